"""The worker, one per rank: its entry (`main`: started by the elastic agent, forked from the launcher on CPU), the
common runner and its phases (`runner`), its training data and the ranks' agreement that a stream ended (`feed`), one
optimizer step (`step`), the evaluation with the metrics of the user's choice, reduced exactly (`evaluation`,
`eval_metrics`), early stopping and callbacks (`callbacks`), the guard of a step that is not finite (`guard`), a
collective that gave up (`hangs`), a mixture's loss per source (`source_loss`), the optimizer over its parameter groups
and the schedule (`optimizers`, `param_groups`, `muon`, `schedules`), memory, speed, stragglers and profiles (`memory`,
`speed`, `stragglers`, `profiling`), the micro-batch an out-of-memory error halves (`adapt`), the checkpoint every rank
resumes from (`resume`), the rank's phase, signals and failure reports (`lifecycle`), and the loggers rank 0 writes to
(`logs`, `mlflow_logger` with its store in `mlflow_store`, `tensorboard_logger`).

A change to the training loop is made here. May import: `launcher.base`, `launcher.data`, `launcher.config`,
`launcher.models`, `launcher.checkpoint`, `launcher.plan` (its cost arithmetic), `launcher.search` (a trial's report),
`launcher.adapters`, `strategies`; never `launcher.parent`.
"""
