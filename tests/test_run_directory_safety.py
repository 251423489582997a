"""A run directory from someone else is data, never code: no .pt file it holds runs code as it loads, and no write of
a resumed run follows a symbolic link out of it."""

import ast
import os
import shutil
from pathlib import Path

import pytest
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from conftest import smoke_args
from plumbing import UsageError, checkpoints, cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [spo_chain, spo_tree, grpo_baseline, ppo_baseline]


class Payload:
    """Pickles to a call of exec(code): what a crafted trainer_state.pt would run with weights_only=False."""

    def __init__(self, marker: Path):
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self):
        return (exec, (self.code,))


def plant(path: Path, marker: Path) -> None:
    """A payload saved by torch.save (its zip format: it passes checkpoint_problem's shape checks)."""
    torch.save({"iteration": 1, "world_size": 1, "optimizer": Payload(marker)}, path)


def resume(script, run_dir: Path, capsys) -> str:
    """Resume `run_dir` through the script's command line as a user would; returns the one error line."""
    with pytest.raises(SystemExit) as exit_info:
        cli.run_cli(script.main, cli.parse(script.Args, ["--resume", str(run_dir), "--iterations", "2"]))
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message.strip(), message
    assert "Traceback" not in capsys.readouterr().err
    return message


@pytest.fixture(scope="module")
def trained_runs(tmp_path_factory, tiny_model_dir, gsm8k_jsonl):
    """One finished 1-iteration run of each script (copied before a test plants anything in it)."""
    runs = {}
    for script in SCRIPTS:
        out = tmp_path_factory.mktemp(script.__name__)
        summary = script.main(smoke_args(script, tiny_model_dir, gsm8k_jsonl, out, iterations=1))
        runs[script.__name__] = Path(summary["run_dir"])
    return runs


def copy_run(trained_runs, script, tmp_path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained_runs[script.__name__], run_dir)
    (run_dir / "lock").unlink(missing_ok=True)
    return run_dir


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_a_pickled_payload_in_trainer_state_never_runs(script, trained_runs, tmp_path, capsys):
    run_dir, marker = copy_run(trained_runs, script, tmp_path), tmp_path / "payload-ran"
    plant(run_dir / "checkpoint" / "trainer_state.pt", marker)
    message = resume(script, run_dir, capsys)
    assert "trainer_state.pt holds objects other than tensors and numbers" in message
    assert checkpoints.trained_iterations(run_dir) == 0  # the Ctrl-C and error messages read it too
    assert not marker.exists()


def test_a_pickled_payload_as_ppos_critic_never_runs(trained_runs, tmp_path, capsys):
    run_dir, marker = copy_run(trained_runs, ppo_baseline, tmp_path), tmp_path / "payload-ran"
    torch.save({"value_head.weight": Payload(marker)}, run_dir / "checkpoint" / "critic.pt")
    message = resume(ppo_baseline, run_dir, capsys)
    assert "critic.pt holds objects other than tensors and numbers" in message
    assert not marker.exists()


def test_todays_trainer_state_loads_as_data(trained_runs):
    """weights_only keeps every file the scripts write: optimizer and scheduler state, SPO-tree's replay buffer."""
    for name, run_dir in trained_runs.items():
        state = checkpoints.load_trainer_state(run_dir / "checkpoint")
        assert state["iteration"] == 1 and "optimizer" in state, name
    assert "buffer" in str(sorted(checkpoints.load_trainer_state(trained_runs["spo_tree"] / "checkpoint")))


def test_a_damaged_pt_file_is_one_line(tmp_path):
    (tmp_path / "trainer_state.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(UsageError, match="trainer_state.pt cannot be read .*: it is damaged"):
        checkpoints.load_data(tmp_path / "trainer_state.pt")


def test_no_source_loads_a_pickle():
    """Every torch.load passes weights_only=True; nothing calls pickle.load(s). A new load elsewhere fails here."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if any(part.startswith(".") or part in ("runs", "__pycache__") for part in path.relative_to(ROOT).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            if (owner, node.func.attr) == ("torch", "load"):
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not safe:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} torch.load without weights_only=True")
            if owner in ("pickle", "cPickle", "dill") and node.func.attr in ("load", "loads", "Unpickler"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.func.attr}")
    assert not offenders, offenders


def test_the_source_scan_sees_an_unsafe_load():
    tree = ast.parse("import torch\nstate = torch.load('x.pt', weights_only=False)\n")
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "load"]
    assert calls and calls[0].keywords[0].value.value is False  # the shape test_no_source_loads_a_pickle refuses


# ----------------------------------------------------------------------------------------------
# Links: every file and folder a run writes, linked to an outside target, is refused on resume


LINKED = {
    "metrics.jsonl": "file",
    "starts.jsonl": "file",
    "args.json": "file",
    "summary.json": "file",
    "samples": "dir",
    "tensorboard": "dir",
    "checkpoint": "dir",
    "checkpoint.new": "dir",
    "checkpoint/critic.pt": "file",
}


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("name", sorted(LINKED))
def test_a_link_in_a_run_directory_is_refused_and_nothing_outside_changes(name, trained_runs, tmp_path, capsys):
    script = ppo_baseline  # the one script whose run has every one of these (critic.pt)
    run_dir, outside = copy_run(trained_runs, script, tmp_path), tmp_path / "outside"
    target = outside / "target"
    original = run_dir / name
    if LINKED[name] == "dir":
        if original.exists():
            shutil.copytree(original, target)
            shutil.rmtree(original)
        else:
            target.mkdir(parents=True)
    else:
        target.parent.mkdir(parents=True)
        shutil.copy(original, target)
        original.unlink()
    if name == "checkpoint":  # its predecessor keeps the run resumable, so the refusal is the link's alone
        shutil.copytree(target, run_dir / "checkpoint.old")
    os.symlink(target, original)
    before = snapshot(outside)
    message = resume(script, run_dir, capsys)
    assert f"{original} is a symbolic link" in message
    assert snapshot(outside) == before


def test_a_new_checkpoint_never_writes_through_a_staging_link(trained_runs, tmp_path):
    """Even when a link appears after the run was opened (a racing process is out of scope, but the run's own
    write removes the link rather than following it)."""
    run_dir, outside = copy_run(trained_runs, grpo_baseline, tmp_path), tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, run_dir / "checkpoint.new")
    model_dir = run_dir / "checkpoint"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    checkpoints.save_checkpoint(run_dir, model, tokenizer, {"iteration": 2})
    assert list(outside.iterdir()) == []
    assert checkpoints.load_trainer_state(run_dir / "checkpoint")["iteration"] == 2


@pytest.mark.parametrize("command", ["html", "curves"])
def test_the_viewer_refuses_a_run_holding_a_link(command, trained_runs, tmp_path):
    import subprocess
    import sys

    run_dir = copy_run(trained_runs, grpo_baseline, tmp_path)
    (tmp_path / "elsewhere.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
    (run_dir / "metrics.jsonl").unlink()
    os.symlink(tmp_path / "elsewhere.jsonl", run_dir / "metrics.jsonl")
    out = tmp_path / ("page.html" if command == "html" else "curves.png")
    result = subprocess.run(
        [sys.executable, str(ROOT / "viewer.py"), command, str(run_dir), "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"error: {run_dir / 'metrics.jsonl'} is a symbolic link (to {tmp_path / 'elsewhere.jsonl'}): a run directory "
        "must hold its own files, since a run would write through the link; replace it with the file itself, or start "
        "a new run"
    )
    assert not out.exists()
