"""Guards at the edges: a step that is not finite, a sweep checked whole, token ids against the vocabulary, the
environment, errors that name what the user wrote, a resume with nothing left to train."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY, Run, clean_env, launch, launch_here

NAN_MODEL = "model._target_=guard_models.NaNGPT"


def _strict(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl read by a strict JSON reader: a bare NaN or Infinity fails."""

    def refuse(name: str) -> None:
        raise ValueError(f"{path} holds {name}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def _nan_run(tmp_path: Path, calls: str, *overrides: str, name: str = "run", rank: int = 1) -> Run:
    env = clean_env(tmp_path) | {"GUARD_NAN_CALLS": calls, "GUARD_NAN_RANK": str(rank)}
    return launch(
        tmp_path,
        *TINY,
        "gpus=2",
        NAN_MODEL,
        "trainer.checkpoint_every=1",
        "trainer.keep_last=0",
        *overrides,
        name=name,
        env=env,
    )


def _state(checkpoint: Path, out: Path) -> dict[str, Any]:
    """A checkpoint's whole state (model and optimizer), read in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def _flat(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _flat(value, f"{prefix}{i}.").items()}
    return {prefix: state}


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    assert a.keys() == b.keys()
    kept = [k for k in a if not k.endswith(".lr.")]  # the schedule's learning rate moves on whatever happened
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in kept)


def test_a_nan_step_stops_the_run_and_the_last_finite_checkpoint_resumes(tmp_path: Path) -> None:
    """DDP, 2 micro-steps per step: rank 1's loss is NaN in step 3's second micro-step. The run ends there in one
    line, nothing of step 3 is saved, and its newest checkpoint (step 2) resumes under FSDP to the end."""
    run = _nan_run(tmp_path, "6", "strategy=ddp", "batch.global_size=8", "batch.micro_size=2", "trainer.max_steps=5")
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("launch: error: ")]
    assert len(errors) == 1, run.stderr
    assert "NonFiniteError: step 3 is not finite: the loss is nan on rank 1 (micro-step 2/2)" in errors[0], errors
    assert "trainer.nonfinite=skip" in errors[0]
    folder = run.run_dir / "checkpoints"
    assert sorted(p.name for p in folder.glob("step_*")) == ["step_00000001", "step_00000002"]
    assert (folder / "latest").read_text().strip().endswith("step_00000002")
    tensors = [v for v in _flat(_state(folder / "step_00000002", tmp_path / "2.pt")).values() if hasattr(v, "isfinite")]
    assert tensors and all(bool(t.isfinite().all()) for t in tensors)  # every weight and moment of it is finite
    assert [m["step"] for m in _strict(run.run_dir / "metrics.jsonl")] == [1, 2]

    resumed = launch(
        tmp_path,
        *TINY,
        "gpus=2",
        "strategy=fsdp",
        "batch.global_size=8",
        "batch.micro_size=2",
        "trainer.max_steps=4",
        f"resume={run.run_dir}",
        name="resumed",
    ).check()
    assert "resuming from" in resumed.stdout and "step_00000002" in resumed.stdout
    records = _strict(resumed.run_dir / "metrics.jsonl")
    assert [m["step"] for m in records] == [3, 4] and all(math.isfinite(m["loss"]) for m in records)

    # Nothing left to train from it: refused in one line naming both, before any worker.
    line = launch_here(tmp_path, *TINY, "trainer.max_steps=2", f"resume={run.run_dir}", name="done").refused()
    assert "step_00000002 is at step 2, and trainer.max_steps=2 leaves nothing to train" in line, line


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_a_skipped_step_changes_nothing_and_too_many_in_a_row_stop(strategy: str, tmp_path: Path) -> None:
    """One micro-step per step: rank 1's loss is NaN in step 2, then in steps 4 and 5. Step 2 is dropped: its
    checkpoint (model and optimizer state, every tensor) equals step 1's, while step 3 moves on; step 4 is dropped
    too, and the second NaN in a row (trainer.max_skipped=2) ends the run."""
    run = _nan_run(
        tmp_path,
        "2,4,5",
        f"strategy={strategy}",
        "batch.global_size=4",
        "batch.micro_size=2",
        "trainer.max_steps=6",
        "trainer.nonfinite=skip",
        "trainer.max_skipped=2",
    )
    assert run.returncode == 1, run.stderr
    assert "launch: skipped step 2: the loss is nan on rank 1 (micro-step 1/1)" in run.stdout, run.stdout
    assert "2 steps in a row were not finite (trainer.max_skipped=2), the last step 5" in run.stderr, run.stderr
    records = _strict(run.run_dir / "metrics.jsonl")
    assert [m["step"] for m in records] == [1, 2, 3, 4]
    assert [m["skipped_steps"] for m in records] == [0, 1, 1, 2]
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None and records[2]["loss"] is not None
    folder = run.run_dir / "checkpoints"
    states = [_flat(_state(folder / f"step_{s:08d}", tmp_path / f"{s}.pt")) for s in (1, 2, 3, 4)]
    assert _equal(states[0], states[1])  # the skipped step 2 left every parameter and moment as step 1 did
    assert not _equal(states[1], states[2])  # step 3 trained
    assert _equal(states[2], states[3])


def test_a_sweep_is_checked_whole_before_its_first_job(tmp_path: Path) -> None:
    """The second job's bad value is found before the first job runs: one line naming that job, exit 2, and no sweep
    folder, no multirun.yaml."""
    import subprocess

    from conftest import LAUNCH

    sweep_dir = tmp_path / "sweep"
    for bad, said in (
        ("optim.lr=1e-3,-1", "(optim.lr=-1): optim.lr=-1.0 is invalid"),
        ("precision=fp32,fp8", "(precision=fp8): "),
    ):
        proc = subprocess.run(
            [LAUNCH, "-m", *TINY, bad, f"hydra.sweep.dir={sweep_dir}"],
            cwd=tmp_path,
            env=clean_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("launch: error: sweep job 2 of 2 ") and said in lines[0], lines[0]
        assert not sweep_dir.exists() and not list(tmp_path.rglob("multirun.yaml"))


def test_token_ids_beyond_the_vocabulary(tmp_path: Path) -> None:
    """A token file is scanned once for its largest id (cached beside it, rescanned when it changes) and refused
    before start; user data's batches are checked in the workers, naming the id, the vocabulary and the step."""
    import os

    import numpy as np

    from launcher.data.builtin import largest_id

    path = tmp_path / "train.bin"
    np.array([*range(200), 300, *range(200)], dtype=np.uint16).tofile(path)
    assert largest_id(path) == 300 and (tmp_path / "train.bin.max-id.json").is_file()
    line = launch_here(
        tmp_path,
        *TINY,
        "data=tokens",
        f"data.path={path}",
        "data.seq_len=16",
        "data.val_fraction=0.5",
        "trainer.eval_every=0",
        "batch.global_size=8",
    ).refused()  # 12 samples: a global batch
    assert f"data.path={path} holds token id 300, but the model's vocabulary has 256 ids" in line, line
    np.array([*range(200), 400, *range(200)], dtype=np.uint16).tofile(path)  # same size: a new time, a new scan
    os.utime(path, ns=(1, 1))
    assert largest_id(path) == 400

    run = launch(
        tmp_path,
        *[o for o in TINY if not o.startswith("data")],
        "data=custom",
        "data._target_=guard_models.WideTokens",
        "model.block_size=32",
        "gpus=2",
        "trainer.max_steps=2",
        name="user",
    )
    assert run.returncode == 1, run.stderr
    assert "token id 300 in a batch of step 1 is outside the model's vocabulary of 256 ids" in run.stderr, run.stderr
    assert "IndexError" not in run.stderr


def test_the_environment_is_named(tmp_path: Path) -> None:
    """wandb online but unreachable (a closed local port: nothing leaves the machine) is one line naming
    WANDB_MODE=offline, before any worker; device=cuda with CUDA_VISIBLE_DEVICES hiding every GPU names it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused
    (tmp_path / "keep").write_text("")  # a refused run removes the empty folders it leaves: not this one
    env = clean_env(tmp_path) | {"WANDB_BASE_URL": f"http://127.0.0.1:{port}"}
    line = launch(tmp_path, *TINY, "logger=wandb", "logger.wandb.mode=online", env=env).refused()
    assert f"http://127.0.0.1:{port} cannot be reached" in line and "WANDB_MODE=offline" in line, line

    env = clean_env(tmp_path) | {"CUDA_VISIBLE_DEVICES": ""}
    line = launch(tmp_path, *TINY, "device=cuda", env=env, name="cuda").refused()
    assert "no CUDA device is visible with CUDA_VISIBLE_DEVICES=''" in line, line


@pytest.mark.unit
def test_a_collective_timeout_is_known_by_its_type_and_wait() -> None:
    """Not by words: a library's error saying "timed out" is not a collective's; torch's own errors are, once the
    rank waited trainer.collective_timeout in its phase."""
    import torch
    import torch.distributed as dist

    from launcher.worker.hangs import collective_timeout as _collective_timeout

    try:
        raise TimeoutError("wandb: Network error: timed out")
    except TimeoutError as e:
        assert not _collective_timeout(e, 700, 600)
    try:
        torch.einsum("ij,jk", torch.zeros(2, 3), torch.zeros(2, 3))  # a RuntimeError raised in torch's code
    except RuntimeError as e:
        assert _collective_timeout(e, 600.5, 600) and not _collective_timeout(e, 30, 600)
    assert _collective_timeout(dist.DistBackendError("watchdog"), 601, 600)
    assert not _collective_timeout(RuntimeError("Timed out waiting 600000ms"), 601, 600)  # raised here, not in torch
