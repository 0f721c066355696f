"""lm-evaluation-harness on a checkpoint: `launch eval CHECKPOINT harness.tasks=[...]`.

After the launcher's own validation pass (the workers' eval.json), the launcher exports the evaluated checkpoint (its
EMA weights with ema=true) to `<run dir>/transformers/` as `launch convert` writes a folder (the built-in GPT as
GPT-2, with the run's tokenizer), runs lm-eval 0.4 on it in the launcher's process (`evaluate`: lm-eval's `hf` model,
transformers' own code, the folder read as any model's), prints lm-eval's table and adds its figures to eval.json
under `harness` (`launcher.parent.harness`).

Checked before any worker starts, one line each: lm-eval is installed, the model makes a transformers folder and the
run's data a tokenizer, each task is found (a name among lm-eval's tasks and harness.include_path's, or a task YAML
that exists). lm-eval's own index of its ~15,000 built-in task files is read only where a name is not found locally:
it takes tens of seconds. A task YAML is code as a config is: lm-eval imports the functions it names (`!function`).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from launcher.base.errors import ConfigError

INSTALL = "pip install 'launch[harness]'"


def requested(cfg: Any) -> list[str]:
    harness = cfg.get("harness")
    return [str(t) for t in harness.tasks] if harness is not None and harness.tasks else []


def check_harness(frozen: Any, model: Any) -> None:
    """One line (ConfigError) for the first bad value of the `harness` node, before any worker starts."""
    tasks = requested(frozen)
    if not tasks:
        return
    if not frozen.trainer.eval_only:
        raise ConfigError(
            f"harness.tasks={tasks[0]} is run by `launch eval CHECKPOINT harness.tasks=[...]` on a checkpoint, not "
            "by a training run: leave it out here"
        )
    if str(frozen.nodes) != "1":
        raise ConfigError(
            f"harness.tasks runs lm-eval in the launcher of one node, and nodes={frozen.nodes}: evaluate on one node"
        )
    try:
        version()
    except ImportError:
        raise ConfigError(
            f"harness.tasks needs lm-evaluation-harness (lm-eval 0.4), not installed: {INSTALL}"
        ) from None
    _check_exportable(model)
    include = _include(frozen.harness.include_path)
    from omegaconf import OmegaConf

    from launcher.export.transformers_folder import run_tokenizer

    tokenizer, said = run_tokenizer({"data": OmegaConf.to_container(frozen.data)})
    if tokenizer is None:
        raise ConfigError(f"harness.tasks: lm-eval reads text through the run's tokenizer, and there is {said}")
    manager = task_manager(include, tuple(tasks))
    for name in tasks:
        if name.endswith((".yaml", ".yml")):
            if not Path(name).expanduser().is_file():
                raise ConfigError(f"harness.tasks: {name} is no file; name a task YAML that exists, or a task by name")
        elif name not in manager.all_tasks:
            import difflib

            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            where = f" nor of harness.include_path={include}" if include else ""
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ConfigError(
                f"harness.tasks: {name} is no task of lm-eval {version()}{where}{hint}; name one `lm-eval ls tasks` "
                "lists, or give a task YAML's path"
            )


def _check_exportable(model: Any) -> None:
    from launcher.models.gpt import GPT

    if isinstance(model, GPT):
        from launcher.export.transformers_folder import Unmapped, gpt2_config

        try:
            gpt2_config(model)
        except Unmapped as e:
            raise ConfigError(
                f"harness.tasks: lm-eval reads a transformers folder, and this model makes none: {e}"
            ) from e
    elif hasattr(model, "peft_config") or not (hasattr(model, "save_pretrained") and hasattr(model, "config")):
        kind = "a PEFT model" if hasattr(model, "peft_config") else "neither the built-in GPT nor a transformers model"
        raise ConfigError(
            f"harness.tasks: lm-eval reads a transformers folder, and {type(model).__qualname__} is {kind}; "
            "evaluate a folder of its own with lm-eval's command line"
        )


def _include(path: Any) -> str | None:
    if path is None:
        return None
    where = Path(str(path)).expanduser()
    if not where.is_dir():
        raise ConfigError(f"harness.include_path={path} is no folder; give the folder of your task YAMLs")
    return str(where.resolve())


def version() -> str:
    """lm-eval's version; ImportError where it is not installed."""
    import importlib.metadata

    import lm_eval  # noqa: F401  (installed, not a leftover distribution record)

    return importlib.metadata.version("lm-eval")


@functools.cache
def task_manager(include: str | None, tasks: tuple[str, ...]) -> Any:
    """lm-eval's TaskManager: harness.include_path's tasks alone where every name is found there (or is a YAML
    path), else lm-eval's own tasks too (an index of ~15,000 files: tens of seconds). Made once per command."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=include, include_defaults=False) if include else None
    found = set(local.all_tasks) if local else set()
    if all(t.endswith((".yaml", ".yml")) or t in found for t in tasks):
        return local or TaskManager(include_defaults=False)
    return TaskManager(include_path=include)


def evaluate(folder: Path, tasks: list[str], harness: Any, device: str) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` on the folder (its `hf` model, float32 as the folder says), all of this machine's
    threads (the workers are gone)."""
    import lm_eval
    import torch

    from launcher.base.machine import usable_cpus

    torch.set_num_threads(usable_cpus())  # the launcher kept one before forking its workers
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its progress at INFO, a line per step: the table says
    manager = task_manager(_include(harness.include_path), tuple(tasks))
    return lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder)},
        tasks=[str(Path(t).expanduser().resolve()) if t.endswith((".yaml", ".yml")) else t for t in tasks],
        task_manager=manager,
        num_fewshot=harness.num_fewshot,
        limit=harness.limit,
        batch_size=int(harness.batch_size),
        device=device,
        log_samples=False,
    )


def figures(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each task's figures from lm-eval's results: {task: {"acc": ..., "acc_stderr": ...}} (lm-eval's "acc,none"
    named by the metric alone where its filter is lm-eval's default, "none")."""
    out: dict[str, dict[str, float]] = {}
    for task, metrics in results["results"].items():
        out[task] = {
            key.removesuffix(",none"): float(value)
            for key, value in metrics.items()
            if "," in key and isinstance(value, (int, float))
        }
    return out
