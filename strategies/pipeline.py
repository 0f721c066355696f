"""Pipeline parallel under FSDP2 (`strategy.pp_size` P > 1): the model split by depth into stages, run by torch's own
schedules (`torch.distributed.pipelining`), each stage split by tensor parallel where `strategy.tp_size` T > 1 and
sharded by FSDP2 over the data-parallel ranks (torchtitan's order, within each stage).

The ranks form a device mesh of pp x (replicate x) shard (x tp), torchtitan's order: each T consecutive ranks are one
tensor-parallel group, each world / P consecutive ranks one stage's data-parallel ranks (FSDP2's gathers on the
fastest links), and a pipeline's ranks, one in each stage, read the same micro-batches (`RunContext.tensor_size`
counts them, `RunContext.data_rank` places them), so the data contract is that of the data-parallel ranks alone. Under a
sequence-parallel plan (the built-in GPT's) a stage sends the next its rank's part of the sequence. A step's K
micro-batches are the schedule's K microbatches; the last stage turns each one's output into the launcher's loss
(`launcher.models.loss.micro_loss`: the summed loss times G / N, N the whole global batch's targets), and the
schedule does not scale the gradients again (`scale_grads=False`).

A stage is the whole model built on the meta device and pruned: its layer list keeps this stage's layers under their
own indices, the modules registered before the list (embeddings) stay on the first stage only, those registered after
it (final norm, head, the loss) on the last only. Every parameter keeps the whole model's name, so param groups,
checkpoints and `launch convert` see the whole model's names. A parameter tied across stages (the built-in GPT's head
and embedding) is held by each stage that uses it, under its first name, and kept in step exactly: its gradients are
summed over its copies before the norm (counted once) and the optimizer step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from strategies.base import ModelFactory, OptimizerFactory, RunContext
from strategies.declarations import Conformance
from strategies.ema import EMA, ema_of
from strategies.fsdp import DTYPES, FSDP, _counting_collectives
from strategies.parallelize import apply_tp, device_meshes
from strategies.pipeline_layout import (
    BALANCE,
    LOOPED,
    SCHEDULES,
    ZERO_BUBBLE,
    Split,
    held_stages,
    microbatch_problem,
    plan_split,
    stage_count,
)
from strategies.pipeline_stages import Stage, counted_stage_class, prune, schedule_class
from strategies.sizes import model_state_bytes
from strategies.stepping import LR_SCALE, autocast_dtype, set_lr, step_figures


class PipelineFSDP(FSDP):
    """FSDP2 with pipeline stages (`strategies.sharded.fsdp` builds it where strategy.pp_size > 1)."""

    stages_model = True

    def conformance(self) -> Conformance:
        tp = (f"strategy.tp_size={self.tp.size}",) if self.tp.size > 1 else ()
        return Conformance(ranks=2 * self.pp_size * self.tp.size, overrides=(f"strategy.pp_size={self.pp_size}", *tp))

    def check(self, ctx: RunContext, model: nn.Module) -> str | None:
        P, world = self.pp_size, ctx.world_size
        if world % P:
            sizes = ", ".join(str(d) for d in range(2, world + 1) if world % d == 0)
            raise ValueError(
                f"strategy.pp_size={P} does not divide the world size {world} (nodes x gpus); use one of "
                f"{sizes}, or 1 for no pipeline"
            )
        refused = [
            (self.offload != "none", f"strategy.offload={self.offload}", "offload"),
            (self.activation_checkpointing, "strategy.activation_checkpointing=true", "activation checkpointing"),
            (self.sync_each_microbatch, "strategy.sync_each_microbatch=true", "a sync on every micro-step"),
            (self.sync_batchnorm, "strategy.sync_batchnorm=true", "synchronised BatchNorm"),
            (ctx.compile, "trainer.compile=true", "compiled units"),
            (ctx.precision == "fp16", "precision=fp16", "fp16's loss scaling (use precision=bf16)"),
            (self.tp.loss_parallel, "strategy.loss_parallel=true", "the loss on split logits"),
            (
                bool(self.pp_split) and self.pp_balance != "layers",
                f"strategy.pp_balance={self.pp_balance}",
                "strategy.pp_split (it names the split itself)",
            ),
        ]
        for bad, key, what in refused:
            if bad:
                raise ValueError(
                    f"{key} with strategy.pp_size={P}: {what} does not compose with pipeline parallel "
                    f"here; leave it out, or use strategy.pp_size=1"
                )
        if self.pp_schedule not in SCHEDULES:
            raise ValueError(f"strategy.pp_schedule={self.pp_schedule} is none of {', '.join(SCHEDULES)}")
        if self.pp_balance not in BALANCE:
            raise ValueError(f"strategy.pp_balance={self.pp_balance} is none of {', '.join(BALANCE)}")
        if self.pp_schedule == "zbv" and self.pp_stages_per_rank not in (None, 2):
            raise ValueError(
                f"strategy.pp_stages_per_rank={self.pp_stages_per_rank} with pp_schedule=zbv: zbv holds "
                "exactly 2 stages per rank, in a V; leave pp_stages_per_rank unset"
            )
        if self.pp_schedule not in LOOPED and self.pp_stages_per_rank not in (None, 1):
            raise ValueError(
                f"strategy.pp_stages_per_rank={self.pp_stages_per_rank} with pp_schedule="
                f"{self.pp_schedule}: it holds one stage per rank; use pp_schedule=interleaved_1f1b or "
                "interleaved_zero_bubble for several"
            )
        problem = microbatch_problem(self.pp_schedule, P, ctx.accumulation)
        if problem:
            raise ValueError(
                f"strategy.pp_schedule={self.pp_schedule} {problem}; the step has {ctx.accumulation} (batch.global_size"
                " / (batch.micro_size x data-parallel ranks)): raise batch.global_size or lower batch.micro_size, or "
                "use pp_schedule=gpipe"
            )
        from strategies.moe import moe_blocks

        if moe_blocks(model, self.moe_blocks):
            raise ValueError(
                f"strategy.pp_size={P}: the model's mixture-of-experts blocks do not compose with "
                "pipeline parallel here; use strategy.pp_size=1"
            )
        from strategies.held import held_tensors

        if held_tensors(model):
            raise ValueError(
                f"strategy.pp_size={P}: {type(model).__name__} holds tensors outside its parameters and "
                "buffers, which its stages cannot be filled with; use strategy.pp_size=1"
            )
        split = self._split(model)
        print(
            f"launch: pipeline: {len(split.ranges)} stages of {type(model).__name__} by "
            f"{'strategy.pp_split' if self.pp_split else self.pp_balance} ({self.pp_schedule}, "
            f"{ctx.accumulation} micro-batches): {split.describe()}",
            flush=True,
        )
        print(
            "launch: pipeline: plan_peak_bytes and comm_bytes_formula are FSDP's over the whole model, not one "
            "stage's (launch plan's pipeline section has each stage's); model_state_bytes, comm_bytes and "
            "pp_sent_bytes are measured",
            flush=True,
        )
        return super().check(ctx, model)

    @property
    def stages(self) -> int:
        return stage_count(self.pp_schedule, self.pp_size, self.pp_stages_per_rank or 2)

    def _split(self, model: nn.Module) -> Split:
        return plan_split(model, self.stages, self.pp_split, self.pp_balance, self.pp_size, self.pp_schedule)

    # ------------------------------------------------------------------ setup

    def setup(self, ctx: RunContext, build_model: ModelFactory, build_optimizer: OptimizerFactory) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        self.ctx = ctx
        P, T = self.pp_size, self.tp.size
        stage_world = ctx.world_size // P  # a stage's ranks: consecutive, a node's where they fill one
        gpus = None if ctx.local_world_size is None else min(ctx.local_world_size, stage_world)
        replicate, shard = self.mesh.groups(stage_world, gpus)  # its data-parallel ranks (of T each): hsdp's nodes
        dp_mesh, tp_mesh, pp_mesh, mesh = device_meshes(ctx.device_type, replicate, shard, T, P)  # (pp, dp, tp)
        self._counter.world_size = shard
        self.pp_group = pp_mesh.get_group()
        pp_rank = pp_mesh.get_local_rank()
        whole = build_model() if ctx.rank == 0 else None
        meta = build_model(meta=True)
        split = self._split(meta)
        mine = held_stages(self.pp_schedule, P, self.pp_stages_per_rank or 2, pp_rank)
        precision = MixedPrecisionPolicy(
            param_dtype=autocast_dtype(ctx.precision), reduce_dtype=DTYPES[self.reduce_dtype]
        )
        pruned = [prune(meta, split, i) for i in mine]
        for stage in pruned:  # torchtitan's order within each stage: tensor parallel, then FSDP around it
            apply_tp(stage, self.tp, tp_mesh)
        parts = [Stage(stage, split, i) for stage, i in zip(pruned, mine)]
        # A zero-bubble schedule computes the weights' gradients apart, after the inputs', from the parameters the
        # stage's module holds then: they must be the gathered ones its forward used (torchtitan's choice too).
        reshard = self.reshard_after_forward and self.pp_schedule not in ZERO_BUBBLE
        for part in parts:
            for layer in part.get_submodule(split.path):
                fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=precision)
            fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=precision)
            part.to_empty(device=ctx.device)
        _fill(parts, meta, whole, torch.device(ctx.device))
        del whole
        reduce_scatter, all_gather = _counting_collectives(self._counter)
        for part in parts:
            part.hook()
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_reduce_scatter(reduce_scatter)
                    module.set_custom_all_gather(all_gather)
        self.parts, self.split = parts, split
        self.last = next((p for p in parts if p.is_last), None)
        self.holder = {
            i: r for r in range(P) for i in held_stages(self.pp_schedule, P, self.pp_stages_per_rank or 2, r)
        }
        counted = counted_stage_class()
        stages = [
            counted(part, i, len(split.ranges), torch.device(ctx.device), group=self.pp_group)
            for part, i in zip(parts, mine)
        ]
        self.pipeline_stages = stages
        cls = schedule_class(self.pp_schedule)
        self.schedule = cls(
            stages[0] if self.pp_schedule in ("gpipe", "1f1b") else stages,
            ctx.accumulation,
            loss_fn=self._loss,
            scale_grads=False,  # the launcher's loss is normalised by the global batch's targets already
        )
        self.optimizers = [build_optimizer(part) for part in parts]
        if any(hasattr(o, "on_gather") for o in self.optimizers):
            raise ValueError(
                f"optim=muon with strategy.pp_size={P}: Muon does not compose with pipeline parallel "
                "here; use optim=adamw, or strategy.pp_size=1"
            )
        self._tie(meta, split, mesh, dist)
        self._whole_groups(meta)
        self.model = parts[0]  # what FSDP's own methods read (its figures' offload set)
        self.optimizer = self.optimizers[0]
        self.ema = None
        self.emas = [e for e in (ema_of(part, ctx.ema) for part in parts) if e is not None]
        """Each stage's EMA of its own parameters, held as they are (a tied parameter's copies averaged alike)."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        self.scaler = ShardedGradScaler(ctx.device_type, enabled=False)
        self._losses: dict[int, tuple[torch.Tensor, bool]] = {}

    def _tie(self, meta: nn.Module, split: Split, mesh: Any, dist: Any) -> None:
        """The parameters held by more than one stage (tied): their first copy's stage, and a group for each
        data-parallel coordinate over the pipeline ranks holding a copy (made on every rank, in one order)."""
        copies: dict[str, list[int]] = {}
        for i in range(len(split.ranges)):
            for name, _ in Stage(prune(meta, split, i), split, i).named_parameters():
                copies.setdefault(name, []).append(i)
        self.tied = {name: stages for name, stages in copies.items() if len(stages) > 1}
        self.tie_groups: dict[str, Any] = {}
        # row: a data-parallel (and tensor-parallel) coordinate; column: a pipeline rank
        grid = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), -1).reshape(-1, self.pp_size)
        for name, stages in sorted(self.tied.items()):
            ranks_pp = sorted({self.holder[i] for i in stages})
            if len(ranks_pp) < 2:
                continue
            for row in grid.tolist():
                ranks = [row[r] for r in ranks_pp]
                group = dist.new_group(ranks)
                if self.ctx.rank in ranks:
                    self.tie_groups[name] = group

    def _whole_groups(self, meta: nn.Module) -> None:
        """Every param group's parameters by name over the whole model (all stages): what a checkpoint records, so
        that one process (any layout) reads the whole model's groups, whichever rank's record it keeps."""
        import torch.distributed as dist

        mine: dict[str, tuple[list[str], dict[str, Any]]] = {}
        for part, optimizer in zip(self.parts, self.optimizers):
            ids = {id(p): n for n, p in part.named_parameters()}
            for group in optimizer.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                mine.setdefault(group.get("group", ""), ([], hyper))[0].extend(ids[id(p)] for p in group["params"])
        every: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(every, mine, group=self.pp_group)
        order = {name: i for i, (name, _) in enumerate(meta.named_parameters())}
        labels: dict[str, set[str]] = {}
        self.group_hyper: dict[str, dict[str, Any]] = {}
        for found in every:
            for label, (names, hyper) in found.items():
                labels.setdefault(label, set()).update(names)
                self.group_hyper.setdefault(label, hyper)
        self.group_names = {label: sorted(names, key=order.__getitem__) for label, names in labels.items()}
        self.group_order = list(dict.fromkeys(sorted(labels, key=lambda lab: min(order[n] for n in labels[lab]))))

    # ------------------------------------------------------------------ a step

    def _loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        k = int(target)
        backward, part, normalised = self._loss_of(k, self.last.rebuild(output))  # type: ignore[union-attr]
        self._losses[k] = (part.double(), normalised)  # by micro-batch: the first step calls it once more for shapes
        return backward

    def pipeline_step(self, micro: list[Any], loss_of: Callable[[int, Any], Any]) -> tuple[torch.Tensor, bool]:
        """Run the step's K micro-batches through the schedule (forward and backward; the gradients synchronised
        on the last); `loss_of(k, output)` is the runner's loss of micro-batch k. Returns the step's loss part (the
        same on every rank of a pipeline) and whether it is token-normalised."""
        import torch.distributed as dist

        self._loss_of, self._losses = loss_of, {}
        given = [self._keywords(b) for b in micro]
        batch = {key: torch.cat([b[key] for b in given]) for key in given[0]}
        targets = torch.arange(len(micro), device=self.ctx.device)
        with self.tp.counted():
            self.schedule.step(target=targets, return_outputs=False, **batch)
        device = torch.device(self.ctx.device)
        parts = [self._losses[k] for k in sorted(self._losses)]
        summed = torch.stack([p for p, _ in parts]).sum() if parts else torch.zeros((), dtype=torch.float64)
        shared = torch.stack(
            [
                summed.to(device),
                torch.tensor(float(all(n for _, n in parts) and bool(parts)), dtype=torch.float64, device=device),
            ]
        )
        dist.all_reduce(shared, group=self.pp_group)  # the last stage's figures, on every stage
        return shared[0], bool(shared[1] > 0)

    def _keywords(self, batch: Any) -> dict[str, torch.Tensor]:
        """A micro-batch as the model's keyword arguments (the model contract: a mapping's keys, a tuple's positions
        bound to the forward's parameters), each a tensor of a row per sample: what the schedule splits."""
        import inspect
        from collections.abc import Mapping

        if isinstance(batch, Mapping):
            found = dict(batch)
        else:
            args = batch if isinstance(batch, (tuple, list)) else (batch,)
            found = dict(inspect.signature(self.parts[0]._run[0].forward).bind(*args).arguments)
        bad = [k for k, v in found.items() if not isinstance(v, torch.Tensor) or v.dim() == 0]
        if bad:
            raise TypeError(
                f"strategy.pp_size > 1 splits a step's batch by rows: its {', '.join(bad)} is no tensor "
                "of a row per sample; give the model's batch as such tensors"
            )
        return found

    def step(self, lr: float) -> float:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for name in self.tied:  # a tied parameter's gradient: the sum over its copies
                local = [
                    _local(p.grad)
                    for part in self.parts
                    for n, p in part.named_parameters()
                    if n == name and p.grad is not None
                ]
                if not local:
                    continue
                total = local[0].clone()
                for t in local[1:]:
                    total += t
                if name in self.tie_groups:
                    dist.all_reduce(total, group=self.tie_groups[name])
                for t in local:
                    t.copy_(total)
            counted = [
                p.grad
                for part in self.parts
                for n, p in part.named_parameters()
                if p.grad is not None and (n not in self.tied or part.index == self.tied[n][0])
            ]
            norm = torch.nn.utils.get_total_norm(counted) if counted else torch.zeros((), device=self.ctx.device)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            squared = norm.double() ** 2
            dist.all_reduce(squared, group=self.pp_group)  # the global norm: every stage's
            total_norm = float(squared.sqrt())
            params = [p for part in self.parts for p in part.parameters()]
            if self.ctx.grad_clip > 0 and math.isfinite(total_norm):
                torch.nn.utils.clip_grads_with_norm_(params, self.ctx.grad_clip, torch.tensor(total_norm))
        for optimizer in self.optimizers:
            set_lr(optimizer, lr)
            if math.isfinite(total_norm):  # a step that is not finite is not committed
                optimizer.step()
        if math.isfinite(total_norm):
            for ema in self.emas:
                ema.update()
        held = sum(model_state_bytes(part.parameters(), o) for part, o in zip(self.parts, self.optimizers))
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        sent = {"pp_sent_bytes": float(sum(s.sent for s in self.pipeline_stages))}
        self._last_step = step_figures(self._counter, held) | sent | self.tp.figures()
        for stage in self.pipeline_stages:
            stage.sent = 0
        return total_norm

    # ------------------------------------------------------------------ evaluation: one micro-batch at a time

    def forward(self, batch: Any) -> Any:
        """The model's output for one micro-batch (evaluation), on every rank of the pipeline: the stages run in
        turn, each sending its activation to the next stage's rank; the last stage's output is sent to every rank."""
        import torch.distributed as dist

        if torch.is_grad_enabled():
            raise RuntimeError("strategy.pp_size > 1 trains through its schedule (pipeline_step), not forward()")
        group, device = self.pp_group, torch.device(self.ctx.device)
        me = dist.get_group_rank(group, self.ctx.rank)
        held = {part.index: part for part in self.parts}
        hidden: torch.Tensor | None = None
        output: Any = None
        count = len(self.split.ranges)
        for i in range(count):
            owner = self.holder[i]
            if i > 0 and self.holder[i - 1] != owner:  # the activation crosses ranks
                hidden = _pass(hidden, self.holder[i - 1], owner, me, group, device)
            if owner == me:
                result = held[i](*(() if i == 0 else (hidden,)), **self._keywords(batch))
                hidden = result if i < count - 1 else None
                if i == count - 1:
                    output = held[i].rebuild(result)
        return _share(output, self.holder[count - 1], me, group, device)

    def sync(self, enabled: bool) -> AbstractContextManager[None]:
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError("strategy.pp_size > 1 trains through its schedule (pipeline_step), not backward()")

    def train(self, mode: bool) -> None:
        for part in self.parts:
            part.train(mode)
        if mode:  # what evaluation sent is not the step's
            self._counter.take()
            self.tp.figures()

    # ------------------------------------------------------------------ checkpoints: the whole model's shape

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model: dict[str, Any] = {}
        state: dict[str, Any] = {}
        hyper: dict[str, dict[str, Any]] = {}
        for part, optimizer in zip(self.parts, self.optimizers):
            fresh = not optimizer.state
            m, o = get_state_dict(part, optimizer)
            if fresh:  # as `strategies.base.torch_state_dict`: asking must not step a fresh optimizer
                optimizer.state.clear()
            model |= m
            state |= o["state"]
            for group in o["param_groups"]:
                hyper.setdefault(group.get("group", ""), {k: v for k, v in group.items() if k != "params"})
        scaled = [g for o in self.optimizers for g in o.param_groups if g.get(LR_SCALE, 1.0)]
        base = scaled[0]["lr"] / scaled[0].get(LR_SCALE, 1.0) if scaled else 0.0
        for label in self.group_order:  # a group no stage of this rank holds: its keys from setup, the lr of now
            if label not in hyper:
                keys = self.group_hyper[label]
                hyper[label] = {**keys, "lr": base * keys.get(LR_SCALE, 1.0)}
        groups = [{**hyper[label], "params": list(self.group_names[label])} for label in self.group_order]
        found = {"model": model, "optim": {"state": state, "param_groups": groups}}
        if self.emas:  # the whole model's names; a tied parameter's average once, its first stage's
            weights = {n: t for ema in reversed(self.emas) for n, t in ema.average.items()}
            found["ema"] = {"weights": weights, "steps": self.emas[0].steps}
        return found

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        loaded = {g.get("group", ""): g for g in state["optim"]["param_groups"]}
        for part, optimizer in zip(self.parts, self.optimizers):
            names = dict(part.named_parameters())
            ids = {id(p): n for n, p in names.items()}
            own = {
                "state": {n: state["optim"]["state"][n] for n in names if n in state["optim"]["state"]},
                "param_groups": [
                    {
                        **{k: v for k, v in loaded[g.get("group", "")].items() if k != "params"},
                        "params": [ids[id(p)] for p in g["params"]],
                    }
                    for g in optimizer.param_groups
                ],
            }
            model = {n: v for n, v in state["model"].items() if n in part.state_dict()}
            set_state_dict(
                part, optimizer, model_state_dict=model, optim_state_dict=own, options=StateDictOptions(strict=False)
            )
        for ema in self.emas:  # from a checkpoint without EMA weights the average starts at the loaded weights
            entry = state.get("ema") or {"weights": dict(ema.live), "steps": ema.steps}
            ema.load({"weights": {n: entry["weights"][n] for n in ema.average}, "steps": entry["steps"]})

    def averaged(self) -> AbstractContextManager[bool]:
        return _averaged(self.emas)

    def teardown(self) -> None:
        self.parts = self.optimizers = self.schedule = None  # type: ignore[assignment]
        super().teardown()


