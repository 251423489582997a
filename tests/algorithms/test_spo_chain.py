"""spo_chain.py's algorithm functions: cutpoints and chain advantages against the SPEC definitions, the probability
mask and whitening, MC values (identical prefixes once, the rollout budget), the worked examples."""

import doctest
import random

import pytest
import torch

import spo_chain as spo
from plumbing import UsageError, engines, models

WORKED_PROBS = [0.99, 0.72, 1, 0.85, 1, 0.56, 0.92, 0.23, 0.98, 0.11, 1, 0.5, 0.99]  # the example


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
