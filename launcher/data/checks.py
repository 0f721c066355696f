"""The checks of the data the launcher makes before any worker starts: its own preparation (data=text tokenizes
here), the collate, both splits built and their first samples collated into a batch, the token ids against the
model's vocabulary (which the launcher passes in). Each failure is a ConfigError (one line); `launcher.parent.checks`
runs them in order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.errors import ConfigError, failure


def prepare_data(frozen: DictConfig) -> None:
    """The data target's own `prepare(**keys)`, where it has one, once, here, before any worker starts (data=text
    tokenizes its files into the cache its workers map), whatever `+data._check_` says."""
    from launcher.base.targets import locate
    from launcher.data.builtin import LOADER_KEYS

    prepare = getattr(locate(str(frozen.data._target_)), "prepare", None)
    if not callable(prepare):
        return
    keys = {k: v for k, v in OmegaConf.to_container(frozen.data).items() if k not in LOADER_KEYS and k != "_target_"}
    try:
        prepare(**keys)
    except ConfigError:
        raise
    except Exception as e:
        raise failure("data", e, "fix the data.* values (the data could not be prepared)") from e


def check_datasets(frozen: DictConfig, mixture: Callable[[DictConfig, Any], Any] | None = None) -> Any:
    """The collate built; both splits built and non-empty (a stream: at least one global batch); the first samples of
    each collated by the run's collate into a batch that holds tensors. Returns the train split's first micro-batch
    (`batch.micro_size` samples, as a rank's forward gets them), or None when the data opts out of the check
    (`+data._check_=false`; the collate is still built). `mixture`: data=mix's own check, which checks its sources
    itself (`launcher.mixture.checks.check_mixture`), given by the caller where the data is a mixture."""
    from launcher.data.builtin import BUILT_IN_DATA, SKIP_CHECK, build_dataset
    from launcher.data.collate import collate_name, describe, tensors_in
    from launcher.data.sources import is_stream

    collate = _collate(frozen.data.get("collate"))
    if frozen.data.get(SKIP_CHECK) is False:
        return None
    if mixture is not None:
        return mixture(frozen, collate)
    splits = ["train"] + (["val"] if frozen.trainer.eval_every > 0 else [])
    global_size, first = int(frozen.batch.global_size), None
    for split in splits:
        try:
            dataset = build_dataset(frozen.data, split)
        except Exception as e:
            if isinstance(e.__cause__ or e, ConfigError):  # the data's own one line (data=hf names what it has)
                raise (e.__cause__ or e) from e
            raise failure("data", e, f"fix the data.* values (the {split} split could not be built)") from e
        count = int(frozen.batch.micro_size) if first is None else 1
        if is_stream(dataset):
            items = _first_of_stream(dataset, split, global_size, collate)[:count]
        else:
            items = _first_of_map(frozen, dataset, split, global_size, count, BUILT_IN_DATA)
        name = collate_name(frozen.data.get("collate"))
        try:
            batch = collate(items)
        except Exception as e:
            message = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(
                f"data: {name} fails on the first {len(items)} sample(s) of the {split} split (each "
                f"{describe(items[0])}): {message} ({type(e).__name__}); fix the samples or the collate"
            ) from e
        if not tensors_in(batch):
            raise ConfigError(
                f"data: {name} returned {describe(batch)} for the first micro-batch of the {split} split, with no "
                "tensor in it (nor an object with .to(device)): the runner has nothing to move to the device; "
                "return tensors, e.g. a dict of them"
            )
        first = batch if first is None else first
    return first


def _collate(node: Any) -> Any:
    """The collate `data.collate` names, built as each rank builds it; ConfigError (one line) where it does not import
    or does not build."""
    from launcher.data.collate import build_collate

    try:
        return build_collate(node)
    except ImportError as e:
        reason = ([line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__])[-1]
        raise ConfigError(
            f"data.collate._target_={node._target_} cannot be imported ({reason}); fix the path or install its package"
        ) from e
    except Exception as e:
        cause = e.__cause__ or e
        message = " ".join(str(cause).split())[:300] or type(cause).__name__
        raise ConfigError(
            f"data.collate._target_={node._target_} does not build: {message} ({type(cause).__name__}); fix its keys "
            "(+data.collate.KEY=VALUE) or name a function, or a class whose instances take the list of samples"
        ) from e


def _first_of_stream(dataset: Any, split: str, global_size: int, collate: Any) -> list[Any]:
    """A stream's first global batch of samples; ConfigError where it has fewer, or is no stream a run can read
    twice."""
    from launcher.data.sources import Stream

    try:
        samples = Stream(dataset, global_size, collate, f"data (the {split} split)").first(global_size)
    except TypeError as e:
        raise ConfigError(f"data: {e}") from e
    except Exception as e:
        raise failure("data", e, f"fix the dataset (its {split} stream does not read)") from e
    if len(samples) < global_size:
        what = "no sample" if not samples else f"{len(samples)} sample(s), fewer than one global batch"
        fix = "set trainer.eval_every=0 or give a longer validation stream" if split == "val" else "give it samples"
        raise ConfigError(
            f"data: the {split} split is a stream that yields {what} (batch.global_size={global_size}); {fix}"
            + (" or lower batch.global_size" if samples else "")
        )
    return samples


def _first_of_map(
    frozen: DictConfig, dataset: Any, split: str, global_size: int, count: int, built_in: tuple[str, ...]
) -> list[Any]:
    """A map-style dataset's first `count` samples; ConfigError for one without a length, an empty one, or a built-in
    one smaller than a global batch."""
    try:
        size = len(dataset)
    except TypeError as e:
        raise ConfigError(
            f"data: the {split} split ({type(dataset).__name__}) has neither a length nor an __iter__; return a "
            "map-style dataset (__len__, __getitem__) or an iterable one (a torch IterableDataset)"
        ) from e
    if size == 0:
        fix = "raise data.val_fraction, or set trainer.eval_every=0" if split == "val" else "give it samples"
        raise ConfigError(f"data: the {split} split is empty (0 samples); {fix}")
    if split == "train" and size < global_size and str(frozen.data._target_).startswith(built_in):
        seq = f" of data.seq_len={frozen.data.seq_len}" if "seq_len" in frozen.data else ""
        raise ConfigError(
            f"data: the train split holds {size} samples{seq}, fewer than one global batch (batch.global_size="
            f"{global_size}): a step would see a sample twice; give more data or lower batch.global_size"
            + (" or data.seq_len" if seq else "")
        )
    try:
        return [dataset[i] for i in range(min(size, count))]
    except Exception as e:
        raise failure("data", e, f"fix the dataset (the {split} split's first samples do not read)") from e


def check_vocabulary(frozen: DictConfig, vocab: int | None) -> None:
    """The built-in token data's largest id against the model's vocabulary, `vocab` ids (None: the model says none;
    user data is checked batch by batch in the workers, `launcher.data.builtin.check_token_ids`)."""
    from launcher.data.builtin import BUILT_IN_DATA, SKIP_CHECK, build_dataset

    needed = frozen.data.get("vocab_size") if "tokenizer" in frozen.data else None
    if vocab is not None and needed is not None and vocab < needed:
        raise ConfigError(
            f"the model embeds {vocab} ids but data.tokenizer={frozen.data.tokenizer} gives {needed} "
            f"(data.vocab_size); give the model at least {needed}: model.vocab_size=${{data.vocab_size}} (the built-in "
            "GPT's default), or a transformers model's config, e.g. +model.config.vocab_size=${data.vocab_size}"
        )
    if vocab is None or not str(frozen.data._target_).startswith(BUILT_IN_DATA) or frozen.data.get(SKIP_CHECK) is False:
        return
    for split in ["train"] + (["val"] if frozen.trainer.eval_every > 0 else []):
        try:
            bound = getattr(build_dataset(frozen.data, split), "largest_id", None)
        except Exception:  # the dataset checks say why it does not build
            return
        if bound is None:
            return
        largest = bound()
        if largest >= vocab:
            where = f"data.path={frozen.data.path}" if "path" in frozen.data else f"data={frozen.data._target_}"
            raise ConfigError(
                f"{where} holds token id {largest}, but the model's vocabulary has {vocab} ids (0..{vocab - 1}); "
                f"raise the model's vocab_size to at least {largest + 1}, or check data.dtype and the tokenizer"
            )
