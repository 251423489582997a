"""Ctrl-C ends a run with one line that says what was kept and the exact --resume command, and the run resumes."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def runs_start_with_sigint_default():
    """A shell starts background jobs with SIGINT ignored, and a run that inherits that never sees Ctrl-C. While
    this test process catches SIGINT, the runs it starts begin with the default (exec resets caught signals)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _start(model_dir, data, out, cwd):
    flags = [
        "--model",
        str(model_dir),
        "--task",
        str(data),
        "--backend",
        "hf",
        "--iterations",
        "40",
        "--questions",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--context",
        "128",
        "--batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--epochs",
        "1",
        "--eval-every",
        "1000",
        "--eval-samples",
        "1",
        "--eval-limit",
        "2",
        "--save-every",
        "1",
        "--output-dir",
        str(out),
    ]
    return subprocess.Popen(
        [sys.executable, str(ROOT / "grpo_baseline.py"), *flags],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_foreground_signals,
    )


def _foreground_signals():
    """The run's stopping signals as a foreground run has them: a test runner started under nohup, or as a shell's
    background job, passes SIGHUP or SIGINT on ignored, and the run keeps an ignored signal ignored (cli.run_cli)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _wait_for(condition, process, timeout=180):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the run never reached the point to interrupt"
        time.sleep(0.05)


def _interrupt(process):
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and "Traceback" not in err, err[-3000:]
    return err.strip().splitlines()[-1]


def _resume(line, cwd):
    command = re.search(r"with: python (\S+) --resume (\S+)$", line)
    assert command, line
    resumed = subprocess.run(
        [sys.executable, str(ROOT / command.group(1)), "--resume", command.group(2), "--iterations", "3"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return Path(command.group(2))


@pytest.mark.parametrize("when", ["before the first checkpoint", "after a checkpoint"])
def test_ctrl_c_keeps_a_resumable_run(when, tiny_model_dir, gsm8k_jsonl, tmp_path):
    out = tmp_path / "runs"
    process = _start(tiny_model_dir, gsm8k_jsonl, out, tmp_path)
    if when == "before the first checkpoint":
        _wait_for(lambda: any(out.glob("*/starts.jsonl")), process)  # the start is recorded: the run is named
    else:
        _wait_for(lambda: any(out.glob("*/checkpoint/trainer_state.pt")), process)
    line = _interrupt(process)
    [run_dir] = out.iterdir()
    state = run_dir / "checkpoint" / "trainer_state.pt"
    if state.exists():  # the interrupt may land after the first save, whichever point was aimed at
        kept = torch.load(state, weights_only=True)["iteration"]
        assert line.startswith(f"interrupted: {run_dir} keeps its checkpoint of iteration {kept}; continue with:")
    else:
        assert when == "before the first checkpoint"
        assert line.startswith(f"interrupted before the first checkpoint: {run_dir} keeps its settings; start it again")
    assert _resume(line, tmp_path) == run_dir
    assert torch.load(state, weights_only=True)["iteration"] == 3
    starts = [json.loads(x) for x in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert [s["resumed"] for s in starts] == [False, True]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # each trained once, logged once
    assert sorted(m["iteration"] for m in metrics if "charts/reward" in m) == [1, 2, 3]


def test_sighup_ends_a_run_like_sigterm(tiny_model_dir, gsm8k_jsonl, tmp_path):
    """A closed terminal: the one line (where a terminal is left to show it), the lock released, exit 128 + 1."""
    out = tmp_path / "runs"
    process = _start(tiny_model_dir, gsm8k_jsonl, out, tmp_path)
    _wait_for(lambda: any(out.glob("*/checkpoint/trainer_state.pt")), process)
    process.send_signal(signal.SIGHUP)
    _, err = process.communicate(timeout=120)
    [run_dir] = out.iterdir()
    assert process.returncode == 129 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"interrupted: {run_dir} keeps its checkpoint of iteration")
    assert not (run_dir / "lock").exists()


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_while_the_first_is_handled_adds_nothing(second, tiny_model_dir, gsm8k_jsonl, tmp_path):
    out = tmp_path / "runs"
    process = _start(tiny_model_dir, gsm8k_jsonl, out, tmp_path)
    _wait_for(lambda: any(out.glob("*/checkpoint/trainer_state.pt")), process)
    process.send_signal(signal.SIGINT)
    for _ in range(20):  # whatever the first's handling is doing (a save, the lock, the line), until it exits
        time.sleep(0.01)
        if process.poll() is None:
            process.send_signal(second)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert sum(line.startswith("interrupted") for line in err.splitlines()) == 1, err[-3000:]
