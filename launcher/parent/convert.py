"""`launch convert`: the consolidated model weights of any checkpoint, as one safetensors file or as a model folder.

    launch convert CHECKPOINT out=model.safetensors             the weights, for model.load_state_dict(...)
    launch convert CHECKPOINT out=DIR [model overrides]         a folder: save_pretrained's (weights + config.json)
                                                                for a model that has it, the built-in GPT as GPT-2
                                                                (`launcher.export.transformers_folder`), each with
                                                                the run's tokenizer, else model.safetensors +
                                                                model.yaml; for a PEFT model, its adapters
    launch convert CHECKPOINT out=DIR merge=true [overrides]    a PEFT model's adapters merged into its base model:
                                                                the whole model's folder

CHECKPOINT: a checkpoint, a checkpoints folder or a run directory, local or at a URL (s3://bucket/prefix/step_N).

The checkpoint is read as data (`launcher.checkpoint.untrusted`). The model a folder needs is the run's own, read as
data from the resolved.yaml beside its checkpoints, the overrides on this command line changing what they name; the
code it names (`_target_`s) only where this command's own composition names it too (`launcher.parent.run_config`): a
config is code. A checkpoint that does not fit that model is one line, before the model is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from launcher.base.storage import Location, check_url, is_remote, location
from launcher.checkpoint.format import CheckpointError, find_checkpoint
from launcher.checkpoint.untrusted import UntrustedDataError, dcp_load, read_metadata


def weights(checkpoint: Location, ema: bool = False, model: Any = None) -> dict[str, Any]:
    """The model's full tensors, whatever layout saved them, read in this process; with `ema`, the EMA weights in
    place of the trainable parameters' (frozen ones and buffers as the model holds them). The average holds a tied
    parameter once, under one of its names: with the `model` (on the meta device will do), its other names take it
    too (the built-in GPT's head is its embedding), not the raw weights the checkpoint's model holds under them."""
    import torch

    try:
        entries = read_metadata(checkpoint).state_dict_metadata
    except UntrustedDataError as e:
        raise CheckpointError(str(e)) from e
    prefix = "ema.weights." if ema else "model."
    averaged = {
        k.removeprefix(prefix): torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in entries.items()
        if k.startswith(prefix) and hasattr(v, "size")
    }
    if ema and not averaged:
        raise CheckpointError(
            f"checkpoint {checkpoint} holds no EMA weights (its run had no trainer.ema.decay); "
            "convert it without ema=true"
        )
    template = {
        k.removeprefix("model."): torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in entries.items()
        if k.startswith("model.") and hasattr(v, "size") and (not ema or k.removeprefix("model.") not in averaged)
    }
    try:
        dcp_load({"model": template} | ({"ema": {"weights": averaged}} if ema else {}), checkpoint, no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException: a crafted or damaged file
        if isinstance(e, KeyboardInterrupt):
            raise
        reason = next((line.strip() for line in str(e).splitlines() if "Error" in line), type(e).__name__)
        raise CheckpointError(f"checkpoint {checkpoint} does not load as data ({reason[:200]})") from e
    if ema and model is not None:
        for group in _tied(model):
            source = next((name for name in group if name in averaged), None)
            averaged |= {name: averaged[source].clone() for name in group if source is not None and name in template}
    return {name: t.contiguous() for name, t in (template | (averaged if ema else {})).items()}


def _tied(model: Any) -> list[list[str]]:
    """The names of each parameter that has more than one."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def write_file(tensors: dict[str, Any], out: Path, checkpoint: Location) -> None:
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"checkpoint": str(checkpoint)})
    os.replace(tmp, out)


