"""A plain, hand-written torchrun DDP script: the baseline `launch` is measured against.

torchrun --nproc_per_node 2 bench/plain_ddp.py --steps 40 --global-size 32 --micro-size 4 --seq-len 128
Prints one JSON line (rank 0): wall-clock time of the first optimizer step and per-window step times.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from launcher.models.gpt import GPT


def param_groups(model: torch.nn.Module) -> list[dict]:
    """The launcher's default param groups, written out for this model: no weight decay on biases, norms and
    embeddings (the head shares the token embedding's weight), optim.weight_decay on every other parameter."""
    kept = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.Embedding))]
    exempt = {id(p) for m in kept for p in m.parameters(recurse=False)}
    exempt |= {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    params = list(model.parameters())  # a tied parameter once
    return [
        {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0},
        {"params": [p for p in params if id(p) not in exempt]},
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-size", type=int, default=32)
    p.add_argument("--micro-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--window", type=int, default=5)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    accumulation = a.global_size // (a.micro_size * world)
    torch.manual_seed(1337)
    model = DistributedDataParallel(GPT(n_layer=4, n_head=4, n_embd=128, vocab_size=256, block_size=a.seq_len))
    optimizer = torch.optim.AdamW(
        param_groups(model.module), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )  # the launcher's AdamW on the CPU in fp32: its fused kernel, its default groups
    tokens = torch.randint(0, 256, (16384, a.seq_len + 1), generator=torch.Generator().manual_seed(0))

    first_step_at, windows, start = None, [], time.perf_counter()
    for step in range(a.steps):
        for k in range(accumulation):
            i = (step * a.global_size + (rank * accumulation + k) * a.micro_size) % len(tokens)
            batch = tokens[i : i + a.micro_size]
            with model.no_sync() if k < accumulation - 1 else nullcontext():
                loss = model(batch[:, :-1], batch[:, 1:])["loss"] / accumulation
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if first_step_at is None:
            first_step_at = time.time()
        if (step + 1) % a.window == 0:
            windows.append((time.perf_counter() - start) / a.window)
            start = time.perf_counter()
    if rank == 0:
        print(json.dumps({"first_step_at": first_step_at, "window_step_times": windows}), flush=True)
    del model, optimizer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
