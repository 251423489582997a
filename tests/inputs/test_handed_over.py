"""Files someone else hands over, read as data: a named pipe where a checkpoint's or a base model's weights belong is
refused unopened (open() on one waits for a writer), a path from an adapter's base_model.json reaches the terminal
escaped, tools/identical_outputs.sh keeps to the folders it made and takes paths with spaces, and a long task file
shows its progress while it is checked."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import write_jsonl
from plumbing import UsageError, checkpoints, lora, models, tasks

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail the test, instead of hanging it, when the block is still running after `seconds` (an open() of a pipe)."""

    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: something opened a named pipe")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------------------------------
# Named pipes where files belong


def test_a_checkpoint_whose_files_are_pipes_is_refused_unopened(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoint"
    shutil.copytree(tiny_model_dir, checkpoint)
    os.mkfifo(checkpoint / "trainer_state.pt")
    with deadline(10):
        assert "trainer_state.pt is a named pipe, not a regular file" in checkpoints.checkpoint_problem(checkpoint)
        with pytest.raises(UsageError, match="trainer_state.pt is a named pipe.*no intact checkpoint is left"):
            checkpoints.latest_checkpoint(run_dir)
        assert checkpoints.trained_iterations(run_dir) == 0
        with pytest.raises(UsageError, match="trainer_state.pt is a named pipe"):
            checkpoints.load_data(checkpoint / "trainer_state.pt")
    (checkpoint / "trainer_state.pt").unlink()
    torch.save({"iteration": 1, "world_size": 1}, checkpoint / "trainer_state.pt")
    assert checkpoints.checkpoint_problem(checkpoint) is None
    (checkpoint / "model.safetensors").unlink()
    os.mkfifo(checkpoint / "model.safetensors")
    with deadline(10):
        assert "model.safetensors is a named pipe" in checkpoints.checkpoint_problem(checkpoint)


def test_a_base_model_whose_weights_are_a_pipe_is_refused_before_its_fingerprint(tiny_model_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    assert models.fingerprint(str(base)) is not None
    (base / "model.safetensors").unlink()
    os.mkfifo(base / "model.safetensors")
    with deadline(10), pytest.raises(UsageError, match="model.safetensors is a named pipe, not a regular file"):
        models.fingerprint(str(base))


# ----------------------------------------------------------------------------------------------
# Terminal escapes in what a message quotes


def adapter_naming(base: str, tiny_model_dir: Path, directory: Path) -> Path:
    """An adapter checkpoint of the tiny model whose base_model.json names `base`."""
    model, _ = models.load_model(str(tiny_model_dir), device="cpu")
    lora.add_adapters(model, lora.lora_config(4, None, 0.0, lora.DEFAULT_TARGET, str(tiny_model_dir)))
    lora.save_adapter(model, directory, str(tiny_model_dir), models.fingerprint(str(tiny_model_dir)))
    record = directory / lora.BASE_RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "model": base}))
    return directory


