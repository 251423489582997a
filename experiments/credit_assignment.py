"""Credit assignment on a real LM: SPO-tree's segment advantages against a Monte-Carlo reference.

What is measured. SPO-tree (spo_tree.py) gives every segment of its rollout tree, i.e. every edge parent -> child,
the advantage V(child) - V(parent) ("rloo"), V backed up from the few leaves below. The segment's true advantage is
  A*(edge) = V*(child) - V*(parent),   V*(s) = the expected reward of the policy's continuations of the token prefix s
(the reward as in training: the graded final answer, 0 when the response is unfinished; A* is the sum of the
per-token advantages over the segment). This benchmark compares SPO-tree's edges with a Monte-Carlo estimate of A*
on SmolLM2-135M with responses of up to 128 tokens. Beside it, on the same edges, a trajectory-level estimate: GRPO's
advantage of the responses the segment is part of (grpo_baseline.group_advantages with the tree's leaves as the
group; an inner node gets the mean over the leaves below it).

How.
1. One tree per question (Q questions): spo_tree.grow_trees (--tree, --segment-tokens M), grade_trees,
   backup_values, edge_advantages ("rloo"; zero edges kept, training drops them), at the training temperature 0.6,
   top_p 1.0.
2. The reference: K* continuations of each edge's parent state (prompt + the segments above) and child state
   (parent + the segment) with the same sampler settings and token budget, token ids in and out (mc_rewards: the
   sampler call of spo_chain.mc_values, each continuation's reward kept). A leaf is closed: its value is its reward.
3. Per estimator, on all edges and at each depth: Pearson and Spearman correlation with A* with 95% bootstrap
   intervals (questions resampled), sign agreement where |A*| >= 0.25 (a zero estimate agrees with neither sign),
   and the paired difference of the two estimators' Pearson correlations with its interval.
The reference's own noise per set of edges: its standard errors, the split-half reliability (A* from two disjoint
halves of the K* continuations, Spearman-Brown corrected), and sqrt of it, the most an estimator whose errors are
independent of the reference's can correlate with it (the "ceiling" in the plot).

What the numbers show: whether, on a real LM and real responses, SPO-tree's segment values from a few leaves track
the segments' true advantages, and whether a value baseline at the segment's start (SPO-tree) tracks them better than
the response's outcome (GRPO); the depth rows separate segments that end a response (the last level) from those in
the middle. What they do not show: per-token accuracy (the per-token reference is at its noise floor on this model;
experiments/credit_exact.py measures every algorithm's per-token advantages and gradients exactly, on a toy policy),
PPO or SPO-chain, learning speed (experiments/learning.py), other models, tasks or tree shapes. The GRPO row's group
is the tree's leaves: correlated samples, weighted by leaf rather than by probability, not G independent responses;
its per-group standardisation gives questions different scales, which correlations pooled over questions count.

Defaults (Q = 16, tree 3,3, M = 16, K* = 16, 128 new tokens, SmolLM2-135M on two-term chain_sum, one torch thread)
take 6-8 minutes on 2 shared CPU cores, nearly all of it the reference.

  python -m experiments.credit_assignment                 # writes experiments/results/credit_assignment.{json,png}
  python -m experiments.credit_assignment --questions 32 --reference-samples 32 --output /tmp/credit.json
  python -m experiments.credit_assignment --model rho-1b-sft-gsm8k --task gsm8k --max-new-tokens 256 --segment-tokens 30
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import grpo_baseline
import spo_tree
from experiments.measures import pearson, rounded, sign_agreement
from plumbing import UsageError, cli, engines, models, ranges, runs, tasks
from plumbing.precision import choose_precision, cpu_description


@dataclass
class Args:
    model: str = "smollm2-135m"
    """policy whose advantages are measured: model directory, Hugging Face id or alias (see eval.py)"""
    task: str = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    """task: gsm8k | math | rg:<reasoning-gym dataset>[:key=value,...] | path.jsonl"""
    split: str = "train"
    """split the questions are drawn from (the one training samples)"""
    questions: ranges.PositiveInt = 16
    """Q: questions (one tree each), drawn at random without replacement"""
    tree: str = "3,3"
    """SPO-tree branch factors per depth"""
    segment_tokens: ranges.PositiveInt = 16
    """SPO-tree segment length M"""
    reference_samples: ranges.PositiveInt = 16
    """K*: continuations per state of the Monte-Carlo reference V* (at least 2: its halves give its noise)"""
    temperature: ranges.PositiveFloat = 0.6
    """sampling temperature of every sample (the training temperature)"""
    top_p: ranges.Probability = 1.0
    """nucleus threshold of every sample"""
    max_new_tokens: ranges.PositiveInt = 128
    """response token budget (a continuation of a state adds at most max_new_tokens - its response tokens)"""
    context: ranges.PositiveInt = 512
    """total context budget (prompt + response)"""
    seed: ranges.Seed = 0
    """seed of the questions, the samples and the bootstrap"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """matmul precision: auto = bf16 autocast where the device has fast bf16, else fp32"""
    threads: ranges.PositiveInt = 1
    """torch CPU threads"""
    sign_threshold: ranges.NonNegativeFloat = 0.25
    """sign agreement is counted on edges with |A*| >= this"""
    bootstrap: ranges.PositiveInt = 1000
    """bootstrap resamples (of questions) for the 95% intervals"""
    output: str = "experiments/results/credit_assignment.json"
    """results JSON (the PNG is written beside it)"""


# ----------------------------------------------------------------------------------------------
# The estimates on a tree's edges


def grpo_credit(root: spo_tree.Node) -> list[float]:
    """GRPO's advantage of every segment of a graded tree, in spo_tree.walk's order: the tree's leaves (complete
    responses) are the group (grpo_baseline.group_advantages of their rewards); a segment shared by several responses
    (an inner node) gets the mean of theirs.

    >>> Node = spo_tree.Node
    >>> root = Node([9], [Node([1], reward=1.0), Node([2], [Node([3], reward=0.0), Node([4], reward=0.0)])])
    >>> [round(a, 4) for a in grpo_credit(root)]  # segment 2's responses both failed: -0.7071, whatever its value
    [1.4142, -0.7071, -0.7071, -0.7071]
    """

    def leaves(node: spo_tree.Node) -> list[spo_tree.Node]:
        return [node] if not node.children else [n for n, _ in spo_tree.walk(node) if not n.children]

    group = leaves(root)
    advantages = grpo_baseline.group_advantages(
        torch.tensor([float(leaf.reward) for leaf in group]), len(group)
    ).tolist()
    advantage_of = {id(leaf): a for leaf, a in zip(group, advantages)}
    return [float(np.mean([advantage_of[id(leaf)] for leaf in leaves(node)])) for node, _ in spo_tree.walk(root)]


# (prompt_ids, response_prefix_ids, answer, end_reward): end_reward is None for a state to continue, and the
# response's own reward for a state that is a whole response (a leaf: nothing left to sample).
State = tuple[tuple[int, ...], tuple[int, ...], str, float | None]


def edge_states(roots: list[spo_tree.Node], answers: list[str]) -> list[dict]:
    """Every edge of the graded trees: its question, depth and segment length, the estimates (spo_tree:
    spo_tree.edge_advantages "rloo", zero edges too; grpo: grpo_credit) and the two states the reference compares,
    parent = prompt + the segments above the child and child = parent + the child's segment (closed, at its reward,
    when the child is a leaf). Depth-first pre-order, as spo_tree.walk."""
    edges = []

    def visit(node: spo_tree.Node, question: int, prompt: tuple, path: tuple) -> None:
        for child, advantage in zip(node.children, spo_tree.edge_advantages(node, "rloo")):
            child_path = path + tuple(child.tokens)
            end_reward = float(child.reward) if not child.children else None
            edges.append(
                {
                    "question": question,
                    "depth": child.depth,
                    "segment_tokens": len(child.tokens),
                    "estimates": {"spo_tree": advantage},
                    "parent": (prompt, path, answers[question], None),
                    "child": (prompt, child_path, answers[question], end_reward),
                }
            )
            visit(child, question, prompt, child_path)

    for question, root in enumerate(roots):
        spo_tree.backup_values(root)
        first = len(edges)
        visit(root, question, tuple(root.tokens), ())
        for edge, grpo in zip(edges[first:], grpo_credit(root)):
            edge["estimates"]["grpo"] = grpo
    return edges


# ----------------------------------------------------------------------------------------------
# The reference: Monte-Carlo values of exact token prefixes

# reward(responses, finished, answers): one reward per response (its token ids after the prompt).
Reward = Callable[[list[list[int]], list[bool], list[str]], list[float]]


def graded_reward(tokenizer, task: str) -> Reward:
    """Training's reward: the response decoded once (special tokens skipped), graded by tasks.grade against its
    answer; an unfinished response scores 0."""

    def reward(responses: list[list[int]], finished: list[bool], answers: list[str]) -> list[float]:
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses]
        return [score if done else 0.0 for score, done in zip(tasks.grade(texts, answers, task), finished)]

    return reward


def mc_rewards(
    sampler,
    states: list[State],
    *,
    samples: int,
    reward: Reward,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    context: int,
    stop: list[str],
) -> tuple[list[list[float]], int]:
    """The reward of each of `samples` continuations of every state, and the tokens the continuations generated.

    An open state is continued as spo_chain.mc_values continues a cutpoint state: one sampler call for all
    states, identical states sampled once, token ids in and out (never re-tokenised), the rollout's budget
    (max_new_tokens - len(prefix), within the context), the stop strings, also where they begin in the prefix;
    `reward` scores prefix + continuation. A closed state (end_reward set) gets `samples` copies of its reward.
    """
    unique = list(dict.fromkeys(states))
    open_states = [s for s in unique if s[3] is None]
    groups = (
        sampler.sample(
            [list(prompt + prefix) for prompt, prefix, _, _ in open_states],
            samples,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=[max_new_tokens - len(prefix) for _, prefix, _, _ in open_states],
            stop=stop,
            context=context,
            progress="reference",
            generated=[len(prefix) for _, prefix, _, _ in open_states],
        )
        if open_states
        else []
    )
    responses, finished, answers, tokens = [], [], [], 0
    for (_, prefix, answer, _), group in zip(open_states, groups):
        for continuation in group:
            responses.append(list(prefix) + continuation.ids)
            finished.append(continuation.finish_reason == "stop")
            answers.append(answer)
            tokens += len(continuation.ids)
    scores = reward(responses, finished, answers) if responses else []
    rewards_of = {
        state: [float(r) for r in scores[i * samples : (i + 1) * samples]] for i, state in enumerate(open_states)
    }
    rewards_of.update({state: [float(state[3])] * samples for state in unique if state[3] is not None})
    return [rewards_of[state] for state in states], tokens


def reference_advantage(before: Sequence[float], after: Sequence[float]) -> dict:
    """A* = mean(after) - mean(before) from the continuation rewards of the parent and child states, its standard
    error (sample std / sqrt(K), the two states' errors added in quadrature) and A* from each half of the continuations.

    >>> reference = reference_advantage([0, 1, 0, 1], [1, 1, 1, 1])  # error: std 0.577 / sqrt(4) and 0
    >>> reference["advantage"], round(reference["error"], 4), reference["halves"]
    (0.5, 0.2887, (0.5, 0.5))
    """

    def error(rewards: Sequence[float]) -> float:
        return float(np.std(rewards, ddof=1) / math.sqrt(len(rewards))) if len(rewards) > 1 else math.nan

    half = len(before) // 2
    halves = tuple(
        float(np.mean(after[part]) - np.mean(before[part])) for part in (slice(0, half), slice(half, 2 * half))
    )
    return {
        "advantage": float(np.mean(after) - np.mean(before)),
        "error": math.hypot(error(before), error(after)),
        "halves": halves,
    }


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
    """The reference's own noise over a set of edges (reference_advantage results; groups: their questions): mean
    standard error, split-half Pearson r with its 95% bootstrap interval over questions, the Spearman-Brown correction
    2r / (1 + r) (the reliability of A* from all K* continuations) and the ceiling sqrt(reliability) with the
    interval that r's interval gives it (a bound below 0 has no ceiling: None). A second estimate of the same
    reliability uses every continuation rather than halves: 1 - mean(standard error^2) / var(A*) (the share of A*'s
    variance that is not sampling noise), with its ceiling sqrt of it.

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
    return {
        "count": len(references),
        "mean_standard_error": float(np.mean(errors)) if errors else None,
        "split_half_r": r,
        "split_half_r_ci": interval,
        "spearman_brown": spearman_brown(r),
        "ceiling": ceiling(r),
        "ceiling_ci": [ceiling(bound) for bound in interval] if interval else None,
        "reliability_from_errors": from_errors,
        "ceiling_from_errors": math.sqrt(from_errors) if from_errors is not None and from_errors > 0 else None,
    }


# ----------------------------------------------------------------------------------------------
# Scores: rank correlation, bootstrap intervals over questions (pure functions; Pearson and sign agreement are
# measures.py's)


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


def bootstrap_interval(
    statistic: Callable,
    estimates: Sequence[float],
    reference: Sequence[float],
    groups: Sequence[int],
    resamples: int,
    seed: int,
) -> tuple[float, float] | None:
    """95% percentile interval of statistic(estimates, reference) when the groups (questions) are resampled with
    replacement, each drawn group bringing all its items (an item's estimates may be a row: several estimators,
    paired); resamples where the statistic is undefined are left out. None when none is defined."""
    estimates, reference, groups = (
        np.asarray(estimates, dtype=float),
        np.asarray(reference, dtype=float),
        np.asarray(groups),
    )
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


def score(
    estimates: Sequence[float],
    reference: Sequence[float],
    groups: Sequence[int],
    *,
    sign_threshold: float,
    resamples: int,
    seed: int,
) -> dict:
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


def pearson_difference(both: np.ndarray, reference: Sequence[float]) -> float | None:
    """Pearson(both[:, 0], reference) - Pearson(both[:, 1], reference): two estimators on the same items (paired, so
    bootstrap_interval resamples them together); None when either is undefined.

    >>> pearson_difference(np.array([[1, 3], [2, 1], [3, 2]]), [1, 2, 3])
    1.5
    """
    first, second = pearson(both[:, 0], reference), pearson(both[:, 1], reference)
    return None if first is None or second is None else first - second


# ----------------------------------------------------------------------------------------------
# Main


def main(args: Args) -> dict:
    branches = validate(args)
    torch.set_num_threads(args.threads)
    started, seconds = time.time(), {}
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = choose_precision(args.precision, device)
    print(precision.line)
    model, tokenizer = models.load_model(args.model, dtype=torch.float32, device=device)
    sampler = engines.make_sampler("hf", model, tokenizer, args.model, seed=args.seed, precision=precision)
    stop, reward = tasks.stop_strings(args.task, tokenizer), graded_reward(tokenizer, args.task)
    questions = draw_questions(args, tokenizer)
    answers = [q.answer for q in questions]
    sampling = dict(temperature=args.temperature, top_p=args.top_p, stop=stop, context=args.context)

    # 1. SPO-tree: one tree per question, graded; every edge with its estimates and its two states.
    step = time.time()
    roots, _ = spo_tree.grow_trees(
        sampler,
        [q.prompt_ids for q in questions],
        branches,
        segment_tokens=args.segment_tokens,
        max_new_tokens=args.max_new_tokens,
        **sampling,
    )
    spo_tree.grade_trees(roots, answers, tokenizer, args.task)
    edges = edge_states(roots, answers)
    leaves = [node for root in roots for node, _ in spo_tree.walk(root) if not node.children]
    tree_tokens = sum(len(node.tokens) for root in roots for node, _ in spo_tree.walk(root))
    seconds["tree"] = time.time() - step

    # 2. Reference: K* continuations of the parent and the child state of every edge.
    step = time.time()
    states = [state for edge in edges for state in (edge["parent"], edge["child"])]
    state_rewards, reference_tokens = mc_rewards(
        sampler, states, samples=args.reference_samples, reward=reward, max_new_tokens=args.max_new_tokens, **sampling
    )
    for k, edge in enumerate(edges):
        edge["reference"] = reference_advantage(state_rewards[2 * k], state_rewards[2 * k + 1])
    seconds["reference"] = time.time() - step

    # 3. Scores: each estimator against A* on all edges and at each depth, and the reference's own noise there.
    depths = sorted({e["depth"] for e in edges})
    subsets = {"all": edges} | (
        {f"depth {d}": [e for e in edges if e["depth"] == d] for d in depths} if len(depths) > 1 else {}
    )
    scoring = dict(sign_threshold=args.sign_threshold, resamples=args.bootstrap, seed=args.seed)
    rows, noise, differences = [], {}, {}
    for subset, members in subsets.items():
        truth, groups = [e["reference"]["advantage"] for e in members], [e["question"] for e in members]
        noise[subset] = reference_noise([e["reference"] for e in members], groups, args.bootstrap, args.seed)
        rows += [
            {
                "estimator": name,
                "edges": subset,
                **score([e["estimates"][name] for e in members], truth, groups, **scoring),
            }
            for name in ("spo_tree", "grpo")
        ]
        both = np.array([[e["estimates"]["spo_tree"], e["estimates"]["grpo"]] for e in members])  # [edges, 2]
        differences[subset] = {
            "pearson": pearson_difference(both, truth),
            "ci": bootstrap_interval(pearson_difference, both, truth, groups, args.bootstrap, args.seed),
        }

    # 4. Results: JSON, PNG, table.
    seconds["total"] = time.time() - started
    results = rounded(
        {
            "command": " ".join(["python", "-m", "experiments.credit_assignment", *sys.argv[1:]]),
            "settings": asdict(args),
            "seconds": seconds,
            "machine": {
                "cpu": cpu_description(),
                "device": device,
                "threads": torch.get_num_threads(),
                "date": time.strftime("%Y-%m-%d"),
                **runs.code_state(),
            },
            "tree": {
                "edges": len(edges),
                "zero_advantage_edges": sum(e["estimates"]["spo_tree"] == 0 for e in edges),
                "leaves": len(leaves),
                "reward_mean": float(np.mean([leaf.reward for leaf in leaves])),
                "unfinished_leaves": sum(leaf.finish_reason != "stop" for leaf in leaves),
                "tokens_per_question": tree_tokens / len(questions),
            },
            "reference": {"generated_tokens": reference_tokens, **noise},
            "estimators": rows,
            "pearson_spo_tree_minus_grpo": differences,
            "edge_records": [
                {key: e[key] for key in ("question", "depth", "segment_tokens", "estimates")}
                | {
                    "reference": e["reference"]["advantage"],
                    "reference_error": e["reference"]["error"],
                    "reference_halves": e["reference"]["halves"],
                }
                for e in edges
            ],
        }
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    plot(results, output.with_suffix(".png"))
    print_table(results)
    print(
        f"Q={args.questions} tree {args.tree} M={args.segment_tokens} K*={args.reference_samples}: {len(edges)} edges, "
        f"leaf reward {results['tree']['reward_mean']:.3f}, {seconds['total']:.0f}s -> {output} and "
        f"{output.with_suffix('.png')}"
    )
    return results


# ----------------------------------------------------------------------------------------------
# Setup, table, plot


def validate(args: Args) -> list[int]:
    """Every check that needs no model; returns the tree's branch factors."""
    problems = ranges.problems(args) + tasks.task_problems(args.task)
    if args.reference_samples < 2:
        problems.append(
            f"--reference-samples ({args.reference_samples}) must be at least 2 (its halves give the reference's noise)"
        )
    try:
        branches = spo_tree.parse_tree(args.tree)
    except ValueError as error:
        problems.append(f"--tree {error}")
    if problems:
        raise UsageError("; ".join(problems))
    return branches


def draw_questions(args: Args, tokenizer) -> list[tasks.Example]:
    """Q distinct questions of the task's split, with room for a response in the context."""
    examples = tasks.load_task(args.task, args.split, seed=args.seed, tokenizer=tokenizer)
    examples = tasks.check_prompt_room(examples, args.context, f"--task {args.task}", drop=True)
    if len(examples) < args.questions:
        raise UsageError(f"--questions {args.questions}: --task {args.task} has only {len(examples)} usable questions")
    return random.Random(args.seed).sample(examples, args.questions)


def print_table(results: dict) -> None:
    def number(value, ci=None):
        text = "n/a" if value is None else f"{value:+.2f}"
        return text + (f" [{ci[0]:+.2f},{ci[1]:+.2f}]" if ci else "")

    print(f"\n{'estimator':<10} {'edges':<8} {'n':>4} {'pearson [95% CI]':>22} {'spearman [95% CI]':>22} {'sign':>9}")
    for row in results["estimators"]:
        sign = "n/a" if row["sign_agreement"] is None else f"{row['sign_agreement']:.2f}/{row['sign_n']}"
        print(
            f"{row['estimator']:<10} {row['edges']:<8} {row['n']:>4} {number(row['pearson'], row['pearson_ci']):>22} "
            f"{number(row['spearman'], row['spearman_ci']):>22} {sign:>9}"
        )
    for subset, difference in results["pearson_spo_tree_minus_grpo"].items():
        print(f"Pearson spo_tree - grpo on {subset} edges (paired): {number(difference['pearson'], difference['ci'])}")
    for subset in results["pearson_spo_tree_minus_grpo"]:
        noise = results["reference"][subset]
        print(
            f"reference on {subset} edges: mean standard error {number(noise['mean_standard_error'])}, split-half r "
            f"{number(noise['split_half_r'], noise['split_half_r_ci'])}, "
            f"Spearman-Brown {number(noise['spearman_brown'])}, "
            f"ceiling {number(noise['ceiling'])}; from the standard errors: "
            f"reliability {number(noise['reliability_from_errors'])}"
        )


def plot(results: dict, path: Path) -> None:
    """Left: each estimator's Pearson and Spearman correlation with A* (95% bootstrap intervals) on all edges and at
    each depth, with the ceiling the reference's noise allows there; right: the estimates against A*."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, settings = results["estimators"], results["settings"]
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [1.3, 1]})
    x = np.arange(len(rows))
    for offset, key, color in ((-0.2, "pearson", "tab:blue"), (0.2, "spearman", "tab:orange")):
        heights = [row[key] if row[key] is not None else 0.0 for row in rows]
        errors = [
            [max(0.0, h - row[f"{key}_ci"][0]) if row[f"{key}_ci"] else 0.0 for h, row in zip(heights, rows)],
            [max(0.0, row[f"{key}_ci"][1] - h) if row[f"{key}_ci"] else 0.0 for h, row in zip(heights, rows)],
        ]
        bars.bar(
            x + offset,
            heights,
            0.4,
            yerr=errors,
            capsize=3,
            color=color,
            label=f"{key.capitalize()} (95% bootstrap CI)",
        )
    for subset in dict.fromkeys(row["edges"] for row in rows):
        members = [i for i, row in enumerate(rows) if row["edges"] == subset]
        ceiling = results["reference"][subset]["ceiling"]
        if ceiling is not None:
            bars.hlines(
                ceiling,
                min(members) - 0.45,
                max(members) + 0.45,
                colors="black",
                linestyles="--",
                label="ceiling: sqrt(split-half reliability of A*)" if subset == "all" else None,
            )
    bars.axhline(0, color="gray", lw=0.8)
    bars.set_xticks(x, [f"{row['estimator']}\n{row['edges']} ({row['n']})" for row in rows], fontsize=8)
    bars.set(
        ylabel="correlation with the Monte-Carlo A*",
        ylim=(-1.05, 1.05),
        title=f"Segment advantages (Q={settings['questions']}, tree {settings['tree']}, "
        f"M={settings['segment_tokens']}, "
        f"K*={settings['reference_samples']})",
    )
    bars.legend(fontsize=8, loc="lower right")
    bars.grid(axis="y", alpha=0.3)

    edges = results["edge_records"]
    reference = [e["reference"] for e in edges]
    for name, marker in (("spo_tree", "^"), ("grpo", "o")):
        scatter.scatter(reference, [e["estimates"][name] for e in edges], s=16, alpha=0.6, marker=marker, label=name)
    scatter.axhline(0, color="gray", lw=0.8)
    scatter.axvline(0, color="gray", lw=0.8)
    scatter.set(
        xlabel="reference A* = V*(child) - V*(parent)",
        ylabel="estimated advantage (raw scale)",
        title="Estimates against A* on the same edges",
    )
    scatter.legend(fontsize=8)
    scatter.grid(alpha=0.3)
    fig.suptitle(
        f"{settings['model']} on {settings['task']}, temperature {settings['temperature']}, top_p {settings['top_p']}, "
        f"{settings['max_new_tokens']} new tokens",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    cli.run_cli(main, ranges.cli(Args))
