"""Trust the files, the folders and the network: checkpoints are data, a run owns its directory, resume=auto
resumes only its own run, saves are durable and checked, one node stays on loopback.

Crafted files hold a pickle that would create a marker file when loaded; every test asserts the marker never
appears and the refusal is one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, Run, clean_env, cli_here, launch, launch_here
from runs import JOB

from launcher.checkpoint.untrusted import UntrustedDataError


class _Payload:
    """Runs a shell command when unpickled: what an attacker's checkpoint would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _ckpt(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step_{step:08d}"


def _restamp(folder: Path) -> None:
    """Make the manifest list the folder's files at their sizes and checksums again, as an attacker who edits a
    checkpoint would."""
    from launcher.checkpoint.format import checksum

    manifest = json.loads((folder / "manifest.json").read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name != "manifest.json")
    manifest["files"] = {name: (folder / name).stat().st_size for name in names}
    manifest["xxh3_128"] = {name: checksum(folder / name) for name in names}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def _convert(tmp_path: Path, checkpoint: Path) -> subprocess.CompletedProcess[str]:
    out = tmp_path / "out.safetensors"
    return cli_here(tmp_path, "convert", str(checkpoint), f"out={out}")


def _one_line(proc_or_run: subprocess.CompletedProcess[str] | Run) -> str:
    lines = proc_or_run.stderr.strip().splitlines()
    assert proc_or_run.returncode == 2 and len(lines) == 1 and lines[0].startswith("launch: error: "), proc_or_run
    return lines[0]


