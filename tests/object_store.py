"""A real S3 protocol server on loopback for the object-storage tests: moto's, in a thread of the test process (as
s3fs's own tests use it), with the environment a run finds its credentials and endpoint in."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from launcher.base.environ import environ

BUCKET = "launch-ckpt"
SECRET = "s3cret-never-written-9f3a"
"""The secret access key the runs get from their environment: no file of a run and no line it prints holds it."""


@dataclass(frozen=True)
class S3:
    env: dict[str, str]
    """AWS_* variables: dummy credentials, the loopback endpoint, and no instance-metadata lookups."""

    def fs(self) -> Any:
        """A fresh s3fs filesystem of this server (no listing cache)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"


@contextmanager
def s3_server() -> Iterator[S3]:
    """moto's S3 server on 127.0.0.1 at a free port, a bucket in it, and this process's environment pointed at it
    (restored at the end)."""
    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "launch-test",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    # fsspec keeps one filesystem per process and arguments, made with the environment of its day: a run in this
    # process after an earlier server's would reach that server's (closed) port.
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with environ(env):
            s3 = S3(env)
            s3.fs().makedirs(BUCKET, exist_ok=True)  # moto keeps its buckets per process, across its servers
            yield s3
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()
