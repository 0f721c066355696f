"""launch's search sweeper for Hydra: `hydra/sweeper=launch_optuna` (found by Hydra's plugin scan of the
`hydra_plugins` namespace; see `sweeper`)."""
