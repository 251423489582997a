"""Tests for the answer-grading section of eval.py (grade, check_reference)."""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import eval as eval_module
from eval import check_reference, grade, grade_failures

MINUS = "\u2212"
SLOW = r"\boxed{10^{10^{10^{10}}}}"  # interruptible, but never finishes
HUGE = r"\boxed{\operatorname{zeros}(30000,30000)}"  # ~7 GB without the limit

CASES = [
    # (task, response, reference, expected)
    ("gsm8k", "...\n#### 72", "72", 1.0),
    ("gsm8k", "Total is $1,234.", "1234", 1.0),
    ("gsm8k", "The answer is 72.0", "72", 1.0),
    ("gsm8k", "The answer is 3/4", "0.75", 1.0),
    ("gsm8k", "**Final Answer:** **72**", "72", 1.0),
    ("gsm8k", f"Answer: {MINUS}5", "-5", 1.0),
    ("gsm8k", "Answer: -5", f"{MINUS}5", 1.0),
    ("gsm8k", "-70", "70", 0.0),
    ("gsm8k", "1181860", "181860", 0.0),
    ("gsm8k", "The answer is 72 or 73", "72", 0.0),
    ("gsm8k", "", "72", 0.0),
    ("gsm8k", "The answer is 73.\n#### 72", "72", 1.0),
    ("rg:chain_sum", f"{MINUS}12", "-12", 1.0),
    ("data/train.jsonl", "so 4 + 1 = 5\n#### 5", "5", 1.0),
    ("math", r"$\boxed{\dfrac12}$", "0.5", 1.0),
    ("math", r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),
    ("math", r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    ("math", r"\boxed{(-\infty,3)}", r"(-\infty,3]", 0.0),
    ("math", r"\boxed{\{3,1,2\}}", r"\{1,2,3\}", 1.0),
    ("math", r"\boxed{x=5}", "5", 1.0),
    ("math", r"\boxed{3} then \boxed{5}", "5", 1.0),
    ("math", r"\boxed{2021}", r"\pm 2021", 0.0),
    ("math500", "", "5", 0.0),
    ("aime24", r"\boxed{033}", "33", 1.0),
]


@pytest.mark.parametrize("task,response,reference,expected", CASES,
                         ids=[f"{c[0]}:{c[1][:30]!r}->{c[2]!r}" for c in CASES])
def test_verdicts(task, response, reference, expected):
    assert grade([response], [reference], task) == [expected]


def test_batch_matches_single_items():
    responses = [c[1] for c in CASES if c[0] == "gsm8k"] * 10
    references = [c[2] for c in CASES if c[0] == "gsm8k"] * 10
    expected = [c[3] for c in CASES if c[0] == "gsm8k"] * 10
    assert grade(responses, references, "gsm8k") == expected


def test_long_response_is_fast():
    grade(["1"], ["1"], "gsm8k")  # start the pool outside the timing
    start = time.monotonic()
    assert grade(["lorem ipsum 12 $ " * 12_000 + "The answer is 72"], ["72"], "gsm8k") == [1.0]
    assert time.monotonic() - start < 2.0


def test_pathological_items_score_zero_and_others_survive():
    before = grade_failures()
    start = time.monotonic()
    scores = grade([HUGE, "The answer is 5", SLOW, r"\boxed{5}"], ["5"] * 4, "math", timeout=1.0)
    assert scores == [0.0, 1.0, 0.0, 1.0]
    assert time.monotonic() - start < 1.0 + eval_module._GRADE_HARD_GRACE + 1.0
    assert grade_failures() - before >= 1  # SLOW timed out; HUGE may fail inside math-verify


def test_hung_worker_is_killed(monkeypatch):
    # A negative grace makes the parent kill before the worker's own alarm fires,
    # as it would for a worker stuck in C code.
    monkeypatch.setattr(eval_module, "_GRADE_HARD_GRACE", -0.3)
    before = grade_failures()
    scores = grade([r"\boxed{7}", SLOW, r"\boxed{8}"], ["7", "7", "8"], "math", timeout=1.0, workers=1)
    assert scores == [1.0, 0.0, 1.0]
    assert grade_failures() - before == 1


def test_crashed_worker_is_replaced():
    grade(["1"], ["1"], "math", workers=1)
    pid = eval_module._grade_workers[0].pid
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    before = grade_failures()
    scores = grade([SLOW, r"\boxed{5}"], ["5", "5"], "math", timeout=5.0, workers=1)
    assert scores == [0.0, 1.0]
    assert grade_failures() - before == 1
    assert eval_module._grade_workers[0].pid != pid


def test_grade_from_non_main_thread():
    result = {}

    def run():
        result["scores"] = grade(["The answer is 72", SLOW, "#### 3"], ["72", "72", "4"],
                                 "gsm8k", timeout=1.0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert result.get("scores") == [1.0, 0.0, 0.0]


def test_grade_from_a_script_without_main_guard(tmp_path):
    # multiprocessing's spawn/forkserver would re-run this script in each worker ("bootstrapping phase" error).
    script = tmp_path / "plain_script.py"
    script.write_text(
        "import sys, threading\n"
        f"sys.path.insert(0, {str(Path(eval_module.__file__).parent)!r})\n"
        "from eval import grade\n"
        "print(grade(['The answer is 72', r'\\boxed{5}', 'no answer'], ['72', '5', '3'], 'math'))\n"
        "result = []\n"
        "thread = threading.Thread(target=lambda: result.append(grade(['#### 4', '#### 5'], ['4', '4'], 'gsm8k')))\n"
        "thread.start(); thread.join()\n"
        "print(result[0])\n"
        "print('top level ran')\n"
    )
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[1.0, 1.0, 0.0]", "[1.0, 0.0]", "top level ran"]  # once: never re-run


def test_grading_server_that_died_is_restarted():
    grade(["1"], ["1"], "gsm8k", workers=1)
    for w in eval_module._grade_workers:
        w.kill()
    eval_module._grade_server.proc.kill()
    eval_module._grade_server.proc.wait()
    assert grade(["#### 3", "#### 4"], ["3", "3"], "gsm8k", workers=1) == [1.0, 0.0]
    assert eval_module._grade_server.proc.poll() is None


@pytest.mark.parametrize("reference,task", [
    ("72", "gsm8k"), (f"{MINUS}5", "gsm8k"), ("1,234", "gsm8k"), ("0.75", "rg:chain_sum"),
    (r"\frac{\sqrt3}{2}", "math"), (r"\pm 2021", "math"), (r"(-\infty,3]", "math500"), ("33", "aime24"),
])
def test_check_reference_accepts(reference, task):
    assert check_reference(reference, task)


@pytest.mark.parametrize("reference,task", [
    ("", "gsm8k"), ("abc??", "gsm8k"), ("", "math"), ("abc??", "math"), ("x", "gsm8k"),
])
def test_check_reference_rejects(reference, task):
    assert not check_reference(reference, task)


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        grade(["1", "2"], ["1"], "gsm8k")


def test_unknown_task_raises():
    with pytest.raises(ValueError, match="unknown task"):
        grade(["1"], ["1"], "mmlu")
