"""Entry point of one rank, started by the elastic agent: forked from the launcher on CPU (`forked`), else
`python -m launcher.worker.main <resolved.yaml>`.

A worker reads the frozen config the launcher wrote; it never re-runs Hydra. Its first instructions, before any
heavy import, tie it to its launcher (`die_with_parent`) and take over the stop signals.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

from launcher.base.process import exit_now, run_exit_handlers
from launcher.worker.lifecycle import (
    EXIT_STOPPED,
    Phase,
    StopRequest,
    after_fork,
    die_with_parent,
    joined,
    name_process,
    report_failure,
    watch_parent,
)


def run_rank(path: str, stop: StopRequest, phase: Phase) -> int:
    """Train; the exit code: 0 finished, EXIT_STOPPED saved and stopped early on a signal."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from omegaconf import DictConfig, OmegaConf

    from launcher.config.context import make_strategy, run_context
    from launcher.recovery.adapt import agreed_micro, say_batch
    from launcher.worker.runner import train

    cfg = OmegaConf.load(path)
    assert isinstance(cfg, DictConfig)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size, derived = int(os.environ["WORLD_SIZE"]), cfg.derived
    if world_size not in range(derived.min_nodes * derived.gpus, derived.world_size + 1, derived.gpus):
        raise RuntimeError(f"the agent started {world_size} workers but the launcher planned {derived.world_size}")
    ctx = run_context(cfg, rank, local_rank, world_size)
    if ctx.device_type == "cuda":
        torch.cuda.set_device(ctx.device)
        # fp32 matmuls (and fp32 parts of mixed precision) on tensor cores in TF32: ~8x faster on A100/H100, with a
        # 10-bit mantissa that training tolerates (PyTorch's own recommendation for training).
        torch.set_float32_matmul_precision("high")
    phase("joining the process group")
    from launcher.recovery.in_place import GlooSockets

    inherited = GlooSockets.now()  # a forked worker's launcher's sockets: never recovery in place's to shut
    dist.init_process_group(
        backend="nccl" if ctx.device_type == "cuda" else "gloo",
        timeout=timedelta(seconds=cfg.trainer.collective_timeout),
    )
    joined(Path(path).parent, rank)
    micro = agreed_micro(cfg, rank, Path(path).parent, ctx.device)  # batch.micro_size=auto: after an out-of-memory
    ctx = run_context(cfg, rank, local_rank, world_size, micro)
    if rank == 0:
        say_batch(cfg, micro, world_size, Path(path).parent)
    strategy = make_strategy(cfg.strategy)
    # What is alive now (torch and every module imported, the launcher's own objects when forked from it) lives as
    # long as the process: out of the cycle collector's reach, a full collection (DeepSpeed's at each release of
    # ZeRO-3's gathered parameters, Python's own now and then) scans only what the run makes, not 0.3 s of imports.
    gc.freeze()
    try:
        finished = train(cfg, ctx, strategy, Path(path).parent, stop, phase, inherited)
    finally:
        # Release everything that holds the process group before destroying it: a gloo thread
        # that frees a tensor during interpreter shutdown aborts the process otherwise.
        strategy.teardown()
        del strategy
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    return 0 if finished else EXIT_STOPPED  # saved and stopped early: not a finished run


def start(path: str) -> int:
    """One rank from its first instruction: tied to its launcher, named, the stop and dump signals taken over; then
    `main`. A failure is reported (`report_failure`) and ends the process."""
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    name_process(rank)
    # What this rank is doing, in memory from the start; written when asked (SIGUSR1, a stop signal) or now and then.
    doing = Phase(Path(path).parent, rank)
    doing.answer_dump_signal()
    requested = StopRequest(on_signal=doing.try_flush).install()
    watch_parent()
    try:
        return run_rank(path, requested, doing)
    except Exception as error:  # one line for the launcher, the traceback in this rank's log file
        report_failure(error, int(os.environ.get("RANK", rank)), Path(path).parent)  # renumbered in place


def forked(path: str) -> None:
    """The entry point of a worker that the agent forks from the launcher (CPU runs, `launcher.parent.launch`): the
    launcher's torch, its imports and its built modules come for free, the launcher's process state does not."""
    after_fork()
    code = start(path)
    if code:
        exit_now(code)
    # A return, not an exit: the agent's multiprocessing context counts a worker done once it returned.
    run_exit_handlers()


if __name__ == "__main__":
    exit_now(start(sys.argv[1]))
