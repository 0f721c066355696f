"""Strategies wrap a model and its optimizer for one parallel layout.

A strategy knows nothing of Hydra, logging or the command line: it receives plain values (a `RunContext`, a
model factory, an optimizer factory) and, for its checks in the launcher, the model built on the meta device.
Every strategy implements the `Strategy` protocol in `strategies.base`; none inherits from another. Nothing
here imports `launcher`: the planner imports the ring formula from `strategies.comm`.

- `ddp`: native DistributedDataParallel;
- `fsdp`: native FSDP2 (`fully_shard`);
- `deepspeed/`: DeepSpeed ZeRO stages and offload, one strategy with presets.
"""

from strategies.base import RunContext, Strategy
from strategies.declarations import Layout, Placement, Transients

__all__ = ["Layout", "Placement", "RunContext", "Strategy", "Transients"]
