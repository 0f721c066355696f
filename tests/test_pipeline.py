"""Pipeline parallel (`strategy.pp_size`, `strategies.pipeline`): the split keeps the whole model's names and
gradients, PP x DP trains what one process trains on the same global batch under each of torch's schedules, its
checkpoint resumes in one process, and what cannot run is refused before any worker starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, Run, cli_here, launch, launch_here
from runs import JOB, NORM_TOLERANCE, shared_run
from test_checkpoint import _ckpt, _max_diff

from launcher.config import schema
from launcher.config.context import preset_strategy

schema.register()
PP = preset_strategy("fsdp", pp_size=2)
TOLERANCE = PP.conformance().tolerance
"""The pipeline's declared loss tolerance from one process (`PipelineFSDP.conformance`): each stage computes one
process's sums in another order of fp32 additions, as FSDP does."""
NORM = NORM_TOLERANCE["fsdp"]
"""Its gradient norm's: FSDP's, the norm's squares summed over the stages once more."""


def _compare(pp: Run, one: Run) -> tuple[float, float, float]:
    """(largest loss difference, largest validation-loss difference, largest relative grad-norm difference)."""
    a, b = pp.metrics, one.metrics
    assert [m["step"] for m in a] == [m["step"] for m in b]
    loss = max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))
    val = max(abs(x["val_loss"] - y["val_loss"]) for x, y in zip(a, b) if "val_loss" in y)
    norm = max(abs(x["grad_norm"] - y["grad_norm"]) / y["grad_norm"] for x, y in zip(a, b))
    assert all(x["lr"] == y["lr"] for x, y in zip(a, b))
    return loss, val, norm


def test_pp2_dp2_follows_one_process_and_its_checkpoint_resumes_in_one_process(
    conformance_dir: Path, one_process: Run, tmp_path: Path
) -> None:
    """1F1B, 2 stages x 2 data-parallel ranks of the suite's job (padded samples: micro-batches of unequal targets,
    the tied head on the last stage, validation at 6 and 12) against one process; then its step-6 checkpoint (the
    whole model's names) resumed in one process under ddp goes on with its losses, and `launch convert` writes the
    whole model."""
    pp = shared_run(conformance_dir, "strategy=fsdp", "strategy.pp_size=2", "gpus=4")
    assert (
        "launch: pipeline: 2 stages of GPT by layers (1f1b, 2 micro-batches): 0: blocks.0-0, 1: blocks.1-1" in pp.stdout
    )
    loss, val, norm = _compare(pp, one_process)
    print(f"pp=2 x dp=2 1f1b: loss {loss:.2e}, val_loss {val:.2e}, grad norm {norm:.2e} (relative)")
    assert loss <= TOLERANCE and val <= TOLERANCE and norm <= NORM
    _sent_as_planned(pp, "1f1b")
    resumed = launch(tmp_path, *JOB, "strategy=ddp", "gpus=1", f"resume={_ckpt(pp, 6)}").check()
    assert _max_diff(pp, resumed, range(7, 13)) <= 2 * TOLERANCE
    # launch convert writes the whole model, every tensor under its own name, which the plain model loads strictly.
    from safetensors.torch import load_file

    from launcher.models.gpt import GPT

    out = tmp_path / "model.safetensors"
    assert cli_here(tmp_path, "convert", str(_ckpt(pp, 12)), f"out={out}").returncode == 0
    GPT(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=32).load_state_dict(load_file(out), strict=True)


@pytest.mark.long  # two resumes at 4 ranks
def test_checkpoints_cross_between_pipeline_and_other_layouts(
    conformance_dir: Path, ddp_run: Run, tmp_path: Path
) -> None:
    """DDP's step-6 checkpoint (2 ranks) resumed under PP=2 x DP=2 goes on with DDP's losses; the PP=2 x DP=2 run's
    step-6 checkpoint resumed under ZeRO-3 at world 4 (DeepSpeed's partitions from the whole model's names) goes on
    with the pipeline's. Each within the pipeline's declared tolerance (both layouts hold one process's losses)."""
    pp = shared_run(conformance_dir, "strategy=fsdp", "strategy.pp_size=2", "gpus=4")
    into_pp = launch(
        tmp_path, *JOB, "strategy=fsdp", "strategy.pp_size=2", "gpus=4", f"resume={_ckpt(ddp_run, 6)}", name="into-pp"
    ).check()
    assert _max_diff(ddp_run, into_pp, range(7, 13)) <= 2 * TOLERANCE
    out_of_pp = launch(tmp_path, *JOB, "strategy=zero3", "gpus=4", f"resume={_ckpt(pp, 6)}", name="out-of-pp").check()
    assert _max_diff(pp, out_of_pp, range(7, 13)) <= 2 * TOLERANCE


