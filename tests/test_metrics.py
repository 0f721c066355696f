"""The logged figures' declarations (`launcher/base/metrics.py`): read by the runner and the docs alike (the docs'
table is made from them: tests/test_docs.py)."""

from __future__ import annotations

import pytest

from launcher.base.metrics import METRICS, declared, over_ranks


@pytest.mark.unit
def test_each_figure_is_reduced_over_ranks_as_declared() -> None:
    """Two ranks' figures, gathered as the collective would (a row per rank): each declared kind reduced its own way,
    in one collective for all of them, the counts summed and every rank's own values beside them; the others stay
    this rank's."""
    ranks = [
        {"loss": 1.0, "rss_bytes": 10.0, "comm_calls": 1.0, "val_loss": 0.5, "lr": 0.1, "compute_s_rank": 0.2},
        {"loss": 2.0, "rss_bytes": 30.0, "comm_calls": 1.0, "val_loss": 0.25, "lr": 0.2, "compute_s_rank": 0.7},
    ]
    sums, each = [[100.0], [28.0]], [[0.5, 0.25], [0.0, 0.75]]
    calls: list[list[float]] = []

    def gather(values: list[float]) -> list[list[float]]:
        calls.append(values)
        names = [n for n in ranks[0] if METRICS[n].reduction in ("sum", "max", "argmax")]
        assert values == [*(ranks[0][n] for n in names), *sums[0], *each[0]]
        return [[*(r[n] for n in names), *s, *e] for r, s, e in zip(ranks, sums, each)]

    out, summed, rows = over_ranks(ranks[0], gather, sums=sums[0], each=each[0])
    assert out == {"loss": 3.0, "rss_bytes": 30.0, "comm_calls": 1.0, "val_loss": 0.75, "lr": 0.1, "compute_s_rank": 1}
    assert summed == [128.0] and rows == each and len(calls) == 1  # one collective
    assert over_ranks({"lr": 0.1}, gather) == ({"lr": 0.1}, [], []) and len(calls) == 1  # nothing to reduce: none
    tie = over_ranks({"wait_s_rank": 0.5}, lambda v: [v, v, v])[0]
    assert tie == {"wait_s_rank": 0}  # equal ranks: the lowest


@pytest.mark.unit
def test_a_figure_nobody_declared_is_refused() -> None:
    with pytest.raises(KeyError, match="'comm_secret' has no declaration in launcher/base/metrics.py"):
        declared("comm_secret")
