"""experiments/credit_assignment.py: the Monte-Carlo reference on tree edges against a reward whose advantages are known
exactly, the estimates on a hand-made tree, the score helpers on hand-made inputs, and a small end-to-end run."""

import json
import math
import random

import numpy as np
import pytest
import torch

import grpo_baseline
import spo_chain
import spo_tree
from conftest import make_tiny_model, write_jsonl
from experiments import credit_assignment as ca
from experiments import measures
from plumbing import engines, models
from spo_tree import Node

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
    """1 when the response's first token is x: V*(prompt) = p(x), V*(s) = 1[y_0 = x] for every state past the prompt."""
    return lambda responses, finished, answers: [float(r[:1] == [x]) for r in responses]


def reference(model, tokenizer, states, samples, reward, max_new_tokens=1, seed=0):
    sampler = engines.HFSampler(model, tokenizer, seed=seed)
    return ca.mc_rewards(
        sampler,
        states,
        samples=samples,
        reward=reward,
        temperature=TEMPERATURE,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        context=256,
        stop=[],
    )


def hand_made_tree(prompt: list[int], x: int, other: int) -> Node:
    """Segments A = (x, 40) and B = (other, 40) with two leaves each, and a leaf C = (x,) at depth 1; rewards as
    first_token_reward(x) gives them."""
    return Node(
        prompt,
        [
            Node([x, 40], [Node([41, 42], reward=1.0, depth=2), Node([43], reward=1.0, depth=2)], depth=1),
            Node([other, 40], [Node([41], reward=0.0, depth=2), Node([44, 45], reward=0.0, depth=2)], depth=1),
            Node([x], reward=1.0, depth=1),
        ],
    )


def test_reference_value_of_the_prompt_converges_to_p_of_x(tiny):
    model, tokenizer, prompt, x, p_x = tiny
    assert 0.05 < p_x < 0.95  # a probability the test can resolve
    (rewards,), tokens = reference(model, tokenizer, [(tuple(prompt), (), "0", None)], 2000, first_token_reward(x))
    value, error = sum(rewards) / len(rewards), math.sqrt(p_x * (1 - p_x) / 2000)
    assert tokens == 2000 and abs(value - p_x) < 4 * error
    # p(x) as the scripts compute p_t (spo_chain.sample_logprobs, logits / temperature) is the same number
    logp = spo_chain.sample_logprobs(
        model, [{"prompt_ids": prompt, "response_ids": [x]}], 1, TEMPERATURE, tokenizer.pad_token_id
    )
    assert logp[0].exp().item() == pytest.approx(p_x, rel=1e-4)


def test_edge_states_and_estimates_on_a_hand_made_tree():
    root = hand_made_tree([7, 8], 5, 6)
    edges = ca.edge_states([root], ["0"])
    assert [(e["depth"], e["segment_tokens"]) for e in edges] == [
        (1, 2),
        (2, 2),
        (2, 1),
        (1, 2),
        (2, 1),
        (2, 2),
        (1, 1),
    ]
    a, a1, _, b, b1, _, c = edges
    assert a["parent"] == ((7, 8), (), "0", None) and a["child"] == ((7, 8), (5, 40), "0", None)  # inner: open
    # leaf: closed at its reward
    assert a1["parent"] == a["child"] and a1["child"] == ((7, 8), (5, 40, 41, 42), "0", 1.0)
    assert b1["child"][3] == 0.0 and c["child"] == ((7, 8), (5,), "0", 1.0)
    # SPO-tree: V(A) = V(C) = 1, V(B) = 0, V(root) = 2/3; siblings that agree give 0 (kept here, dropped in training).
    assert [e["estimates"]["spo_tree"] for e in edges] == pytest.approx([1 / 3, 0, 0, -2 / 3, 0, 0, 1 / 3])
    nonzero = [
        (list(e["parent"][0] + e["parent"][1]), list(e["child"][1][len(e["parent"][1]) :]), e["estimates"]["spo_tree"])
        for e in edges
        if e["estimates"]["spo_tree"] != 0
    ]
    assert nonzero == [(q, s, pytest.approx(v)) for q, s, v, _ in spo_tree.tree_segments(root)]  # training's samples
    # GRPO: the five leaves are the group (rewards 1, 1, 0, 0, 1); a leaf gets its own advantage, an inner node the
    # mean of its leaves', so the leaves under A keep +0.82 where V(child) - V(parent) = 0.
    leaf_advantages = grpo_baseline.group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0]), 5).tolist()
    win, lose = leaf_advantages[0], leaf_advantages[2]
    assert win == pytest.approx(math.sqrt(2 / 3)) and lose == pytest.approx(-math.sqrt(1.5))
    assert [e["estimates"]["grpo"] for e in edges] == pytest.approx([win, win, win, lose, lose, lose, win])
    assert ca.grpo_credit(Node([1], [Node([2], reward=0.0), Node([3], reward=0.0)])) == [0.0, 0.0]  # no signal


