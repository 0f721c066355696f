"""The worker, one per rank: its entry (`main`: started by the elastic agent, forked from the launcher on CPU), the
common runner and its phases (`runner`), its training data and the ranks' agreement that a stream ended (`feed`), one
optimizer step (`step`), the guard of a step that is not finite (`guard`), a collective that gave up (`hangs`), a
mixture's loss per source (`source_loss`), and the rank's phase, signals and failure reports (`lifecycle`).

Each concern the loop calls has its own room: the optimizer (`launcher.optim`), evaluation (`launcher.evaluation`),
the loggers (`launcher.loggers`), the memory tier and adaptation (`launcher.recovery`), measurements
(`launcher.telemetry`), checkpoints and resume (`launcher.checkpoint`). A change to the training loop is made here.
May import every room below it; never `launcher.parent`. The parent imports nothing of it but its entry point
(`main`); what both sides share is `launcher.base.run_files` and `launcher.base.process`.
"""
