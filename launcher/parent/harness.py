"""`launch eval CHECKPOINT harness.tasks=[...]` after its workers end: the evaluated checkpoint exported as
`launch convert` writes a folder (`<run dir>/transformers`), lm-eval run on it (`launcher.export.harness`), its table
printed and its figures added to eval.json beside the launcher's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from launcher.base.errors import ConfigError
from launcher.export.harness import evaluate, figures, requested, version

FOLDER = "transformers"
"""The exported folder's name in the evaluation's run directory."""


def run_harness(cfg: Any, run_dir: Path, device: str) -> str:
    """Export the evaluated checkpoint (its EMA weights with ema=true) to `<run_dir>/transformers`, run the harness's
    tasks on it, print lm-eval's table and add its figures to `<run_dir>/eval.json`; returns "" when done, else why
    not in one line."""
    import yaml

    from launcher.base.storage import location
    from launcher.checkpoint.format import CheckpointError, find_checkpoint
    from launcher.models.meta import build_on_meta
    from launcher.parent.convert import weights, write_folder

    try:
        run = yaml.safe_load((run_dir / "resolved.yaml").read_text())  # this evaluation's, as data
        checkpoint = find_checkpoint(location(str(cfg.resume)))
        tensors = weights(checkpoint, bool(cfg.trainer.eval_ema), build_on_meta(cfg.model))
        folder = run_dir / FOLDER
        said = write_folder(tensors, folder, cfg.model, checkpoint, run=run)
    except (CheckpointError, ConfigError, OSError) as e:
        return f"harness: the checkpoint was not exported ({str(e).splitlines()[0]})"
    if not (folder / "config.json").exists():  # write_folder said why not, in its line
        return f"harness: {said}"
    print(f"launch: harness: wrote {said}", flush=True)
    try:
        results = evaluate(folder, requested(cfg), cfg.harness, device)
    except Exception as e:  # lm-eval's own complaint at run time (a dataset not found offline, ...), in one line
        return f"harness: lm-eval {version()} failed ({type(e).__name__}: {' '.join(str(e).split())[:300]})"
    from lm_eval.utils import make_table

    print(make_table(results), flush=True)
    path = run_dir / "eval.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    record["harness"] = {"lm_eval": version(), "folder": str(folder), "tasks": figures(results)}
    from launcher.base.durable import write_durably

    write_durably(path, json.dumps(record, indent=2))
    print(f"launch: harness: {', '.join(record['harness']['tasks'])} added to {path}", flush=True)
    return ""
