"""Checkpoints: exact resume, any strategy and world size, restarts, kills during saves, bad checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, Run, assert_each_restart_resumes_the_newest, clean_env, cli_here, launch, launch_here
from processes import wait_for_step, worker_pids
from runs import AT_TWO_RANKS, JOB, PARITY_TOLERANCE, SHAPES, ranks, run_of, selecting, suite_run


def _ckpt(run: Run, step: int) -> Path:
    return run.run_dir / "checkpoints" / f"step_{step:08d}"


def _max_diff(a: Run, b: Run, steps: range) -> float:
    full = {m["step"]: m["loss"] for m in a.metrics}
    resumed = {m["step"]: m["loss"] for m in b.metrics}
    assert sorted(resumed) == list(steps), sorted(resumed)
    return max(abs(full[s] - resumed[s]) for s in steps)


def test_resume_with_data_workers_is_exact(ddp_run: Run, tmp_path: Path) -> None:
    """The loader's processes start reading at the resumed position: the same samples as the uninterrupted run."""
    full = ddp_run
    resumed = launch(tmp_path, *JOB, "gpus=2", "data.workers=2", f"resume={_ckpt(full, 6)}").check()
    assert _max_diff(full, resumed, range(7, 13)) <= 1e-6


# Every way of holding the state: zero1's and zero2_offload's are zero2's and zero3_offload's (ddp -> zero1 is in
# CROSSINGS); hsdp's 4-rank run resumes under fsdp there too.
@pytest.mark.parametrize("strategy", [s for s in AT_TWO_RANKS if s not in ("zero1", "zero2_offload")])
def test_resume_is_exact(strategy: str, suite: Run, tmp_path: Path) -> None:
    full = suite
    resumed = launch(tmp_path, *JOB, *selecting(tmp_path, strategy), "gpus=2", f"resume={_ckpt(full, 6)}").check()
    assert f"resuming from {_ckpt(full, 6)} (step 6, sample 96)" in resumed.stdout
    assert _max_diff(full, resumed, range(7, 13)) <= 1e-6


def test_resume_with_dropout_restores_the_random_state(tmp_path: Path) -> None:
    """Dropout draws from the generator every step: the resumed steps match only if the checkpoint's generator state
    is restored (same world size; at another one each rank's generator starts afresh: documented, not exact)."""
    dropout = [*JOB, "gpus=2", "model.dropout=0.2"]
    full = launch(tmp_path, *dropout, name="dropout").check()
    resumed = launch(tmp_path, *dropout, f"resume={_ckpt(full, 6)}", name="dropout-resumed").check()
    assert _max_diff(full, resumed, range(7, 13)) <= 1e-6


CROSSINGS = [
    ("ddp", 2, "fsdp", 1),
    ("fsdp", 2, "zero3", 2),
    ("zero2", 2, "ddp", 1),
    ("zero_infinity", 2, "ddp", 1),
    pytest.param("ddp", 2, "zero1", 2, marks=pytest.mark.long),  # the long tier: ~12-20 s each, and other crossings
    # (ddp to fsdp, fsdp to zero3, zero2 to ddp, tensor parallel to zero3) reshard the same kinds of state
    ("ddp", 1, "hsdp", 4),  # one process's checkpoint on a 2 x 2 mesh (fsdp on 2 ranks: from hsdp, below)
    pytest.param("ddp", 2, "zero_infinity", 1, marks=pytest.mark.long),
    pytest.param("hsdp", 4, "fsdp", 2, marks=pytest.mark.long),  # a 2 x 2 mesh's checkpoint on a 1-D mesh of 2
    pytest.param("fsdp_tp", 4, "ddp", 1, marks=pytest.mark.long),  # TP 2 x DP 2 (the suite's run) in one process
    # ... on 4 data-parallel ranks, each layer whole: 4 more ranks, the long tier (the two crossings beside it reshard
    # the same DTensors at the usual tier's cost)
    pytest.param("fsdp_tp", 4, "fsdp", 4, marks=pytest.mark.long),
    ("fsdp_tp", 4, "zero3", 2),  # ... under DeepSpeed
]  # torch AdamW <-> DeepSpeed CPU Adam


