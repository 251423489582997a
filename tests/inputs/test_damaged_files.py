"""Files that are damaged, writes that fail, two processes on one run, SIGTERM: each is one clear line, and nothing
that was kept is lost (plumbing/files.py, plumbing/runs.py, plumbing/checkpoints.py, plumbing/models.py)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import grpo_baseline
from plumbing import UsageError, checkpoints, files, memory, models, run_lock, runs, settings, tasks
from plumbing.precision import FP32

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------------------------
# Reading


@pytest.mark.parametrize(
    "content,message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not UTF-8 text"),
        (b'{"question": "1+1?", "answer": "#### 2"}\n\xff\xfe\n', "is not UTF-8 text"),
    ],
)
def test_a_task_file_that_is_not_text_is_one_line(content, message, tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(content)
    with pytest.raises(UsageError, match=f"task file {path} {message}"):
        tasks.load_task(str(path), "train")


def test_a_task_file_that_cannot_be_read_or_is_a_directory_is_named(tmp_path):
    folder = tmp_path / "x.jsonl"
    folder.mkdir()
    assert tasks.task_problems(str(folder)) == [f"--task {folder}: a directory, not a task file"]
    with pytest.raises(UsageError, match="is a directory, not a file"):
        tasks.load_task(str(folder), "train")
    if os.geteuid() != 0:  # root reads any file
        locked = tmp_path / "locked.jsonl"
        locked.write_text("{}")
        locked.chmod(0)
        assert "permission denied" in tasks.task_problems(str(locked))[0]


def test_named_pipes_are_refused_never_opened(tiny_model_dir, gsm8k_jsonl, tmp_path):
    """open() on a named pipe waits for a writer: a task file or a model's config.json that is one would block
    forever. Each is one line, from the command line too (--task <(zcat ...) is a pipe)."""
    pipe = tmp_path / "task.jsonl"
    os.mkfifo(pipe)
    assert tasks.task_problems(str(pipe)) == [f"--task {pipe} is a named pipe, not a regular file: " + PIPE_FIX]
    with pytest.raises(UsageError, match=f"task file {pipe} is a named pipe"):
        tasks.load_task(str(pipe), "train")
    with pytest.raises(UsageError, match="args.json .* is a named pipe"):
        files.read_json(pipe, "args.json")
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "config.json":
            (model / path.name).write_bytes(path.read_bytes())
    os.mkfifo(model / "config.json")
    assert models.model_directory_problem(model) == f"{model / 'config.json'} is a named pipe, not a regular file: " + (
        PIPE_FIX
    )
    for command in (
        ["eval.py", "--model", str(model), "--task", str(gsm8k_jsonl)],
        ["grpo_baseline.py", "--model", str(tiny_model_dir), "--task", str(pipe), "--output-dir", str(tmp_path)],
    ):
        result = subprocess.run(
            [sys.executable, str(ROOT / command[0]), *command[1:]], capture_output=True, text=True, timeout=300
        )
        assert result.returncode != 0 and "Traceback" not in result.stderr and "is a named pipe" in result.stderr


PIPE_FIX = "write what it gives to a file and give that (a pipe reads once)"


@pytest.mark.parametrize(
    "content,message",
    [
        ("null", "holds a JSON NoneType, not a JSON object"),
        ("[1, 2]", "holds a JSON list, not a JSON object"),
        ('"text"', "holds a JSON str"),
        ("{not json", "is not valid JSON"),
        ("", "is not valid JSON"),
    ],
)
def test_args_json_of_the_wrong_shape_is_one_line(content, message, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "args.json").write_text(content)
    with pytest.raises(UsageError, match=message):
        settings.saved_settings(grpo_baseline.Args, tmp_path / "run")


@pytest.mark.parametrize(
    "field,value",
    [("lr", "fast"), ("group_size", 2.5), ("prob_mask", 1), ("backend", "tpu"), ("eval_limit", [1]), ("seed", True)],
)
def test_args_json_with_a_value_of_the_wrong_type_is_one_line(field, value, tmp_path):
    (tmp_path / "run").mkdir()
    saved = {**json.loads(json.dumps(grpo_baseline.Args().__dict__)), field: value}
    (tmp_path / "run" / "args.json").write_text(json.dumps(saved))
    with pytest.raises(UsageError, match=f"holds values of the wrong type \\({field} = "):
        settings.saved_settings(grpo_baseline.Args, tmp_path / "run")


def test_a_torn_or_blank_log_tail_is_dropped_and_cut_before_the_next_append(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"iteration": 1}\n{"iteration": 2}\n{"itera')  # a kill during the third write
    with pytest.warns(UserWarning, match="last line is cut short"):
        assert files.read_log(log) == [{"iteration": 1}, {"iteration": 2}]
    assert log.read_text() == '{"iteration": 1}\n{"iteration": 2}\n'
    files.append_line(log, {"iteration": 3})
    assert files.read_log(log) == [{"iteration": 1}, {"iteration": 2}, {"iteration": 3}]
    log.write_text('{"iteration": 1}\n\n\n')  # a full disk leaves blank or zeroed tails too
    assert files.read_log(log) == [{"iteration": 1}] and log.read_text() == '{"iteration": 1}\n'
    log.write_text('{"iteration": 1}\n{"iteration": 2}')  # whole, only its newline missing: kept
    assert files.read_log(log) == [{"iteration": 1}, {"iteration": 2}] and log.read_text().endswith("}\n")
    log.write_text('{"iteration": 1}\n{"iter\n{"iteration": 3}\n')  # damage before the end is not a torn tail
    with pytest.raises(UsageError, match="line 2 is damaged"):
        files.read_log(log)


def test_resumed_run_log_drops_a_torn_tail(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"iteration": 0, "eval/accuracy": 0.5}\n{"iteration": 1, "time/train_seconds": 3.0}\n{"iter'
    )
    with pytest.warns(UserWarning, match="cut short"):
        log = runs.RunLog(tmp_path, start_iteration=2, args=grpo_baseline.Args())
    log.write(2, {"reward": 1.0})
    log.close()
    assert [r["iteration"] for r in files.read_log(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert log.train_seconds == 3.0


def test_a_checkpoint_whose_header_size_is_garbage_is_damaged_not_a_memory_error(tmp_path):
    (tmp_path / "trainer_state.pt").write_bytes(b"")
    import zipfile

    with zipfile.ZipFile(tmp_path / "trainer_state.pt", "w") as z:
        z.writestr("x", "y")
    (tmp_path / "model.safetensors").write_bytes((2**62).to_bytes(8, "little") + b"{}")
    assert "is damaged (its header claims" in checkpoints.checkpoint_problem(tmp_path)


# ----------------------------------------------------------------------------------------------
# Model directories


def test_model_directories_that_are_not_models_say_what_is_missing(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in models.model_directory_problem(
        empty
    ) and "holds nothing" in models.model_directory_problem(empty)
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    assert "has config.json but no weights" in models.model_directory_problem(only_config)
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    assert (
        models.model_directory_problem(run)
        == f"{run} is a run directory, not a model: did you mean {run / 'checkpoint'}?"
    )
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tokenizer / name).write_bytes((tiny_model_dir / name).read_bytes())
    assert "has no tokenizer files" in models.model_directory_problem(no_tokenizer)
    assert models.model_directory_problem(tiny_model_dir) is None
    assert models.model_directory_problem(Path("Qwen/Qwen2.5-Math-7B")) is None  # a hub id, not a local path
    with pytest.raises(UsageError, match=r"cannot load model '.*run': .*did you mean .*run/checkpoint\?"):
        models.load_model(str(run))


def test_a_damaged_weights_file_is_one_line(tiny_model_dir, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in tiny_model_dir.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(UsageError, match="cannot load model .*may be damaged"):
        models.load_model(str(damaged))


# ----------------------------------------------------------------------------------------------
# Writing


def test_a_write_that_fails_leaves_the_previous_file_and_no_partial_one(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("previous")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="cannot write the results .*afile/out.json: .*afile is a file, not a folder"):
        files.write_atomic(tmp_path / "afile" / "out.json", "{}", "the results")
    # a full disk: the process may write at most 100 bytes per file (RLIMIT_FSIZE), SIGXFSZ ignored -> EFBIG
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))
        from plumbing import files, UsageError
        try:
            files.write_atomic({str(target)!r}, "x" * 1000, "the summary")
        except UsageError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.startswith(f"cannot write the summary {target}: File too large"), result
    assert target.read_text() == "previous" and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "summary.json"]


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one(tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from plumbing import checkpoints, models, UsageError
        model, tokenizer = models.load_model({str(tiny_model_dir)!r}, device="cpu")
        run = Path({str(tmp_path / "run")!r})
        run.mkdir()
        checkpoints.save_checkpoint(run, model, tokenizer, {{"iteration": 1}})
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # smaller than the weights
        try:
            checkpoints.save_checkpoint(run, model, tokenizer, {{"iteration": 2}})
        except UsageError as error:
            print(error)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (
        "cannot write the checkpoint of iteration 2" in result.stdout and "still holds iteration 1" in result.stdout
    ), result
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint"]  # no checkpoint.new left
    assert checkpoints.trained_iterations(tmp_path / "run") == 1


# ----------------------------------------------------------------------------------------------
# Run directories: created exclusively, locked for the life of the run


def test_new_runs_get_their_own_directory_lock_it_and_record_how_they_run(tmp_path):
    args = grpo_baseline.Args(output_dir=str(tmp_path), backend="hf")
    run_dir, _, _ = runs.locate_run(args)
    first = runs.open_run(run_dir, args, "precision: fp32", "cpu", memory.size_run(args, "cpu", FP32, args.model))
    lock = json.loads((first / "lock").read_text())
    assert lock["pid"] == os.getpid()
    run_lock.release_run()
    assert not (first / "lock").exists()
    second = runs.make_new_directory(first)  # the same name in the same second: a suffix, never a shared directory
    assert second == first.with_name(first.name + "-2") and second.is_dir()
    start = files.read_log(first / "starts.jsonl")[0]
    assert (start["world_size"], start["backend"], start["device"], start["precision"]) == (
        1,
        "hf",
        "cpu",
        "precision: fp32",
    )


LOCK_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from plumbing import run_lock
run_lock.lock_run(Path({run!r}))
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_process_on_a_locked_run_is_refused_and_a_dead_ones_lock_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER.format(root=str(ROOT), run=str(run))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            UsageError, match=f"{run} is in use by process {holder.pid} on .*this process \\({os.getpid()} on"
        ):
            run_lock.lock_run(run)
    finally:
        holder.kill()
        holder.wait()
    with pytest.warns(UserWarning, match=f"locked by process {holder.pid}, which is no longer running: taking it over"):
        run_lock.lock_run(run)  # kill -9 left the lock behind
    assert json.loads((run / "lock").read_text())["pid"] == os.getpid()
    run_lock.release_run()


SLEEPER = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from plumbing import cli, run_lock, runs
def main(args):
    runs.record_start(Path({run!r}), resumed=False)
    print("started", flush=True)
    time.sleep(60)
cli.run_cli(main, None)
"""


def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", SLEEPER.format(root=str(ROOT), run=str(run))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "started"
    process.send_signal(signal.SIGTERM)  # what Slurm, docker stop and timeout send
    _, err = process.communicate(timeout=30)
    assert process.returncode == 143, err
    assert "Traceback" not in err
    assert f"interrupted before the first checkpoint: {run} keeps its settings; start it again with:" in err
