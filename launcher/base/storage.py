"""Where checkpoints live: a local folder (a `Path`, with fsync and atomic rename) or an fsspec URL (`Remote`:
`s3://bucket/prefix`, `gs://...`, any protocol whose package is installed).

`Remote` answers the few `Path` methods the checkpoint code calls (`/`, `name`, `parent`, `glob`, `stat`, `is_file`,
`read_text`, `open`, ...) through fsspec, so one code path reads both. What differs is said once, here:
- object stores have no atomic rename: a save is written in place (`step_N/`) and its manifest, written last, marks
  it complete (`launcher.checkpoint.format.is_partial`);
- an object is durable once its upload returns (no fsync), and there is no free space to check;
- every look at a listing reads the store afresh (fsspec caches listings; another rank or node writes meanwhile).

Credentials come only from where the protocol's library looks (for S3: the AWS_* variables, ~/.aws, the instance's
or pod's role; `AWS_ENDPOINT_URL` for an S3-compatible store), never from the config: a URL that carries any is
refused (`check_url`, and any password in a URL on the command line: `secret_in`), and every line or file that names
a URL names it `masked`.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^/\s@]*)@")
"""The part of a URL before its host that names a user, and maybe a password: `scheme://user:password@`."""
QUERY_SECRET = re.compile(r"([?&](?:password|passwd|pwd|sslpassword)=)[^&\s'\"]*", re.IGNORECASE)
"""A password in a URL's query (libpq takes `postgresql://host/db?password=...`)."""


def masked(text: str) -> str:
    """`text` with the user and password of every URL in it shown as `***` (`s3://***@bucket/run`): how a line, a
    log or a file names a URL."""
    return QUERY_SECRET.sub(r"\1***", USERINFO.sub(r"\1***@", text))


def secret_in(args: list[str]) -> str | None:
    """One line for the first argument holding a URL with a password in it (masked), or None: refused before
    anything runs, so that no log, config or line of the run can hold it."""
    for arg in args:
        if any(":" in m.group(2) for m in USERINFO.finditer(arg)) or QUERY_SECRET.search(arg):
            where = next((w for key, w in CREDENTIALS.items() if arg.lstrip("+~").startswith(key)), None) or (
                "the environment (for S3: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), ~/.aws, the instance's role "
                "or the service's own password file (e.g. ~/.pgpass)"
            )
            return f"{masked(arg)}: it carries credentials: give them in {where}, never the command line"
    return None


CREDENTIALS = {
    "logger.mlflow.": "MLflow's environment: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
    "MLFLOW_TRACKING_TOKEN)",
    "hydra.sweeper.storage=": "the database's own environment or password file (PostgreSQL: PGPASSWORD or ~/.pgpass)",
}
"""Where the credentials of a key's URL go, where its library reads them from somewhere of its own."""


class Remote:
    """A file or folder at an fsspec URL, with the `Path` methods the checkpoint code uses; printed `masked`."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    @property
    def fs(self) -> Any:
        """The protocol's filesystem (fsspec caches one per process; a forked worker gets its own)."""
        import logging

        from fsspec.core import url_to_fs

        for name in ("botocore", "aiobotocore", "s3fs"):  # where credentials were found: not for the terminal
            logging.getLogger(name).setLevel(logging.WARNING)
        return url_to_fs(self.url)[0]

    @property
    def path(self) -> str:
        """The URL without its protocol, as the filesystem names it."""
        return self.fs._strip_protocol(self.url)

    def __truediv__(self, name: str) -> Remote:
        return Remote(f"{self.url}/{name}")

    def __str__(self) -> str:
        return masked(self.url)

    def __repr__(self) -> str:
        return f"Remote({masked(self.url)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Remote) and other.url == self.url

    def __lt__(self, other: Remote) -> bool:
        return self.url < other.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        return Remote(self.url.rsplit("/", 1)[0])

    def is_relative_to(self, other: Remote | Path) -> bool:
        return isinstance(other, Remote) and (self.url + "/").startswith(other.url + "/")

    def _fresh(self) -> Any:
        fs = self.fs
        fs.invalidate_cache()  # another rank, node or run may have written since this process last looked
        return fs

    def glob(self, pattern: str) -> list[Remote]:
        """The children whose names match `pattern` (one level, as `Path.glob` of a plain name pattern)."""
        try:
            names = self._fresh().ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        children = (Remote(f"{self.url}/{name.rstrip('/').rsplit('/', 1)[-1]}") for name in names)
        return sorted(child for child in children if fnmatch.fnmatchcase(child.name, pattern))

    def iterdir(self) -> Iterator[Remote]:
        return iter(self.glob("*"))

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self._fresh().info(self.path)["size"]))

    def exists(self) -> bool:
        return bool(self._fresh().exists(self.path))

    def is_file(self) -> bool:
        return bool(self._fresh().isfile(self.path))

    def is_dir(self) -> bool:
        return bool(self._fresh().isdir(self.path))

    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.path))

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.path, bytes(data))

    def mkdir(self, parents: bool = True, exist_ok: bool = True) -> None:
        self.fs.makedirs(self.path, exist_ok=True)  # object stores: nothing (a prefix exists by its objects)

    def expanduser(self) -> Remote:
        return self

    def resolve(self) -> Remote:
        return self


