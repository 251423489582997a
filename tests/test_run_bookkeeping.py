"""What a run does with what it is given: a resume says what it does and loses nothing, ranks agree or stop,
degenerate settings are refused before anything is sampled."""

import contextlib
import json
import re
from pathlib import Path

import pytest

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from conftest import make_tiny_model, smoke_args
from plumbing import UsageError, checkpoints, cli, distributed, run_lock, runs, settings


def resume(script, run_dir: Path, *flags: str):
    """Resume with the command line's flags as a user does: (main's summary, None), or (None, the error line
    cli.run_cli prints)."""
    try:
        return script.main(cli.parse(script.Args, ["--resume", str(run_dir), *flags])), None
    except UsageError as error:
        return None, f"error: {error}"
    finally:
        run_lock.release_run()


@pytest.fixture
def finished_run(tiny_model_dir, gsm8k_jsonl, tmp_path) -> Path:
    summary = grpo_baseline.main(smoke_args(grpo_baseline, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1))
    run_lock.release_run()
    return Path(summary["run_dir"])


@pytest.mark.parametrize("script", [spo_chain, spo_tree, grpo_baseline, ppo_baseline], ids=lambda s: s.__name__)
def test_the_progress_bar_ends_on_the_iterations_run(script, tiny_model_dir, gsm8k_jsonl, tmp_path, capsys):
    """The bar's last state counts every iteration that ran: 2/2 after two, not the 1/2 a bar left by `break` shows."""
    script.main(smoke_args(script, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=2))
    run_lock.release_run()
    counts = re.findall(r"iterations: +\d+%\|[^|]*\| (\d+)/(\d+)", capsys.readouterr().err)
    assert counts and counts[-1] == ("2", "2"), counts


def test_resuming_a_finished_run_reports_it_and_leaves_it_as_it_is(finished_run, capsys):
    before = {p.name: p.read_bytes() for p in finished_run.iterdir() if p.is_file() and p.name != "starts.jsonl"}
    summary, error = resume(grpo_baseline, finished_run)
    assert error is None and summary["accuracy_after"] is not None
    assert f"{finished_run} finished its 1 iteration(s)" in capsys.readouterr().out
    after = {p.name: p.read_bytes() for p in finished_run.iterdir() if p.is_file() and p.name != "starts.jsonl"}
    assert after == before  # summary.json keeps its accuracies; metrics untouched


def test_a_resume_that_starts_over_says_so_and_keeps_one_iteration_zero_row(finished_run, capsys):
    for name in ("checkpoint", "checkpoint.old"):
        if (finished_run / name).exists():
            import shutil

            shutil.rmtree(finished_run / name)
    summary, error = resume(grpo_baseline, finished_run)
    assert error is None
    assert "no checkpoint: it starts over from --model" in capsys.readouterr().out
    iterations = [json.loads(line)["iteration"] for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert iterations.count(0) == 1 and iterations.count(1) == 2  # iteration 1: its metrics and its evaluation


def test_resume_states_what_iterations_and_precision_change(finished_run, capsys):
    summary, error = resume(grpo_baseline, finished_run, "--iterations", "2", "--precision", "bf16")
    assert error is None
    out = capsys.readouterr().out
    assert "--iterations 2 (the run had 1): the learning-rate schedule is planned anew" in out
    assert "--precision bf16 (the run had 'fp32'" not in out or "matmuls" in out
    assert checkpoints.trained_iterations(finished_run) == 2


def test_resume_says_another_output_dir_has_no_effect_and_records_the_runs_own(finished_run, tmp_path, capsys):
    saved = json.loads((finished_run / "args.json").read_text())["output_dir"]
    summary, error = resume(
        grpo_baseline, finished_run, "--output-dir", str(tmp_path / "elsewhere"), "--iterations", "2"
    )
    assert error is None and Path(summary["run_dir"]) == finished_run
    assert f"--output-dir {tmp_path / 'elsewhere'} has no effect on --resume" in capsys.readouterr().out
    assert json.loads((finished_run / "args.json").read_text())["output_dir"] == saved
    assert not (tmp_path / "elsewhere").exists()


# ----------------------------------------------------------------------------------------------
# Ranks


def test_launch_variables_are_checked_before_joining():
    assert distributed.launch_problem({}) is None
    assert distributed.launch_problem({"WORLD_SIZE": "1"}) is None
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    assert distributed.launch_problem(torchrun) is None
    assert "WORLD_SIZE='abc' is not a positive integer" in distributed.launch_problem({"WORLD_SIZE": "abc"})
    stale = distributed.launch_problem({"WORLD_SIZE": "2", "RANK": "0"})
    assert "was not started by torchrun" in stale and "unset WORLD_SIZE" in stale
    assert "MASTER_ADDR" in distributed.launch_problem({**torchrun, "MASTER_ADDR": ""})
    assert "RANK=2 is not below WORLD_SIZE=2" in distributed.launch_problem({**torchrun, "RANK": "2"})


def test_settings_that_differ_between_ranks_are_named():
    base = vars(grpo_baseline.Args())
    assert distributed.settings_difference([base, dict(base)]) is None
    other = {**base, "lr": 1e-3}
    message = distributed.settings_difference([base, other, dict(base), {**base, "lr": 1e-3, "epochs": 3}])
    assert message == (
        "the processes were given different settings: --lr on ranks 1, 3 (rank 0 has 1e-06), --epochs on rank 3 (rank "
        "0 has 2); every rank must run the same command line"
    )


def test_collective_timeout_is_a_flag_long_enough_for_a_checkpoint():
    assert settings.TrainArgs().collective_timeout_minutes >= 30
    assert "collective_timeout_minutes" in settings.RESUMABLE_SETTINGS


# ----------------------------------------------------------------------------------------------
# Degenerate settings


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ("1", "--tree 1: depth 0 has one child per node"),
        ("6,1", "--tree 6,1: depth 1 has one child per node"),
        (",".join(["2"] * 101), "levels: at most 100"),
    ],
)
def test_spo_tree_refuses_a_tree_that_trains_nothing_or_nests_too_deep(tree, message, tmp_path):
    args = spo_tree.Args(tree=tree, segment_tokens=1, max_new_tokens=4000, context=4096, output_dir=str(tmp_path))
    with pytest.raises(UsageError, match=message):
        spo_tree.validate(args)