def test_a_crafted_metadata_never_runs_on_resume_convert_or_load(tmp_path: Path, ddp_run: Run) -> None:
    from launcher.checkpoint.loading import read_into

    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted"
    shutil.copytree(_ckpt(ddp_run, 6), crafted)
    (crafted / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _restamp(crafted)  # a complete-looking checkpoint: only its metadata is hostile
    line = launch_here(tmp_path, *JOB, "gpus=2", f"resume={crafted}").refused()  # the launcher, before any worker
    assert "unreadable metadata (UnpicklingError: posix.system is not allowed in checkpoint metadata)" in line, line
    assert "is not allowed in checkpoint metadata" in _one_line(_convert(tmp_path, crafted))
    with pytest.raises(UntrustedDataError, match="posix.system is not allowed"):
        read_into({"model": {}}, crafted)  # what every worker calls on load
    assert not marker.exists()


def test_a_crafted_entry_never_runs_on_resume_or_convert(tmp_path: Path, ddp_run: Run) -> None:
    """A hyperparameter entry that is a pickle (resume), a tensor file that is a pickle (convert)."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    source = _ckpt(ddp_run, 6)
    crafted = tmp_path / "entry"
    shutil.copytree(source, crafted)
    model = {
        name: torch.zeros(tuple(md.size)) for name, md in _tensor_entries(source).items() if name.startswith("model.")
    }
    state = {
        "model": {k.removeprefix("model."): v for k, v in model.items()},
        "optim": {"param_groups": [{"lr": _Payload(marker), "params": []}]},
    }
    for stale in crafted.glob("__*.distcp"):
        stale.unlink()
    dcp.save(state, checkpoint_id=str(crafted), no_dist=True)
    _restamp(crafted)
    line = launch_here(tmp_path, *JOB, "gpus=2", f"resume={crafted}").refused()
    assert "holds an entry that is not plain data" in line, line

    # A tensor's bytes replaced by a pickle: DCP reads tensors weights-only, and convert says so in one line.
    forged = tmp_path / "forged"
    shutil.copytree(source, forged)
    for shard in forged.glob("__*.distcp"):
        shard.write_bytes(pickle.dumps(_Payload(marker)).ljust(shard.stat().st_size, b"\0"))
    assert "__0_0.distcp fails its checksum" in _one_line(_convert(tmp_path, forged))  # refused before it is read
    _restamp(forged)
    assert "does not load as data" in _one_line(_convert(tmp_path, forged))
    assert not marker.exists()


def _tensor_entries(checkpoint: Path) -> dict:
    from launcher.checkpoint.untrusted import read_metadata

    return {k: v for k, v in read_metadata(checkpoint).state_dict_metadata.items() if hasattr(v, "size")}


SWEEP = [*JOB, "gpus=1", "batch.global_size=8", "trainer.checkpoint_every=0", "optim.lr=1e-3,3e-3", "resume=auto"]


@pytest.mark.long  # ~20 s: a sweep's jobs each run on their own (test_ddp's multirun); resume=auto's choice is
# test_checkpoint's
def test_resume_auto_in_a_sweep_resumes_only_each_jobs_own_run(tmp_path: Path) -> None:
    days = tmp_path / "multirun" / "2026-12-01"
    first = launch(tmp_path, "-m", *SWEEP, "trainer.max_steps=2", f"hydra.sweep.dir={days / '10-00-00'}")
    assert first.returncode == 0, first.stderr
    # The bug this replaces: job 1 (another lr) resumed job 0's final checkpoint and trained nothing.
    assert "resuming from" not in first.stdout, first.stdout
    for job in (0, 1):
        assert [m["step"] for m in map(json.loads, (days / "10-00-00" / str(job) / "metrics.jsonl").open())] == [1, 2]
    # Someone else's folder with a broken manifest, next to them: skipped with a note, not a traceback.
    broken = days / "09-00-00" / "0" / "checkpoints" / "step_00000009"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{")
    second = launch(tmp_path, "-m", *SWEEP, "trainer.max_steps=3", f"hydra.sweep.dir={days / '11-00-00'}")
    assert second.returncode == 0, second.stderr
    assert f"launch: skipping checkpoint {broken}: " in second.stdout, second.stdout
    for job in (0, 1):
        resumed = days / "11-00-00" / str(job)
        own = days / "10-00-00" / str(job) / "checkpoints" / "step_00000002"
        assert f"resuming from {own} (step 2" in second.stdout, second.stdout
        assert [m["step"] for m in map(json.loads, (resumed / "metrics.jsonl").open())] == [3]


def test_a_directory_of_another_run_is_refused_and_left_as_it_was(tmp_path: Path, ddp_run: Run) -> None:
    owner = ddp_run
    before = _digest(owner.run_dir)
    other = subprocess.run(
        [LAUNCH, *JOB, "gpus=2", "optim.lr=0.5", f"hydra.run.dir={owner.run_dir}"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
    )
    line = _one_line(other)
    assert f"hydra.run.dir={owner.run_dir} belongs to another run (config hash" in line, line
    assert _digest(owner.run_dir) == before


def test_default_run_directories_of_one_second_differ(tmp_path: Path) -> None:
    dirs = set()
    for _ in range(2):
        proc = subprocess.run([LAUNCH, "--cfg", "hydra", "--resolve"], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        dirs.add(next(line for line in proc.stdout.splitlines() if line.strip().startswith("dir: outputs/")))
    assert len(dirs) == 2, dirs


class _ByGetattr:
    """Pickles as `getattr(owner, name)`: how Python 3.11.2 pickles an enum member, and how a crafted file reaches a
    class's methods."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        return getattr, (self.owner, self.name)


@pytest.mark.unit
def test_metadata_may_name_an_enum_member_by_getattr_and_nothing_else() -> None:
    """DCP's metadata holds `_MEM_FORMAT_ENCODING` members; some Python releases pickle them as getattr(enum, name).
    Those load; a getattr that reaches anything but an allowed enum's member (a path's `unlink`) is refused."""
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from launcher.checkpoint.untrusted import _MetadataUnpickler

    def load(obj: object) -> object:
        return _MetadataUnpickler(io.BytesIO(pickle.dumps(obj, protocol=4))).load()

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    assert load([_ByGetattr(_MEM_FORMAT_ENCODING, member.name)]) == [member]
    for owner, name in ((pathlib.PosixPath, "unlink"), (_MEM_FORMAT_ENCODING, "__class__")):
        with pytest.raises(pickle.UnpicklingError, match="only an enum member by name"):
            load(_ByGetattr(owner, name))