Location = Path | Remote
"""A checkpoint file or folder: local or at a URL."""


def is_url(text: str) -> bool:
    """`scheme://...` other than `file://`: a location fsspec opens."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.isidentifier() and scheme != "file"


def location(text: str | Path) -> Location:
    """A checkpoint location from what a user or a config gives: a URL, or a local path (made absolute, `~` expanded;
    `file://` stripped)."""
    text = str(text)
    if is_url(text):
        return Remote(text)
    return Path(text.removeprefix("file://")).expanduser().absolute()


def checkpoints_of(trainer: Any, run_dir: Path) -> Location:
    """Where a run's checkpoints live: trainer.checkpoint_dir, or `<run dir>/checkpoints`."""
    given = trainer.get("checkpoint_dir") if hasattr(trainer, "get") else getattr(trainer, "checkpoint_dir", None)
    return location(given) if given else run_dir / "checkpoints"


def is_remote(where: Location) -> bool:
    return isinstance(where, Remote)


def inside(path: Location, folder: Location) -> bool:
    """`path` is `folder` or in it (both local, or both at URLs)."""
    return is_remote(path) == is_remote(folder) and path.is_relative_to(folder)  # type: ignore[arg-type]


def check_url(url: str) -> str | None:
    """Why `url` cannot hold checkpoints, in words, or None: a protocol fsspec does not know or whose package is
    not installed, credentials in the URL, a bucket that is not there (fsspec would create it) or cannot be read."""
    from urllib.parse import urlsplit

    import fsspec

    scheme = url.partition("://")[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as e:  # a known protocol whose package is missing: fsspec's message names it
        return f"the {scheme}:// protocol needs a package that is not installed ({str(e).splitlines()[0]})"
    except ValueError:
        return f"fsspec knows no protocol {scheme}://; use a local path or a URL such as s3://bucket/prefix"
    parts = urlsplit(url)
    if parts.username or parts.password:
        return "it carries credentials: give them in the environment, ~/.aws or the instance's role, never the config"
    where = Remote(url)
    try:
        fs = where._fresh()
        try:
            fs.ls(where.path, detail=False)  # the library's own error for credentials, permissions, the network
        except FileNotFoundError:  # a new prefix, or no bucket: fsspec would make the bucket at the first save
            bucket = fs.root_marker + where.path.lstrip("/").split("/")[0]
            if not fs.exists(bucket):
                return f"{scheme}://{bucket.lstrip('/')} does not exist (or these credentials cannot see it); create it"
    except Exception as e:  # credentials, network, permissions: the library's own words, in one line
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        return (
            f"it cannot be read ({type(e).__name__}: {reason}); credentials come from the environment (for S3: "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL for an S3-compatible store), ~/.aws or "
            "the instance's role"
        )
    return None


def write_file(where: Location, data: bytes) -> None:
    """Write a file of a checkpoint: locally flushed and fsynced; at a URL, durable once the upload returns."""
    if isinstance(where, Remote):
        where.write_bytes(data)
        return
    with open(where, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_durably(where: Location, text: str) -> None:
    """A reader sees the old file or the new one, never a torn one: locally a temporary file renamed over it (both
    fsynced); at a URL one upload (an object appears whole or not at all)."""
    if isinstance(where, Remote):
        where.write_bytes(text.encode())
        return
    from launcher.base.durable import write_durably as local

    local(where, text)


def remove(folder: Location, first: str = "") -> None:
    """Remove a folder, if there. At a URL its file `first` goes first (a checkpoint's manifest: a prefix half
    deleted is then partial, never complete)."""
    if isinstance(folder, Remote):
        fs = folder._fresh()
        for path in (f"{folder.path}/{first}", folder.path) if first else (folder.path,):
            try:
                fs.rm(path, recursive=True)
            except FileNotFoundError:
                pass
        return
    shutil.rmtree(folder, ignore_errors=True)
