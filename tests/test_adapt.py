"""Runs that adapt without changing their result (`launcher.recovery.adapt`): batch.micro_size=auto, halved after an
out-of-memory error by a restart of the worker group, trains the trajectory of a run that used the smaller
micro-batch from the start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import LAUNCH, TINY, clean_env, launch
from processes import listening, until

ADAPTIVE = [
    *TINY,
    "model._target_=faulty.SmallMemoryGPT",
    "+model.fits=2",  # micro-batches of 8 and 4 run out of memory; 2 fits
    "+model.at_call=5",  # after a few steps, so that the restarted group resumes from a checkpoint
    "batch.global_size=16",
    "trainer.max_steps=8",
    "trainer.checkpoint_every=2",
    "trainer.collective_timeout=60",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The same run at micro-batch 2 from the start (the model never runs out of memory there)."""
    run = launch(tmp_path_factory.mktemp("reference"), *ADAPTIVE, "batch.micro_size=2")
    assert run.returncode == 0, run.stderr
    return {int(m["step"]): m["loss"] for m in run.metrics}


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("zero2", marks=pytest.mark.long)])  # a torch optimizer and
# DeepSpeed's (the long tier: ~15 s), rebuilt at the new size
def test_an_out_of_memory_error_halves_the_micro_batch_and_keeps_the_trajectory(
    strategy: str, reference: dict[int, float], tmp_path: Path
) -> None:
    run = launch(tmp_path, *ADAPTIVE, f"strategy={strategy}", "batch.micro_size=auto")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "auto: batch.micro_size=8 (accumulation 1 at world size 2)" in run.stdout, run.stdout
    for before, after in ((8, 4), (4, 2)):  # each change said in a line, by the rank that ran out of memory
        said = "ran out of memory in forward/backward of step"
        assert any(
            said in line and f"at micro-batch {before}; the worker group restarts at micro-batch {after}" in line
            for line in (
                run.stdout + "".join(p.read_text() for p in (run.run_dir / "logs").rglob("*.log"))
            ).splitlines()
        ), run.stdout
    metrics = run.metrics
    sizes = [(int(m["micro_size"]), int(m["accumulation"])) for m in metrics]
    assert sizes[0] == (8, 1) and sizes[-1] == (2, 4) and (4, 2) in sizes, sizes  # carried across later restarts
    assert [int(m["restart"]) for m in metrics][-1] == 2
    # Every logged step, the redone ones too, is the reference's step: the trajectory never changed.
    worst = max(abs(m["loss"] - reference[int(m["step"])]) for m in metrics)
    assert worst <= 1e-6, worst
    assert sorted({int(m["step"]) for m in metrics}) == sorted(reference)


ELASTIC = [
    *TINY,
    "model._target_=faulty.SlowGPT",
    "batch.global_size=8",
    "batch.micro_size=2",  # accumulation 2 at world size 2, 4 at world size 1
    "trainer.max_steps=40",
    "trainer.checkpoint_every=2",
    "trainer.collective_timeout=60",
]


