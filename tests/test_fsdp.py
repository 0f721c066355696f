"""What is FSDP-specific, beyond the conformance suite: options, bad input, memory, exit hygiene.

Real `launch` runs with 2 gloo ranks on CPU: the conformance suite's job, and its runs where they are the same.
Exit hygiene: FSDP2 on gloo used to abort at interpreter exit about one run in four (see the worker's teardown);
each of the suite's FSDP and HSDP runs (over a dozen, each `.check()`ed) would show it.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Run, launch_here
from runs import JOB, NORM_TOLERANCE, run_of

FSDP = [*JOB, "strategy=fsdp", "gpus=2"]  # the conformance job: K = 2 micro-steps per optimizer step
N_LAYER = 2  # TINY's model.n_layer


@pytest.fixture
def tmp(conformance_dir: Path) -> Path:
    return conformance_dir


def _run(tmp: Path, *overrides: str) -> Run:
    """FSDP on 2 ranks with `overrides`; without any, the conformance suite's own run."""
    return run_of(tmp, "fsdp", 2, *overrides)


def fp32(tmp: Path) -> Run:
    return _run(tmp)


def max_diff(a: Run, b: Run) -> float:
    return max(abs(x - y) for x, y in zip(a.losses(), b.losses(), strict=True))


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides, named",
    [
        (["strategy.shard_units=[Blok]"], "e.g. strategy.shard_units=[Block]"),  # the closest class is suggested
        (["strategy.reduce_dtype=fp16"], "strategy.reduce_dtype=fp16"),
        (["strategy.offload=nvme"], "strategy.offload"),
        (["strategy.shard_units=[]", "strategy.activation_checkpointing=true"], "strategy.shard_units"),
    ],
)
def test_bad_input_fails_before_workers_start(tmp_path: Path, overrides: list[str], named: str) -> None:
    line = launch_here(tmp_path, *FSDP, *overrides).refused()
    assert named in line, line


