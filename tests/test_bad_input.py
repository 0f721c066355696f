"""Bad input never reaches a worker as a traceback.

A table of inputs that are wrong as values (the schema's ranges, the batch contract) or only once an object is
built (the optimizer, the datasets, the model's forward, the logger's settings, the run directory, a checkpoint,
a strategy's options): each is one line on stderr naming the key or value, exit 2, before any worker starts, and
nothing written. Then what a worker that fails anyway prints, and a worker killed for memory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import LAUNCH, TINY, clean_env, launch, launch_here, unavailable

CUSTOM_CLASSIFIER = [
    "model=custom",
    "model._target_=user_models.Classifier",
    "data=custom",
    "data._target_=user_models.images",
]

BAD = {
    # composition: the schema knows every key, type and choice
    "unknown strategy": (["strategy=nope"], "unknown strategy 'nope'; valid: auto, ddp"),
    "unknown model": (["model=gpt_huge"], "unknown model 'gpt_huge'; valid: custom, gpt_124m"),
    "unknown data": (["data=imagenet"], "unknown data 'imagenet'; valid: custom, hf, mix, pysource"),
    "unknown key": (["trainer.max_stpes=5"], "unknown key 'trainer.max_stpes'"),
    "unknown top-level key": (["gpu=2"], "unknown key 'gpu'"),
    "harness tasks in a training run": (
        ["harness.tasks=[hellaswag]"],
        "harness.tasks=hellaswag is run by `launch eval CHECKPOINT harness.tasks=[...]` on a checkpoint, not by a "
        "training run: leave it out here",
    ),
    "a misspelt key added": (
        ["+trainer.checkpoint_evry=100"],
        "unknown key trainer.checkpoint_evry=100: no schema or "
        "target of the launcher takes it; did you mean trainer.checkpoint_every?",
    ),
    "a key added that nothing takes": (["+foo=1"], "unknown key foo=1: no schema or target of the launcher takes it"),
    "a key added that the data does not take": (
        ["+data.seq_lenn=32"],
        "does not take data.seq_lenn (it takes: format, num_samples, seq_len, vocab_size); did you mean data.seq_len?",
    ),
    "wrong type": (
        ["batch.global_size=lots"],
        "Value 'lots' of type 'str' could not be converted to Integer; full_key: batch.global_size",
    ),
    "bad enum": (["device=tpu"], "Invalid value 'tpu', expected one of [auto, cpu, cuda]; full_key: device"),
    "custom model without a target": (["model=custom"], "model._target_ has no value"),
    "a size taken from a data without it": (
        ["data=custom", "data._target_=launcher.data.builtin.Synthetic"],
        "model.block_size: Interpolation key 'data.seq_len' not found; set model.block_size=... yourself",
    ),
    # ranges, declared once in the schema
    "zero global batch": (["batch.global_size=0"], "batch.global_size=0 is invalid: it must be a positive integer"),
    "negative micro batch": (["batch.micro_size=-4"], "batch.micro_size=-4 is invalid: it must be a positive integer"),
    "zero steps": (["trainer.max_steps=0"], "trainer.max_steps=0 is invalid: it must be a positive integer"),
    "negative checkpoint interval": (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every=-1 is invalid"),
    "negative keep_last": (["trainer.keep_last=-3"], "trainer.keep_last=-3 is invalid"),
    "negative learning rate": (["optim.lr=-1"], "optim.lr=-1.0 is invalid: it must be >= 0"),
    "dropout of one": (["model.dropout=1.0"], "model.dropout=1.0 is invalid: it must be a fraction in [0, 1)"),
    "zero gpus": (["gpus=0"], "gpus=0 is invalid: it must be a positive integer"),
    "unknown plan format": (
        ["plan.format=xml"],
        "Invalid value 'xml', expected one of [table, json]; full_key: plan.format",
    ),
    "port out of range": (["rdzv.port=70000"], "rdzv.port=70000 is invalid: it must be a port in [1, 65535]"),
    "no ZeRO stage 4": (["strategy=zero2", "strategy.stage=4"], "strategy.stage=4 is invalid: it must be a ZeRO stage"),
    # the batch contract and the machine
    "not divisible": (["batch.global_size=30", "batch.micro_size=4", "gpus=2"], "use batch.global_size=24 or 32"),
    "cuda without cuda": (["device=cuda"], "device=cuda but no CUDA device"),
    "micro batch neither a size nor auto": (
        ["batch.micro_size=most"],
        "batch.micro_size=most is invalid: it must be a positive integer, or auto",
    ),
    "fractional micro batch": (
        ["batch.micro_size=2.5"],
        "batch.micro_size=2.5 is invalid: it must be a positive integer, or auto",
    ),
    "nodes neither a count nor a range": (
        ["nodes=two"],
        "nodes=two is invalid: it must be a positive integer, or MIN:MAX (an elastic job)",
    ),
    "an empty node range": (["nodes=3:2"], "nodes=3:2 is not a range MIN:MAX with 1 <= MIN <= MAX"),
    "elastic sizes the batch does not divide over": (
        ["nodes=1:3", "batch.global_size=32", "batch.micro_size=4", "gpus=2", "trainer.max_restarts=3"],
        "nodes=1:3 may run at world sizes 2, 4, 6, but batch.global_size=32 does not divide over batch.micro_size=4 "
        "x world size 6; batch.global_size=48 divides over all of them",
    ),
    "elastic sizes only a smaller micro batch divides over": (
        ["nodes=1:2", "batch.global_size=8", "batch.micro_size=4", "gpus=2", "trainer.max_restarts=3"],
        "batch.global_size=8 does not divide over batch.micro_size=4 x world size 4; batch.micro_size=2 works at all",
    ),
    "elastic without restarts": (
        ["nodes=1:2", "rdzv.endpoint=127.0.0.1:29999", "rdzv.id=x"],
        "nodes=1:2 lets nodes leave and join, but trainer.max_restarts=0 ends the job",
    ),
    # the data, built in the launcher
    "missing token file": (["data=tokens", "data.path=/nonexistent/train.bin"], "data.path=/nonexistent/train.bin"),
    "token file not given": (["data=tokens"], "data.path has no value"),
    "token file of odd bytes": (["data=tokens", "data.path={odd}"], "not a whole number of uint16 tokens"),
    "token file too short": (
        ["data=tokens", "data.path={short}", "data.seq_len=64"],
        "cannot make one sample of data.seq_len=64",
    ),
    "token file too short, named": (
        ["data=tokens", "data.path={short}", "data.seq_len=64"],
        "short.bin: its train split holds 40 tokens",
    ),
    "seq longer than model": (
        ["data.seq_len=64", "model.block_size=32"],
        "data: data.seq_len=64 exceeds the model's 32 positions (model.block_size)",
    ),
    "empty validation split": (["data=pysource", "data.val_fraction=0", "trainer.eval_every=5"], "data: 0 tokens"),
    # the model, built on the meta device, and one forward of a real sample through it
    "heads do not divide width": (["model.n_head=5"], "is not divisible by model.n_head=5"),
    "model target not importable": (["model._target_=nowhere.Model"], "cannot be imported"),
    "keys a model does not take": (["model._target_=user_models.Classifier"], "does not take model.block_size"),
    # what the model's target builds, before anything that reads it as a module or groups its parameters
    "a model target that builds no module": (
        ["model._target_=builtins.dict"],
        "model builtins.dict builds a dict "
        "with keys n_layer, n_head, n_embd, vocab_size, block_size, dropout, not "
        "a torch.nn.Module; point model._target_ at a model class, or at a "
        "function that returns the model",
    ),
    "a model builder that returns nothing": (
        ["model._target_=user_models.forgotten_return"],
        "model user_models.forgotten_return builds nothing (it returned None), not a torch.nn.Module",
    ),
    "a model with every parameter frozen": (
        ["model._target_=user_models.frozen_gpt"],
        "model: no parameter of "
        "user_models.frozen_gpt requires a gradient (its 36 parameter tensors are "
        "all frozen, requires_grad=False): there is nothing to train; unfreeze "
        "the ones to train",
    ),
    "a forward that returns nothing": (
        ["model._target_=user_models.SaysNothing"],
        "model: the model's forward returned a NoneType; return the scalar loss",
    ),
    "forward does not fit the data": (
        [*CUSTOM_CLASSIFIER, "+model.channels=5"],
        "model: Invalid channel dimensions (RuntimeError); make the model's forward take "
        "the data's batch and return the loss",
    ),
    # the optimizer, built over the model's meta parameters: torch checks its own hyperparameters
    "betas out of range": (["optim.betas=[1.5,0.9]"], "optim: Invalid beta parameter at index 0: 1.5"),
    "betas of one value": (["+optim.betas=[0.9]"], "fix optim.betas=[0.9]"),
    "nesterov without momentum": (["optim=sgd", "optim.momentum=0", "+optim.nesterov=true"], "optim: Nesterov"),
    # the logger's settings, checked without starting a run
    "unknown wandb mode": (["logger=wandb", "logger.wandb.mode=sometimes"], "logger: logger.wandb.mode=sometimes"),
    "bad wandb project": (["logger=wandb", "logger.wandb.project=a/b"], "logger: logger.wandb.project='a/b'"),
    # looking inside a run
    "profile steps backwards": (["trainer.profile_steps=[4,2]"], "trainer.profile_steps=[4, 2]"),
    "profile past the end": (["trainer.max_steps=5", "trainer.profile_steps=[3,9]"], "trainer.max_steps=5"),
    "snapshot step without snapshots": (["trainer.memory_snapshot_step=3"], "trainer.memory_snapshot=true"),
    # a search's objective, read by every trial's run
    "unknown objective place": (
        ["sweep.objective_at=first"],
        "Invalid value 'first', expected one of [last, best]; full_key: sweep.objective_at",
    ),
    # the run directory: Hydra would make it first, with a traceback
    # a checkpoint to resume from
    "no checkpoint there": (["resume={tmp}/nowhere"], "no complete checkpoint there"),
    # strategy options
    "option a strategy does not take": (["+strategy.overlap=true"], "does not take strategy.overlap"),
    "fp16 reduction without fp16": (["strategy=fsdp", "strategy.reduce_dtype=fp16"], "strategy.reduce_dtype=fp16"),
    "hsdp shard size not dividing the world": (
        ["strategy=hsdp", "gpus=2", "strategy.shard_size=3"],
        "strategy.shard_size=3 does not divide the world size 2",
    ),
    "hsdp mesh larger than the world": (
        ["strategy=hsdp", "gpus=2", "strategy.shard_size=2", "strategy.replicate_size=2"],
        "strategy.replicate_size=2 x strategy.shard_size=2 is 4 ranks, not the world size 2",
    ),
    "zero shard size": (["strategy=hsdp", "strategy.shard_size=0"], "strategy.shard_size=0 is invalid"),
    "ds_config contradicting the batch": (
        ["strategy=zero1", "+strategy.ds_config.train_batch_size=3"],
        "strategy.ds_config.train_batch_size=3 conflicts",
    ),
    "unknown gradient compression": (
        ["strategy.grad_compression=int8"],
        "Invalid value 'int8', expected one of [none, bf16, fp16]",
    ),
    # tensor parallel (strategies.tensor_parallel, strategies.tp_plans)
    "tp size not dividing the world": (
        ["strategy=fsdp_tp", "gpus=3"],
        "strategy.tp_size=2 does not divide the world size 3 (nodes x gpus); use one of 1, 3",
    ),
    "tp size not dividing the heads": (
        ["strategy=fsdp_tp", "gpus=4", "model.n_head=1"],
        "strategy.tp_size=2 does not divide model.n_head=1",
    ),
    "tp with ddp": (
        ["strategy=ddp", "strategy.tp_size=2"],
        "unknown key 'strategy.tp_size' for this strategy; tensor "
        "parallel runs under FSDP2 alone (DDP and DeepSpeed keep every layer whole): use strategy=fsdp_tp",
    ),
    "tp with deepspeed": (["strategy=zero3", "+strategy.tp_size=2"], "does not take strategy.tp_size (it takes: "),
    "tp plan naming no module": (
        ["strategy=fsdp_tp", "gpus=2", "strategy.tp_plan={{layers.*.fc: colwise}}"],
        "strategy.tp_plan names no module of GPT to split (patterns layers.*.fc)",
    ),
    "tp plan style unknown": (
        ["strategy=fsdp_tp", "gpus=2", "strategy.tp_plan={{blocks.*.mlp.0: fancy}}"],
        "style 'fancy' of 'blocks.*.mlp.0' is not one this launcher runs",
    ),
    "tp plan on a norm": (
        ["strategy=fsdp_tp", "gpus=2", "strategy.tp_plan={{blocks.*.ln1: colwise}}"],
        "blocks.0.ln1 is a LayerNorm, but style 'colwise' splits only Linear, Embedding",
    ),
    "tp plan not a mapping": (
        ["strategy=fsdp_tp", "gpus=2", "strategy.tp_plan=[a,b]"],
        "strategy.tp_plan=['a', 'b'] is not a mapping of module-name patterns to styles",
    ),
    "a strategy written to an older protocol": (
        ["strategy._target_=user_models.OldStrategy"],
        "strategy user_models.OldStrategy lacks collectives(), requirements(), "
        "conformance(), averaged() of the Strategy protocol",
    ),
}


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    odd, short = tmp_path / "odd.bin", tmp_path / "short.bin"
    odd.write_bytes(b"\x01\x02\x03")  # three bytes: not a whole number of 2-byte tokens
    np.arange(40, dtype=np.uint16).tofile(short)  # 40 tokens, less than one sample of 64 + 1
    return {"odd": str(odd), "short": str(short), "tmp": str(tmp_path)}


@pytest.mark.unit
def test_the_table_covers_every_group_and_built_object() -> None:
    """Every config group (a folder of conf/) and every top-level section of the schema has a bad value in the table,
    set by an override of its own; and so does a resume."""
    from importlib import resources

    from launcher.config.schema import LaunchConfig

    groups = {p.name for p in resources.files("launcher.conf").iterdir() if p.is_dir() and p.name[0] != "_"} - {"sweep"}
    sections = {name for name, value in vars(LaunchConfig()).items() if hasattr(value, "__dataclass_fields__")}
    set_by = {o.lstrip("+~").split("=")[0].split(".")[0] for overrides, _ in BAD.values() for o in overrides}
    assert groups and sections and not (groups | sections | {"resume"}) - set_by, (groups | sections) - set_by
    assert len(BAD) >= 30


NOT_GPT = [o for o in TINY if not o.startswith(("model", "data"))]  # TINY without the built-in GPT's and data's keys
NOT_DATA = [o for o in TINY if not o.startswith("data")]  # TINY without its data's keys


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_before_any_worker(case: str, tmp_path: Path, files: dict[str, str]) -> None:
    overrides, expected = BAD[case]
    if "cuda" in case:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    base = NOT_GPT if "model=custom" in overrides else NOT_DATA if "data=custom" in overrides else TINY
    run = launch_here(tmp_path, *base, *(o.format(**files) for o in overrides))
    line = run.refused()  # one line, exit 2, nothing written (not even the run directory)
    assert expected in line, line
    assert "Traceback" not in run.stdout + run.stderr


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    """Hydra makes the run directory before the run starts (with a traceback when it cannot): checked first."""
    proc = subprocess.run(
        [LAUNCH, *TINY, "hydra.run.dir=/proc/launch/run"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("launch: error: hydra.run.dir=/proc/launch/run cannot be created and written")


@pytest.mark.unit
def test_the_nodes_of_one_job_probing_one_new_run_directory_at_once_all_find_it_writable(tmp_path: Path) -> None:
    """Each node's launcher makes the shared run directory, writes a probe in it and removes what it made, at the
    same moment as the others: a folder made, or removed, by another node meanwhile is no refusal (a 16-node elastic
    job on loopback was once refused with "File exists"). 16 probes at once, 30 times, none refused."""
    from omegaconf import OmegaConf

    from launcher.parent.overrides import _run_dir_problem

    said: list[str | None] = []
    for attempt in range(30):
        node = OmegaConf.create({"run": {"dir": str(tmp_path / str(attempt) / "shared" / "run")}})
        start = threading.Barrier(16)

        def probe(node=node, start=start) -> None:  # type: ignore[no-untyped-def]
            start.wait()
            said.append(_run_dir_problem(node, [], []))

        nodes = [threading.Thread(target=probe) for _ in range(16)]
        for t in nodes:
            t.start()
        for t in nodes:
            t.join()
    assert said == [None] * 480, [s for s in said if s][:3]
    assert not [f for f in tmp_path.rglob("*") if not f.is_dir()]  # no probe left behind


def test_a_worker_killed_for_memory_is_named(tmp_path: Path) -> None:
    """A real out-of-memory kill: the launcher runs in a memory cgroup of its own with a limit, and one rank's
    model hoards memory until the kernel kills it."""
    cgroup = _memory_cgroup(tmp_path, limit=2 * 2**30)
    run_dir = tmp_path / "run"

    def enter() -> None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    proc = subprocess.run(
        [LAUNCH, *TINY, "gpus=2", "trainer.max_steps=5", "model._target_=faulty.HungryGPT", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        preexec_fn=enter,
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        cgroup.rmdir()
    except OSError:
        pass
    assert proc.returncode == 1, proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("launch: error: rank 1 was killed by the out-of-memory killer: the plan's peak per rank is")
    assert "this machine had" in first and "strategies whose plan fits" in first, first


def test_a_worker_killed_otherwise_is_not_blamed_on_memory(tmp_path: Path) -> None:
    from processes import wait_for_step, worker_pids

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [LAUNCH, *TINY, "gpus=2", "trainer.max_steps=400", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(run_dir, 2, proc)
    os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "launch: error: rank 1 was killed by SIGKILL" in err and "out-of-memory" not in err, err


def test_a_rank_killed_inside_a_collective_is_said_with_the_collective_and_its_phase(tmp_path: Path) -> None:
    """gloo aborts a rank whose collectives no longer match (SIGABRT): the line says which call of torch.distributed it
    died in, who called it (from the stacks faulthandler wrote as it died) and what the group was doing."""
    run = launch(tmp_path, *TINY, "gpus=2", "trainer.max_steps=5", "model._target_=faulty.AbortedGPT")
    assert run.returncode == 1, run.stderr
    line = next(line for line in run.stderr.splitlines() if line.startswith("launch: error: rank 1"))
    assert line.startswith("launch: error: rank 1 was killed by SIGABRT in torch.distributed.recv, called from "), line
    assert "faulty.py (fail) while " in line and "forward/backward of step" in line, line
    assert f"(its stacks: {run.run_dir / 'logs' / 'stacks' / 'rank1'})" in line, line


def _memory_cgroup(tmp_path: Path, limit: int) -> Path:
    """A child of this process's memory cgroup with `limit` bytes (cgroup v1 or v2)."""
    from launcher.base.machine import memory_cgroups

    for parent in memory_cgroups():
        child = parent / f"launch-test-{os.getpid()}"
        try:
            child.mkdir()
            limit_file = child / (
                "memory.limit_in_bytes" if (child / "memory.limit_in_bytes").exists() else "memory.max"
            )
            limit_file.write_text(str(limit))
            return child
        except OSError as e:
            reason = f"{e.strerror}: {e.filename}"
            try:
                child.rmdir()
            except OSError:
                pass
    unavailable(
        "LAUNCH_TEST_REQUIRE_ROOT",
        f"no memory cgroup can be made here to run out of memory safely ({locals().get('reason', 'none')})",
    )
