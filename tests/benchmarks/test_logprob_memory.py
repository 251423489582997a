"""benchmarks/logprob_memory.py runs every variant, each in its own process, on the same log-probs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

ROOT = Path(__file__).resolve().parents[2]


def test_logprob_memory_benchmark_runs_every_variant_on_the_same_numbers(tiny_model_dir, tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.logprob_memory",
            "--model",
            str(tiny_model_dir),
            "--rows",
            "2",
            "--prompt-tokens",
            "4",
            "--response-tokens",
            "8",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    results = {r["variant"]: r for r in record["results"]}
    assert list(results) == ["full", "chunked", "chunked-recomputed", "full+gc", "chunked+gc", "chunked-recomputed+gc"]
    sums = [r["logprob_sum"] for r in results.values()]
    assert all(abs(s - sums[0]) < 1e-3 * abs(sums[0]) for s in sums)  # the same log-probs whichever way
    assert all(r["peak_above_base_gb"] >= 0 and r["seconds"] > 0 for r in results.values())
