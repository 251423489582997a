"""plumbing/tasks.py: the task registry and loading. A task added as one entry is known to the early check, loads,
trains and is graded by its answer kind; no module but the registry names the tasks."""

import ast
import doctest
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

import eval as ev
import grpo_baseline as grpo
from conftest import read_metrics, smoke_args
from plumbing import UsageError, models, tasks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return models.load_model(str(tiny_model_dir))


# ---- a Hub task added in one entry

# What the Hub would serve for "someone/arithmetic": a train and a test split, MATH-style columns.
ARITHMETIC = {
    "train": [
        {"problem": f"What is {a} + {b}?", "answer": a + b} for a, b in [(3, 4), (10, 5), (7, 8), (1, 1), (6, 9)]
    ],
    "test": [{"problem": f"What is {a} times {b}?", "answer": a * b} for a, b in [(2, 3), (4, 5), (6, 7)]],
}


@pytest.fixture
def arithmetic(monkeypatch) -> tasks.Task:
    """The task "arithmetic", a Hugging Face dataset, registered in one entry; the download serves ARITHMETIC."""
    asked = []

    def served(dataset_id, config, split):
        asked.append((dataset_id, config, split))
        return ARITHMETIC[split]

    monkeypatch.setattr(tasks, "hub_rows", served)
    # The one entry:
    monkeypatch.setitem(tasks.TASKS, "arithmetic", tasks.Task(tasks.hub("someone/arithmetic"), "expression"))
    yield tasks.TASKS["arithmetic"]
    assert set(asked) <= {("someone/arithmetic", None, "train"), ("someone/arithmetic", None, "test")}


def test_a_task_in_one_entry_is_known_to_the_early_check(arithmetic):
    assert tasks.task_problems("arithmetic", "test") == []
    assert tasks.task_problems("arithmetic", flag="--eval-task") == []
    assert tasks.default_eval_task("arithmetic") == "arithmetic"
    assert "arithmetic" in tasks.task_problems("arithmetic-2")[0]  # the unknown-task message lists it


def test_a_task_in_one_entry_loads_its_splits_with_prompts(arithmetic, tiny):
    _, tokenizer = tiny
    train, held_out = tasks.load_examples("arithmetic", "arithmetic", 96, 2, 0, tokenizer)
    assert [(e.question, e.answer) for e in train] == [(r["problem"], str(r["answer"])) for r in ARITHMETIC["train"]]
    assert [(e.question, e.answer) for e in held_out] == [("What is 2 times 3?", "6"), ("What is 4 times 5?", "20")]
    assert train[0].prompt == tasks.RHO_PROMPT.format(question="What is 3 + 4?")
    assert train[0].prompt_ids == tasks.encode_prompt(train[0].prompt, tokenizer)
    assert tasks.stop_strings("arithmetic", tokenizer) == [tasks.RHO_STOP]


def test_a_task_in_one_entry_trains(arithmetic, tiny_model_dir, tmp_path):
    summary = grpo.main(smoke_args(grpo, tiny_model_dir, "arithmetic", tmp_path, save_samples=1, save_questions=3))
    metrics = read_metrics(summary["run_dir"])
    assert [m["iteration"] for m in metrics if "charts/reward" in m] == [1, 2]
    assert all(v == v and abs(v) != float("inf") for m in metrics for v in m.values() if isinstance(v, float))
    assert {"eval/accuracy", "eval/majority_accuracy"} <= {key for m in metrics for key in m}
    asked = {row["problem"] for row in ARITHMETIC["train"]}
    sampled = Path(summary["run_dir"], "samples", "iter_1.jsonl").read_text().splitlines()
    assert sampled and {json.loads(line)["question"] for line in sampled} <= asked
    assert json.loads(Path(summary["run_dir"], "args.json").read_text())["task"] == "arithmetic"


def test_a_task_is_graded_by_its_entrys_answer_kind(arithmetic, monkeypatch):
    # "2.5e3" is the number 2500 to a numeric task; in an expression task's LaTeX it is 2.5 * e * 3.
    responses = ["The answer is 2.5e3.", "The answer is \\boxed{x+1}."]
    references = ["2500", "x+1"]
    assert tasks.answer_kind("arithmetic") == "expression"
    assert ev.grade(responses, references, "arithmetic") == [0.0, 1.0]
    assert tasks.check_references(references, "arithmetic") == [True, True]
    monkeypatch.setitem(tasks.TASKS, "arithmetic", replace(arithmetic, answer_kind="numeric"))
    assert ev.grade(responses, references, "arithmetic") == [1.0, 0.0]  # a reference that is no number: 0
    assert tasks.check_references(references, "arithmetic") == [True, False]


def test_a_task_with_one_split_reads_it_for_both(monkeypatch):
    monkeypatch.setattr(tasks, "hub_rows", lambda dataset_id, config, split: ARITHMETIC[split])
    monkeypatch.setitem(
        tasks.TASKS,
        "times",
        tasks.Task(tasks.hub("someone/times"), "numeric", splits={"train": "test", "test": "test"}),
    )
    assert tasks.load_task("times", "train") == tasks.load_task("times", "test")
    with pytest.raises(UsageError, match="--split 'dev' is not a split"):
        tasks.load_task("times", "dev")


