"""Many processes (torchrun, gloo on CPU): N ranks make the update one process makes from the union of their samples;
a torchrun run trains, checkpoints and resumes like a single-process one; a failing rank ends the whole job."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as ev

DRIVER = Path(__file__).resolve().parent / "distributed_step.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def run(command: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("script", ["grpo_baseline"])
def test_two_ranks_make_the_update_of_one_process_on_the_union_of_their_samples(script, tiny_model_dir, tmp_path):
    run([sys.executable, str(DRIVER), script, str(tiny_model_dir), str(tmp_path)])
    run(TORCHRUN + [str(DRIVER), script, str(tiny_model_dir), str(tmp_path)])
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    initial = dict(ev.load_model(str(tiny_model_dir), dtype=torch.float32)[0].named_parameters())
    assert max((one["parameters"][0][name] - p).abs().max().item() for name, p in initial.items()) > 1e-3  # the step moved
    if "mask_fraction" in one["stats"]:
        assert 0 < one["stats"]["mask_fraction"] < 1  # the probability mask is in play
    for key in one["stats"]:
        assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-5, abs=1e-7), key
    for single, ranks in zip(one["parameters"], two["parameters"]):
        for name in single:
            assert torch.allclose(ranks[name], single[name], rtol=1e-5, atol=1e-7), name
