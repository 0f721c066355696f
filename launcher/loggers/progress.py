"""The progress line on the terminal: one line per logged step, rank 0's."""

from __future__ import annotations

import sys


class Progress:
    """A progress bar on rank 0 when it writes to a terminal, plain log lines otherwise."""

    def __init__(self, rank: int, total: int, enabled: bool) -> None:
        self.rank = rank
        self.bar = None
        if rank == 0 and enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict[str, float] | None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if metrics:
                self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", samples_s=f"{metrics['samples_per_s']:.0f}")
        elif self.rank == 0 and metrics:
            extra = f" | val_loss {metrics['val_loss']:.4f}" if "val_loss" in metrics else ""
            print(
                f"step {step} | loss {metrics['loss']:.4f}{extra} | lr {metrics['lr']:.2e} | "
                f"{metrics['step_time_s']:.3f} s/step | {_rate(metrics)}",
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rate(metrics: dict[str, float]) -> str:
    if "tokens_per_s" in metrics:
        return f"{metrics['tokens_per_s']:.0f} tok/s"
    return f"{metrics['samples_per_s']:.1f} samples/s"
