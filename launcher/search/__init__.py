"""Sweeps that search: current Optuna, through its ask-and-tell API, behind a Hydra sweeper of our own
(`hydra/sweeper=launch_optuna`, `hydra_plugins/launch_optuna/`).

- `schema`: `sweep.*` of a run's config: which logged figure is the objective, and which trial a run is;
- `space`: the search space, written in Hydra's override grammar, as Optuna's distributions, and back;
- `objective`: a trial's objective (or objectives, a multi-objective study) read from the figures its run logged;
- `study`: the study in its storage (a SQLite file in the sweep directory by default): opened, checked to be the same
  study, continued after a kill, each trial's outcome told;
- `claims`: the storage a study lives in (SQLite, Optuna's journal, a database URL), and which of several sweepers of
  one study runs which trial (locks in the shared sweep directory);
- `trial`: in a trial's run, rank 0 reports the objective at each step that logs it and asks the pruner;
- `report`: a sweep's report, every trial's figures in one table (a Hydra callback: `hydra.callbacks`).

Nothing here imports optuna at module level: `launch --help` and runs outside a search never pay for it.
"""
