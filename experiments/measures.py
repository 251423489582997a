"""Statistics the experiments share, each defined once here: pure functions, each with a worked example.

pearson, sign_agreement        an estimated advantage against a reference one (credit_assignment.py, credit_exact.py)
paired_interval                a paired difference over seeds, with its bootstrap interval (credit_exact.py,
                               learning_exact.py)
at_tokens, area_under          a learning curve's J against cumulative sampled tokens (learning_exact.py,
                               learning_critical.py)
wilson, paired, across_seeds   held-out questions: one accuracy's interval, and paired differences within a seed and
                               across seeds (learning_paired.py, lora.py)
rounded                        a results JSON's numbers

  python -m doctest experiments/measures.py   # the worked examples (silent when they hold)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# Correlations against a reference advantage


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


def sign_agreement(
    estimates: Sequence[float], reference: Sequence[float], threshold: float
) -> tuple[float | None, int]:
    """Fraction of the items with |reference| >= threshold whose estimate has the reference's sign (an estimate of
    exactly 0 agrees with neither), and how many such items there are.

    >>> sign_agreement([0.5, -0.1, 0.0, 2.0], [0.3, 0.4, -0.5, 0.1], 0.25)  # the last item is too small to count
    (0.3333333333333333, 3)
    """
    pairs = [(e, r) for e, r in zip(estimates, reference) if abs(r) >= threshold]
    if not pairs:
        return None, 0
    return sum(bool(np.sign(e) == np.sign(r)) for e, r in pairs) / len(pairs), len(pairs)


# ----------------------------------------------------------------------------------------------
# Paired differences over seeds


def paired_interval(a: np.ndarray, b: np.ndarray, resamples: int, seed: int) -> list[float] | None:
    """[mean, low, high]: the mean of a - b over the seeds where both are defined and its 95% percentile bootstrap
    interval (the seeds resampled with replacement, each bringing both of its values). None without such a seed.

    >>> round(paired_interval(np.array([0.5, 0.6, np.nan]), np.array([0.4, 0.4, 0.1]),
    ...                       100, 0)[0], 6)  # the third seed has no a
    0.15
    """
    both = np.isfinite(a) & np.isfinite(b)
    if not both.any():
        return None
    difference = (a - b)[both]
    # [resamples, seeds]
    draws = np.random.default_rng(seed).integers(len(difference), size=(resamples, len(difference)))
    low, high = np.percentile(difference[draws].mean(1), [2.5, 97.5])
    return [float(difference.mean()), float(low), float(high)]


# ----------------------------------------------------------------------------------------------
# Learning curves against sampled tokens


def cumulative_tokens(run: dict) -> np.ndarray:
    """[len(J)]: sampled tokens per prompt spent before each J of the run (0 before the first iteration)."""
    return np.concatenate([[0.0], np.cumsum(run["tokens"])])[: len(run["J"])]


def in_steps(run: dict) -> dict:
    """The run with one unit per iteration in place of its tokens, so at_tokens and area_under read optimizer steps
    (the samples axis of learning_exact.py).

    >>> area_under(in_steps({"J": [0.0, 1.0, 1.0], "tokens": [50.0, 70.0]}), 2)  # 0 -> 1 in the first of 2 steps
    0.75
    """
    return {**run, "tokens": [1.0] * (len(run["J"]) - 1)}


def at_tokens(run: dict, tokens, key: str = "J") -> np.ndarray:
    """The run's J (or `key`: "kl") after `tokens` sampled tokens per prompt: linear between its iterations, its last
    value after its last iteration.

    >>> at_tokens({"J": [0.2, 0.4, 0.8], "tokens": [10, 30]}, [0, 5, 10, 25, 40, 99]).round(6).tolist()
    [0.2, 0.3, 0.4, 0.6, 0.8, 0.8]
    """
    return np.interp(np.asarray(tokens, dtype=float), cumulative_tokens(run), run[key])


COLLAPSE_SHARE = 0.5  # a run collapses when its J falls below this share of its start J


def collapsed(curve: dict) -> bool:
    """Whether a run collapsed: its exact J, after some iteration of the run, below COLLAPSE_SHARE of its start J,
    i.e. the run lost half the start policy's expected reward (what too large a rate does on this toy: J 0.96 -> 0.00
    in one step, or 0.91 -> 0.12 -> 0; a run that recovers later still counts).

    >>> collapsed({"J": [0.6, 0.9, 0.2, 0.9]}), collapsed({"J": [0.6, 0.4, 0.31]})
    (True, False)
    """
    return min(curve["J"][1:], default=curve["J"][0]) < COLLAPSE_SHARE * curve["J"][0]


def area_under(run: dict, budget: float) -> float:
    """The area under J against cumulative sampled tokens per prompt from 0 to `budget`, over `budget`: the run's mean
    J over its first `budget` tokens (J linear between iterations), which rewards early and lasting gains alike.

    >>> area_under({"J": [0.0, 1.0], "tokens": [10]}, 20)  # 0 -> 1 over the first 10 tokens, then 1
    0.75
    """
    grid = cumulative_tokens(run)
    points = np.concatenate([grid[grid < budget], [budget]])
    return float(np.trapezoid(at_tokens(run, points), points) / budget)


# ----------------------------------------------------------------------------------------------
# Held-out questions: one accuracy, and paired differences


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95 % interval of a proportion correct / n."""
    p, denominator = correct / n, 1 + z**2 / n
    centre, half = (p + z**2 / (2 * n)) / denominator, z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denominator
    return centre - half, centre + half


