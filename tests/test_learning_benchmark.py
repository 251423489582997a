"""benchmarks/learning.py: reading a finished run (also from an --output-dir outside the repository), and evaluating
the starting model once per seed (--no-eval-before in the later runs)."""
import importlib
import json
import sys
from pathlib import Path

import pytest
from conftest import read_metrics, smoke_args

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import learning  # noqa: E402


def test_finished_run_outside_the_repository_is_read(tmp_path):
    run_dir = tmp_path / "seed1" / "grpo" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    lines = [{"iteration": 0, "eval/accuracy": 0.2},
             {"iteration": 1, "charts/reward": 0.5, "charts/generated_tokens": 10, "time/train_seconds": 3.0},
             {"iteration": 1, "eval/accuracy": 0.4}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run_dir / "starts.jsonl").write_text(json.dumps({"resumed": False, "precision": "precision: cpu fp32 (--precision fp32)"}) + "\n")
    result = learning.run_one(learning.Args(output_dir=str(tmp_path)), "grpo", 1)  # absolute: not under the repository
    assert result["run_dir"] == str(run_dir)
    assert result["precision"] == "precision: cpu fp32 (--precision fp32)"  # what the run computed in, from its first start
    assert (result["accuracy_before"], result["accuracy_after"], result["iterations"]) == (0.2, 0.4, 1)


def test_later_algorithms_reuse_the_seeds_starting_accuracy(tmp_path):
    run_dir = tmp_path / "seed1" / "ppo" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    lines = [{"iteration": 1, "charts/reward": 0.5, "charts/generated_tokens": 10, "time/train_seconds": 3.0},
             {"iteration": 1, "eval/accuracy": 0.4}]  # started with --no-eval-before: no iteration-0 evaluation
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = learning.run_one(learning.Args(output_dir=str(tmp_path)), "ppo", 1, base_accuracy=0.25)
    assert (result["accuracy_before"], result["accuracy_after"]) == (0.25, 0.4)
    assert result["precision"] is None  # a run from before starts.jsonl existed
    first, later = learning.command(learning.Args(), "ppo", 1), learning.command(learning.Args(), "ppo", 1, eval_before=False)
    assert "--no-eval-before" not in first and later[1] == "ppo_baseline.py" and "--no-eval-before" in later


@pytest.mark.parametrize("script", ["grpo_baseline", "ppo_baseline", "spo_chain", "spo_tree"])
def test_no_eval_before_skips_only_the_starting_evaluation(script, tiny_model_dir, gsm8k_jsonl, tmp_path):
    module = importlib.import_module(script)
    summary = module.main(smoke_args(module, tiny_model_dir, gsm8k_jsonl, tmp_path, iterations=1, eval_before=False))
    evals = [m["iteration"] for m in read_metrics(summary["run_dir"]) if "eval/accuracy" in m]
    assert evals == [1] and summary["accuracy_before"] is None and summary["accuracy_after"] is not None
