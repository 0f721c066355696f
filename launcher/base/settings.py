"""A built-in target's settings, read from its config node: one place for every key, the schema."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class Settings(SimpleNamespace):
    """The keys of a target's config node, as Hydra passes them to it, read by name (`data.path`) and never changed.

    Their defaults, types and meaning are the schema's alone (launcher/config/*_schema.py, schema.py): a built-in
    data source or logger takes `**keys` and restates none of them in a signature, so that a key added to a schema is
    one edit, there. A key the schema lacks was refused before start (`launcher.config.known`)."""

    def __getattr__(self, name: str) -> Any:  # only for a key that is not there
        raise AttributeError(f"{name} was not given: a built-in target takes every key its schema declares")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{name}: a target's settings are its config's, read-only")
