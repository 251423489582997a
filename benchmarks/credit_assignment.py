"""Credit assignment: how close is each algorithm's advantage to the true advantage of a token?

What is measured. For a response y_0..y_{T-1} sampled from the policy, the true advantage of token t is
  A*(t) = V*(s_t) - V*(s_{t-1}),   s_t = prompt + y_0..y_t (s_{-1} = the prompt),
V*(s) being the expected reward of the policy's continuations of the exact token prefix s (reward as in training:
the graded final answer, 0 when the response is unfinished). GRPO, SPO-chain, PPO and SPO-tree each estimate
advantages from far fewer samples; this benchmark compares their estimates with a Monte-Carlo reference of A*.

How.
1. Q questions x G responses at the training temperature (0.6; top_p 1.0, so p_t, computed from logits /
   temperature by spo_chain.sample_logprobs, is exactly the probability the sampler used), graded like training.
2. Probes: in each response up to P tokens with p_t < 0.9 (the low-probability tokens SPO's cutpoints and
   probability mask are built on), drawn at random (seeded). For each probe, V*(s_{t-1}) and V*(s_t) are the mean
   reward of K* continuations of those exact token ids (mc_rewards: the sampler call of spo_chain.mc_values, with
   per-continuation rewards kept). The whole response s_{T-1} is not continued: its value is its own reward
   (mc_values would sample past its end; the scripts never ask it to).
3. Each algorithm's advantage at the same tokens, from its script's own functions:
   grpo               grpo_baseline.group_advantages over the G rewards, broadcast to the response's tokens;
   spo_chain_int{I}_k{K}  spo_chain.find_cutpoints (interval I) + spo_chain.mc_values (K continuations per cutpoint
                      state, its own samples) + spo_chain.chain_advantages with prob_mask=False. The mask only zeroes
                      tokens with p_t > 0.9, and every probe has p_t < 0.9, so the masked and raw advantages agree
                      at the probes (checked in the run: "prob_mask_changes_probes"). Only the values a probe's
                      advantage reads are estimated (the cutpoints on either side of it; the others are NaN, and
                      the run checks that no probe's advantage is NaN); the cost column estimates what every
                      cutpoint would cost (--chain-all-cutpoints estimates them all, as training does);
   ppo_untrained      ppo_baseline.make_critic(policy) + sample_values + add_advantages_and_returns (GAE, reward on the
                      last token, gamma 1, lambda --lam). Its value head starts at zero, so V = 0 everywhere and with
                      gamma = lambda = 1 every token's advantage is the response's reward R: a no-baseline estimator;
   ppo_trained        the same with the critic of a ppo_baseline.py checkpoint (--ppo-checkpoint RUN/checkpoint,
                      critic.pt loaded as ppo_baseline.load_critic loads it). That critic learned the values of its
                      run's policy, which after a few iterations at lr 1e-6 is still the starting model;
   spo_tree           spo_tree.grow_trees (--tree, --segment-tokens) + grade_trees + backup_values + edge_advantages
                      ("rloo": V(child) - V(parent), zero edges included; training drops those), compared on its own
                      edges with V*(child) - V*(parent), K* continuations of each of the two states (a finished
                      leaf's value is its reward). A segment advantage is the sum of its tokens' A*, so this row is
                      scored on a different set from the others (its own reference noise is reported too).
4. Per estimator: Pearson and Spearman correlation with A*, a 95% bootstrap interval of each (questions resampled
   with replacement), sign agreement on the probes with |A*| >= 0.25 (a zero estimate agrees with neither sign),
   and the extra tokens it generated per response (GRPO and PPO: 0, PPO adds one critic forward per response;
   SPO-chain: its MC continuations; SPO-tree: the tokens of its tree per leaf, its whole sampling cost).
The reference is noisy too: its standard error per probe, and the split-half reliability (Pearson correlation of
A* from two disjoint halves of the K* continuations) with its Spearman-Brown correction 2r / (1 + r), the
reliability of A* from all K*. An estimator whose errors are independent of the reference's can at best reach a
correlation of sqrt(reliability), the "ceiling" drawn in the plot. The ceiling is estimated from the same few probes
(its bootstrap interval is reported): an estimator above it means the ceiling was underestimated, not that the
estimator beats the reference.

What the numbers show: how well, on this model and task, each estimator tracks the true advantage of
low-probability tokens at this many samples (Q, G, K as stated; the intervals show how little Q questions pin down).
A question the policy never solves has A* = 0 exactly at every probe (every continuation scores 0), and every
estimator is near 0 there too; such probes count, and tie in the ranks.
What they do not show: learning speed or final accuracy (benchmarks/learning.py measures those); tokens with
p_t >= 0.9 (not probed; their A* is small and SPO's mask ignores them); the scale of the advantages (correlation
is scale-free, yet GRPO's per-group standardisation gives different groups different scales, which it does
count); other models, tasks or response lengths.

Defaults (Q = 8, G = 4, P = 1, K* = 16, 128 new tokens, SmolLM2-135M on two-term chain_sum) take about 17 minutes
on 2 CPU cores; the reference and SPO-chain's MC continuations are nearly all of it.

  python benchmarks/credit_assignment.py                                   # writes benchmarks/results/credit_assignment.{json,png}
  python benchmarks/credit_assignment.py --ppo-checkpoint runs/<ppo run>/checkpoint --reference-samples 32
  python benchmarks/credit_assignment.py --model rho-1b-sft-gsm8k --task gsm8k --max-new-tokens 256 --top-p 0.9
"""

