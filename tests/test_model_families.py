"""Models of families we did not write, built from configs (tests/family_models.py), each against one process: a
diffusion model whose noise schedule is a tensor attribute of its scheduler (neither a parameter nor a buffer), a
vision-language model with parameters it never uses, an audio encoder-decoder, and a model with a branch used only on
even steps, which shows what each strategy does with a parameter that gets a gradient in some steps only.

Each family's sweep and its one-process run are made once per session (`launch_once`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Run, launch_once
from runs import jobs, metrics, smoke

DENOISER = [
    "model=custom",
    "model._target_=family_models.Denoiser",
    "data=custom",
    "data._target_=family_models.noisy_images",
    "trainer.max_steps=4",
]
# Adam's eps at 1e-6: softmax ignores a bias added to every key of a query, so the gradient of CLIP's key biases is
# rounding noise (1e-11), which at torch's eps of 1e-8 Adam turns into moves of 1e-6 per step that follow the
# summation order (up to 5e-6 apart after 4 steps, on one tensor and what it touches).
LLAVA = [
    "model=custom",
    "model._target_=family_models.llava",
    "data=custom",
    "data._target_=family_models.image_text",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=3",
    "trainer.keep_last=0",
    "optim.eps=1e-6",
]
WHISPER = [
    "model=custom",
    "model._target_=family_models.whisper",
    "data=custom",
    "data._target_=family_models.speech",
    "trainer.max_steps=4",
]
# Accumulation 1 (2 ranks of 1 sample, one process of 2): the branch runs in every even step on every rank.
BRANCH = [
    "model=custom",
    "model._target_=family_models.EvenStepBranch",
    "data=custom",
    "data._target_=moe_models.points",
    "batch.global_size=2",
    "trainer.max_steps=4",
    "trainer.save_at_end=true",
]
EXACT = 1e-6
"""Losses and final weights under a strategy against one process's: every strategy these families run declares 1e-6
(`Conformance.tolerance`), the same gradients in another order of fp32 sums."""


def one_process(conformance_dir: Path, name: str, *overrides: str) -> Run:
    return launch_once(conformance_dir, "+sweep=smoke", *overrides, "strategy=ddp", "gpus=1", name=name).check()


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from launcher.checkpoint.format import find_checkpoint
    from launcher.parent.convert import weights

    return weights(find_checkpoint(run_dir))


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    assert sorted(a) == sorted(b)
    return {k: float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point()}


@pytest.mark.long  # ~30 s: a diffusers sweep under fsdp and zero3 and one process; tensors a model holds outside
# its parameters get rank 0's values in the tests below
def test_a_diffusion_model_whose_noise_schedule_is_a_plain_tensor_matches_one_process(conformance_dir: Path) -> None:
    """FSDP builds the model on the meta device: the scheduler's `alphas_cumprod` (a tensor attribute) is filled with
    rank 0's values like the parameters, so FSDP and ZeRO-3 (which builds it sharded) add the same noise as one
    process."""
    run, sweep = smoke(conformance_dir, "smoke-denoiser", *DENOISER, "strategy=fsdp,zero3")  # the two meta builds
    assert run.returncode == 0, run.stderr[-3000:]
    one = one_process(conformance_dir, "smoke-denoiser-one", *DENOISER)
    assert len(one.losses()) == 4
    runs = {strategy: [m["loss"] for m in metrics(job)] for strategy, job in jobs(sweep).items()}
    assert sorted(runs) == ["fsdp", "zero3"]
    for strategy, losses in runs.items():
        assert losses == pytest.approx(one.losses(), abs=EXACT), (strategy, losses, one.losses())


@pytest.mark.long  # ~35 s: every strategy; unused parameters are also tested on a cheaper model in this file
def test_a_vision_language_model_keeps_the_parameters_it_never_uses_under_every_strategy(conformance_dir: Path) -> None:
    """LLaVA reads its CLIP tower's hidden states before the last layer: that layer and `post_layernorm` get no
    gradient. The launcher names them before start; DDP needs no find_unused_parameters, ZeRO steps them without
    weight decay, and every final weight, theirs included, is one process's."""
    run, sweep = smoke(conformance_dir, "smoke-llava", *LLAVA, "strategy=ddp,fsdp,zero2,zero3")
    assert run.returncode == 0, run.stderr[-3000:]
    one = one_process(conformance_dir, "smoke-llava-one", *LLAVA)
    named = (
        "got no gradient from the first micro-batch: model.vision_tower.encoder.layers.1.*, "
        "model.vision_tower.post_layernorm.{weight,bias}"
    )
    lines = [line for line in run.stdout.splitlines() if named in line]
    assert len(lines) == 4 and lines[0].startswith("launch: 18 parameters got no gradient"), run.stdout
    assert sum("ddp leaves them out of its buckets" in line for line in lines) == 1, lines
    assert sum("ZeRO-2 gives every parameter a gradient" in line for line in lines) == 1, lines
    expected = final_weights(one.run_dir)
    for name in ("weight", "bias"):  # never used, never changed: LayerNorm's initial ones and zeros
        value = expected[f"model.vision_tower.post_layernorm.{name}"]
        assert torch.equal(value, torch.ones_like(value) if name == "weight" else torch.zeros_like(value))
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero2", "zero3"]
    for strategy, job in jobs(sweep).items():
        assert [m["loss"] for m in metrics(job)] == pytest.approx(one.losses(), abs=EXACT), strategy
        apart = {k: d for k, d in differences(final_weights(job), expected).items() if d > EXACT}
        assert not apart, (strategy, apart)


