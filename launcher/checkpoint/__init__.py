"""Checkpoints, in one package:

- `format`: what a checkpoint folder holds (the manifest's fields, checksums), what makes it complete, which is
  newest: written once, read by everything below and by `launch convert`;
- `untrusted`: reading DCP's files as data, never code;
- `saving` and `space`: writing a checkpoint (sync or async), and the room it needs, checked first;
- `loading`: into a strategy of any layout, and the launcher's checks of `resume=`;
- `policy`: when a run saves and how many it keeps.

The workers' side of a resume (which checkpoint every rank loads) is `launcher.checkpoint.resume`.
"""
