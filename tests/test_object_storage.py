"""Checkpoints in object storage (trainer.checkpoint_dir=s3://...): every checkpoint feature against a real S3
protocol server on loopback (moto's), and the format's reading of a URL against a local folder's (fsspec's memory
filesystem, in process)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import LAUNCH, TINY, Run, clean_env, launch, launch_here
from object_store import BUCKET, S3, SECRET, s3_server
from processes import wait_for_step, worker_pids

JOB = [
    *(o for o in TINY if not o.startswith("model.n_embd")),
    "model.n_embd=256",  # a save takes a while (20 MB): long enough to kill a rank in the middle of one
    "batch.global_size=16",
    "batch.micro_size=4",
    "gpus=2",
    "trainer.max_steps=8",
]


def _step(step: int) -> str:
    return f"step_{step:08d}"


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines)}


def _max_diff(reference: Run, run_dir: Path, steps: range) -> float:
    resumed = _losses(run_dir)
    assert set(steps) <= set(resumed), sorted(resumed)
    return max(abs(reference.metrics[s - 1]["loss"] - resumed[s]) for s in steps)


def _listing(fs, prefix: str) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{BUCKET}/{prefix}", detail=False))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3]:
    with s3_server() as server:
        yield server


@pytest.fixture(scope="module")
def reference(s3: S3, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted run every other one is held to: synchronous saves into the bucket every 2 steps, 2 kept."""
    tmp = tmp_path_factory.mktemp("reference")
    every = ["trainer.checkpoint_every=2", "trainer.keep_last=2", f"trainer.checkpoint_dir={s3.url('reference')}"]
    return launch(tmp, *JOB, *every, env=clean_env(tmp) | s3.env).check()


def test_saves_go_to_the_bucket_pruned_with_metrics_and_logs_local_and_no_secret(reference: Run, s3: S3) -> None:
    from launcher.base.storage import location
    from launcher.checkpoint.format import damage

    fs = s3.fs()
    assert _listing(fs, "reference") == ["latest", _step(6), _step(8)]  # keep_last=2 pruned steps 2 and 4
    assert fs.cat(f"{BUCKET}/reference/latest").decode() == _step(8)
    manifest = json.loads(fs.cat(f"{BUCKET}/reference/{_step(8)}/manifest.json"))
    assert manifest["step"] == 8 and manifest["samples"] == 8 * 16 and manifest["world_size"] == 2
    assert {".metadata", "rng_0.pt", "rng_1.pt"} <= set(manifest["files"]) == set(manifest["xxh3_128"])
    for step in (6, 8):  # every file's size and checksum, read back from the bucket
        assert damage(location(s3.url(f"reference/{_step(step)}"))) is None
    run_dir = reference.run_dir
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "resolved.yaml").is_file()
    assert not (run_dir / "checkpoints").exists()
    written = b"".join(p.read_bytes() for p in run_dir.rglob("*") if p.is_file())
    assert s3.url("reference").encode() in written  # the config names the URL ...
    assert SECRET.encode() not in written and SECRET not in reference.stdout + reference.stderr  # ... never the key
    assert "credentials" not in reference.stdout + reference.stderr  # botocore's lines stay off the terminal


