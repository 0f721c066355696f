"""Mixture-of-experts under every strategy, and a preflight that checks a micro-batch and never refuses a valid model.

A hand-written top-1 MoE whose ranks route to different experts (rank 0 never runs the expert rank 1 runs in the
first micro-step, and one expert no token of the step goes to), and a tiny transformers Mixtral built from a config:
each trains under ddp, fsdp, zero2 and zero3 to the losses of one process. Neither needs `+data._check_=false`:
the meta device cannot run their routing (`nonzero`, `torch._grouped_mm`), which the launcher says in one line and
goes on. A CNN with BatchNorm starts too: the preflight's forward takes `batch.micro_size` samples, not one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import launch, launch_here, launch_once
from runs import PARITY_TOLERANCE, jobs, metrics, smoke, sweep_parts

MOE = [
    "model=custom",
    "model._target_=moe_models.TopOneMoE",
    "data=custom",
    "data._target_=moe_models.points",
    "trainer.max_steps=3",
]
MIXTRAL = [
    "model=custom",
    "model._target_=moe_models.mixtral",
    "data=pysource",
    "data.packing=false",
    "data.seq_len=16",
    "data.format=hf",
]
STRATEGIES = "strategy=ddp,fsdp,zero2,zero3"
CANNOT_CHECK = "launch: could not check the model's forward on the meta device"


def _routes(step: int) -> list[list[list[int]]]:
    """The expert of each sample, per rank and micro-step, of a 2-rank run's step (1-based) at the first weights."""
    import moe_models

    from launcher.data.builtin import GlobalBatches, rank_micro_batches

    torch.manual_seed(1337)  # the runner's seed, before it builds the model
    model, data = moe_models.TopOneMoE(), moe_models.points("train")
    indices = GlobalBatches(len(data), 4, 1337).at(step - 1)
    return [[model.route(data.x[mb]).tolist() for mb in rank_micro_batches(indices, r, 2, 2)] for r in range(2)]


@pytest.mark.unit
def test_the_ranks_route_to_different_experts() -> None:
    """What the runs below rest on: in the first micro-step the ranks run different experts, and some expert runs
    on no rank in the first step."""
    (r0, _), (r1, _) = first = _routes(1)
    assert r0 != r1, first
    used = {e for rank in first for micro in rank for e in micro}
    assert len(used) < 4, first


def test_a_hand_written_moe_matches_one_process_under_every_strategy(conformance_dir: Path) -> None:
    run, sweep = smoke(conformance_dir, "smoke-moe", *MOE, STRATEGIES)
    assert run.returncode == 0, run.stderr[-3000:]
    one = launch_once(conformance_dir, "+sweep=smoke", *MOE, "strategy=ddp", "gpus=1", name="smoke-moe-one").check()
    assert len(one.losses()) == 3
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero2", "zero3"]
    for strategy, job in jobs(sweep).items():
        assert [m["loss"] for m in metrics(job)] == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), (
            strategy
        )
    assert CANNOT_CHECK in run.stdout and "NotImplementedError" in run.stdout  # torch.nonzero has no meta kernel


def test_zero_reduces_routed_experts_in_one_order_at_accumulation_1_too(conformance_dir: Path) -> None:
    """At accumulation 1 DeepSpeed's own path reduces in buckets filled as the gradients are ready, an order that
    differs between ranks that routed apart (under ZeRO-2 the ranks then summed other parameters' gradients: a loss
    2e-4 off by step 2, or gloo's abort): with MoE blocks every step reduces once, at its end, in the parameters'
    order. Micro-batches of 2 make K = 1 with the global batch of the one-process run above."""
    import moe_models

    from launcher.data.builtin import GlobalBatches, rank_micro_batches

    torch.manual_seed(1337)
    model, data = moe_models.TopOneMoE(), moe_models.points("train")
    step1 = GlobalBatches(len(data), 4, 1337).at(0)
    routed = [set(model.route(data.x[rank_micro_batches(step1, r, 2, 1)[0]]).tolist()) for r in range(2)]
    assert routed[0] != routed[1], routed
    run = launch_once(
        conformance_dir, "+sweep=smoke", *MOE, "strategy=zero2", "batch.micro_size=2", name="smoke-moe-zero2-k1"
    ).check()
    one = launch_once(conformance_dir, "+sweep=smoke", *MOE, "strategy=ddp", "gpus=1", name="smoke-moe-one").check()
    assert run.losses() == pytest.approx(one.losses(), abs=PARITY_TOLERANCE["zero2"]), (run.losses(), one.losses())


