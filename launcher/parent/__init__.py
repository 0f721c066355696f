"""The parent, one per node: the `launch` console script (`cli`) and its subcommands (`convert`; `launch plan` in
`launcher.plan.commands`, `launch prepare` in `launcher.prepare.store`), the overrides composed once (`overrides`),
the job checked before any worker starts (`checks`, in order: the optimizer's `launcher.optim.checks`, the
data's `launcher.data.checks`, the model's `launcher.models.checks`, the evaluation's `launcher.evaluation.checks`, the
loggers' `launcher.loggers.checks`, the memory tier's `launcher.recovery.shm`; everything a run will
build, without its memory), its
workers started through torch's elastic agent (`launch`, `workers`; the agent, the rendezvous and the failures' lines
in `launcher.elastic`), its run directory claimed and its run id made (`rundir`, `run_id`), and `launch eval`
(`cli`); a sweep's report is the search's (`launcher.search.report`).

May import every other package of the launcher (it is the top); nothing imports it but the console script and the
Hydra plugins in `hydra_plugins/`.
"""