DEEPER = ("model.n_layer=4",)


@pytest.mark.long  # 4 ranks and 12 steps per schedule; 1F1B's run above (the same job) is the default tier's
@pytest.mark.parametrize(
    "schedule,strategy",
    [(s, "fsdp") for s in ("gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")] + [("1f1b", "hsdp")],
)
def test_each_schedule_at_pp2_dp2_follows_one_process(
    schedule: str, strategy: str, conformance_dir: Path, tmp_path: Path
) -> None:
    """4 layers: 2 stages, or 4 on 2 ranks for the looped schedules (zbv's in a V); hsdp: 2 replicas of 1 shard."""
    one = shared_run(conformance_dir, "strategy=ddp", "gpus=1", *DEEPER)
    mesh = ["strategy.shard_size=1"] if strategy == "hsdp" else []
    overrides = [f"strategy={strategy}", *mesh, "strategy.pp_size=2", f"strategy.pp_schedule={schedule}", "gpus=4"]
    pp = launch(tmp_path, *JOB, *DEEPER, *overrides).check()
    loss, val, norm = _compare(pp, one)
    print(f"pp=2 x dp=2 {schedule}: loss {loss:.2e}, val_loss {val:.2e}, grad norm {norm:.2e} (relative)")
    assert loss <= TOLERANCE and val <= TOLERANCE and norm <= NORM
    _sent_as_planned(pp, schedule)


@pytest.mark.long  # 8 ranks
def test_pp2_tp2_dp2_follows_one_process(conformance_dir: Path, one_process: Run, tmp_path: Path) -> None:
    """Three mesh dimensions, PP=2 x TP=2 x DP=2 on 8 ranks, the suite's job: each stage split by the GPT's own
    tensor-parallel plan (sequence parallel: what a stage sends is its rank's half of the sequence), then sharded by
    FSDP2; the tied head on the last stage, split as the first stage's embedding is. One process's losses, validation
    losses and gradient norms; the activations' collectives counted as under fsdp_tp."""
    pp = launch(tmp_path, *JOB, "strategy=fsdp", "strategy.pp_size=2", "strategy.tp_size=2", "gpus=8").check()
    assert "data-parallel 2 = global 16" in pp.stdout and "tensor parallel over 2 ranks" in pp.stdout
    loss, val, norm = _compare(pp, one_process)
    print(f"pp=2 x tp=2 x dp=2 1f1b: loss {loss:.2e}, val_loss {val:.2e}, grad norm {norm:.2e} (relative)")
    assert loss <= TOLERANCE and val <= TOLERANCE and norm <= NORM
    _sent_as_planned(pp, "1f1b", sequence_parts=2)
    assert all(m["tp_comm_bytes"] > 0 for m in pp.metrics)
    # Its step-6 checkpoint (DCP, each stage's shards over two mesh dimensions, the whole model's names) resumed in
    # one process goes on with its losses.
    resumed = launch(tmp_path, *JOB, "strategy=ddp", "gpus=1", f"resume={_ckpt(pp, 6)}", name="one").check()
    assert _max_diff(pp, resumed, range(7, 13)) <= 2 * TOLERANCE


BF16_BOUND = 0.05
"""test_fsdp's bound for bf16 against fp32 on the suite's job: bf16 keeps 8 bits of mantissa (a relative rounding of
4e-3 per value), so its losses are one process's to a few 1e-3, not to fp32's 1e-6."""


