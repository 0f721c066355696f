"""Tensor parallel under FSDP2 (strategy=fsdp_tp): the plans it reads, what it refuses in process, and what the
conformance suite's TP=2 x DP=2 run shows beyond the suite's own checks (tests/test_strategies.py: parity with one
process, the gradient norm, FSDP's collectives and state; tests/test_checkpoint.py: its checkpoint resumed in one
process, at DP=4 and under zero3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, Run, cli_here, launch
from runs import NORM_TOLERANCE, PARITY_TOLERANCE, suite_run
from torch import nn

from launcher.models.gpt import GPT
from strategies.tensor_parallel import TensorParallel
from strategies.tp_plans import check_plan, model_plan, resolve, tp_collectives

SUITE_GPT = {"n_layer": 2, "n_head": 4, "n_embd": 64, "vocab_size": 256, "block_size": 32}  # tests/runs.py's JOB


def _gpt(**sizes: int) -> GPT:
    with torch.device("meta"):
        return GPT(**{**SUITE_GPT, **sizes})


def _llama(kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.unit
def test_the_gpts_plan_splits_attention_mlp_embedding_and_head_with_the_norms_sequence_parallel() -> None:
    resolved = resolve(_gpt(), model_plan(_gpt()))
    assert resolved["blocks.1.attn.q"] == "colwise" and resolved["blocks.1.attn.proj"] == "rowwise_sequence"
    assert resolved["blocks.0.mlp.0"] == "colwise" and resolved["blocks.0.mlp.2"] == "rowwise_sequence"
    assert resolved["tok_emb"] == "embedding_rowwise" and resolved["head"] == "colwise_rep"
    assert resolved["blocks.1.ln1"] == resolved["blocks.1.ln2"] == "sequence_parallel"
    assert resolved["blocks.1.attn"] == resolved["blocks.1.mlp"] == resolved["ln_f"] == "sequence_gather"
    assert resolved["blocks.0"] == "sequence_split" and "blocks.1" not in resolved
    assert len(resolved) == 2 * 10 + 4


@pytest.mark.unit
def test_a_sequence_the_group_cannot_split_is_refused_before_start_and_where_it_enters() -> None:
    """Sequence parallel splits each row's tokens over the group: data.seq_len=30 over 4 ranks is one line before
    start; a plan without sequence styles takes it; a row of 30 tokens reaching the first layer is refused there."""
    with pytest.raises(
        ValueError,
        match="data.seq_len=30 does not split over strategy.tp_size=4: GPT's own plan runs "
        "sequence parallel .* use a data.seq_len that 4 divides",
    ):
        TensorParallel(4, None, False).check(4, 4, _gpt(), seq_len=30)
    TensorParallel(4, {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}, False).check(4, 4, _gpt(), 30)
    TensorParallel(4, None, False).check(4, 4, _gpt(), seq_len=32)
    from strategies.tensor_parallel import _whole_parts

    with pytest.raises(ValueError, match="a micro-batch of 30 tokens per row does not split evenly"):
        _whole_parts(4, nn.Identity(), (torch.zeros(2, 30, 8),), {})
    with pytest.raises(ValueError, match="a micro-batch of 30 tokens per row does not split evenly"):
        _whole_parts(4, nn.Identity(), (), {"input": torch.zeros(2, 30, 8)})  # by keyword, as transformers pass it
    _whole_parts(4, nn.Identity(), (torch.zeros(2, 32, 8),), {})


@pytest.mark.unit
def test_a_transformers_llama_plan_is_read_from_the_model() -> None:
    """LlamaForCausalLM declares its plan (config.base_model_tp_plan, lm_head's in _tp_plan): read, nothing written."""
    llama = _llama()
    resolved = check_plan(llama, None, 2)
    assert resolved["model.layers.1.self_attn.k_proj"] == "colwise"
    assert resolved["model.layers.0.mlp.down_proj"] == "rowwise"
    assert resolved["lm_head"] == "colwise_gather_output"
    assert sum(name.startswith("model.layers.") for name in resolved) == 2 * 7
    with pytest.raises(ValueError, match="strategy.tp_size=4 does not divide num_key_value_heads=2"):
        check_plan(llama, None, 4)


@pytest.mark.unit
def test_a_users_plan_by_patterns_overrides_the_models() -> None:
    plan = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
    expected = {f"blocks.{i}.mlp.0": "colwise" for i in (0, 1)} | {f"blocks.{i}.mlp.2": "rowwise" for i in (0, 1)}
    assert check_plan(_gpt(), plan, 2) == expected
    assert check_plan(_gpt(n_head=1), plan, 2) == expected  # the MLPs alone: no head is split, any count will do


@pytest.mark.unit
def test_a_model_without_a_plan_is_one_line() -> None:
    with pytest.raises(ValueError, match="Sequential declares no tensor-parallel plan .* give one by module names"):
        check_plan(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), None, 2)


