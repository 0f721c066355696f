"""The strategy conformance suite: every file in conf/strategy/ passes the same checks.

The job is padded data (one sample per file chunk, so samples hold different numbers of targets): parity with one
process there is the batch contract on real data, the loss normalised by the global batch's targets.

Real gloo ranks on CPU. A new strategy is tested by adding its config file; a strategy whose
numerics legitimately differ (a compressed all-reduce) declares its tolerance itself
(`Strategy.conformance`); tests/runs.py holds the runs every suite shares.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import Run
from processes import run_processes
from runs import (
    AT_TWO_RANKS,
    NORM_TOLERANCE,
    PARITY_TOLERANCE,
    SHAPES,
    STEPS,
    STRATEGIES,
    ranks,
    run_of,
    selecting,
    shared_run,
    suite_run,
)


@pytest.fixture
def tmp(conformance_dir: Path) -> Path:
    return conformance_dir


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trains_and_exits_clean(strategy: str, suite: Run) -> None:
    run = suite
    losses = run.losses()
    assert len(losses) == STEPS
    assert run.metrics[-1]["world_size"] == ranks(strategy) and run.metrics[-1]["accumulation"] == 2
    assert losses[-1] < losses[0] - 0.5, losses
    assert run_processes(run.run_dir) == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_with_one_process(strategy: str, one_process: Run, suite: Run) -> None:
    ref, run = one_process.losses(), suite.losses()
    diff = max(abs(a - b) for a, b in zip(ref, run, strict=True))
    print(f"{strategy}: max loss difference from one process {diff:.2e}")  # shown with pytest -s
    assert diff <= PARITY_TOLERANCE[strategy], (diff, ref, run)
    # The validation loss too: the same global batches, Σ token losses / Σ targets over every rank.
    val = [[m["val_loss"] for m in r.metrics if "val_loss" in m] for r in (one_process, suite)]
    assert len(val[0]) == 2 and max(abs(a - b) for a, b in zip(*val, strict=True)) <= PARITY_TOLERANCE[strategy], val


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_gradient_norm_is_one_process_s(strategy: str, one_process: Run, suite: Run) -> None:
    """The logged pre-clip norm is the whole gradient's, whoever holds which shard (DeepSpeed's own, never NaN)."""
    ref, run = ([m["grad_norm"] for m in r.metrics] for r in (one_process, suite))
    worst = max(abs(a - b) / a for a, b in zip(ref, run, strict=True))
    print(f"{strategy}: max relative gradient-norm difference from one process {worst:.2e}")  # shown with pytest -s
    assert worst <= NORM_TOLERANCE[strategy] and all(math.isfinite(g) for g in run), (ref, run)


def _four_micro_steps(tmp: Path, strategy: str) -> Run:
    """The suite's job on 2 ranks at K = 4 (micro-batches of 2), the same global batches as the suite's K = 2."""
    return shared_run(tmp, *selecting(tmp, strategy), "gpus=2", "batch.micro_size=2")


# One strategy per way of syncing gradients; the offloading presets sync as their stage does (their collectives, K
# included, are checked against their declaration in test_a_strategy_makes_the_collectives_it_declares).
# hsdp: test_hsdp_syncs_once_per_step_in_both_groups.
@pytest.mark.parametrize("strategy", [s for s in AT_TWO_RANKS if not s.endswith("offload") and s != "zero_infinity"])
def test_gradients_sync_once_per_optimizer_step(tmp: Path, strategy: str, suite: Run) -> None:
    """K = 2 and K = 4 micro-steps over the same global batches make, in every optimizer step, the same gradient
    collectives (calls) moving the same bytes: one synchronisation of every gradient, on the last micro-step, as the
    strategy declares (`Collective.times` 1 whatever K). A micro-step that synced too would add its calls and bytes.
    (K = 1 is no reference for the calls: DeepSpeed then takes its own path, reducing during the backward in buckets
    packed as the gradients become ready, where an accumulating step reduces once after it, in the parameters' order:
    the same bytes in another number of buckets, ZeRO-2's 15 calls a step against 11 on the suite's job.)"""
    from omegaconf import OmegaConf

    from launcher.config.context import make_strategy

    two, four = suite.metrics, _four_micro_steps(tmp, strategy).metrics
    assert two[-1]["accumulation"] == 2 and four[-1]["accumulation"] == 4 and len(two) == len(four) == STEPS
    ran = make_strategy(OmegaConf.load(suite.run_dir / "resolved.yaml").strategy)
    for k in (2, 4):
        synced = [c for c in ran.collectives(1e6, "fp32", k, 2, 2) if c.sync]
        assert synced and all(c.times == 1 for c in synced), (k, synced)
    for a, b in zip(two, four, strict=True):
        assert a["comm_calls"] == b["comm_calls"] > 0 and a["comm_bytes"] == b["comm_bytes"] > 0, (a, b)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_strategy_makes_the_collectives_it_declares(strategy: str, one_process: Run, suite: Run) -> None:
    """Its own counter in the suite's run (K = 2, fp32) against its declaration (`Strategy.collectives`): the payload of
    its gradient synchronisations against the declared ones' (their dtype and how often), and the bytes a rank sent
    in every collective against the planner's sum of all it declares (`comm_bytes_formula`), within FSDP's and ZeRO's
    padding of each unit to a multiple of the ranks."""
    from omegaconf import OmegaConf

    from launcher.config.context import make_strategy
    from launcher.plan.costs import tensor_rank_params

    run = suite
    last, resolved = run.metrics[-1], OmegaConf.load(run.run_dir / "resolved.yaml")
    params = one_process.metrics[-1]["model_state_bytes"] / 16  # fp32 AdamW: 16 bytes per parameter
    ran = make_strategy(resolved.strategy)  # as the run built it (hsdp: its shard group of 2)
    held = tensor_rank_params(params, resolved.derived.model.tensor_split, ran.layout().mesh.tensor_size)  # fsdp_tp
    reused = resolved.derived.model.reused  # the GPT's embedding, which its head holds too: ZeRO-3 gathers it per use
    declared = ran.collectives(held, "fp32", last["accumulation"], last["world_size"], resolved.derived.gpus, reused)
    synced, slack = sum(c.payload_bytes for c in declared if c.sync), ran.conformance().comm_slack
    print(
        f"{strategy}: synced/declared {last['comm_bytes'] / synced:.4f}, sent/formula "
        f"{last['comm_sent_bytes'] / last['comm_bytes_formula']:.4f}"
    )
    assert last["comm_bytes"] == pytest.approx(synced, rel=slack), (last, declared)
    assert last["comm_sent_bytes"] == pytest.approx(last["comm_bytes_formula"], rel=slack), (last, declared)


def test_hsdp_syncs_once_per_step_in_both_groups(tmp: Path, one_process: Run) -> None:
    """2 x 2 HSDP at K = 2 against FSDP on 2 ranks (the same shard group of 2, the same padding): per unit
    one reduce-scatter in the shard group and one all-reduce of its half across the 2 replicas, once per optimizer
    step. The bytes each rank sends, written out from the ring formula at S = 2, R = 2, K = 2 in fp32: the shard
    group's (1 + 2K)(S-1)/S x 4P plus the all-reduce's 2(R-1)/R x 4P/S, = 10P + 2P; the planner's figure is that."""
    hsdp = suite_run(tmp, "hsdp").metrics[-1]
    fsdp = _four_micro_steps(tmp, "fsdp").metrics[-1]  # the fsdp check's K = 4: its syncs are K = 1's
    assert hsdp["accumulation"] == 2 and fsdp["accumulation"] == 4 and hsdp["world_size"] == 4
    assert hsdp["comm_calls"] == 2 * fsdp["comm_calls"], (hsdp, fsdp)
    assert hsdp["comm_bytes"] == 1.5 * fsdp["comm_bytes"], (hsdp, fsdp)
    P = one_process.metrics[-1]["model_state_bytes"] / 16  # fp32 AdamW: 16 bytes per parameter
    K, S, R = 2, 2, 2
    expected = (1 + 2 * K) * (S - 1) / S * 4 * P + 2 * (R - 1) / R * 4 * P / S
    assert expected == 12 * P
    assert hsdp["comm_bytes_formula"] == pytest.approx(expected, rel=1e-12), hsdp
    assert hsdp["comm_sent_bytes"] == pytest.approx(expected, rel=0.01), hsdp["comm_sent_bytes"] / expected
    print(f"hsdp 2x2 sent/formula {hsdp['comm_sent_bytes'] / expected:.4f}")  # shown with pytest -s