@pytest.mark.long  # 4 ranks
def test_bf16_under_the_pipeline_computes_and_sends_in_bf16(
    conformance_dir: Path, one_process: Run, tmp_path: Path
) -> None:
    """precision=bf16 at PP=2 x DP=2: each stage's blocks compute in bf16 (FSDP2's mixed precision) and the hidden
    states cross between stages in bf16, half fp32's bytes; the losses fall and stay within bf16's rounding of one
    fp32 process's, as FSDP's without a pipeline do."""
    pp = launch(tmp_path, *JOB, "strategy=fsdp", "strategy.pp_size=2", "gpus=4", "precision=bf16").check()
    losses = pp.losses()
    diff = max(abs(a - b) for a, b in zip(losses, one_process.losses(), strict=True))
    print(f"pp=2 x dp=2 bf16: max loss difference from one fp32 process {diff:.2e}")
    assert losses[-1] < losses[0] and 1e-6 < diff < BF16_BOUND
    _sent_as_planned(pp, "1f1b")


def _sent_as_planned(pp: Run, schedule: str, sequence_parts: int = 1) -> None:
    """Every step's counted activations and gradients between stages (`pp_sent_bytes`, the largest rank's) are the
    plan's figure for the run's shape: M micro-batches of micro x seq x n_embd fp32 values over each boundary a rank
    sends over (`launcher.plan.pipeline.stage_bytes_sent`), each rank's part of the sequence under a sequence-parallel
    plan (`sequence_parts`: the tensor-parallel size)."""
    from omegaconf import OmegaConf

    from launcher.plan.pipeline import stage_bytes_sent

    cfg = OmegaConf.load(pp.run_dir / "resolved.yaml")
    value = 4 if cfg.precision == "fp32" else 2  # bf16: the hidden state crosses in the blocks' dtype
    hidden = cfg.batch.micro_size * cfg.data.seq_len // sequence_parts * cfg.model.n_embd * value
    accumulation = pp.metrics[-1]["accumulation"]
    planned = stage_bytes_sent(schedule, 2, 2, accumulation, hidden)
    assert planned > 0 and [m["pp_sent_bytes"] for m in pp.metrics] == [planned] * len(pp.metrics), planned


LLAMA = [
    "model=custom",
    "model._target_=transformers.AutoModelForCausalLM.from_config",
    "+model.config._target_=transformers.LlamaConfig",
    "+model.config.vocab_size=128",
    "+model.config.hidden_size=64",
    "+model.config.intermediate_size=128",
    "+model.config.num_hidden_layers=4",
    "+model.config.num_attention_heads=4",
    "+model.config.num_key_value_heads=2",
    "data=synthetic",
    "data.format=hf",
    "data.vocab_size=128",
    "batch.global_size=16",
    "batch.micro_size=2",
    "trainer.max_steps=4",
    *(o for o in TINY if not o.startswith(("model", "data"))),
]


@pytest.mark.long  # 4 and 8 ranks of a Llama and one process; the split of a Llama is tested in process below
@pytest.mark.parametrize("tp", [1, 2])
def test_a_transformers_llama_at_pp2_dp2_logs_one_process_losses(tp: int, tmp_path: Path) -> None:
    """PP=2 x DP=2, and PP=2 x TP=2 x DP=2 by the Llama's own tensor-parallel plan (transformers'), 8 ranks."""
    pp = launch(
        tmp_path,
        *LLAMA,
        "strategy=fsdp",
        "strategy.pp_size=2",
        f"strategy.tp_size={tp}",
        "strategy.pp_balance=params",
        f"gpus={4 * tp}",
        name="pp",
    ).check()
    one = launch(tmp_path, *LLAMA, "strategy=ddp", "gpus=1", name="one").check()
    assert "stages of LlamaForCausalLM by params" in pp.stdout
    assert ("LlamaForCausalLM's own plan splits" in pp.stdout) == (tp > 1)
    diff = max(abs(a - b) for a, b in zip(pp.losses(), one.losses(), strict=True))
    print(f"llama pp=2 x tp={tp} x dp=2: max loss difference from one process {diff:.2e}")
    assert diff <= TOLERANCE


# ---------------------------------------------------------------------------------------------- the split, in process


