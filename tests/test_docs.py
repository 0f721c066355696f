"""The documentation is code: the site builds with warnings as errors, its generated parts are the code's own, and
every `launch ...` command in it and in the README composes and validates as a run would, without starting one.

What a test machine lacks is faked, and each fake is said where it is made: GPUs (`device=cuda`, `gpus=8`: derived
as if that many were visible), files and folders a command names (a token file, a tokenizer, a store's manifest:
their resolvers answer a vocabulary of 50,304 ids), and targets of the user's own (`my_pkg.*`: functions that take any
keys).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("plan", "prepare", "convert", "export")
OWN_KEYS = {
    "prepare": ("out", "data.shard_index", "data.num_shards", "block_size"),
    "convert": ("out", "merge", "ema"),
    "export": ("image", "name", "namespace"),
}


def commands() -> list[tuple[str, list[str], bool]]:
    """Every `launch ...` command of the README and the docs' code blocks, with continuation lines joined: (where,
    its arguments, whether the lines after it show it refused)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            fenced = not fenced if line.lstrip().startswith("```") else fenced
            code = fenced or line.startswith("    ")
            text = line.strip().removeprefix("$ ")
            if code and text.startswith("launch ") or (code and text == "launch"):
                start = i
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                refused = i + 1 < len(lines) and lines[i + 1].strip().startswith("launch: error:")
                args = shlex.split(text.split(" #", 1)[0].split(" | ", 1)[0].replace("'s ", "s "))[1:]
                found.append((f"{page.name}:{start + 1}", args, refused))
            i += 1
    return found


COMMANDS = commands()


def _overrides(args: list[str]) -> tuple[str, list[str]]:
    """(the subcommand or "run", its overrides): placeholders (`...`, `<...>`, words without `=`), flags and a
    subcommand's own keys left out."""
    kind = args[0] if args and args[0] in SUBCOMMANDS else "run"
    rest = args[1:] if kind != "run" else args
    if kind == "export":
        rest = rest[1:]  # kubeflow
    own = OWN_KEYS.get(kind, ())
    kept = [a for a in rest if "=" in a and not a.startswith("-") and "..." not in a and a.split("=", 1)[0] not in own]
    return kind, kept


@pytest.mark.unit
def test_the_readme_and_docs_hold_the_commands_they_describe() -> None:
    kinds = {_overrides(args)[0] for _, args, _ in COMMANDS}
    assert len(COMMANDS) > 40 and kinds == {"run", *SUBCOMMANDS}, (len(COMMANDS), kinds)


@pytest.mark.unit
def test_nothing_skips_in_ci() -> None:
    """Every test that skips where the machine lacks something skips through `conftest.unavailable`, whose flag makes
    the skip a failure; CI sets every flag, and the contributors' guide names each. The one other skip: the bad-input
    table's `device=cuda` case on a machine with CUDA, where that input is valid (CI's has none)."""
    from conftest import REQUIRES

    skips = re.compile(r"(?:^|[\s=(\[,@])pytest\.(?:skip|importorskip|xfail|mark\.skip|mark\.skipif|mark\.xfail)\b")
    found = sorted(
        (path.name, line.strip())
        for path in (ROOT / "tests").glob("*.py")
        for line in path.read_text().splitlines()
        if skips.search(line)
    )
    assert found == [("conftest.py", "pytest.skip(why)"), ("test_bad_input.py", 'pytest.skip("this machine has CUDA")')]
    ci, guide = (ROOT / ".ci" / "run").read_text(), (ROOT / "docs" / "contributing.md").read_text()
    assert [flag for flag in REQUIRES if f"{flag}=1" not in ci or f"`{flag}=1`" not in guide] == []