def _node(tmp_path: Path, port: int, name: str, data: list[str]) -> subprocess.Popen[str]:
    """One node of an elastic job of one or two one-rank nodes on loopback, in a session of its own (to be killed
    whole); its output in files (a pipe nobody reads would stall it). Each forward sleeps 0.25 s while the file
    `tmp_path/slow` exists (a step of the survivor alone takes a second: time for a node to join before the run
    ends), and none once the test removes it."""
    overrides = [
        *ELASTIC,
        *data,
        "+model.sleep_s=0.25",
        "+model.slow_rank=null",
        f"+model.while_there={tmp_path / 'slow'}",
        "nodes=1:2",
        "gpus=1",
        "trainer.max_restarts=3",
        f"rdzv.endpoint=127.0.0.1:{port}",
        "rdzv.id=elastic",
        "rdzv.last_call_timeout=2",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    out = open(tmp_path / f"{name}.out", "w")
    return subprocess.Popen(
        [LAUNCH, *overrides],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.long  # ~60 s: three launchers; the memory tier's nodes=3:4 and the scale tier's elastic 16 resize too
def test_an_elastic_job_goes_on_at_the_nodes_it_has_and_keeps_its_trajectory(tmp_path: Path) -> None:
    """Two one-rank nodes train together; one is killed whole mid-run, and the survivor goes on alone at twice the
    accumulation; a third node joining later brings the world back to 2, and a fourth, one too many, is refused in
    one line. Every logged step's loss, the redone ones too, is an uninterrupted run's. The data is a token store
    (data=store) that `launch prepare` built."""
    from conftest import cli_here
    from text_corpus import documents, train_tokenizer, write_jsonl

    for i in range(2):
        write_jsonl(tmp_path / "corpus" / f"{i}.jsonl", documents(60, seed=i))
    tokenizer = train_tokenizer(tmp_path / "tokenizer", documents(100))
    built = cli_here(
        tmp_path,
        "prepare",
        "data=text",
        f"data.files={tmp_path / 'corpus'}",
        f"data.tokenizer={tokenizer}",
        f"out={tmp_path / 'store'}",
        "block_size=4KiB",
    )
    assert built.returncode == 0, built.stderr
    data = ["data=store", f"data.url={tmp_path / 'store'}", "data.seq_len=32"]
    reference = subprocess.Popen(
        [LAUNCH, *ELASTIC, *data, "+model.sleep_s=0", "gpus=2", f"hydra.run.dir={tmp_path / 'reference'}"],
        cwd=tmp_path,
        env=clean_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    (tmp_path / "slow").touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = _node(tmp_path, port, "first", data)  # binds the rendezvous store: the node that stays
    until(lambda: listening(port), first, what="the rendezvous store")
    second = _node(tmp_path, port, "second", data)
    metrics = tmp_path / "run" / "metrics.jsonl"

    def sizes() -> list[int]:
        return (
            [int(json.loads(line)["world_size"]) for line in metrics.read_text().splitlines()]
            if metrics.exists()
            else []
        )

    until(lambda: sizes()[-4:] == [2] * 4, first, second, what="four steps at world size 2")
    os.killpg(second.pid, signal.SIGKILL)
    second.wait()
    killed = len(sizes())
    until(lambda: 1 in sizes()[killed:], first, what="a step of the survivor alone")
    alone = killed + sizes()[killed:].index(1)
    third = _node(tmp_path, port, "third", data)
    until(lambda: 2 in sizes()[alone:], first, third, what="a step at world size 2 again")
    fourth = _node(tmp_path, port, "fourth", data)  # the job has its 2 nodes: refused, the job untouched
    assert fourth.wait(timeout=300) != 0
    said = [line for line in (tmp_path / "fourth.out").read_text().splitlines() if line.startswith("launch: error")]
    assert said == [
        "launch: error: job 'elastic' runs on its 2 nodes already (the most its nodes= allows): this node is not "
        "needed; start it again once a node has left, or start the job with a larger maximum"
    ], (tmp_path / "fourth.out").read_text()
    (tmp_path / "slow").unlink()  # the rest at full speed
    assert first.wait(timeout=300) == 0 and third.wait(timeout=300) == 0, (tmp_path / "first.out").read_text()
    assert reference.wait(timeout=300) == 0, reference.stderr.read()  # type: ignore[union-attr]
    expected = {int(m["step"]): m["loss"] for m in map(json.loads, (tmp_path / "reference" / "metrics.jsonl").open())}
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert int(logged[alone]["accumulation"]) == 4 and int(logged[alone]["restart"]) >= 1  # after the lost node
    assert max(abs(m["loss"] - expected[int(m["step"])]) for m in logged) <= 1e-6
    assert {int(m["step"]) for m in logged} == set(expected)
    assert logged[-1]["world_size"] == 2 and logged[-1]["step"] == 40


@pytest.mark.unit
def test_an_elastic_range_is_refused_where_a_cluster_fixes_the_number_of_nodes() -> None:
    """A SLURM allocation has its nodes: nodes=MIN:MAX is for nodes started by hand (one line, naming both)."""
    from hydra import compose, initialize_config_module

    from launcher.config import ConfigError, derive, freeze, schema
    from launcher.elastic.rendezvous import rendezvous

    schema.register()
    with initialize_config_module("launcher.conf", version_base="1.3"):
        cfg = freeze(
            compose(
                "config",
                overrides=[
                    "nodes=1:2",
                    "gpus=1",
                    "trainer.max_restarts=2",
                    "device=cpu",
                    "rdzv.id=x",
                    "rdzv.endpoint=127.0.0.1:29500",
                ],
            )
        )
    slurm = {
        "SLURM_JOB_ID": "5",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "h[1-2]",
        "SLURM_NTASKS_PER_NODE": "1",
    }
    with pytest.raises(ConfigError, match=r"^nodes=1:2 is an elastic range, but a slurm job has a fixed number of"):
        rendezvous(cfg, derive(cfg, cuda_devices=0), slurm)
    local = rendezvous(cfg, derive(cfg, cuda_devices=0), {})  # by hand: the c10d rendezvous, with its last call
    assert local.backend == "c10d" and local.configs["last_call_timeout"] == 30


@pytest.mark.unit
@pytest.mark.parametrize(
    "record, micro, words",
    [
        ("{micro_size: 2", "auto", "adapted.json cannot be read (Expecting property name"),
        (
            '{"micro_size": 3}',
            "auto",
            "adapted.json holds micro_size 3, which this job never runs at (the sizes that "
            "divide its global batch over each world size: 1, 2, 4, 8)",
        ),
        ('{"micro_size": 1000}', "auto", "adapted.json holds micro_size 1000, which this job never runs at"),
        ('{"micro_size": "2"}', "auto", "adapted.json holds no positive micro_size"),
        ("not json", "4", "adapted.json cannot be read"),  # data of the run directory, whatever the micro-batch
    ],
)
def test_a_damaged_adapted_record_is_refused_in_one_line_and_left_as_it_is(
    tmp_path: Path, record: str, micro: str, words: str
) -> None:
    """`<run dir>/adapted.json` is data like the rest of the run directory: a record the launcher never writes (not
    JSON, a micro-batch the job cannot run at) is refused, not ignored for the planner's own pick."""
    from conftest import cli_here

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "adapted.json").write_text(record)
    proc = cli_here(
        tmp_path, *TINY, "gpus=2", "batch.global_size=16", f"batch.micro_size={micro}", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"launch: error: {run_dir / 'adapted.json'}") and words in line, line
    assert line.endswith("remove it to plan the micro-batch afresh"), line
    assert (
        sorted(p.name for p in run_dir.iterdir()) == ["adapted.json"]
        and (run_dir / "adapted.json").read_text() == record
    )
