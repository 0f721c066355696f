"""The strategy protocol and the free helpers that strategies share; what a strategy declares of itself (its layout,
collectives, requirements and conformance) is in `strategies.declarations`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from strategies.comm import CommCounter
from strategies.declarations import Collective, Conformance, Layout, Requirements
from strategies.ema import EMA, EMASettings

ModelFactory = Callable[..., nn.Module]
"""`build_model()` builds the model for real; `build_model(meta=True)` on the meta device (no memory, no values)."""
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""`build_optimizer(module)`: the optimizer over the module's trainable parameters, in param groups decided by each
parameter's name (as in checkpoints: the unwrapped module's) and the types of the modules holding it."""
LR_SCALE = "lr_scale"
"""A param group's factor of the schedule's learning rate (1 where a group has none)."""


@dataclass(frozen=True)
class RunContext:
    """What a strategy may know about the run: plain values, no config objects."""

    device: str
    """torch device of this rank: "cpu" or "cuda:<local rank>"."""
    rank: int
    local_rank: int
    world_size: int
    precision: str
    """fp32 | bf16 | fp16"""
    grad_clip: float
    """Global gradient-norm limit; 0 disables clipping."""
    accumulation: int
    """Micro-steps per optimizer step."""
    micro_size: int
    """Samples per rank per forward pass."""
    compile: bool = False
    """trainer.compile: compile each unit (transformer block); a strategy that cannot rejects it in check."""
    local_world_size: int | None = None
    """Ranks per node (the launcher's `gpus`); None: every rank is on one node."""
    no_grad: tuple[str, ...] = ()
    """Trainable parameters that got no gradient in the launcher's forward and backward of a first micro-batch (on the
    meta device), by name; none of a mixture-of-experts block's (`strategies.no_grad`)."""
    ema: EMASettings | None = None
    """trainer.ema: keep the EMA weights (`strategies.ema`), held as the parameters are; None: none."""
    tensor_size: int = 1
    """Consecutive ranks that see the same micro-batches (a tensor-parallel group, `Mesh.tensor_size`)."""
    seq_len: int | None = None
    """Tokens per row the data gives (data.seq_len); None where the data does not say."""

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks: which slice of each global batch it reads."""
        return self.rank // self.tensor_size

    @property
    def data_world(self) -> int:
        """The data-parallel ranks: the world size / tensor_size."""
        return self.world_size // self.tensor_size

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type


@runtime_checkable
class Strategy(Protocol):
    """How the common runner drives any data-parallel layout.

    Order of calls: check (in the launcher, before workers start) -> setup -> for each optimizer
    step: K x [sync(k == K-1) around forward and backward], then step -> teardown.
    """

    def layout(self) -> Layout:
        """Which model state this strategy shards or offloads."""

    def collectives(
        self, params: float, precision: str, accumulation: int, world_size: int, gpus: int | None
    ) -> list[Collective]:
        """The collectives of one optimizer step over a model of `params` parameters, at `accumulation` micro-steps
        on `world_size` ranks of `gpus` per node: what the planner sums, what the strategy's counter must see. Under
        tensor parallel (`Mesh.tensor_size` T > 1) `params` is what one rank of a group holds: 1/T of what the plan
        splits and the rest whole."""

    def requirements(self) -> Requirements:
        """What this strategy, as configured, needs of the machine."""

    def conformance(self) -> Conformance:
        """What the conformance suite expects of it."""

    def check(self, ctx: RunContext, model: nn.Module) -> str | None:
        """Raise ValueError (one line: the bad value and the fix) for settings this strategy cannot run.

        Called in the launcher, before any worker starts, with the model built on the meta device (no memory). Returns
        what the run will do about the parameters `ctx.no_grad` names (a clause of the launcher's line naming them),
        or None."""

    def setup(self, ctx: RunContext, build_model: ModelFactory, build_optimizer: OptimizerFactory) -> None:
        """Build the model (where the layout needs it), wrap it, and create the optimizer over the wrapped
        parameters."""

    def forward(self, batch: Any) -> Any:
        """Run the model on one micro-batch under the strategy's precision; return its output as it is (the
        runner takes the loss from it: a scalar, a ModelOutput's `.loss`, a dict's "loss")."""

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        """Context around one micro-step's forward and backward; enabled=False skips gradient synchronisation."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate gradients of `loss` (already divided by the accumulation steps)."""

    def step(self, lr: float) -> float:
        """Clip, apply the optimizer at learning rate `lr`, zero the gradients; return the pre-clip global grad norm.

        A step whose global norm is NaN or Inf is not committed: the gradients are zeroed and no parameter and no
        optimizer state changes, on any rank (under fp16 the loss scaler skips it and lowers its scale). The runner
        makes a non-finite loss on any rank show in that norm, and decides what it means for the run."""

    def train(self, mode: bool) -> None:
        """Switch the wrapped model between training and evaluation."""

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for a checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    def metrics(self) -> dict[str, float]:
        """Per-rank figures of the last optimizer step, for the logs. Every strategy reports:
        `model_state_bytes`: parameters + gradients + optimizer state this rank holds on its device;
        `comm_calls`, `comm_bytes`: gradient-synchronisation collectives issued, and their payload."""

    def averaged(self) -> AbstractContextManager[bool]:
        """Context in which the model holds its EMA weights (True), where the run keeps them (RunContext.ema); False
        and nothing changes where it does not. The model's own weights are back after it."""

    def teardown(self) -> None:
        """Release the model and optimizer so the process group can be destroyed cleanly."""