def _layout(strategy: str):
    from hydra import compose, initialize_config_module

    from launcher.config import freeze, schema
    from launcher.config.context import make_strategy

    schema.register()
    overrides = [f"strategy={strategy}", *SHAPES.get(strategy, (2, []))[1]]
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return make_strategy(freeze(compose("config", overrides=overrides)).strategy).layout()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_model_state_bytes_follow_the_sharding_rule(strategy: str, one_process: Run, suite: Run) -> None:
    from omegaconf import OmegaConf

    from launcher.plan.costs import tensor_rank_params

    full = one_process.metrics[-1]["model_state_bytes"]  # fp32 AdamW: 4 (param) + 4 (grad) + 8 (moments) per parameter
    layout = _layout(strategy)
    split = OmegaConf.load(suite.run_dir / "resolved.yaml").derived.model.tensor_split
    held = tensor_rank_params(full, split * 16, layout.mesh.tensor_size)  # fsdp_tp: the planned layers 1/T
    kinds = {"params": held / 4, "grads": held / 4, "optimizer": held / 2}
    _, shards = layout.mesh.groups(ranks(strategy))  # the ranks each sharded kind is split over: 2, or hsdp's 2 of 4
    if layout.master_weights:  # the optimizer's own fp32 copy of the parameters, placed with its state
        kinds["optimizer"] += held / 4
    expected = sum(
        size * (0 if getattr(layout, kind).where != "device" else 1 / shards if getattr(layout, kind).sharded else 1)
        for kind, size in kinds.items()
    )
    measured = suite.metrics[-1]["model_state_bytes"]
    print(f"{strategy}: model-state bytes per rank / one process's {measured / full:.4f}")  # shown with pytest -s
    assert abs(measured - expected) <= 0.05 * full, (measured, expected, full, layout)


