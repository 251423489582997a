"""Inputs nobody checked: an oversized task row, a huge task file under --limit, a mistyped model path, a full disk
or a killed process during the SmolLM2 conversion, damaged viewer inputs. Each is one clear line, found cheaply."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import viewer
from conftest import write_jsonl
from plumbing import UsageError, files, models, tasks

ROOT = Path(__file__).resolve().parents[2]


def gsm8k_rows(count: int, start: int = 0) -> list[dict]:
    return [
        {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(start, count)
    ]


class RecordingTokenizer:
    """Stands in for a tokenizer and records the length of every text it is asked to encode."""

    chat_template = None

    def __init__(self):
        self.lengths = []

    def __call__(self, text, add_special_tokens=True):
        self.lengths.append(len(text))
        return {"input_ids": [1] * (len(text) // 4 + 1)}


# ----------------------------------------------------------------------------------------------
# A. Task files: oversized rows, --limit


def test_an_oversized_question_or_answer_is_dropped_before_any_tokenizer_sees_it(tmp_path):
    rows = gsm8k_rows(3)
    rows.insert(1, {"question": "x" * (files.MAX_QUESTION_CHARS + 1), "answer": "#### 1"})
    rows.append({"question": "What is 9 + 9?", "answer": "y" * files.MAX_ANSWER_CHARS + "\n#### 18"})
    path = write_jsonl(tmp_path / "task.jsonl", rows)
    tokenizer = RecordingTokenizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        examples = tasks.load_task(str(path), "train", tokenizer=tokenizer)
    assert [e.question for e in examples] == [r["question"] for r in gsm8k_rows(3)]
    assert tokenizer.lengths and max(tokenizer.lengths) < 1_000  # neither long row was ever encoded
    dropped = [str(w.message) for w in caught if "dropped" in str(w.message)]
    assert len(dropped) == 1 and "\n" not in dropped[0]
    assert f"{path}: dropped 2 rows" in dropped[0] and "100,000 characters" in dropped[0] and "line 2" in dropped[0]

    # The training scripts' call: train and held-out questions both come without the long rows, none encoded.
    tokenizer = RecordingTokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train, held_out = tasks.load_examples(str(path), str(path), 10_000, None, 0, tokenizer)
    assert len(train) == len(held_out) == 3 and max(tokenizer.lengths) < 1_000


def test_a_file_of_only_oversized_rows_is_one_error_naming_the_file_and_the_limit(tmp_path):
    path = write_jsonl(tmp_path / "huge.jsonl", [{"question": "q" * 200_000, "answer": "#### 1"}] * 2)
    tokenizer = RecordingTokenizer()
    with pytest.raises(UsageError) as error:
        tasks.load_task(str(path), "test", tokenizer=tokenizer)
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "100,000 characters" in message
    assert tokenizer.lengths == []


def test_limit_is_applied_while_reading_a_large_file(tmp_path, monkeypatch):
    # 200,000 rows, the first two the same question, and a last line that is not JSON: reading the whole file (as
    # before) would raise, and would check 200,000 references.
    rows = gsm8k_rows(1) + gsm8k_rows(200_000)
    path = tmp_path / "large.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "not json\n")
    lines_read, references_checked = [], []
    read_lines, check_references = files.read_lines, tasks.check_references

    def counting_read_lines(*args, **kwargs):
        for item in read_lines(*args, **kwargs):
            lines_read.append(item[0])
            yield item

    def counting_check_references(references, task):
        references_checked.extend(references)
        return check_references(references, task)

    monkeypatch.setattr(files, "read_lines", counting_read_lines)
    monkeypatch.setattr(tasks, "check_references", counting_check_references)
    examples = tasks.load_task(str(path), "test", limit=2)
    assert [(e.question, e.answer) for e in examples] == [("What is 0 + 1?", "1"), ("What is 1 + 1?", "2")]
    assert lines_read == [1, 2, 3]  # the duplicate on line 2 is skipped, as it always was; then reading stops
    assert references_checked == ["1", "2"]


def test_limit_takes_the_same_examples_as_loading_everything(tmp_path):
    path = write_jsonl(tmp_path / "task.jsonl", gsm8k_rows(5) + gsm8k_rows(3) + gsm8k_rows(12, start=5))
    everything = [(e.question, e.answer) for e in tasks.load_task(str(path), "train")]
    assert len(everything) == 12
    for limit in (1, 5, 6, 12, 40):
        assert [(e.question, e.answer) for e in tasks.load_task(str(path), "train", limit=limit)] == everything[:limit]


# ----------------------------------------------------------------------------------------------
# B. Models: a mistyped directory, a full disk, a conversion killed midway


def test_a_mistyped_local_model_directory_says_it_does_not_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path was sent to transformers (and the Hub)")

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", no_hub)
    with pytest.raises(UsageError) as error:
        models.load_model("models/tny")
    message = str(error.value)
    assert "\n" not in message and "the directory models/tny does not exist" in message
    assert "did you mean models/tiny?" in message and ", ".join(models.ALIASES) in message
    assert "Hub" not in message.replace("Hugging Face id", "") and "connect" not in message
    with pytest.raises(UsageError, match=r"the directory ./missing-dir does not exist; give a model directory"):
        models.load_model("./missing-dir")
    # The rule, stated in is_local_path's docstring.
    for name in ("./x", "../x", "/x", "~/x", ".x", "a/b/c", "org/name/", "models/tny", "models\\tny"):
        assert models.is_local_path(name), name
    for name in ("Qwen/Qwen2.5-Math-7B", "gpt2", "rho-1b-sft-gsm8k", "smollm2-135m"):
        assert not models.is_local_path(name), name
    assert models.model_directory_problem("Qwen/Qwen2.5-Math-7B") is None  # no ./Qwen here: a Hub id


def fake_gguf(tmp_path: Path, monkeypatch) -> Path:
    gguf = tmp_path / "package" / "model.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(models, "smollm2_gguf", lambda: gguf)
    return gguf


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # safetensors' writer raises its own error type, which says it only in its text
        type("SafetensorError", (Exception,), {})(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
    ],
)
def test_a_full_disk_during_the_smollm2_conversion_names_the_disk_not_the_package(tmp_path, monkeypatch, failure):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPO_CACHE", str(cache))
    fake_gguf(tmp_path, monkeypatch)

    def save_fails(*args, **kwargs):
        raise failure

    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", save_fails)
    with pytest.raises(UsageError) as error:
        models.smollm2_dir()
    message = str(error.value)
    assert "\n" not in message and f"the disk holding the model cache {cache} is full" in message
    assert "needs about 542 MB" in message and "MB free" in message and "SPO_CACHE" in message
    assert "einstall" not in message
    assert list(cache.iterdir()) == []  # nothing cached, no staging directory left


def test_a_killed_conversion_leaves_a_staging_directory_the_next_conversion_removes(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    gguf = fake_gguf(tmp_path, monkeypatch)
    # A conversion in another process, killed (SIGKILL: no finally runs) while it writes its staging directory.
    code = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; from plumbing import models\n"
        f"models.smollm2_gguf = lambda: Path({str(gguf)!r})\n"
        "def slow(*args, **kwargs):\n    time.sleep(600)\n"
        "models.AutoTokenizer.from_pretrained = slow\nmodels.smollm2_dir()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "SPO_CACHE": str(cache)})
    deadline = time.time() + 120
    while not (cache.is_dir() and any(cache.glob(".staging-*"))) and time.time() < deadline:
        time.sleep(0.2)
    [killed] = list(cache.glob(".staging-*"))
    (killed / "model.safetensors").write_bytes(b"\0" * 1_000_000)  # what it had written so far
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert killed.name.startswith(f".staging-{socket.gethostname()}-{process.pid}-")
    running = cache / f".staging-{socket.gethostname()}-{os.getpid()}-abc123"  # a live process's conversion
    running.mkdir()
    unowned_old, unowned_recent = cache / ".staging-k2j4h5", cache / ".staging-q8w7e6"  # names without a process
    unowned_old.mkdir()
    unowned_recent.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(unowned_old, (two_days_ago, two_days_ago))

    def conversion_fails(*args, **kwargs):
        raise OSError("the GGUF file is damaged")

    monkeypatch.setenv("SPO_CACHE", str(cache))
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", conversion_fails)
    with pytest.raises(UsageError, match="converting .* failed"):
        models.smollm2_dir()  # the next conversion (failing here, at once)
    assert sorted(p.name for p in cache.iterdir()) == sorted([running.name, unowned_recent.name])


# ----------------------------------------------------------------------------------------------
# C. viewer.py: damaged inputs are one line each


def response_record() -> dict:
    return {
        "algorithm": "grpo",
        "iteration": 1,
        "question_index": 0,
        "question": "What is 3 + 4?",
        "reference": "7",
        "prompt": "Problem: 3 + 4",
        "reward": 1.0,
        "finish_reason": "stop",
        "token_ids": [5, 6],
        "tokens": ["7", "."],
        "probs": [0.9, 0.4],
        "advantages": [0.5, 0.5],
        "loss_mask": [1, 1],
    }


def deep_tree_line(depth: int) -> str:
    """A spo_tree samples record whose tree is `depth` nodes deep, written as text (json.dumps would recurse)."""
    node = '"token_ids":[1],"tokens":["a"],"probs":[0.5],"loss_mask":[1],"value":0.5,"advantage":0.1'
    head = '{"algorithm":"spo_tree","iteration":1,"question_index":0,"question":"q","reference":"1","prompt":"p",'
    return head + '"tree":' + ("{" + node + ',"children":[') * depth + "]}" * depth + "}\n"


def make_run(directory: Path) -> Path:
    (directory / "samples").mkdir(parents=True)
    (directory / "args.json").write_text(json.dumps({"exp_name": "grpo", "seed": 0}))
    (directory / "samples" / "iter_1.jsonl").write_text(json.dumps(response_record()) + "\n")
    (directory / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "charts/reward": 0.5}) + "\n")
    return directory


def damage(run: Path, case: str) -> Path:
    """Damage `run` as `case` says; returns the file the error must name."""
    if case == "samples not UTF-8":
        path = run / "samples" / "iter_1.jsonl"
        path.write_bytes(json.dumps(response_record()).encode().replace(b"3 + 4", b"3 \xd7 4") + b"\n")
    elif case == "metrics not UTF-8":
        path = run / "metrics.jsonl"
        path.write_bytes(b'{"iteration": 1, "charts/reward": 0.5, "note": "caf\xe9"}\n')
    elif case in ("args.json a list", "args.json a list (curves)"):
        path = run / "args.json"
        path.write_text("[1, 2]")
    elif case == "samples path a directory":
        path = run / "samples" / "iter_2.jsonl"
        path.mkdir()
    elif case == "tree 5,000 deep":
        path = run / "samples" / "iter_1.jsonl"
        path.write_text(deep_tree_line(5_000))
    return path


def viewer_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "viewer.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize(
    "case, command, text",
    [
        ("samples not UTF-8", "html", "is not UTF-8 text"),
        ("metrics not UTF-8", "curves", "is not UTF-8 text"),
        ("args.json a list", "html", "holds a JSON list, not a JSON object"),
        ("args.json a list (curves)", "curves", "holds a JSON list, not a JSON object"),
        ("samples path a directory", "html", "is a directory, not a file"),
        ("tree 5,000 deep", "html", "nests deeper than the JSON reader allows"),
    ],
)
def test_each_damaged_viewer_input_is_one_error_line_naming_the_file(tmp_path, case, command, text):
    run = make_run(tmp_path / "run")
    output = tmp_path / ("view.html" if command == "html" else "curves.png")
    assert viewer_cli(command, str(run), "-o", str(output)).returncode == 0  # the undamaged run works
    output.unlink()
    path = damage(run, case)
    result = viewer_cli(command, str(run), "-o", str(output))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and str(path) in result.stderr and text in result.stderr
    assert not output.exists()


def test_the_viewer_walks_trees_without_recursion():
    def node(children, value=0.5):
        return {
            "token_ids": [1],
            "tokens": ["a"],
            "probs": [value],
            "loss_mask": [1],
            "value": value,
            "children": children,
        }

    def finite_by_recursion(value):  # the definition finite() keeps
        if isinstance(value, float):
            return value if value == value and abs(value) != float("inf") else None
        if isinstance(value, list):
            return [finite_by_recursion(v) for v in value]
        if isinstance(value, dict):
            return {key: finite_by_recursion(v) for key, v in value.items()}
        return value

    normal = {"1": [{"tree": node([node([], float("nan")), node([node([], float("-inf"))], 1)])}], "2": []}
    assert viewer.finite(normal) == finite_by_recursion(normal)
    assert list(viewer.finite(normal)["1"][0]["tree"]["children"][0]) == list(node([]))  # key order kept
    deep = node([])
    for _ in range(50_000):  # far deeper than Python's recursion limit
        deep = node([deep], float("nan"))
    viewer.check_node(deep, "here")
    copy = viewer.finite(deep)
    assert copy["probs"] == [None] and copy["children"][0]["children"][0]["value"] is None
    bad = deep
    for _ in range(49_999):
        bad = bad["children"][0]
    bad["children"][0]["children"].append({"token_ids": []})  # a broken node at the bottom is still found
    with pytest.raises(UsageError, match="here: a tree node lacks one of"):
        viewer.check_node(deep, "here")
    with pytest.raises(UsageError, match="nests too deep to embed in the page"):
        viewer.page_json({"runs": [copy]})
