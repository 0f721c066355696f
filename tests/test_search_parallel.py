"""Several sweepers on one study, on Optuna's journal storage and on a PostgreSQL server started for the tests: trials
run at once, none lost and none run twice; a sweeper killed mid-trial and started again, its trial going on once, from
its checkpoint; the pruner comparing trials across sweepers; a storage that cannot be used refused in one line, its
password never shown.

The claims are tested with a sweeper reduced to them (tests/claims_sweeper.py: the real storage, picking and telling;
a trial is a loop of steps with checkpoints); the long tests run the same with `launch -m` and real trials."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from conftest import LAUNCH, TINY, clean_env, launch_here
from optuna.trial import TrialState

from launcher.search.claims import Claims, check_home, pick, spec
from launcher.search.study import StudyError, open_study, storage

SWEEPER = str(Path(__file__).with_name("claims_sweeper.py"))


def until(ready: Callable[[], bool], procs: list[subprocess.Popen[str]]) -> None:
    """Poll until `ready()`, or fail when every process has ended first."""
    while not ready():
        assert any(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)


def steps_of(folder: Path) -> list[tuple[int, int]]:
    path = folder / "steps"
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []  # type: ignore[misc]


def storage_spec(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "journal":
        return spec("journal", tmp_path / "sweep")
    name = re.sub(r"\W", "_", f"t{os.getpid()}_{request.node.name[-30:]}").lower()  # one database per test
    return request.getfixturevalue("postgres").database(name)


def pg_env(request: pytest.FixtureRequest, env: dict[str, str], kind: str) -> dict[str, str]:
    """The sweepers' environment; for PostgreSQL, libpq's password there and in this process (which reads back)."""
    if kind != "postgres":
        return env
    password = request.getfixturevalue("postgres").password
    request.getfixturevalue("monkeypatch").setenv("PGPASSWORD", password)
    return env | {"PGPASSWORD": password}


@pytest.mark.parametrize("kind", ["journal", "postgres"])
def test_two_sweepers_run_six_trials_each_once_and_a_killed_ones_trial_goes_on_from_its_checkpoint(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    spelled, sweep = storage_spec(kind, tmp_path, request), tmp_path / "sweep"
    env = pg_env(request, clean_env(tmp_path), kind)
    cmd = [sys.executable, SWEEPER, spelled, str(sweep), "6"]

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first, second = start(), start()
    # `first` is killed once one of its trials has logged a step after its first checkpoint (step 3)
    mid: list[int] = []

    def first_is_mid_trial() -> bool:
        for folder in sweep.glob("[0-9]*"):
            if (first.pid, 4) in steps_of(folder):
                mid.append(int(folder.name))
                return True
        return False

    until(first_is_mid_trial, [first, second])
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    again = start()
    outs = [p.communicate(timeout=300)[0] for p in (second, again)]
    assert second.returncode == again.returncode == 0, outs

    trials = optuna.load_study(study_name="s", storage=storage(spelled)).get_trials()
    assert [t.number for t in trials] == list(range(6)), trials
    assert {t.state for t in trials} == {TrialState.COMPLETE}
    assert len({t.params["x"] for t in trials}) == 6  # each sweeper drew another point
    (killed,) = mid
    assert sum(f"resumes {killed}" in out for out in outs) == 1, outs  # taken over by one sweeper
    assert not any("resumes" in out and f"resumes {killed}" not in out for out in outs), outs
    for trial in trials:
        steps = [step for _, step in steps_of(sweep / str(trial.number))]
        if trial.number != killed:
            assert steps == list(range(1, 9)), (trial.number, steps)  # run once, by one sweeper
            continue
        # the killed attempt's steps up to the kill, then on from its checkpoint: every step after it once
        saved = max(s for s in steps[: steps.index(4) + 1] if s % 3 == 0)
        cut = len(steps) - (8 - saved)
        assert steps[cut:] == list(range(saved + 1, 9)) and steps[:cut][: saved + 1] == list(range(1, saved + 2))
        assert [pid for pid, step in steps_of(sweep / str(killed))[:cut]] == [first.pid] * cut


@pytest.mark.unit
def test_the_pruner_compares_a_trial_with_the_trials_other_sweepers_ran(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from launcher.search.trial import TrialReport

    spelled = spec("journal", tmp_path)
    other = optuna.create_study(study_name="s", storage=storage(spelled))  # another sweeper's storage object
    for value in (0.2, 0.4, 0.6):
        trial = other.ask()
        trial.report(value, 2)
        other.tell(trial, value)
    mine = optuna.load_study(study_name="s", storage=storage(spelled))
    worse, better = mine.ask(), mine.ask()
    median = {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 2, "n_warmup_steps": 0}

    def report(number: int, value: float) -> bool:
        sweep = {"objective": "val_loss", "pruner": median, "study": "s", "storage": spelled, "trial": number}
        return TrialReport(OmegaConf.create({"sweep": sweep}), rank=0).report(2, {"val_loss": value}, last=False)

    assert report(worse.number, 1.0) and not report(better.number, 0.3)


@pytest.mark.unit
def test_a_sweeper_takes_only_trials_no_live_sweeper_holds_and_the_budget_counts_every_trial_made(
    tmp_path: Path,
) -> None:
    spelled = spec("journal", tmp_path)
    space = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    one, two = Claims(tmp_path, spelled), Claims(tmp_path, spelled)  # two sweepers (flock: per open file)
    with one.study():
        study = open_study("s", spelled, "minimize", optuna.samplers.RandomSampler(seed=0), None, ["x"])
    seeds: list[int] = []
    first = pick(study, one, space, 2, seeds.append)
    second = pick(study, two, space, 2, seeds.append)
    assert first is not None and second is not None and (first[1], second[1]) == (False, False)
    assert pick(study, two, space, 2, seeds.append) is None and seeds == [0, 1]  # both made: the budget is spent
    one.close()  # its sweeper is gone: its running trial goes on with the next sweeper that picks, once
    assert (taken := pick(study, two, space, 2, seeds.append)) is not None and taken[1] is True
    assert taken[0].number == first[0].number and taken[0].params == first[0].params
    assert pick(study, Claims(tmp_path, spelled), space, 2, seeds.append) is None  # `two` holds both


@pytest.mark.unit
def test_a_study_run_from_another_sweep_directory_is_one_line(tmp_path: Path) -> None:
    spelled = spec("journal:" + str(tmp_path / "j.journal"), tmp_path)
    study = open_study("s", spelled, "minimize", None, None, [])
    check_home(study, tmp_path / "a", spelled)
    check_home(study, tmp_path / "a", spelled)  # the same: nothing to say
    with pytest.raises(StudyError, match=f"runs its trials in hydra.sweep.dir={tmp_path / 'a'}, this command in "):
        check_home(study, tmp_path / "b", spelled)


SEARCH = ["-m", "hydra/sweeper=launch_optuna", "device=cpu", "logger=none", "optim.lr=interval(1e-4,1e-2)"]


@pytest.mark.unit
@pytest.mark.parametrize("how", ["closed port", "wrong password"])
def test_a_database_that_does_not_connect_is_one_line_without_its_password(
    tmp_path: Path, postgres, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    import socket

    url = postgres.database("refused")
    if how == "closed port":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = url.replace(f":{postgres.port}/", f":{s.getsockname()[1]}/")
        monkeypatch.setenv("PGPASSWORD", postgres.password)
    else:
        monkeypatch.setenv("PGPASSWORD", "not-" + postgres.password)
    run = launch_here(tmp_path, *SEARCH, f"hydra.sweeper.storage={url}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert run.returncode == 2, (run.stdout, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    shown = url.replace("postgres@", "***@")
    assert line.startswith(f"launch: error: the study storage {shown} cannot be opened (OperationalError: "), line
    words = "Connection refused" if how == "closed port" else 'password authentication failed for user "postgres"'
    assert words in line and line.endswith("or choose another hydra.sweep.dir"), line
    assert postgres.password not in run.stdout + run.stderr and "postgres@" not in line
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == [".study.lock"]  # nothing written but the lock


@pytest.mark.unit
def test_a_database_driver_that_is_not_installed_is_one_line(tmp_path: Path) -> None:
    url = "mysql+mysqldb://me@127.0.0.1:1/studies"
    run = launch_here(tmp_path, *SEARCH, f"hydra.sweeper.storage={url}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert run.returncode == 2, (run.stdout, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    shown = "mysql+mysqldb://***@127.0.0.1:1/studies"
    words = "its database driver is not installed (No module named 'MySQLdb')"
    assert line.startswith(f"launch: error: the study storage {shown} cannot be opened: {words}"), line


@pytest.mark.unit
def test_a_study_in_the_database_that_searched_another_space_is_one_line(
    tmp_path: Path, postgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = postgres.database("differs")
    monkeypatch.setenv("PGPASSWORD", postgres.password)
    open_study("search", url, "minimize", None, None, ["optim.lr: another space"])
    run = launch_here(tmp_path, *SEARCH, f"hydra.sweeper.storage={url}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert run.returncode == 2, (run.stdout, run.stderr)
    (line,) = run.stderr.strip().splitlines()
    shown = url.replace("postgres@", "***@")
    assert line.startswith(f"launch: error: study 'search' in {shown} searched optim.lr: another space, this "), line
    assert len(optuna.load_study(study_name="search", storage=url).trials) == 0


JOB = [
    *(o for o in TINY if not o.startswith("trainer.eval_every")),
    "gpus=1",
    "batch.global_size=8",
    "trainer.eval_every=4",
    "trainer.eval_batches=1",
    "trainer.max_steps=12",
    "trainer.checkpoint_every=4",
    "sweep.pruner=null",  # every trial to its end; pruning across sweepers: test_the_pruner_compares_...
]


def raw_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.long  # ~3 min each on 2 cores: 6 real trials; the claims are the default tier's two-sweepers test
@pytest.mark.parametrize("kind", ["journal", "postgres"])
def test_two_launch_sweepers_run_a_study_of_six_trials_each_once_through_a_kill(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    sweep = tmp_path / "sweep"
    given = "journal" if kind == "journal" else storage_spec(kind, tmp_path, request)
    env = pg_env(request, clean_env(tmp_path), kind)
    cmd = [
        LAUNCH,
        "-m",
        "hydra/sweeper=launch_optuna",
        "optim.lr=tag(log,interval(1e-4,1e-2))",
        *JOB,
        "hydra.sweeper.n_trials=6",
        f"hydra.sweeper.storage={given}",
        f"hydra.sweep.dir={sweep}",
    ]
    logs: list[Path] = []

    def start() -> subprocess.Popen[str]:
        logs.append(tmp_path / f"sweeper{len(logs)}.out")
        with open(logs[-1], "w") as out:
            return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)

    first, second = start(), start()
    mid: list[int] = []

    def first_is_past_a_checkpoint() -> bool:  # a trial of `first` logged a step after its first checkpoint
        for folder in sweep.glob("[0-9]*"):
            try:
                pid = json.loads((folder / "claim.json").read_text())["pid"]
            except (OSError, ValueError, KeyError):
                continue
            if pid == first.pid and (folder / "checkpoints" / "latest").exists() and max(raw_steps(folder)) > 4:
                mid.append(int(folder.name))
                return True
        return False

    until(first_is_past_a_checkpoint, [first, second])
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    again = start()
    assert second.wait(timeout=600) == 0 and again.wait(timeout=600) == 0, [log.read_text() for log in logs]
    outs = [log.read_text() for log in logs[1:]]

    study = optuna.load_study(study_name="search", storage=storage(spec(given, sweep)))
    trials = study.get_trials()
    assert [t.number for t in trials] == list(range(6)) and {t.state for t in trials} == {TrialState.COMPLETE}
    (killed,) = mid
    assert sum(f"launch: trial {killed} was interrupted" in out for out in outs) == 1, outs  # one sweeper took it
    for trial in trials:
        steps = raw_steps(sweep / str(trial.number))
        if trial.number != killed:
            assert steps == list(range(1, 13)), (trial.number, steps)  # run once
            continue
        found = re.search(rf"resuming from \S+/{killed}/checkpoints/step_(\d+)", "".join(outs))
        assert found is not None, outs
        resumed_from = int(found.group(1))
        assert resumed_from >= 4 and steps[-(12 - resumed_from) :] == list(range(resumed_from + 1, 13)), steps
        assert steps[:resumed_from] == list(range(1, resumed_from + 1)), steps
    summary = (sweep / "summary.md").read_text()  # written by the sweeper that ended last: every trial of the study
    table = summary.split("| trial | parameters |")[1].split("\n\n")[0].splitlines()[2:]
    assert [(int(row.split("|")[1]), row.split("|")[4].strip()) for row in table] == [(n, "complete") for n in range(6)]
