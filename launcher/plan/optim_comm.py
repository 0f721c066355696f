"""The collectives an optimizer adds to its strategy's (`Strategy.collectives` declares the gradients' and the
parameters'): optim=muon updates each hidden matrix whole, so where the parameters are sharded per parameter
(FSDP/HSDP's DTensors) every rank gathers each one's update once per optimizer step, in the parameters' fp32, over
its shard group (`launcher.worker.muon`). The strategy's communication counter records the same gathers."""

from __future__ import annotations

from strategies.declarations import Collective, Layout


def optimizer_collectives(gathered: float, layout: Layout) -> list[Collective]:
    """The all-gather of the `gathered` elements an optimizer updates whole (`ModelSize.gathered`), where `layout`
    shards the parameters; none where each rank holds them whole."""
    if not gathered or not layout.params.sharded:
        return []
    return [Collective("all_gather", "shard", gathered, "fp32", times=1, sync=False)]
