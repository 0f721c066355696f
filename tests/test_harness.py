"""lm-evaluation-harness on a checkpoint: `launch eval CKPT harness.tasks=[...]` exports the checkpoint as a
transformers folder, runs lm-eval on it, prints its table and adds its figures to eval.json beside the launcher's;
the figures are lm-eval's own command line's on that folder, and a multiple-choice accuracy is the one computed by
hand from the folder's log-probabilities. Bad harness input is one line before any worker starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, clean_env, launch_here, launch_once

NAMES = ["data", "key", "name", "value", "size", "path", "mode", "count", "items", "parent", "config", "state"]
TEXTS = [
    "import os\nimport sys\n",
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    x = 0\n    y = 0\n",
    "for i in range(10):\n    print(i)\n",
]


def make_tasks(folder: Path) -> Path:
    """Two local lm-eval tasks over jsonl files (nothing downloaded): tiny_mc, multiple choice (a getter's attribute
    among four, one of them plausible Python), and tiny_ppl, loglikelihood_rolling over short Python texts."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(NAMES * 2):
        choices = [name, "}}{{", f"{name.upper()}!!", "  ::"]
        shift = i % 4
        choices = choices[shift:] + choices[:shift]
        rows.append(
            {"question": f"def get_{name}(self):\n    return self.", "choices": choices, "answer": choices.index(name)}
        )
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = "dataset_path: json\ntest_split: test\nmetadata:\n  version: 1.0\n"
    (folder / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n'
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'ppl.jsonl'}\n"
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: byte_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
        "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n"
    )
    return folder


def mc_by_hand(folder: Path, tasks: Path) -> tuple[float, float]:
    """tiny_mc's accuracy and byte-normalised accuracy, from the folder's model and tokenizer by plain transformers:
    each choice scored by Σ log p(choice's tokens | question), the highest (divided by its bytes, for acc_norm)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    positions = model.config.n_positions  # a longer question keeps its last tokens, as lm-eval's window does
    right = right_norm = 0
    rows = [json.loads(line) for line in (tasks / "mc.jsonl").read_text().splitlines()]
    for row in rows:
        context = tok(row["question"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in row["choices"]:
            ids = tok(choice, add_special_tokens=False)["input_ids"]
            whole = torch.tensor([(context + ids)[-(positions + 1) :]])
            with torch.no_grad():
                logp = model(input_ids=whole[:, :-1]).logits.double().log_softmax(-1)[0, -len(ids) :]
            scores.append(float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum()))
        right += max(range(4), key=lambda i: scores[i]) == row["answer"]
        normed = [s / len(c) for s, c in zip(scores, row["choices"], strict=True)]  # lm-eval's: by characters
        right_norm += max(range(4), key=lambda i: normed[i]) == row["answer"]
    return right / len(rows), right_norm / len(rows)


@pytest.mark.unit
@pytest.mark.long  # 15-35 s (lm-eval's imports and its run); the refusals below cover the harness's checks, the
# folder's logits tests/test_export.py's
def test_lm_eval_s_accuracy_on_an_exported_gpt_is_the_one_computed_by_hand(tmp_path: Path) -> None:
    """lm-eval run in process as `launch eval` runs it (`launcher.export.harness.evaluate`) on a random GPT's folder:
    tiny_mc's acc and acc_norm are the ones plain transformers gives by hand; eval.json's names are lm-eval's."""
    from omegaconf import OmegaConf

    from launcher.export.harness import evaluate, figures
    from launcher.export.transformers_folder import byte_tokenizer, export_gpt
    from launcher.models.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(n_layer=2, n_head=2, n_embd=32, vocab_size=256, block_size=64)
    export_gpt(gpt, dict(gpt.state_dict()), tmp_path / "hf", None)
    byte_tokenizer().save_pretrained(str(tmp_path / "hf"))
    tasks = make_tasks(tmp_path / "tasks")
    harness = OmegaConf.create({"include_path": str(tasks), "num_fewshot": None, "limit": None, "batch_size": 8})
    found = figures(evaluate(tmp_path / "hf", ["tiny_mc"], harness, "cpu"))
    acc, acc_norm = mc_by_hand(tmp_path / "hf", tasks)
    assert found["tiny_mc"]["acc"] == pytest.approx(acc, abs=1e-12)
    assert found["tiny_mc"]["acc_norm"] == pytest.approx(acc_norm, abs=1e-12)
    assert sorted(found["tiny_mc"]) == ["acc", "acc_norm", "acc_norm_stderr", "acc_stderr"]


