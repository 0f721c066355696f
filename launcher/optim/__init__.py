"""The optimizer recipe, in one room: parameter groups by rule (`groups`), the configured optimizer built over them
(`build`), several optimizers over one model (`grouped`), optim=muon (`muon`), the learning-rate schedule
(`schedules`), their checks before start over the model on the meta device (`checks`, called by the parent), and the
collectives an optimizer adds to the plan (`plan`, read by `launcher.plan`).

May import: `launcher.base`, `launcher.config`, `launcher.models`, `strategies`; never the worker's or parent's
modules.
"""
