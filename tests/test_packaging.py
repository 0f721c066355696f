"""Both install modes find the configs: the suite runs on the editable install; this builds a wheel too."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.long  # ~25 s: builds and installs a wheel; CI's own install is the editable one
def test_a_wheel_install_finds_its_configs_and_runs(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("launch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"launcher/conf/{p.relative_to(ROOT / 'conf').as_posix()}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert shipped <= names, sorted(shipped - names)  # every config group, present and future
    assert "strategies/ddp.py" in names
    packages = {
        p.relative_to(ROOT).as_posix()
        for top in ("launcher", "strategies", "hydra_plugins")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert packages <= names, sorted(packages - names)  # every package, present and future
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    # The wheel's packages come first on the path, ahead of the editable install; run from elsewhere.
    env = {**os.environ, "PYTHONPATH": str(site), "WANDB_MODE": "disabled"}
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = subprocess.run(
        [sys.executable, "-c", "import launcher, strategies; print(launcher.__file__, strategies.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.count(str(site)) == 2, where
    # The search sweeper, found by Hydra's own scan of the hydra_plugins namespace in the wheel.
    scan = "from hydra.core.plugins import Plugins; print([c.__module__ for c in Plugins.instance().discover()])"
    found = subprocess.run([sys.executable, "-c", scan], cwd=work, env=env, capture_output=True, text=True).stdout
    assert "hydra_plugins.launch_optuna.sweeper" in found, found
    entry = "import sys; from launcher.parent.cli import main; main(sys.argv[1:])"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            entry,
            "data=synthetic",
            "data.seq_len=16",
            "model.n_layer=1",
            "gpus=2",
            "device=cpu",
            "batch.global_size=8",
            "trainer.max_steps=2",
            "logger=none",
            "trainer.progress=false",
            f"hydra.run.dir={work / 'run'}",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert len((work / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def _imports(folder: Path) -> dict[str, set[str]]:
    """Each module below `folder` -> the `launcher.*`/`strategies.*` modules it imports (lazily or not)."""
    import ast

    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        found[module] = {n for n in names if n.split(".")[0] in ("launcher", "strategies")}
    return found


@pytest.mark.unit
def test_the_rooms_import_downwards_and_the_parent_knows_the_worker_by_its_entry_alone() -> None:
    """The house's rules (docs/contributing.md): the parent imports nothing of the worker but its entry point; no
    room of a concern imports the worker or the parent; the strategies import nothing of the launcher."""
    modules = _imports(ROOT / "launcher") | _imports(ROOT / "strategies")
    broken = []
    for module, names in modules.items():
        side = module.split(".")[1] if module.startswith("launcher.") else "strategies"
        for name in names:
            if side == "parent" and name.startswith("launcher.worker") and name != "launcher.worker.main":
                if name != "launcher.worker" or not {"launcher.worker.main"} <= names:
                    broken.append(f"{module} imports {name}")
            elif side not in ("parent", "worker") and name.startswith(("launcher.worker", "launcher.parent")):
                broken.append(f"{module} imports {name}")
            elif side == "strategies" and name.startswith("launcher"):
                broken.append(f"{module} imports {name}")
    assert not broken, broken
