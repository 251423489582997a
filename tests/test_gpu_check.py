"""benchmarks/gpu_check.py, the one prepared GPU check, runs every step at toy sizes on the CPU (--device cpu), so it
cannot rot between GPU leases."""

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)


def test_every_step_runs_on_the_cpu_and_the_results_are_written(tmp_path):
    out = tmp_path / "gpu_check.json"
    results = gpu_check.main(gpu_check.Args(device="cpu", out=str(out)))
    assert json.loads(out.read_text()) == results
    failed = {step: value["error"] for step, value in results.items() if isinstance(value, dict) and "error" in value}
    assert failed == {}
    for name in ("grpo", "spo_chain", "spo_tree", "ppo"):
        assert results[f"script_{name}"]["iterations"] == 2 and results[f"script_{name}"]["finite_metrics"]
    update = results["real_shape_update"]
    assert set(update) >= {"rows8", "rows4", "rows8_gc", "no_grad_logprob_tokens_per_second"}
    assert results["script_spo_tree"]["memory"].startswith("memory: ")  # what `auto` chose, recorded per script
    tree_pass = results["spo_tree_old_logprob_pass"]
    assert (
        tree_pass["edges"] == 2 * (3 + 9) and tree_pass["logprob_max_difference"] == 0
    )  # 2 toy trees 3,3; a CPU: same passes
    for name in ("micro_batch_8", "sized_to_memory"):
        assert tree_pass[name]["passes"] >= 1 and 0 < tree_pass[name]["share_of_pass_and_update"] < 1
    assert tree_pass["sized_to_memory"]["budget_positions"] is None  # a CPU sizes nothing: the micro-batches
    assert results["hf_sampler"]["rows240"]["tokens"] == 240 * 16  # ignore_eos: every row its full budget
    round_trip = results["reference_round_trip"]
    assert (
        all(math.isfinite(round_trip[key]) for key in ("pageable", "pin_once", "resident"))
        and len(round_trip["pinned"]) == 3
    )
    assert round_trip["logprobs_equal_resident_and_parked"] and round_trip["parked_after_its_pass"] == ["cpu"]
    assert "vllm" in results["vllm_sampler"].get("skipped", "") or "greedy_equal_to_hf" in results["vllm_sampler"]
    assert results["environment"]["vllm_preflight"].startswith("vLLM pre-flight:")


def test_a_failing_step_keeps_the_others(tmp_path):
    results = {}
    gpu_check.timed("broken", results, lambda: 1 / 0)
    gpu_check.timed("fine", results, lambda: {"value": 1})
    assert results["broken"]["error"] == "ZeroDivisionError: division by zero" and results["fine"]["value"] == 1