def test_families_are_found_by_their_patterns():
    assert tasks.find("rg:chain_sum:max_digits=1") is tasks.TASKS["rg:*"]
    assert tasks.find("data/my task.jsonl") is tasks.TASKS["*.jsonl"]
    assert tasks.find("rg:data.jsonl") is tasks.TASKS["rg:*"]  # the first pattern that matches
    assert tasks.find("gsm9k") is None and tasks.find("data.json") is None
    assert tasks.default_eval_task("math") == "math500"


def test_the_unknown_task_message_lists_the_registry():
    assert tasks.task_problems("gsm9k") == [
        "--task: unknown task 'gsm9k': use gsm8k, math, math500, aime24, rg:<reasoning-gym dataset> or a .jsonl file"
    ]


# ---- no list of task names outside the registry

# The registry's task names that a search finds only where they are meant ("math" is also a word and a module).
SEARCHABLE = [name for name in tasks.TASKS if "*" not in name and re.search(r"\d", name)]
# The literal part of each family's pattern: "rg:" of "rg:*", ".jsonl" of "*.jsonl".
AFFIXES = [name.replace("*", "") for name in tasks.TASKS if "*" in name]


def outside_the_registry() -> list[Path]:
    return [ROOT / "eval.py", *sorted(p for p in (ROOT / "plumbing").glob("*.py") if p.name != "tasks.py")]


def names_in(line: str) -> set[str]:
    """The searchable task names a line names as words (not inside a model alias such as rho-1b-sft-gsm8k)."""
    return {name for name in SEARCHABLE if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", line)}


def decided_by_task_name(source: str) -> list[str]:
    """Code that compares a value with a task name, or tests a name for a family's prefix or suffix."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            constants = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            found += [f"line {node.lineno}: compares with {value!r}" for value in constants if value in SEARCHABLE]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("startswith", "endswith"):
            constants = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
            found += [f"line {node.lineno}: {node.func.attr}({value!r})" for value in constants if value in AFFIXES]
    return found


def test_no_module_but_the_registry_lists_or_decides_by_task_names():
    assert len(SEARCHABLE) >= 3 and AFFIXES  # gsm8k, math500, aime24; rg:, .jsonl
    for path in outside_the_registry():
        source = path.read_text()
        lists = [
            f"line {i}: {line.strip()}" for i, line in enumerate(source.splitlines(), 1) if len(names_in(line)) > 1
        ]
        assert not lists, f"{path.name} lists task names (only plumbing/tasks.py may): {lists}"
        decisions = decided_by_task_name(source)
        assert not decisions, f"{path.name} decides by a task's name (plumbing/tasks.py's entry says): {decisions}"


def test_the_search_sees_a_list_and_a_decision():
    assert names_in('if task in ("gsm8k", "math500", "aime24"):') == {"gsm8k", "math500", "aime24"}
    assert names_in("--model rho-1b-sft-gsm8k --task math500") == {"math500"}
    assert decided_by_task_name('numeric = task == "gsm8k" or task.startswith("rg:")') == [
        "line 1: compares with 'gsm8k'",
        "line 1: startswith('rg:')",
    ]


# ---- loading the built-in tasks


def test_the_worked_examples_in_docstrings_hold():
    result = doctest.testmod(tasks)
    assert result.failed == 0 and result.attempted >= 2


def test_jsonl_task_takes_the_answer_after_hashes_without_annotations(gsm8k_jsonl, tiny):
    _, tokenizer = tiny
    examples = tasks.load_task(str(gsm8k_jsonl), "train", tokenizer=tokenizer)
    assert examples[0].answer == "7" and examples[3].answer == "42"
    assert examples[0].prompt == "[MATH_TASK] Problem:\n" + examples[0].question + "\n\nSolution:"
    assert tokenizer.decode(examples[0].prompt_ids) == examples[0].prompt
    assert len(tasks.load_task(str(gsm8k_jsonl), "train", limit=3)) == 3


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"question": "a", "answer": "1"}\nnot json\n', "line 2 is not valid JSON"),
        ('{"question": "a"}\n', "line 1 needs"),
        ('{"question": "a", "answer": "#### "}\n', "row 1 has a missing or unparseable reference"),
        ("", "has no examples"),
    ],
)
def test_malformed_jsonl_is_rejected_with_the_row(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UsageError, match=message):
        tasks.load_task(str(path), "train")


def test_unknown_task_and_missing_file():
    with pytest.raises(UsageError, match="unknown task"):
        tasks.load_task("gsm9k", "train")
    with pytest.raises(UsageError, match="does not exist"):
        tasks.load_task("nowhere/data.jsonl", "train")


def test_reasoning_gym_task_has_disjoint_deduplicated_splits():
    name = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    train = tasks.load_task(name, "train", limit=300)
    test = tasks.load_task(name, "test", limit=50)
    assert len({e.question for e in train}) == len(train)
    assert not {e.question for e in train} & {e.question for e in test}
    assert all(e.question.endswith("=") and e.answer.lstrip("-").isdigit() for e in train)
    with pytest.raises(UsageError, match="key=value"):
        tasks.load_task("rg:chain_sum:max_digits", "train")


def test_hub_task_offline_is_one_clear_error():
    with pytest.raises(UsageError, match="Offline, use --task rg:chain_sum"):
        tasks.load_task("gsm8k", "test")
