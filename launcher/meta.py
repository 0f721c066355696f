"""The model built on the meta device: shapes and parameters, no memory, no initialisation.

One place builds it, in the parent, once per launch: the planner counts it, the strategies' checks read its
modules, a resume checks a checkpoint's shapes against it. What the workers need of it (`ModelSize`) is frozen
into `resolved.yaml` instead of being rebuilt in every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from omegaconf import DictConfig

from launcher.config import ConfigError


@dataclass(frozen=True)
class ModelSize:
    params: int
    """Parameters, each counted once (the GPT's tied embedding and head are one)."""
    largest_layer: int
    """Parameters of the largest single module, its own only: DeepSpeed's definition of the largest layer."""
    takes_num_items: bool = False
    """Its forward divides a summed loss by `num_items_in_batch` itself (transformers models do)."""
    largest_unit: int = 0
    """Parameters of its largest layer-sized unit (a module of its `_no_split_modules`, with its children): what
    FSDP and ZeRO-3 gather at a time; the whole model when it declares none."""

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
    be built."""
    from hydra.utils import instantiate

    try:
        with _no_init_on_meta():
            return instantiate(model_cfg)
    except Exception as e:  # the model's own one-line complaint, not Hydra's wrapper
        cause = e.__cause__ or e
        twin = _from_config_twin(model_cfg) or _pretrained_as_config(model_cfg)
        if twin is None:
            raise ConfigError(f"model {model_cfg.get('_target_')} could not be built: {cause}") from e
    try:
        with _no_init_on_meta():
            return twin()
    except Exception as e:
        raise ConfigError(f"model {model_cfg.get('_target_')} could not be built: {e.__cause__ or e}") from e


def _from_config_twin(model_cfg: DictConfig) -> Any:
    """A transformers `Class.from_pretrained(path)` refuses the meta device (it wants to load weights): the same
    architecture is `Class.from_config(Class's config from path)`, which builds on the meta device for free."""
    from hydra._internal.utils import _locate

    target = str(model_cfg.get("_target_", ""))
    path = model_cfg.get("pretrained_model_name_or_path")
    if not target.endswith(".from_pretrained") or path is None:
        return None
    owner = _locate(target.removesuffix(".from_pretrained"))
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
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    def from_config(cls: Any, path: Any, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        config = config if isinstance(config, PretrainedConfig) else AutoConfig.from_pretrained(str(config or path))
        return cls._from_config(config)

    def build() -> Any:
        original = PreTrainedModel.__dict__["from_pretrained"]
        PreTrainedModel.from_pretrained = classmethod(from_config)  # type: ignore[method-assign,assignment]
        try:
            return instantiate(model_cfg)
        finally:
            PreTrainedModel.from_pretrained = original  # type: ignore[method-assign]

    return build


def measure(model: Any) -> ModelSize:
    import inspect

    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied parameter once
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        parameters = {}
    # transformers models take **kwargs and hand num_items_in_batch to their `loss_function`.
    kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    # A PEFT model hands its keywords to the model it wraps.
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    takes = "num_items_in_batch" in parameters or (kwargs and hasattr(type(inner), "loss_function"))
    declared = set(getattr(model, "_no_split_modules", None) or ())
    units = [sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in declared]
    return ModelSize(params, largest, takes, max(units, default=params))