from __future__ import annotations

import bisect
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval as ev  # noqa: E402
from plumbing import engines, models, ranges, runs  # noqa: E402
from plumbing import UsageError  # noqa: E402
from plumbing.precision import choose_precision  # noqa: E402
import grpo_baseline  # noqa: E402
import ppo_baseline  # noqa: E402
import spo_chain  # noqa: E402
import spo_tree  # noqa: E402


@dataclass
class Args:
    model: str = "smollm2-135m"
    """policy whose advantages are measured: model directory, Hugging Face id or alias (see eval.py)"""
    task: str = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    """task: gsm8k | math | rg:<reasoning-gym dataset>[:key=value,...] | path.jsonl"""
    split: str = "train"
    """split the questions are drawn from (the one training samples)"""
    questions: ranges.PositiveInt = 8
    """Q: questions, drawn at random without replacement"""
    group_size: ranges.PositiveInt = 4
    """G: responses per question (GRPO's group)"""
    probes: ranges.PositiveInt = 1
    """P: low-probability tokens probed per response (all of them when a response has fewer)"""
    reference_samples: ranges.PositiveInt = 16
    """K*: continuations per state of the Monte-Carlo reference V*"""
    temperature: ranges.PositiveFloat = 0.6
    """sampling temperature of every sample (the training temperature); p_t divides logits by it too"""
    top_p: ranges.Probability = 1.0
    """nucleus threshold of every sample (1.0: p_t is exactly the sampling probability; the GSM8K scripts use 0.9)"""
    max_new_tokens: ranges.PositiveInt = 128
    """response token budget (a continuation of s_t may add max_new_tokens - (t+1) tokens, as in spo_chain.mc_values)"""
    context: ranges.PositiveInt = 512
    """total context budget (prompt + response)"""
    prob_threshold: ranges.Probability = 0.9
    """tokens with p_t < prob_threshold are low-probability: probes, and SPO-chain's cutpoints"""
    seed: ranges.Seed = 0
    """seed of the questions, the samples, the probes and the bootstrap"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """matmul precision: auto = bf16 autocast where the device has fast bf16, else fp32"""
    micro_batch_size: ranges.PositiveInt = 8
    """sequences per forward pass of the log-probs and the critic"""
    output: str = "benchmarks/results/credit_assignment.json"
    """results JSON (the PNG is written beside it)"""

    # Estimators
    intervals: ranges.PositiveInts = field(default_factory=lambda: [1, 5])
    """SPO-chain cutpoint intervals (int1, int5)"""
    mc_samples: ranges.PositiveInts = field(default_factory=lambda: [4, 9])
    """SPO-chain K: continuations per cutpoint state (the paper: 9)"""
    chain_all_cutpoints: bool = False
    """estimate every cutpoint's value, as training does, instead of only those the probes read (same advantages
    at the probes, in distribution; many times the cost)"""
    gamma: ranges.Fraction = 1.0
    """PPO's GAE discount (the paper: 1)"""
    lam: ranges.Fraction = 1.0
    """PPO's GAE lambda (the paper: 1)"""
    ppo_checkpoint: str | None = None
    """a ppo_baseline.py checkpoint directory (RUN/checkpoint) whose critic.pt gives the ppo_trained row"""
    tree: str = "2,2"
    """SPO-tree branch factors per depth"""
    segment_tokens: ranges.PositiveInt = 16
    """SPO-tree segment length M"""

    # Scores
    sign_threshold: ranges.NonNegativeFloat = 0.25
    """sign agreement is counted on probes with |A*| >= this"""
    bootstrap: ranges.PositiveInt = 1000
    """bootstrap resamples (of questions) for the 95% intervals"""


# ----------------------------------------------------------------------------------------------
# The reference: Monte-Carlo values of exact token prefixes

# (prompt_ids, response_prefix_ids, answer, end_reward): end_reward is None for a state to continue, and the
# response's own reward for a state that is a whole response (nothing left to sample).
State = tuple[tuple[int, ...], tuple[int, ...], str, float | None]
# reward(responses, finished, answers): one reward per response (its token ids after the prompt).
Reward = Callable[[list[list[int]], list[bool], list[str]], list[float]]


def graded_reward(tokenizer, task: str) -> Reward:
    """Training's reward: the response decoded once (special tokens skipped), graded by ev.grade against its
    answer; an unfinished response scores 0."""
    def reward(responses: list[list[int]], finished: list[bool], answers: list[str]) -> list[float]:
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
        return [score if done else 0.0 for score, done in zip(ev.grade(texts, answers, task), finished)]
    return reward


def pick_probes(probs: Sequence[float], count: int, threshold: float, rng: random.Random) -> list[int]:
    """Up to `count` distinct positions t with p_t < threshold, drawn at random, in increasing order.

    >>> pick_probes([.95, .5, .99, .2, .7], 5, 0.9, random.Random(0))  # every low-probability token
    [1, 3, 4]
    """
    low = [t for t, p in enumerate(probs) if p < threshold]
    return sorted(rng.sample(low, min(count, len(low))))