@pytest.mark.long  # ~25 s: a branch-gated model saved and resumed under zero3; resume under zero3 is the
# conformance suite's
def test_a_checkpoint_without_optimizer_state_for_unused_parameters_resumes_under_zero3(
    conformance_dir: Path,
) -> None:
    """One process (ddp) saves no optimizer state for the parameters LLaVA never uses (torch makes none for a `.grad`
    that is None): zero3 resumes from its step 3 with none for them either, and goes on as it did (FSDP's loading of
    the same checkpoint is the one of `launcher.checkpoint`, which test_checkpoint runs across strategies)."""
    one = one_process(conformance_dir, "smoke-llava-one", *LLAVA)
    step3 = one.run_dir / "checkpoints" / "step_00000003"
    run, sweep = smoke(conformance_dir, "smoke-llava-resumed", *LLAVA, "strategy=zero3", f"resume={step3}")
    assert run.returncode == 0, run.stderr[-3000:]
    expected = final_weights(one.run_dir)
    assert sorted(jobs(sweep)) == ["zero3"]
    for strategy, job in jobs(sweep).items():
        assert [m["loss"] for m in metrics(job)] == pytest.approx(one.losses()[3:], abs=EXACT), strategy
        apart = {k: d for k, d in differences(final_weights(job), expected).items() if d > EXACT}
        assert not apart, (strategy, apart)


@pytest.mark.long  # ~25 s: one more family's sweep; the encoder-decoder path is test_loss_families' seq2seq run
def test_an_audio_encoder_decoder_matches_one_process_sharded(conformance_dir: Path) -> None:
    """Whisper sharded by FSDP along its own `_no_split_modules` (its encoder and decoder layers)."""
    run, sweep = smoke(conformance_dir, "smoke-whisper", *WHISPER, "strategy=fsdp")
    assert run.returncode == 0, run.stderr[-3000:]
    one = one_process(conformance_dir, "smoke-whisper-one", *WHISPER)
    assert sorted(jobs(sweep)) == ["fsdp"]
    for strategy, job in jobs(sweep).items():
        assert [m["loss"] for m in metrics(job)] == pytest.approx(one.losses(), abs=EXACT), strategy


@pytest.mark.long  # ~20 s: a sweep of every strategy; parameters without a gradient are named in the tests below
def test_a_branch_used_on_even_steps_changes_only_then_except_under_zero(conformance_dir: Path) -> None:
    """The rule: a parameter that gets no gradient in a step is not changed by it. DDP and FSDP keep it (every final
    weight is one process's); ZeRO gives the branch a zero gradient in odd steps, so its moments move it there: the
    losses agree until the first step that reads the moved branch (step 4), as the line at start says."""
    run, sweep = smoke(conformance_dir, "smoke-branch", *BRANCH, "strategy=ddp,fsdp,zero2")
    assert run.returncode == 0, run.stderr[-3000:]
    one = one_process(conformance_dir, "smoke-branch-one", *BRANCH, "batch.micro_size=2")
    assert "launch: 2 parameters got no gradient from the first micro-batch: branch.{weight,bias}" in run.stdout
    assert "moves in the others too" in run.stdout
    expected = final_weights(one.run_dir)
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero2"]
    for strategy, job in jobs(sweep).items():
        losses, apart = [m["loss"] for m in metrics(job)], differences(final_weights(job), expected)
        if strategy in ("ddp", "fsdp"):
            assert losses == pytest.approx(one.losses(), abs=EXACT), strategy
            assert max(apart.values()) <= EXACT, (strategy, apart)
        else:
            assert losses[:3] == pytest.approx(one.losses()[:3], abs=EXACT), strategy
            assert abs(losses[3] - one.losses()[3]) > EXACT, (strategy, losses, one.losses())
            assert apart["branch.weight"] > EXACT, (strategy, apart)


# ------------------------------------------------------------------ in this process


@pytest.fixture
def one_rank():
    """A process group of this process alone (gloo), for a strategy's setup here."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Schedule:
    def __init__(self) -> None:
        self.betas = torch.linspace(0.1, 0.2, 5)
        self.pair = (torch.arange(3.0), "name")
        self.config = _Frozen(scale=torch.tensor(2.0))


class _Frozen(dict):
    """A dict that refuses assignment, as diffusers' FrozenDict does."""

    def __setitem__(self, key: object, value: object) -> None:
        raise TypeError("frozen")


