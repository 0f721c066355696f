"""The built-in GPT as a transformers folder: GPT-2's architecture (`GPT2LMHeadModel`), which it matches part for part
(learned positions, pre-norm LayerNorms with biases, biased projections, exact GELU, 1/sqrt(head) attention, a head
tied to the embedding), with the run's tokenizer, so that `AutoModelForCausalLM.from_pretrained(folder)` loads it
with no code of the launcher's.

| the GPT                                   | GPT2LMHeadModel                                                    |
|-------------------------------------------|--------------------------------------------------------------------|
| tok_emb, pos_emb                          | transformer.wte, transformer.wpe (n_positions = block_size)         |
| blocks.i.ln1, ln2; ln_f                   | transformer.h.i.ln_1, ln_2; transformer.ln_f                       |
| blocks.i.attn.q, k, v (nn.Linear)         | transformer.h.i.attn.c_attn: one Conv1D, [Wq; Wk; Wv] transposed   |
| blocks.i.attn.proj, mlp.0, mlp.2          | attn.c_proj, mlp.c_fc, mlp.c_proj (Conv1D: the weight transposed)  |
| mlp.1 nn.GELU(), approximate="tanh"       | activation_function "gelu", "gelu_new"                             |
| head (tied to tok_emb, or not)            | lm_head (tie_word_embeddings)                                      |

A model that is not the GPT or departs from it in a part (a norm, an activation, a projection without bias, a forward
of its own) maps onto no transformers architecture: `Unmapped`, one line naming the part, before a weight is read.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ACTIVATIONS = {"none": "gelu", "tanh": "gelu_new"}
"""nn.GELU's `approximate` -> transformers' activation of the same function."""


class Unmapped(ValueError):
    """The model maps onto no transformers architecture; the message names the part that does not."""


def _name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def gpt2_config(model: nn.Module, **tokens: Any) -> Any:
    """GPT2Config of a built-in GPT (built on the meta device will do), `tokens` its bos/eos ids; Unmapped (one line,
    the part) for a model that departs from it."""
    from launcher.models import gpt

    if not isinstance(model, gpt.GPT):
        raise Unmapped(f"{_name(model)} is neither the built-in GPT nor a transformers model")
    if type(model).forward is not gpt.GPT.forward:
        raise Unmapped(f"{_name(model)} has a forward of its own; GPT-2's is the built-in GPT's")
    parts = (gpt.Block, gpt.Attention, nn.LayerNorm, nn.Linear, nn.Embedding, nn.Dropout, nn.GELU)
    parts += (nn.Sequential, nn.ModuleList)
    for name, module in model.named_modules():
        if name and type(module) not in parts:
            raise Unmapped(f"{name} is a {_name(module)}, which is no part of GPT-2")
        if isinstance(module, nn.LayerNorm) and (module.weight is None or module.bias is None):
            lacks = "weight" if module.weight is None else "bias"
            raise Unmapped(f"{name} is a LayerNorm without {lacks}; GPT-2's have both")
        if isinstance(module, nn.Linear) and module.bias is None and name != "head":
            raise Unmapped(f"{name} has no bias; GPT-2's projections have one")
    for i, block in enumerate(model.blocks):
        if len(block.mlp) != 3 or [type(m) for m in block.mlp] != [nn.Linear, nn.GELU, nn.Linear]:
            raise Unmapped(f"blocks.{i}.mlp is not Linear, GELU, Linear, GPT-2's MLP")
    if model.head.bias is not None:
        raise Unmapped("head has a bias; GPT-2's lm_head has none")
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    inner = {b.mlp[0].out_features for b in model.blocks}
    acts = {b.mlp[1].approximate for b in model.blocks}
    drops = {m.p for m in model.modules() if isinstance(m, nn.Dropout)} | {b.attn.dropout for b in model.blocks}
    for what, values in (("layer norms' eps", eps), ("MLP widths", inner), ("GELUs", acts), ("dropouts", drops)):
        if len(values) > 1:
            raise Unmapped(f"its {what} differ ({', '.join(map(str, sorted(values)))}); GPT-2 has one for all layers")
    tied = model.head.weight is model.tok_emb.weight
    import transformers

    return transformers.GPT2Config(
        vocab_size=model.tok_emb.num_embeddings,
        n_positions=model.pos_emb.num_embeddings,
        n_embd=model.tok_emb.embedding_dim,
        n_layer=len(model.blocks),
        n_head=model.blocks[0].attn.n_head,
        n_inner=inner.pop(),
        activation_function=ACTIVATIONS[acts.pop()],
        layer_norm_epsilon=eps.pop(),
        resid_pdrop=(p := drops.pop()),
        embd_pdrop=p,
        attn_pdrop=p,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        tie_word_embeddings=tied,
        architectures=["GPT2LMHeadModel"],
        bos_token_id=tokens.get("bos_token_id"),
        eos_token_id=tokens.get("eos_token_id"),
    )


def gpt2_weights(tensors: dict[str, torch.Tensor], n_layer: int, tied: bool) -> dict[str, torch.Tensor]:
    """The GPT's tensors under GPT-2's names and layout (Conv1D holds (in, out), nn.Linear (out, in))."""
    out = {"transformer.wte.weight": tensors["tok_emb.weight"], "transformer.wpe.weight": tensors["pos_emb.weight"]}
    out |= {f"transformer.ln_f.{p}": tensors[f"ln_f.{p}"] for p in ("weight", "bias")}
    if not tied:
        out["lm_head.weight"] = tensors["head.weight"]
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for a, b in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out |= {f"{theirs}{b}.{p}": tensors[f"{ours}{a}.{p}"] for p in ("weight", "bias")}
        out[f"{theirs}attn.c_attn.weight"] = torch.cat([tensors[f"{ours}attn.{x}.weight"] for x in "qkv"]).t()
        out[f"{theirs}attn.c_attn.bias"] = torch.cat([tensors[f"{ours}attn.{x}.bias"] for x in "qkv"])
        for a, b in (("attn.proj", "attn.c_proj"), ("mlp.0", "mlp.c_fc"), ("mlp.2", "mlp.c_proj")):
            out[f"{theirs}{b}.weight"] = tensors[f"{ours}{a}.weight"].t()
            out[f"{theirs}{b}.bias"] = tensors[f"{ours}{a}.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def save_gpt2(model: nn.Module, tensors: dict[str, torch.Tensor], folder: Any, tokenizer: Any = None) -> Any:
    """The GPT's weights (`tensors`, the launcher's names) saved by transformers as GPT2LMHeadModel into `folder`,
    with `tokenizer` (saved beside it, its bos/eos ids in the config); the transformers model, on the meta device
    until loaded."""
    import transformers

    ids = {k: getattr(tokenizer, k, None) for k in ("bos_token_id", "eos_token_id")}
    config = gpt2_config(model, **ids)
    config.dtype = next(iter(tensors.values())).dtype  # config.json says what the weights are
    with torch.device("meta"):
        hf = transformers.GPT2LMHeadModel(config)
    mapped = gpt2_weights(tensors, config.n_layer, config.tie_word_embeddings)
    missing, unexpected = hf.load_state_dict(mapped, strict=False, assign=True)
    tied = ["lm_head.weight"] if config.tie_word_embeddings else []
    assert not unexpected and missing == tied, f"GPT-2's names not those mapped: {missing or unexpected}"
    hf.tie_weights()
    transformers.utils.logging.disable_progress_bar()  # its bar for one file of shards, on the command's terminal
    hf.save_pretrained(str(folder))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return hf


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level table: each byte's stand-in character (printable bytes stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer() -> Any:
    """A tokenizer transformers loads whose ids are the bytes of the UTF-8 text (256 ids): the built-in byte-level
    data's. Byte-level BPE with no merges; "\\n" (what precedes each file of the packed data) is its BOS, byte 0 (the
    padding of unpacked samples) its pad; it has no EOS: the data has no end-of-document token."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = _byte_symbols()
    assert sorted(symbols.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: b for b, s in symbols.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=symbols[10], pad_token=symbols[0])