def probe_states(prompt_ids: Sequence[int], response_ids: Sequence[int], answer: str, reward: float, t: int) -> tuple[State, State]:
    """(s_{t-1}, s_t) of token t: prompt + y_<t and prompt + y_<=t. s_{T-1}, the whole response, is closed:
    its value is the response's reward (sampling on would continue a response that has ended).

    >>> probe_states([7], [1, 2, 3], "5", 1.0, 0)
    (((7,), (), '5', None), ((7,), (1,), '5', None))
    >>> probe_states([7], [1, 2, 3], "5", 1.0, 2)[1]
    ((7,), (1, 2, 3), '5', 1.0)
    """
    prompt, response = tuple(prompt_ids), tuple(response_ids)
    after_reward = float(reward) if t == len(response) - 1 else None
    return (prompt, response[:t], answer, None), (prompt, response[: t + 1], answer, after_reward)


def mc_rewards(
    sampler, states: list[State], *, samples: int, reward: Reward, temperature: float, top_p: float,
    max_new_tokens: int, context: int, stop: list[str],
) -> tuple[list[list[float]], int]:
    """The reward of each of `samples` continuations of every state, and the tokens the continuations generated.

    An open state is continued as spo_chain.mc_values continues a cutpoint state: one sampler call for all
    states, identical states sampled once, token ids in and out (never re-tokenised), the rollout's budget
    (max_new_tokens - len(prefix), within the context), the stop strings, also where they begin in the prefix;
    `reward` scores prefix + continuation. A closed state (end_reward set) gets `samples` copies of its reward.
    """
    unique = list(dict.fromkeys(states))
    open_states = [s for s in unique if s[3] is None]
    groups = sampler.sample(
        [list(prompt + prefix) for prompt, prefix, _, _ in open_states], samples, temperature=temperature, top_p=top_p,
        max_new_tokens=[max_new_tokens - len(prefix) for _, prefix, _, _ in open_states], stop=stop, context=context,
        progress="reference", generated=[len(prefix) for _, prefix, _, _ in open_states],
    ) if open_states else []
    responses, finished, answers, tokens = [], [], [], 0
    for (_, prefix, answer, _), group in zip(open_states, groups):
        for continuation in group:
            responses.append(list(prefix) + continuation.ids)
            finished.append(continuation.finish_reason == "stop")
            answers.append(answer)
            tokens += len(continuation.ids)
    scores = reward(responses, finished, answers) if responses else []
    rewards_of = {state: [float(r) for r in scores[i * samples : (i + 1) * samples]] for i, state in enumerate(open_states)}
    rewards_of.update({state: [float(state[3])] * samples for state in unique if state[3] is not None})
    return [rewards_of[state] for state in states], tokens


def reference_advantage(before: Sequence[float], after: Sequence[float]) -> dict:
    """A* = mean(after) - mean(before) from the continuation rewards of s_{t-1} and s_t, its standard error
    (sample std / sqrt(K), the two states' errors added in quadrature) and A* from each half of the continuations.

    >>> reference = reference_advantage([0, 1, 0, 1], [1, 1, 1, 1])  # error: std 0.577 / sqrt(4) and 0
    >>> reference["advantage"], round(reference["error"], 4), reference["halves"]
    (0.5, 0.2887, (0.5, 0.5))
    """
    def error(rewards: Sequence[float]) -> float:
        return float(np.std(rewards, ddof=1) / math.sqrt(len(rewards))) if len(rewards) > 1 else math.nan

    half = len(before) // 2
    halves = tuple(float(np.mean(after[part]) - np.mean(before[part])) for part in (slice(0, half), slice(half, 2 * half)))
    return {"advantage": float(np.mean(after) - np.mean(before)), "error": math.hypot(error(before), error(after)), "halves": halves}


def spearman_brown(split_half_r: float | None) -> float | None:
    """The reliability 2r / (1 + r) of A* from all K* continuations, given the split-half r; None when r is undefined
    or not positive."""
    return 2 * split_half_r / (1 + split_half_r) if split_half_r is not None and split_half_r > 0 else None


def ceiling(split_half_r: float | None) -> float | None:
    """sqrt of the Spearman-Brown reliability, given the split-half r: the correlation with A* an estimator whose
    errors are independent of the reference's can expect at best. None when r is undefined or not positive.

    >>> ceiling(1.0), round(ceiling(0.5), 4), ceiling(-0.2)
    (1.0, 0.8165, None)
    """
    reliability = spearman_brown(split_half_r)
    return math.sqrt(reliability) if reliability is not None else None


def reference_noise(references: list[dict], groups: Sequence[int], resamples: int, seed: int) -> dict:
    """The reference's own noise over a set of probes (reference_advantage results; groups: their questions): mean
    standard error, split-half Pearson r with its 95% bootstrap interval over questions, the Spearman-Brown correction
    2r / (1 + r) (the reliability of A* from all K* continuations) and the ceiling sqrt(reliability) with the
    interval that r's interval gives it (a bound below 0 has no ceiling: None). A second estimate of the same
    reliability uses every continuation rather than halves: 1 - mean(standard error^2) / var(A*) (the share of A*'s
    variance that is not sampling noise), with its ceiling sqrt of it; it is the steadier of the two on few probes.

    >>> noise = reference_noise([{"error": 0.1, "halves": (0.0, 0.1), "advantage": 0.05},
    ...                          {"error": 0.3, "halves": (1.0, 0.8), "advantage": 0.9}], [0, 1], 10, 0)
    >>> noise["split_half_r"], noise["spearman_brown"], noise["ceiling"]
    (1.0, 1.0, 1.0)
    """
    first, second = [r["halves"][0] for r in references], [r["halves"][1] for r in references]
    r = pearson(first, second)
    interval = bootstrap_interval(pearson, first, second, groups, resamples, seed)
    errors = [r["error"] for r in references if math.isfinite(r["error"])]
    spread = float(np.var([r["advantage"] for r in references], ddof=1)) if len(references) > 1 else 0.0
    from_errors = 1 - float(np.mean(np.square(errors))) / spread if errors and spread > 0 else None
    return {"count": len(references), "mean_standard_error": float(np.mean(errors)) if errors else None,
            "split_half_r": r, "split_half_r_ci": interval, "spearman_brown": spearman_brown(r),
            "ceiling": ceiling(r), "ceiling_ci": [ceiling(bound) for bound in interval] if interval else None,
            "reliability_from_errors": from_errors,
            "ceiling_from_errors": math.sqrt(from_errors) if from_errors is not None and from_errors > 0 else None}