@pytest.mark.parametrize("src,src_gpus,dst,dst_gpus", CROSSINGS)  # a renamed preset fails here, never vanishes
def test_resume_across_strategies_and_world_sizes(
    src: str, src_gpus: int, dst: str, dst_gpus: int, conformance_dir: Path, tmp_path: Path
) -> None:
    full = suite_run(conformance_dir, src) if src_gpus == ranks(src) else run_of(conformance_dir, src, src_gpus)
    shape = SHAPES[dst][1] if dst in SHAPES and dst_gpus == ranks(dst) else []  # hsdp's 2 x 2 mesh
    resumed = launch(
        tmp_path, *JOB, *selecting(tmp_path, dst), f"gpus={dst_gpus}", *shape, f"resume={_ckpt(full, 6)}"
    ).check()
    # Each follows one process within its own declared tolerance: so within their sum of each other.
    assert _max_diff(full, resumed, range(7, 13)) <= PARITY_TOLERANCE[src] + PARITY_TOLERANCE[dst]


def test_keep_last_and_latest_pointer(tmp_path: Path) -> None:
    run = launch(tmp_path, *JOB, "gpus=2", "trainer.checkpoint_every=3", "trainer.keep_last=2").check()
    checkpoints = run.run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000009", "step_00000012"]
    assert (checkpoints / "latest").read_text() == "step_00000012"
    manifest = json.loads((checkpoints / "step_00000012" / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["samples"] == 12 * 16 and manifest["world_size"] == 2
    assert manifest["strategy"] == "ddp" and manifest["precision"] == "fp32" and len(manifest["config_hash"]) == 16
    assert sorted(p.name for p in (checkpoints / "step_00000012").glob("rng_*.pt")) == ["rng_0.pt", "rng_1.pt"]


def test_resume_auto_continues_the_newest_earlier_run(tmp_path: Path) -> None:
    runs = tmp_path / "outputs"
    runs.mkdir()
    # The newest run is neither the longest nor the last by name: only "newest" picks it.
    launch(runs, *JOB, "gpus=1", "trainer.max_steps=6", name="2026-01-02/b").check()
    time.sleep(0.01)
    newest = launch(runs, *JOB, "gpus=1", "trainer.max_steps=4", name="2026-01-01/a").check()
    resumed = launch(runs, *JOB, "gpus=1", "trainer.max_steps=8", "resume=auto", name="2026-01-03/c").check()
    assert f"resuming from {_ckpt(newest, 4)}" in resumed.stdout, resumed.stdout
    assert [m["step"] for m in resumed.metrics] == [5, 6, 7, 8]


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())).hexdigest()


def test_a_checkpoint_of_another_model_is_refused_before_workers_start(ddp_run: Run, tmp_path: Path) -> None:
    full = ddp_run
    before = _digest(full.run_dir / "checkpoints")
    line = launch_here(tmp_path, *JOB, "gpus=2", "model.n_embd=32", f"resume={_ckpt(full, 6)}").refused()
    assert "does not fit the model: tok_emb.weight is [256, 64] there, [256, 32] here" in line
    assert _digest(full.run_dir / "checkpoints") == before


def test_a_corrupted_checkpoint_is_a_one_line_error(ddp_run: Run, tmp_path: Path) -> None:
    import shutil

    from launcher.checkpoint import format as checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(_ckpt(ddp_run, 6), broken)
    (broken / ".metadata").write_bytes(b"not a checkpoint")  # its size no longer matches the manifest's
    assert ".metadata is truncated" in launch_here(tmp_path, *JOB, "gpus=2", f"resume={broken}").refused()
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"][".metadata"] = len(b"not a checkpoint")  # complete by the manifest, garbage inside
    manifest["xxh3_128"][".metadata"] = checkpoint.checksum(broken / ".metadata")
    (broken / "manifest.json").write_text(json.dumps(manifest))
    garbage = launch_here(tmp_path, *JOB, "gpus=2", f"resume={broken}", name="garbage").refused()
    assert "has unreadable metadata" in garbage
    missing = launch_here(tmp_path, *JOB, "gpus=2", f"resume={tmp_path / 'nowhere'}", name="missing").refused()
    assert "no complete checkpoint there" in missing


