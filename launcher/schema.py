"""Typed schema under every YAML file in conf/.

Each dataclass is stored in Hydra's ConfigStore; the YAML files name their schema in their
`defaults` list, so an unknown key or a value of the wrong type fails at composition, with
the key named. Importing this module must stay cheap: no torch, deepspeed or wandb.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Schedule(Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


@dataclass
class BatchConfig:
    global_size: int = 32
    """Samples per optimizer step, over all ranks and micro-steps."""
    micro_size: int = 4
    """Samples per rank per forward pass."""


@dataclass
class TrainerConfig:
    max_steps: int = 300
    """Optimizer steps to run."""
    log_every: int = 10
    """Log metrics every N optimizer steps (the last step is always logged)."""
    eval_every: int = 100
    """Validation loss every N optimizer steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Global batches in one validation pass (the same samples whatever the world size)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    schedule: Schedule = Schedule.cosine
    """Learning-rate shape after warmup."""
    warmup_steps: int = 20
    """Linear warmup from 0 to optim.lr over this many steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of optim.lr (cosine and linear schedules)."""
    max_restarts: int = 0
    """Times the elastic agent restarts the worker group after a failure."""
    collective_timeout: float = 600.0
    """Seconds a collective may wait before the process group gives up."""
    progress: bool = True
    """Show a progress bar on rank 0."""


@dataclass
class ModelConfig:
    _target_: str = MISSING


@dataclass
class GPTConfig(ModelConfig):
    _target_: str = "launcher.models.gpt.GPT"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    vocab_size: int = 256
    block_size: int = 128
    dropout: float = 0.0


@dataclass
class PySourceDataConfig:
    _target_: str = "launcher.data.PySource"
    seq_len: int = 128
    val_fraction: float = 0.05


@dataclass
class SyntheticDataConfig:
    _target_: str = "launcher.data.Synthetic"
    seq_len: int = 128
    vocab_size: int = 256
    num_samples: int = 16384


@dataclass
class TokensDataConfig:
    _target_: str = "launcher.data.Tokens"
    path: str = MISSING
    dtype: str = "uint16"
    seq_len: int = 1024
    val_fraction: float = 0.01


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0


@dataclass
class DDPStrategyConfig:
    _target_: str = "strategies.ddp.DDP"
    bucket_cap_mb: float = 25.0
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True


@dataclass
class WandbConfig:
    _target_: str = "launcher.logs.WandbLogger"
    project: str = "launch"
    entity: Optional[str] = None
    group: Optional[str] = None
    name: Optional[str] = None
    mode: Optional[str] = None
    """online | offline | disabled; unset: online with an API key, offline without."""
    tags: list[str] = field(default_factory=list)


@dataclass
class NoLoggerConfig:
    _target_: str = "launcher.logs.NullLogger"


@dataclass
class LaunchConfig:
    strategy: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    optim: Any = MISSING
    logger: Any = MISSING
    gpus: Optional[int] = None
    """Worker processes per node (one per GPU); unset: every visible GPU, or 2 on CPU."""
    nodes: int = 1
    """Machines in the job; world size = nodes x gpus."""
    device: Device = Device.auto
    """auto picks cuda when a GPU is visible, else cpu."""
    precision: Precision = Precision.fp32
    seed: int = 1337
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


SCHEMAS: dict[str, dict[str, type]] = {
    "strategy": {"base_ddp": DDPStrategyConfig},
    "model": {"base_gpt": GPTConfig},
    "data": {
        "base_pysource": PySourceDataConfig,
        "base_synthetic": SyntheticDataConfig,
        "base_tokens": TokensDataConfig,
    },
    "optim": {"base_adamw": AdamWConfig, "base_sgd": SGDConfig},
    "logger": {"base_wandb": WandbConfig, "base_none": NoLoggerConfig},
}


def register() -> None:
    """Store every schema; YAML files extend them by name (`defaults: [base_gpt, _self_]`)."""
    store = ConfigStore.instance()
    store.store(name="launch_schema", node=LaunchConfig)
    for group, nodes in SCHEMAS.items():
        for name, node in nodes.items():
            store.store(group=group, name=name, node=node)