@pytest.mark.unit
def test_a_tied_weight_split_two_ways_is_refused() -> None:
    """The GPT's embedding is its head: split on the vocabulary by one, on the width by the other, it is refused."""
    with pytest.raises(
        ValueError,
        match="splits a tied weight two ways: tok_emb.weight \\(split on dim 0\\), head.weight \\(split on dim 1\\)",
    ):
        check_plan(_gpt(), {"tok_emb": "embedding_rowwise", "head": "rowwise"}, 2)


@pytest.mark.unit
def test_a_group_across_nodes_is_refused_unless_the_flag_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(
        ValueError,
        match="strategy.tp_size=4 spans nodes of gpus=2: .* use strategy.tp_size=2 or "
        "less, or strategy.tp_across_nodes=true",
    ):
        TensorParallel(4, None, False).check(8, 2, _gpt())
    TensorParallel(4, None, True).check(8, 2, _gpt())
    out = capsys.readouterr().out
    assert (
        "tensor parallel over 4 ranks: GPT's own plan splits 14 modules of GPT and runs 10 on each rank's part of "
        "the sequence" in out
    ), out


def test_measured_tp_traffic_is_the_planned(conformance_dir: Path) -> None:
    """The suite's TP=2 x DP=2 run (micro-batch 4 x 32 tokens, K = 2, fp32): its counter of DTensor's collectives
    against the plan's (`tp_collectives`). Per micro-step and layer, sequence parallel: the attention's and the MLP's
    inputs all-gathered and their gradients reduce-scattered, their rowwise outputs reduce-scattered and those
    gradients all-gathered (8 of 4 x 32 x 64 values, no all-reduce); outside the layers the embedding's all-reduce,
    the first layer's gradient all-gathered, the final norm's input all-gathered, the head's input all-reduced and
    its logits all-gathered (5). Per step the 4 norms' 2 weights, their partial gradients all-reduced once (8). The
    ring bytes by the planner's formula."""
    from launcher.plan.costs import comm_split
    from strategies.declarations import Mesh

    last = suite_run(conformance_dir, "fsdp_tp").metrics[-1]
    planned = tp_collectives(_gpt(), GPT._tp_plan, 4 * 32, 2, "fp32")
    assert last["tp_comm_calls"] == sum(c.times for c in planned) == 2 * (2 * 8 + 5) + 4 * 2
    assert last["tp_comm_bytes"] == sum(c.payload_bytes for c in planned)
    kinds = {c.kind for c in planned if c.elements == 4 * 32 * 64}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter"}
    within, across = comm_split(planned, 4, Mesh(tensor_size=2), 4)
    assert last["tp_comm_sent_bytes"] == pytest.approx(within, rel=1e-12) and across == 0


