"""The collectives an optimizer adds to its strategy's (`Strategy.collectives` declares the gradients' and the
parameters'): optim=muon updates each hidden matrix whole, so where the parameters are sharded per parameter
(FSDP/HSDP's DTensors) every rank gathers each one's update once per optimizer step, in the parameters' fp32, over
its shard group (`launcher.optim.muon`). The strategy's communication counter records the same gathers. A strategy
whose partitions are flat (`Layout.flat`, ZeRO) refuses such an optimizer: it adds none there."""

from __future__ import annotations

from strategies.declarations import Collective, Layout


def optimizer_collectives(gathered: float, layout: Layout) -> list[Collective]:
    """The all-gather of the `gathered` elements an optimizer updates whole (`ModelSize.gathered`), where `layout`
    shards the parameters per parameter; none where each rank holds them whole, or where the strategy's partitions
    are flat (ZeRO, which refuses such an optimizer)."""
    if not gathered or not layout.params.sharded or layout.flat:
        return []
    return [Collective("all_gather", "shard", gathered, "fp32", times=1, sync=False)]
