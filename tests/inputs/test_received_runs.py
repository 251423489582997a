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
