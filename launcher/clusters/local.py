"""No cluster: one machine, or nodes the user points at one another with rdzv.endpoint and rdzv.id."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from launcher.clusters import Job
from launcher.config import Derived


class Local:
    name = "local"

    def detected(self, env: Mapping[str, str]) -> bool:
        return True  # wherever no other environment recognises itself

    def shape(self, env: Mapping[str, str]) -> dict[str, tuple[int, str]]:
        return {}

    def job(self, rdzv: Any, derived: Derived, env: Mapping[str, str]) -> Job:
        return Job(self.name)

    def submission(self, argv: Sequence[str]) -> list[str]:
        return []

    def stopped(self, signum: int, previous: Callable[..., Any] | None) -> None:
        pass
