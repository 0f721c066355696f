"""Frozen parameters under every strategy (a real PEFT LoRA over a transformers GPT-2 from a local folder), DeepSpeed's
bucket sizes for any parameter count, and optimizers other than AdamW under the sharding strategies.

One multirun trains the LoRA under every strategy with a checkpoint at step 2 and at the end; a second resumes each
job from its own step-2 checkpoint. The LoRA model's parameter count is chosen so that 1/8 of it is odd: DeepSpeed's
ZeRO-1/2 refuse a bucket size that is not a multiple of their alignment.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, TINY, clean_env, launch_once, saved_gpt2
from runs import PARITY_TOLERANCE, jobs, metrics

# 126,456 parameters with the adapters: params // 8 = 15,807, odd.
BASE = {
    "n_layer": 2,
    "n_embd": 66,
    "n_head": 3,
    "vocab_size": 256,
    "n_positions": 16,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}
STRATEGIES = ["ddp", "fsdp", "zero2", "zero3", "zero3_offload"]
RESUMED = ["ddp", "fsdp", "zero2", "zero3"]
CHECKPOINT_STEP, STEPS = 2, 4


@pytest.fixture(scope="session")
def base_folder(conformance_dir: Path) -> Path:
    """A tiny random GPT-2, saved with save_pretrained: the pretrained model the adapters train over."""
    return saved_gpt2(conformance_dir, "lora-base", BASE)


def lora(folder: Path) -> list[str]:
    """A LoRA of rank 4 over the folder's model (tests/frozen_models.py), on padded Hugging Face batches."""
    return [
        "model=custom",
        "model._target_=frozen_models.lora",
        f"+model.path={folder}",
        "+model.r=4",
        "data=pysource",
        "data.packing=false",
        "data.seq_len=16",
        "data.format=hf",
        "optim.lr=0.01",
    ]


def lora_run(tmp: Path, folder: Path, name: str, *overrides: str, multirun: bool = False):  # type: ignore[no-untyped-def]
    return launch_once(
        tmp,
        *(["-m"] if multirun else []),
        "+sweep=smoke",
        *lora(folder),
        f"trainer.max_steps={STEPS}",
        f"trainer.checkpoint_every={CHECKPOINT_STEP}",
        "trainer.save_at_end=true",
        *overrides,
        name=name,
        timeout=300 * (1 + multirun * len(STRATEGIES)),
    )


