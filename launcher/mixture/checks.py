"""data=mix's check before any worker starts (called by `launcher.parent.checks`): every source of each split built,
not empty, the first samples of every two sources made one batch by the mixture's collate, and the first micro-batch
of step 1 read as a rank reads it. Each refusal is one line naming the source and the fix."""

from __future__ import annotations

from itertools import islice
from typing import Any

from launcher.base.errors import ConfigError


def check_mixture(frozen: Any, collate: Any) -> Any:
    """The train split's first micro-batch (`batch.micro_size` samples), or ConfigError (one line)."""
    from launcher.data.collate import collate_name, describe
    from launcher.mixture.mix import Mixture
    from launcher.mixture.weights import MixError

    data, name = frozen.data, collate_name(frozen.data.get("collate"))
    B, micro = int(frozen.batch.global_size), int(frozen.batch.micro_size)
    first = None
    for split in ["train"] + (["val"] if frozen.trainer.eval_every > 0 else []):
        try:
            mixture = Mixture(split, data.sources, data.get("schedule"), data.get("on_end", "stop"))
        except MixError as e:
            raise ConfigError(str(e)) from e
        except Exception as e:
            cause = e.__cause__ or e
            raise ConfigError(
                f"data.sources: {' '.join(str(cause).split())[:300]} ({type(cause).__name__}); fix that source's keys "
                f"(its {split} split could not be built)"
            ) from e
        samples = {part.name: _first(part, split) for part in mixture.parts}
        names = list(samples)
        for other in names[1:]:
            pair = [samples[names[0]], samples[other]]
            try:
                collate(pair)
            except Exception as e:
                message = " ".join(str(e).split())[:200] or type(e).__name__
                raise ConfigError(
                    f"data.sources.{names[0]} and data.sources.{other} give samples that {name} cannot make one batch "
                    f"of ({describe(pair[0])}; {describe(pair[1])}: {message}); give every source the same keys and "
                    "shapes (format, seq_len), or a collate that makes them one: data.collate._target_=..."
                ) from e
        if first is None:  # step 1 as training reads it, its sources' epochs and data.on_end as they are
            from launcher.mixture.mix import _MixReader, fresh

            source = mixture.source_for(B, int(frozen.seed), collate, f"the {split} split")
            reader = _MixReader(source, fresh(mixture), 0, 1, 0, 1, B // micro, quiet=True)
            first = next(iter(reader), ([None],))[0][0]
            if first is None:
                raise ConfigError(
                    f"data: the mixture's {split} split gives no full global batch of {B}; give its sources samples"
                )
    return first


def _first(part: Any, split: str) -> Any:
    """A source's first sample; ConfigError where it has none."""
    try:
        found = list(islice(iter(part.dataset), 1)) if part.stream else ([part.dataset[0]] if len(part.dataset) else [])
    except Exception as e:
        raise ConfigError(f"data.sources.{part.name}: its {split} split does not read ({e}); fix that source") from e
    if not found:
        raise ConfigError(
            f"data.sources.{part.name}: its {split} split holds no sample; give it samples, or leave it "
            "out of the mixture"
        )
    return found[0]


def check_mixture_resume(frozen: Any, checkpoint: Any, manifest: dict[str, Any]) -> None:
    """A checkpoint (its `manifest`) resumed with data it cannot be honoured under: one written by data=mix resumed
    with other data (its position counts the mixture's samples, not the data's), or one of other data resumed by a
    mixture (it records no source's position). ConfigError (one line); other changes of a mixture are said by the
    worker."""
    from launcher.mixture.mix import MIX_TARGET

    mixed = isinstance(manifest.get("stream"), dict) and "mix" in manifest["stream"]
    mixing = str(frozen.data._target_) == MIX_TARGET
    if manifest["step"] and mixed and not mixing:
        raise ConfigError(
            f"resume={checkpoint} was written by data=mix (its positions are each source's); resume it with that "
            "mixture (data=mix and its sources), or start this data afresh"
        )
    if manifest["step"] and mixing and not mixed:
        raise ConfigError(
            f"resume={checkpoint} was not written by data=mix (it records no source's position); resume it with the "
            "data it was written with, or start this mixture afresh"
        )
