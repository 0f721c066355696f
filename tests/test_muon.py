"""optim=muon: Muon over the hidden matrices and AdamW over the rest, one process's updates under DDP and FSDP (each
matrix orthogonalised whole), its groups, and its refusals before start."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, cli_here, launch_once

MUON_JOB = [*TINY, "batch.global_size=8", "batch.micro_size=2", "trainer.max_steps=6", "trainer.checkpoint_every=3",
            "trainer.keep_last=0", "optim=muon", "optim.muon_lr=0.05", "optim.lr=3e-3"]  # fmt: skip


@functools.cache
def _run(tmp: Path, strategy: str, gpus: int) -> Run:
    return launch_once(tmp, *MUON_JOB, f"strategy={strategy}", f"gpus={gpus}", name=f"muon-{strategy}-{gpus}").check()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_at_k2_equal_one_process_at_k4(strategy: str, conformance_dir: Path) -> None:
    """Under FSDP each rank holds half of each matrix's rows: the update is the whole matrix's all the same."""
    one, two = _run(conformance_dir, "ddp", 1), _run(conformance_dir, strategy, 2)
    assert len(one.losses()) == 6
    assert max(abs(a - b) for a, b in zip(one.losses(), two.losses(), strict=True)) <= 1e-5
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
    assert max(abs(a - b) for a, b in zip(full.losses()[3:], resumed.losses(), strict=True)) <= 1e-5


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


@pytest.mark.unit
def test_launch_plan_adds_muon_s_gathers_where_the_parameters_are_sharded(tmp_path: Path) -> None:
    """`launch plan optim=muon`: FSDP's and HSDP's bytes per step are AdamW's plus (G-1)/G x 4 bytes x the hidden
    matrices' elements (every 2-D parameter but the embeddings, the head tied to one); DDP's the same."""
    import json

    from launcher.models.gpt import GPT

    def plan(optim: str) -> dict:
        proc = cli_here(tmp_path, "plan", *TINY, "gpus=2", f"optim={optim}", "plan.format=json")
        assert proc.returncode == 0, proc.stderr
        return {sp["name"]: sp["comm_bytes"] for sp in json.loads(proc.stdout)["strategies"]}

    muon, adamw = plan("muon"), plan("adamw")
    model = GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)  # TINY's
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    hidden = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings)
    assert muon["ddp"] == adamw["ddp"]
    for name in ("fsdp", "hsdp"):
        assert muon[name] == pytest.approx(adamw[name] + 0.5 * 4 * hidden, rel=1e-12), (name, muon, adamw)


@pytest.mark.unit
def test_the_hidden_matrices_take_muon_and_the_rest_adamw() -> None:
    """A transformers Llama: every projection is Muon's, at optim.muon_lr; the embeddings, norms and the untied output
    head are AdamW's. A shard's update is the whole matrix's, sliced (here: a matrix split in two by hand)."""
    from omegaconf import OmegaConf
    from transformers import LlamaConfig, LlamaForCausalLM

    from launcher.worker.muon import NS_COEFFICIENTS, MuonAdamW, orthogonalised
    from launcher.worker.optimizers import build_optimizer, rules_for

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)  # fmt: skip
    model = LlamaForCausalLM(config)
    rules = rules_for(OmegaConf.create({"lr": 1e-3, "muon_lr": 0.02}), MuonAdamW)
    optimizer = build_optimizer(MuonAdamW, model, rules=rules, lr=1e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g.get("muon") for p in g["params"]}
    assert muon == {n for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2}
    assert [g["lr"] for g in optimizer.param_groups if g.get("muon")] == [pytest.approx(0.02)]
    from torch.optim._muon import _zeropower_via_newtonschulz  # torch's own iteration (in bf16)

    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    whole = orthogonalised(g)
    singular = torch.linalg.svdvals(whole)  # Newton-Schulz: near orthogonal (singular values about 0.5 to 1.5)
    assert bool(((singular > 0.5) & (singular < 1.5)).all()), singular
    assert torch.allclose(whole, _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, 1e-7).float(), atol=3e-2)


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
