"""benchmarks/learning.py: reading a finished run, also from an --output-dir outside the repository."""
import json
import sys
from pathlib import Path

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
    result = learning.run_one(learning.Args(output_dir=str(tmp_path)), "grpo", 1)  # absolute: not under the repository
    assert result["run_dir"] == str(run_dir)
    assert (result["accuracy_before"], result["accuracy_after"], result["iterations"]) == (0.2, 0.4, 1)
