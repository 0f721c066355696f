"""optim=muon: Muon over the hidden matrices and AdamW over the rest, one process's updates under DDP and FSDP (each
matrix orthogonalised whole), its groups, and its refusals before start."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, cli_here, launch_once
from runs import DECLARED, PARITY_TOLERANCE

MUON_JOB = [
    *TINY,
    "batch.global_size=8",
    "batch.micro_size=2",
    "trainer.max_steps=6",
    "trainer.checkpoint_every=3",
    "trainer.keep_last=0",
    "optim=muon",
    "optim.muon_lr=0.05",
    "optim.lr=3e-3",
]


@functools.cache
def _run(tmp: Path, strategy: str, gpus: int) -> Run:
    return launch_once(tmp, *MUON_JOB, f"strategy={strategy}", f"gpus={gpus}", name=f"muon-{strategy}-{gpus}").check()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_at_k2_equal_one_process_at_k4(strategy: str, conformance_dir: Path) -> None:
    """Under FSDP each rank holds half of each matrix's rows: the update is the whole matrix's all the same."""
    one, two = _run(conformance_dir, "ddp", 1), _run(conformance_dir, strategy, 2)
    assert len(one.losses()) == 6
    assert max(abs(a - b) for a, b in zip(one.losses(), two.losses(), strict=True)) <= PARITY_TOLERANCE[strategy]
    adamw = launch_once(conformance_dir, *MUON_JOB[:-3], "gpus=1", name="muon-adamw-reference").check()
    assert max(abs(a - b) for a, b in zip(one.losses()[1:], adamw.losses()[1:])) > 1e-3  # Muon's own updates


@pytest.mark.long  # 20-40 s: the EMA and param-group resumes cover a grouped optimizer's state
def test_a_resume_from_fsdp_at_two_ranks_into_one_process_goes_on_exactly(
    conformance_dir: Path, tmp_path: Path
) -> None:
    """Muon's momentum (FSDP's shards) and AdamW's moments, saved at step 3, resumed by one DDP process."""
    full = _run(conformance_dir, "fsdp", 2)
    step3 = full.run_dir / "checkpoints" / "step_00000003"
    resumed = launch_once(tmp_path, *MUON_JOB, "gpus=1", f"resume={step3}", name="muon-resumed").check()
    assert len(resumed.losses()) == 3
    assert max(abs(a - b) for a, b in zip(full.losses()[3:], resumed.losses(), strict=True)) <= PARITY_TOLERANCE["fsdp"]


def test_the_planner_and_the_counter_know_the_matrices_muon_gathers(conformance_dir: Path) -> None:
    """Under FSDP at 2 ranks each hidden matrix's update is gathered whole once per step, in fp32: the bytes a rank
    sends are AdamW's under FSDP plus (G-1)/G x 4 bytes x the matrices' elements (every 2-D parameter but the
    embeddings, the head tied to one), in the planner's figure and in the counter's, which agree."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    run = _run(conformance_dir, "fsdp", 2)
    adamw = launch_once(conformance_dir, *MUON_JOB[:-3], "strategy=fsdp", "gpus=2", name="muon-adamw-fsdp").check()
    model = instantiate(OmegaConf.load(run.run_dir / "resolved.yaml").model)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    hidden = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
    extra = (2 - 1) / 2 * 4 * hidden
    muon, plain = run.metrics[-1], adamw.metrics[-1]
    assert muon["comm_bytes_formula"] == pytest.approx(plain["comm_bytes_formula"] + extra, rel=1e-12), (muon, plain)
    assert muon["comm_sent_bytes"] == pytest.approx(plain["comm_sent_bytes"] + extra, rel=1e-12), (muon, plain)
    assert muon["comm_sent_bytes"] == pytest.approx(muon["comm_bytes_formula"], rel=0.02)  # FSDP's unit padding
    assert muon["comm_bytes"] == plain["comm_bytes"]  # the gathers move parameters: no gradient sync more


def _planned_comm(tmp_path: Path, optim: str) -> dict[str, float]:
    """`launch plan` of the tiny GPT on 2 ranks with `optim`: each preset's bytes sent per optimizer step."""
    import json

    proc = cli_here(tmp_path, "plan", *TINY, "gpus=2", f"optim={optim}", "plan.format=json")
    assert proc.returncode == 0, proc.stderr
    return {sp["name"]: sp["comm_bytes"] for sp in json.loads(proc.stdout)["strategies"]}


