"""Strategies wrap a model and its optimizer for one parallel layout.

A strategy knows nothing of Hydra, logging or the command line: it receives plain values.
Every strategy implements the `Strategy` protocol in `strategies.base`; none inherits from another.
"""

from strategies.base import Layout, Placement, RunContext, Strategy

__all__ = ["Layout", "Placement", "RunContext", "Strategy"]