def paired(a: list[float], b: list[float], resamples: int, seed: int = 0) -> dict:
    """mean(a - b) over questions, its 95 % bootstrap interval (questions resampled), and the discordant counts."""
    difference = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    index = torch.randint(0, len(a), (resamples, len(a)), generator=torch.Generator().manual_seed(seed))
    means = difference[index].mean(dim=1)
    return {
        "difference": difference.mean().item(),
        "ci": [means.quantile(0.025).item(), means.quantile(0.975).item()],
        "only_first_right": int((difference > 0).sum()),
        "only_second_right": int((difference < 0).sum()),
    }


def across_seeds(per_seed: dict[str, tuple[list[float], list[float]]], resamples: int, seed: int = 0) -> dict:
    """The mean over seeds of mean(a - b) over each seed's questions, with a 95 % bootstrap interval that resamples
    the seeds and, crossed with them, the questions (one draw of question positions for every seed of a resample:
    every seed answered the same held-out questions), and each seed's own paired difference. per_seed: seed -> (a's
    scores, b's scores), every seed's lists the same length, question i the same question in every seed.

    Seeds whose differences disagree widen the interval (the seeds' own spread); questions every run agrees on add
    none.

    >>> across_seeds({"0": ([1, 1], [0, 1]), "1": ([1, 0], [1, 0])}, 200)["difference"]
    0.25
    >>> across_seeds({"0": ([1, 1], [0, 0]), "1": ([0, 0], [1, 1])}, 2000)["ci"]  # +1 on one seed, -1 on the other
    [-1.0, 1.0]
    """
    lengths = {len(a) for a, b in per_seed.values()} | {len(b) for a, b in per_seed.values()}
    if len(lengths) != 1:
        raise ValueError(f"seeds answered different numbers of questions ({sorted(lengths)}): not one held-out set")
    # [seeds, questions]
    differences = torch.tensor([[x - y for x, y in zip(a, b)] for a, b in per_seed.values()], dtype=torch.float64)
    seeds, questions = differences.shape
    generator = torch.Generator().manual_seed(seed)
    seed_draws = torch.randint(0, seeds, (resamples, seeds), generator=generator)  # [resamples, seeds]
    question_draws = torch.randint(0, questions, (resamples, questions), generator=generator)  # [resamples, questions]
    per_seed_means = differences[:, question_draws].mean(dim=2)  # [seeds, resamples]: each seed on each question draw
    means = per_seed_means.T.gather(1, seed_draws).mean(dim=1)  # [resamples]
    return {
        "difference": differences.mean(dim=1).mean().item(),
        "ci": [means.quantile(0.025).item(), means.quantile(0.975).item()],
        "seeds": {name: paired(a, b, resamples) for name, (a, b) in per_seed.items()},
    }


# ----------------------------------------------------------------------------------------------
# Results JSON


def rounded(value):
    """Floats rounded to 5 decimals (below 0.01 in size: to 5 significant digits, so a learning rate of 3.33e-4 stays
    itself), NaN as None, through lists, tuples and dicts (for the JSON).

    >>> rounded([0.123456789, 3.33e-4, 1.234567e-7, float("nan")])
    [0.12346, 0.000333, 1.2346e-07, None]
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return round(value, 5) if abs(value) >= 0.01 else float(f"{value:.5g}")
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    if isinstance(value, dict):
        return {key: rounded(v) for key, v in value.items()}
    return value