def test_reference_on_edges_is_the_known_advantage_and_exactly_zero_where_the_reward_is_settled(tiny):
    """first_token_reward: A*(A) = A*(C) = 1 - p(x), A*(B) = -p(x), and every depth-2 edge 0 with no noise at all."""
    model, tokenizer, prompt, x, p_x = tiny
    other = (x + 1) % len(tokenizer)
    edges = ca.edge_states([hand_made_tree(prompt, x, other)], ["0"])
    states = [s for e in edges for s in (e["parent"], e["child"])]
    state_rewards, tokens = reference(model, tokenizer, states, 400, first_token_reward(x), max_new_tokens=4)
    references = [ca.reference_advantage(state_rewards[2 * k], state_rewards[2 * k + 1]) for k in range(len(edges))]
    value_of_prompt = sum(state_rewards[0]) / 400
    assert abs(value_of_prompt - p_x) < 4 * math.sqrt(p_x * (1 - p_x) / 400)
    # the prompt (budget 4), A and B (budget 2) sampled once each: C shares the prompt
    assert 0 < tokens <= 400 * (4 + 2 + 2)
    a, a1, a2, b, b1, b2, c = references
    assert a["advantage"] == c["advantage"] == pytest.approx(1 - value_of_prompt, abs=1e-12)  # the same prompt samples
    assert b["advantage"] == pytest.approx(-value_of_prompt, abs=1e-12) and a["error"] > 0
    for settled in (a1, a2, b1, b2):  # V*(parent) = V*(child) = 1[y_0 = x] for every continuation
        assert settled["advantage"] == 0.0 and settled["error"] == 0.0 and settled["halves"] == (0.0, 0.0)


def test_reference_standard_error_shrinks_as_one_over_sqrt_k(tiny):
    model, tokenizer, prompt, x, p_x = tiny
    closed = (tuple(prompt), (x,), "0", 1.0)  # a leaf starting with x: known exactly
    errors = {}
    for k in (100, 1600):
        (before, after), _ = reference(
            model, tokenizer, [(tuple(prompt), (), "0", None), closed], k, first_token_reward(x), seed=k
        )
        errors[k] = ca.reference_advantage(before, after)["error"]
        assert errors[k] == pytest.approx(math.sqrt(p_x * (1 - p_x) / k), rel=0.25)
    assert 3.0 < errors[100] / errors[1600] < 5.3  # sqrt(1600 / 100) = 4


def test_reference_continues_states_exactly_as_spo_chain_mc_values(tiny, gsm8k_jsonl):
    """The same sampler call: with the same seed, the same continuations, so the same values and token counts."""
    model, tokenizer, prompt, _, _ = tiny
    prefixes = [(), (40, 41), (40, 41, 42, 43)]
    task, answer = str(gsm8k_jsonl), "7"
    states = [(tuple(prompt), prefix, answer, None) for prefix in prefixes]
    rewards, tokens = reference(
        model, tokenizer, states, 8, ca.graded_reward(tokenizer, task), max_new_tokens=8, seed=5
    )
    values, stats = spo_chain.mc_values(
        engines.HFSampler(model, tokenizer, seed=5),
        tokenizer,
        [(prompt, list(p), answer) for p in prefixes],
        mc_samples=8,
        temperature=TEMPERATURE,
        top_p=1.0,
        max_new_tokens=8,
        context=256,
        task=task,
        stop=[],
    )
    assert [sum(r) / 8 for r in rewards] == values and tokens == stats["mc_tokens"] > 0


