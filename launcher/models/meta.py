"""The model built on the meta device: shapes and parameters, no memory, no initialisation.

One place builds it, in the parent, once per launch: the planner counts it, the strategies' checks read its
modules, a resume checks a checkpoint's shapes against it. What the workers need of it (`ModelSize`) is frozen
into `resolved.yaml` instead of being rebuilt in every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from launcher.base.errors import ConfigError

if TYPE_CHECKING:
    from launcher.models.loss import LabelRule


@dataclass(frozen=True)
class ModelSize:
    params: int
    """Parameters, each counted once (the GPT's tied embedding and head are one)."""
    largest_layer: int
    """Parameters of the largest single module, its own only: DeepSpeed's definition of the largest layer."""
    takes_num_items: bool = False
    """Its forward divides its summed loss by `num_items_in_batch` when handed it (`label_rule`)."""
    largest_unit: int = 0
    """Parameters of its largest layer-sized unit (a module of its `_no_split_modules`, with its children): what
    FSDP and ZeRO-3 gather at a time; the whole model when it declares none."""
    label_shift: int | None = None
    """How it counts its batch's `labels` (`launcher.models.loss.LabelRule`): 1 shifted, 0 as they stand, None
    unknown."""
    gathered: int = 0
    """Elements of the matrices its optimizer updates whole (optim=muon's hidden matrices), which a per-parameter
    sharding gathers once per step (`launcher.optim.plan`); counted by the launcher, 0 for other optimizers."""
    reused: int = 0
    """Elements a module holds of a parameter another module also holds, once per extra holder (the GPT's head holds
    its embedding's matrix: that matrix once): what a strategy that gathers each module's own parameters before its
    forward and its backward (ZeRO-3) gathers again, per use (`Strategy.collectives`)."""
    tensor_split: int = 0
    """Parameters its own tensor-parallel plan splits over a group of T ranks (`strategies.tp_plans.split_params`):
    each rank of the group holds 1/T of these and the rest whole (norms, a rowwise layer's bias, what the plan does
    not name); 0 for a model without a plan."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def _no_init_on_meta() -> Iterator[None]:
    """Skip `torch.nn.init` calls on meta tensors: they have no values to fill. (torch routes a meta `normal_`
    through a decomposition whose first use imports torch._dynamo: seconds of `launch plan`'s budget.)"""
    import torch
    from torch.overrides import TorchFunctionMode

    class NoInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            tensor = args[0] if args else kwargs.get("tensor")
            if (
                getattr(func, "__module__", "") == "torch.nn.init"
                and isinstance(tensor, torch.Tensor)
                and tensor.is_meta
            ):
                return tensor
            return func(*args, **kwargs)

    with torch.device("meta"), NoInit():
        yield


def build_on_meta(model_cfg: DictConfig) -> Any:
    """The configured model on the meta device; ConfigError (one line: the model's own complaint) if it cannot
    be built, or if what its target builds is no `torch.nn.Module` (a dict, a builder's forgotten return): every
    check after this one reads it as a module."""
    from hydra.utils import instantiate

    target = model_cfg.get("_target_")
    try:
        with _no_init_on_meta():
            return _module(instantiate(model_cfg), target)
    except ConfigError:
        raise
    except Exception as e:  # the model's own one-line complaint, not Hydra's wrapper
        cause = e.__cause__ or e
        twin = _from_config_twin(model_cfg) or _pretrained_as_config(model_cfg)
        if twin is None:
            raise ConfigError(f"model {target} could not be built: {cause}") from e
    try:
        with _no_init_on_meta():
            built = twin()
    except Exception as e:
        raise ConfigError(f"model {target} could not be built: {e.__cause__ or e}") from e
    return _module(built, target)


def _module(built: Any, target: Any) -> Any:
    """`built`, a `torch.nn.Module`; else ConfigError naming what the target built instead."""
    import torch

    from launcher.models.outputs import describe

    if isinstance(built, torch.nn.Module):
        return built
    what = "nothing (it returned None)" if built is None else describe(built)
    raise ConfigError(
        f"model {target} builds {what}, not a torch.nn.Module; point model._target_ at a model class, or at a "
        "function that returns the model"
    )


def _from_config_twin(model_cfg: DictConfig) -> Any:
    """A transformers `Class.from_pretrained(path)` refuses the meta device (it wants to load weights): the same
    architecture is `Class.from_config(Class's config from path)`, which builds on the meta device for free."""
    from launcher.base.targets import locate

    target = str(model_cfg.get("_target_", ""))
    path = model_cfg.get("pretrained_model_name_or_path")
    if not target.endswith(".from_pretrained") or path is None:
        return None
    owner = locate(target.removesuffix(".from_pretrained"))
    config_class = getattr(owner, "config_class", None)
    if config_class is None:  # an Auto class
        from transformers import AutoConfig as config_class
    if hasattr(owner, "from_config"):
        return lambda: owner.from_config(config_class.from_pretrained(str(path)))
    return lambda: owner(config_class.from_pretrained(str(path)))


def _pretrained_as_config(model_cfg: DictConfig) -> Any:
    """A function of the user's that calls a transformers `from_pretrained` inside (a PEFT model over a pretrained
    one): built again with `from_pretrained` building the folder's architecture from its config, as the twin does."""
    import sys

    if "transformers" not in sys.modules:  # imported by the failed attempt, if it got that far
        return None
    from hydra.utils import instantiate

    from launcher.adapters.transformers_private import pretrained_from_config

    def build() -> Any:
        with pretrained_from_config():
            return instantiate(model_cfg)

    return build


def run_plan(model: Any, cfg: Any) -> dict[str, str]:
    """The tensor-parallel plan the run would use: `strategy.tp_plan` where set, else the model's own."""
    from omegaconf import OmegaConf

    from strategies.tp_plans import chosen_plan

    explicit = OmegaConf.select(cfg, "strategy.tp_plan", default=None)
    given = OmegaConf.to_container(explicit) if isinstance(explicit, DictConfig) else None
    return chosen_plan(model, given)[0]


def measure(model: Any, tp_plan: dict[str, str] | None = None) -> ModelSize:
    """The model's sizes; `tensor_split` under `tp_plan`, the run's tensor-parallel plan (None: the model's own)."""
    from strategies.tp_plans import model_plan, resolve, split_params

    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied parameter once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    declared = set(getattr(model, "_no_split_modules", None) or ())
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in declared]
    # modules() and parameters(recurse=False) yield each module, and each of its parameters, once: a tied
    # parameter is counted here once per module that holds it.
    held = sum(p.numel() for m in model.modules() for p in m.parameters(recurse=False))
    rule = label_rule(model)
    split = split_params(model, resolve(model, model_plan(model) if tp_plan is None else tp_plan))
    return ModelSize(
        params,
        largest,
        rule.takes_num_items,
        max(units, default=params),
        rule.label_shift,
        reused=held - params,
        tensor_split=split,
    )


def label_rule(model: Any) -> LabelRule:
    """How a model counts its batch's `labels` (`launcher.models.loss.LabelRule`), decided here once for every rank.

    Known for a transformers model only (a model of one's own counts as it likes: return its count). It takes
    `num_items_in_batch` when transformers does not say otherwise (`accepts_loss_kwargs`) and its loss, in one
    forward of a small batch on the meta device, depends on it: many models take `**kwargs` but return a mean of
    their own (BERT's masked LM, T5), which, taken for a sum divided by N/G, made the loss K times too large. Its
    label shift is that of the loss function it uses, measured; a seq2seq model's own loss
    (`config.is_encoder_decoder`) is over its labels as they stand; otherwise it is the loss function's that its
    `loss_type` maps to, measured; unknown when it names none (a loss of its own that no `loss_type` describes).
    """
    from launcher.models.loss import LabelRule

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # a peft model
    config = getattr(base, "config", None)
    if not hasattr(type(base), "loss_function") or config is None:
        return LabelRule()
    if getattr(base, "accepts_loss_kwargs", True) and _loss_uses_num_items(model, config):
        shift = _label_shift(base.loss_function)
        return LabelRule(shift is not None, shift)
    if getattr(config, "is_encoder_decoder", False):
        return LabelRule(False, 0)
    if getattr(base, "loss_type", None) is None:
        return LabelRule()
    return LabelRule(False, _label_shift(base.loss_function))


def _loss_uses_num_items(model: Any, config: Any) -> bool:
    """Whether the loss of one forward of a small text batch on the meta device depends on `num_items_in_batch`
    (its gradient reaches it). False when such a batch does not go through (the model wants other inputs)."""
    import torch

    from launcher.models.loss import NUM_ITEMS, model_loss

    length = min(8, getattr(config, "max_position_embeddings", None) or 8)
    ids = torch.zeros(2, length, dtype=torch.long, device="meta")
    items = torch.ones((), device="meta", requires_grad=True)
    try:
        with torch.enable_grad():
            loss, _ = model_loss(model(input_ids=ids, labels=ids, **{NUM_ITEMS: items}))
            return loss.requires_grad and torch.autograd.grad(loss, items, allow_unused=True)[0] is not None
    except Exception:
        return False


def _label_shift(loss_function: Any) -> int | None:
    """How a transformers loss function counts labels, measured on one row of 4 labels over zero logits: each
    target costs log V, so its sum (`num_items_in_batch=1`) is (4 - shift) log V. None if it is no such function."""
    import math

    import torch

    vocab, length = 8, 4
    try:
        loss = loss_function(
            logits=torch.zeros(1, length, vocab),
            labels=torch.arange(length).view(1, length),
            vocab_size=vocab,
            num_items_in_batch=torch.tensor(1.0),
        )
        targets = float(loss) / math.log(vocab)
    except Exception:
        return None
    shift = length - round(targets)
    return shift if shift in (0, 1) and abs(targets - round(targets)) < 1e-4 else None