@pytest.mark.unit
def test_launch_plan_adds_muon_s_gathers_where_the_parameters_are_sharded(tmp_path: Path) -> None:
    """`launch plan optim=muon`: FSDP's and HSDP's bytes per step are AdamW's plus (G-1)/G x 4 bytes x the hidden
    matrices' elements (every 2-D parameter but the embeddings, the head tied to one); DDP's the same."""
    from launcher.models.gpt import GPT

    muon, adamw = _planned_comm(tmp_path, "muon"), _planned_comm(tmp_path, "adamw")
    model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)  # TINY's
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    hidden = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
    assert muon["ddp"] == adamw["ddp"]
    for name in ("fsdp", "hsdp"):
        assert muon[name] == pytest.approx(adamw[name] + 0.5 * 4 * hidden, rel=1e-12), (name, muon, adamw)


@pytest.mark.unit
def test_launch_plan_adds_no_muon_gathers_to_the_presets_that_refuse_muon(tmp_path: Path) -> None:
    """Every ZeRO preset refuses optim=muon (its check, before start): its row in `launch plan optim=muon` is AdamW's,
    ZeRO-3's too, whose parameters are sharded (partitioned flat, never a matrix whole)."""
    from strategies.deepspeed.config import check_recipe

    muon, adamw = _planned_comm(tmp_path, "muon"), _planned_comm(tmp_path, "adamw")
    refusing = sorted(name for name, s in DECLARED.items() if type(s).__name__ == "DeepSpeed")
    for name in refusing:  # each refuses it: the check its launch runs
        with pytest.raises(ValueError, match="optim=muon under ZeRO"):
            check_recipe(None, DECLARED[name].stage, "none", {}, "launcher.optim.muon.MuonAdamW")  # type: ignore[arg-type]
        assert muon[name] == adamw[name], (name, muon[name], adamw[name])
    assert {"zero3", "zero3_offload"} <= set(refusing) and DECLARED["zero3"].layout().params.sharded


@pytest.mark.unit
def test_the_hidden_matrices_take_muon_and_the_rest_adamw() -> None:
    """A transformers Llama: every projection is Muon's, at optim.muon_lr; the embeddings, norms and the untied output
    head are AdamW's. A shard's update is the whole matrix's, sliced (here: a matrix split in two by hand)."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from launcher.optim.build import build_optimizer, rules_for
    from launcher.optim.muon import MuonAdamW, orthogonalised

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = LlamaForCausalLM(config)
    rules = rules_for(OmegaConf.create({"lr": 1e-3, "muon_lr": 0.02}), MuonAdamW)
    optimizer = build_optimizer(MuonAdamW, model, rules=rules, lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g.get("muon") for p in g["params"]}
    assert muon == {n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    assert [g["lr"] for g in optimizer.param_groups if g.get("muon")] == [pytest.approx(0.02)]
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    whole = orthogonalised(g)
    singular = torch.linalg.svdvals(whole)  # Newton-Schulz: near orthogonal (singular values about 0.5 to 1.5)
    assert bool(((singular > 0.5) & (singular < 1.5)).all()), singular


class _Fp32Casts(torch.overrides.TorchFunctionMode):
    """Turns `Tensor.bfloat16()` into an fp32 copy, and counts the casts: torch.optim.Muon's one cast of each update
    before its Newton-Schulz iteration (`grad.bfloat16()`), whose arithmetic then runs in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.bfloat16:
            self.casts += 1
            return args[0].to(torch.float32, copy=True)
        return func(*args, **(kwargs or {}))


