"""Recovery in place (trainer.recovery=in_place): when a peer is lost, the surviving workers keep their processes, their
data source and their imports, re-form the job's process group at the new world size, and go on from the last step
complete, as a restarted group would but without a restart.

On a collective that failed (a peer gone: gloo's "Connection closed by peer", a collective that timed out) each
survivor:
1. breaks its collectives: gloo in torch 2.13 has no abort (`ProcessGroupGloo.abort` returns at once and closes
   nothing), so a survivor waiting on another survivor that has already moved on would wait out the whole
   `trainer.collective_timeout`. Each survivor shuts its gloo connections down (`GlooSockets.shut`): every peer's
   pending receive from it fails at once;
2. writes what the restart would read (`MemoryTier.on_failure`: under ddp the state it holds, as the step it last
   completed);
3. takes part in the membership: in the job's c10d store (the rendezvous store every node already reaches), under a
   key of this attempt and generation, it names itself; the first survivor to arrive closes the membership once
   every old rank came or none came for `SETTLE_S` seconds;
4. the worker releases the old group (the runner) and `join`s the new one: ranks renumbered in their old order, on a
   prefix of the same store;
5. the runner builds what depends on the group (the strategy, the memory tier, the saver, the data feed at the new
   accumulation) and resumes as a restart does (`launcher.checkpoint.resume`): the memory tier's newest complete step,
   else the disk's. Step s's global batch is the same at any world size (the batch contract), so the survivors train
   the whole of it, the lost ranks' share included.

A survivor that cannot go on in place (the membership closed without it, too few ranks left for `nodes=min:max`, rank
0 lost: its loggers and the search's trial are its own) raises the failure as before: torch's elastic restart is the
fallback, said in one line. Recovery in place runs on CPU (gloo); on CUDA the restart remains (NCCL's communicator
abort is not tried on a GPU here).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from launcher.base.collectives import failed_collective
from launcher.config import ConfigError

SETTLE_S = 1.0
"""Seconds the membership stays open after the last survivor arrived, where fewer than all old ranks came: a survivor
computing when its peer died comes to its next collective, which fails at once (the peers shut their connections),
well within it."""
PREFIX = "launch/in-place"


def _tcp_table() -> list[tuple[int, int, int, str]]:
    """This process's network namespace's TCP sockets: (inode, local port, remote port, state in hex)."""
    rows = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            local, remote = f[1].rsplit(":", 1)[1], f[2].rsplit(":", 1)[1]
            rows.append((int(f[9]), int(local, 16), int(remote, 16), f[3]))
    return rows


def _held() -> dict[int, int]:
    """This process's open sockets: {inode: file descriptor}."""
    held = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            held[int(target[8:-1])] = int(fd)
    return held


class GlooSockets:
    """The connections of this worker's gloo groups, told apart from every other socket it holds (the c10d store's,
    a logger's, the listeners a worker forked from its launcher inherits) by their ports: each rank's gloo listeners
    (the listening sockets it opened since `before`), published in the store for every rank to read."""

    def __init__(self, before: set[int]) -> None:
        self.before = before
        """The inodes this process held before its first group (inherited ones: never touched)."""

    @staticmethod
    def now() -> set[int]:
        return set(_held())

    def listeners(self) -> list[int]:
        """The ports of the listening sockets this process opened since `before`: its gloo groups'."""
        held = _held()
        mine = {lp for inode, lp, _, state in _tcp_table() if state == "0A" and inode in held}
        return sorted(mine - {lp for inode, lp, _, state in _tcp_table() if inode in self.before})

    def shut(self, ports: set[int]) -> int:
        """Shut down this process's connections to or from any of the job's gloo listener `ports` (not the listeners
        themselves: gloo aborts the process when its listener fails); how many."""
        held, shut = _held(), 0
        for inode, local, remote, state in _tcp_table():
            if state == "0A" or inode not in held or inode in self.before:
                continue
            if local not in ports and remote not in ports:
                continue
            try:
                s = socket.socket(fileno=os.dup(held[inode]))
            except OSError:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:
                pass
            finally:
                s.close()  # the duplicate only: gloo's own descriptor stays open, its reads fail
        return shut