def test_convert_writes_weights_the_plain_model_loads(ddp_run: Run, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from launcher.models.gpt import GPT

    out = tmp_path / "model.safetensors"
    proc = cli_here(tmp_path, "convert", str(_ckpt(ddp_run, 12)), f"out={out}")
    assert proc.returncode == 0, proc.stderr
    model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    converted = load_file(str(out))
    model.load_state_dict(converted, strict=True)
    x = torch.randint(0, 256, (2, 32))
    assert torch.isfinite(model(x, x)["loss"])
    # Every tensor as the checkpoint holds it, read by torch's own converter (our own files: its unpickling is safe).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(_ckpt(ddp_run, 12)), str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    assert sorted(converted) == sorted(saved)
    assert all(torch.equal(converted[k], saved[k]) for k in saved), [
        k for k in saved if not torch.equal(converted[k], saved[k])
    ]


def test_a_killed_worker_is_restarted_and_the_run_matches(ddp_run: Run, tmp_path: Path) -> None:
    full = ddp_run
    run_dir = tmp_path / "restarted"
    proc = subprocess.Popen(
        [LAUNCH, *JOB, "gpus=2", "trainer.checkpoint_every=3", "trainer.max_restarts=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(run_dir, 7, proc)  # checkpoints of steps 3 and 6: the restart must take the newer
    os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "restart 1 of the worker group: resuming from" in out, out
    assert_each_restart_resumes_the_newest(run_dir, out, every=3, restarts=1)
    final = {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    reference = {m["step"]: m["loss"] for m in full.metrics}
    assert abs(final[12] - reference[12]) <= 1e-6 and abs(final[10] - reference[10]) <= 1e-6


def _wait_for_a_save(checkpoints: Path, after: float, proc: subprocess.Popen, timeout: float = 180) -> Path:
    """A save in progress, once an earlier one is complete: a `.step_*.partial` folder holding a file written after
    `after` (not a killed pass's leftovers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for partial in checkpoints.glob(".step_*.partial") if any(checkpoints.glob("step_*")) else ():
            try:
                if any(f.stat().st_mtime > after for f in partial.iterdir()):
                    return partial
            except OSError:  # renamed or removed between the glob and the read: the save finished
                continue
        time.sleep(0.002)
    raise AssertionError(f"no save started in {checkpoints}")


def test_kills_during_saves_never_leave_a_broken_latest_checkpoint(tmp_path: Path) -> None:
    """Save every step and kill rank 0 around the moment a save becomes visible: once while its files are being
    written, once the instant its folder is renamed into place. Every visible checkpoint is complete and loads, and
    the next attempt resumes from the newest one."""
    from launcher.parent.convert import weights

    big = [o for o in JOB if not o.startswith(("model.n_embd", "trainer.keep_last"))] + [
        "model.n_embd=256",
        "trainer.keep_last=3",
    ]
    run_dir, checkpoints = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    landed: set[str] = set()
    for _ in range(6):  # until each moment was hit (a save can finish between the look and the kill)
        moment = "writing" if "writing" not in landed else "renamed"
        started = time.time()
        proc = subprocess.Popen(
            [LAUNCH, *big, "gpus=2", "trainer.checkpoint_every=1", f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=clean_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        partial = _wait_for_a_save(checkpoints, started, proc)
        final = checkpoints / partial.name.removeprefix(".").removesuffix(".partial")
        while moment == "renamed" and partial.exists() and proc.poll() is None:
            time.sleep(0.0005)
        os.kill(worker_pids(run_dir)[0], signal.SIGKILL)  # rank 0: the one that renames a save into place
        proc.communicate(timeout=120)
        if (partial.exists() and not final.exists()) if moment == "writing" else final.exists():
            landed.add(moment)
        visible = sorted(checkpoints.glob("step_*"))
        assert visible, sorted(checkpoints.iterdir())
        for checkpoint in visible:
            manifest = json.loads((checkpoint / "manifest.json").read_text())
            assert all((checkpoint / n).stat().st_size == size for n, size in manifest["files"].items()), checkpoint
            tensors = weights(checkpoint)
            assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors.values()), checkpoint
        assert (checkpoints / (checkpoints / "latest").read_text()).exists()
        if landed == {"writing", "renamed"}:
            break
    assert landed == {"writing", "renamed"}, f"kills landed only {landed or 'never'} in a save"
    # The run directory's own newest checkpoint is where the next attempt continues, at its step + 1.
    newest = max(int(p.name.removeprefix("step_")) for p in checkpoints.glob("step_*"))
    logged_before = len((run_dir / "metrics.jsonl").read_text().splitlines())
    done = launch(tmp_path, *big, "gpus=2", name="killed").check()
    assert f"resuming from {checkpoints / f'step_{newest:08d}'}" in done.stdout, done.stdout
    this_attempt = done.metrics[logged_before:]
    assert this_attempt[0]["step"] == newest + 1 and this_attempt[-1]["step"] == 12


def test_a_raising_rank_ends_the_job_with_its_own_error_first(tmp_path: Path) -> None:
    run = launch(tmp_path, *JOB, "gpus=2", "model._target_=faulty.RaisingGPT")  # a hang fails by its timeout
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    # The rank that raised, where it was, its traceback in its own log file; rank 0's echo of it (gloo's "Connection
    # closed by peer") is no failure of its own, and not printed. Its third forward: the evaluation's check of the
    # first validation batch before step 1 is its first.
    assert lines[0].startswith(
        "launch: error: rank 1 failed while in forward/backward of step 1, micro-step 2/2: "
        "RuntimeError: rank 1 broke on purpose (traceback: "
    ), run.stderr
    assert len(lines) == 1 and "closed by peer" not in run.stderr.lower(), run.stderr
    assert "Traceback (most recent call last)" not in run.stderr + run.stdout
    log = Path(lines[0].split("(traceback: ")[1].rstrip(")"))
    assert log == run.run_dir / "logs" / "rank1.traceback" and "in forward" in log.read_text()
    assert worker_pids(run.run_dir) == {}


class _Payload:
    """A pickle that runs a command when loaded: what a crafted checkpoint would hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.unit
def test_loading_runs_no_code_from_the_checkpoint(tmp_path: Path) -> None:
    """Non-tensor entries (hyperparameters) are read with weights_only=True: plain values load, a crafted pickle
    is refused."""
    import torch.distributed.checkpoint as dcp

    from launcher.checkpoint.format import CheckpointError
    from launcher.checkpoint.loading import check_fits, read_into
    from launcher.models.gpt import GPT

    marker = tmp_path / "ran"
    plain = {
        "model": {"w": torch.arange(4.0)},
        "optim": {"param_groups": [{"lr": 0.5, "betas": (0.9, 0.95), "params": ["w"]}]},
    }
    dcp.save(plain, checkpoint_id=str(tmp_path / "plain"), no_dist=True)
    state = {
        "model": {"w": torch.zeros(4)},
        "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "maximize": False, "params": ["w"]}]},
    }
    read_into(state, tmp_path / "plain")
    assert state["model"]["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert state["optim"]["param_groups"][0] == {"lr": 0.5, "betas": (0.9, 0.95), "maximize": False, "params": ["w"]}

    crafted = tmp_path / "crafted"
    dcp.save({"optim": {"param_groups": [{"lr": _Payload(marker)}]}}, checkpoint_id=str(crafted), no_dist=True)
    with pytest.raises(
        CheckpointError, match=r"holds an entry that is not plain data \(.*posix.system.*\); resume only from"
    ):
        check_fits(
            crafted, GPT(n_layer=1, n_head=2, n_embd=32, vocab_size=256, block_size=32)
        )  # the launcher, before any worker
    with pytest.raises(BaseException, match="Weights only load failed"):  # DCP raises a BaseException
        read_into({"optim": {"param_groups": [{"lr": 0.0}]}}, crafted)  # and the workers
    assert not marker.exists()


@pytest.mark.unit
def test_a_checkpoint_of_a_model_laid_out_otherwise_names_what_it_holds_instead(tmp_path: Path) -> None:
    """A GPT checkpoint of a fused attention (blocks.N.attn.qkv, the layout before q, k and v were split for tensor
    parallel) against today's GPT: one line naming the missing tensor and what the checkpoint holds in its place."""
    import torch.distributed.checkpoint as dcp

    from launcher.checkpoint.format import CheckpointError
    from launcher.checkpoint.loading import check_fits
    from launcher.models.gpt import GPT

    model = GPT(n_layer=1, n_head=2, n_embd=32, vocab_size=256, block_size=32)
    state = {k: v for k, v in model.state_dict().items() if ".attn." not in k or ".attn.proj." in k}
    state |= {"blocks.0.attn.qkv.weight": torch.zeros(96, 32), "blocks.0.attn.qkv.bias": torch.zeros(96)}
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "fused"), no_dist=True)
    with pytest.raises(
        CheckpointError,
        match=r"has no tensor blocks.0.attn.q.weight of the model \(it holds "
        r"blocks.0.attn.qkv.bias, blocks.0.attn.qkv.weight there\)",
    ):
        check_fits(tmp_path / "fused", model)


def test_async_checkpoints_match_the_sync_run_and_resume_exactly(ddp_run: Run, tmp_path: Path) -> None:
    """trainer.async_checkpoint=true: the same losses as the suite's synchronous run, a step-6 checkpoint that
    resumes exactly, and a loop that went on while it was written: step 7 was logged before the step-6 checkpoint
    became visible (its manifest's time), with the seconds the save blocked the loop in step 7's metrics."""
    sync = ddp_run
    run = launch(tmp_path, *JOB, "gpus=2", "trainer.async_checkpoint=true", name="async").check()
    assert max(abs(a - b) for a, b in zip(sync.losses(), run.losses(), strict=True)) <= 1e-6
    checkpoints = run.run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_00000006", "step_00000012"]
    assert (checkpoints / "latest").read_text() == "step_00000012"  # the end waited for the last save
    by_step = {m["step"]: m for m in run.metrics}
    visible = json.loads((_ckpt(run, 6) / "manifest.json").read_text())["time"]
    assert by_step[7]["time"] < visible, (by_step[7]["time"], visible)
    assert by_step[7]["checkpoint_stall_s"] > 0 and "checkpoint_stall_s" not in by_step[6]
    assert {m["step"] for m in sync.metrics if "checkpoint_stall_s" in m} == {7}  # the synchronous save's, too
    sync_visible = json.loads((_ckpt(sync, 6) / "manifest.json").read_text())["time"]
    assert sync_visible < {m["step"]: m for m in sync.metrics}[7]["time"]
    resumed = launch(
        tmp_path, *JOB, "gpus=2", "trainer.async_checkpoint=true", f"resume={_ckpt(run, 6)}", name="async-resumed"
    ).check()
    assert f"resuming from {_ckpt(run, 6)} (step 6, sample 96)" in resumed.stdout
    assert _max_diff(sync, resumed, range(7, 13)) <= 1e-6
    assert (resumed.run_dir / "checkpoints" / "latest").read_text() == "step_00000012"


ASYNC_PROBE = """
import sys, time, torch, torch.distributed as dist
from pathlib import Path
from launcher.checkpoint import format as checkpoint
from launcher.checkpoint import saving
root = Path(sys.argv[1])
dist.init_process_group("gloo", init_method=f"file://{root / 'pg'}", rank=0, world_size=1)
w = torch.zeros(4_000_000)
class Tiny:
    def state_dict(self):
        return {"model": {"w": w}, "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]}}
ck = root / "ckpt"
saver = saving.Saver(ck, 0, 1, 0, asynchronous=True)
run = {"world_size": 1, "config_hash": "0" * 16}
def seen():
    return sorted(p.name for p in ck.iterdir()), (ck / "latest").read_text() if (ck / "latest").exists() else None
saver.save(checkpoint.Position(1, 8), Tiny(), run)
print("SAVED 1", saver.pending is not None, seen(), flush=True)
saver.finish()
print("FINISHED 1", seen(), flush=True)
w.fill_(1.0)
saver.save(checkpoint.Position(2, 16), Tiny(), run)
w.fill_(7.0)  # training goes on: the staged copy is what gets written
print("SAVED 2", seen(), flush=True)
while saver.writing():
    time.sleep(0.001)
print("WRITTEN 2", seen(), flush=True)
saver.finalise()
print("VISIBLE 2", seen(), flush=True)
saver.save(checkpoint.Position(3, 24), Tiny(), run)
print("WRITING 3", flush=True)
time.sleep(120)
"""


def test_an_async_save_is_visible_only_once_written_and_a_kill_keeps_the_one_before(tmp_path: Path) -> None:
    """Real DCP on a one-rank gloo group: a background save stays a .partial folder, without a manifest, with the
    `latest` pointer unmoved, until it is finalised after its write; the state written is the one staged, not the
    one training changed meanwhile; a SIGKILL while a save is in flight leaves the previous checkpoint as `latest`,
    and the start of the next attempt removes the partial folder."""
    from launcher.checkpoint import format as checkpoint
    from launcher.parent.convert import weights

    proc = subprocess.Popen(
        [sys.executable, "-c", ASYNC_PROBE, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])),
        },
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith("WRITING 3"):
            proc.kill()  # SIGKILL, with the step-3 save in flight (or written, never finalised)
            break
    proc.communicate(timeout=60)
    out = "\n".join(lines)
    assert lines[-1] == "WRITING 3", (out, proc.stderr)
    said = {" ".join(line.split()[:2]): line for line in lines}
    assert said["SAVED 1"] == "SAVED 1 True (['.step_00000001.partial'], None)", out
    assert "(['latest', 'step_00000001'], 'step_00000001')" in said["FINISHED 1"], out
    for moment in ("SAVED 2", "WRITTEN 2"):  # written or not, invisible until finalised
        assert "['.step_00000002.partial', 'latest', 'step_00000001'], 'step_00000001')" in said[moment], out
    assert "step_00000002'], 'step_00000002')" in said["VISIBLE 2"], out
    ck = tmp_path / "ckpt"
    assert (ck / ".step_00000003.partial").is_dir() and not (ck / "step_00000003").exists()
    assert checkpoint.latest(ck) == ck / "step_00000002" and (ck / "latest").read_text() == "step_00000002"
    assert torch.equal(weights(ck / "step_00000002")["w"], torch.ones(4_000_000))
    checkpoint.remove_partial(ck)  # what a resumed run does first
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000001", "step_00000002"]


@pytest.mark.unit
def test_the_newest_checkpoint_is_the_last_saved_whatever_its_step_or_the_pointer(tmp_path: Path) -> None:
    """Resume order: by the time each manifest records. A kill between a save's rename and the `latest` pointer's
    move leaves the pointer one behind the newest complete checkpoint; a run resumed from further back saves steps
    older than ones still there, and those are the newer."""
    from launcher.checkpoint import format as checkpoint
    from launcher.checkpoint.format import complete, latest

    def saved(name: str, step: int, at: float) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "rng_0.pt").write_bytes(b"x" * 7)
        record = {"step": step, "samples": 16 * step, "world_size": 1, "time": at, "config_hash": "0" * 16}
        sums = {"rng_0.pt": checkpoint.checksum(folder / "rng_0.pt")}
        (folder / "manifest.json").write_text(json.dumps({**record, "files": {"rng_0.pt": 7}, "xxh3_128": sums}))
        return folder

    first, second = saved("step_00000001", 1, 100.0), saved("step_00000002", 2, 200.0)
    (tmp_path / "latest").write_text("step_00000001")  # the kill landed before the pointer moved
    assert complete(tmp_path) == [second, first] and latest(tmp_path) == second
    stale, again = saved("step_00000012", 12, 150.0), saved("step_00000007", 7, 300.0)
    assert complete(tmp_path) == [again, second, stale, first]
