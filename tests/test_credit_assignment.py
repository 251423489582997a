"""benchmarks/credit_assignment.py: the Monte-Carlo reference against a reward whose advantages are known exactly,
the score helpers on hand-made inputs, SPO-chain's partial cutpoint values, and a small end-to-end run."""
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import credit_assignment as ca  # noqa: E402
import eval as ev  # noqa: E402
from plumbing import checkpoints, engines, models  # noqa: E402
import ppo_baseline  # noqa: E402
import spo_chain  # noqa: E402

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

TEMPERATURE = 0.1  # the tiny random model is nearly uniform at 0.6; at 0.1 its most likely token has p ~ 0.2


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = models.load_model(str(tiny_model_dir), dtype=torch.float32, device="cpu")
    prompt = tokenizer("Tom has 3")["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()  # [vocab]
    probs = torch.softmax(logits / TEMPERATURE, -1)  # top_p 1: exactly what the sampler draws from
    x = int(probs.argmax())
    return model, tokenizer, prompt, x, float(probs[x])


def first_token_reward(x: int) -> ca.Reward:
    """1 when the response's first token is x: V*(prompt) = p(x), V*(s_t) = 1[y_0 = x] for every t >= 0."""
    return lambda responses, finished, answers: [float(r[:1] == [x]) for r in responses]


def reference(model, tokenizer, states, samples, reward, max_new_tokens=1, seed=0):
    sampler = engines.HFSampler(model, tokenizer, seed=seed)
    return ca.mc_rewards(sampler, states, samples=samples, reward=reward, temperature=TEMPERATURE, top_p=1.0,
                         max_new_tokens=max_new_tokens, context=256, stop=[])


def test_reference_value_of_the_prompt_converges_to_p_of_x(tiny):
    model, tokenizer, prompt, x, p_x = tiny
    assert 0.05 < p_x < 0.95  # a probability the test can resolve
    (rewards,), tokens = reference(model, tokenizer, [(tuple(prompt), (), "0", None)], 2000, first_token_reward(x))
    value, error = sum(rewards) / len(rewards), math.sqrt(p_x * (1 - p_x) / 2000)
    assert tokens == 2000 and abs(value - p_x) < 4 * error
    # p(x) as the scripts compute p_t (spo_chain.sample_logprobs, logits / temperature) is the same number
    logp = spo_chain.sample_logprobs(model, [{"prompt_ids": prompt, "response_ids": [x]}], 1, TEMPERATURE, tokenizer.pad_token_id)
    assert logp[0].exp().item() == pytest.approx(p_x, rel=1e-4)


def test_reference_advantage_is_the_first_token_indicator_minus_p_x_then_exactly_zero(tiny):
    model, tokenizer, prompt, x, p_x = tiny
    other = (x + 1) % len(tokenizer)
    reward = first_token_reward(x)
    responses = [[x, 40, 41, 42, 43], [other, 40, 41]]  # hand-made: A* is defined for any token prefix
    rewards = reward(responses, [True, True], ["0", "0"])
    pairs = [ca.probe_states(prompt, response, "0", r, t) for response, r in zip(responses, rewards) for t in range(len(response))]
    assert pairs[4][1][3] == 1.0 and pairs[-1][1][3] == 0.0  # s_{T-1}, the whole response, is closed at its reward
    state_rewards, _ = reference(model, tokenizer, [s for pair in pairs for s in pair], 400, reward, max_new_tokens=4)
    advantages = [ca.reference_advantage(state_rewards[2 * k], state_rewards[2 * k + 1]) for k in range(len(pairs))]
    value_of_prompt = sum(state_rewards[0]) / 400
    assert abs(value_of_prompt - p_x) < 4 * math.sqrt(p_x * (1 - p_x) / 400)
    by_response = [advantages[:5], advantages[5:]]
    for response, mine in zip(responses, by_response):
        assert mine[0]["advantage"] == pytest.approx(float(response[0] == x) - value_of_prompt, abs=1e-12)
        assert mine[0]["error"] > 0
        for later in mine[1:]:  # V*(s_t) = V*(s_{t-1}) = 1[y_0 = x] for every continuation: no noise at all
            assert later["advantage"] == 0.0 and later["error"] == 0.0 and later["halves"] == (0.0, 0.0)


def test_reference_standard_error_shrinks_as_one_over_sqrt_k(tiny):
    model, tokenizer, prompt, x, p_x = tiny
    closed = (tuple(prompt), (x,), "0", 1.0)  # s_0 of a response starting with x: known exactly
    errors = {}
    for k in (100, 1600):
        (before, after), _ = reference(model, tokenizer, [(tuple(prompt), (), "0", None), closed], k, first_token_reward(x), seed=k)
        errors[k] = ca.reference_advantage(before, after)["error"]
        assert errors[k] == pytest.approx(math.sqrt(p_x * (1 - p_x) / k), rel=0.25)
    assert 3.0 < errors[100] / errors[1600] < 5.3  # sqrt(1600 / 100) = 4


def test_reference_continues_states_exactly_as_spo_chain_mc_values(tiny, gsm8k_jsonl):
    """The same sampler call: with the same seed, the same continuations, so the same values and token counts."""
    model, tokenizer, prompt, _, _ = tiny
    prefixes = [(), (40, 41), (40, 41, 42, 43)]
    task, answer = str(gsm8k_jsonl), "7"
    states = [(tuple(prompt), prefix, answer, None) for prefix in prefixes]
    rewards, tokens = reference(model, tokenizer, states, 8, ca.graded_reward(tokenizer, task), max_new_tokens=8, seed=5)
    values, stats = spo_chain.mc_values(engines.HFSampler(model, tokenizer, seed=5), tokenizer, [(prompt, list(p), answer) for p in prefixes],
                                        mc_samples=8, temperature=TEMPERATURE, top_p=1.0, max_new_tokens=8, context=256, task=task, stop=[])
    assert [sum(r) / 8 for r in rewards] == values and tokens == stats["mc_tokens"] > 0


def test_correlations_sign_agreement_and_bootstrap_on_hand_made_inputs():
    reference = [0.5, -0.3, 0.1, -0.6, 0.2, 0.0]
    assert ca.pearson(reference, reference) == pytest.approx(1.0)
    assert ca.pearson([-a for a in reference], reference) == pytest.approx(-1.0)
    assert ca.pearson([2 * a + 1 for a in reference], reference) == pytest.approx(1.0)  # scale-free
    assert ca.spearman([a**3 for a in reference], reference) == pytest.approx(1.0)  # monotone is enough for ranks
    assert ca.spearman([-a for a in reference], reference) == pytest.approx(-1.0)
    assert ca.pearson([1, 1, 1, 1, 1, 1], reference) is None  # a constant estimator has no correlation
    # Sign agreement counts only |A*| >= 0.25: probes 0 and 1 agree, probe 3's estimate 0.0 agrees with neither sign;
    # the flipped sign on probe 2 (A* = 0.1) does not count.
    estimates = [0.9, -0.1, -0.4, 0.0, 0.3, 1.0]
    assert ca.sign_agreement(estimates, reference, 0.25) == (pytest.approx(2 / 3), 3)
    assert ca.sign_agreement([-a for a in reference], reference, 0.25) == (0.0, 3)
    assert ca.sign_agreement(estimates, [0.1] * 6, 0.25) == (None, 0)
    # Bootstrap over questions: a perfect estimator stays perfect in every resample; a noisy one's interval holds it.
    rng = random.Random(0)
    truth = [rng.gauss(0, 1) for _ in range(60)]
    noisy = [a + rng.gauss(0, 1) for a in truth]
    questions = [i // 4 for i in range(60)]
    assert ca.bootstrap_interval(ca.pearson, truth, truth, questions, 200, seed=1) == pytest.approx((1.0, 1.0))
    low, high = ca.bootstrap_interval(ca.pearson, noisy, truth, questions, 500, seed=1)
    assert low < ca.pearson(noisy, truth) < high and high - low < 0.6
    assert ca.bootstrap_interval(ca.pearson, noisy, truth, questions, 500, seed=1) == (low, high)  # seeded
    row = ca.score(noisy, truth, questions, sign_threshold=0.25, resamples=100, seed=0)
    assert row["n"] == 60 and row["sign_n"] == sum(abs(a) >= 0.25 for a in truth) and list(row["pearson_ci"]) == sorted(row["pearson_ci"])


def test_reference_noise_reliability_and_ceiling():
    same = [{"error": 0.1, "halves": (a, a), "advantage": a} for a in (0.1, -0.4, 0.7)]
    noise = ca.reference_noise(same, [0, 1, 2], 50, seed=0)
    assert noise["spearman_brown"] == pytest.approx(1.0) and noise["ceiling"] == pytest.approx(1.0)
    assert noise["ceiling_ci"] == pytest.approx([1.0, 1.0])  # identical halves in every resample
    spread = np.var([0.1, -0.4, 0.7], ddof=1)  # A* varies far more than its standard error 0.1
    assert noise["reliability_from_errors"] == pytest.approx(1 - 0.01 / spread)
    assert noise["ceiling_from_errors"] == pytest.approx(math.sqrt(1 - 0.01 / spread))
    pure_noise = [{"error": 0.5, "halves": (a, -a), "advantage": a} for a in (0.1, -0.1, 0.0)]  # spread below the error
    assert ca.reference_noise(pure_noise, [0, 1, 2], 20, seed=0)["ceiling_from_errors"] is None
    half = [{"error": 0.2, "halves": (a, b), "advantage": (a + b) / 2} for a, b in [(0.0, 0.5), (0.5, 0.0), (1.0, 1.0), (0.0, 0.0)]]
    noise = ca.reference_noise(half, [0, 1, 2, 3], 200, seed=0)
    r = noise["split_half_r"]
    assert noise["spearman_brown"] == pytest.approx(2 * r / (1 + r)) and noise["ceiling"] == pytest.approx(math.sqrt(2 * r / (1 + r)))
    low, high = noise["split_half_r_ci"]
    assert low <= r <= high and noise["mean_standard_error"] == pytest.approx(0.2)
    flipped = [{"error": 0.1, "halves": (0.0, 1.0), "advantage": 0.5}, {"error": 0.1, "halves": (1.0, 0.0), "advantage": 0.5}]
    assert ca.reference_noise(flipped, [0, 1], 20, seed=0)["ceiling"] is None
    assert ca.ceiling(0.5) == pytest.approx(math.sqrt(2 / 3)) and ca.ceiling(None) is None


def test_probe_cutpoint_values_give_the_full_chain_advantages_at_the_probes():
    """Only the cutpoints chain_value_indices names are estimated; the others are NaN, and no probe reads one."""
    rng = random.Random(3)
    for _ in range(300):
        probs = [rng.choice([0.2, 0.5, 0.95, 0.99]) for _ in range(rng.randint(2, 30))]
        for interval in (1, 2, 5):
            cutpoints = spo_chain.find_cutpoints(probs, 0.9, interval)
            values = [rng.random() for _ in cutpoints]
            probes = ca.pick_probes(probs, 3, 0.9, rng)
            needed = ca.chain_value_indices(cutpoints, probes)
            partial = [v if j in needed else math.nan for j, v in enumerate(values)]
            full = spo_chain.chain_advantages(probs, cutpoints, values, 1.0, prob_mask=False)
            some = spo_chain.chain_advantages(probs, cutpoints, partial, 1.0, prob_mask=False)
            masked = spo_chain.chain_advantages(probs, cutpoints, values, 1.0, prob_mask=True)
            assert all(some[t] == full[t] == masked[t] for t in probes)  # the mask never touches a p_t < 0.9 probe


def test_end_to_end_writes_a_row_per_estimator_and_a_plot(tiny_model_dir, gsm8k_jsonl, tmp_path):
    # A ppo_baseline.py checkpoint, written by its own save_checkpoint, whose critic predicts 0.25 for every state.
    model, tokenizer = models.load_model(str(tiny_model_dir), dtype=torch.float32, device="cpu")
    critic = ppo_baseline.make_critic(model)
    torch.nn.init.constant_(critic.value_head.bias, 0.25)
    checkpoint = checkpoints.save_checkpoint(tmp_path / "ppo", model, tokenizer, {"iteration": 1}, modules={"critic": critic})
    args = ca.Args(model=str(tiny_model_dir), task=str(gsm8k_jsonl), questions=2, group_size=2, probes=2, reference_samples=2,
                   max_new_tokens=6, context=128, mc_samples=[2], intervals=[1, 5], tree="2,2", segment_tokens=2, bootstrap=20,
                   ppo_checkpoint=str(checkpoint), output=str(tmp_path / "out" / "credit.json"))
    results = ca.main(args)
    saved = json.loads((tmp_path / "out" / "credit.json").read_text())
    assert (tmp_path / "out" / "credit.png").stat().st_size > 10_000
    names = [row["estimator"] for row in saved["estimators"]]
    assert names == ["grpo", "spo_chain_int1_k2", "spo_chain_int5_k2", "ppo_untrained", "ppo_trained", "spo_tree"]
    assert saved["settings"]["reference_samples"] == 2 and saved["responses"] == 4 and not saved["prob_mask_changes_probes"]
    records = saved["probe_records"]
    assert 0 < len(records) <= 4 * 2 and all(r["p_t"] < 0.9 for r in records)
    assert all(row["n"] == len(records) for row in saved["estimators"][:-1])
    assert saved["estimators"][-1]["n"] == len(saved["edge_records"]) == saved["tree"]["edges"] > 0
    # The untrained critic's value head is zero: V = 0, so with gamma = lambda = 1 every advantage is the reward.
    assert all(r["estimates"]["ppo_untrained"] == r["reward"] for r in records)
    assert all(r["estimates"]["ppo_trained"] == pytest.approx(r["reward"] - 0.25, abs=1e-5) for r in records)  # A_t = R - V(s_t)
    assert results["reference"]["probes"]["count"] == len(records)
