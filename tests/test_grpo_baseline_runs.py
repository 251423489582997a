"""grpo_baseline.py run as a researcher runs it: micro-batch invariance, EOS in the loss, the on-policy step, a smoke
run, resume, identical seeds, reward that rises, --max-minutes and saved rollouts."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as ev
import grpo_baseline as grpo
from conftest import killed_at_step, make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import models

ROOT = Path(__file__).resolve().parents[1]


def _samples(tokenizer, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = tokenizer(f"question {i}:")["input_ids"]
        response = torch.randint(4, len(tokenizer), (3 + i % 4,), generator=g).tolist() + [tokenizer.eos_token_id]
        length = len(response)
        samples.append(
            {
                "prompt_ids": prompt,
                "response_ids": response,
                "old_logps": -torch.rand(length, generator=g) * 3,
                "ref_logps": -torch.rand(length, generator=g) * 3,
                "advantages": torch.randn(length, generator=g),
                "loss_mask": torch.rand(length, generator=g) > 0.2,
            }
        )
    return samples


def test_gradient_does_not_depend_on_micro_batch_split(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    samples = _samples(tokenizer)
    grads = []
    for micro in (1, 2, 6):
        model.zero_grad()
        grpo.accumulate_gradients(
            model,
            samples,
            micro_batch_size=micro,
            temperature=0.7,
            clip_eps=0.2,
            beta=0.1,
            pad_id=tokenizer.pad_token_id,
        )
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-5) and torch.allclose(
        grads[0], grads[2], rtol=1e-5, atol=1e-5
    )


def test_eos_is_in_the_loss_mask_even_when_pad_equals_eos(tiny_model_dir):
    _, tokenizer = models.load_model(str(tiny_model_dir))
    eos = tokenizer.eos_token_id
    samples = [{"prompt_ids": [5, 6], "response_ids": [7, eos]}, {"prompt_ids": [5], "response_ids": [8, 9, 10, eos]}]
    batch = grpo.collate(samples, pad_id=eos, device="cpu")  # the trap: pad id == EOS id
    assert batch["response_mask"].tolist() == [[True, True, False, False], [True, True, True, True]]
    responses = batch["input_ids"][:, -4:]
    assert responses[0, 1] == eos and responses[1, 3] == eos


def test_response_logprobs_match_a_plain_forward(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    samples = [
        {"prompt_ids": [10, 11, 12], "response_ids": [13, 14]},
        {"prompt_ids": [20], "response_ids": [21, 22, 23]},
    ]
    logps = grpo.response_logprobs(model, grpo.collate(samples, 0, "cpu"), temperature=0.5)
    for row, s in enumerate(samples):
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        logits = model(ids).logits[0, :-1] / 0.5
        expected = (
            torch.log_softmax(logits, -1)[len(s["prompt_ids"]) - 1 :]
            .gather(-1, ids[0, len(s["prompt_ids"]) :, None])
            .squeeze(-1)
        )
        assert torch.allclose(logps[row, : len(s["response_ids"])], expected, atol=1e-5)


def test_cli_bad_model_prints_one_error_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "grpo_baseline.py"),
            "--model",
            str(tmp_path / "missing"),
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot load model")
    assert "Traceback" not in result.stderr


def test_smoke_run_writes_finite_metrics_and_a_checkpoint_eval_reloads(tiny_model_dir, gsm8k_jsonl, tmp_path):
    summary = grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path))
    metrics = read_metrics(summary["run_dir"])
    train = [m for m in metrics if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1, 2]
    assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for m in metrics for v in m.values())
    assert "losses/kl_per_sequence" in train[0] and "losses/grad_norm" in train[0]
    model, tokenizer = models.load_model(summary["checkpoint"])
    result = ev.evaluate(model, tokenizer, str(gsm8k_jsonl), limit=2, max_new_tokens=4)
    assert result["examples"] == 2 and 0.0 <= result["accuracy"] <= 1.0
    state = torch.load(Path(summary["checkpoint"]) / "trainer_state.pt", weights_only=True)
    assert state["iteration"] == 2


def test_resume_after_a_kill_continues_exactly_where_it_stopped(tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch):
    full = grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path / "full", iterations=3))

    with killed_at_step(monkeypatch, grpo, 5):  # 2 optimizer steps per iteration: the 5th is iteration 3's first
        grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path / "killed", iterations=3))
    run_dir = next((tmp_path / "killed").iterdir())
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 2

    resumed = grpo.main(
        smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path / "unused", iterations=3, resume=str(run_dir))
    )
    assert resumed["run_dir"] == str(run_dir)
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 3
    assert read_metrics(run_dir) == read_metrics(full["run_dir"])  # same seed: same numbers with or without the kill


def test_same_seed_gives_identical_metrics(tiny_model_dir, gsm8k_jsonl, tmp_path):
    one = grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path / "a"))
    two = grpo.main(smoke_args(grpo, tiny_model_dir, gsm8k_jsonl, tmp_path / "b"))
    assert read_metrics(one["run_dir"]) == read_metrics(two["run_dir"])


@pytest.mark.slow
def test_reward_rises_on_a_trivially_learnable_task(tmp_path):
    # Digits-only vocabulary; every answer is 7, so "7<eos>" is always right and GRPO must find it.
    model_dir = make_tiny_model(tmp_path / "digits", alphabet="0123456789 ")
    data = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    summary = grpo.main(
        grpo.Args(
            model=str(model_dir),
            task=str(data),
            backend="hf",
            iterations=25,
            questions=8,
            group_size=8,
            max_new_tokens=3,
            context=64,
            batch_size=64,
            micro_batch_size=64,
            epochs=1,
            lr=1e-2,
            beta=0.0,
            warmup_ratio=0.0,
            eval_every=1000,
            eval_samples=4,
            eval_limit=8,
            eval_temperature=0.6,
            save_every=1000,
            output_dir=str(tmp_path / "runs"),
        )
    )
    rewards = [m["charts/reward"] for m in read_metrics(summary["run_dir"]) if "charts/reward" in m]
    assert sum(rewards[:3]) / 3 < 0.2
    assert sum(rewards[-3:]) / 3 > 0.8
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.5


def test_max_minutes_stops_early_and_save_samples_writes_the_rollouts(tiny_model_dir, gsm8k_jsonl, tmp_path):
    summary = grpo.main(
        smoke_args(
            grpo,
            tiny_model_dir,
            gsm8k_jsonl,
            tmp_path,
            iterations=5,
            max_minutes=1e-6,
            save_samples=1,
            save_questions=2,
        )
    )
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1]  # the budget ran out in iteration 1: it became the last one
    assert [m["iteration"] for m in lines if "eval/accuracy" in m] == [0, 1]
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 1
    assert train[0]["time/train_seconds"] == train[0]["time/iteration_seconds"] > 0
    assert train[0]["charts/generated_tokens"] == train[0]["charts/response_tokens"] * 3 * 4

    records = [json.loads(line) for line in (run_dir / "samples" / "iter_1.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 and [r["question_index"] for r in records] == [0] * 4 + [1] * 4
    tokenizer = models.load_model(str(tiny_model_dir))[1]
    for r in records:
        n = len(r["token_ids"])
        assert len(r["tokens"]) == len(r["probs"]) == len(r["advantages"]) == len(r["loss_mask"]) == n
        assert "".join(r["tokens"]) == tokenizer.decode(r["token_ids"])
        assert all(0 < p <= 1 for p in r["probs"]) and r["reward"] in (0.0, 1.0) and r["cutpoints"] is None
    for q in range(2):
        group = [r for r in records if r["question_index"] == q]
        expected = grpo.group_advantages(torch.tensor([r["reward"] for r in group]), 4)
        for a, r in zip(expected.tolist(), group):
            assert r["advantages"] == pytest.approx([a] * len(r["token_ids"]), abs=1e-4)  # one advantage per response