def lora_sweep(tmp: Path, folder: Path, name: str, strategies: list[str], *overrides: str) -> dict[str, Path]:
    """A multirun of the LoRA over `strategies`, once per session; strategy -> job folder (named by its strategy)."""
    sweep = tmp / name
    run = lora_run(
        tmp,
        folder,
        name,
        f"strategy={','.join(strategies)}",
        *overrides,
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=${hydra:runtime.choices.strategy}",
        multirun=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = jobs(sweep)
    assert sorted(found) == sorted(strategies), run.stdout
    return found


@pytest.fixture
def trained(conformance_dir: Path, base_folder: Path) -> dict[str, Path]:
    return lora_sweep(conformance_dir, base_folder, "lora", STRATEGIES)


def checkpoint(job: Path, step: int) -> Path:
    return job / "checkpoints" / f"step_{step:08d}"


def test_lora_trains_under_every_strategy_as_in_one_process(trained, conformance_dir, base_folder) -> None:
    one = lora_run(conformance_dir, base_folder, "lora-one-process", "strategy=ddp", "gpus=1").check()
    assert len(one.losses()) == STEPS and one.losses()[-1] != one.losses()[0]
    for strategy, job in trained.items():
        losses = [m["loss"] for m in metrics(job)]
        assert losses == pytest.approx(one.losses(), abs=PARITY_TOLERANCE[strategy]), (strategy, losses, one.losses())


def test_frozen_weights_stay_as_loaded_and_only_the_adapters_have_optimizer_state(trained, base_folder) -> None:
    """Every strategy's final checkpoint holds every weight, the frozen ones exactly as the folder's (the adapters
    moved), and optimizer state for the adapters only."""
    from safetensors.torch import load_file

    from launcher.checkpoint.untrusted import read_metadata
    from launcher.parent.convert import weights

    folder = load_file(str(base_folder / "model.safetensors"))
    for strategy, job in trained.items():
        saved = weights(checkpoint(job, STEPS))
        adapters = {k for k in saved if ".lora_" in k}
        frozen = {re.sub(r"^base_model\.model\.|\.base_layer", "", k): saved[k] for k in saved if k not in adapters}
        assert set(frozen) - set(folder) <= {"lm_head.weight"} <= set(frozen), strategy  # the head: tied to wte
        folder["lm_head.weight"] = folder["transformer.wte.weight"]
        assert all(torch.equal(frozen[k], folder[k]) for k in folder), strategy
        assert adapters and all(saved[k].abs().max() > 0 for k in adapters if "lora_B" in k), strategy
        entries = read_metadata(checkpoint(job, STEPS)).state_dict_metadata  # optim.state.<parameter>.<key>
        stated = {k.removeprefix("optim.state.").rsplit(".", 1)[0] for k in entries if k.startswith("optim.state.")}
        assert stated == adapters, (strategy, sorted(stated ^ adapters)[:3])
    # ZeRO-3 partitions the frozen parameters too: a rank holds about half of what a DDP rank holds (all weights).
    held = {s: metrics(trained[s])[-1]["model_state_bytes"] for s in ("ddp", "zero3")}
    assert held["zero3"] < 0.55 * held["ddp"], held


@pytest.mark.long
def test_a_resume_from_the_mid_run_checkpoint_is_exact(trained, conformance_dir, base_folder) -> None:
    root = trained["ddp"].parent  # each job resumes from its own strategy's checkpoint
    resume = f"resume={root}/${{hydra:runtime.choices.strategy}}/checkpoints/step_{CHECKPOINT_STEP:08d}"
    for strategy, job in lora_sweep(conformance_dir, base_folder, "lora-resumed", RESUMED, resume).items():
        full = {m["step"]: m["loss"] for m in metrics(trained[strategy])}
        resumed = {m["step"]: m["loss"] for m in metrics(job)}
        assert sorted(resumed) == list(range(CHECKPOINT_STEP + 1, STEPS + 1)), (strategy, resumed)
        for step, loss in resumed.items():
            assert loss == pytest.approx(full[step], abs=1e-6), (strategy, step, loss, full[step])


def test_ddp_resumes_the_lora_from_a_zero3_checkpoint(trained, conformance_dir, base_folder) -> None:
    """ZeRO-3's checkpoint holds the frozen weights and the adapters' state in the param groups torch's optimizers
    have (the trainable parameters): DDP continues it as its own run went on."""
    resume = f"resume={checkpoint(trained['zero3'], CHECKPOINT_STEP)}"
    run = lora_run(conformance_dir, base_folder, "lora-ddp-from-zero3", "strategy=ddp", resume).check()
    full = {m["step"]: m["loss"] for m in metrics(trained["ddp"])}
    assert [m["step"] for m in run.metrics] == list(range(CHECKPOINT_STEP + 1, STEPS + 1)), run.metrics
    assert run.losses() == pytest.approx([full[m["step"]] for m in run.metrics], abs=1e-6)


def test_convert_writes_the_adapters_peft_loads_and_merged_the_whole_model(trained, base_folder, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from launcher.parent.convert import weights

    saved = weights(checkpoint(trained["zero3"], STEPS))
    model = lora(base_folder)[:4]
    adapters, merged = tmp_path / "adapters", tmp_path / "merged"
    said = []
    for out, extra in ((adapters, []), (merged, ["merge=true"])):
        proc = subprocess.run(
            [LAUNCH, "convert", str(checkpoint(trained["zero3"], STEPS)), f"out={out}", *extra, *model],
            capture_output=True,
            text=True,
            env=clean_env(tmp_path),
        )
        assert proc.returncode == 0, proc.stderr
        said.append(proc.stdout.strip().splitlines()[-1])
    # Each says what it wrote and how to load it.
    assert said[0].startswith("launch: wrote the adapters (") and "PeftModel.from_pretrained(base, " in said[0], said
    assert "merge=true" in said[0] and said[1].startswith("launch: wrote the whole model, its adapters merged"), said
    ids = torch.arange(16).reshape(1, 16)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_folder)), str(adapters)).eval()
    loaded = dict(peft.named_parameters())
    trained_adapters = {k: v for k, v in saved.items() if ".lora_" in k}
    assert trained_adapters and all(torch.equal(loaded[k], v) for k, v in trained_adapters.items())
    whole = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert not any(".lora_" in k for k in whole.state_dict())
    with torch.no_grad():
        assert torch.allclose(whole(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5)


# ------------------------------------------------------------------ DeepSpeed's buckets


@pytest.mark.unit
def test_bucket_sizes_are_multiples_of_deepspeeds_alignment_for_any_parameter_count() -> None:
    """DeepSpeed's own rule, read from its source: ZeRO-1/2 assert allgather_bucket_size % nccl_start_alignment_factor
    == 0 in their constructor."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from strategies.deepspeed.config import BUCKET_SHARE, buffers

    source = inspect.getsource(DeepSpeedZeroOptimizer.__init__)
    (factor,) = {int(n) for n in re.findall(r"self\.nccl_start_alignment_factor = (\d+)", source)}
    assert re.search(r"allgather_bucket_size % self\.nccl_start_alignment_factor == 0", source), "the rule moved"
    counts = [*range(1, 5000), 670_345, 15_807 * 8 + 7, 10**9 + 3, 4 * 10**9 + 11]
    for stage in (1, 2, 3):
        for params in counts:
            sized = buffers(stage, params)
            for key in ("allgather_bucket_size", "reduce_bucket_size"):
                assert sized[key] % factor == 0 and sized[key] > 0, (stage, params, key, sized[key])
                assert sized[key] <= max(factor, params // BUCKET_SHARE), (stage, params, key, sized[key])


# ------------------------------------------------------------------ optimizers


@pytest.mark.unit
def test_the_optimizer_holds_the_trainable_parameters_with_the_kernel_they_take() -> None:
    """On plain tensors every fused kernel; on DTensors (FSDP's shards) only where DTensor dispatches it."""
    from launcher.optim.build import _dtensor_fuses, build_optimizer

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2), requires_grad=False)]
    for optimizer in (torch.optim.SGD, torch.optim.AdamW, torch.optim.Adagrad):
        (group,) = build_optimizer(optimizer, iter(params), fuse=True, lr=0.1).param_groups
        assert group["fused"] is True and group["params"] == params[:1]  # the trainable parameter only
    assert _dtensor_fuses(torch.optim.Adam) and _dtensor_fuses(torch.optim.AdamW)
    assert not _dtensor_fuses(torch.optim.SGD) and not _dtensor_fuses(torch.optim.Adagrad)