@pytest.mark.unit
@pytest.mark.parametrize("where,args,refused", COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_every_command_composes_and_validates(where: str, args: list[str], refused: bool, monkeypatch) -> None:
    """Composed over the typed schema as the command line composes it (a sweep at its first values), frozen (every
    range), derived (the batch contract, devices), every target's keys checked against what it takes."""
    from hydra import initialize_config_module
    from omegaconf import OmegaConf

    import launcher.config.frozen as config
    from launcher.clusters import shaped
    from launcher.config import ConfigError, derive, freeze, schema
    from launcher.config.known import check_keys
    from launcher.parent.overrides import CONFIG_MODULE, compose_checked

    schema.register()
    # Fakes, for what a test machine lacks: files a command names, and the vocabularies read from them; the user's
    # own package (my_pkg), whose targets stand in as functions that take any keys.
    monkeypatch.setattr(config, "_check_data", lambda cfg: None)
    monkeypatch.setitem(sys.modules, "my_pkg", _UsersPackage("my_pkg"))
    for resolver in ("launch_vocab", "launch_store_vocab"):
        OmegaConf.register_new_resolver(resolver, lambda *_: 50304, replace=True)
    kind, overrides = _overrides(args)
    if kind == "prepare":
        overrides = [*overrides, "data=text"] if "data=text" not in overrides else overrides
    problem = None
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            composed, problem = compose_checked(overrides)
            if problem is None:
                frozen = shaped(freeze(composed), {}, overrides)
                gpus = frozen.gpus or 0
                cuda = gpus if frozen.device == "cuda" or (frozen.device == "auto" and gpus) else 0  # GPUs, faked
                try:
                    derive(frozen, cuda)
                except config.BatchSizeError:
                    # `launch plan` with the default global batch over more ranks than it divides plans one
                    # micro-batch per rank, and says so; any other command is refused
                    if kind != "plan" or any(o.startswith("batch.") for o in overrides):
                        raise
                check_keys(frozen)
                if frozen.model._target_ == "launcher.models.gpt.GPT":  # the optimizer over the model's parameters
                    from launcher.models.meta import build_on_meta
                    from launcher.optim.checks import check_optimizer

                    check_optimizer(frozen, build_on_meta(frozen.model))
    except ConfigError as e:
        problem = str(e)
    finally:
        for resolver in ("launch_vocab", "launch_store_vocab"):
            OmegaConf.clear_resolver(resolver)
        schema.register()  # the real resolvers back
    if refused:
        assert problem, f"{where}: shown refused, but it composes: launch {' '.join(args)}"
    else:
        assert problem is None, f"{where}: launch {' '.join(args)}\n{problem}"


class _UsersPackage(types.ModuleType):
    """A user's package that is not installed here: any name in it is a function that takes any keys."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        if name.startswith("__"):
            raise AttributeError(name)

        def target(*args, **kwargs):  # type: ignore[no-untyped-def]
            return None

        target.__module__, target.__qualname__ = self.__name__, name
        return target


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.unit
def test_the_generated_parts_are_the_codes_own() -> None:
    """The logging page's table of figures is `launcher.base.metrics`' declarations; the configuration page's
    reference is the typed schema, every option of every group and every key of the run there."""
    from launcher.base.metrics import table
    from launcher.config.reference import markdown, option_schemas

    hooks = _hooks()
    for page, made in (("logging.md", table()), ("configuration.md", markdown())):
        text = (ROOT / "docs" / page).read_text()
        assert any(marker in text for marker in hooks.MARKERS), page
        assert made in hooks.on_page_markdown(text, None, None, None), page
    reference = markdown()
    for group, options in option_schemas().items():
        for option in options:
            assert f"### {group}={option}" in reference
    for key in ("`trainer.max_steps`", "`batch.micro_size`", "`rdzv.endpoint`", "`data.collate._target_`"):
        assert key in reference, key


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, an anchor that is not there or a page left out of the navigation fails
    the tests."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", **_env()})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()
    assert re.search(r"trainer\.max_steps", (tmp_path / "site" / "configuration" / "index.html").read_text())


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
