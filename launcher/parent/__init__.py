"""The parent, one per node: the `launch` console script (`cli`) and its subcommands (`convert`; `launch plan` in
`launcher.plan.commands`, `launch prepare` in `launcher.data.store_build`), the overrides composed once (`overrides`),
the job checked before any worker starts (`checks`, in order: the optimizer's `launcher.optim.checks`, the
data's `launcher.data.checks`, the model's `launcher.models.checks`, the evaluation's `launcher.evaluation.checks`, the
loggers' `launcher.loggers.checks`, the memory tier's `launcher.recovery.shm`; everything a run will
build, without its memory), its
workers started through torch's elastic agent (`launch`, `workers`, `agent`, `rendezvous`), its run directory claimed
and its run id made (`rundir`, `run_id`), a failure told in one line by its cause (`failures`), a sweep's report
(`report`), and `launch eval` (`cli`).

May import every other package of the launcher (it is the top); nothing imports it but the console script and the
Hydra plugins in `hydra_plugins/`.
"""