@contextmanager
def _averaged(emas: list[EMA]) -> Iterator[bool]:
    """Every stage's parameters hold their average inside the block (none kept: False)."""
    with ExitStack() as stack:
        for ema in emas:
            stack.enter_context(ema.swapped())
        yield bool(emas)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fill(parts: list[Stage], meta: nn.Module, whole: nn.Module | None, device: torch.device) -> None:
    """Every rank's shards of its stages from rank 0's whole model (collective: every rank holds as many stages),
    and every buffer, non-persistent ones too, broadcast and kept where a stage holds it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for part in parts:
        set_model_state_dict(part, whole.state_dict() if whole is not None else {}, options=options)
    held = {n: b for part in parts for n, b in part.named_buffers()}
    sources = dict(whole.named_buffers()) if whole is not None else {}
    with torch.no_grad():
        for name, b in meta.named_buffers():
            t = (
                sources[name].to(device).clone()
                if whole is not None
                else torch.empty(b.shape, dtype=b.dtype, device=device)
            )
            dist.broadcast(t, src=0)
            if name in held:
                held[name].copy_(t)


def _pass(hidden: torch.Tensor | None, src: int, dst: int, me: int, group: Any, device: torch.device) -> Any:
    """An activation from pipeline rank `src` to `dst` (group ranks): its shape and dtype first."""
    import torch.distributed as dist

    if me == src:
        assert hidden is not None
        head = torch.tensor([hidden.dim(), *hidden.shape, *[0] * (8 - hidden.dim())], dtype=torch.int64)
        dist.send(head.to(device), group_dst=dst, group=group)
        dist.send_object_list([hidden.dtype], group_dst=dst, group=group)
        dist.send(hidden.contiguous(), group_dst=dst, group=group)
        return None
    if me == dst:
        head = torch.zeros(9, dtype=torch.int64, device=device)
        dist.recv(head, group_src=src, group=group)
        kind: list[Any] = [None]
        dist.recv_object_list(kind, group_src=src, group=group)
        shape = head[1 : 1 + int(head[0])].tolist()
        hidden = torch.empty(shape, dtype=kind[0], device=device)
        dist.recv(hidden, group_src=src, group=group)
        return hidden
    return None


def _share(output: Any, src: int, me: int, group: Any, device: torch.device) -> Any:
    """The last stage's output on every rank of the pipeline: its structure, then each tensor."""
    import torch.distributed as dist

    leaves, spec = pytree.tree_flatten(output) if me == src else ([], None)
    shapes = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ("value", t) for t in leaves]
    box = [spec, shapes]
    dist.broadcast_object_list(box, group_src=src, group=group)
    spec, shapes = box
    out = []
    for i, (shape, kind) in enumerate(shapes):
        if shape == "value":
            out.append(kind)
            continue
        t = leaves[i].contiguous() if me == src else torch.empty(shape, dtype=kind, device=device)
        dist.broadcast(t, group_src=src, group=group)
        out.append(t)
    return pytree.tree_unflatten(out, spec)


def pipelined(strategy: Any) -> bool:
    """Whether a strategy runs a step's micro-batches itself, through a pipeline schedule."""
    return callable(getattr(strategy, "pipeline_step", None))
