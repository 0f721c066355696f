"""The configuration reference, generated from the typed schema: every key, its type, its default, its valid values and
what it means, read from the dataclasses themselves (a field's docstring is the string literal under it), so that no
key can be missing from it or described as it no longer is. `python -m launcher.config.reference` prints it as Markdown;
the docs site embeds it (docs/hooks.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from typing import Any

from omegaconf import MISSING


@cache
def field_docs(cls: type) -> dict[str, str]:
    """A dataclass's field docstrings: the string literal right under each annotated field, else the `doc` its
    declaration carries (a field several schemas share, `launcher.config.ranges`), and the class's own docstring under
    the key ""."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {"": " ".join((ast.get_docstring(tree.body[0]) or "").split())}  # type: ignore[arg-type]
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("doc") and f.name not in docs:
            docs[f.name] = " ".join(f.metadata["doc"].split())
    return docs


def rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, valid values, meaning) of every field of a schema, nested schemas flattened."""
    out = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            out += rows(type(default), f"{key}.")
            continue
        valid = f.metadata.get("range")
        shown = "required" if default is MISSING else _value(default)
        out.append((key, str(f.type), shown, valid.rule if valid is not None else "", docs.get(f.name, "")))
    return out


def _value(value: Any) -> str:
    if hasattr(value, "value") and hasattr(value, "name"):  # an Enum member
        return str(value.value)
    return "null" if value is None else str(value).replace("True", "true").replace("False", "false")


def option_schemas() -> dict[str, dict[str, type]]:
    """Each group's options (its YAML files) and the schema each one extends (the `base_*` its defaults name)."""
    from importlib import resources

    import yaml

    from launcher.config.groups import choices
    from launcher.config.schema import SCHEMAS

    out: dict[str, dict[str, type]] = {}
    for group, options in choices().items():
        if group not in SCHEMAS:
            continue
        for option in options:
            text = (resources.files("launcher.conf") / group / f"{option}.yaml").read_text()
            bases = [d for d in (yaml.safe_load(text) or {}).get("defaults", []) if str(d).startswith("base_")]
            if bases:
                out.setdefault(group, {})[option] = SCHEMAS[group][bases[0]]
    return out


def markdown() -> str:
    """The whole reference: the run's own keys, then each group's options."""
    from launcher.config.schema import LaunchConfig

    lines = ["## The run", "", *_table([r for r in rows(LaunchConfig) if r[0] not in _GROUPS])]
    for group, options in option_schemas().items():
        lines += ["", f"## {group}", ""]
        for option, schema in options.items():
            about = field_docs(schema)[""]
            lines += [f"### {group}={option}", "", *([about, ""] if about else []), *_table(rows(schema, f"{group}."))]
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


_GROUPS = ("strategy", "model", "data", "optim", "logger")


def _table(found: list[tuple[str, str, str, str, str]]) -> list[str]:
    out = ["| key | type | default | valid | meaning |", "|---|---|---|---|---|"]
    for key, kind, default, valid, doc in found:
        cells = [f"`{key}`", kind, f"`{default}`" if default else "", valid, doc]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return out


if __name__ == "__main__":
    print(markdown(), end="")
