"""Reading what others may have written: checkpoint folders and manifests are data, and nothing read can run code.

torch.distributed.checkpoint (DCP) reads a checkpoint in three ways, and each is replaced or checked here:
- `.metadata`: DCP's `FileSystemReader.read_metadata` unpickles it with a bare `pickle.load`, which runs whatever
  a crafted file names. `SafeReader` unpickles it with an allow-list: DCP's metadata classes, torch sizes, dtypes
  and layouts, paths; anything else is refused before it is constructed.
- non-tensor entries (optimizer hyperparameters): DCP's default planner uses `torch.load(weights_only=False)`;
  `WeightsOnly` reads them with `weights_only=True` (tensors and plain values only).
- tensors: DCP already reads them with `weights_only=True`.
Manifests are JSON, checked field by field (`launcher.checkpoint.format.read_manifest`), and every file a manifest
lists has its size and its xxh3-128 checksum there, which `format.damage` verifies before anything is read; RNG
files are read with `weights_only=True`.

Configs and `_target_`s, by contrast, are code: they name what to import and run.
"""

from __future__ import annotations

import pickle
from typing import Any

from launcher.base.storage import Location, is_remote

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # looks a torch.layout up by name, nothing else
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class UntrustedDataError(ValueError):
    """A file that is not the plain data it should be; the message is one line naming the file and what is wrong."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == (
            "builtins",
            "getattr",
        ):  # an enum member by name (how some Python 3.11 releases pickle it)
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent references are not allowed in checkpoint metadata")


def _enum_member(cls: Any, name: str) -> Any:
    """A member of an allowed enum by its name, and nothing else a `getattr` could reach (a class's methods)."""
    import enum

    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(
        f"getattr({getattr(cls, '__name__', cls)!r}, {name!r}) is not allowed in checkpoint "
        "metadata (only an enum member by name)"
    )


def read_metadata(path: Location) -> Any:
    """DCP's `Metadata` of the checkpoint folder `path`, through the allow-list unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with (path / ".metadata").open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # truncated, foreign or crafted: one line, never a traceback
        raise UntrustedDataError(f"checkpoint {path} has unreadable metadata ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UntrustedDataError(f"checkpoint {path} has metadata that is not DCP's ({type(metadata).__name__})")
    return metadata


def safe_reader(path: Location) -> Any:
    """A DCP storage reader for `path` (a local folder, or a URL through fsspec) that reads its metadata through
    `read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not exported by the package
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FsspecReader if is_remote(path) else FileSystemReader):  # type: ignore[misc]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # per-rank metadata files: not written by our saves
                raise UntrustedDataError(f"checkpoint {path}: per-rank metadata is not supported")
            metadata = read_metadata(path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def weights_only_planner() -> Any:
    """A DCP load planner that reads non-tensor entries with `torch.load(weights_only=True)`."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnly(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnly()


def dcp_load(state: dict[str, Any], path: Location, no_dist: bool = False) -> None:
    """Fill `state` in place from the checkpoint at `path` (collective unless `no_dist`), reading only data."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # without a process group DCP warns that it loads in one process: the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=safe_reader(path), planner=weights_only_planner(), no_dist=no_dist)