def call_model(model: nn.Module, batch: Any) -> Any:
    """The model contract: a tuple/list batch is passed as positional arguments, a dict (any mapping: a transformers
    BatchEncoding) as keywords, anything else (a tensor, a PyG `Batch`) as the one argument."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def unit_classes(model: nn.Module, explicit: list[str] | None) -> list[str]:
    """Class names of a model's layer-sized units (what FSDP shards one by one, what compile compiles): the explicit
    list when given; else the model's own `_no_split_modules` that occur in it (transformers models declare them, as
    Accelerate reads them; so does the built-in GPT), less those whose units would split a tied parameter
    (`untied_units`); else none: the whole model is one unit."""
    if explicit is not None:
        return list(explicit)
    return untied_units(model, _declared_units(model))[0]


def _declared_units(model: nn.Module) -> list[str]:
    present = {type(m).__name__ for m in model.modules()}
    return sorted(name for name in getattr(model, "_no_split_modules", None) or () if name in present)


def unit_modules(model: nn.Module, class_names: list[str]) -> list[nn.Module]:
    """Submodules (not the root) whose class name is listed, in pre-order (parents before children)."""
    return [m for m in model.modules() if m is not model and type(m).__name__ in class_names]


@dataclass(frozen=True)
class SplitTie:
    """One parameter reachable under several names (tied weights) whose names fall in different units."""

    names: tuple[str, ...]
    units: tuple[str, ...]
    """Per name, the class of the innermost unit holding it; "" for the root."""

    def describe(self) -> str:
        where = [f"{name} (in {unit or 'the root'})" for name, unit in zip(self.names, self.units)]
        return " = ".join(where)


def split_ties(model: nn.Module, class_names: list[str]) -> list[SplitTie]:
    """Tied parameters (the same Parameter under two module paths) that units of these classes would hold apart:
    FSDP gathers and shards a parameter with the one unit that claims it, so its other users, in another unit or
    the root, would meet it sharded."""
    units = {
        path: type(m).__name__
        for path, m in model.named_modules(remove_duplicate=False)
        if path and type(m).__name__ in class_names
    }
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    found = []
    for tied in (n for n in names.values() if len(n) > 1):
        holders = [max((u for u in units if name.startswith(u + ".")), key=len, default="") for name in tied]
        if len(set(holders)) > 1:
            found.append(SplitTie(tuple(tied), tuple(units.get(h, "") for h in holders)))
    return found


def untied_units(model: nn.Module, classes: list[str]) -> tuple[list[str], list[tuple[str, SplitTie]]]:
    """The unit classes less those whose units would split a tied parameter, and each class left out with its tie.

    A class whose units hold a parameter that is also reachable outside them (BERT's word embedding, tied to its
    decoder in the root; one weight shared by two blocks) is left out, and its modules go with the unit around
    them (at last the root); until no tie is split."""
    left_out: list[tuple[str, SplitTie]] = []
    while ties := split_ties(model, classes):
        for cls in sorted({unit for tie in ties for unit in tie.units if unit}):
            left_out.append((cls, next(t for t in ties if cls in t.units)))
        classes = [c for c in classes if c not in {cls for cls, _ in left_out}]
    return classes, left_out


def tied_unit_lines(model: nn.Module, explicit: list[str] | None) -> list[str]:
    """For a sharding strategy's check: one line for each of the model's own unit classes that `unit_classes` leaves
    out for a tie; explicit classes (`strategy.shard_units`) that split a tie are a ValueError naming the tied
    names and the classes that would do."""
    if explicit is None:
        return [
            f"{cls} is not a unit, though {type(model).__name__}._no_split_modules lists it: its parameter is tied, "
            f"{tie.describe()}, and a unit must hold every use of its parameters; its modules go with the unit "
            "around them"
            for cls, tie in untied_units(model, _declared_units(model))[1]
        ]
    kept, left_out = untied_units(model, list(explicit))
    if left_out:
        ties = "; ".join(t.describe() for t in split_ties(model, list(explicit)))
        raise ValueError(
            f"strategy.shard_units=[{','.join(explicit)}] splits tied parameters between units: {ties}; use "
            f"strategy.shard_units=[{','.join(kept)}] (units that keep each tied parameter together)"
        )
    return []


def compile_units(units: list[nn.Module]) -> None:
    """torch.compile each unit in place (`nn.Module.compile`): its class, names and state-dict keys stay the same.

    Per unit rather than the whole model: the graphs stay small and alike (one compile serves every block),
    and a sharding strategy can still put its hooks around each unit.
    """
    for unit in units:
        unit.compile()


def autocast_dtype(precision: str) -> torch.dtype | None:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def local_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor this rank holds: a DTensor's local shard only."""
    if hasattr(t, "to_local"):  # DTensor: count only this rank's shard
        t = t.to_local()
    return t.numel() * t.element_size()


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples (a state dict)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def model_state_bytes(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    which: Callable[[torch.Tensor], bool] | None = None,
) -> int:
    """Bytes of parameters, gradients and optimizer state that this rank holds (local shards only): of every
    parameter, or of those `which` selects (with their gradients and their optimizer state)."""
    total = 0
    for p in params:
        if which is not None and not which(p):
            continue
        total += local_bytes(p)
        if p.grad is not None:
            total += local_bytes(p.grad)
        total += sum(local_bytes(t) for t in tensors(optimizer.state.get(p, {})) if t.dim() > 0)
    return total


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's learning rate, times each group's `LR_SCALE`."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get(LR_SCALE, 1.0)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    grad_clip: float,
    lr: float,
    offloaded_to_host: Callable[[torch.Tensor], bool] | None = None,
    ema: EMA | None = None,
) -> tuple[float, int, int]:
    """The optimizer step of the torch strategies (DDP, FSDP): set the learning rate, unscale, clip to the global
    norm, step, update the loss scaler, zero the gradients. A non-finite global norm is not committed: the optimizer
    does not step (under fp16 the scaler skips it itself, and lowers its scale).

    Returns the pre-clip global gradient norm, the model-state bytes this rank held at the step (measured before the
    gradients are released: the step's peak), and of those the bytes of the parameters `offloaded_to_host` selects.
    On DTensor gradients (FSDP) the norm is reduced over all shards, so it is the same global norm as DDP's.
    """
    set_lr(optimizer, lr)
    scaler.unscale_(optimizer)
    limit = grad_clip if grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    norm = float(norm)  # the same on every rank: they all commit the step, or none does
    if math.isfinite(norm) or scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    if ema is not None and math.isfinite(norm):  # the step was applied
        ema.update()
    held = model_state_bytes(model.parameters(), optimizer)
    offloaded = model_state_bytes(model.parameters(), optimizer, offloaded_to_host) if offloaded_to_host else 0
    optimizer.zero_grad(set_to_none=True)
    return norm, held, offloaded


