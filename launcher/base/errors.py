"""The launcher's own errors, which every side raises and reads."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad value in the user's config; its message is one line naming the value and the fix."""


class Refused(RuntimeError):
    """A check every rank makes alike (one collective: the same answer everywhere) refused the run: told once, in its
    own words, not as each rank's failure in whatever phase it was."""


REFUSED = "refused: "
"""How a worker's report marks a refusal (`Refused`), for the launcher's one line (`launcher.parent.failures`)."""
