"""benchmarks/sampler.py's figures that are derived from the measured seconds."""

import json
from pathlib import Path

import pytest

from benchmarks import sampler as bench

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

ROOT = Path(__file__).resolve().parents[2]


def case(hf_sampler: float, generate: float) -> dict:
    return {"hf_sampler": {"seconds": hf_sampler}, "generate": {"seconds": generate}}


def test_bf16_sampler_is_compared_with_fp32_generate_case_by_case():
    precisions = {
        "fp32": {"mc": case(14.0, 39.0), "tree": case(9.0, 20.0)},
        "bf16": {"mc": case(11.0, 28.0), "tree": case(5.0, 14.0)},
    }
    assert bench.bf16_over_fp32_generate(precisions) == {"mc": 39.0 / 11.0, "tree": 20.0 / 5.0}


def test_no_bf16_comparison_where_bf16_was_skipped():
    fp32 = {"mc": case(14.0, 39.0)}
    assert bench.bf16_over_fp32_generate({"fp32": fp32, "bf16": {"skipped": "the CPU has no bf16"}}) == {}
    assert bench.bf16_over_fp32_generate({"fp32": fp32}) == {}


def test_committed_results_hold_the_comparison_their_seconds_give():
    files = sorted((ROOT / "benchmarks" / "results").glob("sampler*.json"))  # one per machine measured
    assert files
    for path in files:
        results = json.loads(path.read_text())
        assert results["hf_sampler_bf16_over_generate_fp32"] == bench.bf16_over_fp32_generate(results["precisions"]), (
            path.name
        )