OPTIMIZERS = ["torch.optim.SGD", "torch.optim.Adagrad"]


@pytest.mark.long  # ~20 s: optimizers by class and their groups under every strategy are test_param_groups'
def test_sgd_and_adagrad_train_under_fsdp_and_zero2(conformance_dir: Path) -> None:
    """The built-in GPT with SGD and with Adagrad (`optim=custom`): FSDP and ZeRO-2 agree step by step, and from the
    second step on each optimizer's losses are its own (its updates were applied). AdamW is the LoRA's optimizer
    above, under every strategy."""
    sweep = conformance_dir / "optimizers"
    run = launch_once(
        conformance_dir,
        "-m",
        *TINY,
        "gpus=2",
        "batch.global_size=8",
        "batch.micro_size=2",
        "trainer.max_steps=4",
        "trainer.save_at_end=false",
        "optim=custom",
        "optim.lr=0.05",
        f"optim._target_={','.join(OPTIMIZERS)}",
        "strategy=fsdp,zero2",
        f"hydra.sweep.dir={sweep}",
        name="optimizers",
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found: dict[tuple[str, str], list[float]] = {}
    for job in (d for d in sweep.iterdir() if d.is_dir()):
        outcome = json.loads((job / "outcome.json").read_text())
        (optimizer,) = [o.split("=")[1] for o in outcome["overrides"] if o.startswith("optim._target_=")]
        found[(outcome["strategy"], optimizer)] = [m["loss"] for m in metrics(job)]
    assert sorted(found) == sorted((s, o) for s in ("fsdp", "zero2") for o in OPTIMIZERS), sorted(found)
    for optimizer in OPTIMIZERS:
        fsdp, zero2 = found[("fsdp", optimizer)], found[("zero2", optimizer)]
        apart = PARITY_TOLERANCE["fsdp"] + PARITY_TOLERANCE["zero2"]  # each within its own of one process
        assert len(fsdp) == 4 and zero2 == pytest.approx(fsdp, abs=apart), (optimizer, fsdp, zero2)
    sgd, adagrad = (found[("fsdp", o)] for o in OPTIMIZERS)
    assert sgd[0] == adagrad[0] and all(abs(a - b) > 1e-4 for a, b in zip(sgd[1:], adagrad[1:])), (sgd, adagrad)


def test_convert_refuses_merge_without_a_folder(tmp_path: Path) -> None:
    for args, said in (
        (["out=model.safetensors", "merge=true"], "merge=true writes a model folder; use out=DIR"),
        ([f"out={tmp_path / 'out'}", "merge=yes"], "merge=yes is not a boolean"),
    ):
        proc = subprocess.run([LAUNCH, "convert", str(tmp_path), *args], capture_output=True, text=True, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.startswith(f"launch: error: {said}"), proc.stderr
        assert sorted(tmp_path.iterdir()) == [], sorted(tmp_path.iterdir())
