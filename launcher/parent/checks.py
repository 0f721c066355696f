"""The parent's checks of a frozen config, before any worker starts: each failure is a ConfigError (one line).

They take the model already built on the meta device (`launcher.models.meta`), so nothing here builds it again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from launcher.config import ConfigError
from launcher.config.context import outside_moe_blocks
from launcher.config.identity import sweep_identity
from launcher.config.optim_schema import RECIPE_KEYS
from launcher.parent.optim_checks import check_optimizer

if TYPE_CHECKING:
    from launcher.base.storage import Location


def check_resume(frozen: DictConfig, run_dir: Path, model: Any) -> Location | None:
    """The checkpoint `resume=` names (a local path or a URL), checked against the model's shapes; None when there is
    none. trainer.checkpoint_dir, when set, is checked first (`check_folder`)."""
    from launcher.base.storage import checkpoints_of
    from launcher.checkpoint.format import CheckpointError
    from launcher.checkpoint.loading import check_fits, check_folder, find_resume

    try:
        identity = {"config_hash": frozen.job.config_hash, "sweep_dir": frozen.job.get("sweep_dir")}
        if identity["sweep_dir"]:  # a sweep's job: the same job of an earlier sweep, by its overrides
            identity["overrides"] = sweep_identity(frozen.job.overrides)
        checkpoints = checkpoints_of(frozen.trainer, run_dir) if frozen.trainer.get("checkpoint_dir") else None
        if checkpoints is not None:  # trainer.checkpoint_dir: reachable, and this run's
            check_folder(checkpoints, identity)
        found = find_resume(frozen.resume, run_dir, identity, checkpoints)
        if found is not None:
            check_fits(found, model)
            _check_steps_left(found, frozen.trainer.max_steps)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e
    if frozen.resume == "auto":
        print(f"launch: resume=auto: {f'resuming from {found}' if found else 'no earlier checkpoint, starting fresh'}")
    return found


def _check_steps_left(checkpoint: Location, max_steps: int) -> None:
    """A checkpoint at or past trainer.max_steps leaves nothing to train: refused, not a run that says nothing."""
    from launcher.checkpoint.format import read_manifest
    from launcher.checkpoint.untrusted import UntrustedDataError

    try:
        step = read_manifest(checkpoint)["step"]
    except UntrustedDataError as e:
        raise ConfigError(f"{e}; resume from another one") from e
    if step >= max_steps:
        raise ConfigError(
            f"resume={checkpoint} is at step {step}, and trainer.max_steps={max_steps} leaves nothing to train; "
            f"raise trainer.max_steps above {step}"
        )


# What the launcher itself passes to each group's target, besides the keys in its config node.
PASSED_BY_THE_LAUNCHER = {
    "strategy": (),
    "model": (),
    "data": ("split", "role", "workers", "collate"),  # the loader's keys (LOADER_KEYS), never passed on
    "optim": ("params", *RECIPE_KEYS),
    "logger": ("run_config", "run_dir"),
}


def check_keys(frozen: DictConfig) -> None:
    """Every key of a target's config node (nested targets too) must be a parameter it takes: a model of your own
    under the built-in GPT's keys is a one-line error naming the keys and the fix, not a TypeError in a worker."""
    from launcher.config import target_nodes

    for group, passed in PASSED_BY_THE_LAUNCHER.items():
        for path, node in target_nodes(frozen, group):
            _check_node_keys(node, path, group, passed)


