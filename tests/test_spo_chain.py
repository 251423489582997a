"""spo_chain.py: cutpoints, chain advantages against the SPEC definitions, MC values (dedup, budget),
micro-batch invariance, smoke run with the MC rollouts counted, resume, error lines."""

import doctest
import json
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import eval as ev
import spo_chain as spo
from conftest import make_tiny_model, read_metrics, smoke_args, write_jsonl
from plumbing import UsageError, engines, models

ROOT = Path(__file__).resolve().parents[1]
WORKED_PROBS = [0.99, 0.72, 1, 0.85, 1, 0.56, 0.92, 0.23, 0.98, 0.11, 1, 0.5, 0.99]  # the example


# ---- brute-force reference: SPEC.md "SPO-chain", written token by token


def reference_cutpoints(probs, threshold, interval):
    low = [t for t in range(len(probs)) if probs[t] < threshold]
    return [t - 1 for t in low][::interval]


def reference_advantages(probs, cutpoints, values, reward, threshold, prob_mask):
    T = len(probs)
    if not cutpoints:
        return [0.0] * T
    value_at = {c: v for c, v in zip(cutpoints, values) if c >= 0}
    value_at[T - 1] = reward  # the last token carries R
    advantages = []
    for t in range(T):
        position = min(p for p in value_at if p >= t)  # the next value position at or to the right of t
        earlier = [p for p in value_at if p < position]
        if earlier:
            advantage = value_at[position] - value_at[max(earlier)]
        elif cutpoints[0] == -1:
            advantage = value_at[position] - values[0]  # V(prompt) is the starting baseline
        else:
            advantage = 0.0
        advantages.append(0.0 if prob_mask and probs[t] > threshold else advantage)
    return advantages


# ---- pure functions


def test_docstring_examples():
    assert doctest.testmod(spo).failed == 0


def test_worked_example_cutpoints_and_advantages():
    assert spo.find_cutpoints(WORKED_PROBS, threshold=0.9, interval=2) == [0, 4, 8]
    assert spo.find_cutpoints(WORKED_PROBS, threshold=0.9, interval=1) == [0, 2, 4, 6, 8, 10]
    v0, v4, v8, R = 0.3, 0.7, 0.1, 1.0
    unmasked = spo.chain_advantages(WORKED_PROBS, [0, 4, 8], [v0, v4, v8], R, prob_mask=False)
    assert unmasked == [0.0] + [v4 - v0] * 4 + [v8 - v4] * 4 + [R - v8] * 4
    masked = spo.chain_advantages(WORKED_PROBS, [0, 4, 8], [v0, v4, v8], R)
    kept = {1: v4 - v0, 3: v4 - v0, 5: v8 - v4, 7: v8 - v4, 9: R - v8, 11: R - v8}
    assert masked == [kept.get(t, 0.0) for t in range(13)]


def test_first_token_cutpoint_uses_the_prompt_value_as_baseline():
    probs = [0.4, 0.95, 0.6, 0.99, 0.2]  # low: 0, 2, 4 -> cutpoints -1, 1, 3
    assert spo.find_cutpoints(probs, interval=1) == [-1, 1, 3]
    v_prompt, v1, v3, R = 0.25, 0.5, 0.75, 0.0
    advantages = spo.chain_advantages(probs, [-1, 1, 3], [v_prompt, v1, v3], R, prob_mask=False)
    assert advantages == [v1 - v_prompt] * 2 + [v3 - v1] * 2 + [R - v3]
    # only the prompt as cutpoint: every token gets R - V(prompt), a per-response baseline
    assert spo.chain_advantages(probs, [-1], [0.25], 1.0, prob_mask=False) == [0.75] * 5
    # without the baseline the first segment gets 0
    assert spo.chain_advantages(probs, [1, 3], [v1, v3], R, prob_mask=False) == [0.0] * 2 + [v3 - v1] * 2 + [R - v3]


def test_no_cutpoints_gives_zero_advantages():
    confident = [0.95, 0.99, 1.0, 0.91]
    assert spo.find_cutpoints(confident) == []
    for mask in (True, False):
        assert spo.chain_advantages(confident, [], [], 1.0, prob_mask=mask) == [0.0] * 4
    assert spo.find_cutpoints([]) == [] and spo.chain_advantages([], [], [], 1.0) == []