def test_resume_from_a_url_resume_auto_and_convert_read_the_bucket(reference: Run, s3: S3, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    env = clean_env(tmp_path) | s3.env
    resumed = launch(tmp_path, *JOB, f"resume={s3.url(f'reference/{_step(6)}')}", env=env).check()
    assert f"resuming from {s3.url(f'reference/{_step(6)}')} (step 6, sample 96)" in resumed.stdout
    assert _max_diff(reference, resumed.run_dir, range(7, 9)) <= 1e-6
    assert (resumed.run_dir / "checkpoints" / "latest").read_text() == _step(8)  # its own saves: local, as before

    fs = s3.fs()
    fs.copy(f"{BUCKET}/reference", f"{BUCKET}/auto", recursive=True)  # a run's checkpoints, left in its bucket
    auto = [f"trainer.checkpoint_dir={s3.url('auto')}", "resume=auto", "trainer.max_steps=10"]
    again = launch(tmp_path, *JOB, *auto, name="auto", env=env).check()  # a new pod: a fresh run directory
    assert f"resume=auto: resuming from {s3.url(f'auto/{_step(8)}')}" in again.stdout, again.stdout
    assert sorted(_losses(again.run_dir)) == [9, 10]

    out, local = tmp_path / "from-s3.safetensors", tmp_path / "local" / _step(8)
    fs.get(f"{BUCKET}/reference/{_step(8)}/", str(local), recursive=True)
    for source, target in ((s3.url(f"reference/{_step(8)}"), out), (local, tmp_path / "from-disk.safetensors")):
        proc = subprocess.run(
            [LAUNCH, "convert", str(source), f"out={target}"], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
    from_s3, from_disk = load_file(str(out)), load_file(str(tmp_path / "from-disk.safetensors"))
    assert sorted(from_s3) == sorted(from_disk) and all(torch.equal(from_s3[k], from_disk[k]) for k in from_disk)


def _partial_save(fs, prefix: str, proc: subprocess.Popen, timeout: float = 120) -> str | None:  # type: ignore[no-untyped-def]
    """A step prefix being written (no manifest yet) once an earlier save is complete; None if the run ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            steps = [p for p in _listing(fs, prefix) if p.startswith("step_")]
        except FileNotFoundError:
            steps = []
        done = [p for p in steps if fs.exists(f"{BUCKET}/{prefix}/{p}/manifest.json")]
        partial = [p for p in steps if p not in done]
        if done and partial:
            return partial[0]
        time.sleep(0.005)
    return None


@pytest.mark.long
def test_a_kill_mid_save_leaves_a_partial_prefix_and_the_next_pod_resumes_exactly(
    reference: Run, s3: S3, tmp_path: Path
) -> None:
    """Save every step and SIGKILL rank 0 while a save is being uploaded: that prefix has no manifest and is never
    read; every prefix with one verifies and loads; a launch on a fresh run directory (a new pod) resumes from the
    newest complete checkpoint and logs the uninterrupted run's losses."""
    from launcher.base.storage import location
    from launcher.checkpoint.format import damage, latest
    from launcher.parent.convert import weights

    fs, url = s3.fs(), s3.url("killed")
    flags = ["trainer.checkpoint_every=1", "trainer.keep_last=3", f"trainer.checkpoint_dir={url}"]
    env = clean_env(tmp_path) | s3.env
    partial = None
    for attempt in range(4):  # until a kill lands inside a save (one may finish between the look and the kill)
        run_dir = tmp_path / f"pod{attempt}"
        proc = subprocess.Popen(
            [LAUNCH, *JOB, *flags, f"hydra.run.dir={run_dir}"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        writing = _partial_save(fs, "killed", proc)
        if writing is not None:
            os.kill(worker_pids(run_dir)[0], signal.SIGKILL)
        proc.communicate(timeout=120)
        if writing is not None and not fs.exists(f"{BUCKET}/killed/{writing}/manifest.json"):
            partial = writing
            break
    assert partial is not None, "no kill landed inside a save"
    complete = [p for p in _listing(fs, "killed") if p.startswith("step_") and p != partial]
    assert complete and partial in _listing(fs, "killed")
    for name in complete:
        checkpoint = location(f"{url}/{name}")
        assert damage(checkpoint) is None, name
        assert all(bool(torch.isfinite(t).all()) for t in weights(checkpoint).values()), name
    newest = latest(location(url))
    assert newest is not None and newest.name != partial
    assert fs.cat(f"{BUCKET}/killed/latest").decode() in complete

    done = launch(tmp_path, *JOB, *flags, name="next-pod", env=env).check()
    step = int(newest.name.removeprefix("step_"))
    assert f"resuming from {newest} (step {step}," in done.stdout, done.stdout
    assert sorted(_losses(done.run_dir)) == list(range(step + 1, 9))
    assert _max_diff(reference, done.run_dir, range(step + 1, 9)) <= 1e-6
    left = [p for p in _listing(fs, "killed") if p.startswith("step_")]
    assert all(fs.exists(f"{BUCKET}/killed/{p}/manifest.json") for p in left), left  # the partial one is gone


@pytest.mark.long  # ~20 s: async saves are test_checkpoint's on disk; the bucket's reads and writes the URL
# test's
def test_async_saves_and_an_elastic_restart_go_on_from_the_bucket(reference: Run, s3: S3, tmp_path: Path) -> None:
    """trainer.async_checkpoint=true into the bucket, and a worker SIGKILLed once a checkpoint is visible: the agent
    restarts the group, which resumes from the bucket; every step logs the uninterrupted run's loss."""
    fs, url, run_dir = s3.fs(), s3.url("async"), tmp_path / "async"
    flags = ["trainer.async_checkpoint=true", "trainer.checkpoint_every=2", "trainer.keep_last=0"]
    proc = subprocess.Popen(
        [LAUNCH, *JOB, *flags, "trainer.max_restarts=1", f"trainer.checkpoint_dir={url}", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env=clean_env(tmp_path) | s3.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(run_dir, 5, proc)
    deadline = time.monotonic() + 60
    while not fs.exists(f"{BUCKET}/async/{_step(4)}/manifest.json") and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(worker_pids(run_dir)[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    found = [line for line in out.splitlines() if "restart 1 of the worker group: resuming from" in line]
    assert len(found) == 1 and f"resuming from {url}/step_" in found[0], out
    resumed_at = int(found[0].split("(step ")[1].split(",")[0])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert resumed_at >= 4 and [r["step"] for r in records if r["restart"] == 1][0] == resumed_at + 1
    for r in records:  # both attempts, each step as the uninterrupted synchronous run logged it
        assert abs(r["loss"] - reference.metrics[r["step"] - 1]["loss"]) <= 1e-6, r
    assert _listing(fs, "async") == ["latest", *(_step(s) for s in (2, 4, 6, 8))]
    assert all(fs.exists(f"{BUCKET}/async/{_step(s)}/manifest.json") for s in (2, 4, 6, 8))


def _flip_a_byte(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


def test_damaged_or_crafted_checkpoints_in_the_bucket_are_refused_as_local_ones(
    reference: Run, s3: S3, tmp_path: Path
) -> None:
    """A flipped byte, and a manifest that lists a file outside its folder: `resume=<url>` is refused before any
    worker starts with the line a local copy gets; the run's own newest checkpoint, damaged, is skipped with its
    line and the one before it resumes exactly."""
    fs = s3.fs()
    for name, damage in (("flipped", "fails its checksum (xxh3-128)"), ("crafted", "lists a bad file entry")):
        remote, local = f"{BUCKET}/{name}/{_step(8)}", tmp_path / name / _step(8)
        fs.copy(f"{BUCKET}/reference/{_step(8)}", remote, recursive=True)
        fs.get(remote + "/", str(local), recursive=True)
        if name == "flipped":
            broken = _flip_a_byte(fs.cat(f"{remote}/__0_0.distcp"))
            fs.pipe(f"{remote}/__0_0.distcp", broken)
            (local / "__0_0.distcp").write_bytes(broken)
        else:
            manifest = json.loads(fs.cat(f"{remote}/manifest.json"))
            manifest["files"]["../../escape"], manifest["xxh3_128"]["../../escape"] = 1, "0" * 32
            fs.pipe(f"{remote}/manifest.json", json.dumps(manifest).encode())
            (local / "manifest.json").write_text(json.dumps(manifest))
        url = f"s3://{remote}"
        from_s3 = launch_here(tmp_path, *JOB, f"resume={url}", name=f"{name}-s3").refused()
        from_disk = launch_here(tmp_path, *JOB, f"resume={local}", name=f"{name}-disk").refused()
        assert damage in from_s3 and from_s3.replace(url, "X") == from_disk.replace(str(local), "X"), from_s3

    fs.copy(f"{BUCKET}/reference", f"{BUCKET}/fallback", recursive=True)
    fs.pipe(
        f"{BUCKET}/fallback/{_step(8)}/__0_0.distcp", _flip_a_byte(fs.cat(f"{BUCKET}/fallback/{_step(8)}/__0_0.distcp"))
    )
    url = s3.url("fallback")
    run = launch(tmp_path, *JOB, f"trainer.checkpoint_dir={url}", name="fallback", env=clean_env(tmp_path) | s3.env)
    run.check()
    assert f"launch: skipping checkpoint {url}/{_step(8)}: __0_0.distcp fails its checksum (xxh3-128)" in run.stdout
    assert f"resuming from {url}/{_step(6)} (step 6, sample 96)" in run.stdout, run.stdout
    assert _max_diff(reference, run.run_dir, range(7, 9)) <= 1e-6


GPT2 = [  # transformers' GPT-2, built from its config: nothing downloaded
    "model=custom",
    "model._target_=transformers.AutoModelForCausalLM.from_config",
    "+model.config._target_=transformers.GPT2Config",
    *(f"+model.config.{k}={v}" for k, v in {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256}.items()),
    "+model.config.n_positions=32",
]


@pytest.mark.long  # ~25 s: saves to and converts from the bucket are the URL test's, a transformers model's convert
# test_user_models'
def test_a_transformers_model_sharded_by_fsdp_saves_to_the_bucket_and_converts_from_it(s3: S3, tmp_path: Path) -> None:
    """FSDP's DTensor shards of a third-party model, written by every rank into the bucket; `launch convert <url>`
    writes its weights, which the same transformers model built from its config loads whole (strict)."""
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from launcher.base.storage import location
    from launcher.parent.convert import weights

    url, env = s3.url("gpt2"), clean_env(tmp_path) | s3.env
    hf = [*(o for o in JOB if not o.startswith(("model", "trainer.max_steps"))), *GPT2, "data.format=hf"]
    launch(tmp_path, *hf, "strategy=fsdp", "trainer.max_steps=2", f"trainer.checkpoint_dir={url}", env=env).check()
    assert json.loads(s3.fs().cat(f"{BUCKET}/gpt2/{_step(2)}/manifest.json"))["strategy"] == "fsdp"
    out = tmp_path / "gpt2.safetensors"
    proc = subprocess.run([LAUNCH, "convert", url, f"out={out}"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32))
    converted = load_file(str(out))
    model.load_state_dict(converted, strict=True)
    saved = weights(location(f"{url}/{_step(2)}"))
    assert sorted(saved) == sorted(converted) and all(torch.equal(converted[k], saved[k]) for k in saved)
    x = torch.randint(0, 256, (2, 32))
    assert torch.isfinite(model(input_ids=x, labels=x).loss)


def test_a_checkpoint_dir_that_cannot_hold_checkpoints_is_one_line_before_start(s3: S3, tmp_path: Path) -> None:
    import s3fs

    cases = {
        s3.url("x").replace(BUCKET, "no-such-bucket"): "s3://no-such-bucket does not exist",
        f"s3://someone:{SECRET}@{BUCKET}/x": "it carries credentials: give them in the environment",
        "nosuchproto://bucket/x": "fsspec knows no protocol nosuchproto://",
    }
    for i, (url, words) in enumerate(cases.items()):
        line = launch_here(tmp_path, *JOB, f"trainer.checkpoint_dir={url}", name=f"bad{i}").refused()
        shown = url.replace(f"someone:{SECRET}", "***")  # a URL's credentials are never echoed
        assert line.startswith(f"launch: error: trainer.checkpoint_dir={shown}: ") and words in line, line
    keys = {key: os.environ.pop(key) for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        line = launch_here(tmp_path, *JOB, f"trainer.checkpoint_dir={s3.url('x')}", name="no-keys").refused()
    finally:
        os.environ.update(keys)
        s3fs.S3FileSystem.clear_instance_cache()
    assert "NoCredentialsError" in line and "credentials come from the environment" in line, line


# ------------------------------------------------------------------ in process: a URL read as a local folder


def _checkpoint(folder, step: int, at: float) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint as the saver writes it (a file and its manifest, last), into a local folder or at a URL."""
    from launcher.base.storage import write_durably, write_file
    from launcher.checkpoint.format import MANIFEST, Position, checksum, record

    folder.mkdir(parents=True, exist_ok=True)
    write_file(folder / "rng_0.pt", bytes(range(256)) * 4)
    manifest = record(
        {"world_size": 1, "config_hash": "0" * 16},
        Position(step, 16 * step),
        at,
        {"rng_0.pt": 1024},
        {"rng_0.pt": checksum(folder / "rng_0.pt")},
    )
    write_durably(folder / MANIFEST, json.dumps(manifest))


@pytest.mark.unit
def test_a_url_is_read_as_a_local_folder_and_a_prefix_without_manifest_is_partial(tmp_path: Path) -> None:
    from launcher.base.storage import Remote, location, write_file
    from launcher.checkpoint.format import by_time, damage, is_partial, newest_intact, remove_partial, writing_folder

    remote, local = location(f"memory://launch-{uuid.uuid4().hex}/ckpts"), location(tmp_path / "ckpts")
    assert isinstance(remote, Remote) and isinstance(local, Path)
    for where in (remote, local):
        _checkpoint(where / _step(2), 2, 200.0)
        _checkpoint(where / _step(4), 4, 100.0)  # older by its manifest's time, whatever its step
        writing_folder(where, 6).mkdir(parents=True, exist_ok=True)
        write_file(writing_folder(where, 6) / "rng_0.pt", b"a save being written")  # no manifest yet
    assert writing_folder(remote, 6) == remote / _step(6) and writing_folder(local, 6).name == f".{_step(6)}.partial"
    assert is_partial(remote / _step(6)) and is_partial(writing_folder(local, 6)) and not is_partial(remote / _step(2))
    said: list[str] = []
    assert [p.name for p in by_time(remote, said.append)] == [p.name for p in by_time(local)] == [_step(2), _step(4)]
    assert said == []  # a save in progress is no checkpoint, and no skipped one either
    for where in (remote, local):
        file = where / _step(2) / "rng_0.pt"
        write_file(file, _flip_a_byte(file.read_bytes()))
    lines: list[str] = []
    assert newest_intact(remote, lines.append) == remote / _step(4)
    assert newest_intact(local, lines.append) == local / _step(4)
    assert lines[0].replace(str(remote), "X") == lines[1].replace(str(local), "X")
    assert "rng_0.pt fails its checksum (xxh3-128)" in lines[0] and damage(remote / _step(4)) is None
    for where in (remote, local):
        remove_partial(where)
    assert [p.name for p in remote.glob("step_*")] == [_step(2), _step(4)] and not writing_folder(local, 6).exists()


@pytest.mark.unit
@pytest.mark.parametrize(
    "args",
    [
        [*JOB, "trainer.checkpoint_dir=s3://KEYID:SECRETKEY@bucket/run"],
        ["-m", *JOB, "seed=1,2", "trainer.checkpoint_dir=s3://KEYID:SECRETKEY@bucket/run"],
        [*JOB, "resume=s3://KEYID:SECRETKEY@bucket/run"],
        ["plan", *JOB, "trainer.checkpoint_dir=s3://KEYID:SECRETKEY@bucket/run"],
        ["convert", "s3://KEYID:SECRETKEY@bucket/run", "out=weights.safetensors"],
        [*JOB, "trainer.checkpoint_dir=s3://KEYID@bucket/run"],  # a key alone: refused where the URL is checked
    ],
    ids=["run", "sweep", "resume", "plan", "convert", "key-alone"],
)
def test_a_url_with_credentials_is_refused_without_echoing_them(tmp_path: Path, args: list[str]) -> None:
    """Credentials in a URL are refused before Hydra logs, records or composes anything, in one line that names the
    URL masked; nothing is written."""
    from conftest import cli_here

    proc = cli_here(tmp_path, *args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("launch: error: ") and "s3://***@bucket/run" in line and "carries credentials" in line, line
    assert "KEYID" not in proc.stdout + proc.stderr and "SECRETKEY" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
def test_locations_and_urls_refused_before_any_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from launcher.base.storage import Remote, check_url, checkpoints_of, location, masked

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert location("s3://bucket/prefix/") == Remote("s3://bucket/prefix") and str(Remote("gs://b/p")) == "gs://b/p"
    assert location("file:///data/ckpt") == Path("/data/ckpt") and location("rel") == tmp_path / "rel"
    assert location("~/ckpt") == tmp_path / "home" / "ckpt"
    assert checkpoints_of({"checkpoint_dir": None}, tmp_path) == tmp_path / "checkpoints"
    assert checkpoints_of({"checkpoint_dir": "s3://b/run"}, tmp_path) == Remote("s3://b/run")
    assert (Remote("s3://b/run") / "step_1").is_relative_to(Remote("s3://b/run"))
    assert not Remote("s3://b/run2").is_relative_to(Remote("s3://b/run"))
    assert "fsspec knows no protocol nosuch://" in (check_url("nosuch://b/x") or "")
    assert "carries credentials" in (check_url("s3://AKIA:secret@bucket/x") or "")
    assert str(Remote("s3://AKIA:secret@bucket/x")) == "s3://***@bucket/x" and "secret" not in repr(
        Remote("s3://a:b@c")
    )
    assert masked("at postgresql://me:pw@db/s and s3://k@b/x, not in s3://b/k@x") == (
        "at postgresql://***@db/s and s3://***@b/x, not in s3://b/k@x"
    )
    if importlib.util.find_spec("gcsfs") is None:  # a known protocol whose package is not installed
        assert "gs:// protocol needs a package that is not installed (Please install gcsfs" in (
            check_url("gs://b/x") or ""
        )