EVAL = [o for o in TINY if not o.startswith("data=")]


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, said",
    [
        (["harness.tasks=[{tasks}/gone.yaml]"], "harness.tasks: {tasks}/gone.yaml is no file"),
        (["harness.tasks=[tiny_mc]", "harness.include_path={tasks}/gone"], "harness.include_path={tasks}/gone is no"),
        (["harness.tasks=[tiny_mc]", "data=synthetic"], "reads text through the run's tokenizer, and there is no toke"),
        (["harness.tasks=[tiny_mc]", "nodes=2"], "harness.tasks runs lm-eval in the launcher of one node, and nodes=2"),
    ],
    ids=["task-yaml", "include-path", "no-tokenizer", "nodes"],
)
def test_bad_harness_input_is_one_line_before_any_worker(extra: list[str], said: str, tmp_path: Path) -> None:
    tasks = make_tasks(tmp_path / "tasks")
    args = [a.format(tasks=tasks) for a in extra]
    data = [] if any(a.startswith("data=") for a in args) else ["data=pysource"]
    line = launch_here(tmp_path, "eval", str(tmp_path / "nothing"), *EVAL, *data, *args).refused()
    assert said.format(tasks=tasks) in line, line


@pytest.mark.unit
@pytest.mark.long  # 30-60 s: a name not found locally is looked up in lm-eval's index of its ~15,000 task files; the
# missing task YAML above is the default tier's task not found
def test_a_task_name_found_nowhere_is_one_line_naming_it(tmp_path: Path) -> None:
    tasks = make_tasks(tmp_path / "tasks")
    args = ["data=pysource", "harness.tasks=[tiny_mcq]", f"harness.include_path={tasks}"]
    line = launch_here(tmp_path, "eval", str(tmp_path / "nothing"), *EVAL, *args).refused()
    from launcher.export.harness import version

    assert f"harness.tasks: tiny_mcq is no task of lm-eval {version()} nor of harness.include_path={tasks}" in line, (
        line
    )
    assert "(close: tiny_mc" in line and "name one `lm-eval ls tasks` lists, or give a task YAML's path" in line


@pytest.mark.unit
def test_harness_tasks_in_a_training_run_or_without_lm_eval_are_one_line(tmp_path: Path, monkeypatch) -> None:
    tasks = make_tasks(tmp_path / "tasks")
    line = launch_here(
        tmp_path, *EVAL, "data=pysource", "harness.tasks=[tiny_mc]", f"harness.include_path={tasks}"
    ).refused()
    assert "harness.tasks=tiny_mc is run by `launch eval CHECKPOINT harness.tasks=[...]`" in line, line
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed: its import fails
    line = launch_here(
        tmp_path, "eval", str(tmp_path / "x"), *EVAL, "data=pysource", "harness.tasks=[tiny_mc]", name="x"
    ).refused()
    assert "needs lm-evaluation-harness (lm-eval 0.4), not installed: pip install 'launch[harness]'" in line, line


@pytest.mark.parametrize("strategy", ["fsdp"])
@pytest.mark.long  # 60-120 s (an evaluation at 2 ranks, lm-eval in it and its command line); the unit tests above cover
# the in-process evaluation and the refusals
def test_launch_eval_runs_the_harness_and_its_figures_are_lm_eval_s_command_line_s(
    suite, strategy, tmp_path: Path
) -> None:
    """`launch eval CKPT harness.tasks=[tiny_mc, .../tiny_ppl.yaml]` of FSDP's checkpoint at 2 ranks: lm-eval's table
    printed, eval.json holds the launcher's val_loss and the harness's figures, which are those `lm-eval run` gives on
    the same exported folder; tiny_mc's accuracy is the one computed by hand."""
    tasks = make_tasks(tmp_path / "tasks")
    checkpoint = suite.run_dir / "checkpoints" / "step_00000012"
    env = clean_env(tmp_path) | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    run = launch_once(
        tmp_path,
        "eval",
        str(checkpoint),
        "logger=none",
        "trainer.progress=false",
        f"harness.tasks=[tiny_mc,{tasks / 'tiny_ppl.yaml'}]",
        f"harness.include_path={tasks}",
        "harness.batch_size=4",
        name="evaluated",
        env=env,
    ).check()
    assert "|tiny_mc |" in run.stdout and "|tiny_ppl|" in run.stdout and "acc_norm" in run.stdout, run.stdout
    record = json.loads((run.run_dir / "eval.json").read_text())
    assert record["step"] == 12 and "val_loss" in record["figures"], record
    ours = record["harness"]["tasks"]
    folder = run.run_dir / "transformers"
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={folder}",
        "--tasks",
        "tiny_mc",
        str(tasks / "tiny_ppl.yaml"),
        "--include_path",
        str(tasks),
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        str(tmp_path / "cli"),
    ]
    cli = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    (written,) = (tmp_path / "cli").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]
    for task in ("tiny_mc", "tiny_ppl"):
        for metric, value in ours[task].items():
            assert theirs[task][f"{metric},none"] == value, (task, metric)
    assert set(ours["tiny_ppl"]) >= {"byte_perplexity", "bits_per_byte"}
    acc, acc_norm = mc_by_hand(folder, tasks)
    assert (ours["tiny_mc"]["acc"], ours["tiny_mc"]["acc_norm"]) == pytest.approx((acc, acc_norm), abs=1e-12)
