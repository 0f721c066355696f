"""DeepSpeed ZeRO-1/2/3, ZeRO-Offload and ZeRO-Infinity: one strategy, presets in conf/strategy/.

- `config`: the DeepSpeed config generated from the run's values (no deepspeed import);
- `zero`: every call into DeepSpeed's private ZeRO internals (state export/import, bytes held, reductions);
- `strategy`: the `DeepSpeed` strategy itself (`_target_: strategies.deepspeed.DeepSpeed`).

Importing this package does not import deepspeed: only a DeepSpeed run's `setup` does.
"""

from strategies.deepspeed.config import build_ds_config
from strategies.deepspeed.strategy import DeepSpeed

__all__ = ["DeepSpeed", "build_ds_config"]
