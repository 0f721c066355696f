"""The search sweeper's parts, in process: the search space written in Hydra's grammar as Optuna's distributions, a
trial's objective read from what its run logged, the study held, checked and continued, the report's trials, and a
search refused before anything runs (one line, exit 2, nothing written)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
from conftest import launch_here
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from launcher.search.claims import Claims, pick
from launcher.search.objective import lineage, objective, read_metrics
from launcher.search.report import collect, trials, trials_table
from launcher.search.space import SpaceError, low_end, parse
from launcher.search.study import StudyError, finished, hold, open_study, storage_url, tell

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "override, expected",
    [
        ("optim.lr=tag(log,interval(1e-4,1e-2))", FloatDistribution(1e-4, 1e-2, log=True)),
        ("optim.lr=interval(0.001,0.01)", FloatDistribution(0.001, 0.01)),
        ("trainer.warmup_steps=tag(int,interval(0,40))", IntDistribution(0, 40)),
        ("trainer.warmup_steps=range(0,40,10)", IntDistribution(0, 30, step=10)),  # Hydra's range stops before 40
        ("optim.weight_decay=range(0.0,0.3,0.1)", FloatDistribution(0.0, 0.2, step=0.1)),
        ("optim.weight_decay=choice(0.0,0.1)", CategoricalDistribution((0.0, 0.1))),
        ("optim.weight_decay=0.0,0.1", CategoricalDistribution((0.0, 0.1))),
        ("strategy=ddp,fsdp", CategoricalDistribution(("ddp", "fsdp"))),
    ],
)
def test_each_sweep_of_hydras_grammar_is_an_optuna_distribution(override: str, expected: object) -> None:
    space = parse([override, "trainer.max_steps=10"])
    assert list(space.distributions.values()) == [expected]
    assert space.fixed == ["trainer.max_steps=10"]


def test_a_key_given_again_wins_as_in_hydra() -> None:
    space = parse(
        [
            "optim.lr=tag(log,interval(1e-4,1e-2))",
            "optim.weight_decay=0.1",
            "optim.lr=0.003",
            "optim.weight_decay=interval(0.0,0.2)",
        ]
    )
    assert space.fixed == ["optim.lr=0.003"] and list(space.distributions) == ["optim.weight_decay"]


def test_a_trials_values_come_back_as_overrides_that_hydra_reads_as_those_values() -> None:
    space = parse(["+optim.foo=choice(true,false)", "optim.lr=tag(log,interval(1e-4,1e-2))", "seed=3"])
    overrides = space.overrides({"+optim.foo": False, "optim.lr": 0.0012345678901234567})
    assert overrides == ["seed=3", "+optim.foo=false", "optim.lr=0.0012345678901234567"]
    back = {
        o.key_or_group: o.value()
        for o in __import__("hydra")
        .core.override_parser.overrides_parser.OverridesParser.create()
        .parse_overrides(overrides)
    }
    assert back == {"seed": 3, "optim.foo": False, "optim.lr": 0.0012345678901234567}


@pytest.mark.parametrize(
    "override, words",
    [
        ("optim.lr=tag(log,interval(0,0.1))", "needs LOW > 0 on a log scale"),
        ("optim.lr=interval(0.1,0.01)", "is empty"),
        ("optim.lr=range(5,1)", "holds no value"),
        ("optim.lr=glob(*)", "cannot sample glob(...)"),
    ],
)
def test_a_space_that_cannot_be_sampled_is_one_line(override: str, words: str) -> None:
    with pytest.raises(SpaceError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse([override])


def _records(*pairs: tuple[int, float | None]) -> list[dict]:
    return [{"step": s, "loss": 1.0, **({"val_loss": v} if v != -1 else {})} for s, v in pairs]


def test_the_objective_is_the_last_or_the_best_logged_value() -> None:
    records = _records((1, -1), (2, 3.0), (3, -1), (4, 2.0), (5, -1), (6, 2.5))
    assert objective(records, "val_loss", "last", "minimize") == (2.5, "")
    assert objective(records, "val_loss", "best", "minimize") == (2.0, "")
    assert objective(records, "val_loss", "best", "maximize") == (3.0, "")
    assert objective(records, "loss", "last", "minimize") == (1.0, "")


def test_no_objective_says_why() -> None:
    assert objective(_records((1, -1)), "val_loss", "last", "minimize") == (None, "the run logged no val_loss")
    assert objective(_records((2, 3.0), (4, None)), "val_loss", "last", "minimize") == (
        None,
        "val_loss at step 4 is not finite",
    )
    assert objective(_records((2, 3.0), (4, None)), "val_loss", "best", "minimize") == (3.0, "")


def test_a_run_started_again_counts_only_the_steps_its_final_state_descends_from(tmp_path: Path) -> None:
    # Killed after step 5 (checkpoint at 4), then resumed: steps 5 and 6 logged again, after the first attempt's.
    steps = [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 1.0), (5, 5.5), (6, 5.0)]
    assert [r["val_loss"] for r in lineage(_records(*steps))] == [9.0, 8.0, 7.0, 6.0, 5.5, 5.0]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _records(*steps)) + '\n{"step": 7, "lo')
    assert objective(read_metrics(tmp_path), "val_loss", "best", "minimize") == (5.0, "")  # not the lost 1.0


def test_a_study_is_held_by_one_sweeper_and_is_the_study_its_command_describes(tmp_path: Path) -> None:
    url = storage_url(None, tmp_path)
    assert url == f"sqlite:///{tmp_path / 'study.db'}"
    claims = Claims(tmp_path, url)  # a SQLite study: held for the sweeper's life
    with pytest.raises(StudyError, match="is being run by another launch.*hydra.sweeper.storage=journal"):
        hold(tmp_path)
    definition = parse(["optim.lr=tag(log,interval(1e-4,1e-2))", "trainer.max_steps=8"]).definition()
    study = open_study("s", url, "minimize", optuna.samplers.RandomSampler(seed=0), None, definition)
    space = parse(["optim.lr=tag(log,interval(1e-4,1e-2))"]).distributions
    picked = pick(study, claims, space, 2, lambda made: None)
    assert picked is not None and picked[1] is False
    claims.close()  # its sweeper is gone: the next one continues its trial first
    claims = Claims(tmp_path, url)
    again = pick(study, claims, space, 2, lambda made: None)
    assert again is not None and again[1] is True and again[0].number == 0
    assert tell(study, again[0], {"state": "complete", "objective": 2.5}) == ("complete", False)
    claims.let_go(0)
    assert finished(study) == 1
    watched = parse(["optim.lr=tag(log,interval(1e-4,1e-2))", "trainer.max_steps=8", "logger=wandb"]).definition()
    again = open_study("s", url, "minimize", None, None, watched)  # the same study, continued (logged elsewhere)
    assert again.best_value == 2.5
    other = parse(["optim.lr=tag(log,interval(1e-4,1e-1))", "trainer.max_steps=8"]).definition()
    with pytest.raises(
        StudyError, match=r"study 's' in .* searched optim.lr: .*0\.01.*, this command optim.lr: .*0\.1"
    ):
        open_study("s", url, "minimize", None, None, other)
    claims.close()


def test_a_failed_trial_is_told_as_failed_and_a_sampler_with_no_point_left_ends_the_study(tmp_path: Path) -> None:
    space = parse(["batch.global_size=choice(16,20)"])
    study = open_study(
        "g",
        storage_url(None, tmp_path),
        "minimize",
        optuna.samplers.BruteForceSampler(seed=0),
        None,
        space.definition(),
    )
    first = study.ask(space.distributions)
    assert tell(study, first, {"state": "failed", "reason": "refused"}) == ("failed", False)
    second = study.ask(space.distributions)
    assert {first.params["batch.global_size"], second.params["batch.global_size"]} == {16, 20}
    assert tell(study, second, {"state": "pruned"}) == ("pruned", True)  # every point tried
    states = [t.state for t in study.get_trials()]
    assert states == [optuna.trial.TrialState.FAIL, optuna.trial.TrialState.PRUNED]
    assert study.trials[0].user_attrs["reason"] == "refused"


def test_the_report_lists_trials_in_the_order_they_ran_and_marks_the_best(tmp_path: Path) -> None:
    outcomes = [(0, "complete", 3.0), (1, "pruned", 4.0), (2, "failed", None), (10, "complete", 2.0)]
    for n, state, value in outcomes:
        (tmp_path / str(n)).mkdir()
        record = {
            "code": 0 if state != "failed" else 2,
            "overrides": [f"optim.lr={n / 100}", f"sweep.trial={n}"],
            "trial": n,
            "params": {"optim.lr": n / 100},
            "state": state,
            "objective": value,
            "objective_name": "val_loss",
            "direction": "minimize",
            **({"pruned_at": 2} if state == "pruned" else {}),
        }
        (tmp_path / str(n) / "outcome.json").write_text(json.dumps(record))
    ran, best = trials(collect(tmp_path))
    assert [t["trial"] for t in ran] == [0, 1, 2, 10] and best is not None and best["trial"] == 10
    rows = trials_table(collect(tmp_path)).splitlines()[2:]
    assert rows[0] == "| 0 | optim.lr=0 | 3 | complete |  |"
    assert rows[1] == "| 1 | optim.lr=0.01 | 4 | pruned | at step 2 |"
    assert rows[3] == "| 10 | optim.lr=0.1 | 2 | complete | best |"


def test_the_ready_study_searches_lr_warmup_and_weight_decay_in_a_directory_of_its_own() -> None:
    from hydra import compose, initialize_config_module

    from launcher.config import schema
    from launcher.parent.overrides import CONFIG_MODULE, CONFIG_NAME

    schema.register()  # the typed schema's config groups, as the command line registers them (not by an earlier test)
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        cfg = compose(CONFIG_NAME, overrides=["+sweep=search"], return_hydra_config=True)
        sweeper = cfg.hydra.sweeper
        space = parse([f"{k}={v}" for k, v in sweeper.params.items()])
        assert sweeper._target_ == "hydra_plugins.launch_optuna.sweeper.LaunchOptunaSweeper" and sweeper.n_trials == 20
        assert space.distributions == {
            "optim.lr": FloatDistribution(1e-4, 3e-2, log=True),
            "trainer.warmup_steps": IntDistribution(0, 100, step=10),
            "optim.weight_decay": FloatDistribution(0.0, 0.2),
        }
        assert cfg.hydra.sweep.dir == "multirun/search/search"  # the same command finds its study again
        assert cfg.sweep.objective == "val_loss" and cfg.trainer.eval_every > 0
        low = compose(CONFIG_NAME, overrides=space.overrides(low_end(space.distributions)))  # one trial's overrides
        assert (low.optim.lr, low.trainer.warmup_steps, low.optim.weight_decay) == (1e-4, 0, 0.0)


def test_each_trial_is_one_run_in_its_studys_group_in_every_logger() -> None:
    from launcher.parent.launch import _name_logger_run

    def named(study: str | None, sweep_dir: str, num: int) -> set[tuple[str, str]]:
        loggers = {name: {"group": None, "name": None} for name in ("wandb", "mlflow", "tensorboard")}
        resolved = {"logger": loggers, "sweep": {"study": study}, "job": {"sweep_dir": sweep_dir, "num": num}}
        _name_logger_run(resolved)
        return {(logger["group"], logger["name"]) for logger in resolved["logger"].values()}

    assert named("lr-search", "/runs/multirun/2026-12-04/x", 3) == {("lr-search", "lr-search-3")}
    assert named(None, "/runs/multirun/2026-12-04/x", 3) == {("x", "x-3")}  # a grid: its sweep directory's


SEARCH = ["-m", "hydra/sweeper=launch_optuna", "device=cpu", "logger=none"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            ["optim.lrr=tag(log,interval(1e-4,1e-2))"],
            "the search's overrides do not compose: Could not override 'optim.lrr'",
        ),
        (["optim.lr=tag(log,interval(0,1e-2))"], "optim.lr=tag(log,interval(0.0,0.01)) needs LOW > 0"),
        (
            ["optim.lr=interval(1e-4,1e-2)", "sweep.objective=accuracy"],
            "sweep.objective=accuracy is not a logged figure; use one of: loss, val_loss",
        ),
        (
            ["optim.lr=interval(1e-4,1e-2)", "trainer.eval_every=0"],
            "sweep.objective=val_loss but trainer.eval_every=0 never evaluates",
        ),
        (["optim.lr=interval(1e-4,1e-2)", "+sweep.pruner.nope=1"], "sweep.pruner cannot be built"),
        (["trainer.max_steps=5"], "nothing to search: give a distribution"),
        (
            ["optim.lr=interval(1e-4,1e-2)", "hydra.sweeper.n_trials=0"],
            "hydra.sweeper.n_trials=0 is invalid: it must be a positive integer",
        ),
        (
            ["optim.lr=interval(1e-4,1e-2)", "hydra.sweeper.storage=postgresql://me:pa55@db.example/studies"],
            "hydra.sweeper.storage=postgresql://***@db.example/studies: it carries credentials",
        ),
    ],
)
def test_a_search_that_cannot_run_is_one_line_before_anything_is_written(
    tmp_path: Path, overrides: list[str], words: str
) -> None:
    run = launch_here(tmp_path, *SEARCH, *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch: error: ") and words in lines[0], run.stderr
    assert not (tmp_path / "sweep").exists() and "pa55" not in run.stdout + run.stderr


@pytest.mark.parametrize(
    "content, words",
    [
        (b"this is not a database\n", "is not a SQLite database (it begins b'this is not '), so no study"),
        (b"SQLite format 3\x00" + bytes(84) + b"cut short", "is a damaged SQLite database"),
        ("other", "is a SQLite database of something else (its tables: notes), not a study"),
    ],
)
def test_a_study_file_that_holds_no_study_is_one_line_and_left_as_it_is(
    tmp_path: Path, content: bytes | str, words: str
) -> None:
    import sqlite3

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    db = sweep / "study.db"
    if content == "other":  # another program's database, named as the sweeper names its own
        with sqlite3.connect(db) as made:
            made.execute("CREATE TABLE notes (text)")
        made.close()
    else:
        db.write_bytes(content)  # type: ignore[arg-type]
    before = db.read_bytes()
    run = launch_here(tmp_path, *SEARCH, "optim.lr=interval(1e-4,1e-2)", f"hydra.sweep.dir={sweep}")
    assert run.returncode == 2, (run.stdout, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"launch: error: {db} ") and words in line, line
    assert line.endswith("or choose another hydra.sweep.dir; study.db is left as it is"), line
    assert db.read_bytes() == before and sorted(p.name for p in sweep.iterdir()) == [".study.lock", "study.db"]


def _trial_cfg(url: str, trial: int | None, pruner: dict | None) -> object:
    from omegaconf import OmegaConf

    sweep = {
        "objective": "val_loss",
        "objective_at": "last",
        "direction": "minimize",
        "pruner": pruner,
        "study": "s",
        "storage": url,
        "trial": trial,
    }
    return OmegaConf.create({"sweep": sweep})


def test_rank_0_reports_each_evaluation_to_its_trial_and_the_pruner_stops_it_but_never_at_the_last(
    tmp_path: Path,
) -> None:
    from launcher.search.trial import TrialReport

    url = storage_url(None, tmp_path)
    study = open_study("s", url, "minimize", None, None, [])
    trial = study.ask()
    always = {"_target_": "optuna.pruners.ThresholdPruner", "upper": 0.0}
    assert not TrialReport(_trial_cfg(url, trial.number, always), rank=1).report(2, {"val_loss": 3.0}, last=False)
    assert not TrialReport(_trial_cfg(url, None, always), rank=0).report(2, {"val_loss": 3.0}, last=False)
    rank0 = TrialReport(_trial_cfg(url, trial.number, always), rank=0)
    assert not rank0.report(1, {"loss": 3.5}, last=False)  # no objective at this step: nothing reported
    assert rank0.report(2, {"loss": 3.4, "val_loss": 3.0}, last=False)
    assert not rank0.report(4, {"val_loss": 2.0}, last=True)  # the run has finished: its value stands
    assert study.trials[0].intermediate_values == {2: 3.0, 4: 2.0}
    never = TrialReport(_trial_cfg(url, trial.number, None), rank=0)  # sweep.pruner=null
    assert not never.report(6, {"val_loss": 9.0}, last=False)


def test_a_trials_outcome_is_its_state_and_objective(tmp_path: Path) -> None:
    from launcher.search.objective import trial_outcome
    from launcher.search.trial import record_pruned

    cfg = _trial_cfg("sqlite://", 7, None)
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 3.1, "val_loss": 3.0}\n{"step": 4, "loss": 2.9}\n')
    done = trial_outcome(cfg, tmp_path, 0, "")
    assert (done["trial"], done["state"], done["objective"], done["direction"]) == (7, "complete", 3.0, "minimize")
    assert trial_outcome(cfg, tmp_path, 2, "optim.lr=-1.0 is invalid")["state"] == "failed"
    assert trial_outcome(cfg, tmp_path, 143, "stopped by SIGTERM")["state"] == "stopped"
    assert trial_outcome(_trial_cfg("sqlite://", None, None), tmp_path, 0, "") == {}  # no trial: no search
    record_pruned(tmp_path, 2, "val_loss", 3.0)
    assert trial_outcome(cfg, tmp_path, 0, "") | {"objective_name": None} == {
        "trial": 7,
        "objective_name": None,
        "objective": 3.0,
        "direction": "minimize",
        "state": "pruned",
        "pruned_at": 2,
    }
    (tmp_path / "pruned.json").unlink()
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 3.1}\n')
    assert trial_outcome(cfg, tmp_path, 0, "")["reason"] == "no objective: the run logged no val_loss"


def test_a_command_that_searches_something_else_than_its_study_is_one_line(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    open_study("search", storage_url(None, sweep), "minimize", None, None, ["optim.lr: another space"])
    run = launch_here(tmp_path, *SEARCH, "optim.lr=interval(1e-4,1e-2)", f"hydra.sweep.dir={sweep}")
    assert run.returncode == 2, (run.stdout, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"launch: error: study 'search' in {storage_url(None, sweep)} searched "), line
    assert "searched optim.lr: another space, this command device=cpu; optim.lr: {" in line, line  # logger: not
    assert line.endswith("start another with hydra.sweeper.study_name=... (or another hydra.sweep.dir)"), line
    assert len(optuna.load_study(study_name="search", storage=storage_url(None, sweep)).trials) == 0
    hold(sweep).close()  # the refused sweeper let go of its study


MULTI = ["sweep.objective=[val_loss,tokens_per_s]", "sweep.direction=[minimize,maximize]"]


@pytest.mark.parametrize(
    "objective, direction, words",
    [
        (["val_loss", "tokens_per_s"], "minimize", "give one direction per objective, e.g. sweep.direction=[minimize"),
        (["val_loss", "val_loss"], ["minimize", "minimize"], "the objectives must be distinct figure names"),
        (["val_loss", "tokens_per_s"], ["minimize", "up"], "a direction is minimize or maximize, not up"),
        (["val_loss"], ["minimize"], "a list is for several objectives; give one as sweep.objective=NAME"),
    ],
)
def test_objectives_that_do_not_say_what_to_optimise_are_one_line(objective, direction, words: str) -> None:
    from launcher.search.objective import ObjectiveError, figures

    with pytest.raises(ObjectiveError, match=re.escape(words)):
        figures({"objective": objective, "direction": direction})
    assert figures({"objective": "val_loss", "direction": "maximize"}) == [("val_loss", "maximize")]


def test_a_trial_of_several_objectives_is_each_figure_at_the_last_step_and_the_study_is_optunas_multi_objective(
    tmp_path: Path,
) -> None:
    from omegaconf import OmegaConf

    from launcher.search.objective import trial_outcome

    sweep = {
        "objective": ["val_loss", "tokens_per_s"],
        "objective_at": "last",
        "direction": ["minimize", "maximize"],
        "pruner": None,
        "study": "s",
        "storage": "sqlite://",
        "trial": 0,
    }
    cfg = OmegaConf.create({"sweep": sweep})
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 2, "val_loss": 3.0, "tokens_per_s": 90}\n{"step": 4, "val_loss": 2.5, "tokens_per_s": 80}\n'
    )
    record = trial_outcome(cfg, tmp_path, 0, "")
    assert (record["state"], record["objective"]) == ("complete", [2.5, 80.0])
    study = open_study("m", storage_url(None, tmp_path), ["minimize", "maximize"], None, None, [])
    trial = study.ask()
    assert tell(study, trial, record) == ("complete", False) and study.best_trials[0].values == [2.5, 80.0]
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "val_loss": 3.0}\n')
    assert trial_outcome(cfg, tmp_path, 0, "")["reason"] == "no objective: the run logged no tokens_per_s"


def test_the_report_of_a_multi_objective_study_shows_its_pareto_front(tmp_path: Path) -> None:
    from launcher.search.report import front

    values = {0: [3.0, 100.0], 1: [2.0, 90.0], 2: [2.5, 80.0], 3: [1.5, 50.0], 4: None}  # 2: beaten by 1 on both
    for n, value in values.items():
        (tmp_path / str(n)).mkdir()
        record = {
            "code": 0,
            "overrides": [f"optim.lr={n / 100}", f"sweep.trial={n}"],
            "trial": n,
            "params": {"optim.lr": n / 100},
            "state": "complete" if value else "failed",
            "objective": value,
            "objective_name": ["val_loss", "tokens_per_s"],
            "direction": ["minimize", "maximize"],
        }
        (tmp_path / str(n) / "outcome.json").write_text(json.dumps(record))
    ran, best = trials(collect(tmp_path))
    assert best is None and [t["trial"] for t in front(ran)] == [0, 1, 3]
    rows = trials_table(collect(tmp_path)).splitlines()
    assert rows[0] == "| trial | parameters | val_loss (min) | tokens_per_s (max) | state | |"
    assert rows[2] == "| 0 | optim.lr=0 | 3 | 100 | complete | Pareto front |"
    assert rows[4] == "| 2 | optim.lr=0.02 | 2.5 | 80 | complete |  |"
    assert rows[6] == "| 4 | optim.lr=0.04 | — | — | failed |  |"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            MULTI,
            "sweep.pruner=optuna.pruners.MedianPruner cannot prune a study of 2 objectives (Optuna prunes "
            "single-objective studies only); add sweep.pruner=null",
        ),
        ([*MULTI, "sweep.pruner=null", "sweep.objective_at=best"], "sweep.objective_at=best with 2 objectives"),
        (["sweep.objective=[val_loss,tokens_per_s]", "sweep.pruner=null"], "give one direction per objective"),
    ],
)
def test_a_multi_objective_search_that_cannot_run_is_one_line(tmp_path: Path, overrides: list[str], words: str) -> None:
    run = launch_here(
        tmp_path, *SEARCH, "optim.lr=interval(1e-4,1e-2)", *overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("launch: error: ") and words in line, line
    assert not (tmp_path / "sweep").exists()