def scaler_scale(scaler: Any) -> float | None:
    """The loss scale after the step's update, when the scaler runs (precision=fp16): halved on each overflow."""
    return float(scaler.get_scale()) if scaler.is_enabled() else None


def step_figures(
    counter: CommCounter, on_device: float, offloaded: float | None = None, loss_scale: float | None = None
) -> dict[str, float]:
    """What every strategy's `metrics()` reports of its last optimizer step, under the names `launcher.base.metrics`
    declares: the model state it holds on the device (and offloaded, where it offloads), the loss scale under
    precision=fp16, and its counter's collectives since the last step (read and reset)."""
    figures = {"model_state_bytes": float(on_device)}
    if offloaded is not None:
        figures["offloaded_state_bytes"] = float(offloaded)
    if loss_scale is not None:
        figures["loss_scale"] = loss_scale
    return figures | counter.take()


@contextmanager
def averaged(ema: EMA | None) -> Iterator[bool]:
    """A strategy's `averaged` over its EMA (or none)."""
    if ema is None:
        yield False
        return
    with ema.swapped():
        yield True


def ema_of(module: nn.Module, settings: EMASettings | None) -> EMA | None:
    """The EMA of a module's trainable parameters (by their checkpoint names), held as the parameters are."""
    if settings is None:
        return None
    return EMA({n: p for n, p in module.named_parameters() if p.requires_grad}, settings)


def torch_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, ema: EMA | None = None) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter names, whatever the wrapper (DDP, FSDP2): the checkpoint shape;
    with the EMA, its average under `ema` (the same names, held as the parameters are)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(model, optimizer)
    if fresh:
        # Before the first step torch makes the optimizer's state to describe it: a zero-gradient step at lr 0, which
        # counts as a step (AdamW's bias correction would then be one step ahead). Asked before training (the room a
        # checkpoint needs), the optimizer is left as fresh as it was; what was returned still describes the state.
        optimizer.state.clear()
    return {"model": model_state, "optim": optim_state} | ({"ema": ema.state()} if ema is not None else {})


def load_torch_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], ema: EMA | None = None
) -> None:
    """`state` is this strategy's template filled from a checkpoint (every model entry is there, or the load failed):
    not strict, so that a parameter the checkpoint has no optimizer state for (it never got a gradient) gets none.
    From a checkpoint without EMA weights (`launcher.checkpoint.loading` drops the entry) the average starts at the
    loaded weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    options = StateDictOptions(strict=False)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    if ema is not None:
        ema.load(state["ema"] if "ema" in state else {"weights": dict(ema.live), "steps": ema.steps})
