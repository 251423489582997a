"""spo_chain.py run as a researcher runs it: micro-batch invariance, the non-finite guard, --dry-run, error lines, a
smoke run with the MC rollouts counted, resume, reward that rises, --max-minutes and saved samples."""

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import eval as ev
import spo_chain as spo
from conftest import make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import UsageError, bookkeeping, engines, models

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return models.load_model(str(tiny_model_dir))[1]


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
        spo.accumulate_gradients(
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


def test_a_non_finite_batch_skips_its_update_but_steps_the_scheduler_and_three_in_a_row_stop(
    tiny_model_dir, monkeypatch
):
    model, tokenizer = models.load_model(str(tiny_model_dir))
    samples, args = _samples(tokenizer, n=4), spo.Args(epochs=2, batch_size=2, micro_batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    losses = iter([float("nan"), 1.0, 2.0, float("nan")])  # 2 epochs x 2 batches
    monkeypatch.setattr(spo, "accumulate_gradients", lambda *a, **k: {"loss": next(losses)})
    guard = bookkeeping.NonFiniteGuard()
    with pytest.warns(UserWarning, match="iteration 7: non-finite loss, update skipped"):
        steps = spo.update_policy(model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, 7, guard)
    assert [s["loss"] for s in steps] == [1.0, 2.0] and scheduler.last_epoch == 4 and guard.in_a_row == 1
    # the count runs on across iterations: two more non-finite batches make three in a row
    monkeypatch.setattr(spo, "accumulate_gradients", lambda *a, **k: {"loss": float("inf")})
    with pytest.raises(UsageError, match="three non-finite losses in a row"), warnings.catch_warnings(record=True):
        spo.update_policy(model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, 8, guard)
    assert guard.in_a_row == 3 and scheduler.last_epoch == 5  # the third raises before its scheduler step


def test_dry_run_compares_with_the_paper_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "runs"
    result = spo.main(spo.Args(dry_run=True, output_dir=str(out)))
    assert result["paper_run"] == "gsm8k" and result["differences"] == []  # the defaults are the paper's GSM8K run
    assert result["resolved"] == {"eval_task": "gsm8k", "model_id": models.ALIASES["rho-1b-sft-gsm8k"]}
    assert spo.main(spo.Args(dry_run=True, interval=2, mc_samples=4, output_dir=str(out)))["differences"] == [
        "mc_samples",
        "interval",
    ]
    math_run = spo.main(spo.Args(dry_run=True, task="math", output_dir=str(out)))
    assert math_run["settings"]["eval_task"] == "math500"  # MATH trains, MATH500 evaluates (the paper's protocol)
    assert not out.exists()
    assert "2 difference(s) from the paper; nothing was loaded (--dry-run)" in capsys.readouterr().out


def test_cli_bad_input_prints_one_error_line(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "spo_chain.py"), "--interval", "0", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: --interval (0) must be at least 1")
    assert "Traceback" not in result.stderr


def test_smoke_run_counts_mc_rollouts_and_writes_a_checkpoint_eval_reloads(
    tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch
):
    requests, real_sample = [], engines.HFSampler.sample

    def counting_sample(self, prompts, n, **kwargs):
        if kwargs.get("progress") == "mc":
            requests.append((prompts, n))
        return real_sample(self, prompts, n, **kwargs)

    monkeypatch.setattr(engines.HFSampler, "sample", counting_sample)
    summary = spo.main(smoke_args(spo, tiny_model_dir, gsm8k_jsonl, tmp_path))
    metrics = read_metrics(summary["run_dir"])
    train = [m for m in metrics if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1, 2]
    assert all(isinstance(v, (int, float)) and v == v and abs(v) != float("inf") for m in metrics for v in m.values())
    assert (
        "losses/kl_per_sequence" in train[0] and "losses/grad_norm" in train[0] and "charts/mc_value_mean" in train[0]
    )
    # one MC call per iteration, distinct prefixes only, and the logged count is what was requested
    assert len(requests) == 2
    for (prompts, n), m in zip(requests, train):
        assert n == 2 and len({tuple(p) for p in prompts}) == len(prompts)
        assert m["charts/mc_rollouts"] == len(prompts) * n and m["charts/mc_states"] == len(prompts)
        # a random tiny model is never confident: every token is low-probability, cutpoints -1, 1, 3 at interval 2;
        # the 4 responses of a question share the prompt state (c = -1)
        assert m["charts/cutpoints_per_response"] > 0 and m["charts/loss_mask_fraction"] == 1.0
        assert m["charts/mc_states"] < m["charts/cutpoints_per_response"] * 12
    model, tokenizer = models.load_model(summary["checkpoint"])
    result = ev.evaluate(model, tokenizer, str(gsm8k_jsonl), limit=2, max_new_tokens=4)
    assert result["examples"] == 2 and 0.0 <= result["accuracy"] <= 1.0
    assert torch.load(Path(summary["checkpoint"]) / "trainer_state.pt", weights_only=True)["iteration"] == 2


def test_resume_after_a_kill_continues_exactly_where_it_stopped(tiny_model_dir, gsm8k_jsonl, tmp_path, monkeypatch):
    full = spo.main(smoke_args(spo, tiny_model_dir, gsm8k_jsonl, tmp_path / "full", iterations=3))

    class Killed(Exception):
        pass

    calls, real_step = [], spo.accumulate_gradients

    def dies_in_iteration_3(*args, **kwargs):  # 2 optimizer steps per iteration: the 5th is iteration 3's first
        calls.append(1)
        if len(calls) == 5:
            raise Killed
        return real_step(*args, **kwargs)

    monkeypatch.setattr(spo, "accumulate_gradients", dies_in_iteration_3)
    with pytest.raises(Killed):
        spo.main(smoke_args(spo, tiny_model_dir, gsm8k_jsonl, tmp_path / "killed", iterations=3))
    monkeypatch.setattr(spo, "accumulate_gradients", real_step)
    run_dir = next((tmp_path / "killed").iterdir())
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 2

    resumed = spo.main(
        smoke_args(spo, tiny_model_dir, gsm8k_jsonl, tmp_path / "unused", iterations=3, resume=str(run_dir))
    )
    assert resumed["run_dir"] == str(run_dir)
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 3
    assert read_metrics(run_dir) == read_metrics(full["run_dir"])  # same seed: same numbers, MC values included


@pytest.mark.slow
def test_reward_rises_on_a_trivially_learnable_task(tmp_path):
    # Digits-only vocabulary; every answer is 7, so "7<eos>" is always right. The only learning signal is the
    # chain advantages (MC values of the cutpoint states): a sign or alignment error there would not learn.
    model_dir = make_tiny_model(tmp_path / "digits", alphabet="0123456789 ")
    data = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    summary = spo.main(
        spo.Args(
            model=str(model_dir),
            task=str(data),
            backend="hf",
            iterations=12,
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
            mc_samples=4,
            interval=1,
            eval_every=1000,
            eval_samples=4,
            eval_limit=8,
            eval_temperature=0.6,
            save_every=1000,
            output_dir=str(tmp_path / "runs"),
        )
    )
    rewards = [m["charts/reward"] for m in read_metrics(summary["run_dir"]) if "charts/reward" in m]
    assert rewards[0] < 0.1
    assert sum(rewards[-3:]) / 3 > 0.4
    assert summary["accuracy_after"] > summary["accuracy_before"] + 0.3


def test_max_minutes_stops_early_and_save_samples_writes_cutpoints_values_and_advantages(
    tiny_model_dir, gsm8k_jsonl, tmp_path
):
    summary = spo.main(
        smoke_args(
            spo,
            tiny_model_dir,
            gsm8k_jsonl,
            tmp_path,
            iterations=5,
            max_minutes=1e-6,
            save_samples=1,
            save_questions=1,
            max_new_tokens=12,
            context=128,
        )
    )
    run_dir = Path(summary["run_dir"])
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "charts/reward" in m]
    assert [m["iteration"] for m in train] == [1] and [m["iteration"] for m in lines if "eval/accuracy" in m] == [0, 1]
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 1
    assert train[0]["time/train_seconds"] == train[0]["time/iteration_seconds"] > 0
    assert (
        train[0]["charts/generated_tokens"] == train[0]["charts/response_tokens"] * 3 * 4 + train[0]["charts/mc_tokens"]
    )

    records = [json.loads(line) for line in (run_dir / "samples" / "iter_1.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["algorithm"] == "spo_chain" and r["question_index"] == 0 for r in records)
    assert sum(len(r["cutpoints"]) for r in records) > 0  # random tiny model: many low-probability tokens
    for r in records:
        n = len(r["token_ids"])
        assert len(r["tokens"]) == len(r["probs"]) == len(r["advantages"]) == len(r["loss_mask"]) == n
        assert r["cutpoints"] == spo.find_cutpoints(r["probs"], 0.9, 2)
        assert len(r["cutpoint_values"]) == len(r["cutpoints"]) and all(0 <= v <= 1 for v in r["cutpoint_values"])
        expected = spo.chain_advantages(r["probs"], r["cutpoints"], r["cutpoint_values"], r["reward"], 0.9, True)
        assert r["advantages"] == pytest.approx(expected, abs=1e-4)
