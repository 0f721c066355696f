"""Speed you can see: MFU and the measured-vs-formula communication in the logs, and trainer.compile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, clean_env, launch, launch_here
from runs import JOB

from launcher.models.gpt import GPT
from launcher.plan.costs import flops_per_token, peak_tflops

DIMS = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "block_size": 32}  # TINY's model


def _n_params() -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(**DIMS).parameters())


@pytest.mark.unit
def test_flops_per_token_and_the_peak_table() -> None:
    # nanoGPT's gpt2 (124M, 12 x 768, T=1024): 6N + 12 x 12 x 768 x 1024.
    assert flops_per_token(124_000_000, 12, 768, 1024) == 6 * 124e6 + 12 * 12 * 768 * 1024
    assert flops_per_token(1000) == 6000  # a user model: no attention term
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0  # matched before the SXM part's "H100"
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("cpu") is None


def test_ddp_sends_what_the_planner_says_under_accumulation_and_logs_mfu(tmp_path: Path) -> None:
    run = launch(
        tmp_path,
        *TINY,
        "gpus=2",
        "batch.global_size=32",
        "batch.micro_size=4",
        "trainer.max_steps=3",
        "trainer.peak_tflops=0.5",
    ).check()
    n = _n_params()
    for m in run.metrics:
        assert m["accumulation"] == 4
        # The lesson's ring all-reduce, written out: 2(G-1)/G x 4N bytes at G=2 is 4N, once per optimizer step (K=4
        # micro-steps, one all-reduce: a sync per micro-step would send 4 times this).
        assert m["comm_bytes_formula"] == 4 * n
        assert m["comm_sent_bytes"] == pytest.approx(4 * n, rel=0.01), m["comm_sent_bytes"] / (4 * n)
        # Tokens are samples x sequence length (32); MFU is 6N + 12 L h T FLOPs per token over 2 x 0.5 TFLOPS.
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 32, rel=1e-9)
        per_token = 6 * n + 12 * DIMS["n_layer"] * DIMS["n_embd"] * DIMS["block_size"]
        assert m["mfu"] == pytest.approx(per_token * m["tokens_per_s"] / (2 * 0.5e12), rel=1e-9)
    ratio = m["comm_sent_bytes"] / m["comm_bytes_formula"]
    print(f"DDP measured/formula: {ratio:.3f}")  # shown with pytest -s


def test_no_mfu_on_cpu_without_a_peak(ddp_run: Run) -> None:
    run = ddp_run  # on CPU, no trainer.peak_tflops
    assert "mfu" not in run.metrics[-1] and run.metrics[-1]["comm_bytes_formula"] > 0


COMPILED = 1e-6
"""Compiled blocks' losses against eager ones, same strategy and ranks: inductor fuses each block's operations into
kernels of its own, which round fp32 in their own order, as a layout's sums do (2.8e-7 measured on the suite's job)."""


@pytest.mark.long
@pytest.mark.parametrize("strategy", ["ddp"])  # FSDP compiles the same units (strategy.compile_units)
def test_compiled_blocks_train_to_the_same_losses(
    conformance_dir: Path, tmp_path: Path, strategy: str, suite: Run
) -> None:
    eager = suite  # the conformance suite's run of the same job
    # One cache for both strategies (the same blocks compile to the same kernels: the second run reuses them), apart
    # from any other: proof that inductor compiled something in this test run.
    cache = conformance_dir / "inductor"
    compiled = launch(
        tmp_path,
        *JOB,
        f"strategy={strategy}",
        "gpus=2",
        "trainer.compile=true",
        "trainer.checkpoint_every=0",
        env=clean_env(tmp_path) | {"TORCHINDUCTOR_CACHE_DIR": str(cache)},
        timeout=600,
    ).check()
    assert cache.is_dir() and any(cache.rglob("*.py")), "trainer.compile=true compiled nothing"
    assert compiled.losses() == pytest.approx(eager.losses(), abs=COMPILED)


@pytest.mark.unit
def test_compile_is_rejected_by_a_strategy_without_units(tmp_path: Path) -> None:
    line = launch_here(tmp_path, *TINY, "gpus=2", "trainer.compile=true", "strategy.compile_units=[]").refused()
    assert "strategy.compile_units is empty" in line, line


@pytest.mark.unit
def test_deepspeed_rejects_compile_in_one_line(tmp_path: Path) -> None:
    line = launch_here(tmp_path, *TINY, "gpus=2", "strategy=zero2", "trainer.compile=true").refused()
    assert "trainer.compile=true is not supported by DeepSpeed" in line, line