def _gpt() -> torch.nn.Module:
    from launcher.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def _batch(kind: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    if kind == "gpt":
        targets = ids[:, 1:].clone()
        targets[0, :3] = -100
        return {"idx": ids[:, :-1], "targets": targets}
    labels = ids[:, :-1].clone()
    labels[0, :3] = -100
    return {"input_ids": ids[:, :-1], "labels": labels}


def _gpt2() -> torch.nn.Module:
    """transformers' GPT-2: its layers in `transformer.h`, its head tied to the token embedding (first and last
    stage), a learned position embedding beside it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0)
    config.embd_pdrop = config.attn_pdrop = 0.0  # dropout draws differ between one forward and the stages
    return GPT2LMHeadModel(config)


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2"])
@pytest.mark.parametrize("stages", [2, 4])
def test_stages_run_in_turn_give_the_whole_models_loss_and_gradients_under_its_names(kind: str, stages: int) -> None:
    """Each model split into stages run one after another: the whole model's loss, each parameter's gradient (a tied
    one's summed over the stages that hold a copy: the GPT's and GPT-2's head on the last, their embedding on the
    first) and its state dict's names."""
    from strategies.pipeline_layout import plan_split
    from strategies.pipeline_stages import Stage, prune

    whole = {"gpt": _gpt, "llama": _llama, "gpt2": _gpt2}[kind]()
    batch = _batch(kind)
    split = plan_split(whole, stages, None, "layers", stages, "1f1b")
    parts = [Stage(prune(whole, split, i), split, i) for i in range(stages)]
    for part in parts:
        part.hook()
    out = whole(**batch)
    loss = out["loss_sum"] if kind == "gpt" else out.loss
    loss.backward()
    hidden: object = None
    for part in parts:
        hidden = part(**batch) if part.is_first else part(hidden, **batch)
    result = parts[-1].rebuild(hidden)  # type: ignore[arg-type]
    staged = result["loss_sum"] if kind == "gpt" else result.loss
    staged.backward()
    assert float(staged.detach()) == float(loss.detach())
    names: dict[str, list[torch.nn.Parameter]] = {}
    for part in parts:
        for name, p in part.named_parameters():
            names.setdefault(name, []).append(p)
    assert set(names) == set(dict(whole.named_parameters()))  # the whole model's names, a tied one under its first
    for name, p in whole.named_parameters():
        summed = sum(q.grad for q in names[name] if q.grad is not None)
        assert torch.equal(summed, p.grad), name
    assert set().union(*(part.state_dict() for part in parts)) == set(whole.state_dict())


@pytest.mark.unit
@pytest.mark.parametrize("P,D,T", [(2, 4, 2), (4, 2, 1), (2, 1, 4), (1, 4, 2)])
def test_a_pipelines_ranks_read_one_slice_of_the_batch_where_the_mesh_puts_them(P: int, D: int, T: int) -> None:
    """The mesh is pp x data parallel x tp over the ranks in order (torch's `init_device_mesh`: row-major): every
    rank of data-parallel coordinate d, whatever its stage and tensor-parallel place, reads slice d of each global
    batch, and the D slices are read by P x T ranks each."""
    from strategies import RunContext

    mesh = torch.arange(P * D * T).reshape(P, D, T)
    for rank in range(P * D * T):
        ctx = RunContext("cpu", rank, rank, P * D * T, "fp32", 0.0, 1, 1, tensor_size=P * T, pipeline_size=P)
        assert ctx.data_world == D and rank in mesh[:, ctx.data_rank, :].flatten().tolist()


@pytest.mark.unit
def test_the_split_balances_by_layers_or_parameters_and_takes_named_points() -> None:
    from strategies.pipeline_layout import plan_split

    gpt = _gpt()
    assert plan_split(gpt, 2, None, "layers", 2, "1f1b").ranges == ((0, 2), (2, 4))
    # The embedding (64 x 32) and the position embedding on the first stage outweigh a block (~12.7k): by parameters
    # the first stage takes fewer blocks; the tied head counts once, on the first stage's embedding.
    by_params = plan_split(gpt, 2, None, "params", 2, "1f1b")
    assert by_params.ranges[0][1] <= 2
    assert plan_split(gpt, 3, [1, 3], "layers", 3, "1f1b").ranges == ((0, 1), (1, 3), (3, 4))
    with pytest.raises(ValueError, match=r"strategy.pp_split=\[3, 1\] does not split blocks's 4 layers into the 3"):
        plan_split(gpt, 3, [3, 1], "layers", 3, "1f1b")
    with pytest.raises(ValueError, match="makes 8 stages, more than blocks's 4 layers"):
        plan_split(gpt, 8, None, "layers", 4, "interleaved_1f1b")
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="has no layer list the launcher can split .* e.g. strategy.pp_split=\\[4\\]"):
        plan_split(flat, 2, None, "layers", 2, "1f1b")