def test_the_merge_names_a_base_path_with_escapes_escaped(tiny_model_dir, tmp_path):
    base = str(tmp_path / "gone\x1b]0;owned\x07\x1b[2J")  # would set the window title and clear the screen
    adapter = adapter_naming(base, tiny_model_dir, tmp_path / "adapter")
    result = subprocess.run(
        [sys.executable, "-m", "plumbing.checkpoints", "merge", str(adapter), str(tmp_path / "merged")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "gone\\x1b]0;owned\\x07\\x1b[2J is not there" in result.stderr
    assert not (tmp_path / "merged").exists()


# ----------------------------------------------------------------------------------------------
# tools/identical_outputs.sh: its work dir, and paths with spaces

# Stands in for the interpreter the tool runs ($PYTHON): the environment line, the digits model's build, each run (its
# arguments recorded, and refused as the scripts' parser would refuse a stray word), --help and --dry-run; the
# comparison (python -) is the real interpreter's.
FAKE_PYTHON = textwrap.dedent(
    """\
    #!{python}
    import json, os, sys
    from pathlib import Path

    words = sys.argv[1:]
    if words[0] == "-":
        os.execv(sys.executable, [sys.executable, *words])
    if words[0] == "-c":
        sys.exit(print("python 3 torch 0 transformers 0 threads 1"))
    if words[1:] in (["--help"], ["--dry-run"]):
        sys.exit(print(words[0], words[1]))
    flags = dict(zip(words[1::2], words[2::2]))
    if words[:2] == ["-m", "benchmarks.gpu_check"]:
        models = Path(dict(zip(words[2::2], words[3::2]))["--work"])
        (models / "digits").mkdir(parents=True)
        (models / "sevens.jsonl").write_text("{{}}\\n")
        sys.exit()
    with open(os.environ["FAKE_PYTHON_LOG"], "a") as log:
        log.write(json.dumps(words) + "\\n")
    if any(not flag.startswith("--") for flag in words[1::2]):
        sys.exit(f"error: unrecognized arguments: {{words}}")
    if "digits" in flags["--model"] and not Path(flags["--model"]).is_dir():
        sys.exit(f"error: the directory {{flags['--model']}} does not exist")
    run = Path(flags["--output-dir"]) / "identical"
    (run / "samples").mkdir(parents=True)
    (run / "samples" / "iter_1.jsonl").write_text('{{"tokens": [1]}}\\n')
    (run / "metrics.jsonl").write_text('{{"iteration": 1, "charts/reward": 0.5}}\\n')
    (run / "summary.json").write_text('{{"accuracy_after": 0.5}}')
    (run / "args.json").write_text(json.dumps({{"model": flags["--model"], "output_dir": str(run)}}))
    """
)


def a_repository(tmp_path: Path) -> Path:
    """A repository of its own holding tools/identical_outputs.sh, in a folder whose name has a space."""
    repo = tmp_path / "a repo"
    (repo / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "identical_outputs.sh", repo / "tools")
    (repo / "grpo_baseline.py").write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@example.org"]
    subprocess.run([*git, "init", "--quiet"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "--quiet", "-m", "start"], check=True)
    return repo


def run_the_tool(repo: Path, work: Path, log: Path) -> subprocess.CompletedProcess:
    """IDENTICAL_WORK=`work` tools/identical_outputs.sh HEAD with FAKE_PYTHON as $PYTHON: seconds, not the real runs'
    minutes."""
    fake = repo.parent / "fake_python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    environment = {**os.environ, "PYTHON": str(fake), "FAKE_PYTHON_LOG": str(log), "IDENTICAL_WORK": str(work)}
    return subprocess.run(
        ["bash", str(repo / "tools" / "identical_outputs.sh"), "HEAD"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )


def test_the_tool_refuses_a_work_dir_it_did_not_make(tmp_path):
    work = tmp_path / "my folder"
    (work / "other").mkdir(parents=True)
    (work / "other" / "thesis.tex").write_text("a year of work")
    result = run_the_tool(a_repository(tmp_path), work, tmp_path / "calls.jsonl")
    assert result.returncode == 2, result.stdout + result.stderr
    assert (work / "other" / "thesis.tex").read_text() == "a year of work"
    assert f"IDENTICAL_WORK={work}" in result.stderr and "was not made by this tool" in result.stderr
    assert sorted(p.name for p in work.iterdir()) == ["other"]  # nothing written into it either
    assert not (tmp_path / "calls.jsonl").exists()


def test_the_tool_takes_a_work_path_with_a_space_and_reuses_the_dir_it_made(tmp_path):
    repo, work, log = a_repository(tmp_path), tmp_path / "work dir", tmp_path / "calls.jsonl"
    first = run_the_tool(repo, work, log)
    assert first.returncode == 0 and first.stdout.rstrip().endswith("ALL EQUAL"), first.stdout + first.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 16  # 8 runs a side
    for call in calls:  # each path one argument
        output = Path(call[call.index("--output-dir") + 1])
        assert output.parent.parent.parent == work and output.parent.parent.name in ("base", "other")
        if call[call.index("--model") + 1] != "smollm2-135m":
            assert call[call.index("--model") + 1] == str(work / "models" / "digits")
            assert call[call.index("--task") + 1] == str(work / "models" / "sevens.jsonl")
    assert sum(call[call.index("--model") + 1] == "smollm2-135m" for call in calls) == 8
    second = run_the_tool(repo, work, log)  # the work dir it made is its own: BASE reused, OTHER run again
    assert second.returncode == 0 and second.stdout.rstrip().endswith("ALL EQUAL"), second.stdout + second.stderr
    assert second.stdout.count("reusing the run") == 8 and len(log.read_text().splitlines()) == 16 + 8


# ----------------------------------------------------------------------------------------------
# A long task file: progress while its rows are read and checked


def test_a_long_task_file_shows_its_progress_while_it_is_checked(tmp_path, monkeypatch, capsys):
    path = write_jsonl(
        tmp_path / "task.jsonl", [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(50)]
    )
    tasks.check_references(["1"], str(path))  # the grading pool's workers started
    quiet = tasks.load_task(str(path), "train")
    assert capsys.readouterr().err == ""  # a check shorter than the bar's delay prints nothing
    monkeypatch.setattr(tasks, "PROGRESS_DELAY", 0.0)
    monkeypatch.setattr(tasks, "CHECKED_AT_ONCE", 16)
    batches, check_references = [], tasks.check_references

    def counting_check_references(references, task):
        batches.append(len(references))
        return check_references(references, task)

    monkeypatch.setattr(tasks, "check_references", counting_check_references)
    checked = tasks.load_task(str(path), "train")
    progress = capsys.readouterr().err
    assert f"checking the answers of {path}" in progress and "50/50" in progress
    assert batches == [16, 16, 16, 2]  # the bar moves after each round trip to the grading pool
    assert [(e.question, e.answer) for e in checked] == [(e.question, e.answer) for e in quiet]
    assert len(quiet) == 50 and quiet[-1].answer == "50"