def run_tokenizer(run: dict[str, Any] | None) -> tuple[Any, str]:
    """The tokenizer of the run's data (its resolved.yaml, as data), and what it is in words; (None, why) where the
    run had none a transformers folder can hold. CheckpointError (one line) where the run's tokenizer file is not the
    one it trained with (its hash, recorded at launch)."""
    if run is None:
        return None, "no tokenizer: the checkpoint has no run config beside it to say which"
    data = run.get("data") or {}
    choice = str((run.get("job") or {}).get("choices", {}).get("data"))
    if str(data.get("_target_", "")).endswith(("builtin.PySource", "builtin.Synthetic")):
        if data["_target_"].endswith("Synthetic"):
            return None, "no tokenizer: data=synthetic's ids are random, no text's"
        return byte_tokenizer(), "the byte-level tokenizer of data=pysource (ids are the UTF-8 bytes)"
    path = data.get("tokenizer")
    if not path:
        return None, f"no tokenizer: data={choice} names none (data.tokenizer)"
    from pathlib import Path

    from launcher.checkpoint.format import CheckpointError
    from launcher.data.tokenizer import load_tokenizer, tokenizer_hash

    recorded = (run.get("derived") or {}).get("tokenizer_hash")
    where = Path(str(path)).expanduser()
    if not where.exists():
        raise CheckpointError(f"the run's data.tokenizer={path} is gone; give data.tokenizer=... the run trained with")
    if recorded and tokenizer_hash(where) != recorded:
        raise CheckpointError(
            f"the run's data.tokenizer={path} has changed since it trained (its hash is not the run's); restore it"
        )
    tokenizer = load_tokenizer(str(path))
    if data.get("eos_token"):
        tokenizer.eos_token = data["eos_token"]  # the token the run put between documents
    checked = "" if recorded else " (not checked: the run recorded no hash of it)"
    return tokenizer, f"the run's tokenizer {path}{checked}"


def export_gpt(model: nn.Module, tensors: dict[str, torch.Tensor], out: Any, run: dict[str, Any] | None) -> str:
    """The built-in GPT `model` (its structure; on the meta device will do) with `tensors` (the launcher's names), as a
    transformers folder at `out` with the run's tokenizer; what was written, in words. Unmapped before anything is
    written where it departs from GPT-2."""
    gpt2_config(model)  # the structure, before the tokenizer is read or a file written
    tokenizer, said = run_tokenizer(run)
    hf = save_gpt2(model, tensors, out, tokenizer)
    count = sum(t.numel() for t in hf.parameters())
    return (
        f"{count:,} parameters to {out}, a transformers folder (GPT2LMHeadModel) with {said}: "
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it"
    )


def tokenizer_record(data: Any) -> str | None:
    """The hash of the run's data.tokenizer (`launcher.data.tokenizer.tokenizer_hash`), recorded in resolved.yaml at
    launch, by which an export knows the tokenizer file is still the one the run trained with; None: it has none."""
    from pathlib import Path

    path = data.get("tokenizer") if hasattr(data, "get") else None
    if not path or not Path(str(path)).expanduser().exists():
        return None
    from launcher.data.tokenizer import tokenizer_hash

    return tokenizer_hash(Path(str(path)).expanduser())
