"""Typed schema under every YAML file in conf/.

Each dataclass is stored in Hydra's ConfigStore; the YAML files name their schema in their
`defaults` list, so an unknown key or a value of the wrong type fails at composition, with
the key named. Every numeric field declares its valid range beside it (`ranged`, launcher/config/ranges.py), checked
once when the config is frozen. Importing this module must stay cheap: no torch, deepspeed or wandb.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from launcher.config import data_schema, mix_schema
from launcher.config.data_schema import PySourceDataConfig, SyntheticDataConfig, TokensDataConfig
from launcher.config.groups import choices
from launcher.config.harness_schema import HarnessConfig
from launcher.config.optim_schema import AdamWConfig, CustomOptimConfig, MuonConfig, SGDConfig
from launcher.config.ranges import (
    COUNT,
    FRACTION,
    MICRO,
    NODES,
    PORT,
    POSITIVE,
    SIZE,
    ZERO_STAGE,
    launch_only,
    ranged,
)
from launcher.config.sweep_schema import SweepConfig
from launcher.config.trainer_schema import TrainerConfig

__all__ = ["choices", "register"]  # the options read from here


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class BatchConfig:
    global_size: int = ranged(32, SIZE)
    """Samples per optimizer step, over all ranks and micro-steps."""
    micro_size: Any = ranged(4, MICRO, identity=False)
    """Samples per rank per forward pass; not part of the run's identity (the trajectory depends on the global batch
    alone: `launcher.models.loss`). auto: the largest that divides the global batch and whose planned peak
    fits the device, halved (accumulation doubled) after an out-of-memory error (`launcher.recovery.adapt`)."""


@dataclass
class CustomConfig:
    """model=custom, logger=custom: a target of your own and nothing else; add its keys with +model.KEY=VALUE
    (data=custom: `data_schema.CustomDataConfig`, which also has the loader's keys)."""

    _target_: str = MISSING


@dataclass
class GPTConfig:
    _target_: str = "launcher.models.gpt.GPT"
    n_layer: int = ranged(4, SIZE)
    n_head: int = ranged(4, SIZE)
    n_embd: int = ranged(128, SIZE)
    vocab_size: int = ranged(256, SIZE)
    block_size: int = ranged(128, SIZE)
    dropout: float = ranged(0.0, FRACTION)


class GradCompression(Enum):
    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"


@dataclass
class DDPStrategyConfig:
    _target_: str = "strategies.ddp.DDP"
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to synchronised ones (torch's SyncBatchNorm; on CPU an all-reduce of the same
    statistics): each normalises with the whole micro-batch of every rank, and the running statistics follow it."""
    bucket_cap_mb: float = ranged(25.0, POSITIVE)
    find_unused_parameters: bool = False
    """All-reduce zeros for the parameters a rank did not use in a step (beyond mixture-of-experts blocks, whose
    parameters always get a gradient: strategy.moe_blocks)."""
    gradient_as_bucket_view: bool = True
    compile_units: list[str] | None = None
    """Class names of the modules trainer.compile=true compiles one by one; unset: the model's own
    `_no_split_modules` (transformers models, the built-in GPT's Block), else the whole model."""
    moe_blocks: list[str] | None = None
    """Class names of the mixture-of-experts blocks (each gives every parameter a gradient, zero where a rank used no
    expert of it); unset: the modules with a child named `experts`."""
    grad_compression: GradCompression = GradCompression.none
    """The gradient all-reduce on the wire: none (fp32), or bf16/fp16 (torch's compression hook: half the bytes, each
    gradient rounded to 16 bits before it is summed)."""


class FSDPOffload(Enum):
    none = "none"
    cpu = "cpu"


@dataclass
class FSDPStrategyConfig:
    _target_: str = "strategies.sharded.fsdp"
    shard_units: list[str] | None = None
    """Class names of the modules sharded as one unit each, before the root; unset: the model's own
    `_no_split_modules` (transformers models, the built-in GPT's Block), else the whole model as one unit."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (gather again for backward); false keeps them."""
    offload: FSDPOffload = FSDPOffload.none
    """cpu: keep sharded parameters, gradients and optimizer state in host memory."""
    reduce_dtype: Precision = Precision.fp32
    """Dtype of the gradient reduce-scatter (and of accumulation between syncs) under mixed precision."""
    activation_checkpointing: bool = False
    """Recompute each shard unit's activations in backward instead of storing them."""
    sync_each_microbatch: bool = False
    """Reduce-scatter on every micro-step: K x the communication, but no unsharded gradients kept between."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to synchronised ones (torch's SyncBatchNorm; on CPU an all-reduce of the same
    statistics): each normalises with the whole micro-batch of every rank, and the running statistics follow it."""
    shard_size: int | None = ranged(None, SIZE)
    """Ranks each shard group splits the state over (the 2-D mesh's dim 1); unset: world size / replicate_size, or
    with both unset the GPUs of a node (strategy=hsdp)."""
    replicate_size: int | None = ranged(1, SIZE)
    """Shard groups holding replicas of each other (dim 0), their gradient shards all-reduced each step; 1: plain
    FSDP over every rank; unset: world size / shard_size (strategy=hsdp: the number of nodes)."""
    moe_blocks: list[str] | None = None
    """Class names of the mixture-of-experts blocks (each gives every parameter a gradient, zero where a rank used no
    expert of it); unset: the modules with a child named `experts`."""
    tp_size: int = ranged(1, SIZE)
    """Tensor parallel: ranks of a node that split each planned layer (the mesh's last dimension); they see the same
    micro-batches, so data parallel is the world size / tp_size. 1: none (strategy=fsdp_tp: 2)."""
    tp_plan: Any = None
    """Module-name patterns to styles, e.g. {blocks.*.mlp.0: colwise, blocks.*.mlp.2: rowwise}; unset: the model's own
    (`_tp_plan`, a transformers config's `base_model_tp_plan`). A mapping (untyped: a typed one takes no new keys)."""
    tp_across_nodes: bool = False
    """Let a tensor-parallel group span nodes (tp_size above gpus): its activations' all-reduces then cross the
    network, several per layer per micro-step, much slower than a node's links."""
    loss_parallel: bool = False
    """Under tensor parallel, the output layer's logits stay split over the group by vocabulary and the cross-entropy
    is computed on each rank's part (torch's `loss_parallel`): no rank holds the whole logits, in the forward or the
    backward; what reads the logits (metrics) gathers them."""
    pp_size: int = ranged(1, SIZE)
    """Pipeline parallel: stages of the model's layers, each held by world size / pp_size consecutive ranks
    (`strategies.pipeline`); a pipeline, one rank of each stage, sees the same micro-batches, so data parallel is the
    world size / pp_size. 1: none."""
    pp_schedule: str = "1f1b"
    """torch's pipeline schedule: gpipe | 1f1b | interleaved_1f1b | interleaved_zero_bubble | zbv."""
    pp_stages_per_rank: int | None = ranged(None, SIZE)
    """Stages each rank holds under interleaved_1f1b and interleaved_zero_bubble; unset: 2 (zbv: always 2)."""
    pp_split: list[int] | None = None
    """Where each stage after the first begins, as indices into the model's layer list, e.g. [4] for two stages of
    8 layers; unset: the split pp_balance makes."""
    pp_balance: str = "layers"
    """How the automatic split balances the stages: layers (as many per stage) | params (the fewest parameters on
    the largest stage, the embeddings counted on the first and the head on the last)."""
    pp_across_nodes: bool = False
    """Run a pipeline across nodes that the plan says costs more a step (its bubble, the hidden states it sends)
    than it saves (FSDP's gathers over every rank on the network); unset: such a pipeline is refused before start."""


class ZeroOffload(Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


@dataclass
class DeepSpeedStrategyConfig:
    _target_: str = "strategies.deepspeed.DeepSpeed"
    stage: int = ranged(2, ZERO_STAGE)
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    offload_optimizer: ZeroOffload = ZeroOffload.none
    """Optimizer state and fp32 master weights: none (on the device) | cpu | nvme (stage 3); runs DeepSpeed's
    CPU Adam."""
    offload_params: ZeroOffload = ZeroOffload.none
    """Parameters between uses: none | cpu | nvme (stage 3 only)."""
    nvme_path: str | None = None
    """Folder on a local NVMe disk for offload=nvme; each rank swaps into its own subfolder, removed at the end."""
    sync_each_microbatch: bool = False
    """ZeRO-2/3: reduce-scatter on every micro-step: K x the communication, but no unsharded gradients kept between."""
    sync_batchnorm: bool = False
    """Refused: DeepSpeed strategies keep each rank's own BatchNorm statistics (use ddp, fsdp or hsdp to sync)."""
    ds_config: dict[str, Any] = field(default_factory=dict)
    """Extra DeepSpeed config keys; one that contradicts a derived value (batch, precision, clipping, optimizer)
    is an error."""
    optimizer: str = "${optim._target_}"
    """The optimizer class, read from optim (the checks need it before workers start); do not set."""
    moe_blocks: list[str] | None = None
    """Class names of the mixture-of-experts blocks (each gives every parameter a gradient, zero where a rank used no
    expert of it; ZeRO-3 gathers each as a whole, a leaf module); unset: the modules with a child named `experts`."""


@dataclass
class WandbConfig:
    _target_: str = "launcher.loggers.wandb.WandbLogger"
    project: str = "launch"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    mode: str | None = None
    """online | offline | disabled; unset: online with an API key, offline without."""
    tags: list[str] = field(default_factory=list)


@dataclass
class MlflowConfig:
    _target_: str = "launcher.loggers.mlflow.MlflowLogger"
    tracking_uri: str | None = None
    """Where MLflow keeps the run: a server (http://host:5000), a database (sqlite:///path/mlflow.db) or any URI MLflow
    takes, credentials never in it (MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN); unset:
    MLFLOW_TRACKING_URI, else a SQLite store in the run directory (a sweep's: in the sweep directory),
    `<dir>/mlflow/mlflow.db`."""
    experiment: str = "launch"
    """The experiment the run goes into, made if it is not there."""
    group: str | None = None
    """A parent run the job's run is nested under (made by the first run that names it); a sweep sets it: one parent
    run per sweep, finished by the sweep with its report attached."""
    name: str | None = None
    """The run's name; unset: the run directory's (a sweep's job: `<sweep>-<n>`)."""
    tags: dict[str, str] = field(default_factory=dict)
    """Tags set on the run, besides the launcher's own (`launch.run_id`, `launch.run_dir`)."""


@dataclass
class TensorBoardConfig:
    _target_: str = "launcher.loggers.tensorboard.TensorBoardLogger"
    log_dir: str | None = None
    """Where the event files go: unset, `<run dir>/tensorboard`; set, `<log_dir>/<group>/<name>` (one folder per
    job, kept across its restarts and resumes)."""
    group: str | None = None
    """With log_dir: a folder of runs under it; a sweep sets it (one folder per sweep)."""
    name: str | None = None
    """With log_dir: the job's folder; unset: the job's run id (`<run dir>/run_id`)."""


@dataclass
class RdzvConfig:
    endpoint: str | None = None
    """HOST:PORT of the rendezvous, the same on every node; unset: 127.0.0.1 on one node, the first SLURM host in
    an allocation."""
    id: str | None = None
    """Run id shared by the nodes of one job; unset: derived from the SLURM job id, or random on one node."""
    backend: str = "c10d"
    """torch elastic rendezvous backend: c10d (its store on the node at rdzv.endpoint), static (node ranks from
    rdzv.node_rank / SLURM_NODEID), or etcd-v2 (its store in an etcd server at rdzv.endpoint, which outlives any node
    of the job; pip install 'launch[etcd]')."""
    port: int | None = ranged(None, PORT)
    """Port on the first host when the endpoint is derived from a SLURM allocation; unset: from the job id and
    rdzv.secret, below the kernel's ephemeral port range, so that concurrent jobs on one first host do not meet."""
    secret: str | None = None
    """Random token the launcher adds when it submits to SLURM (hydra/launcher=submitit_*): part of the derived
    rendezvous id and port, so that knowing a job id is not enough to join its rendezvous."""
    join_timeout: float = ranged(600.0, POSITIVE)
    """Seconds to wait for every node to join before giving up."""
    last_call_timeout: int = ranged(30, SIZE)
    """nodes=MIN:MAX: once MIN nodes have joined, seconds to wait for more before the worker group starts (or
    restarts at its new size)."""
    node_rank: int | None = ranged(None, COUNT)
    """This node's rank for the static backend; unset: SLURM_NODEID."""


class PlanFormat(Enum):
    table = "table"
    json = "json"


@dataclass
class PlanConfig:
    """`launch plan` and `strategy=auto`: the machine the plan is for (memory per device, links)."""

    link_gbps: float = ranged(600.0, POSITIVE)
    """Bandwidth of the link between GPUs of one node, in GB/s (gigaBYTES, 1e9 bytes/s) per GPU; 600: NVLink (A100)."""
    internode_gbps: float = ranged(50.0, POSITIVE)
    """Bandwidth between nodes, in GB/s per GPU (gigaBYTES); 50: one 400 Gb/s InfiniBand NIC per GPU. Bounds a
    run when nodes > 1."""
    device_memory_gb: float | None = ranged(None, POSITIVE)
    """Memory per device in GB (1e9 bytes); unset: the free memory of cuda:0 when a GPU is visible, else 80."""
    host_memory_gb: float | None = ranged(None, POSITIVE)
    """Host memory per node in GB, shared by its ranks; unset: this machine's available memory with device=cpu or a
    GPU visible, else a typical node for the GPUs planned (2 GB per GB of their memory)."""
    nvme_gb: float | None = ranged(None, POSITIVE)
    """NVMe space per node in GB for state offloaded there, shared by its ranks; unset: not checked by the plan (a
    launch checks strategy.nvme_path's free space)."""
    headroom: float = ranged(0.1, FRACTION)
    """Fraction of device memory kept free (allocator fragmentation, CUDA context, buffers); 0 <= headroom < 1."""
    format: PlanFormat = PlanFormat.table
    """table: for people; json: for scripts."""
    chart: str | None = None
    """Also write a PNG chart of per-rank memory by kind for each strategy to this path."""


@dataclass
class AutoStrategyConfig:
    """strategy=auto: a marker, not a strategy; the launcher replaces it with the planner's choice before
    anything runs."""

    _target_: str = "launcher.plan.commands.Auto"
    candidates: list[str] = field(default_factory=list)
    """Presets to choose from (names in conf/strategy); empty: all of them."""


@dataclass
class LaunchConfig:
    strategy: Any = launch_only(MISSING)
    """A checkpoint is strategy-neutral: the same run may go on under another strategy or world size."""
    model: Any = MISSING
    data: Any = MISSING
    optim: Any = MISSING
    logger: dict[str, Any] = launch_only(factory=dict)
    """The loggers, each under its name (`logger=[wandb,mlflow]`: logger.wandb.*, logger.mlflow.*); none: only
    metrics.jsonl."""
    gpus: int | None = ranged(None, SIZE, identity=False)
    """Worker processes per node (one per GPU); unset: every visible GPU, or 2 on CPU."""
    nodes: Any = ranged(1, NODES, identity=False)
    """Machines in the job; world size = nodes x gpus. MIN:MAX: an elastic job, which goes on at any number of nodes
    in the range (the global batch fixed, accumulation derived again: `launcher.recovery.adapt`)."""
    device: Device = launch_only(Device.auto)
    """auto picks cuda when a GPU is visible, else cpu."""
    precision: Precision = Precision.fp32
    seed: int = ranged(1337, COUNT)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resume: str | None = launch_only(None)
    """Continue from a checkpoint: auto (the newest among earlier runs), a run directory or a checkpoint folder."""
    rdzv: RdzvConfig = launch_only(factory=RdzvConfig)
    plan: PlanConfig = launch_only(factory=PlanConfig)
    sweep: SweepConfig = launch_only(factory=SweepConfig)
    """A search's objective, and which trial of which study a run is (`launcher.search`)."""
    harness: HarnessConfig = launch_only(factory=HarnessConfig)
    """lm-evaluation-harness tasks `launch eval CHECKPOINT` runs on the checkpoint (`launcher.export.harness`)."""


SCHEMAS: dict[str, dict[str, type]] = {
    "strategy": {
        "base_ddp": DDPStrategyConfig,
        "base_fsdp": FSDPStrategyConfig,
        "base_deepspeed": DeepSpeedStrategyConfig,
    },
    "model": {"base_gpt": GPTConfig, "base_custom": CustomConfig},
    "data": {
        "base_custom": data_schema.CustomDataConfig,
        "base_hf": data_schema.HFDataConfig,
        "base_pysource": PySourceDataConfig,
        "base_synthetic": SyntheticDataConfig,
        "base_tokens": TokensDataConfig,
        "base_text": data_schema.TextDataConfig,
        "base_store": data_schema.StoreDataConfig,
        "base_mix": mix_schema.MixDataConfig,
    },
    "optim": {
        "base_adamw": AdamWConfig,
        "base_sgd": SGDConfig,
        "base_muon": MuonConfig,
        "base_custom": CustomOptimConfig,
    },
    "logger": {
        "base_wandb": WandbConfig,
        "base_mlflow": MlflowConfig,
        "base_tensorboard": TensorBoardConfig,
        "base_custom": CustomConfig,
    },
}

SCHEMAS["strategy"]["base_auto"] = AutoStrategyConfig  # conf/strategy/auto.yaml: resolved by launch.prepare()


def register() -> None:
    """Store every schema; YAML files extend them by name (`defaults: [base_gpt, _self_]`)."""
    if not OmegaConf.has_resolver("launch_id"):  # the default run directory's suffix; cached: one value per launch
        OmegaConf.register_new_resolver("launch_id", lambda: secrets.token_hex(2), use_cache=True)
    if not OmegaConf.has_resolver("launch_vocab"):  # data=text: data.vocab_size, the tokenizer's unless set
        OmegaConf.register_new_resolver("launch_vocab", data_schema.tokenizer_vocab, use_cache=True)
    if not OmegaConf.has_resolver("launch_store_vocab"):  # data=store: data.vocab_size, its manifest's
        OmegaConf.register_new_resolver("launch_store_vocab", data_schema.store_vocab, use_cache=True)
    if not OmegaConf.has_resolver("launch_strategies"):  # conf/sweep/smoke.yaml (launcher/config/smoke.py)
        from launcher.config import smoke

        OmegaConf.register_new_resolver("launch_strategies", smoke.runnable_strategies, use_cache=True)
        OmegaConf.register_new_resolver("launch_scratch", smoke.scratch, use_cache=True)
    store = ConfigStore.instance()
    store.store(name="launch_schema", node=LaunchConfig)
    for group, nodes in SCHEMAS.items():
        for name, node in nodes.items():
            store.store(group=group, name=name, node=node)
