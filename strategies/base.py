"""The strategy protocol and the free helpers that strategies share; what a strategy declares of itself (its layout,
collectives, requirements and conformance) is in `strategies.declarations`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from strategies.declarations import Collective, Conformance, Layout, Requirements
from strategies.ema import EMASettings

ModelFactory = Callable[..., nn.Module]
"""`build_model()` builds the model for real; `build_model(meta=True)` on the meta device (no memory, no values)."""
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
"""`build_optimizer(module)`: the optimizer over the module's trainable parameters, in param groups decided by each
parameter's name (as in checkpoints: the unwrapped module's) and the types of the modules holding it."""


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
    """Ranks that see the same micro-batches: a tensor-parallel group's T consecutive ranks (`Mesh.tensor_size`), in
    each of the `pipeline_size` stages of a pipeline."""
    seq_len: int | None = None
    """Tokens per row the data gives (data.seq_len); None where the data does not say."""
    pipeline_size: int = 1
    """Pipeline stages P (strategy.pp_size): the mesh's outermost dimension (torchtitan's order, pp x data parallel x
    tp), so that a stage's data-parallel ranks are world / P consecutive ranks and a pipeline crosses them."""

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel ranks: which slice of each global batch it reads."""
        return self.rank // (self.tensor_size // self.pipeline_size) % self.data_world

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
        self, params: float, precision: str, accumulation: int, world_size: int, gpus: int | None, reused: float = 0
    ) -> list[Collective]:
        """The collectives of one optimizer step over a model of `params` parameters, at `accumulation` micro-steps
        on `world_size` ranks of `gpus` per node: what the planner sums, what the strategy's counter must see. Under
        tensor parallel (`Mesh.tensor_size` T > 1) `params` is what one rank of a group holds: 1/T of what the plan
        splits and the rest whole. `reused`: the elements of parameters that several modules hold, once per extra
        holder (`ModelSize.reused`), for a strategy that gathers each module's own parameters."""

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
