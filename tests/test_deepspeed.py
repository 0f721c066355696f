"""DeepSpeed-specific behaviour; training, parity and memory rules are in the conformance suite.

Real processes through the `launch` console script, real DeepSpeed engines on gloo ranks.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import LAUNCH, TINY, clean_env, launch, launch_here, require_async_io, unavailable

from strategies import RunContext
from strategies.deepspeed import build_ds_config

CTX = RunContext(
    device="cpu", rank=0, local_rank=0, world_size=4, precision="bf16", grad_clip=0.5, accumulation=8, micro_size=2
)
FEW_STEPS = ["batch.global_size=8", "batch.micro_size=2", "trainer.max_steps=3"]


# ------------------------------------------------------------------ the generated config


@pytest.mark.unit
def test_config_is_derived_from_the_run() -> None:
    config = build_ds_config(CTX, stage=3, offload_optimizer="cpu", offload_params="nvme", swap_path="/swap")
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_accumulation_steps"] == 8
    assert config["train_batch_size"] == 2 * 8 * 4
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": True} and config["fp16"] == {"enabled": False}
    assert config["gradient_clipping"] == 0.5
    zero = config["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/swap"}
    assert "optimizer" not in config and "scheduler" not in config  # the client optimizer and our LR schedule


@pytest.mark.unit
def test_clipping_is_always_written() -> None:
    """DeepSpeed clips at 1.0 when the key is absent: grad_clip=0 must reach it as 0."""
    from dataclasses import replace

    assert build_ds_config(replace(CTX, grad_clip=0.0), stage=1)["gradient_clipping"] == 0.0


@pytest.mark.unit
def test_extra_keys_are_merged_and_equal_values_accepted() -> None:
    extra = {
        "zero_optimization": {"reduce_bucket_size": 1000},
        "gradient_accumulation_steps": 8,
        "wall_clock_breakdown": True,
    }
    config = build_ds_config(CTX, stage=2, extra=extra)
    # Ours: gradient buckets reduced to their owner (a reduce-scatter's volume); the user's bucket size wins.
    assert config["zero_optimization"] == {
        "stage": 2,
        "reduce_bucket_size": 1000,
        "use_multi_rank_bucket_allreduce": False,
    }
    assert config["wall_clock_breakdown"] is True and config["gradient_accumulation_steps"] == 8


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"gradient_accumulation_steps": 4}, ["gradient_accumulation_steps=4", "gradient_accumulation_steps=8"]),
        ({"train_batch_size": 32}, ["train_batch_size=32", "train_batch_size=64"]),
        ({"fp16": {"enabled": True}}, ["fp16.enabled=True", "fp16.enabled=False", "precision"]),
        ({"gradient_clipping": 1.0}, ["gradient_clipping=1.0", "gradient_clipping=0.5", "trainer.grad_clip"]),
        ({"optimizer": {"type": "Adam"}}, ["optimizer=", "optim"]),
        ({"zero_optimization": {"stage": 1}}, ["zero_optimization.stage=1", "zero_optimization.stage=2"]),
    ],
)
@pytest.mark.unit
def test_conflicting_keys_are_rejected_naming_both_values(extra: dict, named: list[str]) -> None:
    with pytest.raises(ValueError) as error:
        build_ds_config(CTX, stage=2, extra=extra)
    message = str(error.value)
    assert "\n" not in message and all(text in message for text in named), message


# ------------------------------------------------------------------ errors before workers start


def _rejected(tmp_path: Path, *overrides: str) -> str:
    return launch_here(tmp_path, *TINY, *overrides).refused()  # in this process, as the launcher refuses it


@pytest.mark.unit
@pytest.mark.parametrize(
    "key, given, derived",
    [
        ("gradient_accumulation_steps", 8, 2),  # global 16 = micro 4 x world 2 x accumulation 2
        ("zero_optimization.stage", 1, 2),  # nested: the config arrives as OmegaConf nodes
    ],
)
def test_conflicting_ds_config_rejected_by_launch(tmp_path: Path, key: str, given: int, derived: int) -> None:
    line = _rejected(
        tmp_path, "strategy=zero2", "batch.global_size=16", "batch.micro_size=4", f"+strategy.ds_config.{key}={given}"
    )
    assert f"{key}={given}" in line and f"{key}={derived}" in line, line


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["strategy=zero2", "strategy.offload_params=cpu"], "needs strategy.stage=3"),
        (["strategy=zero2", "strategy.offload_optimizer=nvme", "strategy.nvme_path=/tmp"], "needs strategy.stage=3"),
        (["strategy=zero2_offload", "optim=sgd"], "optim=adamw"),
        (["strategy=zero_infinity"], "strategy.nvme_path is unset"),
        (["strategy=zero2", "trainer.compile=true"], "trainer.compile=true is not supported"),
    ],
)
def test_impossible_combinations_rejected(tmp_path: Path, overrides: list[str], expected: str) -> None:
    assert expected in _rejected(tmp_path, *overrides)


@pytest.mark.unit
def test_nvme_path_must_exist(tmp_path: Path) -> None:
    line = _rejected(tmp_path, "strategy=zero_infinity", f"strategy.nvme_path={tmp_path / 'absent'}")
    assert "does not exist" in line


@pytest.mark.unit
def test_nvme_path_must_be_writable(tmp_path: Path) -> None:
    locked, mounted = tmp_path / "locked", False
    locked.mkdir(0o500)  # read-only to anyone but root
    if not os.access("/proc/sys", os.W_OK):  # read-only even for root (tests often run as root, in containers)
        path = "/proc/sys"
    elif os.geteuid() != 0:
        path = str(locked)
    else:  # root on a host: a read-only mount of its own
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1M", "tmpfs", str(locked)], capture_output=True)
        if mount.returncode:
            unavailable("LAUNCH_TEST_REQUIRE_ROOT", f"no read-only folder to point at: {mount.stderr.decode().strip()}")
        path, mounted = str(locked), True
    try:
        assert "is not writable" in _rejected(tmp_path, "strategy=zero_infinity", f"strategy.nvme_path={path}")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(locked)], check=False)


@pytest.mark.unit
def test_nvme_path_must_have_room_for_the_model(tmp_path: Path) -> None:
    # 4096-wide GPT layers hold about 201M parameters; NVMe offload writes 16 bytes per parameter.
    layers = math.ceil(shutil.disk_usage(tmp_path).free / (16 * 201e6)) + 2
    line = _rejected(
        tmp_path,
        "strategy=zero_infinity",
        f"strategy.nvme_path={tmp_path}",
        f"model.n_layer={layers}",
        "model.n_embd=4096",
        "model.n_head=32",
        "trainer.max_steps=1",
    )
    assert "GiB free but NVMe offload needs about" in line


# ------------------------------------------------------------------ ZeRO-Infinity pages to NVMe


def test_zero_infinity_pages_to_nvme_and_cleans_up(tmp_path: Path) -> None:
    require_async_io()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    seen: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for root, _, files in os.walk(nvme):
                seen.update(os.path.relpath(os.path.join(root, f), nvme) for f in files)
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        # 512-wide layers: the larger tensors' 1/2 partitions are over the 1 MiB DeepSpeed swaps at least.
        run = launch(
            tmp_path,
            *TINY,
            *FEW_STEPS,
            "strategy=zero_infinity",
            f"strategy.nvme_path={nvme}",
            "model.n_embd=512",
            "model.n_head=8",
        )
    finally:
        done.set()
        watcher.join()
    run.check()
    swapped = [f for f in seen if f.endswith(".swp")]
    assert any("optimizer" in f for f in swapped), sorted(seen)  # fp32 master and Adam moments
    assert any("params" in f for f in swapped), sorted(seen)  # fp32 parameters
    assert list(nvme.iterdir()) == []  # each rank's swap folder is removed at the end: nothing piles up


# ------------------------------------------------------------------ accumulation


def test_sync_each_microbatch_reduces_every_micro_step(tmp_path: Path) -> None:
    """The opt-in DeepSpeed path: ZeRO-2 reduces on each of the K=2 micro-steps (the default: once).

    Also an extra nested ds_config key reaching the engine: 10k-element buckets make many reductions. And ZeRO in a
    16-bit precision on CPU, its gradients reduced in 2 bytes each: precision=fp16 where the processor has float16
    kernels (DeepSpeed's dynamic loss scaler runs, its default initial scale 2^16 reported as `loss_scale`); where it
    has none, fp16 is refused before any worker starts, naming the fix, and the run is made in bf16.
    """
    import torch

    from launcher.models.gpt import GPT
    from strategies.deepspeed.strategy import cpu_fp16

    args = (
        *TINY,
        "strategy=zero2",
        "strategy.sync_each_microbatch=true",
        "batch.global_size=16",
        "batch.micro_size=4",
        "trainer.max_steps=2",
        "+strategy.ds_config.zero_optimization.reduce_bucket_size=10000",
    )
    if cpu_fp16():
        run = launch(tmp_path, *args, "precision=fp16").check()
    else:
        said = launch_here(tmp_path, *args, "precision=fp16", name="fp16").refused()  # nothing written
        assert "precision=fp16 under DeepSpeed on CPU" in said and "use precision=bf16" in said, said
        run = launch(tmp_path, *args, "precision=bf16").check()
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32).parameters())
    last = run.metrics[-1]
    assert last["accumulation"] == 2 and last["comm_bytes"] == 2 * 2 * n, (last, n)  # K x 16-bit gradients
    assert last["comm_calls"] >= 2 * n / 10000, last  # one per bucket: the key reached DeepSpeed
    assert all(math.isfinite(m["loss"]) for m in run.metrics), run.metrics
    if cpu_fp16():
        scales = [m["loss_scale"] for m in run.metrics]
        assert scales[0] in (2.0**16, 2.0**15), scales


# ------------------------------------------------------------------ the import stays lazy


@pytest.fixture
def no_deepspeed(tmp_path: Path) -> dict[str, str]:
    """An environment in which `import deepspeed` fails, in the launcher and in every worker."""
    guard = tmp_path / "guard" / "deepspeed"
    guard.mkdir(parents=True)
    (guard / "__init__.py").write_text("raise ImportError('deepspeed was imported')\n")
    env = clean_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(guard.parent), env.get("PYTHONPATH", "")])
    probe = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True)
    assert "deepspeed was imported" in probe.stderr  # the guard itself works
    return env


def test_modules_do_not_import_deepspeed(no_deepspeed: dict[str, str]) -> None:
    code = (
        "import launcher.parent.cli, launcher.parent.launch, launcher.worker.runner, launcher.worker.main, "
        "strategies.deepspeed"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=no_deepspeed, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_help_does_not_import_deepspeed(no_deepspeed: dict[str, str]) -> None:
    proc = subprocess.run([LAUNCH, "--help"], env=no_deepspeed, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # the whole help, DeepSpeed's presets among the strategies, from their config files alone
    assert "strategy: auto, ddp, ddp_bf16, fsdp, fsdp_tp, hsdp, zero1, zero2, zero2_offload, zero3" in proc.stdout, (
        proc.stdout
    )
    # and a ZeRO preset's composed config
    proc = subprocess.run([LAUNCH, "strategy=zero3", "--cfg", "job"], env=no_deepspeed, capture_output=True, text=True)
    assert proc.returncode == 0 and "_target_: strategies.deepspeed.DeepSpeed" in proc.stdout, proc.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_other_strategies_never_import_deepspeed(tmp_path: Path, no_deepspeed: dict[str, str], strategy: str) -> None:
    launch(tmp_path, *TINY, f"strategy={strategy}", "trainer.max_steps=2", env=no_deepspeed).check()


def test_forked_workers_start_with_deepspeed_and_its_ops_loaded(tmp_path: Path) -> None:
    """CPU workers are forked from the launcher, which imports DeepSpeed (and what its ZeRO optimizers import) and
    loads its CPU Adam op once, before the fork: rank 1's log of Python's imports names none of them."""
    env = clean_env(tmp_path) | {"PYTHONPROFILEIMPORTTIME": "1"}
    run = launch(tmp_path, *TINY, "strategy=zero2_offload", "gpus=2", "trainer.max_steps=1", env=env).check()
    (log,) = (run.run_dir / "logs").glob("*/attempt_0/1/stderr.log")
    lines = [line.rsplit("|", 1) for line in log.read_text().splitlines() if line.startswith("import time:")]
    imported = {name.strip() for _, name in lines}
    assert "launcher.worker.runner" in imported, sorted(imported)  # the worker's own imports are logged
    assert not {"deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "cpuinfo"} & imported, sorted(imported)


# ------------------------------------------------------------------ the strategy-neutral export


# zero3_offload: sharded and offloaded, the state farthest from torch's; zero2: read first after DeepSpeed's own first
# step, which links the moments of its first param group alone to their parameters
@pytest.mark.parametrize("preset", ["zero3_offload", "zero2"])
def test_state_dict_is_the_full_torch_state_and_loads(tmp_path: Path, preset: str) -> None:
    """Full fp32 weights and Adam moments under torch's full state-dict keys, as one torch process has
    them, in every param group; loaded into a fresh engine, training continues exactly."""
    import json

    env = clean_env(tmp_path) | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(Path(__file__).parent / "ds_state_dict_worker.py"),
            preset,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["same_keys"], result
    assert (
        result["diff"]["weights"] <= 1e-5 and result["diff"]["exp_avg"] <= 1e-6 and result["diff"]["exp_avg_sq"] <= 1e-6
    ), result
    assert result["resume_diff"] == 0.0, result  # loaded into a fresh engine: the next step is bit-identical
    # Streamed: each rank holds the full copies of the parameters it owns, about 1/G of them (the tied
    # embedding, a third of this model, is one rank's), never the whole state.
    assert sum(result["shares"]) == pytest.approx(1.0) and max(result["shares"]) <= 0.6, result


TEMPLATE = """
import functools, json, sys
import torch, torch.distributed as dist
from launcher.config import schema
from launcher.config.context import preset_strategy
from launcher.models.gpt import GPT
from launcher.optim.build import build_optimizer
from strategies import RunContext
schema.register()
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
ctx = RunContext(device="cpu", rank=0, local_rank=0, world_size=1, precision="fp32", grad_clip=1.0, accumulation=1,
                 micro_size=2)
for stage, optimizer in ((2, torch.optim.AdamW), (1, torch.optim.Adam)):
    strategy = preset_strategy("zero2_offload", stage=stage, optimizer=f"torch.optim.{optimizer.__name__}")
    torch.manual_seed(0)
    build = functools.partial(build_optimizer, optimizer, lr=1e-3, weight_decay=0.1)
    strategy.setup(ctx, lambda: GPT(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=8), build)
    zero = strategy.engine.optimizer
    before = [p.clone() for p in zero.single_partition_of_fp32_groups]
    strategy.state_dict()  # a checkpoint's template, as the room check before the first save takes it
    after = zero.single_partition_of_fp32_groups
    moments = [t for s in zero.optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")]
    print(json.dumps({"groups": [g["weight_decay"] for g in zero.optimizer.param_groups], "moments": len(moments),
                      "moved": max((a - b).abs().max().item() for a, b in zip(after, before, strict=True)),
                      "moment": max(t.abs().max().item() for t in moments)}), flush=True)
    strategy.teardown()
from launcher.base.process import exit_now
exit_now(0)
"""


def test_a_template_before_the_first_step_moves_no_weight_and_no_moment(tmp_path: Path) -> None:
    """ZeRO-1/2 with the optimizer offloaded: the optimizer state a checkpoint's template needs before the first step
    (the room check before the first save takes one) is made by a step of zero gradients at learning rate 0 that
    leaves every fp32 master as it was, in the group without weight decay and in the one with it (which a step of
    every group at its own learning rate decayed), and every moment zero (Adam adds weight decay to the gradient)."""
    import json

    one_rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    env = clean_env(tmp_path) | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"} | one_rank
    proc = subprocess.run(
        [sys.executable, "-c", TEMPLATE, str(tmp_path / "pg")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2, proc.stdout
    for result in results:  # ZeRO-2 with AdamW, ZeRO-1 with Adam
        assert result["groups"] == [0.0, 0.1] and result["moments"] == 4, result
        assert result["moved"] == 0.0 and result["moment"] == 0.0, result


@pytest.mark.unit
def test_an_op_check_keeps_what_the_compiler_prints_off_the_terminal(capfd: pytest.CaptureFixture[str]) -> None:
    """Without libaio, DeepSpeed's check of its async I/O op runs the compiler, which logs its command lines and
    prints "cannot find -laio": the refusal is the one line the user sees."""
    import logging

    from strategies.deepspeed.ops import _is_compatible

    class Noisy:
        def is_compatible(self, verbose: bool) -> bool:
            os.system("echo 'gcc test.o -laio' && echo 'collect2: error: ld returned 1 exit status' >&2")
            logging.getLogger("compilers.C.base").info("gcc test.o -laio -o a.out")
            print("python out")
            print("python err", file=sys.stderr)
            return False

    assert _is_compatible(Noisy()) is False
    out, err = capfd.readouterr()
    assert (out, err) == ("", ""), (out, err)
    print("after")  # the terminal is back
    assert capfd.readouterr().out == "after\n"
