"""MkDocs hooks: the pages' generated parts, made from the code at build time, so that they cannot go stale: the
configuration reference (`launcher.config.reference`, from the typed schema) and the table of logged figures
(`launcher.base.metrics`, from their declarations)."""

from __future__ import annotations

from typing import Any

MARKERS = {
    "<!-- configuration reference -->": "launcher.config.reference:markdown",
    "<!-- metrics table -->": "launcher.base.metrics:table",
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    import importlib

    for marker, where in MARKERS.items():
        if marker in markdown:
            module, function = where.split(":")
            markdown = markdown.replace(marker, getattr(importlib.import_module(module), function)())
    return markdown