def test_convert_gives_the_whole_model_from_a_tensor_parallel_checkpoint(conformance_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step = suite_run(conformance_dir, "fsdp_tp").run_dir / "checkpoints" / "step_00000012"
    out = tmp_path / "model.safetensors"
    proc = cli_here(tmp_path, "convert", str(step), f"out={out}")
    assert proc.returncode == 0, proc.stderr
    model = GPT(**SUITE_GPT)
    converted = load_file(str(out))
    model.load_state_dict(converted, strict=True)  # every tensor whole: no rank's part
    dcp_to_torch_save(str(step), str(tmp_path / "full.pt"))
    saved = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    assert all(torch.equal(converted[k], saved[k]) for k in saved)


@pytest.mark.long  # 4 ranks, ~30 s on 2 busy cores; TP=2 x DP=2 under FSDP is the conformance suite's
def test_hsdp_with_tensor_parallel_is_a_3d_mesh_that_logs_one_process_losses(conformance_dir: Path) -> None:
    """strategy=hsdp strategy.tp_size=2 on 4 ranks: 2 replicas x 1 shard x TP=2, a 3-D mesh; its losses and
    gradient norms are one process's, its TP traffic the plan's, and its replicas' all-reduce is made."""
    from runs import reference, run_of

    run = run_of(conformance_dir, "hsdp", 4, "strategy.tp_size=2", "strategy.replicate_size=2", "strategy.shard_size=1")
    one = reference(conformance_dir)
    assert "tensor parallel over 2 ranks: GPT's own plan splits" in run.stdout
    diff = max(abs(a - b) for a, b in zip(run.losses(), one.losses(), strict=True))
    assert diff <= PARITY_TOLERANCE["hsdp"], (run.losses(), one.losses())
    norms = [(m["grad_norm"], r["grad_norm"]) for m, r in zip(run.metrics, one.metrics, strict=True)]
    assert max(abs(a - b) / b for a, b in norms) <= NORM_TOLERANCE["hsdp"], norms
    planned = tp_collectives(_gpt(), GPT._tp_plan, 4 * 32, 2, "fp32")
    assert run.metrics[-1]["tp_comm_bytes"] == sum(c.payload_bytes for c in planned)
    assert run.metrics[-1]["comm_calls"] > 0  # the replicas' all-reduce of each gradient


LLAMA = [
    "model=custom",
    "model._target_=transformers.AutoModelForCausalLM.from_config",
    "+model.config._target_=transformers.LlamaConfig",
    "+model.config.vocab_size=128",
    "+model.config.hidden_size=64",
    "+model.config.intermediate_size=128",
    "+model.config.num_hidden_layers=2",
    "+model.config.num_attention_heads=4",
    "+model.config.num_key_value_heads=2",
    "data=synthetic",
    "data.format=hf",
    "data.vocab_size=128",
    "batch.global_size=16",
    "batch.micro_size=2",
    "trainer.max_steps=6",
    *(o for o in TINY if not o.startswith(("model", "data"))),
]


@pytest.mark.long  # 4 ranks of a Llama and one process, ~60 s on 2 busy cores; the GPT's TP=2 x DP=2 parity is the
# conformance suite's, and the Llama plan's reading is tested in process above
def test_a_transformers_llama_at_tp2_dp2_logs_one_process_losses(tmp_path: Path) -> None:
    tp: Run = launch(tmp_path, *LLAMA, "strategy=fsdp_tp", "gpus=4", name="tp").check()
    one: Run = launch(tmp_path, *LLAMA, "strategy=ddp", "gpus=1", name="one").check()
    assert "LlamaForCausalLM's own plan splits 16 modules" in tp.stdout
    diff = max(abs(a - b) for a, b in zip(tp.losses(), one.losses(), strict=True))
    print(f"llama TP=2 x DP=2: max loss difference from one process {diff:.2e}")  # shown with pytest -s
    assert diff <= PARITY_TOLERANCE["fsdp_tp"], (tp.losses(), one.losses())
    assert tp.metrics[-1]["tp_comm_calls"] > 0


LLAMA_SEQUENCE_PLAN = (
    "strategy.tp_plan={model.embed_tokens: embedding_rowwise, model.layers.0: sequence_split, "
    "model.layers.*.input_layernorm: sequence_parallel, model.layers.*.self_attn: sequence_gather, "
    "model.layers.*.self_attn.q_proj: colwise, model.layers.*.self_attn.k_proj: colwise, "
    "model.layers.*.self_attn.v_proj: colwise, model.layers.*.self_attn.o_proj: rowwise_sequence, "
    "model.layers.*.post_attention_layernorm: sequence_parallel, model.layers.*.mlp: sequence_gather, "
    "model.layers.*.mlp.gate_proj: colwise, model.layers.*.mlp.up_proj: colwise, "
    "model.layers.*.mlp.down_proj: rowwise_sequence, model.norm: sequence_gather, lm_head: colwise_rep}"
)
"""torchtitan's Llama layout in the launcher's styles: the residual stream split on the sequence between layers. A
Llama decoder layer calls its attention with `hidden_states=` by keyword, which `sequence_gather` must gather."""


@pytest.mark.long  # 2 ranks of a Llama and one process
def test_a_transformers_llama_sequence_parallel_takes_hidden_states_by_keyword(tmp_path: Path) -> None:
    """TP=2 (DP=1) of a Llama under a sequence-parallel plan of the user's: its attention, given its hidden states by
    keyword, gets them gathered whole; the losses are one process's within fsdp_tp's declared tolerance."""
    tp: Run = launch(tmp_path, *LLAMA, "strategy=fsdp_tp", "gpus=2", LLAMA_SEQUENCE_PLAN, name="sp").check()
    one: Run = launch(tmp_path, *LLAMA, "strategy=ddp", "gpus=1", name="one").check()
    diff = max(abs(a - b) for a, b in zip(tp.losses(), one.losses(), strict=True))
    print(f"llama sequence parallel TP=2: max loss difference from one process {diff:.2e}")
    assert diff <= PARITY_TOLERANCE["fsdp_tp"], (tp.losses(), one.losses())


@pytest.mark.unit
def test_the_first_input_is_found_by_position_or_by_keyword() -> None:
    """What `sequence_gather` and `sequence_split` act on: a forward's first parameter, however the caller passes
    it; a forward that takes none by position has none."""
    from strategies.tensor_parallel import first_input_name

    class Keyword(torch.nn.Module):
        def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return hidden_states

    class OnlyKeywords(torch.nn.Module):
        def forward(self, *, x: torch.Tensor) -> torch.Tensor:
            return x

    assert first_input_name(Keyword()) == "hidden_states" and first_input_name(torch.nn.LayerNorm(4)) == "input"
    assert first_input_name(OnlyKeywords()) is None


@pytest.mark.unit
def test_plan_shows_tp_1_2_4_8_and_the_activations_traffic(tmp_path: Path) -> None:
    """gpt_7b on 8 GPUs, bf16, micro-batch 4 x 128 tokens, global 32: at T = 2 the data-parallel ranks are 4 and the
    accumulation 2. Per micro-step and layer (32) 4 all-gathers and 4 reduce-scatters, outside them 2 all-reduces and
    2 all-gathers of 4 x 128 x 4096 values, and the head's all-gather of 4 x 128 x 50304 logits; per step the norms'
    weights' gradients all-reduced; in a ring of 2 an all-reduce sends its whole buffer once, an all-gather or a
    reduce-scatter half of it; 2 bytes each."""
    proc = cli_here(tmp_path, "plan", "model=gpt_7b", "gpus=8", "precision=bf16")
    assert proc.returncode == 0, proc.stderr
    section = proc.stdout.split("\ntensor parallel (")[1].split("\npipeline parallel (")[0]  # the pipeline's follows
    rows = {int(line.split()[0]): line.split() for line in section.splitlines() if line[:4].strip().isdigit()}
    assert sorted(rows) == [1, 2, 4, 8] and [rows[t][1:3] for t in (1, 2, 4, 8)] == [
        ["8", "1"],
        ["4", "2"],
        ["2", "4"],
        ["1", "8"],
    ]
    tokens, hidden, vocab = 4 * 128, 4096, 50304
    # sequence parallel: per layer 4 all-gathers and 4 reduce-scatters (half the buffer each in a ring of 2); outside
    # the layers 2 all-reduces (embedding, head's input) and 2 all-gathers (first layer's gradient, final norm's input)
    per_micro = (32 * 8 * 0.5 + 2 + 2 * 0.5) * tokens * hidden * 2 + tokens * vocab * 0.5 * 2
    per_micro += 32 * 2 * 2 * hidden * 1.0 * 2 / 2  # the norms' weights' gradients, once per step of K = 2
    assert rows[2][-2] == f"{2 * per_micro / 1e9:.2f}" and rows[1][-2] == "0.00"
    acts = [float(rows[t][4]) for t in (1, 2, 4, 8)]
    assert acts == sorted(acts, reverse=True)  # the split layers' activations: 1/T


@pytest.mark.unit
def test_sequence_parallel_splits_every_activation_of_a_layer() -> None:
    """Korthikanti et al.'s per-layer activations: under tensor parallel alone the norms' and dropouts' inputs
    (10 s·b·h) stay whole; with sequence parallel a layer's activations are all 1/T, a checkpointed block's input
    too."""
    from launcher.plan.costs import activation_bytes

    shape = {"seq": 128, "micro": 4, "hidden": 256, "heads": 8, "vocab": 1000, "elem": 2}
    outside = activation_bytes(layers=0, **shape)
    one = activation_bytes(layers=1, **shape) - outside
    for t in (2, 4, 8):
        split = activation_bytes(layers=1, tensor=t, sequence=True, **shape) - outside
        assert split == pytest.approx(one / t, rel=1e-12)
        plain = activation_bytes(layers=1, tensor=t, **shape) - outside
        assert plain - split == pytest.approx(10 * 128 * 4 * 256 * (1 - 1 / t), rel=1e-12)
        kept = activation_bytes(layers=3, tensor=t, sequence=True, checkpointing=True, **shape)
        assert kept - outside - split == pytest.approx(3 * 128 * 4 * 256 * 2 / t, rel=1e-12)


@pytest.mark.unit
def test_an_auto_micro_batch_divides_the_global_batch_over_the_data_parallel_ranks(tmp_path: Path) -> None:
    """Under TP=2 on 4 ranks two groups read the global batch of 8: batch.micro_size=auto may take 4 (K = 1), which the
    4 ranks alone would not divide; the line's accumulation is the run's, micro x K x data ranks = the global batch."""
    proc = cli_here(
        tmp_path,
        "plan",
        *TINY,
        "strategy=fsdp_tp",
        "gpus=4",
        "batch.global_size=8",
        "batch.micro_size=auto",
        "plan.device_memory_gb=40",
    )
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("auto: batch.micro_size="))
    micro, accumulation = int(line.split("=")[1].split()[0]), int(line.split("(accumulation ")[1].split()[0])
    assert (micro, accumulation) == (4, 1), line