def test_prob_mask_is_strictly_greater_and_off_means_nothing_masked():
    probs = [0.5, 0.9, 0.95, 0.3]  # p_1 == threshold: not low (no cutpoint) and not masked (not > threshold)
    assert spo.find_cutpoints(probs, threshold=0.9, interval=1) == [-1, 2]
    assert spo.chain_advantages(probs, [-1, 2], [0.5, 0.25], 1.0, threshold=0.9) == [-0.25, -0.25, 0.0, 0.75]
    assert spo.chain_advantages(probs, [-1, 2], [0.5, 0.25], 1.0, threshold=0.9, prob_mask=False) == [
        -0.25,
        -0.25,
        -0.25,
        0.75,
    ]


def test_edge_cases_cutpoint_at_last_token_and_bad_cutpoints():
    probs = [0.5, 0.5, 0.5]
    # A cutpoint at T-1 (find_cutpoints never makes one) is the finished response: R, not its V, is its value.
    assert spo.chain_advantages(probs, [0, 2], [0.25, 0.5], 1.0) == [0.0, 0.75, 0.75]
    assert spo.chain_advantages(probs, [2], [0.5], 1.0) == [0.0, 0.0, 0.0]
    for cutpoints, values in [([1, 1], [0.1, 0.2]), ([1, 0], [0.1, 0.2]), ([3], [0.1]), ([-2], [0.1]), ([0], [])]:
        with pytest.raises(ValueError):
            spo.chain_advantages(probs, cutpoints, values, 1.0)
    with pytest.raises(ValueError):
        spo.find_cutpoints(probs, interval=0)


def test_matches_the_spec_definitions_on_random_cases():
    rng = random.Random(0)
    for case in range(400):
        T = rng.randint(0, 40)
        threshold = rng.choice([0.9, 0.5, rng.random()])
        # probabilities near 1 (confident), low, and exactly at the threshold
        probs = [rng.choice([rng.random(), 1 - rng.random() * 0.1, 1.0, threshold]) for _ in range(T)]
        interval = rng.randint(1, 6)
        cutpoints = spo.find_cutpoints(probs, threshold, interval)
        assert cutpoints == reference_cutpoints(probs, threshold, interval), case
        if case % 4 == 0 and T:  # arbitrary valid cutpoints too, T-1 included
            cutpoints = sorted(rng.sample(range(-1, T), rng.randint(0, min(T + 1, 6))))
        values = [rng.choice([rng.random(), rng.randint(0, 9) / 9]) for _ in cutpoints]
        reward = rng.choice([0.0, 1.0, rng.random()])
        for mask in (True, False):
            got = spo.chain_advantages(probs, cutpoints, values, reward, threshold, mask)
            assert got == reference_advantages(probs, cutpoints, values, reward, threshold, mask), (
                case,
                probs,
                cutpoints,
                values,
            )


def test_loss_mask_and_whitening_follow_the_prob_mask():
    response = torch.tensor([True, True, True, False])
    probs = torch.tensor([0.95, 0.5, 0.89, 0.1])
    assert spo.loss_mask(response, probs, 0.9, prob_mask=False).tolist() == [True, True, True, False]
    assert spo.loss_mask(response, probs, 0.9, prob_mask=True).tolist() == [False, True, True, False]
    assert spo.loss_mask(response, torch.tensor([0.95, 0.99, 0.91, 0.1]), 0.9, True).tolist() == [
        True,
        True,
        True,
        False,
    ]
    out = spo.whiten(torch.tensor([1.0, 3.0, 100.0]), torch.tensor([True, True, False]))
    assert out[:2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-6)


# ---- MC values


