"""vLLM under torchrun (2 gloo processes, the fake vllm of test_vllm_glue.py, run by tests/helpers/vllm_ranks_run.py):
every rank builds its own engine as vLLM 0.30's external launcher needs (tests/test_vllm_source.py holds those facts
to the wheel), samples its own share of the questions, and after every update holds the trained weights, with the
model replicated or sharded by FSDP2."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.vllm_ranks_run import digests

from conftest import SMOKE_SETTINGS, cli_flags, read_metrics
from plumbing import models

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    str(ROOT / "tests" / "helpers" / "vllm_ranks_run.py"),
]


def ranks(out: Path, *command: str) -> list[dict]:
    result = subprocess.run(TORCHRUN + [str(out), *command], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def engine_built_for_its_rank(record: dict, rank: int) -> None:
    assert record["llm"]["distributed_executor_backend"] == "external_launcher"
    assert record["llm"]["tensor_parallel_size"] == 1 and record["llm"]["enable_sleep_mode"] is True
    # torchrun's RANK and LOCAL_RANK are this process's, in the world init_distributed made before the engine,
    # and both ranks built their engines together (the minimum over ranks of RANK + 1 is 1).
    assert record["world"] == {
        "world_size": 2,
        "rank": rank,
        "local_rank": rank,
        "torch_rank": rank,
        "min_over_ranks": 1,
    }


@pytest.mark.parametrize("sharding", ["replicas", "fsdp"])
def test_each_rank_samples_its_questions_with_its_own_engine_and_receives_the_trained_weights(
    sharding, tiny_model_dir, gsm8k_jsonl, tmp_path
):
    iterations = 2
    settings = {
        **SMOKE_SETTINGS["grpo_baseline"],
        "questions": 4,
        "batch_size": 8,
        "micro_batch_size": 4,
        "max_new_tokens": 10,
        "context": 160,
        "iterations": iterations,
        "model": str(tiny_model_dir),
        "task": str(gsm8k_jsonl),
        "output_dir": str(tmp_path / "runs"),
        # replicas: --backend auto chooses vLLM under torchrun; fsdp: --backend vllm is not refused there
        "backend": "auto" if sharding == "replicas" else "vllm",
        **({"fsdp": True} if sharding == "fsdp" else {}),
    }
    records = ranks(tmp_path, "script", "grpo_baseline.py", *cli_flags(settings))
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert json.loads((run_dir / "starts.jsonl").read_text().splitlines()[0])["backend"] == "vllm"
    metrics = read_metrics(run_dir)
    rewards = [m["charts/reward"] for m in metrics if "charts/reward" in m]
    assert len(rewards) == iterations and all(0 < r < 1 for r in rewards)  # the fake's answers were graded
    assert all(math.isfinite(v) for m in metrics for v in m.values())

    # (a) Each rank's engine, built for that rank, samples that rank's prompts: the eval questions split between the
    # ranks (3: one and two), the training questions (4 a rollout: two each, 4 samples each) differ.
    for rank, record in enumerate(records):
        engine_built_for_its_rank(record, rank)
    evals = [[call["prompts"] for call in record["generate"] if call["n"] == 1] for record in records]
    rollouts = [[call["prompts"] for call in record["generate"] if call["n"] == 4] for record in records]
    assert [len(calls) for calls in evals] == [1 + iterations] * 2  # before training, and after each iteration
    assert [len(evals[0][0]), len(evals[1][0])] == [1, 2] and not set(map(tuple, evals[0][0])) & set(
        map(tuple, evals[1][0])
    )
    assert [[len(prompts) for prompts in calls] for calls in rollouts] == [[2] * iterations] * 2
    assert all(mine != theirs for mine, theirs in zip(*rollouts))

    # (b) After every update each rank's engine slept (level 2: weights discarded), woke its weights, received the
    # whole model, then its KV cache; the weights are the same on both ranks, moved by each update, and the last
    # are the trained model's (the checkpoint, saved after the last update), in the engine's dtype.
    cycle = ["sleep", "wake_up ['weights']", "reload_weights", "wake_up ['kv_cache']", "reset_prefix_cache"]
    assert all(record["events"] == cycle * iterations for record in records)
    assert records[0]["syncs"] == records[1]["syncs"]
    syncs = records[0]["syncs"]
    initial = digests(models.load_model(str(tiny_model_dir), dtype=torch.float32)[0].named_parameters())
    trained = digests(models.load_model(str(run_dir / "checkpoint"), dtype=torch.float32)[0].named_parameters())
    assert [set(sync) for sync in syncs] == [set(initial)] * iterations  # every parameter, at its full shape
    assert syncs[-1] == trained
    assert initial != syncs[0] != syncs[1]

    # (c) The ranks draw their own samples: no request seed is shared (a question both ranks drew would otherwise be
    # sampled with the same noise on both).
    seeds = [{seed for call in record["generate"] for seed in call["seeds"]} for record in records]
    assert not seeds[0] & seeds[1]


def test_shards_reach_every_engine_whole(tiny_model_dir, tmp_path):
    records = ranks(tmp_path, "sharded-sync", str(tiny_model_dir))
    for rank, record in enumerate(records):
        engine_built_for_its_rank(record, rank)
        assert record["sharded"], "the parameters were on their shards when load_weights ran"
        assert record["events"] == ["reload_weights", "reset_prefix_cache"]
    assert records[0]["reference"] and records[0]["syncs"] == records[1]["syncs"] == [records[0]["reference"]]