@pytest.mark.unit
def test_the_main_tables_tensor_parallel_row_holds_its_activations_and_traffic(tmp_path: Path) -> None:
    """`launch plan`'s row of fsdp_tp (T = 2 on 8 GPUs) is its section's T = 2 row: the activations split over the
    group, and FSDP's traffic plus the activations' in its comm figure; fsdp's row (T = 1) keeps the whole ones."""
    import json

    job = ["plan", "model=gpt_7b", "gpus=8", "precision=bf16"]
    table = cli_here(tmp_path, *job).stdout
    row = next(line.split() for line in table.splitlines() if line.startswith("   2 "))
    acts, fsdp, tp = float(row[4]), float(row[9]), float(row[10])
    plan = json.loads(cli_here(tmp_path, *job, "plan.format=json").stdout)
    by_name = {s["name"]: s for s in plan["strategies"]}
    assert by_name["fsdp_tp"]["activation_bytes"] / 1e9 == pytest.approx(acts, abs=0.006)
    assert by_name["fsdp_tp"]["comm_bytes"] / 1e9 == pytest.approx(fsdp + tp, abs=0.011)
    assert (
        by_name["fsdp"]["activation_bytes"]
        == plan["activations"]["bytes"]
        > 1.8 * by_name["fsdp_tp"]["activation_bytes"]
    )