def write_folder(
    tensors: dict[str, Any],
    out: Path,
    model_cfg: DictConfig,
    checkpoint: Location,
    merge: bool = False,
    run: dict[str, Any] | None = None,
    command: Sequence[str] = (),
) -> str:
    """The model of `model_cfg` with the checkpoint's weights, saved as a folder its own loader reads back; returns
    what was written, and how to load it, in words. A checkpoint that does not fit it is one line naming the
    `command`'s setting that differs from the `run`'s config (`run_config.check_model`)."""
    from hydra.utils import instantiate

    from launcher.parent.run_config import check_model

    check_model(checkpoint, model_cfg, run, command)
    from launcher.export.transformers_folder import Unmapped, export_gpt, gpt2_config
    from launcher.models.gpt import GPT
    from launcher.models.meta import build_on_meta

    meta, unmapped = build_on_meta(model_cfg), ""
    if isinstance(meta, GPT) and not merge:  # the built-in GPT: GPT-2's folder, where each of its parts maps
        try:
            return export_gpt(meta, tensors, out, run)
        except Unmapped as e:
            unmapped = str(e)
    try:
        model = instantiate(model_cfg)
    except Exception as e:  # the model's own complaint, in one line
        cause = e.__cause__ or e
        raise CheckpointError(f"model {model_cfg.get('_target_')} could not be built: {cause}") from e
    peft = hasattr(model, "peft_config") and hasattr(model, "merge_and_unload")  # a PEFT model (LoRA, ...)
    if merge and not peft:
        raise CheckpointError(
            f"merge=true merges a PEFT model's adapters into its base model; model {model_cfg.get('_target_')} "
            "is not a PEFT model: leave merge out"
        )
    from launcher.parent.run_config import fit_fix

    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a shape the meta model did not show (a model built otherwise when real)
        why = f"checkpoint {checkpoint} does not fit the model ({_first_mismatch(e)})"
        raise CheckpointError(f"{why}; {fit_fix(run, command)}") from e
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {checkpoint} does not fit the model ("
            f"{'missing ' + missing[0] if missing else 'unexpected ' + unexpected[0]}); {fit_fix(run, command)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    if peft and merge:
        merged = model.merge_and_unload()
        merged.save_pretrained(str(out))
        return (
            f"the whole model, its adapters merged ({_count(merged):,} parameters), to {out}: "
            f"{type(merged).__name__}.from_pretrained({str(out)!r}) loads it"
        )
    if peft:  # PEFT's own format: the adapters and adapter_config.json, over a base model loaded separately
        model.save_pretrained(str(out))
        trained = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad)
        base = next(iter(model.peft_config.values())).base_model_name_or_path or "<the base model>"
        return (
            f"the adapters ({trained:,} parameters) to {out}: PeftModel.from_pretrained(base, {str(out)!r}) loads "
            f"them over base = {type(model.get_base_model()).__name__}.from_pretrained({base!r}); "
            "merge=true writes the whole model, adapters merged"
        )
    if hasattr(model, "save_pretrained"):  # a transformers model: weights and config.json, for from_pretrained
        from launcher.export.transformers_folder import run_tokenizer

        tokenizer, said = run_tokenizer(run)
        model.save_pretrained(str(out))
        if tokenizer is not None:  # the run's, where it had one
            tokenizer.save_pretrained(str(out))
        return f"{_count(tensors):,} parameters to {out}, with {said}"
    try:  # the launcher's own format, and why it is no transformers folder
        gpt2_config(meta)
    except Unmapped as e:
        unmapped = unmapped or str(e)
    write_file(tensors, out / "model.safetensors", checkpoint)
    OmegaConf.save(model_cfg, out / "model.yaml")
    return (
        f"{_count(tensors):,} parameters to {out} (model.safetensors, model.yaml); no transformers folder: {unmapped}"
    )


def _first_mismatch(e: RuntimeError) -> str:
    lines = [line.strip() for line in str(e).splitlines() if "size mismatch" in line]
    return (lines or [" ".join(str(e).split())])[0][:300]


def _count(weights: Any) -> int:
    """Elements of a state dict's tensors, or a module's parameters (a tied one once)."""
    return sum(t.numel() for t in (weights.values() if isinstance(weights, dict) else weights.parameters()))


def convert(
    path: str | Path,
    out: Path,
    model_cfg: DictConfig | None,
    merge: bool = False,
    ema: bool = False,
    run: dict[str, Any] | None = None,
    command: Sequence[str] = (),
) -> str:
    """Write the checkpoint's weights (with `ema`, its EMA weights) to `out` (a .safetensors file, or a folder with
    `model_cfg`'s model: the `run`'s, `command`'s overrides over it); returns what was written, in words. `path`: a
    local path or a URL (`launcher.base.storage.location`)."""
    where = location(path)
    if is_remote(where) and (why := check_url(str(where))):  # credentials, a bucket: one line, not a traceback
        raise CheckpointError(f"{where}: {why}")
    checkpoint = find_checkpoint(where)
    meta = None
    if ema and model_cfg is not None and (run is not None or out.suffix != ".safetensors"):  # tied names
        from launcher.models.meta import build_on_meta
        from launcher.parent.run_config import check_model

        check_model(checkpoint, model_cfg, run, command)
        meta = build_on_meta(model_cfg)
    tensors = weights(checkpoint, ema, meta)
    if out.suffix == ".safetensors":
        if ema and meta is None:
            raise CheckpointError(
                f"ema=true into {out.name} needs the run's model, to give a tied parameter's every name the average: "
                "the checkpoint has no run config beside it; write a folder (out=DIR with the run's model overrides)"
            )
        write_file(tensors, out, checkpoint)
        return f"{_count(tensors):,} parameters to {out}"
    assert model_cfg is not None, "a folder needs the model's config"
    return write_folder(tensors, out, model_cfg, checkpoint, merge, run, command)