class _TorchMuonInFp32(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in fp32, as the launcher runs it by default: torch's own step,
    under a torch function mode (torch's public extension point) that makes its cast to bf16 an fp32 copy."""

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        with _Fp32Casts() as mode:
            loss = super().step(closure)
        matrices = sum(p.grad is not None for g in self.param_groups for p in g["params"])
        assert mode.casts == matrices, (mode.casts, matrices)  # every update went through the mode, and only those
        return loss


class _Small(torch.nn.Module):
    """Matrices (Muon's), vectors (biases, a norm), an embedding and an output head (AdamW's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(40, 16)
        self.up = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.head = torch.nn.Linear(16, 40)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.norm(torch.relu(self.up(self.embedding(tokens))))))


def _launchers_muon(ns_dtype: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """optim=muon as a run builds it (the composed config, `optimizer_factory`, the default param groups), over a fresh
    `_Small` seeded 0."""
    from hydra import compose, initialize_config_module

    from launcher.config import freeze, schema
    from launcher.optim.build import optimizer_factory
    from strategies import RunContext

    schema.register()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = freeze(compose("config", overrides=["optim=muon", "optim.lr=1e-2", f"optim.ns_dtype={ns_dtype}"]))
    ctx = RunContext(
        device="cpu", rank=0, local_rank=0, world_size=1, precision="fp32", grad_clip=0.0, accumulation=1, micro_size=4
    )
    torch.manual_seed(0)
    model = _Small()
    return model, optimizer_factory(cfg, ctx)(model)


def _torch_optimizers(model: torch.nn.Module, groups: list[dict], muon: type) -> list[torch.optim.Optimizer]:
    """`muon` over the launcher's Muon groups of `model` (its parameters by the launcher's order), torch.optim.AdamW
    over its other groups: each group's own rate, weight decay and hyperparameters."""
    muon_groups = [
        {
            "params": g["params"],
            "lr": g["lr"],
            "weight_decay": g["weight_decay"],
            "momentum": g["momentum"],
            "nesterov": g["nesterov"],
            "ns_steps": g["ns_steps"],
        }
        for g in groups
        if g.get("muon")
    ]
    adamw_groups = [
        {"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"], "betas": g["betas"], "eps": g["eps"]}
        for g in groups
        if not g.get("muon")
    ]
    return [muon(muon_groups, adjust_lr_fn="original"), torch.optim.AdamW(adamw_groups, foreach=False)]


def _steps(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer], steps: int = 5) -> None:
    tokens = torch.randint(0, 40, (8, 12), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 40, (8, 12), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
        for optimizer in optimizers:
            optimizer.step()


@pytest.mark.unit
@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_muon_adamw_is_torch_s_muon_and_adamw_bit_for_bit(ns_dtype: str) -> None:
    """5 steps of the launcher's optimizer equal torch.optim.Muon over its hidden matrices plus torch.optim.AdamW over
    the rest, in the same groups: every weight bit for bit. optim.ns_dtype=fp32 (the default) against torch's Muon
    with its Newton-Schulz iteration in fp32; bf16 against torch's Muon as it is. And the two dtypes differ."""
    model, optimizer = _launchers_muon(ns_dtype)
    reference = _Small()
    reference.load_state_dict(model.state_dict())
    theirs = dict(zip(model.parameters(), reference.parameters(), strict=True))
    groups = [{**g, "params": [theirs[p] for p in g["params"]]} for g in optimizer.param_groups]
    assert [g["group"] for g in groups] == ["hidden_matrices", "no_decay", "decay"]  # the default rules
    assert {p.dim() for g in groups if g.get("muon") for p in g["params"]} == {2}
    assert len(groups[1]["params"]) == 5 and len(groups[2]["params"]) == 1  # embedding, biases, norm; the head
    muon = _TorchMuonInFp32 if ns_dtype == "fp32" else torch.optim.Muon
    _steps(model, [optimizer])
    _steps(reference, _torch_optimizers(reference, groups, muon))
    for (name, mine), other in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, other), (name, float((mine - other).abs().max()))
    other_dtype, its_optimizer = _launchers_muon("bf16" if ns_dtype == "fp32" else "fp32")
    _steps(other_dtype, [its_optimizer])
    assert not torch.equal(model.up.weight, other_dtype.up.weight)  # the option is what the two runs differ by


REFUSED = [
    (["strategy=zero2", "optim=muon"], "optim=muon under ZeRO"),
    (
        ["optim=muon", "model=custom", "model._target_=user_models.NoMatrices"],
        "steps the model's 2-D hidden matrices with Muon, and the model has none",
    ),
]


@pytest.mark.unit
@pytest.mark.parametrize("overrides,line", REFUSED)
def test_muon_where_it_cannot_run_is_one_line(overrides: list[str], line: str, tmp_path: Path) -> None:
    base = [o for o in TINY if not o.startswith("model")] if "model=custom" in overrides else TINY
    proc = cli_here(tmp_path, *base, *overrides)
    assert proc.returncode != 0
    (error,) = [e for e in proc.stderr.splitlines() if e.strip()]
    assert line in error, error
