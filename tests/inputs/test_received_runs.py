"""A run directory from someone else is data: its strings reach the terminal escaped, its --track is not taken, and
the numbers in its trainer_state.pt are range-checked like args.json's."""

import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import grpo_baseline as grpo
from conftest import smoke_args
from plumbing import UsageError, checkpoints, runs, settings, shown

ROOT = Path(__file__).resolve().parents[2]
ESCAPES = "\x1b]0;owned\x07\x1b[2J\r\x1b[32mforged line\x1b[0m\n\u202e"


def test_shown_escapes_every_control_character_and_keeps_the_rest():
    assert shown("a\x1b[2Jb\nc\td\x7f\x85\u2028\u202e é 中 ok") == (
        "a\\x1b[2Jb\\x0ac\\x09d\\x7f\\x85\\u2028\\u202e é 中 ok"
    )
    assert shown(3) == "3"


def _received_run(tmp_path: Path, **changes) -> Path:
    """A run directory as someone else could have written it: args.json with `changes`."""
    run_dir = tmp_path / "received"
    run_dir.mkdir()
    saved = {**asdict(grpo.Args(model="my/model", task="gsm8k", iterations=3)), **changes}
    (run_dir / "args.json").write_text(json.dumps(saved))
    return run_dir


def _command(*flags, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "grpo_baseline.py"), *flags], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_strings_of_a_received_args_json_reach_the_terminal_escaped(tmp_path):
    run_dir = _received_run(tmp_path, exp_name=f"x{ESCAPES}", model=f"my/model{ESCAPES}")
    result = _command("--resume", str(run_dir), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "\x1b" not in result.stdout + result.stderr and "\u202e" not in result.stdout
    assert "\\x1b]0;owned\\x07" in result.stdout and "forged line" in result.stdout
    assert not any(line.startswith("\x1b[32mforged") or line == "forged line" for line in result.stdout.splitlines())


def test_an_error_line_quoting_a_received_string_is_escaped(tmp_path):
    result = _command("--resume", str(tmp_path / f"gone{ESCAPES}"), cwd=tmp_path)
    assert result.returncode != 0
    assert result.stderr.strip().startswith("error: --resume") and len(result.stderr.strip().splitlines()) == 1
    assert "\x1b" not in result.stderr and "\\x1b[2J" in result.stderr


def test_track_is_never_taken_from_a_received_args_json(tmp_path):
    run_dir = _received_run(tmp_path, track=True)
    assert settings.saved_settings(grpo.Args, run_dir).track is False


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_track_without_wandb_is_one_line_before_anything_loads(tmp_path):
    result = _command("--model", str(tmp_path / "no-model"), "--task", "gsm8k", "--track", cwd=tmp_path)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "--track" in result.stderr and "pip install wandb" in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, gsm8k_jsonl):
    folder = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as patch:  # fp32, as the autouse fixture would (module scope runs before it)
        from plumbing import precision

        flags = precision.cpu_flags
        patch.setattr(precision, "cpu_flags", lambda: flags() - precision.BF16_CPU_FLAGS)
        summary = grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, folder, iterations=2))
    return Path(summary["run_dir"])


@pytest.mark.parametrize(
    "change, named",
    [
        ({"iteration": -1}, "iteration of -1"),
        ({"iteration": 10**9}, "iteration 1000000000, past the 2"),
        ({"world_size": 0}, "world size of 0"),
        ({"world_size": "two"}, "world size of 'two'"),
    ],
)
def test_numbers_in_a_received_trainer_state_are_range_checked(change, named, trained, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    state_path = run_dir / "checkpoint" / "trainer_state.pt"
    state = torch.load(state_path, weights_only=True)
    torch.save({**state, **change}, state_path)
    args = settings.saved_settings(grpo.Args, run_dir)
    args.resume = str(run_dir)
    with pytest.raises(UsageError, match=named.replace("(", r"\(")):
        runs.locate_run(args)
    assert checkpoints.load_trainer_state(trained / "checkpoint")["iteration"] == 2  # the original is untouched


def _copied(trained: Path, tmp_path: Path) -> tuple[Path, object]:
    """A copy of the trained run, and the Args a --resume of it takes (its own settings)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    args = settings.saved_settings(grpo.Args, run_dir)
    args.resume = str(run_dir)
    return run_dir, args


def _edit_first_start(run_dir: Path, **changes) -> None:
    lines = (run_dir / "starts.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    for dotted, value in changes.items():
        outer, _, inner = dotted.partition("__")
        if inner:
            first[outer][inner] = value
        else:
            first[outer] = value
    (run_dir / "starts.jsonl").write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")


@pytest.mark.parametrize(
    "change, named",
    [
        ({"memory__sampler_batch_tokens": -5}, "memory.sampler_batch_tokens is -5, not a positive number"),
        ({"memory__sampler_batch_tokens": 1.5}, "memory.sampler_batch_tokens is 1.5"),
        ({"memory__sampler_batch_tokens": True}, "memory.sampler_batch_tokens is true"),
        ({"memory": [1]}, "memory is [1], not an object"),
        ({"fingerprints__task": "\x1b[2Jforged"}, r'fingerprints.task is "\u001b[2Jforged", not a fingerprint'),
        ({"fingerprints": "abc"}, 'fingerprints is "abc", not an object'),
    ],
)
def test_values_read_back_from_starts_jsonl_are_range_checked(change, named, trained, tmp_path):
    run_dir, args = _copied(trained, tmp_path)
    _edit_first_start(run_dir, **change)
    with pytest.raises(UsageError, match=r"starts.jsonl line 1 \(the run's first start\): .*") as error:
        runs.locate_run(args)
    assert named in str(error.value) and "\n" not in str(error.value) and "\x1b" not in str(error.value)


def test_a_task_file_rewritten_under_the_same_path_is_refused(trained, tmp_path):
    """The run records its task file's fingerprint (every byte: it samples from every row) at its first start; a file
    rewritten under the path args.json names is other data, refused, as it is at a new path."""
    import shutil

    run_dir, args = _copied(trained, tmp_path)
    task = tmp_path / "task.jsonl"
    shutil.copy(args.task, task)  # the same bytes, under a path this test may rewrite
    saved = json.loads((run_dir / "args.json").read_text())
    (run_dir / "args.json").write_text(json.dumps({**saved, "task": str(task)}))
    args.task = str(task)
    runs.locate_run(args)  # the same bytes: resumes
    rows = [json.loads(line) for line in task.read_text().splitlines() if line.strip()]
    task.write_text("".join(json.dumps({**row, "answer": row["answer"] + "1"}) + "\n" for row in rows))
    with pytest.raises(UsageError, match=r"its task .*task.jsonl was rewritten since the run started \(fingerprint"):
        runs.locate_run(args)
    task.unlink()
    with pytest.raises(UsageError, match=r"its task .*task.jsonl is not there any more"):
        runs.locate_run(args)