# ----------------------------------------------------------------------------------------------
# Scores: correlations, sign agreement, bootstrap intervals (pure functions)


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson correlation; None when it is undefined (fewer than 2 points, or a constant side).

    >>> pearson([1, 2, 3], [2, 4, 7]), pearson([1, 2, 3], [-1, -2, -3]), pearson([1, 2, 3], [5, 5, 5])
    (0.9933992677987828, -1.0, None)
    """
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    x, y = x - x.mean(), y - y.mean()
    return float(np.clip((x @ y) / math.sqrt((x @ x) * (y @ y)), -1.0, 1.0))


def ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank (as Spearman's correlation needs).

    >>> ranks([10, 30, 20, 20]).tolist()
    [1.0, 4.0, 2.5, 2.5]
    """
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    sorted_x, result = x[order], np.empty(len(x))
    start = 0
    while start < len(x):
        end = start
        while end + 1 < len(x) and sorted_x[end + 1] == sorted_x[start]:
            end += 1
        result[order[start : end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman rank correlation: Pearson of the ranks (ties averaged).

    >>> spearman([1, 2, 3, 4], [1, 8, 27, 64]), spearman([1, 2, 3], [3, 1, 2])
    (1.0, -0.5)
    """
    return pearson(ranks(x), ranks(y)) if len(x) >= 2 else None


def sign_agreement(estimates: Sequence[float], reference: Sequence[float], threshold: float) -> tuple[float | None, int]:
    """Fraction of the probes with |reference| >= threshold whose estimate has the reference's sign (an estimate of
    exactly 0 agrees with neither), and how many such probes there are.

    >>> sign_agreement([0.5, -0.1, 0.0, 2.0], [0.3, 0.4, -0.5, 0.1], 0.25)  # the last probe is too small to count
    (0.3333333333333333, 3)
    """
    pairs = [(e, r) for e, r in zip(estimates, reference) if abs(r) >= threshold]
    if not pairs:
        return None, 0
    return sum(bool(np.sign(e) == np.sign(r)) for e, r in pairs) / len(pairs), len(pairs)


def bootstrap_interval(
    statistic: Callable, estimates: Sequence[float], reference: Sequence[float], groups: Sequence[int], resamples: int, seed: int,
) -> tuple[float, float] | None:
    """95% percentile interval of statistic(estimates, reference) when the groups (questions) are resampled with
    replacement, each drawn group bringing all its probes; resamples where the statistic is undefined are left out.
    None when none is defined."""
    estimates, reference, groups = np.asarray(estimates, dtype=float), np.asarray(reference, dtype=float), np.asarray(groups)
    names = np.unique(groups)
    if len(names) == 0:
        return None
    members = [np.flatnonzero(groups == name) for name in names]
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        picked = np.concatenate([members[i] for i in rng.integers(len(names), size=len(names))])
        value = statistic(estimates[picked], reference[picked])
        if value is not None:
            values.append(value)
    if not values:
        return None
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def score(estimates: Sequence[float], reference: Sequence[float], groups: Sequence[int], *, sign_threshold: float,
          resamples: int, seed: int) -> dict:
    """One estimator's scores against the reference A*: count, Pearson and Spearman with 95% bootstrap intervals over
    groups, sign agreement where |A*| >= sign_threshold."""
    agreement, signed = sign_agreement(estimates, reference, sign_threshold)
    return {
        "n": len(estimates),
        "pearson": pearson(estimates, reference),
        "pearson_ci": bootstrap_interval(pearson, estimates, reference, groups, resamples, seed),
        "spearman": spearman(estimates, reference),
        "spearman_ci": bootstrap_interval(spearman, estimates, reference, groups, resamples, seed),
        "sign_agreement": agreement,
        "sign_n": signed,
    }


# ----------------------------------------------------------------------------------------------
# The estimators, each through its script's own functions


def chain_value_indices(cutpoints: Sequence[int], probes: Sequence[int]) -> set[int]:
    """Indices into `cutpoints` of the values spo_chain.chain_advantages reads for the probed tokens: a token's
    advantage is the value of the first value position at or after it minus the value before that, so it needs
    the cutpoints on either side of it (the last token carries R and needs no value).

    >>> sorted(chain_value_indices([-1, 3, 7, 12], [0, 8, 14]))  # 0: V(s_3) - V(s_-1); 8: V(s_12) - V(s_7); 14: R - V(s_12)
    [0, 1, 2, 3]
    >>> sorted(chain_value_indices([2, 6], [1]))  # before the first cutpoint: advantage 0 unless cutpoint -1
    [0]
    """
    needed = set()
    for t in probes:
        i = bisect.bisect_left(cutpoints, t)  # the first cutpoint >= t
        needed.update(j for j in (i - 1, i) if 0 <= j < len(cutpoints))
    return needed


def spo_chain_advantages(
    sampler, tokenizer, samples: list[dict], probs: list[list[float]], rewards: list[float], probes: list[list[int]],
    *, interval: int, mc_samples: int, all_cutpoints: bool, args: Args, stop: list[str],
) -> tuple[list[list[float]], dict]:
    """SPO-chain's token advantages of every response (prob_mask off; NaN where a value was not estimated) and the
    run's counts: the cutpoint states training would estimate, those estimated here, their MC tokens, and whether
    the probability mask would change a probed token's advantage."""
    cutpoints = [spo_chain.find_cutpoints(p, args.prob_threshold, interval) for p in probs]
    wanted = [set(range(len(cuts))) if all_cutpoints else chain_value_indices(cuts, ts) for cuts, ts in zip(cutpoints, probes)]
    states = [(s["prompt_ids"], s["response_ids"][: cuts[j] + 1], s["answer"]) for s, cuts, need in zip(samples, cutpoints, wanted)
              for j in sorted(need)]
    values, stats = spo_chain.mc_values(sampler, tokenizer, states, mc_samples=mc_samples, temperature=args.temperature,
                                        top_p=args.top_p, max_new_tokens=args.max_new_tokens, context=args.context,
                                        task=args.task, stop=stop)
    values, advantages, mask_changes = iter(values), [], False
    for p, cuts, need, reward, ts in zip(probs, cutpoints, wanted, rewards, probes):
        cut_values = [next(values) if j in need else math.nan for j in range(len(cuts))]
        raw = spo_chain.chain_advantages(p, cuts, cut_values, reward, args.prob_threshold, prob_mask=False)
        masked = spo_chain.chain_advantages(p, cuts, cut_values, reward, args.prob_threshold, prob_mask=True)
        if any(not math.isfinite(raw[t]) for t in ts):
            raise RuntimeError("a probed token's SPO-chain advantage read a cutpoint value that was not estimated")
        mask_changes |= any(raw[t] != masked[t] for t in ts)
        advantages.append(raw)
    training_states = len({(tuple(s["prompt_ids"]), tuple(s["response_ids"][: c + 1])) for s, cuts in zip(samples, cutpoints) for c in cuts})
    return advantages, {**stats, "training_states": training_states, "prob_mask_changes_probes": mask_changes}


def load_critic(policy, checkpoint: str | None, device: str) -> ppo_baseline.Critic:
    """ppo_baseline's critic: make_critic(policy) (a copy of the policy's backbone with a zero value head), with the
    weights of checkpoint/critic.pt when given, loaded as ppo_baseline.load_critic loads them."""
    critic = ppo_baseline.make_critic(policy)
    if checkpoint is not None:
        path = Path(checkpoint) / "critic.pt"
        if not path.is_file():
            raise UsageError(f"--ppo-checkpoint {checkpoint}: no critic.pt there; give a ppo_baseline.py checkpoint (RUN/checkpoint)")
        critic.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    return critic


def ppo_advantages(critic, samples: list[dict], rewards: list[float], *, gamma: float, lam: float, prob_threshold: float,
                   micro_batch_size: int, pad_id: int) -> list[list[float]]:
    """PPO's GAE advantages (before whitening) of every response: the critic's V(s_{t-1}) per token
    (ppo_baseline.sample_values) and the reward on the last token (ppo_baseline.add_advantages_and_returns)."""
    values = ppo_baseline.sample_values(critic, samples, micro_batch_size, pad_id)
    rows = [{**s, "old_values": v} for s, v in zip(samples, values)]  # copies: add_advantages_and_returns writes into them
    gae = ppo_baseline.add_advantages_and_returns(rows, torch.tensor(rewards), gamma=gamma, lam=lam,
                                                  prob_threshold=prob_threshold, prob_mask=False)  # [N, T]
    return [gae[i, : len(s["response_ids"])].tolist() for i, s in enumerate(samples)]


def tree_edges(roots: list, answers: list[str]) -> list[dict]:
    """Every edge of the graded trees: its question, SPO-tree's advantage (spo_tree.edge_advantages, "rloo"; zero
    edges too) and the two states the reference compares, parent = prompt + the segments above the child and
    child = parent + the child's segment (closed, at its reward, when the child is a leaf)."""
    edges = []

    def visit(node, question: int, prompt: tuple, path: tuple) -> None:
        for child, advantage in zip(node.children, spo_tree.edge_advantages(node, "rloo")):
            child_path = path + tuple(child.tokens)
            end_reward = float(child.reward) if not child.children else None
            edges.append({"question": question, "advantage": advantage, "parent": (prompt, path, answers[question], None),
                          "child": (prompt, child_path, answers[question], end_reward)})
            visit(child, question, prompt, child_path)

    for question, root in enumerate(roots):
        spo_tree.backup_values(root)
        visit(root, question, tuple(root.tokens), ())
    return edges


# ----------------------------------------------------------------------------------------------
# Setup, results, plot


def validate(args: Args) -> list[int]:
    """Every check that needs no model; returns the tree's branch factors."""
    problems = ev.task_problems(args.task)
    if min(args.questions, args.group_size, args.probes) < 1:
        problems.append("--questions, --group-size and --probes must be at least 1")
    if args.reference_samples < 2:
        problems.append(f"--reference-samples ({args.reference_samples}) must be at least 2 (its halves give the reference's noise)")
    if not args.temperature > 0 or not 0 < args.top_p <= 1 or not 0 < args.prob_threshold <= 1:
        problems.append("--temperature must be positive, --top-p and --prob-threshold in (0, 1]")
    if args.max_new_tokens < 1 or args.context < 2 or args.segment_tokens < 1 or args.micro_batch_size < 1:
        problems.append("--max-new-tokens, --segment-tokens and --micro-batch-size must be at least 1, --context at least 2")
    if not args.intervals or not args.mc_samples or min(args.intervals + args.mc_samples) < 1:
        problems.append("--intervals and --mc-samples need at least one value each, all at least 1")
    if not (0 <= args.gamma <= 1 and 0 <= args.lam <= 1) or args.bootstrap < 1 or args.sign_threshold < 0:
        problems.append("--gamma and --lam must be in [0, 1], --bootstrap at least 1, --sign-threshold non-negative")
    try:
        branches = spo_tree.parse_tree(args.tree)
    except ValueError as error:
        problems.append(f"--tree {error}")
    if problems:
        raise UsageError("; ".join(problems))
    return branches


def draw_questions(args: Args, tokenizer) -> list[ev.Example]:
    """Q distinct questions of the task's split, with room for a response in the context."""
    examples = ev.load_task(args.task, args.split, seed=args.seed, tokenizer=tokenizer)
    examples = ev.check_prompt_room(examples, args.context, f"--task {args.task}", drop=True)
    if len(examples) < args.questions:
        raise UsageError(f"--questions {args.questions}: --task {args.task} has only {len(examples)} usable questions")
    return random.Random(args.seed).sample(examples, args.questions)


def rounded(value):
    """Floats rounded to 5 digits, NaN as None, through lists, tuples and dicts (for the JSON)."""
    if isinstance(value, float):
        return round(value, 5) if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {key: rounded(v) for key, v in value.items()}
    return value


def print_table(rows: list[dict], noise: dict) -> None:
    def number(value, ci=None):
        text = "n/a" if value is None else f"{value:+.2f}"
        return text + (f" [{ci[0]:+.2f},{ci[1]:+.2f}]" if ci else "")

    print(f"\n{'estimator':<20} {'on':<10} {'n':>4} {'pearson [95% CI]':>22} {'spearman [95% CI]':>22} {'sign':>10} {'tokens/resp':>12}")
    for row in rows:
        sign = "n/a" if row["sign_agreement"] is None else f"{row['sign_agreement']:.2f}/{row['sign_n']}"
        print(f"{row['estimator']:<20} {row['compared_on']:<10} {row['n']:>4} {number(row['pearson'], row['pearson_ci']):>22} "
              f"{number(row['spearman'], row['spearman_ci']):>22} {sign:>10} {row['extra_tokens_per_response']:>12.0f}")
    for name in ("probes", "tree edges"):
        part, error = noise[name], noise[name]["mean_standard_error"]
        print(f"reference on {name}: {part['count']} comparisons, mean standard error {'n/a' if error is None else f'{error:.3f}'}, "
              f"split-half r {number(part['split_half_r'], part['split_half_r_ci'])}, Spearman-Brown {number(part['spearman_brown'])}, "
              f"ceiling {number(part['ceiling'])}; from the standard errors: reliability {number(part['reliability_from_errors'])}, "
              f"ceiling {number(part['ceiling_from_errors'])}")


def plot(results: dict, path: Path) -> None:
    """Left: each estimator's Pearson and Spearman correlation with A* (95% bootstrap intervals) and the ceiling the
    reference's noise allows; right: estimates against A*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, settings = results["estimators"], results["settings"]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1.6, 1]})
    x = np.arange(len(rows))
    for offset, key, color in ((-0.2, "pearson", "tab:blue"), (0.2, "spearman", "tab:orange")):
        heights = [row[key] if row[key] is not None else 0.0 for row in rows]
        errors = [[max(0.0, h - row[f"{key}_ci"][0]) if row[f"{key}_ci"] else 0.0 for h, row in zip(heights, rows)],
                  [max(0.0, row[f"{key}_ci"][1] - h) if row[f"{key}_ci"] else 0.0 for h, row in zip(heights, rows)]]
        bars.bar(x + offset, heights, 0.4, yerr=errors, capsize=3, color=color, label=f"{key.capitalize()} (95% bootstrap CI)")
    for set_name, style in (("probes", "--"), ("tree edges", ":")):
        ceiling = results["reference"][set_name]["ceiling"]
        members = [i for i, row in enumerate(rows) if row["compared_on"] == set_name]
        interval = results["reference"][set_name]["ceiling_ci"]
        if ceiling is not None and members:
            spread = f" (95% CI {'n/a' if interval[0] is None else f'{interval[0]:.2f}'}-{interval[1]:.2f})" if interval and interval[1] is not None else ""
            steadier = results["reference"][set_name]["ceiling_from_errors"]
            also = "" if steadier is None else f"; from standard errors {steadier:.2f}"
            bars.hlines(ceiling, min(members) - 0.45, max(members) + 0.45, colors="black", linestyles=style,
                        label=f"ceiling on {set_name}: sqrt(split-half reliability) = {ceiling:.2f}{spread}{also}")
    bars.axhline(0, color="gray", lw=0.8)
    bars.set_xticks(x, [row["estimator"] for row in rows], rotation=30, ha="right")
    bars.set(ylabel="correlation with the Monte-Carlo advantage A*", ylim=(-1.05, 1.05),
             title=f"Advantage accuracy at low-probability tokens (Q={settings['questions']}, G={settings['group_size']}, "
                   f"P={settings['probes']}, K*={settings['reference_samples']})")
    bars.legend(fontsize=8, loc="lower left")
    bars.grid(axis="y", alpha=0.3)

    reference = [p["reference"] for p in results["probe_records"]]
    shown = [row["estimator"] for row in rows if row["compared_on"] == "probes"]
    ppo = "ppo_trained" if "ppo_trained" in shown else "ppo_untrained"
    largest_k = f"_k{max(settings['mc_samples'])}"
    shown = [name for name in shown if name in ("grpo", ppo) or (name.startswith("spo_chain") and name.endswith(largest_k))]
    for name in shown:
        scatter.scatter(reference, [p["estimates"][name] for p in results["probe_records"]], s=14, alpha=0.7, label=name)
    edges = results["edge_records"]
    scatter.scatter([e["reference"] for e in edges], [e["estimate"] for e in edges], s=14, alpha=0.7, marker="^",
                    label="spo_tree (edges: segment A*)")
    scatter.axhline(0, color="gray", lw=0.8)
    scatter.axvline(0, color="gray", lw=0.8)
    scatter.set(xlabel="reference A* (Monte-Carlo, K* continuations per state)", ylabel="estimated advantage (raw scale)",
                title="Estimates against A* at the same tokens (SPO-tree: at its edges)")
    scatter.legend(fontsize=8)
    scatter.grid(alpha=0.3)
    fig.suptitle(f"{settings['model']} on {settings['task']}, temperature {settings['temperature']}, top_p {settings['top_p']}, "
                 f"{settings['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Main


def main(args: Args) -> dict:
    branches = validate(args)
    started, seconds = time.time(), {}
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = choose_precision(args.precision, device)
    print(precision.line)
    model, tokenizer = models.load_model(args.model, dtype=torch.float32, device=device)
    sampler = engines.make_sampler("hf", model, tokenizer, args.model, seed=args.seed, precision=precision)
    pad_id, stop, reward = tokenizer.pad_token_id, ev.stop_strings(tokenizer), graded_reward(tokenizer, args.task)
    questions, rng = draw_questions(args, tokenizer), random.Random(args.seed)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, stop=stop, context=args.context)

    # 1. Rollout: G responses per question, graded as in training (unfinished: 0).
    step = time.time()
    groups = sampler.sample([q.prompt_ids for q in questions], args.group_size, max_new_tokens=args.max_new_tokens,
                            progress="rollout", **sampling)
    completions = [c for group in groups for c in group]
    question_of = [i // args.group_size for i in range(len(completions))]
    samples = [{"prompt_ids": questions[q].prompt_ids, "response_ids": c.ids, "answer": questions[q].answer}
               for q, c in zip(question_of, completions)]
    rewards = reward([c.ids for c in completions], [c.finish_reason == "stop" for c in completions], [s["answer"] for s in samples])

    # 2. p_t from the training log-probs (logits / temperature); up to P low-probability probes per response.
    logps = spo_chain.sample_logprobs(model, samples, args.micro_batch_size, args.temperature, pad_id, precision)
    for s, logp in zip(samples, logps):
        s["old_logps"] = logp
    probs = [logp.exp().tolist() for logp in logps]
    probes = [pick_probes(p, args.probes, args.prob_threshold, rng) for p in probs]
    seconds["rollout"] = time.time() - step

    # 3. SPO-tree: one tree per question, graded; its edges and the two states of each.
    step = time.time()
    roots, _ = spo_tree.grow_trees(sampler, [q.prompt_ids for q in questions], branches, segment_tokens=args.segment_tokens,
                                   max_new_tokens=args.max_new_tokens, **sampling)
    spo_tree.grade_trees(roots, [q.answer for q in questions], tokenizer, args.task)
    edges = tree_edges(roots, [q.answer for q in questions])
    tree_tokens = sum(len(node.tokens) for root in roots for node, _ in spo_tree.walk(root))
    leaves = sum(not node.children for root in roots for node, _ in spo_tree.walk(root))
    seconds["tree"] = time.time() - step

    # 4. Reference: K* continuations of s_{t-1} and s_t of every probe and of both states of every tree edge.
    step = time.time()
    probe_list = [(i, t) for i, ts in enumerate(probes) for t in ts]
    pairs = [probe_states(samples[i]["prompt_ids"], samples[i]["response_ids"], samples[i]["answer"], rewards[i], t) for i, t in probe_list]
    pairs += [(edge["parent"], edge["child"]) for edge in edges]
    state_rewards, reference_tokens = mc_rewards(sampler, [s for pair in pairs for s in pair], samples=args.reference_samples,
                                                 reward=reward, max_new_tokens=args.max_new_tokens, **sampling)
    references = [reference_advantage(state_rewards[2 * k], state_rewards[2 * k + 1]) for k in range(len(pairs))]
    probe_refs, edge_refs = references[: len(probe_list)], references[len(probe_list) :]
    seconds["reference"] = time.time() - step

    # 5. Every estimator's advantage of every response token (tree: of every edge).
    step = time.time()
    token_advantages, costs, chain_stats = {}, {}, {}
    grpo = grpo_baseline.group_advantages(torch.tensor(rewards), args.group_size).tolist()
    token_advantages["grpo"] = [[a] * len(s["response_ids"]) for a, s in zip(grpo, samples)]
    costs["grpo"] = (0.0, "none")
    for interval in args.intervals:
        for k in args.mc_samples:
            name = f"spo_chain_int{interval}_k{k}"
            token_advantages[name], chain_stats[name] = spo_chain_advantages(
                sampler, tokenizer, samples, probs, rewards, probes, interval=interval, mc_samples=k,
                all_cutpoints=args.chain_all_cutpoints, args=args, stop=stop)
            stats = chain_stats[name]
            per_rollout = stats["mc_tokens"] / max(1, stats["mc_rollouts"])
            costs[name] = (stats["training_states"] * k * per_rollout / len(samples),
                           "measured (every cutpoint)" if args.chain_all_cutpoints else
                           f"estimated: every cutpoint state x K x {per_rollout:.1f} tokens per continuation measured here")
    seconds["spo_chain"] = time.time() - step
    step = time.time()
    critics = {"ppo_untrained": None, **({"ppo_trained": args.ppo_checkpoint} if args.ppo_checkpoint else {})}
    for name, checkpoint in critics.items():
        critic = load_critic(model, checkpoint, device)
        token_advantages[name] = ppo_advantages(critic, samples, rewards, gamma=args.gamma, lam=args.lam, prob_threshold=args.prob_threshold,
                                                micro_batch_size=args.micro_batch_size, pad_id=pad_id)
        costs[name] = (0.0, "one critic forward per response")
        del critic
    seconds["ppo"] = time.time() - step

    # 6. Scores: each estimator at the probes (SPO-tree at its edges) against A*.
    reference_values = [r["advantage"] for r in probe_refs]
    groups_of_probes = [question_of[i] for i, _ in probe_list]
    scoring = dict(sign_threshold=args.sign_threshold, resamples=args.bootstrap, seed=args.seed)
    rows = []
    for name, per_token in token_advantages.items():
        estimates = [per_token[i][t] for i, t in probe_list]
        rows.append({"estimator": name, "compared_on": "probes", **score(estimates, reference_values, groups_of_probes, **scoring),
                     "extra_tokens_per_response": costs[name][0], "cost": costs[name][1]})
    edge_values = [r["advantage"] for r in edge_refs]
    rows.append({"estimator": "spo_tree", "compared_on": "tree edges",
                 **score([e["advantage"] for e in edges], edge_values, [e["question"] for e in edges], **scoring),
                 "extra_tokens_per_response": tree_tokens / max(1, leaves),
                 "cost": f"tree tokens per leaf (its whole sampling: {tree_tokens / len(questions):.0f} tokens per question, "
                         f"{leaves / len(questions):.1f} leaves)"})
    noise = {"probes": reference_noise(probe_refs, groups_of_probes, args.bootstrap, args.seed),
             "tree edges": reference_noise(edge_refs, [e["question"] for e in edges], args.bootstrap, args.seed)}

    # 7. Results: JSON, PNG, table.
    seconds["total"] = time.time() - started
    results = rounded({
        "settings": asdict(args), "seconds": seconds, "device": device, "torch_threads": torch.get_num_threads(),
        "responses": len(samples), "reward_mean": float(np.mean(rewards)),
        "response_tokens_mean": float(np.mean([len(s["response_ids"]) for s in samples])),
        "truncation_rate": float(np.mean([c.finish_reason == "length" for c in completions])),
        "low_probability_fraction": float(np.mean([p < args.prob_threshold for ps in probs for p in ps])) if any(probs) else None,
        "reference": {**noise, "generated_tokens": reference_tokens},
        "prob_mask_changes_probes": any(stats["prob_mask_changes_probes"] for stats in chain_stats.values()),
        "spo_chain": chain_stats, "tree": {"edges": len(edges), "zero_advantage_edges": sum(e["advantage"] == 0 for e in edges),
                                           "tokens": tree_tokens, "leaves": leaves},
        "estimators": rows,
        "probe_records": [{"question": question_of[i], "response": i, "t": t, "p_t": probs[i][t], "reward": rewards[i],
                           "reference": r["advantage"], "reference_error": r["error"], "reference_halves": r["halves"],
                           "estimates": {name: per_token[i][t] for name, per_token in token_advantages.items()}}
                          for (i, t), r in zip(probe_list, probe_refs)],
        "edge_records": [{"question": e["question"], "estimate": e["advantage"], "reference": r["advantage"],
                          "reference_error": r["error"], "reference_halves": r["halves"], "segment_tokens": len(e["child"][1]) - len(e["parent"][1])}
                         for e, r in zip(edges, edge_refs)],
    })
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    plot(results, output.with_suffix(".png"))
    print_table(results["estimators"], results["reference"])
    print(f"Q={args.questions} G={args.group_size} P={args.probes} K*={args.reference_samples}: {len(probe_list)} probes, "
          f"{len(edges)} tree edges, reward {results['reward_mean']:.3f}, {seconds['total']:.0f}s -> {output} and {output.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    runs.run_cli(main, ranges.cli(Args))