@pytest.mark.unit
def test_launch_plan_figures_the_runs_own_tp_plan_not_the_models(tmp_path: Path) -> None:
    """With strategy.tp_plan set (here the MLPs alone), `launch plan`'s tensor section and the main table's fsdp_tp
    row count what that plan splits and sends, not what the model's own plan would."""
    import json

    import yaml

    from strategies.comm import ring_sent_elements
    from strategies.declarations import WIRE_BYTES
    from strategies.tp_plans import split_params

    mlp = {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}
    given = "strategy.tp_plan={" + ", ".join(f"{k}: {v}" for k, v in mlp.items()) + "}"
    job = ["plan", "model=gpt_7b", "gpus=8", "precision=bf16", "strategy=fsdp_tp"]
    own, mine = cli_here(tmp_path, *job), cli_here(tmp_path, *job, given)
    assert own.returncode == mine.returncode == 0, mine.stderr
    plan = json.loads(cli_here(tmp_path, *job, given, "plan.format=json").stdout)
    cfg = yaml.safe_load(cli_here(tmp_path, *job[1:], "--cfg", "job", "--resolve").stdout)
    m = {k: cfg["model"][k] for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")}
    with torch.device("meta"):
        model = GPT(**m)
    params = sum(p.numel() for p in model.parameters())
    share = f"{2 * m['n_layer']} modules planned, {split_params(model, resolve(model, mlp)) / params:.2%} of"
    assert share in mine.stdout and share not in own.stdout, mine.stdout

    def row(out: str) -> list[str]:
        return next(x.split() for x in out.split("tensor parallel (")[1].splitlines() if x.startswith("   2 "))

    seq, micro, accumulation = cfg["data"]["seq_len"], plan["batch"]["micro"], int(row(mine.stdout)[2])
    sent = sum(
        c.times * ring_sent_elements(c.elements, 2, c.kind) * WIRE_BYTES[c.dtype]
        for c in tp_collectives(model, mlp, micro * seq, accumulation, "bf16")
    )
    assert float(row(mine.stdout)[10]) == pytest.approx(sent / 1e9, abs=0.006)
    assert abs(float(row(own.stdout)[10]) - sent / 1e9) > 0.05
    fsdp_tp = next(s for s in plan["strategies"] if s["name"] == "fsdp_tp")
    assert fsdp_tp["comm_bytes"] / 1e9 == pytest.approx(float(row(mine.stdout)[9]) + sent / 1e9, abs=0.011)


@pytest.mark.long  # 2 ranks and one process of the suite's job (shared), ~30 s on 2 cores
def test_loss_parallel_keeps_the_logits_split_and_logs_one_process_losses(conformance_dir: Path) -> None:
    """strategy.loss_parallel=true under TP=2: the head's logits stay split by vocabulary and the cross-entropy runs
    on each rank's part (torch's loss_parallel), in training and in evaluation; the losses, the validation loss and
    the gradient norms are one process's, and torchmetrics' Perplexity, which reads the logits whole, is exp of the
    validation loss. The logits the head sends are not gathered: the step's TP traffic is the plan's less the head's
    all-gather in the forward (the cross-entropy's own all-reduces are over one value per token)."""
    import math

    from runs import reference, run_of

    ppl = ["+trainer.metrics.ppl._target_=torchmetrics.text.Perplexity", "+trainer.metrics.ppl.ignore_index=-100"]
    run = run_of(conformance_dir, "fsdp_tp", 2, "strategy.loss_parallel=true", *ppl)
    one = reference(conformance_dir)
    assert "the loss on head's logits split by vocabulary (loss_parallel)" in run.stdout
    diff = max(abs(a - b) for a, b in zip(run.losses(), one.losses(), strict=True))
    assert diff <= PARITY_TOLERANCE["fsdp_tp"], (run.losses(), one.losses())
    val = [(m["val_loss"], r["val_loss"]) for m, r in zip(run.metrics, one.metrics, strict=True) if "val_loss" in r]
    assert val and max(abs(a - b) for a, b in val) <= PARITY_TOLERANCE["fsdp_tp"], val
    norms = [(m["grad_norm"], r["grad_norm"]) for m, r in zip(run.metrics, one.metrics, strict=True)]
    assert max(abs(a - b) / b for a, b in norms) <= NORM_TOLERANCE["fsdp_tp"], norms
    logged = next(m for m in run.metrics if "val/ppl" in m)
    assert logged["val/ppl"] == pytest.approx(math.exp(logged["val_loss"]), rel=1e-6), logged
    planned = sum(c.payload_bytes for c in tp_collectives(_gpt(), GPT._tp_plan, 4 * 32, 4, "fp32"))  # K = 16 / 4
    gathered = 4 * (4 * 32 * SUITE_GPT["vocab_size"]) * 4  # the head's logits gathered whole, each micro-step, fp32
    assert run.metrics[-1]["tp_comm_bytes"] < planned - gathered / 2, (run.metrics[-1]["tp_comm_bytes"], planned)
    norm = max(abs(a - b) / b for a, b in norms)
    print(f"loss_parallel tp=2: loss {diff:.2e}, val_loss {max(abs(a - b) for a, b in val):.2e}, grad norm {norm:.2e}")
    print(f"tp_comm_bytes {run.metrics[-1]['tp_comm_bytes']:.0f} against {planned:.0f} with the logits gathered")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["strategy=fsdp"], "strategy.loss_parallel=true but strategy.tp_size=1 splits no logits; set"),
        (
            ["strategy=fsdp_tp", "strategy.tp_plan={blocks.*.mlp.0: colwise, blocks.*.mlp.2: rowwise}", "gpus=2"],
            "strategy.loss_parallel=true: strategy.tp_plan gathers no layer's output whole (colwise_rep or",
        ),
        (["strategy=ddp"], "unknown key 'strategy.loss_parallel' for this strategy; tensor parallel runs under FSDP2"),
        (
            ["strategy=fsdp_tp", "strategy.pp_size=2", "gpus=4", "batch.global_size=16", "batch.micro_size=2"],
            "strategy.loss_parallel=true with strategy.pp_size=2: the loss on split logits does not compose",
        ),
    ],
)
def test_loss_parallel_is_refused_where_it_splits_nothing(overrides: list[str], expected: str, tmp_path: Path) -> None:
    from conftest import launch_here

    said = launch_here(tmp_path, *TINY, "gpus=2", *overrides, "strategy.loss_parallel=true").refused()
    assert expected in said, said
