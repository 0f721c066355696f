"""The worker, one per rank: its entry (`main`: started by the elastic agent, forked from the launcher on CPU), the
common runner and its phases (`runner`), one optimizer step and one evaluation (`step`), the guard of a step that is
not finite (`guard`), a mixture's loss per source (`source_loss`), optimizers and the schedule (`optimizers`),
memory, speed, stragglers and profiles (`memory`, `speed`, `stragglers`, `profiling`), the micro-batch an
out-of-memory error halves (`adapt`), the checkpoint every rank resumes from (`resume`), the rank's phase, signals
and failure reports (`lifecycle`), and the loggers rank 0 writes to (`logs`, `mlflow_logger` with its store in
`mlflow_store`, `tensorboard_logger`).

A change to the training loop is made here. May import: `launcher.base`, `launcher.data`, `launcher.config`,
`launcher.models`, `launcher.checkpoint`, `launcher.plan` (its cost arithmetic), `launcher.search` (a trial's report),
`strategies`; never `launcher.parent`.
"""
