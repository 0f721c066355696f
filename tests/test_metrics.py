"""The logged figures' declarations (`launcher/metrics.py`): read by the runner and the README alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.metrics import METRICS, declared, over_ranks, table

README = Path(__file__).parent.parent / "README.md"


@pytest.mark.unit
def test_the_readme_table_is_the_declarations() -> None:
    text = README.read_text()
    start, end = text.index("<!-- metrics table -->\n"), text.index("<!-- end of the metrics table -->")
    assert text[start:end].split("\n", 1)[1].strip() == table(), "run: python -m launcher.metrics"


@pytest.mark.unit
def test_each_figure_is_reduced_over_ranks_as_declared() -> None:
    """Two ranks' figures, reduced by hand as the all-reduces would: each declared kind goes to its own reduction,
    in one call each, and the others stay this rank's."""
    ranks = [
        {"loss": 1.0, "rss_bytes": 10.0, "comm_calls": 1.0, "val_loss": 0.5},
        {"loss": 2.0, "rss_bytes": 30.0, "comm_calls": 1.0, "val_loss": 0.25},
    ]
    calls: list[str] = []

    def reduction(kind: str, combine: object) -> object:
        def reduce(values: list[float]) -> list[float]:
            calls.append(kind)
            names = [n for n in ranks[0] if METRICS[n].reduction == kind]
            assert len(values) == len(names)
            return [combine(r[n] for r in ranks) for n in names]  # type: ignore[operator]

        return reduce

    out = over_ranks(ranks[0], reduction("sum", sum), reduction("max", max))  # type: ignore[arg-type]
    assert out == {"loss": 3.0, "rss_bytes": 30.0, "comm_calls": 1.0, "val_loss": 0.75}
    assert sorted(calls) == ["max", "sum"]
    assert over_ranks({"lr": 0.1}, reduction("sum", sum), reduction("max", max)) == {"lr": 0.1}  # type: ignore[arg-type]


@pytest.mark.unit
def test_a_figure_nobody_declared_is_refused() -> None:
    with pytest.raises(KeyError, match="'comm_secret' has no declaration in launcher/metrics.py"):
        declared("comm_secret")