def test_a_context_beyond_the_models_positions_is_refused_before_sampling(gsm8k_jsonl, tmp_path, monkeypatch):
    model_dir = make_tiny_model(tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (model_dir / "config.json").write_text(json.dumps(config))
    sampled = []
    monkeypatch.setattr(grpo_baseline.engines.HFSampler, "sample", lambda *a, **k: sampled.append(1))
    args = smoke_args(grpo_baseline, model_dir, gsm8k_jsonl, tmp_path / "runs", context=300)
    with pytest.raises(UsageError, match="--context 300 is beyond the model's 64 positions"):
        grpo_baseline.main(args)
    assert not sampled


def test_a_non_finite_loss_names_a_tiny_temperature():
    from plumbing.bookkeeping import NonFiniteGuard

    guard = NonFiniteGuard()
    guard.in_a_row = 2
    with pytest.raises(UsageError, match=r"--temperature 1e-40 divides the logits"):
        guard.skips({"loss": float("nan")}, 3, temperature=1e-40)


@pytest.mark.slow
@pytest.mark.parametrize("flags", ["--lr 0.003", "--epochs 3"])
def test_ranks_given_different_settings_stop_with_one_line_naming_them(flags, tiny_model_dir, gsm8k_jsonl, tmp_path):
    """A rank with another --lr would train a diverging replica, one with other --epochs would hang in collectives:
    both end at start, on every rank, with the differing flag and its rank named."""
    import os
    import subprocess
    import sys

    from conftest import SMOKE_SETTINGS, cli_flags

    settings = {**SMOKE_SETTINGS["grpo_baseline"], "model": str(tiny_model_dir), "task": str(gsm8k_jsonl)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(Path(__file__).parent / "helpers" / "rank_flags_run.py"), "grpo_baseline"]
    command += cli_flags({**settings, "output_dir": str(tmp_path), "questions": 2, "batch_size": 8})
    environment = {**os.environ, "RANK_FLAGS_RANK": "1", "RANK_FLAGS": flags}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode != 0
    flag = flags.split()[0]
    assert f"error: the processes were given different settings: {flag} on rank 1" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing was trained or written


def test_a_moved_model_and_task_file_are_given_anew_and_checked_against_the_run(tmp_path, gsm8k_jsonl, capsys):
    import shutil

    model, task = make_tiny_model(tmp_path / "model"), tmp_path / "task.jsonl"
    shutil.copy(gsm8k_jsonl, task)
    summary = grpo_baseline.main(smoke_args(grpo_baseline, model, task, tmp_path / "runs", iterations=1))
    run_lock.release_run()
    run_dir = Path(summary["run_dir"])
    model.rename(tmp_path / "moved-model")
    task.rename(tmp_path / "moved-task.jsonl")
    other = make_tiny_model(tmp_path / "other-model", alphabet="0123456789 ")  # another config: another model
    other_task = tmp_path / "other-task.jsonl"
    other_task.write_text(gsm8k_jsonl.read_text().replace("#### ", "#### 1"))
    _, error = resume(grpo_baseline, run_dir, "--model", str(other), "--task", str(tmp_path / "moved-task.jsonl"))
    assert error.startswith(f"error: --resume {run_dir}: --model '{other}' is not the model the run started with")
    _, error = resume(grpo_baseline, run_dir, "--task", str(other_task), "--model", str(tmp_path / "moved-model"))
    assert error.startswith(f"error: --resume {run_dir}: --task '{other_task}' is not the task the run started with")
    summary, error = resume(
        grpo_baseline, run_dir, "--iterations", "2", "--model", str(tmp_path / "moved-model"), "--task",
        str(tmp_path / "moved-task.jsonl"),
    )  # fmt: skip
    assert error is None and checkpoints.trained_iterations(run_dir) == 2
    out = capsys.readouterr().out
    assert f"--model {tmp_path / 'moved-model'}: the run's model ({model}), found at a new path" in out
    assert json.loads((run_dir / "args.json").read_text())["model"] == str(tmp_path / "moved-model")


# ----------------------------------------------------------------------------------------------
# Time and kept rows: durations from a monotonic clock; what a resume reads back from metrics.jsonl is checked


def test_a_wall_clock_stepped_back_changes_no_measured_duration(monkeypatch):
    from plumbing import bookkeeping

    wall = iter([1_000_000.0, 1_000_000.0 - 3600, 1_000_000.0 - 3600])  # NTP sets the clock back an hour mid-block
    monkeypatch.setattr(bookkeeping.time, "time", lambda: next(wall))
    loop = bookkeeping.Loop.__new__(bookkeeping.Loop)  # only the clock's parts: no run directory
    loop.seconds = {}
    with loop.timed("rollout"):
        pass
    assert 0 <= loop.seconds["rollout"] < 60


@pytest.mark.parametrize(
    "row,named",
    [
        ({"iteration": "1", "time/train_seconds": 5.0}, 'iteration is "1", not a whole number'),
        ({"iteration": 1, "time/train_seconds": "5"}, 'time/train_seconds is "5", not a number of seconds'),
        ({"iteration": 1, "time/train_seconds": float("nan")}, "time/train_seconds is NaN"),
        ({"iteration": 1, "time/train_seconds": -3600.0}, "time/train_seconds is -3600.0"),
    ],
)
def test_a_kept_metrics_row_of_the_wrong_type_is_one_line_naming_its_line(row, named, tmp_path):
    from types import SimpleNamespace

    rows = [{"iteration": 0, "eval/accuracy": 0.1}, row]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UsageError) as error:
        runs.RunLog(tmp_path, 3, SimpleNamespace(track=False))
    message = str(error.value)
    assert f"metrics.jsonl line 2: {named}" in message and "\n" not in message


