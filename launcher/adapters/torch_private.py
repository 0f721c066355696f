"""Every name of torch's that the launcher relies on beyond torch's public API, checked against torch 2.13.0.

- The elastic agent's hooks (`_monitor_workers`, `_stop_workers`, `_shutdown`, `_exit_barrier` and the store it
  keeps, `_store`): torch documents them for implementors
  of `SimpleElasticAgent`, and the launcher's agent (`launcher.elastic.agent.Agent`) overrides them; a release that
  renamed one would leave the override never called, and a failed group waiting torch's fixed 30 s, without a word.
- The dynamic rendezvous: the join step, wrapped to refuse a node that a full job would keep as a spare
  (`when_spare`), and the name it gives its events, read from the frame rather than from `inspect.stack()`
  (`cheap_event_names`). torch offers no setting for either.
- `UntypedStorage.resize_`, wrapped inside a measured block (`resizes_seen`): a resize in place runs no operator, so
  no dispatch mode sees it.

Each group of names is checked on first use (`strategies.checked.check`): one that is gone or takes other
parameters fails in one line naming it, torch's version and what to do. On a new torch release, run
`python -m pytest -q tests/test_adapters.py` first (docs/contributing.md).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from strategies.checked import LibraryChanged, Private, changed, check

CHECKED_AGAINST = "2.13.0"
ADAPTER = "launcher/adapters/torch_private.py"

AGENT = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"
LOCAL = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
HOOKS = (
    Private(f"{AGENT}._monitor_workers", ("self", "worker_group")),
    Private(f"{AGENT}._stop_workers", ("self", "worker_group")),
    Private(f"{AGENT}._shutdown", ("self", "death_sig", "timeout")),
    Private(f"{LOCAL}._monitor_workers", ("self", "worker_group")),  # the launcher's agent calls these two of
    Private(f"{LOCAL}._shutdown", ("self", "death_sig", "timeout")),  # torch's local agent, its base
)
"""The hooks torch's agent loop calls and an implementor of `SimpleElasticAgent` defines."""
EXIT_BARRIER = (Private(f"{AGENT}._exit_barrier", ("self",)),)
"""The agent's wait for every node at the end, which torch's loop calls and the launcher's agent overrides: after a
recovery in place only the surviving nodes come to it."""
RENDEZVOUS = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
RENDEZVOUS_NAMES = (
    Private(f"{RENDEZVOUS}:_RendezvousJoinOp.__call__", ("self", "ctx", "deadline")),
    Private(f"{RENDEZVOUS}:_RendezvousContext.__init__", ("self", "node", "state", "settings")),
    Private(f"{RENDEZVOUS}:_Action.ADD_TO_REDUNDANCY_LIST"),
    Private(f"{RENDEZVOUS}:get_method_name", ("depth",)),
)
STATE = ("participants", "last_heartbeats")
"""What the join's context holds of the rendezvous state (`_RendezvousState`), read to tell a spare node's wait."""


def check_torch(names: tuple[Private, ...], where: Any = None) -> None:
    """`strategies.checked.check` for torch's names: LibraryChanged in one line where one differs."""
    check("torch", CHECKED_AGAINST, names, ADAPTER, where)


@functools.cache
def check_elastic() -> None:
    """The agent's hooks are still the ones torch's loop calls, with the parameters the launcher's agent takes."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    check_torch(HOOKS + EXIT_BARRIER)
    declared = {name.path.rpartition(".")[2] for name in HOOKS if name.path.startswith(AGENT)}
    if missing := sorted(declared - SimpleElasticAgent.__abstractmethods__):
        raise _changed(f"{AGENT}.{missing[0]}", "is no longer a hook an agent defines")


@functools.cache
def check_rendezvous() -> None:
    """The join step and the state it reads are as `when_spare` and `cheap_event_names` expect."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    check_torch(RENDEZVOUS_NAMES)
    if missing := [name for name in STATE if name not in vars(dr._RendezvousState())]:
        raise _changed(f"{RENDEZVOUS}:_RendezvousState.{missing[0]}", "is gone")


def _changed(path: str, problem: str) -> LibraryChanged:
    """LibraryChanged for what `check` cannot see in a signature."""
    return changed("torch", CHECKED_AGAINST, path, problem, ADAPTER)


def cheap_event_names() -> None:
    """torch's dynamic rendezvous names each of its events by `inspect.stack()`, twice per event, before it checks
    whether anyone records events (nobody does, by default): every frame's source is read from disk, about half a
    second of a launch. The same name, the calling method's, read from the frame alone."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    check_rendezvous()
    dynamic_rendezvous.get_method_name = _method_name


def _method_name(depth: int = 2) -> str:
    try:
        return sys._getframe(depth).f_code.co_name  # as inspect.stack()[depth].function: counted from here
    except ValueError:
        return "no_method_name"


_on_spare: Callable[[str, int], None] | None = None
_torch_join: Any = None


def when_spare(refuse: Callable[[str, int], None]) -> None:
    """Call `refuse(run_id, max_nodes)` where torch's rendezvous would keep this node as a spare of a job that has all
    its nodes (it would wait, saying nothing, until one leaves) and every member kept its place alive within two
    keep-alive intervals; `refuse` raises to end the join. Where a member has gone quiet (a node that just failed,
    started again before torch dropped it), the node waits as torch has it, to take that place."""
    global _on_spare, _torch_join
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    check_rendezvous()
    _on_spare = refuse
    if dr._RendezvousJoinOp.__call__ is not _joining:
        _torch_join = dr._RendezvousJoinOp.__call__
        dr._RendezvousJoinOp.__call__ = _joining  # type: ignore[method-assign]


def _joining(op: Any, ctx: Any, deadline: float) -> Any:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    action = _torch_join(op, ctx, deadline)
    if action == dr._Action.ADD_TO_REDUNDANCY_LIST and _on_spare is not None and _members_alive(ctx):
        _on_spare(ctx.settings.run_id, ctx.settings.max_nodes)
    return action


def _members_alive(ctx: Any) -> bool:
    from datetime import datetime, timezone

    recent = datetime.now(timezone.utc) - 2 * ctx.settings.keep_alive_interval
    beats = ctx.state.last_heartbeats
    return all(node in beats and beats[node] > recent for node in ctx.state.participants)


@contextmanager
def resizes_seen(seen: Callable[[Any], None]) -> Iterator[None]:
    """Inside the block, `seen(storage)` after each `UntypedStorage.resize_` (which runs no operator: FSDP frees an
    unsharded parameter's memory so, and refills it). The method is UntypedStorage's inherited one; the block's
    own is removed at its end, which leaves the inherited one (checked: were torch to define it on UntypedStorage
    itself, the block would remove torch's)."""
    import torch

    if "resize_" in vars(torch.UntypedStorage) or not hasattr(torch.UntypedStorage, "resize_"):
        raise _changed("torch:UntypedStorage.resize_", "is no longer the method UntypedStorage inherits")
    real = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        out = real(storage, size)
        seen(storage)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        del torch.UntypedStorage.resize_  # the method it inherits, as before
