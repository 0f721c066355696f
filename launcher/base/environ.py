"""Environment variables set for a while, and put back as they were."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


def restore(saved: Mapping[str, str | None]) -> None:
    """Each variable of `saved` back to its value (None: unset, as it was)."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def environ(settings: Mapping[str, str]) -> Iterator[None]:
    """The variables of `settings` set for the block, each put back as it was after it (an error too)."""
    saved = {key: os.environ.get(key) for key in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        restore(saved)
