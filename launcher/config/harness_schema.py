"""The `harness` node: lm-evaluation-harness tasks that `launch eval CHECKPOINT` runs on the checkpoint's transformers
folder, after the launcher's own validation (`launcher.export.harness`)."""

from __future__ import annotations

from dataclasses import dataclass

from launcher.config.ranges import COUNT, SIZE, launch_only


@dataclass
class HarnessConfig:
    tasks: list[str] = launch_only(factory=list)
    """lm-eval tasks, each by name (a task, group or tag of lm-eval's, or of harness.include_path) or as the path of
    a task YAML; empty: none. `launch eval` only."""
    include_path: str | None = launch_only(None)
    """A folder of your own task YAMLs, indexed before lm-eval's own (lm-eval's `--include_path`)."""
    num_fewshot: int | None = launch_only(None, valid=COUNT)
    """Examples in each prompt; unset: each task's own."""
    limit: int | None = launch_only(None, valid=SIZE)
    """The first N documents of each task; unset: all of them."""
    batch_size: int = launch_only(1, valid=SIZE)
    """Requests per forward pass (lm-eval's `--batch_size`)."""