class ScriptedSampler:
    """Stands in for engines.HFSampler: records every request and answers with scripted continuations."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def sample(
        self, prompts, n, *, temperature, top_p, max_new_tokens, stop=(), context=None, progress=None, generated=0
    ):
        self.calls.append(
            {
                "prompts": [list(p) for p in prompts],
                "n": n,
                "max_new_tokens": max_new_tokens,
                "context": context,
                "generated": generated,
            }
        )
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        return [
            [self.cut(self.script(list(p), i), min(b, context - len(p)) if context else b) for i in range(n)]
            for p, b in zip(prompts, budgets)
        ]

    @staticmethod
    def cut(completion, budget):  # like the real samplers: a completion never runs past its budget
        if len(completion.ids) <= budget:
            return completion
        return engines.Completion(ids=completion.ids[:budget], finish_reason="length")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return models.load_model(str(tiny_model_dir))[1]


def test_identical_prefixes_are_estimated_once_and_graded_with_their_response_prefix(tokenizer):
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    prompt_a, prompt_b = ids("Q: 40+2?"), ids("Q: 6+1?")
    # continuation i of every prefix spells "2" for i < 3, else "9": with prefix "4" that is "42" three times in four
    sampler = ScriptedSampler(
        lambda prefix, i: engines.Completion(ids=ids("2" if i < 3 else "9") + [eos], finish_reason="stop")
    )
    states = [
        (prompt_a, [], "42"),
        (prompt_a, ids("4"), "42"),
        (prompt_a, [], "42"),
        (prompt_a, ids("4"), "42"),
        (prompt_a, ids("5"), "42"),
        (prompt_b, [], "7"),
        (prompt_a, [], "42"),
    ]
    settings = dict(
        mc_samples=4, temperature=0.6, top_p=0.9, max_new_tokens=10, context=100, task="data.jsonl", stop=[]
    )
    values, stats = spo.mc_values(sampler, tokenizer, states, **settings)
    assert len(sampler.calls) == 1 and sampler.calls[0]["n"] == 4  # one call for the whole batch
    requested = sampler.calls[0]["prompts"]
    assert requested == [prompt_a, prompt_a + ids("4"), prompt_a + ids("5"), prompt_b]  # 4 distinct states of 7
    assert stats["mc_states"] == 4 and stats["mc_rollouts"] == len(requested) * sampler.calls[0]["n"] == 16
    assert stats["mc_tokens"] == 16 * 2
    # "2" alone is not 42 but "4" + "2" is; "5" + "2" is not; nothing from prompt_b is 7
    assert values == [0.0, 0.75, 0.0, 0.75, 0.0, 0.0, 0.0]
    assert spo.mc_values(sampler, tokenizer, [], **settings) == ([], {"mc_states": 0, "mc_rollouts": 0, "mc_tokens": 0})


def test_continuations_keep_the_rollout_budget_and_unfinished_ones_score_zero(tokenizer):
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    prompt = ids("Q?")  # 2 tokens

    def script(prefix, i):
        # 0: "7<eos>" finished (2 tokens); 1: " 7<eos>" (3 tokens); 2: "  7<eos>" (4 tokens); 3: "7..." cut by the
        # sampler
        if i == 3:
            return engines.Completion(ids=ids("7777"), finish_reason="length")
        return engines.Completion(ids=ids(" " * i + "7") + [eos], finish_reason="stop")

    sampler = ScriptedSampler(script)
    settings = dict(mc_samples=4, temperature=0.6, top_p=0.9, max_new_tokens=6, context=100, task="data.jsonl", stop=[])
    # response prefixes of 1, 3 and 4 tokens (spaces): budgets 5, 3 and 2 (max_new_tokens - prefix length)
    states = [(prompt, ids(" "), "7"), (prompt, ids("   "), "7"), (prompt, ids("    "), "7")]
    values, _ = spo.mc_values(sampler, tokenizer, states, **settings)
    assert sampler.calls[0]["max_new_tokens"] == [5, 3, 2] and sampler.calls[0]["context"] == 100
    assert sampler.calls[0]["generated"] == [1, 3, 4]  # a stop string may begin in the response prefix
    assert values == [0.75, 0.5, 0.25]
    # the context binds when it is tighter: the sampler caps 5 at 6 - len(prompt + prefix) = 3
    values, _ = spo.mc_values(sampler, tokenizer, states[:1], **{**settings, "context": 6})
    assert sampler.calls[-1]["max_new_tokens"] == [5] and sampler.calls[-1]["context"] == 6 and values == [0.5]


# ---- update


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
    streak = [0]
    with pytest.warns(UserWarning, match="iteration 7: non-finite loss, update skipped"):
        steps = spo.update_policy(model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, 7, streak)
    assert [s["loss"] for s in steps] == [1.0, 2.0] and scheduler.last_epoch == 4 and streak == [1]
    # the count runs on across iterations: two more non-finite batches make three in a row
    monkeypatch.setattr(spo, "accumulate_gradients", lambda *a, **k: {"loss": float("inf")})
    with pytest.raises(UsageError, match="three non-finite losses in a row"), warnings.catch_warnings(record=True):
        spo.update_policy(model, optimizer, scheduler, samples, args, tokenizer.pad_token_id, 8, streak)
    assert streak == [3] and scheduler.last_epoch == 5  # the third raises before its scheduler step


# ---- errors


def test_bad_configuration_is_one_clear_error():
    with pytest.raises(UsageError, match="--interval"):
        spo.validate(spo.Args(interval=0))
    with pytest.raises(UsageError, match="--mc-samples"):
        spo.validate(spo.Args(mc_samples=0))
    with pytest.raises(UsageError, match="--prob-threshold"):
        spo.validate(spo.Args(prob_threshold=1.5))
    with pytest.raises(UsageError, match="multiple of --micro-batch-size"):
        spo.validate(spo.Args(batch_size=6, micro_batch_size=4))
    spo.validate(spo.Args(group_size=1))  # a single response per question is fine: the MC values are the baseline


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


# ---- main


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
