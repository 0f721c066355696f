"""Models with frozen parameters, for tests: a PEFT LoRA over a transformers model from a local folder.

`model=custom model._target_=frozen_models.lora +model.path=DIR +model.r=4` (tests/ is on the workers' PYTHONPATH).
"""

from __future__ import annotations

from typing import Any


def lora(path: str, r: int = 4) -> Any:
    """The causal LM saved in `path` with LoRA adapters of rank `r` on its attention projections (no dropout): its
    own weights frozen, the adapters trainable, as `peft.get_peft_model` returns it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path)
    config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True)
    return get_peft_model(base, config)