class _Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.schedule = _Schedule()
        self.register_buffer("mask", torch.ones(2))
        self.tables = [torch.full((2,), 7.0)]
        self.alias = self.schedule.betas  # one tensor, two paths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum()


@pytest.mark.unit
def test_tensors_a_model_holds_are_found_and_get_rank_0s_values_where_they_are_held(one_rank) -> None:
    from strategies.held import check_held, fill_held, held_tensors

    with torch.device("meta"):
        meta = _Holder()
    held = held_tensors(meta)
    paths = [
        "model.schedule.betas",
        "model.schedule.pair[0]",
        "model.schedule.config['scale']",
        "model.tables[0]",
        "model.alias",
    ]  # not the buffer, not the parameters
    assert [h.path for h in held] == paths
    assert all(h.tensor.is_meta for h in held)
    check_held(meta, "fsdp")
    whole = _Holder()
    fill_held(held, meta, whole, "cpu")
    assert torch.equal(meta.schedule.betas, whole.schedule.betas) and meta.alias is meta.schedule.betas
    assert torch.equal(meta.schedule.pair[0], torch.arange(3.0)) and meta.schedule.pair[1] == "name"
    assert isinstance(meta.schedule.config, _Frozen) and float(meta.schedule.config["scale"]) == 2.0
    assert torch.equal(meta.tables[0], torch.full((2,), 7.0))


@pytest.mark.unit
def test_a_held_tensor_fsdp_cannot_make_right_is_refused_naming_it() -> None:
    from strategies.held import check_held

    with torch.device("meta"):
        model = _Holder()
    model.transposed = model.layer.weight.t()  # follows the parameter in one process; not once FSDP re-creates it
    with pytest.raises(ValueError, match=r"model.transposed is a view of layer.weight, which fsdp re-creates"):
        check_held(model, "fsdp")
    del model.transposed
    model.schedule.kept = {torch.zeros(1)}
    with pytest.raises(ValueError, match=r"model.schedule.kept.<a set's member> is a tensor in a set"):
        check_held(model, "fsdp")


@pytest.mark.unit
def test_parameters_without_a_gradient_are_named_by_module() -> None:
    from strategies.no_grad import grouped

    names = ["tower.post_layernorm.weight", "tower.post_layernorm.bias", "head.weight"]
    assert grouped(names) == "tower.post_layernorm.{weight,bias}, head.weight"
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    )
    unused = ["1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias", "0.bias"]
    assert grouped(unused, model) == "1.*, 0.bias"  # a module unused whole is one group


class _Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).sum()


@pytest.mark.unit
def test_ddps_error_names_the_parameters_that_got_no_gradient_and_guesses_no_experts(one_rank) -> None:
    """Where the launcher could not find them before start (its meta-device forward could not run), DDP's own error
    at the next forward names them, from the indices it lists."""
    import functools

    from launcher.config.context import preset_strategy
    from launcher.optim.build import build_optimizer
    from strategies import RunContext

    ctx = RunContext("cpu", 0, 0, 1, "fp32", 0.0, 1, 1)
    ddp = preset_strategy("ddp")
    ddp.setup(ctx, lambda meta=False: _Unused(), functools.partial(build_optimizer, torch.optim.AdamW))
    ddp.backward(ddp.forward((torch.ones(1, 2),)))
    with pytest.raises(RuntimeError) as raised:
        ddp.forward((torch.ones(1, 2),))
    assert str(raised.value).startswith(
        "2 parameters got no gradient on rank 0 in the previous step: spare.{weight,bias}"
    )
    assert "strategy.find_unused_parameters=true" in str(raised.value) and "expert" not in str(raised.value)
    ddp.teardown()


@pytest.mark.unit
def test_ddp_synchronises_parameters_named_before_start_only_in_steps_that_use_them(one_rank) -> None:
    import functools

    from launcher.config.context import preset_strategy
    from launcher.optim.build import build_optimizer
    from strategies import RunContext

    ctx = RunContext("cpu", 0, 0, 1, "fp32", 0.0, 1, 1, no_grad=("spare.weight", "spare.bias"))
    ddp = preset_strategy("ddp")
    ddp.setup(
        ctx, lambda meta=False: _Unused(), functools.partial(build_optimizer, torch.optim.AdamW, weight_decay=0.1)
    )
    spare = ddp.model.module.spare.weight.detach().clone()
    for _ in range(2):  # no "Expected to have finished reduction" at the second forward
        ddp.backward(ddp.forward((torch.ones(1, 2),)))
        ddp.step(1e-2)
    assert torch.equal(ddp.model.module.spare.weight, spare)  # no gradient: no weight decay, no moments
    assert ddp.metrics()["comm_calls"] == 2  # the buckets' all-reduce and the one of the parameters kept apart
    ddp.teardown()
