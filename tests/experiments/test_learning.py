"""experiments/learning.py: reading a finished run (also from an --output-dir outside the repository), and evaluating
the starting model once per seed (--no-eval-before in the later runs), and the plot of every algorithm it knows."""

import dataclasses
import importlib
import json
import subprocess
from pathlib import Path

import pytest

from conftest import read_metrics, smoke_args
from experiments import learning

# The tests marked slow run with --slow (README, Tests); the plot test is quick.


def started_with(run_dir: Path, cmd: list[str], **entry) -> None:
    """RUN/starts.jsonl as the script writes it: its first start ran `cmd` (learning.command's, without python)."""
    (run_dir / "starts.jsonl").write_text(json.dumps({"resumed": False, "argv": cmd[1:], **entry}) + "\n")


def finished_run(run_dir: Path, accuracy_after: float, args=None) -> Path:
    """A finished one-iteration run directory of learning.py's grpo seed 1 that evaluated 0.2 before and
    accuracy_after after training."""
    run_dir.mkdir(parents=True)
    started_with(run_dir, learning.command(args or learning.Args(output_dir=str(run_dir.parents[2])), "grpo", 1))
    (run_dir / "summary.json").write_text("{}")
    lines = [
        {"iteration": 0, "eval/accuracy": 0.2},
        {"iteration": 1, "charts/reward": 0.5, "charts/generated_tokens": 10, "time/train_seconds": 3.0},
        {"iteration": 1, "eval/accuracy": accuracy_after},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return run_dir


@pytest.mark.slow
def test_finished_run_outside_the_repository_is_read(tmp_path):
    run_dir = finished_run(tmp_path / "seed1" / "grpo" / "run", accuracy_after=0.4)
    started_with(
        run_dir,
        learning.command(learning.Args(output_dir=str(tmp_path)), "grpo", 1),
        precision="precision: cpu fp32 (--precision fp32)",
    )
    result = learning.run_one(learning.Args(output_dir=str(tmp_path)), "grpo", 1)  # absolute: not under the repository
    assert result["run_dir"] == str(run_dir)
    # what the run computed in, from its first start
    assert result["precision"] == "precision: cpu fp32 (--precision fp32)"
    assert (result["accuracy_before"], result["accuracy_after"], result["iterations"]) == (0.2, 0.4, 1)


@pytest.mark.slow
def test_later_algorithms_reuse_the_seeds_starting_accuracy(tmp_path):
    run_dir = tmp_path / "seed1" / "ppo" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    # started with --no-eval-before: no iteration-0 evaluation
    lines = [
        {"iteration": 1, "charts/reward": 0.5, "charts/generated_tokens": 10, "time/train_seconds": 3.0},
        {"iteration": 1, "eval/accuracy": 0.4},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    started_with(run_dir, learning.command(learning.Args(output_dir=str(tmp_path)), "ppo", 1, eval_before=False))
    result = learning.run_one(learning.Args(output_dir=str(tmp_path)), "ppo", 1, base_accuracy=0.25)
    assert (result["accuracy_before"], result["accuracy_after"]) == (0.25, 0.4)
    assert result["precision"] is None  # a start that recorded no precision
    first, later = (
        learning.command(learning.Args(), "ppo", 1),
        learning.command(learning.Args(), "ppo", 1, eval_before=False),
    )
    assert "--no-eval-before" not in first and later[1] == "ppo_baseline.py" and "--no-eval-before" in later


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo_baseline", "ppo_baseline", "spo_chain", "spo_tree"])
def test_no_eval_before_skips_only_the_starting_evaluation(script, tiny_model_dir, gsm8k_jsonl, tmp_path):
    module = importlib.import_module(script)
    summary = module.main(smoke_args(module, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1, eval_before=False))
    evals = [m["iteration"] for m in read_metrics(summary["run_dir"]) if "eval/accuracy" in m]
    assert evals == [1] and summary["accuracy_before"] is None and summary["accuracy_after"] is not None


@pytest.mark.slow
def test_keep_other_seeds_adds_a_seed_to_the_results_it_finds(tmp_path):
    finished_run(
        tmp_path / "runs" / "seed1" / "grpo" / "run",
        accuracy_after=0.3,
        args=learning.Args(output_dir=str(tmp_path / "runs")),
    )
    seed2 = {
        "algorithm": "grpo",
        "seed": 2,
        "accuracy_before": 0.2,
        "accuracy_after": 0.6,
        "iterations": 4,
        "seconds_per_iteration": 10.0,
        "tokens_per_iteration": 100.0,
        "curve": [{"seconds": 1.0, "tokens": 5, "reward": 0.1}],
    }
    seed1_before = dict(seed2, seed=1, accuracy_after=0.9)  # replaced by the seed 1 run found on disk
    results = tmp_path / "learning.json"
    args = learning.Args(
        seeds=[1], algorithms=["grpo"], output_dir=str(tmp_path / "runs"), results=str(results), keep_other_seeds=True
    )
    results.write_text(json.dumps({"args": dataclasses.asdict(args), "runs": [seed2, seed1_before]}))
    learning.main(args)
    written = json.loads(results.read_text())
    assert [(r["seed"], r["accuracy_after"]) for r in written["runs"]] == [(1, 0.3), (2, 0.6)]  # in seed order
    assert written["summary"]["grpo"]["seeds"] == [1, 2]
    assert written["summary"]["grpo"]["gain_mean"] == pytest.approx((0.1 + 0.4) / 2)

    other = json.loads(results.read_text())
    other["args"]["lr"] = 1e-6  # measured with another learning rate: not comparable
    results.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="--lr 1e-06 there, 1e-05 here"):
        learning.main(args)
    # without the flag the file holds this call's seeds only
    learning.main(dataclasses.replace(args, keep_other_seeds=False))
    assert [r["seed"] for r in json.loads(results.read_text())["runs"]] == [1]


@pytest.mark.slow
def test_a_finished_run_made_with_other_settings_is_not_reused(tmp_path, monkeypatch):
    run_dir = finished_run(tmp_path / "seed1" / "grpo" / "run", accuracy_after=0.4)
    args = learning.Args(output_dir=str(tmp_path))
    assert learning.finished_run(run_dir.parent, learning.command(args, "grpo", 1)) == run_dir
    assert (
        learning.finished_run(
            run_dir.parent, learning.command(learning.Args(output_dir=str(tmp_path), lr=3e-5), "grpo", 1)
        )
        is None
    )
    launched = []

    def failing_run(cmd, stdout, **kw):  # the script's own output goes to log.txt
        launched.append(cmd)
        stdout.write("iterations: 0%|\nerror: --task x.jsonl: the file does not exist\n\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(learning.subprocess, "run", failing_run)
    with pytest.raises(
        SystemExit, match=r"grpo seed 1 failed \(exit 1\): error: --task x.jsonl: the file does not exist \(whole log: "
    ):
        learning.run_one(learning.Args(output_dir=str(tmp_path), lr=3e-5), "grpo", 1)  # ran anew, not the lr 1e-5 run
    assert launched and "3e-05" in launched[0]


@pytest.mark.slow
def test_results_that_cannot_be_written_are_refused_before_any_run(tmp_path, monkeypatch):
    monkeypatch.setattr(learning, "run_one", lambda *a, **k: pytest.fail("a run started"))
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "afile").write_text("x")
    for results, message in [
        (tmp_path / "dir.json", "is a directory"),
        (tmp_path / "r.txt", "give a .json file path"),
        (tmp_path / "afile" / "r.json", "is a file"),
    ]:
        with pytest.raises(SystemExit, match=message):
            learning.main(learning.Args(results=str(results), output_dir=str(tmp_path / "runs")))
    assert learning.last_line(tmp_path / "afile") == "x"


def test_the_plot_has_a_colour_for_every_algorithm(tmp_path):
    names = [*learning.ALGORITHMS, "renamed_since"]  # a results file may hold a name this version lacks
    runs = [
        {
            "algorithm": name,
            "seed": seed,
            "accuracy_before": 0.2,
            "accuracy_after": 0.3 + 0.05 * i,
            "curve": [{"seconds": 1.0, "tokens": 5, "reward": 0.1}, {"seconds": 2.0, "tokens": 9, "reward": 0.2}],
        }
        for seed in (1, 2)
        for i, name in enumerate(names)
    ]
    learning.plot(runs, tmp_path / "learning.png")
    assert (tmp_path / "learning.png").read_bytes().startswith(b"\x89PNG")
    assert len({learning.color(name) for name in learning.ALGORITHMS}) == len(learning.ALGORITHMS)