@pytest.mark.unit
def test_the_split_by_parameters_is_the_best_of_every_split_and_takes_no_combinatorial_time() -> None:
    """Against trying every split (small models of random layer sizes): the same smallest largest stage, and of the
    splits that reach it the one whose cuts come first; then 80 layers into 16 stages, C(79, 15) splits to try."""
    import itertools
    import random

    from strategies.pipeline_layout import plan_split

    def model(sizes: list[int], pre: int, post: int) -> torch.nn.Module:
        m = torch.nn.Module()
        m.pre = torch.nn.Linear(pre, 1, bias=False)
        m.blocks = torch.nn.ModuleList(torch.nn.Linear(size, 1, bias=False) for size in sizes)
        m.post = torch.nn.Linear(post, 1, bias=False)
        return m

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 8)
        stages, sizes, pre, post = (
            rng.randint(2, n),
            [rng.choice([1, 2, 3, 5, 8]) for _ in range(n)],
            *rng.choices(range(1, 5), k=2),
        )
        tried = []
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = [0, *cuts, n]
            loads = [sum(sizes[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
            tried.append((max(loads[0] + pre, loads[-1] + post, *loads[1:-1]), tuple(zip(bounds[:-1], bounds[1:]))))
        best = min(load for load, _ in tried)
        first = next(ranges for load, ranges in tried if load == best)
        assert plan_split(model(sizes, pre, post), stages, None, "params", stages, "1f1b").ranges == first, sizes
    deep = plan_split(model([4] * 80, 4, 4), 16, None, "params", 8, "interleaved_1f1b")
    assert len(deep.ranges) == 16 and deep.ranges[-1][1] == 80


# ---------------------------------------------------------------------------------------------- refused before start

PP4 = [
    *TINY,
    "model.n_layer=4",
    "gpus=4",
    "strategy=fsdp",
    "strategy.pp_size=2",
    "batch.global_size=8",
    "batch.micro_size=2",
]


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["batch.micro_size=4"],
            "strategy.pp_schedule=1f1b needs at least pp_size=2 micro-batches per step; the step has 1",
        ),
        (
            ["batch.micro_size=1", "strategy.pp_schedule=interleaved_1f1b", "batch.global_size=10"],
            "strategy.pp_schedule=interleaved_1f1b needs the micro-batches a multiple of its rounds (2 = K // pp_size)",
        ),
        (["strategy.pp_size=3"], "strategy.pp_size=3 does not divide the world size 4 (nodes x gpus); use one of"),
        (["strategy.pp_split=[1,2]"], "strategy.pp_split=[1, 2] does not split blocks's 4 layers into the 2 stages"),
        (
            ["strategy.pp_schedule=interleaved_1f1b", "strategy.pp_stages_per_rank=3", "batch.micro_size=1"],
            "makes 6 stages, more than blocks's 4 layers",
        ),
        (["strategy.pp_schedule=looped"], "strategy.pp_schedule=looped is none of gpipe, 1f1b"),
        (["precision=fp16"], "precision=fp16 with strategy.pp_size=2: fp16's loss scaling (use precision=bf16)"),
        (
            ["strategy.tp_size=2", "data.seq_len=31"],
            "data.seq_len=31 does not split over strategy.tp_size=2",
        ),
        (["optim=muon"], "(Muon) with strategy.pp_size=2: Muon does not compose with pipeline parallel here"),
        (["strategy=ddp"], "pipeline parallel runs under FSDP2 alone"),
        (["nodes=1:2", "trainer.max_restarts=3"], "nodes=1:2 (elastic) with strategy.pp_size=2: it does not compose"),
        (["trainer.memory_checkpoint_every=2"], "trainer.memory_checkpoint_every (the memory tier) with strategy.pp"),
        (["strategy.pp_schedule=zbv", "strategy.pp_stages_per_rank=3"], "zbv holds exactly 2 stages per rank"),
    ],
)
def test_what_cannot_run_is_refused_before_start(overrides: list[str], expected: str, tmp_path: Path) -> None:
    line = launch_here(tmp_path, *PP4, *overrides).refused()
    assert expected in line, line


