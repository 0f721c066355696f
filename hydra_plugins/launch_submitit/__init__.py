"""launch's submitit_slurm launcher for Hydra: Hydra's own, with the allocation checked before anything is submitted
(found by Hydra's plugin scan of the `hydra_plugins` namespace; see `slurm`)."""