@pytest.mark.unit
def test_reducing_each_micro_step_under_zero2_or_3_with_routed_experts_is_refused(tmp_path: Path) -> None:
    line = launch_here(tmp_path, "+sweep=smoke", *MOE, "strategy=zero2", "strategy.sync_each_microbatch=true").refused()
    assert "strategy.sync_each_microbatch=true under ZeRO-2" in line and "mixture-of-experts block MoE" in line, line
    assert "use strategy.sync_each_microbatch=false" in line, line


@pytest.mark.long
def test_a_transformers_moe_matches_one_process_under_every_strategy(conformance_dir: Path) -> None:
    run, sweep = smoke(conformance_dir, "smoke-mixtral", *MIXTRAL, STRATEGIES)
    assert run.returncode == 0, run.stderr[-3000:]
    one = launch_once(conformance_dir, "+sweep=smoke", *MIXTRAL, "strategy=ddp", "gpus=1", name="smoke-mixtral-one")
    one.check()
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero2", "zero3"]
    for strategy, job in jobs(sweep).items():
        assert [m["loss"] for m in metrics(job)] == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), (
            strategy
        )
    # Its experts run through torch._grouped_mm, whose meta kernel refuses fp32: said once by the sweep's checks and
    # once per job, not refused.
    checks, ran = sweep_parts(run.stdout)
    assert checks.count(CANNOT_CHECK) == 1 and ran.count(CANNOT_CHECK) == 4, run.stdout
    assert "a meta kernel stricter about dtypes" in ran


def test_a_module_that_one_rank_skips_is_named_not_a_collective_that_aborts(tmp_path: Path) -> None:
    """With its MoE block undeclared (strategy.moe_blocks=[]), FSDP2 would reduce-scatter gradients of other sizes on
    each rank (gloo aborts): the first micro-step's check names the expert and the ranks instead."""
    (r0, _), (r1, _) = _routes(1)
    run = launch(tmp_path, "+sweep=smoke", *MOE, "strategy=fsdp", "strategy.moe_blocks=[]")
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("launch: error: rank")]
    named = f"parameter moe.experts.{r1[0]}.up.weight got no gradient on rank(s) 0 in the first micro-step"
    assert errors and all(named in e and "but did on rank(s) 1" in e for e in errors), errors
    assert "strategy.moe_blocks" in errors[0] and "SIGABRT" not in run.stderr, run.stderr


BATCHNORM = [
    "model=custom",
    "model._target_=units_models.BatchNormNet",
    "data=custom",
    "data._target_=units_models.images",
    "+data.size=1",
]  # 1 x 1 images: one value per sample


def test_a_batchnorm_cnn_starts_and_a_micro_batch_of_one_is_refused(tmp_path: Path) -> None:
    """BatchNorm in training needs more than one value per channel: with micro-batches of 2 the preflight's forward
    passes and the run trains (under a ZeRO stage: ddp and fsdp train BatchNorm in tests/test_units_and_batchnorm.py);
    with micro-batches of 1 every real step would fail, and the preflight says so."""
    run = launch(tmp_path, "+sweep=smoke", *BATCHNORM, "strategy=zero2", "batch.micro_size=2", "trainer.max_steps=1")
    assert run.check().losses() and CANNOT_CHECK not in run.stdout
    line = launch_here(tmp_path, "+sweep=smoke", *BATCHNORM, name="one").refused()
    assert "model: Expected more than 1 value per channel when training" in line, line


@pytest.mark.unit
def test_a_shard_unit_inside_an_moe_block_and_an_unknown_block_are_refused(tmp_path: Path) -> None:
    # Each in a folder of its own: a refused run removes its empty run directory and the folder above it.
    line = launch_here(
        tmp_path, "+sweep=smoke", *MOE, "strategy=fsdp", "strategy.shard_units=[Expert]", name="a/run"
    ).refused()
    assert "strategy.shard_units=[Expert] makes units inside the mixture-of-experts block MoE" in line, line
    assert "strategy.shard_units=[MoE]" in line, line
    line = launch_here(
        tmp_path, "+sweep=smoke", *MOE, "strategy=zero3", "strategy.moe_blocks=[Router]", name="b/run"
    ).refused()
    assert "strategy.moe_blocks: no module of class Router in TopOneMoE" in line, line
