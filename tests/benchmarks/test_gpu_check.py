"""benchmarks/gpu_check.py, the steps of the lease command: one step a process, its result or its error in its JSON,
and each script's command line as the scripts parse it (tests/benchmarks/test_gpu_lease.py runs every step at toy
sizes)."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from plumbing import cli

ROOT = Path(__file__).resolve().parents[2]


def test_a_failing_step_keeps_the_others():
    results = {}
    gpu_check.timed("broken", results, lambda: 1 / 0)
    gpu_check.timed("exits", results, lambda: sys.exit(2))  # tyro exits on a flag it does not know
    gpu_check.timed("fine", results, lambda: {"value": 1})
    assert results["broken"]["error"] == "ZeroDivisionError: division by zero"
    assert results["exits"]["error"] == "SystemExit: 2" and results["fine"]["value"] == 1


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["grpo", "spo_chain", "spo_tree", "ppo", "spo_tree_vllm"])
def test_each_scripts_command_line_parses_as_the_script_parses_it(name, device, tmp_path):
    """The flags a lease passes, at the GPU's sizes too: a renamed flag fails here, not minutes into a lease."""
    module = gpu_check.SCRIPTS[name.removesuffix("_vllm")]
    args = cli.parse(module.Args, gpu_check.script_flags(name, tmp_path, device))
    assert args.iterations == 2 and args.model == str(tmp_path / "digits")
    assert args.backend == ("vllm" if name.endswith("_vllm") else "hf")
    if name == "spo_tree":  # every memory knob at auto but the parked reference
        assert (args.micro_batch_size, args.reference_on_device) == ("auto", False)


def test_one_step_writes_its_json(tmp_path):
    result = gpu_check.main(gpu_check.Args(step="models", device="cpu", work=str(tmp_path)))
    written = json.loads((tmp_path / "models.json").read_text())
    assert written["step"] == "models" and written["models"] == result
    assert set(result["built"]) == {"digits", "printable"} and (tmp_path / "sevens.jsonl").is_file()
    again = gpu_check.main(
        gpu_check.Args(step="models", device="cpu", work=str(tmp_path), out=str(tmp_path / "o.json"))
    )
    assert again["built"] == {}  # the models are built once; every later step reuses them


def test_a_step_that_fails_writes_its_error(tmp_path):
    (tmp_path / "digits").mkdir()
    (tmp_path / "digits" / "config.json").write_text("{")  # a damaged model directory
    result = gpu_check.main(gpu_check.Args(step="script_grpo", device="cpu", work=str(tmp_path)))
    assert "error" in result and "trace" in result
    assert json.loads((tmp_path / "script_grpo.json").read_text())["script_grpo"]["error"] == result["error"]


def test_the_lora_step_trains_the_planned_adapters_and_times_the_merge(tmp_path):
    """The lease's LoRA step at toy size: the adapters it trains are the ones the plan counts, both micro-batches run
    beside an estimate, and the sync's merge covers every weight of the base."""
    result = gpu_check.main(gpu_check.Args(step="lora_update", device="cpu", work=str(tmp_path)))
    assert "error" not in result, result.get("trace")
    assert result["trainable_parameters"] == result["planned_adapters"] > 0
    picked = [key for key in result if key.startswith("mb") and result[key]["plan_picked_it"]]
    assert len(picked) == 1 and "mb8" in result
    assert all(result[key]["estimated_gib"] is not None for key in result if key.startswith("mb"))
    assert "reference: the base (adapters off)" in result["plan"]
    base = gpu_check.qwen("cpu")
    assert result["merge"]["parameters"] == sum(p.numel() for p in base.parameters())