def test_each_block_is_a_unit_and_state_is_half_of_ddp(tmp: Path, ddp_run: Run) -> None:
    fsdp, ddp = fp32(tmp).metrics[-1], ddp_run.metrics[-1]
    assert fsdp["comm_calls"] == N_LAYER + 1  # one reduce-scatter per block, one for the root's parameters
    assert fsdp["comm_bytes"] == ddp["comm_bytes"]  # every gradient reduced once, in fp32, as DDP's all-reduce
    assert fsdp["model_state_bytes"] <= 0.55 * ddp["model_state_bytes"], (fsdp, ddp)
    # Clipping uses the global norm over all shards, not this rank's shard: the same norm as DDP's.
    assert fsdp["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=NORM_TOLERANCE["fsdp"])


def test_bf16_mixed_precision_trains(tmp: Path) -> None:
    run, ref = _run(tmp, "precision=bf16"), fp32(tmp)
    losses = run.losses()
    assert losses[-1] < losses[0] - 0.5, losses
    assert max_diff(run, ref) > 1e-6  # the blocks really computed in bf16
    assert max_diff(run, ref) < 0.05
    assert run.metrics[-1]["comm_bytes"] == ref.metrics[-1]["comm_bytes"]  # still reduced in fp32 by default
    bf16_reduce = _run(tmp, "precision=bf16", "strategy.reduce_dtype=bf16").metrics[-1]
    assert bf16_reduce["comm_bytes"] == ref.metrics[-1]["comm_bytes"] / 2


def test_fp16_trains_with_the_sharded_loss_scaler(tmp: Path) -> None:
    run = _run(tmp, "precision=fp16")
    losses = run.losses()
    assert losses[-1] < losses[0] - 0.5, losses
    # The scaler runs: torch's initial scale 2^16, halved on each overflow, never above its start here (growth comes
    # after 2000 clean steps), so every logged figure is a power of two up to 2^16.
    scales = [m["loss_scale"] for m in run.metrics]
    assert len(scales) == len(losses) and all(1 <= s <= 2.0**16 and math.log2(s).is_integer() for s in scales), scales
    assert "loss_scale" not in fp32(tmp).metrics[-1]


def test_cpu_offload_trains_and_reports_host_state(tmp: Path) -> None:
    run, ref = _run(tmp, "strategy.offload=cpu"), fp32(tmp)
    assert max_diff(run, ref) <= 1e-6
    last = run.metrics[-1]
    assert last["model_state_bytes"] == 0  # nothing stays on the device between steps
    assert last["offloaded_state_bytes"] == ref.metrics[-1]["model_state_bytes"]


def test_keeping_units_gathered_after_forward_skips_backwards_all_gathers(tmp: Path) -> None:
    """strategy.reshard_after_forward=false: the same losses, and each unit's parameters are gathered once per
    micro-step instead of twice (forward and again in backward): (1 + K) instead of (1 + 2K) passes over the model."""
    run, ref = _run(tmp, "strategy.reshard_after_forward=false"), fp32(tmp)
    assert max_diff(run, ref) <= 1e-6
    K = ref.metrics[-1]["accumulation"]
    kept, resharded = run.metrics[-1]["comm_sent_bytes"], ref.metrics[-1]["comm_sent_bytes"]
    assert kept / resharded == pytest.approx((1 + K) / (1 + 2 * K), rel=0.02), (kept, resharded)


def test_activation_checkpointing_gives_the_same_losses(tmp: Path) -> None:
    assert max_diff(_run(tmp, "strategy.activation_checkpointing=true"), fp32(tmp)) <= 1e-6


# One rank, in a fresh process: count how often the attention inside each block runs in one micro-step
# (the recomputation calls the block's forward without its hooks, but its children's hooks fire).
_COUNT_FORWARDS = """
import sys, torch, torch.distributed as dist
from launcher.models.gpt import GPT, Attention
from strategies.base import RunContext
from launcher.config import schema
from launcher.config.context import preset_strategy

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
ctx = RunContext("cpu", 0, 0, 1, "fp32", 1.0, 1, 2)
schema.register()
strategy = preset_strategy("fsdp", activation_checkpointing=sys.argv[2] == "true")
def build(meta=False):
    with torch.device("meta" if meta else "cpu"):
        return GPT(2, 4, 64, 256, 32)
strategy.setup(ctx, build, lambda module: torch.optim.SGD(module.parameters(), lr=0.1))
calls = []
for module in strategy.model.modules():
    if isinstance(module, Attention):
        module.register_forward_hook(lambda *_: calls.append(1))
idx = torch.randint(0, 256, (2, 32))
with strategy.sync(True):
    strategy.backward(strategy.forward((idx, idx))["loss"])
print(len(calls))
strategy.teardown()
dist.destroy_process_group()
from launcher.base.process import exit_now
exit_now(0)  # as the launcher's own workers end: a gloo thread can abort the interpreter's teardown
"""


@pytest.mark.parametrize("checkpointing, forwards", [("false", N_LAYER), ("true", 2 * N_LAYER)])
def test_activation_checkpointing_recomputes_each_block(tmp_path: Path, checkpointing: str, forwards: int) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _COUNT_FORWARDS, str(tmp_path / "pg"), checkpointing],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) == forwards


def test_sync_each_microbatch_reduce_scatters_every_micro_step(tmp: Path) -> None:
    run, ref = _run(tmp, "strategy.sync_each_microbatch=true"), fp32(tmp)
    k = ref.metrics[-1]["accumulation"]
    assert k == 2
    assert run.metrics[-1]["comm_calls"] == k * ref.metrics[-1]["comm_calls"]
    assert run.metrics[-1]["comm_bytes"] == k * ref.metrics[-1]["comm_bytes"]
    assert max_diff(run, ref) <= 1e-6  # the same gradients, only reduced earlier
