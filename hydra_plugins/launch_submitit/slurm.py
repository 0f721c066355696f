"""Hydra's submitit_slurm launcher, with the allocation checked before anything is submitted: SLURM queues a job it
can never start (more nodes than the partition has) and leaves it pending forever, and a refused sbatch reaches the
terminal as a traceback. `sbatch --test-only` of the very script submitit would submit says either in one line."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra_plugins.hydra_submitit_launcher import submitit_launcher

from launcher.config import EXIT_BAD_INPUT


class SlurmLauncher(submitit_launcher.SlurmLauncher):
    """What hydra/launcher=submitit_slurm runs (`launcher.clusters.slurm.SUBMITIT_SLURM`): Hydra's own launcher, once
    SLURM said it can start the job."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        if refusal := self.refusal():
            print(f"launch: error: {refusal}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_BAD_INPUT)
        return super().launch(job_overrides, initial_job_idx)

    def refusal(self) -> str | None:
        """Why SLURM would not start this job (one line, from `sbatch --test-only`), or None where it would."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        base = set(OmegaConf.structured(BaseQueueConf).keys())  # the parameters as the plugin's launch passes them
        own = {"submitit_folder", "max_num_timeout"}
        params = {k if k in base else f"slurm_{k}": v for k, v in self.params.items() if k not in own}
        with tempfile.TemporaryDirectory() as folder:
            executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
            executor.update_parameters(**params)
            script = Path(folder) / "check.sh"
            script.write_text(executor._executor._make_submission_file_text("true", "check"))
            try:
                said = subprocess.run(
                    ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=120
                )
            except (OSError, subprocess.SubprocessError) as e:
                return f"sbatch cannot be run here ({e}); submit from a machine of the SLURM cluster"
        if said.returncode == 0:
            return None
        reason = "; ".join(line.removeprefix("sbatch: error: ") for line in said.stderr.strip().splitlines())
        shape = f"nodes={self.params.get('nodes')}, gpus_per_node={self.params.get('gpus_per_node')}"
        if self.params.get("partition"):
            shape += f", partition={self.params['partition']}"
        return (
            f"SLURM cannot give this job its allocation ({shape}): {reason or 'sbatch --test-only failed'}; "
            "ask within what `sinfo -o '%P %D %G'` lists for each partition (nodes, GPUs), or choose another one "
            "with hydra.launcher.partition="
        )