def test_hsdp_holds_half_the_state_on_4_ranks(tmp: Path, one_process: Run) -> None:
    """2 x 2: each rank holds 1/2 of the model's state (its shard group's size), not 1/4 (the world size)."""
    full = one_process.metrics[-1]["model_state_bytes"]
    measured = suite_run(tmp, "hsdp").metrics[-1]["model_state_bytes"]
    assert measured == pytest.approx(full / 2, rel=0.02), measured / full


def test_reference_counts_every_parameter(one_process: Run) -> None:
    """The world-1 figure the rule is checked against is itself 16 bytes per parameter."""
    import torch

    from launcher.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    n = sum(p.numel() for p in model.parameters())
    assert one_process.metrics[-1]["model_state_bytes"] == 16 * n


def test_one_forward_over_the_global_batch_gives_the_same_losses(tmp: Path, one_process: Run, ddp_run: Run) -> None:
    """Padded data: G=2 K=2, one process with K=4 and one process with K=1 (one forward over the whole global batch)
    log the same losses, because every step is normalised by the targets of the whole global batch."""
    one_forward = run_of(tmp, "ddp", 1, "batch.micro_size=16").losses()
    for run in (one_process, ddp_run):
        assert max(abs(a - b) for a, b in zip(one_forward, run.losses(), strict=True)) <= 1e-6


def test_the_mean_of_micro_batch_means_would_fail_that_check(one_process: Run) -> None:
    """The usual recipe (each micro-batch's mean / K, averaged over ranks) on the same padded data and the same
    first weights: it changes with K and G, so the check above can fail; the logged loss is the global one."""
    import numpy as np
    import torch

    from launcher.config import schema
    from launcher.config.context import preset_dataset
    from launcher.data.builtin import GlobalBatches
    from launcher.models.gpt import GPT

    schema.register()
    data = preset_dataset("pysource", "train", seq_len=32, packing=False)
    torch.manual_seed(1337)
    model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)
    samples = [data[int(i)] for i in GlobalBatches(len(data), 16, 1337).at(0)]
    with torch.no_grad():
        out = [model(x[None], y[None]) for x, y in samples]
        sums, counts = np.array([float(o["loss_sum"]) for o in out]), np.array([int(o["num_tokens"]) for o in out])

    def mean_of_means(parts: int) -> float:  # G x K micro-batches of 16 / parts samples each
        return float(np.mean([s.sum() / c.sum() for s, c in zip(np.split(sums, parts), np.split(counts, parts))]))

    exact = sums.sum() / counts.sum()
    assert counts.min() < counts.max()  # padded: the samples really differ
    assert abs(mean_of_means(4) - exact) > 1e-4 and abs(mean_of_means(16) - mean_of_means(4)) > 1e-4
    assert one_process.losses()[0] == pytest.approx(exact, abs=1e-6)  # step 1: before any update


def test_data_workers_read_ahead_without_changing_a_loss(tmp: Path, ddp_run: Run) -> None:
    """data.workers=2: DataLoader processes read the same samples in the same order, so the losses are equal."""
    assert run_of(tmp, "ddp", 2, "data.workers=2").losses() == ddp_run.losses()
