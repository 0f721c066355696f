"""FSDP2's strategy as its config asks for it: the `_target_` of strategy=fsdp, hsdp and fsdp_tp."""

from __future__ import annotations

from typing import Any

from strategies.fsdp import FSDP


def fsdp(**options: Any) -> FSDP:
    """FSDP2 over the data-parallel (and tensor-parallel) ranks; with pipeline stages (`strategy.pp_size` > 1) the
    pipeline's form of it (`strategies.pipeline`), each stage sharded the same way."""
    if int(options.get("pp_size") or 1) > 1:
        from strategies.pipeline import PipelineFSDP

        return PipelineFSDP(**options)
    return FSDP(**options)
