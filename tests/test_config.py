"""Tier (a): every config composes and instantiates; bad input fails in one line before any worker starts."""

from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from conftest import LAUNCH, TINY, clean_env, launch_here
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf import OmegaConf

from launcher.config import ConfigError, derive, freeze, schema
from launcher.config.context import make_strategy

schema.register()
CONF = resources.files("launcher.conf")
GROUPS = {
    g: sorted(p.name[:-5] for p in (CONF / g).iterdir() if p.name.endswith(".yaml"))
    for g in ("strategy", "model", "data", "optim", "logger")
}


def _compose(*overrides: str):
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return compose("config", overrides=list(overrides))


CUSTOM = {
    "model": "user_models.Classifier",
    "data": "user_models.images",
    "logger": "user_models.RecordingLogger",
    "optim": "torch.optim.Adagrad",
}


@pytest.mark.unit
@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_and_instantiates(group: str, option: str, tmp_path: Path) -> None:
    from hydra.utils import get_object

    overrides = [f"{group}={option}"] + ([f"data.path={tmp_path / 't.bin'}"] if option == "tokens" else [])
    path = f"logger.{option}" if group == "logger" else group  # loggers: each under its own name, several at once
    if group == "logger" and option == "none":
        assert _compose(*overrides).logger == {}  # no logger but metrics.jsonl
        return
    if option == "custom":  # one key, the target, which the user names: until then it has none
        assert OmegaConf.is_missing(OmegaConf.select(_compose(*overrides), path), "_target_"), f"{path} has a _target_"
        overrides.append(f"{path}._target_={CUSTOM[group]}")
    cfg = _compose(*overrides)
    node = OmegaConf.select(cfg, path)
    target = OmegaConf.select(node, "_target_")
    assert target and (option != "custom" or target == CUSTOM[group]), (group, option, target)
    from launcher.config.optim_schema import RECIPE_KEYS
    from launcher.data.builtin import LOADER_KEYS

    # The target imports, and takes the option's keys as keywords; the loader's own keys (the collate, which
    # launcher.data.collate builds) never reach a data target, nor the param-group rules an optimizer.
    built = instantiate(node, _partial_=True, _recursive_=group != "data")
    assert built.func is get_object(target), (built.func, target)
    own = {"data": LOADER_KEYS, "optim": RECIPE_KEYS}.get(group, ())
    taken = {k: v for k, v in built.keywords.items() if k not in own}
    inspect.signature(built.func).bind_partial(*built.args, **taken)  # TypeError for a key the target does not take
    if group == "strategy":
        make_strategy(freeze(cfg).strategy)  # constructors take plain values and import nothing heavy
    if group == "model" and option == "gpt_tiny":
        import torch

        with torch.device("meta"):
            n = sum(p.numel() for p in instantiate(node).parameters())
        assert 0.5e6 < n < 2e6, n  # "about 1M parameters"


@pytest.mark.unit
def test_model_presets_have_their_advertised_size() -> None:
    import torch

    sizes = {"gpt_124m": 124e6, "gpt_1b": 1.1e9, "gpt_7b": 6.7e9, "gpt_70b": 71e9}
    for name, target in sizes.items():
        node = _compose(f"model={name}", "data.seq_len=1024").model
        with torch.device("meta"):
            n = sum(p.numel() for p in instantiate(node).parameters())
        assert abs(n - target) / target < 0.1, (name, n)


def _cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LAUNCH, *args], cwd=tmp_path, env=clean_env(tmp_path), capture_output=True, text=True, timeout=120
    )


def test_help_and_cfg_import_no_heavy_module(tmp_path: Path) -> None:
    """`--cfg job` composes without torch, deepspeed, wandb, optuna, mlflow or tensorboard; `--help` lists the groups
    without Hydra (its instantiate module above all) or OmegaConf: it composes nothing."""
    probe = (
        "import sys; from launcher.parent import cli\n"
        "try:\n    cli.main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "heavy = ['torch', 'deepspeed', 'wandb', 'optuna', 'datasets', 'transformers', 'mlflow', 'tensorboard']\n"
        "heavy += ['hydra', 'omegaconf'] if '--help' in sys.argv else []\n"
        "print('HEAVY', [m for m in sys.modules if m.split('.')[0] in heavy], file=sys.stderr)\n"
    )
    cases = (
        ["--help"],
        ["model=gpt_124m", "--help"],
        ["--cfg", "job"],
        ["strategy=ddp", "--cfg", "job"],
        ["+sweep=search", "--cfg", "hydra"],
        ["data=text", "--cfg", "job"],
        ["logger=[wandb,mlflow,tensorboard]", "--cfg", "job"],
        ["logger=[mlflow,tensorboard]", "--help"],
    )
    for args in cases:
        proc = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, capture_output=True, text=True)
        assert "HEAVY []" in proc.stderr, (args, proc.stderr)