def test_kept_metrics_rows_that_are_well_formed_carry_the_training_time_on(tmp_path):
    from types import SimpleNamespace

    rows = [{"iteration": 1, "time/train_seconds": 12.5}, {"iteration": 2, "time/train_seconds": 30}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = runs.RunLog(tmp_path, 3, SimpleNamespace(track=False))
    log.close()
    assert log.train_seconds == 30


# ----------------------------------------------------------------------------------------------
# A stop signal is never lost: one whose exception Python dropped (raised inside a callback) stops the run at the
# loop's next safe point


@pytest.fixture
def stop_handlers_restored():
    import signal

    saved = {signum: signal.getsignal(signum) for signum in cli.STOPPING_SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    cli._arrived.clear()


def test_a_dropped_stop_signal_is_raised_at_the_next_safe_point(stop_handlers_restored):
    import signal

    assert cli.raise_if_stopped() is None  # nothing arrived: a safe point does nothing
    try:
        cli._stop(signal.SIGTERM, None)
    except cli.Terminated:
        pass  # what Python does with an exception raised while it runs a callback
    with pytest.raises(cli.Terminated) as stopped:
        cli.raise_if_stopped()
    assert stopped.value.signum == signal.SIGTERM


def test_a_run_whose_sigterm_was_dropped_mid_iteration_stops_with_the_resume_line(
    tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch, capsys, stop_handlers_restored
):
    import signal

    real = grpo_baseline.group_advantages

    def dropped_sigterm(*args, **kwargs):  # SIGTERM lands in a callback in iteration 2: its exception is lost there
        calls.append(1)
        if len(calls) == 2:
            with contextlib.suppress(cli.Terminated):
                cli._stop(signal.SIGTERM, None)
        return real(*args, **kwargs)

    calls = []
    monkeypatch.setattr(grpo_baseline, "group_advantages", dropped_sigterm)
    args = smoke_args(grpo_baseline, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=4, save_every=1)
    with pytest.raises(SystemExit) as ended:
        cli.run_cli(grpo_baseline.main, args)
    assert ended.value.code == 128 + signal.SIGTERM
    assert len(calls) == 2  # iteration 3 never started
    assert "--resume" in capsys.readouterr().err
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    logged = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert 1 in logged and 2 not in logged  # stopped before iteration 2's update, at the update's safe point


def test_a_runs_own_results_do_not_mark_the_tree_modified():
    """code_state: a new file in a results/ folder (a sweep's earlier case) is output, not a code change; any other
    new file is."""
    from plumbing import runs

    root = Path(__file__).resolve().parents[1]
    before = runs.code_state()["tree_modified"]
    output, code = root / "experiments" / "results" / "_probe_output.json", root / "_probe_code.py"
    try:
        output.write_text("{}")
        assert runs.code_state()["tree_modified"] == before
        code.write_text("")
        assert runs.code_state()["tree_modified"] is True
    finally:
        output.unlink(missing_ok=True)
        code.unlink(missing_ok=True)
