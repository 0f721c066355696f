"""Run by test_deepspeed.py under torchrun (2 ranks): DeepSpeed's state_dict against one torch process.

Both train the same GPT on the same global batches for 2 optimizer steps: DeepSpeed on 2 ranks with
2 micro-steps each, plain torch (AdamW, clipping) on rank 0 over the same micro-batches. Then the
export is loaded into a fresh engine and both take one more step. Rank 0 prints one JSON line.

Each rank's export holds the full copies of the parameters it owns (about 1/G of the state): their union
is torch's full state dict.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from launcher.config.context import preset_strategy
from launcher.models.gpt import GPT
from launcher.optim.build import build_optimizer
from strategies import RunContext

KW = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=256, block_size=16)
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def main(preset: str) -> None:
    dist.init_process_group("gloo")
    rank, world, K = dist.get_rank(), dist.get_world_size(), 2
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 256, (world * K * 2, 17), generator=gen) for _ in range(2)]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]  # next-token targets
    strategy = preset_strategy(preset, optimizer="torch.optim.AdamW")
    ctx = RunContext(
        device="cpu",
        rank=rank,
        local_rank=rank,
        world_size=world,
        precision="fp32",
        grad_clip=1.0,
        accumulation=K,
        micro_size=2,
    )
    torch.manual_seed(0)
    strategy.setup(ctx, lambda: GPT(**KW), functools.partial(build_optimizer, torch.optim.AdamW, **ADAMW))
    for idx, targets in batches:
        for k in range(K):
            rows = slice((rank * K + k) * 2, (rank * K + k + 1) * 2)
            with strategy.sync(k == K - 1):
                strategy.backward(strategy.forward((idx[rows], targets[rows]))["loss"] / K)
        strategy.step(ADAMW["lr"])
    mine = strategy.state_dict()
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    state = {"model": {}, "optim": {"state": {}, "param_groups": mine["optim"]["param_groups"]}}
    for part in parts:
        state["model"] |= part["model"]
        state["optim"]["state"] |= part["optim"]["state"]
    held = [sum(t.numel() for t in part["model"].values()) for part in parts]
    total = sum(t.numel() for t in state["model"].values())

    # Resume: a fresh engine's template filled with the export (as a checkpoint load does), then
    # one more step on both: the same weights and moments afterwards.
    fresh = preset_strategy(preset, optimizer="torch.optim.AdamW")
    torch.manual_seed(1)  # other initial weights: the load must replace them
    fresh.setup(ctx, lambda: GPT(**KW), functools.partial(build_optimizer, torch.optim.AdamW, **ADAMW))
    template = fresh.state_dict()
    for name, t in template["model"].items():
        t.copy_(state["model"][name])
    for name, moments in template["optim"]["state"].items():
        for key, t in moments.items():
            t.copy_(state["optim"]["state"][name][key])
    fresh.load_state_dict(template)
    idx, targets = batches[0]
    for s in (strategy, fresh):
        for k in range(K):
            rows = slice((rank * K + k) * 2, (rank * K + k + 1) * 2)
            with s.sync(k == K - 1):
                s.backward(s.forward((idx[rows], targets[rows]))["loss"] / K)
        s.step(ADAMW["lr"])
    after, resumed = strategy.state_dict(), fresh.state_dict()
    strategy.teardown()
    fresh.teardown()
    local = max(
        max((after["model"][k] - v).abs().max().item() for k, v in resumed["model"].items()),
        max(
            (
                (after["optim"]["state"][k][m] - v[m]).abs().max().item()
                for k, v in resumed["optim"]["state"].items()
                for m in v
            ),
            default=0.0,
        ),
    )
    worst = torch.tensor(local)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # each rank compares the entries it owns
    resume_diff = worst.item()
    if rank == 0:
        torch.manual_seed(0)
        model = GPT(**KW)
        optim = build_optimizer(torch.optim.AdamW, model, **ADAMW)  # the same param groups
        for idx, targets in batches:
            for m in range(world * K):  # the same micro-batches, accumulated
                (model(idx[m * 2 : (m + 1) * 2], targets[m * 2 : (m + 1) * 2])["loss"] / (world * K)).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        ref_model, ref_optim = get_state_dict(model, optim)
        diff = {
            "weights": max((state["model"][k] - v).abs().max().item() for k, v in ref_model.items()),
            "exp_avg": max(
                (state["optim"]["state"][k]["exp_avg"] - v["exp_avg"]).abs().max().item()
                for k, v in ref_optim["state"].items()
            ),
            "exp_avg_sq": max(
                (state["optim"]["state"][k]["exp_avg_sq"] - v["exp_avg_sq"]).abs().max().item()
                for k, v in ref_optim["state"].items()
            ),
        }
        same_keys = (
            sorted(state["model"]) == sorted(ref_model)
            and sorted(state["optim"]["state"]) == sorted(ref_optim["state"])
            and [g["params"] for g in state["optim"]["param_groups"]]
            == [g["params"] for g in ref_optim["param_groups"]]
            and all(
                float(state["optim"]["state"][k]["step"]) == float(v["step"]) for k, v in ref_optim["state"].items()
            )
        )
        shares = [h / total for h in held]
        print(
            json.dumps({"diff": diff, "same_keys": same_keys, "resume_diff": resume_diff, "shares": shares}), flush=True
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    from launcher.config import schema

    schema.register()
    main(sys.argv[1])  # a preset of conf/strategy/, built as a run builds it
    from launcher.base.process import exit_now

    exit_now(0)  # as the launcher's own workers end: a gloo thread can abort the interpreter's teardown (SIGABRT)