def test_correlations_sign_agreement_and_bootstrap_on_hand_made_inputs():
    reference = [0.5, -0.3, 0.1, -0.6, 0.2, 0.0]
    assert measures.pearson(reference, reference) == pytest.approx(1.0)
    assert measures.pearson([-a for a in reference], reference) == pytest.approx(-1.0)
    assert measures.pearson([2 * a + 1 for a in reference], reference) == pytest.approx(1.0)  # scale-free
    assert ca.spearman([a**3 for a in reference], reference) == pytest.approx(1.0)  # monotone is enough for ranks
    assert ca.spearman([-a for a in reference], reference) == pytest.approx(-1.0)
    assert measures.pearson([1, 1, 1, 1, 1, 1], reference) is None  # a constant estimator has no correlation
    # Sign agreement counts only |A*| >= 0.25: items 0 and 1 agree, item 3's estimate 0.0 agrees with neither sign;
    # the flipped sign on item 2 (A* = 0.1) does not count.
    estimates = [0.9, -0.1, -0.4, 0.0, 0.3, 1.0]
    assert measures.sign_agreement(estimates, reference, 0.25) == (pytest.approx(2 / 3), 3)
    assert measures.sign_agreement([-a for a in reference], reference, 0.25) == (0.0, 3)
    assert measures.sign_agreement(estimates, [0.1] * 6, 0.25) == (None, 0)
    # Bootstrap over questions: a perfect estimator stays perfect in every resample; a noisy one's interval holds it.
    rng = random.Random(0)
    truth = [rng.gauss(0, 1) for _ in range(60)]
    noisy = [a + rng.gauss(0, 1) for a in truth]
    questions = [i // 4 for i in range(60)]
    assert ca.bootstrap_interval(measures.pearson, truth, truth, questions, 200, seed=1) == pytest.approx((1.0, 1.0))
    low, high = ca.bootstrap_interval(measures.pearson, noisy, truth, questions, 500, seed=1)
    assert low < measures.pearson(noisy, truth) < high and high - low < 0.6
    assert ca.bootstrap_interval(measures.pearson, noisy, truth, questions, 500, seed=1) == (low, high)  # seeded
    row = ca.score(noisy, truth, questions, sign_threshold=0.25, resamples=100, seed=0)
    assert (
        row["n"] == 60
        and row["sign_n"] == sum(abs(a) >= 0.25 for a in truth)
        and list(row["pearson_ci"]) == sorted(row["pearson_ci"])
    )


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
    half = [
        {"error": 0.2, "halves": (a, b), "advantage": (a + b) / 2}
        for a, b in [(0.0, 0.5), (0.5, 0.0), (1.0, 1.0), (0.0, 0.0)]
    ]
    noise = ca.reference_noise(half, [0, 1, 2, 3], 200, seed=0)
    r = noise["split_half_r"]
    assert noise["spearman_brown"] == pytest.approx(2 * r / (1 + r)) and noise["ceiling"] == pytest.approx(
        math.sqrt(2 * r / (1 + r))
    )
    low, high = noise["split_half_r_ci"]
    assert low <= r <= high and noise["mean_standard_error"] == pytest.approx(0.2)
    flipped = [
        {"error": 0.1, "halves": (0.0, 1.0), "advantage": 0.5},
        {"error": 0.1, "halves": (1.0, 0.0), "advantage": 0.5},
    ]
    assert ca.reference_noise(flipped, [0, 1], 20, seed=0)["ceiling"] is None
    assert ca.ceiling(0.5) == pytest.approx(math.sqrt(2 / 3)) and ca.ceiling(None) is None


def test_end_to_end_scores_both_estimators_on_every_edge_and_at_each_depth(tmp_path):
    """A model over the alphabet "7 " and questions whose answer is 7: even the random model earns some reward and
    stops often, so the trees have leaves at both depths and advantages to compare."""
    model_dir = make_tiny_model(tmp_path / "model", alphabet="7 ")
    task = write_jsonl(tmp_path / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    args = ca.Args(
        model=str(model_dir),
        task=str(task),
        questions=4,
        tree="2,2",
        segment_tokens=2,
        reference_samples=8,
        max_new_tokens=6,
        context=128,
        bootstrap=50,
        output=str(tmp_path / "out" / "credit.json"),
    )
    threads = torch.get_num_threads()
    try:
        results = ca.main(args)  # sets one torch thread (--threads 1)
    finally:
        torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "out" / "credit.json").read_text())
    assert saved == json.loads(json.dumps(results)) and (tmp_path / "out" / "credit.png").stat().st_size > 10_000
    rows = {(row["estimator"], row["edges"]): row for row in saved["estimators"]}
    assert list(rows) == [(name, subset) for subset in ("all", "depth 1", "depth 2") for name in ("spo_tree", "grpo")]
    edges = saved["edge_records"]
    assert rows["spo_tree", "all"]["n"] == len(edges) == saved["tree"]["edges"]
    assert rows["grpo", "depth 1"]["n"] + rows["grpo", "depth 2"]["n"] == len(edges)
    assert 0 < saved["tree"]["reward_mean"] < 1 and saved["reference"]["all"]["count"] == len(edges)
    for question in range(4):  # V(child) - V(parent) over the root's children sums to 0
        assert sum(
            e["estimates"]["spo_tree"] for e in edges if e["question"] == question and e["depth"] == 1
        ) == pytest.approx(0, abs=1e-4)
    assert all(
        -1 <= e["reference"] <= 1 and e["reference"] == pytest.approx(np.mean(e["reference_halves"]), abs=1e-4)
        for e in edges
    )
    assert rows["spo_tree", "all"]["pearson"] > 0.3  # the tree's own values track the Monte-Carlo segment values
    difference = saved["pearson_spo_tree_minus_grpo"]["all"]  # paired: the same edges, the same resamples
    assert difference["pearson"] == pytest.approx(
        rows["spo_tree", "all"]["pearson"] - rows["grpo", "all"]["pearson"], abs=1e-4
    )
    assert difference["ci"][0] <= difference["pearson"] <= difference["ci"][1]
    assert saved["machine"]["threads"] == 1 and saved["reference"]["generated_tokens"] > 0
