"""A trained model leaves for the field's tools: `launch convert CKPT out=DIR` of the built-in GPT writes a transformers
folder (GPT2LMHeadModel, the run's tokenizer) that `AutoModelForCausalLM.from_pretrained` loads with no code of the
launcher's, whose logits are the launcher's GPT's; a model that departs from GPT-2 is said in one line, naming its
part."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import cli_here
from torch import nn

from launcher.export.transformers_folder import Unmapped, byte_tokenizer, export_gpt, gpt2_config
from launcher.models.gpt import GPT

LOGITS_TOLERANCE = 1e-5
"""How far the folder's logits may be from the launcher's GPT's on the same tokens: the same float32 operations on
both sides (one SDPA attention, the same matrix products; GPT-2's fused q|k|v projection computes each output from the
same dot products), so equal up to the order of float32 sums (measured: 0.0 for the exact GELU, 2.4e-7 for tanh)."""

SMALL = {"n_layer": 3, "n_head": 4, "n_embd": 32, "vocab_size": 256, "block_size": 24}


def _perturbed(model: GPT) -> GPT:
    """Norms and biases away from their initial ones and zeros, so that a part mapped wrongly shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _loaded(folder: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _logits_diff(gpt: GPT, folder: Path, idx: torch.Tensor) -> float:
    with torch.no_grad():
        ours = gpt.eval()(idx, idx)["logits"]
        theirs = _loaded(folder)(input_ids=idx).logits
    assert ours.shape == theirs.shape
    return float((ours - theirs).abs().max())


@pytest.mark.unit
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_a_gpt_s_folder_gives_its_logits(approximate: str, tmp_path: Path) -> None:
    """A random GPT (its norms and biases perturbed; exact or tanh GELU) as a folder: from_pretrained gives its
    logits within LOGITS_TOLERANCE, from GPT2LMHeadModel's own code."""
    torch.manual_seed(0)
    gpt = _perturbed(GPT(**SMALL))
    for block in gpt.blocks:
        block.mlp[1] = nn.GELU(approximate=approximate)
    said = export_gpt(gpt, dict(gpt.state_dict()), tmp_path / "hf", None)
    assert "GPT2LMHeadModel" in said and "no tokenizer: the checkpoint has no run config" in said, said
    assert type(_loaded(tmp_path / "hf")).__name__ == "GPT2LMHeadModel"
    idx = torch.randint(0, SMALL["vocab_size"], (3, SMALL["block_size"]))
    assert _logits_diff(gpt, tmp_path / "hf", idx) <= LOGITS_TOLERANCE


@pytest.mark.unit
def test_the_byte_tokenizer_s_ids_are_the_bytes(tmp_path: Path) -> None:
    """The byte-level data's tokenizer, saved and loaded back by AutoTokenizer: 256 ids, each text's ids its UTF-8
    bytes (every byte value, a whole standard-library file), decoded back to the text."""
    import json as module
    from pathlib import Path as P

    from transformers import AutoTokenizer

    byte_tokenizer().save_pretrained(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 256 and tok.bos_token_id == 10 and tok.pad_token_id == 0 and tok.eos_token_id is None
    every = bytes(range(256)).decode("latin-1")  # each byte value's character: UTF-8 of the upper ones is 2 bytes
    for text in ("def f(x):\n\treturn x  # é, ∑, 🙂", every, "", P(module.__file__).read_text()):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


class _SiLUGPT(GPT):
    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.blocks[1].mlp[1] = nn.SiLU()


class _RMSGPT(GPT):
    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.ln_f = nn.RMSNorm(kw["n_embd"])


class _NoBiasGPT(GPT):
    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.blocks[0].attn.q = nn.Linear(kw["n_embd"], kw["n_embd"], bias=False)


class _OwnForward(GPT):
    def forward(self, idx, targets):  # type: ignore[no-untyped-def]
        return super().forward(idx * 0, targets)


@pytest.mark.unit
@pytest.mark.parametrize(
    "model, said",
    [
        (_SiLUGPT, "blocks.1.mlp.1 is a torch.nn.modules.activation.SiLU, which is no part of GPT-2"),
        (_RMSGPT, "ln_f is a torch.nn.modules.normalization.RMSNorm, which is no part of GPT-2"),
        (_NoBiasGPT, "blocks.0.attn.q has no bias; GPT-2's projections have one"),
        (_OwnForward, "test_export._OwnForward has a forward of its own; GPT-2's is the built-in GPT's"),
        (None, "torch.nn.modules.linear.Linear is neither the built-in GPT nor a transformers model"),
    ],
)
def test_a_model_that_maps_onto_no_architecture_is_one_line_naming_the_part(model, said: str) -> None:
    with torch.device("meta"):
        built = nn.Linear(2, 2) if model is None else model(**SMALL)
    with pytest.raises(Unmapped) as e:
        gpt2_config(built)
    assert str(e.value) == said and "\n" not in str(e.value)


@pytest.mark.unit
def test_the_run_s_tokenizer_goes_in_as_it_trained_or_is_refused_in_one_line(tmp_path: Path) -> None:
    """The run's data.tokenizer (its hash recorded at launch, `derived.tokenizer_hash`) goes into the folder with the
    run's data.eos_token; a tokenizer file changed since, or gone, is one line; a run that recorded no hash gets its
    tokenizer, said unchecked."""
    from text_corpus import documents, train_tokenizer
    from transformers import AutoTokenizer

    from launcher.checkpoint.format import CheckpointError
    from launcher.export.transformers_folder import run_tokenizer, tokenizer_record

    folder = train_tokenizer(tmp_path / "tok", documents(20))
    own = AutoTokenizer.from_pretrained(str(folder))
    between = max(t for t in own.get_vocab() if t != own.eos_token)  # the token the run put between documents
    data = {"_target_": "launcher.data.text.Text", "tokenizer": str(folder), "eos_token": between}
    run = {"data": data, "derived": {"tokenizer_hash": tokenizer_record(data)}, "job": {"choices": {"data": "text"}}}
    tok, said = run_tokenizer(run)
    assert said == f"the run's tokenizer {folder}" and tok.eos_token == between != own.eos_token
    assert tok.eos_token_id == own.convert_tokens_to_ids(between) and tok("a b c") == own("a b c")
    _, said = run_tokenizer({**run, "derived": {}})
    assert said == f"the run's tokenizer {folder} (not checked: the run recorded no hash of it)"
    (folder / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text() + " ")
    with pytest.raises(CheckpointError, match="has changed since it trained \\(its hash is not the run's\\); restore"):
        run_tokenizer(run)
    with pytest.raises(CheckpointError, match="data.tokenizer=.* is gone; give data.tokenizer=..."):
        run_tokenizer({**run, "data": {**data, "tokenizer": str(tmp_path / "gone")}})


@functools.cache
def _val_windows(run_dir: Path, count: int = 6) -> torch.Tensor:
    from omegaconf import OmegaConf

    from launcher.data.builtin import build_dataset

    cfg = OmegaConf.load(run_dir / "resolved.yaml")
    dataset = build_dataset(cfg.data, "val")
    return torch.stack([dataset[i][0] for i in range(count)])


def _launcher_gpt(run_dir: Path, tensors: dict[str, torch.Tensor]) -> GPT:
    """The launcher's GPT of the run's resolved.yaml, holding `tensors` (a tied head takes the embedding's)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "resolved.yaml")
    gpt = GPT(**{k: v for k, v in cfg.model.items() if k != "_target_"})
    missing, unexpected = gpt.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"head.weight"}, (missing, unexpected)
    return gpt


def _saved(checkpoint: Path, tmp_path: Path) -> dict:
    """The checkpoint as torch's own tool consolidates it: {model: ..., ema: {weights: ...}}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp_path / "full.pt"))
    return torch.load(tmp_path / "full.pt", weights_only=True)


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp_tp"])
def test_convert_of_a_sharded_gpt_writes_a_folder_from_pretrained_loads_with_its_logits(
    suite, strategy: str, tmp_path: Path
) -> None:
    """`launch convert RUN out=DIR` of the suite's GPT, trained under fsdp at 2 ranks and fsdp_tp at 4 (its suite's
    shape): a folder that AutoModelForCausalLM and AutoTokenizer load; its logits on the run's validation windows are
    the launcher's GPT's (the checkpoint as torch's tool consolidates it) within LOGITS_TOLERANCE; its tokenizer gives
    each window's bytes as their ids."""
    from transformers import AutoTokenizer

    checkpoint = suite.run_dir / "checkpoints" / "step_00000012"
    out = tmp_path / "hf"
    proc = cli_here(tmp_path, "convert", str(suite.run_dir), f"out={out}")
    assert proc.returncode == 0, proc.stderr
    assert "a transformers folder (GPT2LMHeadModel) with the byte-level tokenizer of data=pysource" in proc.stdout
    gpt = _launcher_gpt(suite.run_dir, _saved(checkpoint, tmp_path)["model"])
    windows = _val_windows(suite.run_dir)
    assert _logits_diff(gpt, out, windows) <= LOGITS_TOLERANCE
    tok = AutoTokenizer.from_pretrained(str(out))
    text = bytes(windows[0].tolist()).decode("utf-8", errors="surrogateescape")
    assert tok(text, add_special_tokens=False)["input_ids"] == windows[0].tolist()


def test_convert_with_ema_exports_the_average_head_included(conformance_dir: Path, tmp_path: Path) -> None:
    """`launch convert CKPT out=DIR ema=true` of FSDP's EMA run at 2 ranks: the folder's logits are those of the GPT
    holding the average (its tied head the averaged embedding), not the weights'; `out=FILE.safetensors ema=true`
    gives the head the averaged embedding too (the checkpoint averages the tied matrix once, under one name)."""
    from safetensors.torch import load_file
    from test_ema import _run

    run = _run(conformance_dir, "fsdp", 2)
    checkpoint = run.run_dir / "checkpoints" / "step_00000006"
    saved = _saved(checkpoint, tmp_path)
    proc = cli_here(tmp_path, "convert", str(checkpoint), f"out={tmp_path / 'ema'}", "ema=true")
    assert proc.returncode == 0, proc.stderr
    windows = _val_windows(run.run_dir)
    merged = {**saved["model"], **saved["ema"]["weights"]}
    average = _launcher_gpt(run.run_dir, {k: v for k, v in merged.items() if k != "head.weight"})  # tied: tok_emb's
    assert _logits_diff(average, tmp_path / "ema", windows) <= LOGITS_TOLERANCE
    weights = _launcher_gpt(run.run_dir, saved["model"])
    assert _logits_diff(weights, tmp_path / "ema", windows) > 1e-3  # the average is not the weights
    proc = cli_here(tmp_path, "convert", str(checkpoint), f"out={tmp_path / 'ema.safetensors'}", "ema=true")
    assert proc.returncode == 0, proc.stderr
    written = load_file(str(tmp_path / "ema.safetensors"))
    assert torch.equal(written["head.weight"], saved["ema"]["weights"]["tok_emb.weight"])
    assert not torch.equal(written["head.weight"], saved["model"]["head.weight"])


TRAINS_ON_TOLERANCE = 1e-5
"""How far the folder's losses, trained on as model=custom, may be from the launcher's GPT's from the same weights:
the same float32 operations (GPT-2's fused q|k|v projection gets the same gradient entries as the three, and AdamW
updates each entry alone), so equal up to the order of float32 sums (measured: 4.2e-7 over 6 steps)."""


@pytest.mark.parametrize("strategy", ["fsdp"])
@pytest.mark.long  # 40-90 s (two runs of 2 ranks); the logits test above covers the folder's model
def test_the_folder_trains_on_as_model_custom_with_the_gpt_s_losses(suite, strategy: str, tmp_path: Path) -> None:
    """The exported folder trained on as `model=custom` with transformers' from_pretrained, under FSDP at 2 ranks:
    its losses for the next steps are those of the launcher's GPT from the same weights (`launch convert
    out=FILE.safetensors`), on the same samples with the same targets (data.format=hf for both), each with a fresh
    optimizer: a folder holds the weights, not the optimizer's state or the data's position."""
    from conftest import launch
    from omegaconf import OmegaConf

    folder, file = tmp_path / "hf", tmp_path / "w.safetensors"
    for out in (folder, file):
        proc = cli_here(tmp_path, "convert", str(suite.run_dir), f"out={out}")
        assert proc.returncode == 0, proc.stderr
    sizes = {k: v for k, v in OmegaConf.load(suite.run_dir / "resolved.yaml").model.items() if k != "_target_"}
    job = [
        "data=pysource",
        f"data.seq_len={sizes['block_size']}",
        "data.format=hf",
        "strategy=fsdp",
        "gpus=2",
        "batch.global_size=16",
        "batch.micro_size=4",
        "trainer.max_steps=4",
        "trainer.warmup_steps=2",
        "trainer.log_every=1",
        "trainer.eval_every=0",
        "trainer.save_at_end=false",
        "trainer.progress=false",
        "logger=none",
        "device=cpu",
        "model=custom",
    ]
    gpt = launch(
        tmp_path,
        *job,
        "model._target_=export_models.gpt_from_file",
        f"+model.path={file}",
        *(f"+model.{k}={v}" for k, v in sizes.items()),
        name="gpt",
    ).check()
    hf = launch(
        tmp_path,
        *job,
        "model._target_=transformers.AutoModelForCausalLM.from_pretrained",
        f"+model.pretrained_model_name_or_path={folder}",
        name="hf",
    ).check()
    assert len(gpt.losses()) == len(hf.losses()) == 4
    assert hf.losses() == pytest.approx(gpt.losses(), abs=TRAINS_ON_TOLERANCE), (hf.losses(), gpt.losses())


def test_convert_of_a_model_of_one_s_own_writes_the_launcher_s_format_and_says_why(
    conformance_dir: Path, tmp_path: Path
) -> None:
    """A model of one's own (an nn.Module, neither the built-in GPT nor a transformers model) maps onto no transformers
    architecture: its folder is the launcher's format, and the line names why (the run test_evaluation's)."""
    from conftest import launch_once
    from test_evaluation import JOB, METRICS, NANO

    run = launch_once(conformance_dir, "+sweep=smoke", *NANO, *METRICS, *JOB, "gpus=1", name="eval-nano-one").check()
    code = ["model._target_=eval_models.NanoClassifier", "+model.config._target_=eval_models.NanoConfig"]
    proc = cli_here(tmp_path, "convert", str(run.run_dir), f"out={tmp_path / 'own'}", *code)
    assert proc.returncode == 0, proc.stderr
    said = "(model.safetensors, model.yaml); no transformers folder: eval_models.NanoClassifier is neither the built-in"
    assert said in proc.stdout, proc.stdout
    assert sorted(p.name for p in (tmp_path / "own").iterdir()) == ["model.safetensors", "model.yaml"]