@pytest.mark.unit
def test_a_mixture_is_refused_before_start(tmp_path: Path) -> None:
    source = "{weight:1,_target_:launcher.data.builtin.Synthetic,seq_len:32,num_samples:512}"
    base = [o for o in PP4 if not o.startswith("data")]
    line = launch_here(tmp_path, *base, "data=mix", "model.block_size=32", f"data.sources={{a:{source}}}").refused()
    assert "data=mix with strategy.pp_size=2: a mixture's losses per source do not compose" in line, line


@pytest.mark.unit
def test_launch_plan_has_a_pipeline_section_of_each_size_and_schedule(tmp_path: Path) -> None:
    """Rows for P = 1, 2, 4 (gpt_tiny's 4 layers hold no 8 stages): 1F1B's bubble (P-1)/(M+P-1), and the bytes a
    rank sends, 2 boundaries of an inner stage's rank, 1 of an end's."""
    from launcher.plan.pipeline import boundary_sends, bubble

    proc = cli_here(tmp_path, "plan", "model=gpt_tiny", "strategy=fsdp", "strategy.pp_size=2", "gpus=8")
    assert proc.returncode == 0, proc.stderr
    assert "the pipeline section below has each stage's" in proc.stderr
    rows = {tuple(line.split()[:2]): line.split() for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert rows[("1", "fsdp")][-1] == "0.00" and rows[("2", "1f1b")][-2] == f"{1 / 3:.1%}"
    assert rows[("4", "1f1b")][-2] == f"{3 / 7:.1%}" and "more stages than layers" in " ".join(rows[("8", "gpipe")])
    assert [boundary_sends("1f1b", 4, 1, r) for r in range(4)] == [1, 2, 2, 1]
    assert [boundary_sends("zbv", 2, 2, r) for r in range(2)] == [2, 2]  # the V's turn stays on rank 1
    assert [boundary_sends("interleaved_1f1b", 2, 2, r) for r in range(2)] == [3, 3]
    assert bubble("interleaved_1f1b", 4, 8, 2) == 3 / 19 and bubble("gpipe", 1, 8) == 0.0
    # With TP=2 in each stage: half the data-parallel ranks, twice the micro-batches, and each hidden state sent is a
    # rank's half of the sequence (the GPT's plan is sequence parallel): the same bytes as above.
    tp = cli_here(
        tmp_path, "plan", "model=gpt_tiny", "strategy=fsdp", "strategy.pp_size=2", "strategy.tp_size=2", "gpus=8"
    )
    assert tp.returncode == 0, tp.stderr
    section = tp.stdout[tp.stdout.index("pipeline parallel (") :]
    assert "strategy.tp_size=2;" in section and "(data = G/(P x T)" in section
    split = {tuple(line.split()[:2]): line.split() for line in section.splitlines() if line.startswith("  ")}
    assert split[("2", "1f1b")][2:4] == ["2", "4"] and rows[("2", "1f1b")][2:4] == ["4", "2"]
    assert split[("2", "1f1b")][-1] == rows[("2", "1f1b")][-1] and ("8", "gpipe") not in split  # 8 x 2 > 8 ranks


def test_a_non_finite_loss_on_the_last_stage_is_not_committed(tmp_path: Path) -> None:
    """PP=2 x DP=2: the last stage of the first pipeline (rank 2: stage 1's first data-parallel rank) adds NaN to its
    loss alone (its gradient stays finite) in one micro-batch; under trainer.nonfinite=skip that step is dropped on
    every rank, its checkpoint every tensor of the one before, and the run goes on."""
    from test_guards import _equal, _flat, _nan_run, _state, _strict

    pp = ["gpus=4", "strategy=fsdp", "strategy.pp_size=2", "batch.global_size=8", "batch.micro_size=2"]
    skip = ("trainer.max_steps=4", "trainer.nonfinite=skip", "trainer.max_skipped=2")
    run = _nan_run(tmp_path, "5", *pp, *skip, rank=2)
    assert run.returncode == 0, run.stderr
    records = _strict(run.run_dir / "metrics.jsonl")
    assert records[-1]["skipped_steps"] == 1, records
    step = next(m["step"] for m in records if m["skipped_steps"] == 1)
    assert f"launch: skipped step {step}: the loss is nan on rank 2 (micro-step " in run.stdout, run.stdout
    folder = run.run_dir / "checkpoints"
    before, skipped = (_flat(_state(folder / f"step_{s:08d}", tmp_path / f"{s}.pt")) for s in (step - 1, step))
    assert _equal(before, skipped)


ACROSS = [  # a 7B GPT of 4096-token rows, two nodes of 8, each stage a node, 2 micro-batches per step
    "model=gpt_7b",
    "strategy=fsdp",
    "strategy.pp_size=2",
    "precision=bf16",
    "data.seq_len=4096",
    "batch.global_size=16",
    "batch.micro_size=1",
    "nodes=2",
    "gpus=8",
    "trainer.peak_tflops=989",
]


def _weighed(*overrides: str) -> tuple[Any, Any, Any]:
    from hydra import compose, initialize_config_module

    from launcher.config import derive, freeze
    from launcher.models.meta import build_on_meta

    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = freeze(compose("config", overrides=[*ACROSS, *overrides]))
    return cfg, derive(cfg, 0), build_on_meta(cfg.model)


@pytest.mark.unit
def test_a_pipeline_across_nodes_is_weighed_against_fsdp_over_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """Where its stages are on different nodes, the plan weighs the pipeline (its bubble, (P-1)/(M+P-1) of the step,
    and the hidden states it sends between nodes) against FSDP over every rank (its gathers on the network): at
    50 GB/s between nodes the pipeline saves more than it costs and runs, said in one line; at 400 GB/s FSDP's
    gathers cost less than the bubble, and the pipeline is refused unless strategy.pp_across_nodes accepts it."""
    from launcher.config import ConfigError
    from launcher.plan.pipeline import check_pipeline_nodes, stage_bytes_sent, step_seconds

    cfg, derived, model = _weighed("plan.internode_gbps=50")
    pipelined, flat, bubble, sent = step_seconds(model, cfg, 16, 8, 989e12)
    M = 16 // (1 * 8)  # the global batch over a stage's 8 data-parallel ranks, a micro-batch of 1
    assert bubble == pytest.approx(1 / (M + 1)) and sent == stage_bytes_sent("1f1b", 2, 2, M, 4096 * 4096 * 2)
    assert pipelined < flat
    check_pipeline_nodes(cfg, derived, model)
    said = capsys.readouterr().out
    assert said.startswith("launch: pipeline across 2 nodes: the plan puts a step at ") and "a 33% bubble" in said

    cfg, derived, model = _weighed("plan.internode_gbps=400")
    pipelined, faster, _, _ = step_seconds(model, cfg, 16, 8, 989e12)
    assert faster < flat and pipelined > faster  # the network's speed is FSDP's gain alone: the stages' is in a node
    with pytest.raises(ConfigError, match=r"^strategy.pp_size=2 across 2 nodes costs more than it saves: the plan"):
        check_pipeline_nodes(cfg, derived, model)
    check_pipeline_nodes(*_weighed("plan.internode_gbps=400", "strategy.pp_across_nodes=true"))
    assert capsys.readouterr().out == ""


@pytest.mark.unit
def test_a_pipeline_across_nodes_that_costs_more_than_it_saves_is_refused_before_start(tmp_path: Path) -> None:
    """The same refusal from `launch`, one line naming the key that accepts it, before anything is written."""
    rdzv = ["rdzv.endpoint=127.0.0.1:29999", "rdzv.id=pp"]
    said = launch_here(tmp_path, *ACROSS, "plan.internode_gbps=400", *rdzv, name="pp").refused()
    assert said.startswith("launch: error: strategy.pp_size=2 across 2 nodes costs more than it saves: "), said
    assert said.endswith("or strategy.pp_across_nodes=true to run it anyway"), said
    assert not (tmp_path / "pp" / "resolved.yaml").exists()
