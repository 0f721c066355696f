"""The checks of the model, built on the meta device, that the launcher makes before any worker starts (its
optimizer's are `launcher.optim.checks`, after the first of these): a parameter to train, a forward and
backward of the first micro-batch (no memory, no values), the parameters that get no gradient, the sequence length
against its positions, and the vocabulary it embeds. Each failure is a ConfigError (one line);
`launcher.parent.checks` runs them in order."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig

from launcher.base.errors import ConfigError, failure


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


def check_trainable(model: Any, target: Any) -> None:
    """A parameter to train: one that requires a gradient. Checked before anything that groups or steps the
    parameters (the optimizer's checks, the strategy's), which would otherwise refuse a model with none in terms of
    their own keys."""
    tensors = list(model.parameters())
    if any(p.requires_grad for p in tensors):
        return
    held = f"its {len(tensors)} parameter tensors are all frozen, requires_grad=False" if tensors else "it has none"
    raise ConfigError(
        f"model: no parameter of {target} requires a gradient ({held}): there is nothing to train; unfreeze the "
        "ones to train (`requires_grad_(True)`: a head, an adapter) where the model is built"
    )


def _positions(model: Any) -> tuple[int | None, str]:
    """The longest sequence the model takes, and the setting that says so."""
    limit = getattr(model, "block_size", None)
    if isinstance(limit, int):
        return limit, "model.block_size"
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return (limit, "model.config.max_position_embeddings") if isinstance(limit, int) else (None, "")


def check_forward(frozen: DictConfig, model: Any, batch: Any) -> list[str] | None:
    """A forward and backward of the first micro-batch on the meta device; the parameters that got no gradient
    (`_without_gradient`), or None when the meta device could not run it (said in a line)."""
    import torch

    from launcher.base.device import to_device
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
        raise failure("model", e, "make the model's forward take the data's batch and return the loss") from e
    except Exception as e:
        why = _meta_artefact(e)
        if why is None:
            raise failure("model", e, "make the model's forward take the data's batch and return the loss") from e
        message = " ".join(str(e).split()).split(". ")[0][:200]
        print(
            f"launch: could not check the model's forward on the meta device ({why}: {type(e).__name__}: {message}); "
            "its first step checks it",
            flush=True,
        )
        return None
    try:
        loss, _ = model_loss(output, frozen.trainer.get("loss"))
    except Exception as e:
        raise failure("model", e, "make the model's forward take the data's batch and return the loss") from e
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


def outside_moe_blocks(model: Any, names: list[str], explicit: Any) -> list[str]:
    """`names` (parameters without a gradient) but those inside a mixture-of-experts block (`strategy.moe_blocks`, or
    the blocks found): every strategy gives those one."""
    from strategies.moe import moe_blocks

    blocks = {id(m) for m in moe_blocks(model, None if explicit is None else [str(c) for c in explicit])}
    inside = [path for path, m in model.named_modules() if id(m) in blocks]
    return [n for n in names if not any(n.startswith(f"{path}.") for path in inside)]
