"""Evaluation: metrics of the user's choice (a torchmetrics Metric by `_target_`, a function returning sums and
counts) reduced over ranks exactly, and a model in nanoGPT's shape (built from a config object, `(logits, loss)`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import Run, launch_here, launch_once
from runs import PARITY_TOLERANCE, jobs, metrics, smoke

NANO = [
    "model=custom",
    "model._target_=eval_models.NanoClassifier",
    "+model.config._target_=eval_models.NanoConfig",
    "+model.config.channels=4",
    "+model.config.width=16",
    "data=custom",
    "data._target_=eval_models.images",
    "+data.channels=4",
]
"""A classifier in nanoGPT's shape, on 64 training images and 13 validation images (an odd number)."""
METRICS = [
    "+trainer.metrics.accuracy._target_=torchmetrics.classification.MulticlassAccuracy",
    "+trainer.metrics.accuracy.num_classes=4",
    "+trainer.metrics.accuracy.average=micro",
    "+trainer.metrics.right._target_=eval_models.correct",
]
JOB = [
    "batch.global_size=8",
    "batch.micro_size=2",
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.eval_batches=2",
    "optim.lr=0.1",
    "trainer.warmup_steps=1",
    "trainer.save_at_end=true",
]
"""The 13 validation samples each once per evaluation: fewer than 2 global batches of 8, so the set is read whole, its
second batch partial (5 samples: 3 and 2 at 2 ranks, micro-batches of 2, 1, 1 and 1)."""
EXACT = 1e-7
"""How far the validation figures may be from one plain process over the same samples and weights: both forward in
float32; the launcher adds each micro-batch's float32 mean (cross_entropy's) times its samples in float64, the
reference takes the float64 mean of the same logits' losses, so they differ by the rounding of a few float32 means
(measured: 3.5e-8 on a loss near 1.5 over 13 samples, 5e-9 over 301; the accuracy, a count of right predictions,
exactly)."""


def plain_figures(checkpoint: Path, count: int = 13, classes: int = 4, channels: int = 4, width: int = 16) -> dict:
    """The classifier's validation loss and accuracy over its `count` validation images, with the checkpoint's
    weights, in one plain torch forward in this process: the figures one process over all of them gives."""
    import torch
    import torch.nn.functional as F
    from eval_models import NanoClassifier, NanoConfig, images

    from launcher.parent.convert import weights

    model = NanoClassifier(NanoConfig(channels=channels, classes=classes, width=width))
    model.load_state_dict(weights(checkpoint))
    data = images("val", val_count=count, channels=channels)
    x, y = torch.stack([data[i][0] for i in range(count)]), torch.stack([data[i][1] for i in range(count)])
    with torch.no_grad():
        logits, _ = model.eval()(x, y)
    right = float((logits.argmax(dim=-1) == y).double().mean())
    return {"val_loss": float(F.cross_entropy(logits.double(), y)), "val/accuracy": right, "val/right": right}


def nano_sweep(conformance_dir: Path) -> tuple[Run, Path]:
    """The classifier at 2 ranks under ddp, fsdp, zero2 and zero3 (one multirun, once per session): its folder."""
    run, sweep = smoke(conformance_dir, "eval-nano", *NANO, *METRICS, *JOB, "strategy=ddp,fsdp,zero2,zero3")
    assert run.returncode == 0, run.stderr[-3000:]
    return run, sweep


