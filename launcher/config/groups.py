"""The config groups and their options: the YAML files of conf/ (the group is the registry)."""

from __future__ import annotations


def choices() -> dict[str, list[str]]:
    """Each config group's options: its YAML files (the schemas stored under it are not choices)."""
    from importlib import resources

    root = resources.files("launcher.conf")
    return {
        group.name: sorted(f.name.removesuffix(".yaml") for f in group.iterdir() if f.name.endswith(".yaml"))
        for group in sorted(root.iterdir(), key=lambda g: g.name)
        if group.is_dir() and not group.name.startswith("_")
    }
