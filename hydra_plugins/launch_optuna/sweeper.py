"""`hydra/sweeper=launch_optuna`: a Hydra sweeper that searches with current Optuna, through its ask-and-tell API.

Hydra finds it by scanning the `hydra_plugins` namespace, so this module stays cheap to import (Hydra and OmegaConf
only): optuna and the launcher's search (`launcher.search`) are imported when a search starts. Each trial is one job
of Hydra's launcher (a whole distributed run, in `<sweep dir>/<trial number>`); its task function returns the
trial's state and objective, which the sweeper tells the study. A trial that fails or is refused is told as failed,
and the study goes on; a stop signal ends the sweep, and the same command continues the study.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf


@dataclass
class LaunchOptunaSweeperConf:
    _target_: str = "hydra_plugins.launch_optuna.sweeper.LaunchOptunaSweeper"
    _recursive_: bool = False
    """The sampler is built by the sweeper when the search starts, so that a bad one is one line."""
    n_trials: int = 20
    """The study's budget: every trial the study has made (complete, pruned, failed or running), by every sweeper and
    every run of the same command."""
    study_name: str = "search"
    storage: str | None = None
    """Where the study lives. Unset: sqlite:///<sweep dir>/study.db, for one sweeper at a time. For several sweepers on
    one study: `journal` (Optuna's journal file, <sweep dir>/study.journal, on a shared folder), `journal:PATH`, or a
    database URL (postgresql://user@host/db; the password from PGPASSWORD or ~/.pgpass, never the URL)."""
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": 0})
    """Any Optuna sampler; TPE, seeded, by default. A continued study's is seeded with seed + the trials it holds: it
    does not draw its earlier points again."""
    params: dict[str, str] | None = None
    """The search space, as overrides: {optim.lr: 'tag(log,interval(1e-4,1e-2))', ...}; the command line adds to
    it."""


ConfigStore.instance().store(
    group="hydra/sweeper", name="launch_optuna", node=LaunchOptunaSweeperConf, provider="launch"
)


class LaunchOptunaSweeper(Sweeper):
    def __init__(
        self, n_trials: int, study_name: str, storage: str | None, sampler: Any, params: dict[str, str] | None = None
    ) -> None:
        self.n_trials, self.study_name, self.storage = n_trials, study_name, storage
        self.sampler, self.params = sampler, dict(params or {})
        self.hydra_context: Any = None
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        """The study's interrupted trials first, then new ones until its budget is spent."""
        from launcher.search.claims import pick
        from launcher.search.space import SpaceError
        from launcher.search.study import SWEEP_DIR, StudyError, ended, tell

        try:
            study, space, sweep_dir = self._open(arguments)
        except (SpaceError, StudyError) as e:
            print(f"launch: error: {e}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        returns, exhausted = [], False
        while not exhausted:
            try:  # the study's interrupted trials first (each goes on in its own folder), then new ones
                picked = pick(study, self.claims, space.distributions, self.n_trials, self._reseed)
            except ValueError as e:  # a sampler that cannot sample this space (a grid over an interval)
                print(f"launch: error: hydra.sweeper.sampler: {_one_line(e)}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            if picked is None:
                break
            trial, interrupted = picked
            record = ended(sweep_dir / str(trial.number)) if interrupted else None
            if record is not None:  # its run had ended, its outcome not yet told
                print(f"launch: trial {trial.number} had ended ({tell(study, trial, record)[0]})", flush=True)
            elif interrupted:
                print(
                    f"launch: trial {trial.number} was interrupted; it goes on in its folder, from its last "
                    "checkpoint if it saved one",
                    flush=True,
                )
                exhausted = self._run(study, trial, space, returns)
            else:
                trial.set_user_attr(SWEEP_DIR, str(sweep_dir))
                exhausted = self._run(study, trial, space, returns)
            self.claims.let_go(trial.number)
        if exhausted:
            print(
                f"launch: the sampler has tried every point of the space: the study ends at {len(study.trials)} "
                "trial(s)",
                flush=True,
            )
        self._say_best(study)
        return returns

    def _open(self, arguments: list[str]) -> tuple[Any, Any, Path]:
        """The search space, the objective and the study, checked before anything is written; the study held."""
        from hydra.utils import instantiate

        from launcher.base.storage import masked, secret_in
        from launcher.config.ranges import SIZE
        from launcher.search.claims import Claims, check_home, spec
        from launcher.search.space import SpaceError, parse
        from launcher.search.study import StudyError, finished, open_study

        assert self.config is not None
        if not SIZE.holds(self.n_trials):  # as the schema's ranges say it
            raise SpaceError(f"hydra.sweeper.n_trials={self.n_trials} is invalid: it must be {SIZE.rule}")
        if self.storage and (secret := secret_in([f"hydra.sweeper.storage={self.storage}"])):
            raise SpaceError(secret)  # the trials' configs would hold it
        space = parse([*(f"{k}={v}" for k, v in self.params.items()), *arguments])
        if not space.distributions:
            raise SpaceError(
                "nothing to search: give a distribution, e.g. optim.lr=tag(log,interval(1e-4,1e-2)), or "
                "hydra.sweeper.params; a list of values to run each of is the basic sweeper's (no hydra/sweeper=)"
            )
        sweep = OmegaConf.to_container(self.config.sweep, resolve=True, enum_to_str=True)
        assert isinstance(sweep, dict)
        self._check_objective(sweep)
        self.objective = {"objective_name": sweep["objective"], "direction": sweep["direction"]}
        self._check_composes(space)
        try:
            sampler = instantiate(self.sampler)
            pruner = instantiate(sweep["pruner"]) if sweep["pruner"] is not None else None
        except Exception as e:
            raise SpaceError(f"hydra.sweeper.sampler or sweep.pruner cannot be built: {_one_line(e)}") from e
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).absolute()
        url = spec(self.storage, sweep_dir)
        definition = [
            *space.definition(),
            *(f"sweep.{k}={sweep[k]}" for k in ("objective", "objective_at", "direction")),
        ]
        claims = Claims(sweep_dir, url)  # a SQLite study: held for this sweeper's life
        try:
            with claims.study():  # its first open makes a database's tables: one sweeper at a time
                study = open_study(self.study_name, url, sweep["direction"], sampler, pruner, definition)
                if not claims.whole_life:  # a shared study: its sweepers meet in one sweep directory
                    check_home(study, sweep_dir, masked(url))
        except StudyError:
            claims.close()
            raise
        self.claims, self.study = claims, study  # its locks held while this process lives
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.url, self.sweep_dir, done = url, sweep_dir, finished(study)
        again = f"continuing: {done} of {self.n_trials} trial(s) done" if done else f"{self.n_trials} trial(s)"
        print(f"launch: study {self.study_name!r} ({masked(url)}): {again}", flush=True)
        return study, space, sweep_dir

    def _reseed(self, made: int) -> None:
        """The sampler seeded by the place of the trial it draws (seed + trials the study has made): sweepers of one
        study, and a continued study, do not draw the same points again."""
        from hydra.utils import instantiate

        seed = self.sampler.get("seed") if self.sampler else None
        if made and seed is not None:
            self.study.sampler = instantiate(self.sampler, seed=seed + made)

    def _check_objective(self, sweep: dict[str, Any]) -> None:
        """Any figure the run logs, by name: a declared one, or the evaluation's (val/<metric>: trainer.metrics)."""
        from launcher.base.metrics import METRICS, logged_figures
        from launcher.search.objective import ObjectiveError, figures
        from launcher.search.space import SpaceError

        assert self.config is not None
        try:
            objectives = figures(sweep)
        except ObjectiveError as e:
            raise SpaceError(str(e)) from None
        if len(objectives) > 1 and (pruner := sweep["pruner"]) is not None:
            named = pruner.get("_target_") if isinstance(pruner, dict) else pruner
            raise SpaceError(
                f"sweep.pruner={named} cannot prune a study of {len(objectives)} objectives "
                "(Optuna prunes single-objective studies only); add sweep.pruner=null"
            )
        if len(objectives) > 1 and sweep["objective_at"] != "last":
            raise SpaceError(
                f"sweep.objective_at={sweep['objective_at']} with {len(objectives)} objectives would take each at "
                "another step, of another model; a multi-objective study takes them at the run's last step: "
                "sweep.objective_at=last"
            )
        logged = logged_figures(self.config)
        for name, _ in objectives:
            if name.startswith("val") and not self.config.trainer.eval_every:
                raise SpaceError(
                    f"sweep.objective={name} but trainer.eval_every=0 never evaluates; set trainer.eval_every=N "
                    "(each evaluation is also where a trial may be pruned)"
                )
            if name not in logged and not any(name.startswith(f"{figure}/") for figure in logged):
                names = [n for n in METRICS if n in logged] + sorted(logged - set(METRICS))
                raise SpaceError(f"sweep.objective={name} is not a logged figure; use one of: {', '.join(names)}")

    def _check_composes(self, space: Any) -> None:
        """One trial's overrides at the low end of every distribution compose (unknown keys, wrong types)."""
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        from launcher.search.space import SpaceError, low_end

        try:
            self.validate_batch_is_legal([space.overrides(low_end(space.distributions))])
        except (HydraException, OmegaConfBaseException) as e:
            raise SpaceError(f"the search's overrides do not compose: {_one_line(e)}") from e

    def _run(self, study: Any, trial: Any, space: Any, returns: list[Any]) -> bool:
        """One trial: its run as one job of Hydra's launcher, in `<sweep dir>/<trial number>`; its outcome told.
        True when the sampler has no point left."""
        from launcher.search.study import tell

        overrides = [
            *space.overrides(trial.params),
            f"sweep.trial={trial.number}",
            f"sweep.study={self.study_name}",
            f"sweep.storage='{self.url}'",
        ]
        result = None
        try:  # a value that does not compose (a wrong type) fails in the launcher, one that the run refuses in the job
            (result,) = self.launcher.launch([overrides], initial_job_idx=trial.number)
            record = result.return_value
        except Exception as e:  # the trial failed; the study goes on
            record = {"state": "failed", "reason": _one_line(e)}
        if not isinstance(record, dict) or "state" not in record:
            record = {"state": "failed", "reason": f"the job returned {record!r}, not a trial's outcome"}
        record = self._record(trial, record)
        if record["state"] == "stopped":  # a stop signal: the trial stays RUNNING, the same command continues it
            print(
                f"launch: the study stopped during trial {trial.number}; run the same command to continue it",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(int(record.get("code") or 1))
        state, exhausted = tell(study, trial, record)
        names, values = record.get("objective_name"), record.get("objective")
        pairs = zip(names, values) if isinstance(values, list) else [(names, values)]
        shown = ", ".join(f"{n} {v:.6g}" for n, v in pairs) if values is not None else record.get("reason", "")
        print(f"launch: trial {trial.number} {state}: {shown}", flush=True)
        returns.extend([result] if result is not None else [])
        return exhausted

    def _record(self, trial: Any, record: dict[str, Any]) -> dict[str, Any]:
        """The trial's outcome in its folder, for the report, with its parameters (also when no job started)."""
        import json

        record = {**self.objective, "objective": None, **record, "trial": trial.number, "params": trial.params}
        folder = self.sweep_dir / str(trial.number)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "outcome.json").write_text(json.dumps(record))
        return record

    def _say_best(self, study: Any) -> None:
        from optuna.trial import TrialState

        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            print("launch: no trial of the study completed", file=sys.stderr, flush=True)
            return
        if len(study.directions) > 1:  # several objectives: the trials no other beats on every one
            names = self.objective["objective_name"]
            front = ", ".join(
                f"trial {t.number} ({', '.join(f'{n} {v:.6g}' for n, v in zip(names, t.values))})"
                for t in sorted(study.best_trials, key=lambda t: t.number)
            )
            print(f"launch: Pareto front: {front}", flush=True)
            return
        best = study.best_trial
        params = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in best.params.items())
        print(f"launch: best trial {best.number}: {best.value:.6g} ({params})", flush=True)


def _one_line(e: BaseException) -> str:
    from launcher.config import one_line

    return one_line(e)
