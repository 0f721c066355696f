"""The launcher's own errors, which every side raises and reads."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad value in the user's config; its message is one line naming the value and the fix."""


class Refused(RuntimeError):
    """A check every rank makes alike (one collective: the same answer everywhere) refused the run: told once, in its
    own words, not as each rank's failure in whatever phase it was."""


REFUSED = "refused: "
"""How a worker's report marks a refusal (`Refused`), for the launcher's one line (`launcher.elastic.failures`)."""


def failure(group: str, e: BaseException, fix: str) -> ConfigError:
    """A check's one line for an exception raised by what it built (`group`: data, model, optim, logger): its cause's
    message, its type, and the fix."""
    cause = e.__cause__ or e
    message = " ".join(str(cause).split()) or type(cause).__name__
    return ConfigError(f"{group}: {message} ({type(cause).__name__}); {fix}")