def test_help_lists_each_groups_options_not_its_schemas(tmp_path: Path) -> None:
    proc = _cli("--help", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    conf = Path(__file__).resolve().parents[1] / "conf"
    for group in ("strategy", "model", "data", "optim", "logger", "sweep"):
        options = ", ".join(sorted(p.stem for p in (conf / group).glob("*.yaml")))
        assert f"\n{group}: {options}\n" in proc.stdout, proc.stdout
    assert "base_" not in proc.stdout and "launch plan" in proc.stdout


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    proc = _cli("batch.global_size=64", "--cfg", "job", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    cfg = OmegaConf.create(proc.stdout)
    assert cfg.batch.global_size == 64 and cfg.strategy._target_ == "strategies.ddp.DDP"
    assert not (tmp_path / "outputs").exists()  # nothing started, nothing written


@pytest.mark.unit
def test_bad_input_in_a_sweep_is_caught_before_the_first_job(tmp_path: Path) -> None:
    line = launch_here(tmp_path, "-m", *TINY, "model=gpt_tiny,gpt_nope").refused()
    assert "unknown model 'gpt_nope'" in line, line
    assert not (tmp_path / "multirun").exists()


@pytest.mark.unit
def test_a_sweeps_checks_say_what_a_single_run_says_at_start_once_for_the_sweep(tmp_path: Path) -> None:
    """The checks before a sweep's first job print what a single run prints at start (the optimizer's groups, the
    loss found in a model's `(logits, loss)`): shown as they run, each line once for the sweep, not set aside. The
    sweep's third job is refused, so nothing runs."""
    nano = [
        *(o for o in TINY if not o.startswith(("model", "data"))),
        "model=custom",
        "model._target_=eval_models.NanoClassifier",
        "+model.config._target_=eval_models.NanoConfig",
        "+model.config.channels=4",
        "data=custom",
        "data._target_=eval_models.images",
        "+data.channels=4",
    ]
    single = launch_here(tmp_path, *nano, f"resume={tmp_path / 'nowhere'}", name="single")  # refused after them
    said = single.stdout.splitlines()
    assert "resume=" in single.refused() and "at position 1 (trainer.loss=1 says so)" in single.stdout, said
    sweep = launch_here(tmp_path, "-m", *nano, "optim.lr=0.1,0.2,-1", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert "sweep job 3 of 3 (optim.lr=-1)" in sweep.refused(), sweep.stderr
    assert sweep.stdout.splitlines() == said, (sweep.stdout, said)  # both jobs' lines, each once
    assert not (tmp_path / "sweep").exists()


@pytest.mark.unit
def test_derive_rules() -> None:
    def frozen(*overrides: str):
        return freeze(_compose(*overrides))

    d = derive(frozen("batch.global_size=64", "batch.micro_size=8", "gpus=2"), cuda_devices=0)
    assert (d.device, d.gpus, d.world_size, d.accumulation) == ("cpu", 2, 2, 4)
    d = derive(frozen("batch.global_size=512", "batch.micro_size=4", "gpus=8", "nodes=2"), cuda_devices=8)
    assert (d.device, d.world_size, d.accumulation) == ("cuda", 16, 8)  # the lesson's exercise 3: 4 x 8 x 16 = 512
    assert derive(frozen("batch.global_size=64"), cuda_devices=4).gpus == 4  # unset gpus: every visible GPU
    with pytest.raises(ConfigError, match=r"gpus=8 but only 2 CUDA device"):
        derive(frozen("gpus=8", "batch.global_size=64"), cuda_devices=2)


@pytest.mark.unit
def test_freeze_turns_enums_into_strings_once() -> None:
    frozen = freeze(_compose("device=cpu", "precision=bf16", "strategy=fsdp", "strategy.offload=cpu"))
    assert (frozen.device, frozen.precision, frozen.trainer.schedule, frozen.strategy.offload) == (
        "cpu",
        "bf16",
        "cosine",
        "cpu",
    )
    assert all(type(v) is str for v in (frozen.device, frozen.precision, frozen.strategy.reduce_dtype))
    assert frozen.model.block_size == frozen.data.seq_len  # interpolations resolved


@pytest.mark.unit
@pytest.mark.parametrize("sweep", ["smoke", "strategies"])
def test_the_sweeps_of_every_strategy_list_every_preset_this_machine_runs(sweep: str) -> None:
    """Neither sweep keeps a list of its own: a preset added to conf/strategy/ joins both (hsdp was once left out)."""
    from conftest import async_io_problem

    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"+sweep={sweep}"], return_hydra_config=True)
    swept = str(cfg.hydra.sweeper.params.strategy).split(",")
    expected = set(GROUPS["strategy"]) - {"auto"} - ({"zero_infinity"} if async_io_problem() else set())
    expected -= {"fsdp_tp"}  # a model may have no tensor-parallel plan: not swept over any model
    assert sorted(swept) == sorted(expected), swept


def _perturbed(value: object) -> list[object]:
    """Other values of a leaf's type, the first one inside its range tried first."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1]
    if isinstance(value, float):
        return [value / 2 if value else 0.5, 0.5]
    if isinstance(value, str):
        return [f"{value}x"]
    return []


@pytest.mark.unit
def test_every_key_is_part_of_the_run_identity_unless_its_schema_marks_it() -> None:
    """Each scalar of the composed default config, changed alone: the identity hash changes exactly where the
    schema does not mark the key `launch_only` (a key added without a mark counts, with no list to update)."""
    from enum import Enum

    from launcher.config.identity import identity_hash
    from launcher.config.ranges import _fields, untracked

    base = _compose("data=synthetic")
    reference = identity_hash(freeze(base), base)
    left_out = untracked(base)
    counted, marked = 0, 0
    for name, _, value in list(_fields(base)):
        if isinstance(value, Enum) or value is None or OmegaConf.is_config(value) or name.endswith("_target_"):
            continue
        for other in _perturbed(value):
            cfg = base.copy()
            try:
                OmegaConf.update(cfg, name, other)
                frozen = freeze(cfg)
            except (ConfigError, ValueError, TypeError):
                continue  # outside the field's range or type: the next candidate
            out = any(name == k or name.startswith(f"{k}.") for k in left_out)
            assert (identity_hash(frozen, cfg) == reference) == out, (name, value, other, out)
            counted, marked = counted + (not out), marked + out
            break
    assert counted >= 15 and marked >= 20, (counted, marked)  # the walk reached both kinds
    assert {"trainer.max_steps", "trainer.log_every", "gpus", "rdzv", "plan"} <= left_out
    assert not {"trainer.grad_clip", "trainer.warmup_steps", "optim.lr", "seed", "model.n_layer"} & left_out


@pytest.mark.unit
def test_a_single_run_is_composed_once_and_its_ranges_checked_once(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The composition that checks a run's overrides is the one the run runs, and `config.freeze` alone checks the
    ranges: a run refused after both (by the batch contract, before any worker) counts one of each."""
    from hydra._internal.hydra import Hydra

    import launcher.config.ranges

    calls = {"compose": 0, "ranges": 0}
    compose_config, fields = Hydra.compose_config, launcher.config.ranges._fields

    def counted_compose(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["compose"] += 1
        return compose_config(*args, **kwargs)

    def counted_fields(cfg, path=""):  # type: ignore[no-untyped-def]
        calls["ranges"] += not path  # a whole config's walk: once per check_ranges, whoever calls it
        return fields(cfg, path)

    monkeypatch.setattr(Hydra, "compose_config", counted_compose)
    monkeypatch.setattr(launcher.config.ranges, "_fields", counted_fields)
    line = launch_here(tmp_path, *TINY, "batch.global_size=30").refused()
    assert line.startswith("launch: error: batch.global_size=30 is not divisible by batch.micro_size=4"), line
    assert calls == {"compose": 1, "ranges": 1}, calls


@pytest.mark.unit
def test_an_option_without_its_schema_takes_the_built_in_ones(tmp_path: Path) -> None:
    """Your own preset that names a built-in target and a key or two (no `defaults: [base_ddp]`) gets that target's
    schema when the config is frozen: its defaults (written there alone), its types, its ranges and its keys."""
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "mine.yaml").write_text("_target_: strategies.ddp.DDP\nbucket_cap_mb: 1\n")
    (tmp_path / "strategy" / "typo.yaml").write_text("_target_: strategies.ddp.DDP\nbucket_cap_mbb: 1\n")
    with initialize_config_module("launcher.conf", version_base="1.3"):
        search = f"hydra.searchpath=[file://{tmp_path}]"
        mine = freeze(compose("config", overrides=[search, "strategy=mine"])).strategy
        assert mine == {**freeze(compose("config", overrides=["strategy=ddp"])).strategy, "bucket_cap_mb": 1.0}
        with pytest.raises(ConfigError) as e:
            freeze(compose("config", overrides=[search, "strategy=typo"]))
        expected = "strategy.bucket_cap_mbb: Key 'bucket_cap_mbb' not in 'DDPStrategyConfig' (the schema of "
        assert str(e.value).startswith(expected + "strategies.ddp.DDP, which your strategy option names: "), e.value
        with pytest.raises(ConfigError, match=r"^strategy.bucket_cap_mb=-1.0 is invalid: it must be > 0$"):
            freeze(compose("config", overrides=[search, "strategy=mine", "strategy.bucket_cap_mb=-1"]))


@dataclass
class _Section:
    early_stop_patience: int = 3


@dataclass
class _Top:
    section: _Section = field(default_factory=_Section)
    settings: dict[str, Any] = field(default_factory=dict)
    target: Any = field(default_factory=lambda: {"_target_": "builtins.dict"})


MISSPELT = {  # one per section of the launcher's own schema, and the top level
    "+trainer.checkpoint_evry=100": "unknown key trainer.checkpoint_evry=100: no schema or target of the launcher "
    "takes it; did you mean trainer.checkpoint_every?",
    "+batch.global_sise=64": "did you mean batch.global_size?",
    "+rdzv.join_timout=5": "did you mean rdzv.join_timeout?",
    "+plan.host_memory=512": "did you mean plan.host_memory_gb?",
    "+sweep.objectiv=loss": "did you mean sweep.objective?",
    "+max_steps=5": "unknown key max_steps=5: no schema or target of the launcher takes it; did you mean "
    "trainer.max_steps?",  # a section's key set at the top
    "+foo=1": "unknown key foo=1: no schema or target of the launcher takes it; the top level has: batch, data, ",
}


@pytest.mark.unit
@pytest.mark.parametrize("override", sorted(MISSPELT))
def test_a_key_no_schema_or_target_takes_is_refused_naming_the_nearest(override: str) -> None:
    """Hydra's `+` adds a key to a typed config without a word; freezing the config refuses it in one line."""
    with pytest.raises(ConfigError) as e:
        freeze(_compose(*TINY, override))
    assert MISSPELT[override] in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.unit
def test_the_known_keys_are_the_schema_dataclasses_own() -> None:
    """The rule reads each node's dataclass: a field declared there is known, with no list elsewhere; a node with a
    `_target_` and a node typed dict are open."""
    from omegaconf import open_dict

    from launcher.config.known import unknown_key

    def added(key: str) -> str | None:
        cfg = OmegaConf.structured(_Top)
        with open_dict(cfg):
            OmegaConf.update(cfg, key, 1, force_add=True)
        return unknown_key(cfg)

    assert added("section.early_stop_patience") is None
    assert added("section.early_stop_patiense") == (
        "unknown key section.early_stop_patiense=1: no schema or target of the launcher takes it; did you mean "
        "section.early_stop_patience?"
    )
    assert added("early_stop_patiense") == (
        "unknown key early_stop_patiense=1: no schema or target of the launcher takes it; did you mean "
        "section.early_stop_patience?"
    )
    assert str(added("patience")).endswith("; the top level has: section, settings, target")
    assert added("settings.anything") is None and added("target.anything") is None
    assert added("hydra.anything") is None  # Hydra's node, composed beside the run's


VALID_ADDED = [  # keys the suite and the docs add with `+`: each taken by a target, or by a node typed dict
    ("optim=sgd", "+optim.nesterov=true"),
    ("+model.at_call=1",),
    (
        "model=custom",
        "model._target_=transformers.AutoModelForCausalLM.from_config",
        "+model.config._target_=transformers.GPT2Config",
        "+model.config.n_layer=2",
    ),
    ("data=custom", "data._target_=user_models.images", "model.block_size=32", "+data.root=corpus"),
    ("+data._check_=false",),
    (
        "data=hf",
        "data.path=corpus",
        "model.block_size=32",
        "+data.collate.tokenizer._target_=transformers.AutoTokenizer.from_pretrained",
        "+data.collate.tokenizer.pretrained_model_name_or_path=models/gpt2",
    ),
    ("logger=custom", "logger.custom._target_=user_models.RecordingLogger", "+logger.custom.file=log.jsonl"),
    ("strategy=zero1", "+strategy.ds_config.zero_optimization.reduce_bucket_size=1000"),
    ("+sweep.pruner.upper=1.0",),
]


@pytest.mark.unit
@pytest.mark.parametrize("overrides", VALID_ADDED, ids=lambda o: o[-1])
def test_keys_a_target_or_a_dict_takes_stay_open(overrides: tuple[str, ...]) -> None:
    frozen = freeze(_compose(*overrides))
    key, value = overrides[-1].lstrip("+").split("=", 1)
    assert str(OmegaConf.select(frozen, key)).lower() == value.lower(), (key, OmegaConf.select(frozen, key))