def test_metrics_of_a_nanogpt_shaped_model_are_one_process_s_under_every_strategy(conformance_dir: Path) -> None:
    one = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, "gpus=1", name="eval-nano-one").check()
    run, sweep = nano_sweep(conformance_dir)
    # The tuple's loss, and each metric's inputs, found where only one thing can be meant: said once, at start.
    said = "its loss is its only scalar tensor, at position 1 (trainer.loss=1 says so)"
    assert one.stdout.count(said) == 1 and run.stdout.count(said) == 1, one.stdout + run.stdout  # in a sweep too
    assert one.stdout.count("metric accuracy: preds = the model's output: position 0") == 1, one.stdout
    read = "launch: evaluation: the set val: all 13 samples, each once, in 2 global batch(es) of 8 (the last holds 5)"
    assert one.stdout.count(f"{read}: it holds fewer than trainer.eval_batches=2") == 1, one.stdout
    reference = one.metrics
    evaluated = [m for m in reference if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [2, 4]
    accuracy = [m["val/accuracy"] for m in evaluated]
    assert all(a * 13 == pytest.approx(round(a * 13), abs=1e-9) for a in accuracy), accuracy  # 13 samples, once
    assert accuracy == [m["val/right"] for m in evaluated]  # the Metric and the function of sums agree
    assert sorted(jobs(sweep)) == ["ddp", "fsdp", "zero2", "zero3"]
    for strategy, job in {"one process": one.run_dir, **jobs(sweep)}.items():
        logged = metrics(job)
        assert [m["loss"] for m in logged] == pytest.approx(
            [m["loss"] for m in reference], abs=PARITY_TOLERANCE.get(strategy, 0.0)
        )
        # The last evaluation (a partial last batch, stand-ins on the ranks whose share is empty) is one plain
        # process's over the 13 samples, with the same final weights.
        plain = plain_figures(job / "checkpoints" / "step_00000004")
        last = logged[-1]
        assert last["step"] == 4 and {n: last[n] for n in plain} == pytest.approx(plain, abs=EXACT), (strategy, last)


def test_each_validation_set_is_logged_under_its_name(conformance_dir: Path) -> None:
    """Two sets: one with the data's own validation images (its figures are the one-set run's), one of 5 images."""
    sets = ["+data.val.same={}", "+data.val.small.val_count=5"]
    two = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, *sets, name="eval-two-sets").check()
    one = metrics(jobs(nano_sweep(conformance_dir)[1])["ddp"])  # the same run with the data's one set: 2 ranks, ddp
    evaluated, reference = [m for m in two.metrics if "val/same/loss" in m], [m for m in one if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [m["step"] for m in reference] == [2, 4]
    for theirs, ours in zip(reference, evaluated):
        assert "val_loss" not in ours and "val/accuracy" not in ours, ours
        assert ours["val/same/loss"] == pytest.approx(theirs["val_loss"], abs=1e-12)
        assert ours["val/same/accuracy"] == pytest.approx(theirs["val/accuracy"], abs=1e-12)
        assert ours["val/small/loss"] != ours["val/same/loss"]
        assert {"val/small/accuracy", "val/small/right"} <= set(ours), ours


STOPPING = [
    "gpus=2",
    "trainer.max_steps=20",
    "trainer.eval_every=1",
    "trainer.eval_batches=1",
    "optim.lr=0",
    "trainer.save_at_end=true",
    "trainer.keep_last=1",
    "+trainer.early_stop.metric=val/accuracy",
    "trainer.early_stop.mode=max",
    "trainer.early_stop.patience=2",
]
"""A planted plateau: at lr 0 the accuracy never changes, so the best is step 1 and the run stops after step 3."""


def test_early_stop_ends_every_rank_at_a_plateau_and_keeps_the_best(conformance_dir: Path) -> None:
    folder = conformance_dir / "eval-early-calls"
    folder.mkdir(exist_ok=True)
    calls = ["+trainer.callbacks=[{_target_: eval_models.Recording, folder: " + str(folder) + "}]"]
    run = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, *STOPPING, *calls, name="eval-early")
    run.check()
    assert [m["step"] for m in run.metrics] == [1, 2, 3], run.metrics
    line = "early stop after step 3: val/accuracy did not improve by more than 0 (max) in 2 evaluation(s); best"
    assert run.stdout.count(line) == 1 and "at step 1; checkpoint" in run.stdout, run.stdout
    checkpoints = run.run_dir / "checkpoints"
    assert (checkpoints / "best").read_text().strip() == "step_00000001"  # kept beside the newest (keep_last=1)
    assert (checkpoints / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000001", "step_00000003"]
    # Every rank's callback saw the same phases, in order, with the figures reduced over ranks.
    seen = [[json.loads(x) for x in (folder / f"calls{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert seen[0] == seen[1]
    hooks = [(c["hook"], c["step"]) for c in seen[0]]
    assert hooks == [
        ("on_train_start", 0),
        ("on_step_end", 1),
        ("on_eval_end", 1),
        ("on_save", 1),
        ("on_step_end", 2),
        ("on_eval_end", 2),
        ("on_step_end", 3),
        ("on_eval_end", 3),
        ("on_save", 3),
        ("on_train_end", 3),
    ], hooks
    assert "val/accuracy" in seen[0][2]["figures"] and "loss" not in seen[0][2]["figures"]
    # A resume of it says that it stopped early, and goes on.
    more = ["trainer.max_steps=4", "trainer.early_stop.patience=5", f"resume={run.run_dir}"]
    again = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, *STOPPING, *more, name="eval-again")
    again.check()
    assert "launch: resuming a run that stopped early (early stop after step 3" in again.stdout, again.stdout


def test_a_callback_that_raises_ends_the_run_in_one_line_with_its_last_checkpoint(conformance_dir: Path) -> None:
    raising = [
        "+trainer.callbacks=[{_target_: eval_models.Raising, at: 3}]",
        "trainer.checkpoint_every=2",
        "trainer.max_steps=6",
        "trainer.save_at_end=true",
    ]
    run = launch_once(conformance_dir, "+sweep=smoke", *NANO, *JOB, *raising, name="eval-raising")
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("launch: error:")]
    assert len(errors) == 1, run.stderr
    assert (
        "the callback eval_models.Raising raised in on_step_end at step 3: RuntimeError: planted failure" in errors[0]
    )
    assert errors[0].endswith("step_00000002"), errors[0]  # the last complete checkpoint, and it is the newest
    assert (run.run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,says",
    [
        (
            ["+trainer.metrics.acc._target_=torchmetrics.classification.NoSuchAccuracy"],
            "trainer.metrics.acc._target_=torchmetrics.classification.NoSuchAccuracy does not import",
        ),
        (
            ["+trainer.metrics.acc._target_=torchmetrics.classification.MulticlassAccuracy"],
            "MulticlassAccuracy does not build (ValueError: Argument `num_classes`",
        ),
        (["+trainer.metrics.loss._target_=eval_models.correct"], "trainer.metrics.loss: `loss` is the validation loss"),
        (
            [*METRICS, "+trainer.early_stop.metric=val/acuracy"],
            "trainer.early_stop.metric=val/acuracy is no figure this run logs; it logs: ",
        ),
        (
            ["+trainer.metrics.avg._target_=eval_models.Averaged"],
            "trainer.metrics.avg: Averaged's state 'value' is reduced over ranks by dim_zero_mean, which is exact only",
        ),
        (
            ["trainer.eval_batches=every"],
            "trainer.eval_batches=every is invalid: it must be a positive integer, or all (every sample of each set)",
        ),
    ],
    ids=["does-not-import", "does-not-build", "named-loss", "early-stop-figure", "averaged-state", "eval-batches"],
)
def test_bad_evaluation_input_is_one_line_before_any_worker_starts(tmp_path: Path, overrides, says) -> None:
    line = launch_here(tmp_path, "+sweep=smoke", *NANO, *JOB, *overrides).refused()
    assert says in line, line
    if "early_stop" in says:
        assert "val/accuracy" in line and "val/right" in line and "val_loss" in line, line


CODE = [
    "model._target_=eval_models.NanoClassifier",
    "+model.config._target_=eval_models.NanoConfig",
    "data._target_=eval_models.images",
    "+trainer.metrics.accuracy._target_=" + METRICS[0].split("=", 1)[1],
    "+trainer.metrics.right._target_=eval_models.correct",
]
"""What `launch eval` of the classifier's runs is given: the code its config names, which is never taken from a file;
every other setting (the model's sizes, the data's, the metrics' keys, the batch) is the run's."""


def test_launch_eval_of_a_zero3_checkpoint_at_one_process_gives_the_run_s_figures(conformance_dir: Path) -> None:
    zero3 = jobs(nano_sweep(conformance_dir)[1])["zero3"]  # 2 ranks
    logged = metrics(zero3)[-1]
    assert logged["step"] == 4 and "val/accuracy" in logged, logged
    checkpoint = zero3 / "checkpoints" / "step_00000004"
    # The run's config names code (its model, data and metrics are the user's): refused in one line that gives the
    # overrides to repeat, before anything is written.
    line = launch_here(conformance_dir, "eval", str(checkpoint), name="eval-refused").refused()
    assert f"the run's config ({zero3 / 'resolved.yaml'}) names code that is not taken from a file: give " in line
    assert " ".join(CODE) in line, line
    evaluated = conformance_dir / "eval-of-zero3"
    proc = launch_once(conformance_dir, "eval", str(checkpoint), *CODE, "strategy=ddp", "gpus=1", name="eval-of-zero3")
    proc.check()
    assert f"launch: eval: the run's config from {zero3 / 'resolved.yaml'} (model=custom, data=custom" in proc.stdout
    figures = json.loads((evaluated / "eval.json").read_text())
    assert figures["step"] == 4
    names = ["val_loss", "val/accuracy", "val/right"]
    assert sorted(figures["figures"]) == sorted(names)
    plain = plain_figures(checkpoint)
    for name in names:
        assert figures["figures"][name] == pytest.approx(logged[name], abs=EXACT), name
        assert figures["figures"][name] == pytest.approx(plain[name], abs=EXACT), name
    table = proc.stdout[proc.stdout.index("launch: evaluation of step 4") :].splitlines()
    assert table[1].split() == ["figure", "value"] and [r.split()[0] for r in table[2:5]] == names, table
    assert not (evaluated / "metrics.jsonl").read_text().strip()  # no step trained, none logged


@pytest.mark.long  # 4-8 min (12 runs); test_metrics_of_a_nanogpt_shaped_model_are_one_process_s_under_every_strategy
# covers a partial last batch against one plain process in the default tier (13 points, 2 ranks, every strategy)
def test_301_points_are_one_plain_process_s_at_1_to_4_ranks_under_ddp_fsdp_and_zero3(conformance_dir: Path) -> None:
    """301 validation points (an odd count: 12 global batches of 24 and one of 13), trainer.eval_batches=all, at 1, 2,
    3 and 4 ranks under ddp, fsdp and zero3: the loss and MulticlassAccuracy(average=micro) of each run's final
    weights are one plain process's over all 301; `launch eval` of the zero3 checkpoint of 3 ranks, at 4 ranks under
    fsdp, gives them too."""
    wide = [
        *NANO,
        "+model.config.classes=5",
        "+data.val_count=301",
        *METRICS[:1],
        "+trainer.metrics.accuracy.num_classes=5",
        "+trainer.metrics.accuracy.average=micro",
        "batch.global_size=24",
        "batch.micro_size=2",
        "trainer.max_steps=3",
        "trainer.eval_every=3",
        "trainer.eval_batches=all",
        "optim.lr=0.1",
        "trainer.warmup_steps=1",
        "trainer.save_at_end=true",
    ]
    sweep = conformance_dir / "eval-301"
    # Workers forked (the default): the sweep's checks build the 301 images in the launcher, single-threaded where
    # its jobs fork (`check_config`), so a forked worker's own multi-threaded op has its own threads.
    shapes = ["strategy=ddp,fsdp,zero3", "gpus=1,2,3,4", f"hydra.sweep.dir={sweep}"]
    run = launch_once(conformance_dir, "-m", "+sweep=smoke", *wide, *shapes, name="eval-301", timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    from omegaconf import OmegaConf

    seen = {}
    for job in (d for d in sweep.iterdir() if (d / "resolved.yaml").is_file()):
        cfg = OmegaConf.load(job / "resolved.yaml")
        plain = plain_figures(job / "checkpoints" / "step_00000003", count=301, classes=5)
        last = metrics(job)[-1]
        seen[(cfg.job.choices.strategy, cfg.derived.world_size)] = job
        assert last["step"] == 3 and last["val_loss"] == pytest.approx(plain["val_loss"], abs=EXACT), (job, last)
        assert last["val/accuracy"] == pytest.approx(plain["val/accuracy"], abs=EXACT), (job, last)
    assert sorted(seen) == [(s, g) for s in ("ddp", "fsdp", "zero3") for g in (1, 2, 3, 4)], sorted(seen)
    checkpoint = seen[("zero3", 3)] / "checkpoints" / "step_00000003"
    code = [o for o in CODE if "right" not in o]
    shape = ["strategy=fsdp", "gpus=4"]
    proc = launch_once(conformance_dir, "eval", str(checkpoint), *code, *shape, name="eval-301-of-zero3", timeout=900)
    figures = json.loads((proc.check().run_dir / "eval.json").read_text())["figures"]
    plain = plain_figures(checkpoint, count=301, classes=5)
    assert {n: figures[n] for n in ("val_loss", "val/accuracy")} == pytest.approx(
        {n: plain[n] for n in ("val_loss", "val/accuracy")}, abs=EXACT
    )


GPT_ON_TEXT = [
    "data=text",
    "data.seq_len=32",
    "data.packing=false",
    "model.n_layer=1",
    "model.n_embd=32",
    "gpus=2",
    "batch.global_size=16",
    "batch.micro_size=4",
    "trainer.max_steps=2",
    "trainer.eval_every=2",
    "trainer.eval_batches=all",
    "trainer.save_at_end=true",
]
"""The built-in GPT at 32 positions on data=text's padded samples (each holds its own number of targets), its
validation over the whole split."""
GPT_EXACT = 1e-6
"""How far the GPT's validation loss may be from a plain loop's: the GPT sums each micro-batch's token losses in
float32 (its `loss_sum`, over up to 128 tokens of losses near 5.7: up to about 1e-7 of each sum), the loop adds each
token's loss in float64 (measured: 1e-7 apart over 117 samples)."""


def plain_gpt_loss(run_dir: Path, checkpoint: Path | None = None) -> tuple[float, int]:
    """Σ token losses / Σ targets over every sample of the run's validation split, one sample at a time, in float64,
    with the checkpoint's weights (the run's newest): the figure of a plain loop over the whole split; and its
    number of samples."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from launcher.base.storage import location
    from launcher.checkpoint.format import find_checkpoint
    from launcher.data.builtin import build_dataset
    from launcher.models.gpt import GPT
    from launcher.parent.convert import weights

    cfg = OmegaConf.load(run_dir / "resolved.yaml")
    model = GPT(**{k: v for k, v in cfg.model.items() if k != "_target_"})
    model.load_state_dict(weights(find_checkpoint(location(checkpoint or run_dir))))
    dataset, total, targets = build_dataset(cfg.data, "val"), 0.0, 0
    with torch.no_grad():
        for i in range(len(dataset)):
            x, y = dataset[i]
            logits = model.eval()(x[None], y[None])["logits"].double()
            total += float(F.cross_entropy(logits.view(-1, logits.size(-1)), y, reduction="sum"))  # -100: nothing
            targets += int((y != -100).sum())
    return total / targets, len(dataset)


def test_the_gpt_s_loss_over_a_whole_text_split_is_a_plain_loop_s_and_eval_and_convert_take_the_run_s_config(
    tmp_path: Path,
) -> None:
    """trainer.eval_batches=all: the GPT's val_loss is a plain loop's over every sample of the split. `launch eval
    RUN` and `launch convert RUN out=DIR` with no override take the run's own config (a model of 32 positions, where
    the command's defaults make 128) and give the same figure; an override that does not fit is one line naming it."""
    from conftest import TINY, cli_here, launch
    from text_corpus import make_corpus

    corpus = make_corpus(tmp_path / "made")
    data = [
        f"data.files={corpus['corpus']}",
        f"data.tokenizer={corpus['tokenizer']}",
        f"data.val_files={corpus['val']}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    base = [o for o in TINY if not o.startswith(("data", "model.n_", "trainer.eval_every"))]
    run = launch(tmp_path, *base, *GPT_ON_TEXT, *data).check()
    plain, samples = plain_gpt_loss(run.run_dir)
    assert samples % 16 and f"launch: evaluation: the set val: all {samples} samples, each once" in run.stdout
    assert run.metrics[-1]["val_loss"] == pytest.approx(plain, abs=GPT_EXACT), (run.metrics[-1], plain)
    evaluated = launch(tmp_path, "eval", str(run.run_dir), name="evaluated").check()
    assert f"launch: eval: the run's config from {run.run_dir / 'resolved.yaml'}" in evaluated.stdout
    figures = json.loads((evaluated.run_dir / "eval.json").read_text())["figures"]
    assert figures["val_loss"] == pytest.approx(plain, abs=GPT_EXACT), (figures, plain)
    converted = cli_here(tmp_path, "convert", str(run.run_dir), f"out={tmp_path / 'gpt'}")
    assert converted.returncode == 0, converted.stderr
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(tmp_path / "gpt"))
    assert config.n_positions == 32
    # The run's tokenizer in the folder, its end-of-document token the run's (and the config's).
    assert f"with the run's tokenizer {corpus['tokenizer']}:" in converted.stdout, converted.stdout
    ours, theirs = (AutoTokenizer.from_pretrained(str(folder)) for folder in (tmp_path / "gpt", corpus["tokenizer"]))
    text = json.loads(corpus["val"].read_text().splitlines()[0])["text"]
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.eos_token == theirs.eos_token and config.eos_token_id == theirs.eos_token_id is not None
    # The checkpoint copied under a folder whose resolved.yaml is another run's (another config hash): not taken.
    import shutil

    other = tmp_path / "other"
    shutil.copytree(run.run_dir / "checkpoints" / "step_00000002", other / "checkpoints" / "step_00000002")
    foreign = OmegaConf.load(run.run_dir / "resolved.yaml")
    foreign.job.config_hash = "0" * 16
    OmegaConf.save(foreign, other / "resolved.yaml")
    moved = cli_here(tmp_path, "convert", str(other), f"out={tmp_path / 'moved'}")
    assert f"{other / 'resolved.yaml'} is another run's config (config hash 0000000000000000" in moved.stdout
    assert moved.returncode == 2 and "give the model overrides the run was launched with" in moved.stderr, moved
    # An override the checkpoint does not fit: one line naming it and the run's value, before anything is written.
    line = launch_here(tmp_path, "eval", str(run.run_dir), "model.n_embd=48", name="wrong").refused()
    assert "does not fit the model" in line and "leave out model.n_embd=48 (the run's: 32)" in line, line
    wrong = cli_here(tmp_path, "convert", str(run.run_dir), f"out={tmp_path / 'wrong'}", "model.n_layer=2")
    lines = wrong.stderr.strip().splitlines()
    assert wrong.returncode == 2 and len(lines) == 1 and "leave out model.n_layer=2 (the run's: 1)" in lines[0], lines
    assert not (tmp_path / "wrong").exists()


@pytest.mark.long  # 15-30 s: the accuracy test covers the reduction; this one covers padded targets
def test_perplexity_of_padded_samples_is_the_exponential_of_the_validation_loss(conformance_dir: Path) -> None:
    """Padded samples (data.packing=false): the ranks hold different numbers of targets, and torchmetrics'
    Perplexity, fed the built-in GPT's logits and targets (found), is exp(Σ token losses / Σ targets) over both."""
    from conftest import TINY

    ppl = ["+trainer.metrics.ppl._target_=torchmetrics.text.Perplexity", "+trainer.metrics.ppl.ignore_index=-100"]
    job = [
        "data=pysource",
        "data.packing=false",
        "gpus=2",
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "trainer.eval_batches=1",
        "batch.global_size=16",
        "batch.micro_size=4",
    ]
    run = launch_once(conformance_dir, *TINY, *job, "trainer.save_at_end=false", *ppl, name="eval-ppl").check()
    logged = run.metrics[-1]
    assert logged["val/ppl"] == pytest.approx(math.exp(logged["val_loss"]), rel=1e-6), logged
    assert "metric ppl: preds = the model's output: 'logits'" in run.stdout, run.stdout


@pytest.mark.long  # 35-95 s (two trials): a trial reads its objective by name as test_search_runs' trials read val_loss
def test_an_optuna_search_maximises_a_metric_by_name(tmp_path: Path) -> None:
    import subprocess

    import optuna
    from conftest import LAUNCH, clean_env

    sweep = tmp_path / "sweep"
    search = [
        "-m",
        "hydra/sweeper=launch_optuna",
        "optim.lr=tag(log,interval(1e-3,0.3))",
        "hydra.sweeper.n_trials=2",
        "sweep.objective=val/accuracy",
        "sweep.direction=maximize",
        "sweep.pruner=null",
    ]
    cmd = [LAUNCH, *search, "+sweep=smoke", *NANO, *METRICS, *JOB, "gpus=1", f"hydra.sweep.dir={sweep}"]
    run = subprocess.run(cmd, cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    study = optuna.load_study(study_name="search", storage=f"sqlite:///{sweep / 'study.db'}")
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE and len(study.trials) == 2
    for trial in study.trials:  # each trial's value: the last accuracy its run logged
        logged = [m for m in metrics(sweep / str(trial.number)) if "val/accuracy" in m]
        assert trial.value == logged[-1]["val/accuracy"], (trial.number, logged)
    assert study.best_value == max(t.value for t in study.trials)


@pytest.mark.long  # 20-40 s: a T5 under zero3; the accuracy test covers the exact reduction of a metric's states
def test_a_transformers_seq2seq_model_logs_bleu_exactly_at_two_ranks(conformance_dir: Path) -> None:
    """T5 at its initial weights (lr 0) on padded rows of 2 to 16 tokens: the smoothed BLEU of its predictions over
    the validation batch, at 2 ranks, is that of one plain forward over the same 8 samples here."""
    import loss_models
    from eval_models import sentences
    from torch.utils.data import default_collate
    from torchmetrics.text import BLEUScore

    bleu = [
        "+trainer.metrics.bleu._target_=torchmetrics.text.BLEUScore",
        "+trainer.metrics.bleu.n_gram=2",
        "+trainer.metrics.bleu.smooth=true",
        "+trainer.metrics.bleu.inputs=eval_models.sentences",
    ]
    job = [
        "device=cpu",
        "logger=none",
        "data=custom",
        "batch.global_size=8",
        "batch.micro_size=2",
        "gpus=2",
        "trainer.eval_batches=1",
        "trainer.progress=false",
        "trainer.save_at_end=false",
        "model=custom",
        "model._target_=loss_models.seq2seq",
        "data._target_=loss_models.reversal",
        "optim.lr=0",
        "trainer.max_steps=1",
        "trainer.eval_every=1",
        "strategy=zero3",
    ]
    run = launch_once(conformance_dir, *job, *bleu, name="eval-bleu").check()
    dataset, model = loss_models.reversal("val"), loss_models.seq2seq()
    batch = default_collate([dataset[i] for i in range(8)])
    metric = BLEUScore(n_gram=2, smooth=True)
    metric.update(*sentences(model(**batch), batch))
    expected = float(metric.compute())
    assert expected > 0
    assert run.metrics[-1]["val/bleu"] == pytest.approx(expected, abs=1e-7), (run.metrics[-1], expected)


def test_a_metric_that_fails_on_the_first_batch_ends_the_run_before_its_first_step(conformance_dir: Path) -> None:
    two = [
        "+trainer.metrics.accuracy._target_=torchmetrics.classification.MulticlassAccuracy",
        "+trainer.metrics.accuracy.num_classes=2",
    ]
    run = launch_once(conformance_dir, "+sweep=smoke", *NANO, *JOB, *two, name="eval-fails-first")
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("launch: error:")]
    assert len(errors) == 1, run.stderr
    assert "trainer.metrics.accuracy fails on the first batch of the validation set val: " in errors[0], errors[0]
    assert run.metrics == []  # no step was trained


# ------------------------------------------------------------------------------- each sample once, in this process


def _numbered_source(kind: str) -> object:
    """29 samples that are their own numbers, at B=12: a list, a stream, or a mixture of a list of 17 (whose `epochs`
    would repeat it in training) and a stream of 12 numbered from 100."""
    from eval_models import numbered
    from omegaconf import OmegaConf

    from launcher.data.collate import default_collate
    from launcher.data.sources import source_of
    from launcher.mixture.mix import Mix

    if kind == "mix":
        a = {"_target_": "eval_models.numbered", "count": 17, "weight": 0.7, "epochs": 3}
        b = {"_target_": "eval_models.numbered", "count": 12, "first": 100, "stream": True, "weight": 0.3}
        parts = {"a": a, "b": b}
        return source_of(Mix("val", sources=OmegaConf.create(parts)), 12, 0, default_collate, "val")
    return source_of(numbered("val", 29, stream=kind == "stream"), 12, 0, default_collate, "val")


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["map", "stream", "mix"])
@pytest.mark.parametrize("batches", [None, 2, 9])
def test_a_pass_counts_each_sample_once_at_any_world_size(kind: str, batches: int | None) -> None:
    """29 samples read in global batches of 12 by 1 to 4 ranks (K micro-batches each): the samples counted over all
    ranks are, at every world size, the same ones in the same order, each once: the first 24 (2 batches), or all 29
    (`all`, or 9 batches: more than the set holds, read once, whole, its last batch holding 5). Every rank runs K
    forwards per batch; a rank whose share of the partial batch is empty forwards a stand-in counted in nothing."""
    import torch

    source = _numbered_source(kind)
    expected = {"map": list(range(29)), "stream": list(range(29)), "mix": [*range(17), *range(100, 112)]}[kind]
    read = {}
    for world, K in ((1, 3), (2, 2), (3, 4), (4, 3)):
        passes = [list(source.evaluation(batches, r, world, K, torch.device("cpu"))) for r in range(world)]
        assert len({len(p) for p in passes}) == 1 and all(len(micro) == K for p in passes for micro in p)
        counted = [m.batch for b in range(len(passes[0])) for r in range(world) for m in passes[r][b] if m.counted]
        read[world] = torch.cat(counted).view(-1).tolist()
        stand_ins = [m for p in passes for micro in p for m in micro if not m.counted]
        assert len(stand_ins) == (0 if batches == 2 or world * K <= 5 else world * K - 5), (world, K, len(stand_ins))
    assert all(numbers == read[1] for numbers in read.values()), read
    numbers = read[1]
    assert len(numbers) == len(set(numbers)) == (24 if batches == 2 else 29), numbers
    assert sorted(numbers) == (sorted(expected) if batches != 2 else sorted(numbers)) and set(numbers) <= set(expected)
    if kind != "mix":
        assert numbers == expected[: len(numbers)]  # from the set's start, in order


@pytest.mark.unit
def test_the_loss_weighs_a_micro_batch_by_its_targets_or_by_its_samples() -> None:
    """A mean over counted targets weighs by them (-100 ignored); a mean whose batch holds no targets the launcher
    counts weighs by the micro-batch's samples, and the start says so; a sum and its count are added as they are."""
    import torch

    from launcher.evaluation.passes import unweighed, weighed
    from launcher.models.loss import LabelRule

    rule, mean = LabelRule(), torch.tensor(2.0)
    labels = torch.tensor([[1, 2, -100], [3, -100, -100]])
    assert weighed(mean, (torch.zeros(2, 3), labels), rule) == (6.0, 3.0)
    assert weighed((torch.zeros(5, 4), mean), (torch.zeros(5, 2), torch.arange(5)), rule) == (10.0, 5.0)
    assert weighed({"loss": mean}, {"input_ids": torch.zeros(3, 8, dtype=torch.long)}, rule) == (6.0, 3.0)
    assert weighed({"loss_sum": torch.tensor(7.0), "num_tokens": 4}, {"x": torch.zeros(2)}, rule) == (7.0, 4.0)
    assert unweighed((torch.zeros(5, 4), mean), (torch.zeros(5, 2), torch.arange(5)), rule) is None  # one per sample
    said = unweighed({"loss": mean}, {"input_ids": torch.zeros(3, 8, dtype=torch.long)}, rule)
    assert said and "weighs each micro-batch's mean by its samples" in said, said
    said = unweighed(mean, (torch.zeros(2, 3), labels), rule)
    assert said and "by the targets counted in it" in said, said


# ------------------------------------------------------------------------------- the run's own config, as data


@pytest.mark.unit
def test_the_run_s_config_becomes_overrides_that_the_command_line_changes_where_it_names() -> None:
    """The run's group choices and values, before the command line's: a key the command names (or one above or below
    it) is left out of the run's, a group it chooses leaves out the run's whole node; every value reads back through
    Hydra's parser as it was."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from launcher.parent.run_config import TAKEN, render, run_overrides

    metric = {"_target_": "torchmetrics.classification.MulticlassAccuracy", "num_classes": 5, "average": "micro"}
    run = {
        "model": {"_target_": "launcher.models.gpt.GPT", "n_layer": 2, "block_size": 32, "dropout": 0.0},
        "data": {"_target_": "launcher.data.builtin.Synthetic", "seq_len": 32, "val": {}},
        "trainer": {"metrics": {"acc": metric}, "eval_batches": "all", "max_steps": 300},
        "strategy": {"_target_": "strategies.ddp.DDP"},
        "gpus": 2,
        "job": {"choices": {"model": "gpt_tiny", "data": "synthetic", "strategy": "ddp"}},
    }
    command = ["model.n_layer=3", "data=pysource", "+trainer.metrics.acc._target_=my_pkg.Acc", "gpus=1"]
    assert run_overrides(run, command, TAKEN) == [
        "model=gpt_tiny",
        "++model._target_=launcher.models.gpt.GPT",
        "++model.block_size=32",
        "++model.dropout=0.0",
        "++trainer.metrics.acc.num_classes=5",
        "++trainer.metrics.acc.average=micro",
        "++trainer.eval_batches=all",
    ]
    parser = OverridesParser.create()
    values = ["it's", "back\\slash\\", "a b", "1e-08", "true", "cosine", "my_pkg.Net", 1e-08, 3, None, True]
    for value in [*values, [0.9, "x y"], {"k": [1, {"z": "w's"}]}, {}]:
        assert parser.parse_override(f"++a.b={render(value)}").value() == value, (value, render(value))


@pytest.mark.unit
def test_a_run_s_config_is_read_as_data_and_its_code_only_where_the_command_names_it(tmp_path: Path) -> None:
    """resolved.yaml is YAML read safely: a tag that would build a Python object, or an interpolation (which would
    read the environment when resolved), is refused in one line and nothing runs; a `_target_` the command's own
    composition does not name is refused, with the overrides to give."""
    from omegaconf import OmegaConf

    from launcher.base.errors import ConfigError
    from launcher.config import schema
    from launcher.parent.run_config import check_code, package_targets, read_run, render, run_overrides

    planted = tmp_path / "planted"
    (tmp_path / "crafted.yaml").write_text(f"model: !!python/object/apply:os.mkdir ['{planted}']\njob: {{}}\n")
    with pytest.raises(ConfigError, match="does not read as a run's config"):
        read_run(tmp_path / "crafted.yaml")
    assert not planted.exists()
    with pytest.raises(ConfigError, match=r"an interpolation at data.path \(\$\{oc.env:HOME\}\)"):
        render("${oc.env:HOME}", "data.path")
    run = {"model": {"_target_": "os.system", "command": "true"}, "job": {"choices": {"model": "custom"}}}
    taken = run_overrides(run, [], ["model"])
    base = OmegaConf.create({"model": {"_target_": "???"}})
    with pytest.raises(ConfigError, match="names code that is not taken from a file: give model._target_=os.system on"):
        check_code(taken, base, tmp_path / "resolved.yaml")
    check_code(taken, OmegaConf.create({"model": {"_target_": "os.system"}}), tmp_path / "resolved.yaml")  # named
    # A mixture of the launcher's own data names its sources' targets: those of the package's own options are taken.
    schema.register()
    source = {"_target_": "launcher.data.builtin.Synthetic", "weight": 1.0}
    mix = {
        "data": {"_target_": "launcher.mixture.mix.Mix", "sources": {"a": source}},
        "job": {"choices": {"data": "mix"}},
    }
    mixed = OmegaConf.create({"data": {"_target_": "launcher.mixture.mix.Mix", "sources": {}}})
    check_code(run_overrides(mix, [], ["data"]), mixed, tmp_path / "resolved.yaml", package_targets)
    with pytest.raises(ConfigError, match=r"chose model=\.\./evil, which is no model option here"):
        run_overrides({"job": {"choices": {"model": "../evil"}}}, [], ["model"])


@pytest.mark.unit
def test_a_run_written_before_the_rooms_moved_names_its_optimizer_at_the_new_path(tmp_path: Path) -> None:
    """A resolved.yaml that names a `_target_` of the launcher's own at the path it had before it moved (optim=muon's
    `launcher.worker.muon.MuonAdamW`) is read with the new path, which imports; other targets are left as they are."""
    from launcher.base.targets import locate
    from launcher.parent.run_config import MOVED, read_run

    old = "launcher.worker.muon.MuonAdamW"
    (tmp_path / "resolved.yaml").write_text(
        f"optim: {{_target_: {old}, lr: 0.01}}\nlogger: [{{_target_: launcher.worker.logs.WandbLogger}}]\n"
        "model: {_target_: my_pkg.Net}\njob: {choices: {optim: muon}}\n"
    )
    run = read_run(tmp_path / "resolved.yaml")
    assert run["optim"] == {"_target_": "launcher.optim.muon.MuonAdamW", "lr": 0.01}
    assert run["logger"] == [{"_target_": "launcher.loggers.wandb.WandbLogger"}]
    assert run["model"]["_target_"] == "my_pkg.Net"
    for new in MOVED.values():  # every new path imports (a class, or a function that builds one: strategies.sharded)
        assert locate(new).__name__ == new.rsplit(".", 1)[1]
