"""A library's names outside its public API, checked before use: what an adapter module calls, overrides or wraps,
each with the parameters the adapter expects it to take.

One adapter module per library holds every such name (torch: `launcher.adapters.torch_private`; DeepSpeed:
`strategies.deepspeed.zero`), names the release it was checked against, and checks its names before it relies on
them: a release that renamed one, or changed what it takes, fails in one line naming it, the installed version and
what to do, where it would otherwise hang or drop a fault report without a word.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


class LibraryChanged(RuntimeError):
    """An installed library no longer has a name, or a signature, that an adapter relies on: one line."""


@dataclass(frozen=True)
class Private:
    """A name an adapter relies on, as `module:attribute.path`, and the parameters it takes (None: it exists)."""

    path: str
    parameters: tuple[str, ...] | None = None


def resolve(path: str) -> Any:
    """The object at `module:attribute.path`; AttributeError or ImportError where it is gone."""
    module, _, attributes = path.partition(":")
    found: Any = importlib.import_module(module)
    for name in attributes.split(".") if attributes else ():
        found = getattr(found, name)
    return found


def parameters(function: Any) -> tuple[str, ...]:
    """The names of `function`'s parameters, or of the function a decorator hides: one kept as `__wrapped__`, or the
    one function kept in the closure of a wrapper that takes `(*args, **kwargs)` (DeepSpeed's `timed_op`)."""
    function = inspect.unwrap(function)
    names = tuple(inspect.signature(function).parameters)
    if names == ("args", "kwargs"):
        inner = [c.cell_contents for c in getattr(function, "__closure__", None) or () if _is_function(c)]
        if len(inner) == 1:
            return parameters(inner[0])
    return names


def _is_function(cell: Any) -> bool:
    try:
        return inspect.isfunction(cell.cell_contents)
    except ValueError:  # an empty cell
        return False


def check(library: str, checked_against: str, names: Iterable[Private], adapter: str, where: Any = None) -> None:
    """Raise LibraryChanged, naming the first of `names` that is gone or takes other parameters, the installed
    version of `library` and what to do. `where`: resolve the names in it (a stand-in, in the tests), not in the
    installed library."""
    for name in names:
        try:
            found = resolve(name.path) if where is None else _attribute(where, name.path)
            problem = None
            if name.parameters is not None and (taken := parameters(found)) != name.parameters:
                problem = f"takes ({', '.join(taken)}), not ({', '.join(name.parameters)})"
        except (ImportError, AttributeError):
            problem = "is gone"
        except (TypeError, ValueError):  # a callable without a signature
            problem = "has no signature to check"
        if problem:
            raise changed(library, checked_against, name.path, problem, adapter)


def changed(library: str, checked_against: str, path: str, problem: str, adapter: str) -> LibraryChanged:
    """The one line for `path` of `library` that is not what `adapter` expects: what is wrong with it, the installed
    version, the version checked against, and what to do."""
    installed = _version(library)
    return LibraryChanged(
        f"{library} {installed}: {path} {problem}; {adapter} was checked against {library} {checked_against}: "
        f"install {library}=={checked_against}, or update {adapter} for {library} {installed} "
        "(docs/contributing.md, a new release of a library)"
    )


def _attribute(where: Any, path: str) -> Any:
    found = where
    for name in path.partition(":")[2].split("."):
        found = getattr(found, name)
    return found


def _version(library: str) -> str:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
