"""Parameter groups by rule: which parameters take weight decay (the built-in GPT, a transformers Llama and BERT),
the same groups under every strategy (read back from each strategy's checkpoint), and the rules refused before
start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, cli_here
from runs import STRATEGIES

GPT_DECAYED = {
    f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.0", "mlp.2")
}
"""The tiny GPT's 2-D hidden matrices: the only parameters the default decays (its head is tied to the embedding)."""


def _gpt() -> torch.nn.Module:
    from launcher.models.gpt import GPT

    return GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _decayed(module: torch.nn.Module, **optim: object) -> set[str]:
    from launcher.optim.build import build_optimizer, rules_for

    built = build_optimizer(torch.optim.AdamW, module, rules=rules_for(optim, torch.optim.AdamW), lr=1e-3)
    names = {id(p): n for n, p in module.named_parameters()}
    return {names[id(p)] for g in built.param_groups if g["weight_decay"] > 0 for p in g["params"]}


@pytest.mark.unit
def test_the_default_decays_only_hidden_matrices_of_the_gpt_and_a_llama() -> None:
    """Biases, LayerNorm gains (torch's type), transformers' LlamaRMSNorm gains (not torch's type: found by its
    class name) and embeddings take no decay; every other matrix does. `optim.no_decay=false` decays all, as before."""
    gpt, llama = _gpt(), _llama()
    assert _decayed(gpt) == GPT_DECAYED
    projections = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    hidden = {f"model.layers.{i}.{p}.weight" for i in range(2) for p in projections}
    assert not isinstance(llama.model.norm, torch.nn.RMSNorm)  # the rule is by class name here, not torch's type
    assert _decayed(llama) == hidden | {"lm_head.weight"}  # an untied output head is a matrix like any other
    for model in (gpt, llama):
        assert _decayed(model, no_decay=False) == {n for n, _ in model.named_parameters()}


@pytest.mark.unit
def test_a_norm_gain_with_zero_gradient_keeps_its_value_under_the_default_and_moved_under_the_old_rule() -> None:
    """A zero gradient (DeepSpeed's flat buffers give one to a parameter no token reached): zero moments, and no
    weight decay under the default, so the gain stays; the old rule (optim.no_decay=false) decayed it toward 0."""
    from launcher.optim.build import build_optimizer, rules_for

    for no_decay, moves in ((True, False), (False, True)):
        torch.manual_seed(0)
        model = _gpt()
        rules = rules_for({"no_decay": no_decay}, torch.optim.AdamW)
        optimizer = build_optimizer(torch.optim.AdamW, model, rules=rules, lr=1e-2, weight_decay=0.1)
        model(torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32)))["loss"].backward()
        model.ln_f.weight.grad.zero_()
        before = model.ln_f.weight.detach().clone()
        optimizer.step()
        assert torch.equal(model.ln_f.weight, before) is not moves, no_decay


@pytest.mark.unit
def test_layer_wise_learning_rates_on_a_transformers_bert() -> None:
    """One rule per encoder layer (lr_scale 0.5 ** (depth below the top)): after AdamW's first step, whose update is
    lr x sign(gradient) where the gradient is not zero, each layer's largest change is its own rate; the layer's
    biases and LayerNorm gains keep no decay in a group of the rule's own."""
    from transformers import BertConfig, BertForMaskedLM

    from launcher.optim.build import build_optimizer, rules_for

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
    )
    model = BertForMaskedLM(config)
    scales = {i: 0.5 ** (2 - i) for i in range(3)}
    groups = [{"name": f"bert.encoder.layer.{i}.*", "lr_scale": s} for i, s in scales.items()]
    rules = rules_for({"groups": groups}, torch.optim.AdamW)
    optimizer = build_optimizer(torch.optim.AdamW, model, rules=rules, lr=1e-2, weight_decay=0.0)
    labels = {f"optim.groups[{i}]" for i in range(3)} | {f"optim.groups[{i}].no_decay" for i in range(3)}
    assert {g["group"] for g in optimizer.param_groups} == labels | {"no_decay", "decay"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for i, scale in scales.items():
        change = max(
            float((p.detach() - before[n]).abs().max())
            for n, p in model.named_parameters()
            if n.startswith(f"bert.encoder.layer.{i}.")
        )
        assert change == pytest.approx(1e-2 * scale, rel=1e-3), (i, change)
    for group in optimizer.param_groups:
        if group["group"].endswith("no_decay"):
            assert group["weight_decay"] == 0.0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_holds_the_same_groups(strategy: str, suite: Run, tmp_path: Path) -> None:
    """Each strategy's checkpoint (torch's optimizers and DeepSpeed's ZeRO, offloaded too) records the same param
    groups: the hidden matrices with weight decay, the rest without, in that order of the rules."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(suite.run_dir / "checkpoints" / f"step_{12:08d}"), str(tmp_path / "full.pt"))
    groups = torch.load(tmp_path / "full.pt", weights_only=True)["optim"]["param_groups"]
    assert [(g["group"], g["weight_decay"]) for g in groups] == [("no_decay", 0.0), ("decay", 0.1)]
    names = {n for n, _ in _gpt().named_parameters()}
    assert set(groups[1]["params"]) == GPT_DECAYED and set(groups[0]["params"]) == names - GPT_DECAYED
    assert "launch: optimizer param groups: no_decay 20,224 (weight_decay 0.0); decay 98,304" in suite.stdout


REFUSED = [
    (
        "optim.groups=[{name: 'blocks.9.*', lr_scale: 0.5}]",
        "optim.groups[0] (name=blocks.9.*, module=None) matches no trainable parameter",
    ),
    ("optim.groups=[{module: Conv2d}]", "optim.groups[0] (name=None, module=Conv2d) matches no trainable parameter"),
    ("optim.groups=[{lr_scale: 0.5}]", "optim.groups: optim.groups[0]={'lr_scale': 0.5} names no parameters"),
    ("optim.groups=[{name: '*', lr_scale: -1}]", "optim.groups[0].lr_scale=-1 is not a number >= 0"),
    ("optim.groups=[{name: '*', momentum: 0.9}]", "optim.groups[0].momentum: torch.optim.AdamW takes no such key"),
    (
        "optim.groups=[{name: 'blocks.*', _target_: torch.optim.NoSuchOptimizer}]",
        "optim.groups[0]._target_=torch.optim.NoSuchOptimizer does not import",
    ),
    (
        "optim.groups=[{name: 'blocks.*', _target_: torch.optim.SGD, betas: [0.9, 0.9]}]",
        "optim.groups[0].betas: torch.optim.SGD takes no such key",
    ),
]


@pytest.mark.unit
@pytest.mark.parametrize("override,line", REFUSED)
def test_a_rule_that_matches_nothing_or_that_the_optimizer_cannot_take_is_one_line(
    override: str, line: str, tmp_path: Path
) -> None:
    proc = cli_here(tmp_path, *TINY, override)
    assert proc.returncode != 0
    (error,) = [e for e in proc.stderr.splitlines() if e.strip()]
    assert line in error, error