def _check_node_keys(node: Any, path: str, group: str, passed: tuple[str, ...] = ()) -> None:
    import inspect

    from launcher.base.targets import locate

    if not isinstance(node, DictConfig) or node.get("_target_") is None:  # no target (data.collate unset)
        return
    target = str(node._target_)
    given = [str(k) for k in node if not str(k).startswith("_")]
    for key in given:
        _check_node_keys(node.get(key), f"{path}.{key}", group)
    try:
        parameters = inspect.signature(locate(target)).parameters.values()
    except (ImportError, TypeError, ValueError):  # not importable (derive says so) or no signature to read
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return
    names = {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    unknown = sorted(k for k in given if k not in names and k not in passed)
    if not unknown:
        return
    takes = ", ".join(sorted(names - set(passed))) or "nothing else"
    keys = ", ".join(f"{path}.{k}" for k in unknown)
    if path == group and group in ("model", "data"):
        fix = f"use {group}=custom {group}._target_={target}, then add its own keys with +{group}.KEY=VALUE"
    else:
        fix = f"remove them (~{path}.{unknown[0]}) or name a target that takes them"
    raise ConfigError(f"{path}._target_={target} does not take {keys} (it takes: {takes}); {fix}")


def check_built(frozen: DictConfig, model: Any) -> list[str] | None:
    """Build in the parent what the workers will build, and refuse in one line what fails: the optimizer over the
    model's (meta) parameters, the data's own preparation (data=text tokenizes here), both datasets and their first
    samples, a forward and backward of one micro-batch on the meta device, the logger's settings, the vocabulary.
    Nothing here allocates a model's memory. Returns the trainable parameters that got no gradient in that backward
    (none of a mixture-of-experts block's: every strategy gives those one), or None when it could not run."""
    print(check_optimizer(frozen, model), flush=True)
    _prepare_data(frozen)
    sample = _check_datasets(frozen)
    no_grad = _check_forward(frozen, model, sample) if sample is not None else None
    _check_logger(frozen)
    _check_vocabulary(frozen, model)
    return None if no_grad is None else outside_moe_blocks(model, no_grad, frozen.strategy.get("moe_blocks"))


def _prepare_data(frozen: DictConfig) -> None:
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
        raise _fail("data", e, "fix the data.* values (the data could not be prepared)") from e


def vocabulary(model: Any) -> int | None:
    """The number of token ids the model embeds, where it says so: a transformers model's input embeddings or
    config, or a `vocab_size` attribute (the built-in GPT); None for a model without one (an image classifier)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        try:
            rows = getattr(embeddings(), "num_embeddings", None)
        except Exception:  # a model that has the method but no embeddings
            rows = None
        if isinstance(rows, int):
            return rows
    for size in (getattr(getattr(model, "config", None), "vocab_size", None), getattr(model, "vocab_size", None)):
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def _check_vocabulary(frozen: DictConfig, model: Any) -> None:
    """The built-in token data's largest id against the model's vocabulary (user data is checked batch by batch in
    the workers, `launcher.data.builtin.check_token_ids`)."""
    from launcher.data.builtin import BUILT_IN_DATA, SKIP_CHECK, build_dataset

    vocab = vocabulary(model)
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


def _fail(group: str, e: BaseException, fix: str) -> ConfigError:
    cause = e.__cause__ or e
    message = " ".join(str(cause).split()) or type(cause).__name__
    return ConfigError(f"{group}: {message} ({type(cause).__name__}); {fix}")


def _check_datasets(frozen: DictConfig) -> Any:
    """The collate built; both splits built and non-empty (a stream: at least one global batch); the first samples of
    each collated by the run's collate into a batch that holds tensors. Returns the train split's first micro-batch
    (`batch.micro_size` samples, as a rank's forward gets them), or None when the data opts out of the check
    (`+data._check_=false`; the collate is still built)."""
    from launcher.data.builtin import BUILT_IN_DATA, SKIP_CHECK, build_dataset
    from launcher.data.collate import collate_name, describe, tensors_in
    from launcher.data.sources import is_stream

    collate = _collate(frozen.data.get("collate"))
    if frozen.data.get(SKIP_CHECK) is False:
        return None
    splits = ["train"] + (["val"] if frozen.trainer.eval_every > 0 else [])
    global_size, first = int(frozen.batch.global_size), None
    for split in splits:
        try:
            dataset = build_dataset(frozen.data, split)
        except Exception as e:
            if isinstance(e.__cause__ or e, ConfigError):  # the data's own one line (data=hf names what it has)
                raise (e.__cause__ or e) from e
            raise _fail("data", e, f"fix the data.* values (the {split} split could not be built)") from e
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
        raise _fail("data", e, f"fix the dataset (its {split} stream does not read)") from e
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
        raise _fail("data", e, f"fix the dataset (the {split} split's first samples do not read)") from e


def _positions(model: Any) -> tuple[int | None, str]:
    """The longest sequence the model takes, and the setting that says so."""
    limit = getattr(model, "block_size", None)
    if isinstance(limit, int):
        return limit, "model.block_size"
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return (limit, "model.config.max_position_embeddings") if isinstance(limit, int) else (None, "")


def _check_forward(frozen: DictConfig, model: Any, batch: Any) -> list[str] | None:
    """A forward and backward of the first micro-batch on the meta device; the parameters that got no gradient
    (`_without_gradient`), or None when the meta device could not run it (said in a line)."""
    import torch

    from launcher.data.collate import to_device
    from launcher.models.loss import batch_tokens, model_loss
    from strategies.base import call_model

    limit, setting = _positions(model)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    ids = ids[0] if isinstance(ids, (list, tuple)) and ids else ids
    long = isinstance(ids, torch.Tensor) and ids.dim() > 1 and ids.shape[-1] > (limit or ids.shape[-1])
    if long and batch_tokens(batch):
        seq = f"data.seq_len={ids.shape[-1]}" if "seq_len" in frozen.data else f"a sample of {ids.shape[-1]} tokens"
        raise ConfigError(
            f"data: {seq} exceeds the model's {limit} positions ({setting}); lower data.seq_len or raise {setting}"
        )
    try:
        with torch.enable_grad(), _value_checks_pass():
            output = call_model(model, to_device(batch, torch.device("meta")))
    except TypeError as e:  # the batch's keys or arguments against the forward's parameters
        raise _fail("model", e, "make the model's forward take the data's batch and return the loss") from e
    except Exception as e:
        why = _meta_artefact(e)
        if why is None:
            raise _fail("model", e, "make the model's forward take the data's batch and return the loss") from e
        message = " ".join(str(e).split()).split(". ")[0][:200]
        print(
            f"launch: could not check the model's forward on the meta device ({why}: {type(e).__name__}: {message}); "
            "its first step checks it",
            flush=True,
        )
        return None
    try:
        loss, _ = model_loss(output)
    except Exception as e:
        raise _fail("model", e, "make the model's forward take the data's batch and return the loss") from e
    return _without_gradient(model, loss)


def _without_gradient(model: Any, loss: Any) -> list[str] | None:
    """The trainable parameters that get no gradient from `loss`, by name: a backward on the meta device (no memory,
    no values; nothing stored in `.grad`). None, with a line, where the meta device cannot run it."""
    import torch

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return []
    if not loss.requires_grad:  # a loss made without autograd: nothing to learn from it here
        return None
    try:
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    except Exception as e:
        message = " ".join(str(e).split()).split(". ")[0][:200]
        print(
            f"launch: could not find the parameters that get no gradient on the meta device ({type(e).__name__}: "
            f"{message}); a strategy that needs every gradient says so at its first step",
            flush=True,
        )
        return None
    return [n for (n, _), g in zip(named, grads) if g is None]


@contextmanager
def _value_checks_pass() -> Iterator[None]:
    """torch's own checks of values (`torch._check_tensor_all`: `_is_all_true().item()`, as transformers checks that
    LLaVA's image tokens match its image features) taken as passing on the meta device, which has no values to check;
    the first real step checks them. Any other `.item()` still fails, as data-dependent control flow must."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    checks = (torch.ops.aten._is_all_true.default, torch.ops.aten._is_any_true.default)
    scalar = torch.ops.aten._local_scalar_dense.default

    class Passing(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.verdicts: list[Any] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is scalar and any(args[0] is v for v in self.verdicts):
                return True
            out = func(*args, **(kwargs or {}))
            if func in checks and out.is_meta:
                self.verdicts.append(out)
            return out

    with Passing():
        yield


def _meta_artefact(e: BaseException) -> str | None:
    """Why a forward that failed on the meta device may well run on a real one, or None when the failure is the
    model's or the data's (a shape that does not fit, a value the model refuses): an operation with no meta kernel
    or one that needs values (data-dependent routing, `.item()`), or a meta kernel that checks dtypes its real kernel
    converts (`torch._grouped_mm`'s rejects fp32 inputs: transformers' MoE experts)."""
    import traceback

    message = str(e).lower()
    if isinstance(e, NotImplementedError) or "meta" in message:
        return "an operation that needs real values or has no meta kernel"
    frames = traceback.extract_tb(e.__traceback__)[-4:]  # the kernel's frame, under torch's own _check helpers
    in_meta_kernel = any(frame.filename.endswith("_meta_registrations.py") for frame in frames)
    if in_meta_kernel and ("dtype" in message or " type" in message):
        return "a meta kernel stricter about dtypes than the real one"
    return None


def _check_logger(frozen: DictConfig) -> None:
    """Each logger's own `check` of its settings, when it has one (the built-in ones do: their package installed,
    their values, their server or folder reachable), without starting a run."""
    from launcher.base.targets import locate
    from launcher.config import target_nodes

    for path, node in target_nodes(frozen, "logger"):
        check = getattr(locate(str(node._target_)), "check", None)
        if not callable(check):
            continue
        settings = {k: v for k, v in OmegaConf.to_container(node).items() if not str(k).startswith("_")}
        try:
            check(**settings)
        except (ConnectionError, ImportError) as e:  # its package, its service: the message says what to do
            raise ConfigError(str(e)) from e
        except (TypeError, ValueError) as e:
            raise _fail("logger", e, f"fix the {path}.* values") from e
