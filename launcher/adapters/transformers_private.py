"""Every name of transformers' that the launcher relies on beyond its public API, checked against transformers
5.25.0.

A model the user's function builds with `from_pretrained` inside (a PEFT model over a pretrained one) is built on the
meta device from the folder's config alone (`launcher.models.meta`): inside `pretrained_from_config`,
`PreTrainedModel.from_pretrained` builds the architecture its config names (`_from_config`, which transformers' own
`AutoModel.from_config` calls), reading no weights, and is restored when the block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from strategies.checked import Private, changed, check

CHECKED_AGAINST = "5.25.0"
ADAPTER = "launcher/adapters/transformers_private.py"
MODEL = "transformers.modeling_utils:PreTrainedModel"
NAMES = (Private(f"{MODEL}._from_config", ("config", "kwargs")),)  # a classmethod: bound, without cls


def check_transformers(where: Any = None) -> None:
    """LibraryChanged, in one line, where the installed transformers lacks what `pretrained_from_config` relies on:
    `_from_config`, and a `from_pretrained` of PreTrainedModel's own (the one the block puts back)."""
    from transformers import PreTrainedModel

    check("transformers", CHECKED_AGAINST, NAMES, ADAPTER, where)
    model = PreTrainedModel if where is None else where.PreTrainedModel
    if not isinstance(vars(model).get("from_pretrained"), classmethod):
        raise changed(
            "transformers", CHECKED_AGAINST, f"{MODEL}.from_pretrained", "is not its own classmethod", ADAPTER
        )


@contextmanager
def pretrained_from_config() -> Iterator[None]:
    """Inside the block, `from_pretrained(path_or_name, *args, config=None, **kwargs)` of any transformers model
    builds the architecture of `config` (a PretrainedConfig, or the path or name of one; else `path_or_name`'s)."""
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    check_transformers()

    def from_config(cls: Any, path: Any, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        config = config if isinstance(config, PretrainedConfig) else AutoConfig.from_pretrained(str(config or path))
        return cls._from_config(config)

    original = vars(PreTrainedModel)["from_pretrained"]
    PreTrainedModel.from_pretrained = classmethod(from_config)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original  # type: ignore[method-assign]