class InPlace:
    """This worker's side of recovery in place: its gloo ports published, and on a failure the membership."""

    def __init__(self, rank: int, world: int, timeout: float, sockets: GlooSockets, lowest: int) -> None:
        self.rank, self.world, self.timeout, self.sockets = rank, world, timeout, sockets
        self.lowest = lowest
        """The fewest ranks the job may go on with (nodes=min:max)."""
        self.attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.originals = list(range(world))
        """Each rank of the group now, by the rank it had when the elastic agent started this attempt (the rank its
        agent knows it by)."""
        self.lost: list[int] = []
        """The ranks lost in this attempt so far, by their rank at its start."""
        self.generation = 0
        before = GlooSockets.now()
        self.store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        sockets.before |= GlooSockets.now() - before  # its own connection to the store: kept
        self.publish()

    @classmethod
    def of(cls, cfg: Any, ctx: Any, before: set[int] | None) -> InPlace | None:
        """Where trainer.recovery=in_place on CPU, under an elastic agent (its store), with more than one rank."""
        if str(cfg.trainer.get("recovery", "restart")) != "in_place" or before is None:
            return None
        if ctx.device_type != "cpu" or ctx.world_size < 2 or "MASTER_PORT" not in os.environ:
            return None
        lowest = int(cfg.derived.min_nodes) * int(cfg.derived.gpus)
        return cls(ctx.rank, ctx.world_size, float(cfg.trainer.collective_timeout), GlooSockets(before), lowest)

    def key(self, name: str) -> str:
        return f"{PREFIX}/{self.attempt}/{self.generation}/{name}"

    def publish(self) -> None:
        """This rank's gloo listener ports, for the others to know its connections by (after every group exists)."""
        self.store.set(self.key(f"ports{self.rank}"), json.dumps(self.sockets.listeners()))

    def regroup(self, error: BaseException, write_state: Any) -> tuple[int, int, list[int]] | None:
        """After `error`: (this rank's new rank, the new world size, the ranks lost, by their rank at the attempt's
        start), or None where this worker
        cannot go on in place (the failure is raised, torch's restart takes over; said in one line)."""
        if not failed_collective(error):
            return None
        self.shut()
        write_state()  # before arriving: whoever closes the membership may resume from it at once
        members = self.members()
        lost = [r for r in range(self.world) if r not in members]
        why = None
        if self.rank not in members:
            why = f"rank {self.rank} came after the job re-formed without it"
        elif 0 not in members:
            why = "rank 0 was lost (its loggers and a search's trial are its own)"
        elif len(members) < self.lowest:
            why = f"{len(members)} rank(s) are left, fewer than the {self.lowest} the job may run with"
        elif not lost:
            why = "no rank was lost (a collective failed on every rank)"
        if why is not None:
            if self.rank == min(members, default=self.rank):
                print(f"launch: recovery in place: {why}; the elastic agent restarts the worker group", flush=True)
            return None
        gone = [self.originals[r] for r in lost]
        self.originals = [self.originals[r] for r in members]
        self.lost += gone
        return members.index(self.rank), len(members), gone

    def shut(self) -> None:
        """Every connection of this worker's gloo groups shut down: the peers waiting on it fail at once."""
        ports: set[int] = set()
        for r in range(self.world):
            key = self.key(f"ports{r}")
            if self.store.check([key]):  # every rank published its own after its groups were made
                ports |= {int(p) for p in json.loads(self.store.get(key))}
        self.sockets.shut(ports)

    def members(self) -> list[int]:
        """The old ranks that came, agreed in the store: each names itself, then counts in; the first to count in
        closes the membership once all came or none came for `SETTLE_S`."""
        self.store.set(self.key(f"came{self.rank}"), socket.gethostname())
        if self.store.add(self.key("arrived"), 1) == 1:
            seen, since = 1, time.monotonic()
            while (n := self.store.add(self.key("arrived"), 0)) < self.world:
                if n != seen:
                    seen, since = n, time.monotonic()
                elif time.monotonic() - since > SETTLE_S:
                    break
                time.sleep(0.02)
            came = [r for r in range(self.world) if self.store.check([self.key(f"came{r}")])]
            self.store.set(self.key("members"), json.dumps(came))
        self.store.wait([self.key("members")], datetime.timedelta(seconds=self.timeout))
        return [int(r) for r in json.loads(self.store.get(self.key("members")))]

    def join(self, rank: int, world: int, backend: str) -> None:
        """The new default group, on this generation's prefix of the store; this rank's ports published again."""
        name = self.key("group")
        self.generation += 1
        self.rank, self.world = rank, world
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(name, self.store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=self.timeout),
        )


def check_in_place(cfg: DictConfig, derived: Any, set_up_again: bool) -> None:
    """Before start: trainer.recovery=in_place where it can run, else one line naming what and the fix."""
    if str(cfg.trainer.get("recovery", "restart")) != "in_place":
        return
    fix = "set trainer.recovery=restart"
    device, world_size = str(derived.device), int(derived.world_size)
    if device != "cpu":
        raise ConfigError(
            f"trainer.recovery=in_place re-forms gloo process groups (CPU); this job runs on {device}, where NCCL's "
            f"abort is not tried here: {fix}"
        )
    if world_size < 2:
        raise ConfigError(f"trainer.recovery=in_place needs more than one rank; this job has {world_size}: {fix}")
    if int(OmegaConf.select(cfg, "strategy.pp_size", default=1) or 1) > 1:
        raise ConfigError(
            "trainer.recovery=in_place with strategy.pp_size > 1: a lost stage's layers are no survivor's; " + fix
        )
    if not set_up_again:
        name = OmegaConf.select(cfg, "strategy._target_", default="the strategy")
        raise ConfigError(
            f"trainer.recovery=in_place: {name} cannot be set up again in the same process on a new process group "
            f"(DeepSpeed's engine keeps the groups it was made with); {fix}, or use ddp, fsdp or hsdp"
        )
    if int(derived.nodes) == 1:
        raise ConfigError(
            "trainer.recovery=in_place goes on with the nodes left, but this job has one node (its launcher restarts "
            f"a lost rank's group itself): run it on several nodes, nodes=MIN:MAX, or {fix}"
        )
    if int(derived.min_nodes) == int(derived.nodes):
        raise ConfigError(
            f"trainer.recovery=in_place goes on with the nodes left, but nodes={derived.nodes} is fixed: make the job "
            f"elastic (nodes=MIN:{derived.nodes} with MIN < {derived.nodes}, trainer.max_restarts=N), or {fix}"
        )
