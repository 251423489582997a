"""SPO-tree: segment advantages from a tree of Monte-Carlo rollouts (Segment Policy Optimization, long CoT).

For each question, grow a tree: the prompt (root) samples b_0 segments of at most M tokens; every
segment that did not finish samples b_1 continuations of M tokens, and so on; at the last level the
continuations run to completion. Leaves are graded (1 if the final answer is right, 0 if wrong or
unfinished); an inner node's value is the mean of its children's values. Every non-root node is one
training sample: query = prompt + the segments above it, response = its own segment, constant
advantage V(node) - V(parent) (the siblings are each other's baseline). The policy is updated with the
PPO-clip surrogate on tokens with p_t < 0.9 (probability mask) plus a k3 KL penalty to the frozen
reference model. Guo et al. 2025, "Segment Policy Optimization", arXiv 2505.23564 (section 4, SPO-tree);
see README.md for the paper's settings and results.

Deliberate differences from the paper's released code: README.md, "Deliberate fixes over the paper's released
code" (here: a child continues from its parent's exact token ids; unfinished leaves score 0).
Choices the paper leaves open, each stated where it is made: a stop string that straddles a segment boundary ends
the response there (grow_trees); an edge waits at most --buffer-max-age iterations and leaves the buffer once taken,
so it is trained on in one iteration, with the old log-probs of the policy that grew it (sample_buffer); every
iteration trains exactly --samples-per-iteration samples, a random subset or random repeats of the buffer's offer
(fill_samples); the learning rate schedule steps once per iteration, since the number of steps may vary (main).

  python spo_tree.py                       # paper long-CoT run: R1-Distill-Qwen-1.5B on MATH, 6-6-6, M=600, 2K context
  python spo_tree.py --model rho-1b-sft-gsm8k --task gsm8k --segment-tokens 30 --questions 16 \\
      --samples-per-iteration 1024 --context 2047 --max-new-tokens 1024 --top-p 0.9 --eval-samples 16 \\
      --eval-temperature 0.35 --eval-top-p 0.9                                     # paper GSM8K run
  python spo_tree.py --model smollm2-135m --task rg:chain_sum:min_terms=2,max_terms=2,max_digits=1 --tree 3,3 \\
      --segment-tokens 16 --iterations 2 --questions 2 --samples-per-iteration 16 --batch-size 8 --micro-batch-size 4 \\
      --max-new-tokens 64 --context 512 --eval-limit 10 --eval-samples 1               # offline CPU
"""

from __future__ import annotations

import collections
import math
import random
import re
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

import eval as ev
from plumbing import (
    UsageError,
    bookkeeping,
    checkpoints,
    cli,
    distributed,
    engines,
    models,
    paper,
    ranges,
    settings,
    tasks,
)
from plumbing.precision import FP32, Precision
from plumbing.rollout_correction import correct_rollouts, rollout_metrics
from plumbing.training import (
    attach_old_logprobs,
    collate,
    make_optimizer,
    micro_batches,
    new_sample,
    reseed,
    response_logprobs,
    sample_logprobs,
)


@dataclass
class SpoTreeSettings:
    """SPO-tree's own settings: first in --help."""

    tree: str = "6,6,6"
    """branch factor per depth, b_0,b_1,...: depth = number of entries (paper: 6,6,6). Size per iteration,
    --questions x product of the branches leaves: above 50,000 a warning gives the estimate (the paper's: 6,912);
    above 1,000,000 the run is refused"""
    segment_tokens: ranges.PositiveInt = 600
    """M: new tokens per segment above the last level (paper: 600 long CoT, 30 GSM8K)"""
    advantage: Literal["rloo", "grpo"] = "rloo"
    """edge advantage: rloo = V(child) - V(parent); grpo = that / (std of the siblings' values + 1e-8)"""
    prob_mask: bool = True
    """train only on tokens with p_t < prob_threshold (--no-prob-mask: every response token)"""
    prob_threshold: ranges.Probability = 0.9
    """probability threshold of the mask"""
    buffer_max_age: ranges.PositiveInt = 8
    """iterations an edge may wait in the replay buffer (1: only this iteration's edges are used)"""
    edges_per_question: ranges.PositiveInt = 32
    """edges taken from the buffer per question per iteration, at random; the rest wait"""
    samples_per_iteration: ranges.NonNegativeInt = 512
    (
        "segment samples trained on per iteration (paper: 512 MATH, 1024 GSM8K): a random subset of the edges the "
        "buffer offers when it offers more (the rest stay in the buffer), edges repeated at random when it offers "
        "fewer; 0: every edge the buffer offers, once"
    )
    edge_weight: Literal["uniform", "depth"] = "uniform"
    """uniform: every edge weighs 1 (the paper's and the authors' code); depth: an option beyond the paper that weighs a
    depth-d edge 1 / (b_0 ... b_{d-2} (b_{d-1} - 1)) (times offered / kept edges of its question), so the expected
    loss gradient is the policy gradient's direction (depth_weights; README, deliberate differences)"""


# SpoTreeSettings first in --help, then the settings every script shares (settings.TrainArgs), redeclared
# here only where this algorithm's paper default differs.
@dataclass
class Args(settings.TrainArgs, SpoTreeSettings):
    exp_name: str = "spo_tree"
    """experiment name, part of the run name"""
    model: str = "deepseek-r1-distill-qwen-1.5b"
    (
        "policy to start from: model directory, Hugging Face id or alias (rho-1b-sft-gsm8k, rho-1b-sft-math, "
        "deepseek-r1-distill-qwen-1.5b, smollm2-135m)"
    )
    task: str = "math"
    """training task: one of plumbing/tasks.py (eval.py --help lists them), e.g. gsm8k, rg:chain_sum, path.jsonl"""
    questions: ranges.PositiveInt = 32
    """questions per iteration, one tree each (sampled with replacement)"""
    top_p: ranges.Probability = 1.0
    """nucleus sampling threshold"""
    max_new_tokens: ranges.PositiveInt = 2048
    """response token budget of a whole root-to-leaf path (the context budget usually binds first)"""
    context: ranges.PositiveInt = 2048
    """total context budget (prompt + response)"""
    epochs: ranges.PositiveInt = 1
    """passes over each iteration's edges"""
    batch_size: ranges.PositiveInt = 128
    """sequences (edges) per optimizer step"""
    eval_samples: ranges.PositiveInt = 1
    """samples per held-out question (paper long-CoT protocol: 1 at temperature 0.6, top_p 0.95)"""
    eval_temperature: ranges.NonNegativeFloat = 0.6
    """evaluation sampling temperature"""
    eval_top_p: ranges.Probability = 0.95
    """evaluation nucleus threshold"""


# The paper's runs of this algorithm (Guo et al. 2025, section 5 and appendix; the authors' released configs): the
# setup all four scripts share (plumbing/paper.py: model, task, sampling, evaluation, optimizer) and what this
# algorithm sets. Args' defaults are the first run's values. --dry-run prints every setting beside the matching run's,
# and the README's settings table is generated from these (python -m tools.paper_settings --write).
# fmt: off
TREE_RUN = dict(tree="6,6,6", advantage="rloo", edge_weight="uniform", epochs=1, batch_size=128, prob_mask=True,
                prob_threshold=0.9, buffer_max_age=8, edges_per_question=32)
PAPER_SETTINGS = {
    "math":  dict(paper.MATH_RUN,  **TREE_RUN, questions=32, samples_per_iteration=512,  segment_tokens=600),
    "gsm8k": dict(paper.GSM8K_RUN, **TREE_RUN, questions=16, samples_per_iteration=1024, segment_tokens=30),
}
# fmt: on


# ----------------------------------------------------------------------------------------------
# Algorithm: the tree, values, segment advantages, loss (pure functions)

ADVANTAGES = ("rloo", "grpo")


def parse_tree(spec: str) -> list[int]:
    """Branch factors per depth from "b0,b1,...": each a positive integer, whitespace allowed.

    >>> parse_tree("6, 6,6")
    [6, 6, 6]
    """
    if not spec.strip():
        raise ValueError(f"{spec!r}: no branch factors (write one per depth, e.g. 6,6,6)")
    branches = []
    for depth, part in enumerate(spec.split(",")):
        part = part.strip()
        if not re.fullmatch(r"[0-9]+", part) or int(part) < 1:
            raise ValueError(
                f"{spec!r}: branch factor {part!r} at depth {depth} is not a positive integer "
                "(write one per depth, e.g. 6,6,6)"
            )
        branches.append(int(part))
    return branches


@dataclass
class Node:
    """One node of a rollout tree: the root holds the prompt ids, every other node its own segment's ids."""

    tokens: list[int]
    children: list[Node] = field(default_factory=list)
    reward: float | None = None  # leaves only: graded reward of the full response (0 when unfinished)
    value: float | None = None  # filled by backup_values
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"; None for the root
    depth: int = 0  # 0 for the root, d for a segment sampled at level d-1
    logprobs: list[float] | None = None  # the log-probs the sampler drew the segment's tokens with (Completion)
    logprobs_top_p: float = 1.0  # the nucleus those log-probs are renormalised over (Completion)


def backup_values(root: Node) -> float:
    """Fill every node's value: a leaf's is its reward, an inner node's the mean of its children's values
    (recursive in definition, not leaf-weighted; computed children first without recursion, so any depth is fine);
    return the root's value.

    Paper: segment advantage estimation: SPO-tree's tree-based advantage estimation.

    >>> backup_values(Node([0], [Node([1], reward=1.0), Node([2], [Node([3], reward=0.0), Node([4], reward=1.0)])]))
    0.75
    """
    order = []
    stack = [root]
    while stack:  # pre-order; reversed, every child comes before its parent
        node = stack.pop()
        order.append(node)
        stack += node.children
    for node in reversed(order):
        if node.children:
            node.value = sum(child.value for child in node.children) / len(node.children)
        elif node.reward is None:
            raise ValueError(f"leaf at depth {node.depth} has no reward")
        else:
            node.value = float(node.reward)
    return root.value


def edge_advantages(parent: Node, advantage: str = "rloo") -> list[float]:
    """Advantage of each child of `parent` (values already backed up): "rloo" V(child) - V(parent),
    "grpo" that / (population std of the children's values + 1e-8).

    Paper: segment advantage estimation: SPO-tree's tree-based advantage estimation.

    >>> edge_advantages(Node([0], [Node([1], value=1.0), Node([2], value=0.0)], value=0.5))
    [0.5, -0.5]
    """
    scale = (
        statistics.pstdev([child.value for child in parent.children]) + 1e-8
        if advantage == "grpo" and parent.children
        else 1.0
    )
    return [(child.value - parent.value) / scale for child in parent.children]


def tree_segments(root: Node, advantage: str = "rloo", with_nodes: bool = False) -> list[tuple]:
    """Training samples of a tree: (query ids, segment ids, advantage, depth) per non-root node, depth-first
    pre-order (a node, then its subtree, then its next sibling); with_nodes: the node in place of its segment's ids.
    Calls backup_values.

    Paper: segment advantage estimation: SPO-tree's tree-based advantage estimation.

    query = root.tokens + the ancestors' segments; advantage "rloo" = V(node) - V(parent), "grpo" = that
    / (population std of the node and its siblings' values + 1e-8); depth: 1 for the root's children. Edges with
    advantage exactly 0 are dropped: siblings that agree carry no signal.

    >>> root = Node([9], [Node([1], reward=1.0), Node([2], [Node([3], reward=0.0), Node([4], reward=1.0)])])
    >>> tree_segments(root)
    [([9], [1], 0.25, 1), ([9], [2], -0.25, 1), ([9, 2], [3], -0.5, 2), ([9, 2], [4], 0.5, 2)]
    """
    if advantage not in ADVANTAGES:
        raise ValueError(f"unknown advantage {advantage!r}: use {' or '.join(ADVANTAGES)}")
    backup_values(root)
    segments = []

    def children(node: Node, query: list[int], depth: int) -> list:  # reversed: the stack pops them in order
        return [
            (c, a, query, depth + 1) for c, a in reversed(list(zip(node.children, edge_advantages(node, advantage))))
        ]

    stack = children(root, list(root.tokens), 0)  # (node, its advantage, its query, its depth); no recursion
    while stack:
        node, edge_advantage, query, depth = stack.pop()
        if edge_advantage != 0:
            segments.append((list(query), node if with_nodes else list(node.tokens), edge_advantage, depth))
        stack += children(node, query + node.tokens, depth)
    return segments


def walk(root: Node) -> Iterator[tuple[Node, list[int]]]:
    """Every non-root node with the ids generated before it (its ancestors' segments), depth-first pre-order.
    The node's full response is `before + node.tokens`; its query is `root.tokens + before`."""
    stack = [(child, []) for child in reversed(root.children)]
    while stack:
        node, before = stack.pop()
        yield node, before
        stack += [(child, before + node.tokens) for child in reversed(node.children)]


def tree_edges(trees: list[Node], question_ids: list[int], iteration: int, advantage: str) -> tuple[list[dict], int]:
    """Replay-buffer edges of one iteration's trees (tree_segments of each, with the question's index, the
    iteration it was born in and the sampler's log-probs when it gave them) and the number of edges with a non-zero
    advantage. An empty segment (a stop string that began in the parent's segment) makes no edge, but is counted.

    >>> tree = Node([9], [Node([1], reward=1.0), Node([2], reward=0.0)])
    >>> edges, nonzero = tree_edges([tree], [7], iteration=3, advantage="rloo")
    >>> [(e["question"], e["born"], e["prompt_ids"], e["response_ids"], e["advantage"], e["depth"]) for e in edges]
    [(7, 3, [9], [1], 0.5, 1), (7, 3, [9], [2], -0.5, 1)]
    >>> nonzero
    2
    """
    edges = []
    nonzero = 0
    for question_id, tree in zip(question_ids, trees):
        segments = tree_segments(tree, advantage, with_nodes=True)
        nonzero += len(segments)
        edges += [
            {
                "question": question_id,
                "born": iteration,
                **new_sample(
                    query, engines.Completion(node.tokens, node.finish_reason, node.logprobs, node.logprobs_top_p)
                ),
                "advantage": edge_advantage,
                "depth": depth,
            }
            for query, node, edge_advantage, depth in segments
            if node.tokens
        ]
    return edges, nonzero


def sample_buffer(
    buffer: list[dict], iteration: int, max_age: int, per_question: int, rng: random.Random
) -> tuple[list[dict], list[dict]]:
    """Replay buffer step: drop edges older than `max_age` iterations, then take at most `per_question`
    random edges per question. Returns (taken, remaining); taken edges leave the buffer.

    Paper: SPO-tree's replay buffer.

    An edge born in iteration i (edge["born"]) can be taken in iterations i .. i + max_age - 1.
    Edges are grouped by edge["question"]; both lists keep the buffer's order.
    """
    alive = [edge for edge in buffer if iteration - edge["born"] < max_age]
    by_question: dict = {}
    for index, edge in enumerate(alive):
        by_question.setdefault(edge["question"], []).append(index)
    chosen = set()
    for indices in by_question.values():
        chosen.update(rng.sample(indices, min(per_question, len(indices))))
    taken = [edge for i, edge in enumerate(alive) if i in chosen]
    remaining = [edge for i, edge in enumerate(alive) if i not in chosen]
    return taken, remaining


def fill_samples(taken: list[dict], remaining: list[dict], n: int, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Exactly `n` segment samples from the edges sample_buffer took, as the authors' episode generator makes
    them: a random subset of n when it took more (the others go back to the buffer), every edge once plus
    n - len(taken) drawn again with replacement when it took fewer. n = 0, n = len(taken) or no edges at all:
    the taken edges unchanged. Returns (samples, remaining); samples keep the buffer's order, repeats last.

    Paper: SPO-tree's replay buffer.

    A repeat is the same dict as its edge: setting a sample's tensors sets every copy's, which would get the
    same values anyway, and each copy still counts in the per-sample statistics (whitening, loss normalisation).
    An edge that goes back keeps its "born" iteration; `remaining` stays oldest first, the edge behind those of
    its own iteration that stayed.

    >>> edges = [{"id": i, "born": 2} for i in range(4)]
    >>> samples, buffer = fill_samples(edges, [{"id": 8, "born": 1}, {"id": 9, "born": 2}], 2, random.Random(0))
    >>> [e["id"] for e in samples], [e["id"] for e in buffer]
    ([1, 3], [8, 9, 0, 2])
    >>> samples, buffer = fill_samples(edges[:2], [], 5, random.Random(0))
    >>> [e["id"] for e in samples], buffer
    ([0, 1, 1, 1, 0], [])
    """
    if n == 0 or not taken or len(taken) == n:
        return taken, remaining
    if len(taken) > n:
        chosen = set(rng.sample(range(len(taken)), n))
        samples = [edge for i, edge in enumerate(taken) if i in chosen]
        returned = [edge for i, edge in enumerate(taken) if i not in chosen]
        # sorted is stable: both lists are oldest first
        return samples, sorted(remaining + returned, key=lambda edge: edge["born"])
    return taken + [rng.choice(taken) for _ in range(n - len(taken))], remaining


def depth_weights(branches: list[int]) -> list[float]:
    """--edge-weight depth: the weight of an edge at each depth d = 1..D of a --tree b_0,...,b_{D-1} tree, so that
    the tree's expected loss gradient is proportional to the policy gradient (an option beyond the paper, whose
    edges all weigh 1).

    Paper: edge weighting (beyond the paper).

    A full tree has n_d = b_0 ... b_{d-1} nodes at depth d, each an equally weighted sample, so uniform weights
    count a depth-d segment n_d times per tree; with the rloo baseline the parent's value includes the child itself,
    which scales its expected contribution by (b_{d-1} - 1) / b_{d-1}. The weight that undoes both is
    w_d = 1 / (b_0 ... b_{d-2} (b_{d-1} - 1)); here scaled by one constant so a full tree's mean edge weight is 1.
    A level with one branch has no baseline (its edges have advantage 0 and are dropped): weight 0.

    >>> [round(w, 4) for w in depth_weights([6, 6, 6])]  # 1/5, 1/30, 1/180, times 258/3.6
    [14.3333, 2.3889, 0.3981]
    >>> depth_weights([2, 3])  # 1/1 and 1/(2*2), times 8 / (2 + 1.5)
    [2.2857142857142856, 0.5714285714285714]
    """
    raw = []
    nodes = []
    width = 1
    for branch in branches:
        raw.append(1.0 / (width * (branch - 1)) if branch > 1 else 0.0)
        width *= branch
        nodes.append(width)
    total = sum(n * w for n, w in zip(nodes, raw))
    return [w * sum(nodes) / total for w in raw] if total else raw


def edge_weights(taken: list[dict], remaining: list[dict], by_depth: list[float]) -> list[float]:
    """The weight of each edge sample_buffer took: its depth's weight (depth_weights; edge["depth"] counts from 1)
    times E_q / k_q, where k_q of the E_q edges question q offered were taken (--edges-per-question keeps a
    random k_q of them, and E_q depends on the tree's outcomes: without the factor a question with many non-zero
    edges would count as much as one with few).

    Paper: edge weighting (beyond the paper).

    >>> taken = [{"question": 0, "depth": 1}, {"question": 0, "depth": 2}, {"question": 1, "depth": 2}]
    >>> edge_weights(taken, [{"question": 0, "depth": 2}] * 2, [1.0, 0.5])  # question 0: 2 of 4 kept
    [2.0, 1.0, 0.5]
    """
    offered = collections.Counter()
    kept = collections.Counter(edge["question"] for edge in taken)
    offered.update(edge["question"] for edge in taken + remaining)
    return [by_depth[edge["depth"] - 1] * offered[edge["question"]] / kept[edge["question"]] for edge in taken]


def loss_mask(
    response_mask: torch.Tensor,
    probs: torch.Tensor,
    threshold: float,
    prob_mask: bool,
    all_sum: Callable = lambda x: x,
) -> torch.Tensor:
    """Tokens that count in the loss: response tokens, and with the probability mask only those with p_t < threshold.

    Paper: policy optimization with the probability mask.

    Falls back to all response tokens when no token of the batch is below the threshold. `all_sum` sums a tensor
    over the processes that share the batch (distributed.all_sum under torchrun; the identity in one process).

    >>> response = torch.tensor([[True, True, True, False]])  # the last column is padding
    >>> loss_mask(response, torch.tensor([[0.95, 0.5, 0.99, 0.1]]), 0.9, prob_mask=True)
    tensor([[False,  True, False, False]])
    >>> loss_mask(response, torch.tensor([[0.95, 0.97, 0.99, 0.1]]), 0.9, prob_mask=True)  # none below 0.9: fall back
    tensor([[ True,  True,  True, False]])
    >>> loss_mask(response, torch.tensor([[0.95, 0.5, 0.99, 0.1]]), 0.9, prob_mask=False)
    tensor([[ True,  True,  True, False]])
    """
    if not prob_mask:
        return response_mask
    masked = response_mask & (probs < threshold)
    return masked if all_sum(masked.sum()) > 0 else response_mask


def whiten(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-8,
    all_sum: Callable = lambda x: x,
    mode: str = "centre-scale",
) -> torch.Tensor:
    """Normalise advantages over the masked tokens (--whiten); unmasked tokens are transformed too, but do not count in
    the statistics. No masked token at all: returned unchanged. `all_sum` sums a tensor over the processes that share
    the batch (distributed.all_sum under torchrun), so the statistics are those of the whole batch.

    Paper: policy optimization with the probability mask.

    centre-scale (the paper's): shift and scale to mean 0, std 1 (std with ddof 0). When the mask nearly empties
    (few tokens under the threshold, all with negative advantages), centring turns advantage-0 tokens positive.
    scale: divide by the root mean square over the masked tokens, no shift, so an advantage of 0 stays 0 and every
    sign is kept; all masked advantages 0: returned unchanged (nothing to scale by). none: returned unchanged.

    >>> whiten(torch.tensor([1., 3., 5., 100.]), torch.tensor([True, True, True, False]))
    tensor([-1.2247,  0.0000,  1.2247, 59.4001])
    >>> whiten(torch.tensor([0., 0., -3., 4.]), torch.tensor([True, True, True, False]))  # the zeros turn positive
    tensor([ 0.7071,  0.7071, -1.4142,  3.5355])
    >>> whiten(torch.tensor([0., 0., -3., 4.]), torch.tensor([True, True, True, False]), mode="scale")  # RMS sqrt(3)
    tensor([ 0.0000,  0.0000, -1.7321,  2.3094])
    """
    if mode == "none":
        return advantages
    count, total = all_sum(torch.stack([mask.sum().to(advantages.dtype), (advantages * mask).sum()]))
    if count == 0:
        return advantages
    if mode == "scale":
        rms = (all_sum((advantages**2 * mask).sum()) / count).sqrt()
        return advantages if rms == 0 else advantages / (rms + eps)
    mean = total / count
    std = (all_sum(((advantages - mean) ** 2 * mask).sum()) / count).sqrt()
    return (advantages - mean) / (std + eps)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    beta: float,
    batch_tokens: int,
    batch_sequences: int,
) -> tuple[torch.Tensor, dict]:
    """PPO-clip surrogate + beta * k3 KL to the reference model, for a micro-batch of [rows, T] token tensors.

    Paper: policy optimization with the probability mask; the KL penalty.

    Normalised by the whole batch's masked-token count (`batch_tokens`) and sequence count
    (`batch_sequences`), so summing micro-batch losses gives the batch loss whatever the split.
    KL: k3 = exp(d) - d - 1 with d = ref - logp, summed over a sequence's masked tokens, mean over sequences.
    Both log-ratios are clamped to [-10, 10] (as in the authors' code): a token the policy has nearly ruled out
    would otherwise make exp() overflow to inf and the whole update non-finite.

    Token 0 doubled its probability (ratio 2, clipped to 1.2 for a positive advantage); token 1 did not move:
    pg_loss = -(1.2 * 1 + 1 * -1) / 2 tokens = -0.1; kl = exp(log 0.5) - log 0.5 - 1 = 0.1931 (token 1 adds 0),
    0.0966 per masked token (kl_per_token: logged beside the loss's kl, not in the loss).

    >>> old = torch.log(torch.tensor([[0.25, 0.5]]))
    >>> loss, stats = policy_loss(torch.log(torch.tensor([[0.5, 0.5]])), old, old, torch.tensor([[1.0, -1.0]]),
    ...                           torch.tensor([[True, True]]), clip_eps=0.2, beta=0.1, batch_tokens=2,
    ...                           batch_sequences=1)
    >>> round(loss.item(), 4), {key: round(value, 4) for key, value in stats.items()}
    (-0.0807, {'pg_loss': -0.1, 'kl': 0.1931, 'kl_per_token': 0.0966, 'clip_count': 1.0})
    """
    mask = mask.float()
    ratio = torch.exp(torch.clamp(logps - old_logps, -10.0, 10.0))  # [rows, T]
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    pg_loss = -(surrogate * mask).sum() / batch_tokens
    log_ref_ratio = torch.clamp(ref_logps - logps, -10.0, 10.0)  # [rows, T]
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # [rows, T], k3 estimator: unbiased, always >= 0
    kl_loss = (kl * mask).sum() / batch_sequences
    clipped = ((ratio - 1).abs() > clip_eps).float()
    stats = {"pg_loss": pg_loss.item(), "kl": kl_loss.item(), "kl_per_token": (kl * mask).sum().item() / batch_tokens}
    stats["clip_count"] = (clipped * mask).sum().item()
    return pg_loss + beta * kl_loss, stats


# ----------------------------------------------------------------------------------------------
# Rollout: grow the trees level by level, grade the leaves


def grow_trees(
    sampler,
    prompts: list[list[int]],
    branches: list[int],
    *,
    segment_tokens: int,
    max_new_tokens: int,
    context: int,
    temperature: float,
    top_p: float,
    stop: list[str],
) -> tuple[list[Node], list[float]]:
    """One tree per prompt, grown level by level with one batched sampler call per level across all trees.

    Paper: segment partition: SPO-tree's fixed-length segments.

    Level d: every open node samples branches[d] children of at most `segment_tokens` new tokens (the sampler
    prefills each prefix once); at the last level children run to completion, up to `max_new_tokens` minus
    the tokens already on the path and the context budget. A child that stopped (EOS or stop string) is a
    leaf to grade. A child that filled its M tokens is expanded at the next level; one cut short by the
    context limit, or with no room left, cannot be: it stays an unfinished leaf (reward 0), as does a
    last-level child that did not stop. Returns the roots (rewards not set yet) and the seconds per level.
    """
    roots = [Node(tokens=list(prompt)) for prompt in prompts]
    frontier = [(root, root.tokens, []) for root in roots]  # (open node, prompt ids, ids generated on its path)
    seconds = []
    for depth, branch in enumerate(branches):
        started = time.monotonic()
        last = depth == len(branches) - 1
        generated = depth * segment_tokens  # every open node's path holds exactly `depth` full segments
        groups = sampler.sample(
            [prompt + path for _, prompt, path in frontier],
            branch,
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens - generated if last else segment_tokens,
            stop=stop,
            context=context,
            progress=f"level {depth + 1}/{len(branches)}",
            generated=[len(path) for _, _, path in frontier],  # a stop string may begin in an ancestor's segment
        )
        next_frontier = []
        for (parent, prompt, path), completions in zip(frontier, groups):
            for completion in completions:
                # empty when a stop string began in the path
                ids = completion.ids
                finish = completion.finish_reason
                child = Node(
                    list(ids),
                    finish_reason=finish,
                    depth=depth + 1,
                    logprobs=completion.logprobs,
                    logprobs_top_p=completion.logprobs_top_p,
                )
                parent.children.append(child)
                room = context - len(prompt) - len(path) - len(ids)
                if not last and finish == "length" and len(ids) == segment_tokens and room > 0:
                    next_frontier.append((child, prompt, path + child.tokens))
        frontier = next_frontier
        seconds.append(time.monotonic() - started)
    return roots, seconds


def grade_trees(trees: list[Node], answers: list[str], tokenizer, task: str) -> None:
    """Set every leaf's reward: a leaf that stopped is graded on its full response (all segments on its path,
    special tokens skipped), an unfinished one scores 0. One grading call for all trees."""
    finished = []  # (leaf, response text, reference answer)
    for tree, answer in zip(trees, answers):
        for node, before in walk(tree):
            if not node.children:
                node.reward = 0.0
                if node.finish_reason == "stop":
                    finished.append((node, tokenizer.decode(before + node.tokens, skip_special_tokens=True), answer))
    if finished:
        scores = tasks.grade([text for _, text, _ in finished], [answer for _, _, answer in finished], task)
        for (node, _, _), score in zip(finished, scores):
            node.reward = score


# ----------------------------------------------------------------------------------------------
# The update: what the loss needs, gradients, optimizer steps


def attach_targets(
    samples: list[dict],
    reference,
    micro_batch_size: int,
    temperature: float,
    pad_id: int,
    prob_threshold: float,
    prob_mask: bool,
    precision: Precision = FP32,
    whiten_mode: str = "centre-scale",
) -> dict:
    """Set what the loss needs on every sample: "ref_logps" (the frozen reference model's log-probs; the old ones
    when there is no reference model, beta = 0), "loss_mask" (response tokens, with the probability mask only
    those with p_t < prob_threshold) and "advantages" (the edge's advantage on each token, whitened over the
    masked tokens of all samples, of every rank under torchrun, then times the edge's "weight" when it has one:
    --edge-weight depth; --whiten's `whiten_mode`). A sample listed twice (fill_samples) counts twice in the
    whitening. Returns the whitening's counts (bookkeeping.whitening_metrics)."""
    edges = list({id(s): s for s in samples}.values())  # each edge once: a repeat is the same dict
    for s in edges:
        s["ref_logps"] = s["old_logps"]
    if reference is not None:
        # Parked in pinned CPU memory (--reference-on-device False): copied in for this pass
        with models.on_device(reference):
            ref_logps = sample_logprobs(reference, edges, micro_batch_size, temperature, pad_id, precision)
            for s, logps in zip(edges, ref_logps):
                s["ref_logps"] = logps
    lengths = [len(s["response_ids"]) for s in samples]
    flat_probs = torch.cat([s["old_logps"] for s in samples] or [torch.zeros(0)]).exp()  # [tokens], p_t
    every_token = torch.ones_like(flat_probs, dtype=torch.bool)
    flat_mask = loss_mask(every_token, flat_probs, prob_threshold, prob_mask, all_sum=distributed.all_sum)
    raw = torch.repeat_interleave(
        torch.tensor([s["advantage"] for s in samples]), torch.tensor(lengths, dtype=torch.long)
    )
    # Whitened over the whole iteration batch's masked tokens
    flat_advantages = whiten(raw, flat_mask, all_sum=distributed.all_sum, mode=whiten_mode)
    whitening = bookkeeping.whitening_metrics(raw, flat_advantages, flat_mask)
    # --edge-weight depth (edge_weights): each edge's weight scales its whitened advantage, which is the surrogate's
    # per-token weight (w > 0 factors out of PPO-clip's min); the KL term and the token count stay unweighted.
    flat_weights = torch.repeat_interleave(
        torch.tensor([s.get("weight", 1.0) for s in samples], dtype=flat_advantages.dtype),
        torch.tensor(lengths, dtype=torch.long),
    )
    flat_advantages = flat_advantages * flat_weights
    for s, mask, advantage in zip(samples, flat_mask.split(lengths), flat_advantages.split(lengths)):
        s["loss_mask"] = mask
        s["advantages"] = advantage
    return whitening


def accumulate_gradients(
    model,
    batch_samples: list[dict],
    *,
    micro_batch_size: int,
    temperature: float,
    clip_eps: float,
    beta: float,
    pad_id: int,
    all_sum: Callable = lambda x: x,
    precision: Precision = FP32,
) -> dict:
    """Forward/backward one optimizer batch in micro-batches; gradients add up to the full-batch gradient.
    Under torchrun each rank passes its share of the batch (possibly none) and `all_sum=distributed.all_sum`: the loss
    is normalised by the whole batch's counts, so the ranks' gradients (and stats) sum to those of the whole batch."""
    counts = all_sum(torch.tensor([sum(int(s["loss_mask"].sum()) for s in batch_samples), len(batch_samples)]))
    batch_tokens = max(1, int(counts[0]))
    batch_sequences = int(counts[1])
    stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "kl_per_token": 0.0, "clip_count": 0.0}
    for indices in micro_batches(batch_samples, micro_batch_size):
        batch = collate([batch_samples[i] for i in indices], pad_id, model.device)
        logps = response_logprobs(model, batch, temperature, precision=precision)
        loss, micro = policy_loss(
            logps,
            batch["old_logps"],
            batch["ref_logps"],
            batch["advantages"],
            batch["loss_mask"],
            clip_eps,
            beta,
            batch_tokens,
            batch_sequences,
        )
        loss.backward()
        stats["loss"] += loss.item()
        for key in micro:
            stats[key] = stats.get(key, 0.0) + micro[key]
    stats["clip_frac"] = stats.pop("clip_count") / batch_tokens
    return stats


def update_policy(
    model,
    optimizer,
    scheduler,
    samples: list[dict],
    args: Args,
    pad_id: int,
    iteration: int,
    guard: bookkeeping.NonFiniteGuard,
    precision: Precision = FP32,
) -> list[dict]:
    """--epochs passes over the samples in shuffled batches of --batch-size, each accumulated in micro-batches
    and clipped into one optimizer step; then one scheduler step. Returns the stats of the steps taken.
    Under torchrun `samples` is this rank's share: every rank takes the steps the whole iteration's samples make,
    each with --batch-size / world size of its own (the last ones possibly none), and the gradients are summed."""
    model.train()
    model_stats = []
    batch_size = args.batch_size // distributed.world_size()  # this rank's share of each batch
    # Optimizer steps per epoch, the same on every rank
    steps = math.ceil(int(distributed.all_sum(torch.tensor(len(samples)))) / args.batch_size)
    for _ in range(args.epochs):
        order = torch.randperm(len(samples)).tolist()
        for start in range(0, steps * batch_size, batch_size):
            optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                model,
                [samples[i] for i in order[start : start + batch_size]],
                micro_batch_size=args.micro_batch_size,
                temperature=args.temperature,
                clip_eps=args.clip_eps,
                beta=args.beta,
                pad_id=pad_id,
                all_sum=distributed.all_sum,
                precision=precision,
            )
            stats = distributed.sum_over_ranks(stats)  # every rank takes the same decision below
            distributed.all_reduce_gradients(model)
            stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            if guard.skips(stats, iteration, keys=("loss", "grad_norm"), temperature=args.temperature):
                continue
            optimizer.step()
            model_stats.append(stats)
    optimizer.zero_grad(set_to_none=True)
    # Once per iteration, not per step: one rule whether the number of steps varies (--samples-per-iteration 0) or not.
    with warnings.catch_warnings():  # an iteration without edges makes no optimizer step; the schedule still advances
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()
    return model_stats


# ----------------------------------------------------------------------------------------------
# Main loop: the algorithm box


def main(args: Args) -> dict:
    # torchrun: this rank's GPU (or the CPU over gloo); plain python: one process
    device = distributed.init_distributed(args)
    branches = validate(args)
    eval_task = args.eval_task or tasks.default_eval_task(args.task)
    if args.dry_run:  # nothing is loaded: the alias is expanded by name only
        return paper.dry_run(args, PAPER_SETTINGS, eval_task, **tree_shape(branches))
    run = bookkeeping.start_run(args, device)  # seed, precision, run directory, newest checkpoint, memory plan
    if run.finished:
        return run.finished  # resumed after its last iteration: reported, left as it is
    args = replace(args, **run.plan.settings())  # from here on the memory knobs hold this device's values
    model, tokenizer, reference = models.load_run_models(args, run.checkpoint, device, precision=run.precision)
    train_examples, eval_examples = tasks.load_examples(
        args.task, eval_task, args.context, args.eval_limit, args.seed, tokenizer, args.heldout_seed
    )
    sampler = engines.run_sampler(args, model, tokenizer, run.checkpoint, run.precision)
    sampling = engines.sampling_settings(args, tasks.stop_strings(args.task, tokenizer))
    pad_id = tokenizer.pad_token_id
    # The schedule steps once per iteration (see update_policy).
    optimizer, scheduler = make_optimizer(
        model, args.lr, args.weight_decay, args.warmup_ratio, args.iterations, run.state
    )
    buffer = run.state["buffer"] if run.state else []  # the replay buffer, oldest edge first
    evaluate = lambda: ev.evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args)  # noqa: E731
    book = bookkeeping.Loop(run, args, eval_task, evaluate)

    for iteration in book.iterations():
        rng = reseed(args.seed, iteration, sampler)  # a resumed run samples what the uninterrupted one would

        # 1. Rollout: one tree per question, grown level by level across all trees (this rank's share of them).
        question_ids = distributed.shard([rng.randrange(len(train_examples)) for _ in range(args.questions)])
        questions = [train_examples[i] for i in question_ids]
        with book.timed("rollout"):
            trees, level_seconds = grow_trees(
                sampler, [q.prompt_ids for q in questions], branches, segment_tokens=args.segment_tokens, **sampling
            )

        # 2. Rewards: every finished leaf graded on its full response; unfinished leaves score 0.
        grade_trees(trees, [q.answer for q in questions], tokenizer, args.task)

        # 3. Values and segment advantages; old log-probs of the new edges under the policy that sampled them.
        #    Under torchrun every rank gets every rank's edges: the replay buffer is one, the same on all ranks.
        new_edges, nonzero_edges = tree_edges(trees, question_ids, iteration, args.advantage)
        attach_old_logprobs(model, new_edges, args.micro_batch_size, args.temperature, pad_id, run.precision)
        new_edges = distributed.gather(new_edges)
        saved_probs = {}
        if book.saves_samples(iteration):  # p_t of the saved trees' nodes, before the update
            saved = trees[: args.save_questions]
            saved_probs = tree_node_probs(model, saved, args.micro_batch_size, args.temperature, pad_id, run.precision)

        # 4. Replay buffer: at most --edges-per-question edges per question, then exactly --samples-per-iteration
        #    samples of them (each rank trains its share); reference log-probs, loss mask, whitened advantages.
        taken, buffer = sample_buffer(buffer + new_edges, iteration, args.buffer_max_age, args.edges_per_question, rng)
        # Beyond the paper: --edge-weight depth makes the expected loss gradient the policy gradient's direction.
        if args.edge_weight == "depth":
            for edge, weight in zip(taken, edge_weights(taken, buffer, depth_weights(branches))):
                edge["weight"] = weight
        # buffer: what stays for later iterations (the checkpoint keeps it)
        samples, buffer = fill_samples(taken, buffer, args.samples_per_iteration, rng)
        rank_samples = distributed.shard(samples)
        whitening = attach_targets(
            rank_samples,
            reference,
            args.micro_batch_size,
            args.temperature,
            pad_id,
            args.prob_threshold,
            args.prob_mask,
            run.precision,
            args.whiten,
        )
        correct_rollouts(rank_samples, args.rollout_correction, args.rollout_cap)  # beyond the paper; none: the paper's

        # 5. Update: epochs x shuffled batches x micro-batches (the rollout engine sleeps meanwhile).
        sampler.sleep()
        lr = scheduler.get_last_lr()[0]  # this iteration's: the schedule steps once, at the end of the update
        with book.timed("update"):
            update_stats = update_policy(
                model, optimizer, scheduler, rank_samples, args, pad_id, iteration, book.guard, run.precision
            )
        sampler.wake_up()
        sampler.load_weights(model)
        seconds, last = book.end_iteration()  # rollout, update, iteration (without evaluation and checkpoint), train

        # 6. Log (over all ranks' trees), save samples, evaluate, checkpoint.
        metrics = iteration_metrics(
            trees, samples, buffer, rank_samples, nonzero_edges, iteration, update_stats, lr, seconds, level_seconds
        )
        metrics |= whitening  # the loss-masked tokens and what the whitening moved
        book.log(iteration, metrics, progress_line(iteration, metrics, level_seconds))
        if book.saves_samples(iteration):
            book.write_samples(iteration, sample_records(iteration, trees, questions, saved_probs, tokenizer, args))
        if book.due(iteration, args.eval_every, last):
            book.evaluate(iteration)
        if book.due(iteration, args.save_every, last):  # the buffer too: a resumed run trains on the same edges
            trainer_state = {**checkpoints.optimizer_checkpoint(model, optimizer, scheduler), "iteration": iteration}
            checkpoints.save_checkpoint(run.dir, model, tokenizer, {**trainer_state, "buffer": buffer})
    return book.finish()


# ----------------------------------------------------------------------------------------------
# Below main: this script's settings check, tree size and shape, metrics and sample records


def validate(args: Args) -> list[int]:
    """Check the configuration; return the branch factors of --tree."""
    # the settings every script shares first
    problems = settings.setting_problems(args, tasks.task_problems, engines.backend_problems)
    branches = []
    try:
        branches = parse_tree(args.tree)
    except ValueError as error:
        problems.append(f"--tree {error}")
    if single := [depth for depth, branch in enumerate(branches) if branch == 1]:
        problems.append(
            f"--tree {args.tree}: depth {single[0]} has one child per node, whose advantage against its parent (its "
            "own value) is always 0, so its edges are never trained: give every depth 2 or more children"
        )
    problems += tree_size_problems(args, branches)  # depth, leaves, room for the last level
    if args.advantage not in ADVANTAGES:
        problems.append(f"--advantage must be {' or '.join(ADVANTAGES)}, not {args.advantage!r}")
    # --fsdp: every rank must run as many forward/backward passes as the others (each gathers shards), so each trains
    # an equal share of exactly --samples-per-iteration samples.
    per_rank = {"--questions": args.questions, "--batch-size": args.batch_size}
    if args.fsdp:
        if args.samples_per_iteration == 0:
            problems.append(
                "--fsdp needs a fixed --samples-per-iteration (not 0): every rank must train an equal share"
            )
        per_rank["--samples-per-iteration"] = args.samples_per_iteration
    problems += distributed.world_size_problems(args, per_rank=per_rank)
    if problems:
        raise UsageError("; ".join(problems))
    return branches


# Leaves per iteration a run may grow (stated in --tree's help)
WARN_LEAVES = 50_000
MAX_LEAVES = 1_000_000
MAX_DEPTH = 100  # levels of --tree (viewer.py reads saved trees up to about 495 levels deep)


def tree_size_problems(args: Args, branches: list[int]) -> list[str]:
    """--tree against what a run can hold: at most MAX_DEPTH levels, room for the last level within --max-new-tokens
    and --context, and a tree too large to grow refused (a problem line) or a large one warned about with an estimate.
    Reads --tree, --questions, --segment-tokens, --max-new-tokens and --context."""
    if not branches:
        return []
    problems = []
    if len(branches) > MAX_DEPTH:
        problems.append(
            f"--tree has {len(branches)} levels: at most {MAX_DEPTH} (a saved tree nests one JSON level per depth)"
        )
    nodes_per_level = [args.questions * math.prod(branches[: d + 1]) for d in range(len(branches))]
    leaves = nodes_per_level[-1]
    budget = min(args.max_new_tokens, args.context)
    before_last = (len(branches) - 1) * args.segment_tokens  # tokens on every path before the last level
    tokens = sum(n * args.segment_tokens for n in nodes_per_level[:-1]) + leaves * max(0, budget - before_last)
    estimate = (
        f"--tree {args.tree} grows up to {leaves:,} leaves and {tokens:,} generated tokens per iteration "
        f"(--questions {args.questions})"
    )
    if leaves > MAX_LEAVES:
        problems.append(
            f"{estimate}: over the {MAX_LEAVES:,}-leaf limit; use fewer or smaller branches or fewer --questions"
        )
    elif before_last >= budget:
        problems.append(
            f"--tree {args.tree} with --segment-tokens {args.segment_tokens} generates {before_last} tokens before "
            "its last level, leaving no room within --max-new-tokens and --context: raise them or lower "
            "--segment-tokens"
        )
    elif leaves > WARN_LEAVES:
        warnings.warn(f"{estimate}: far beyond the paper's 6,912 leaves; expect long iterations", stacklevel=2)
    return problems


def tree_shape(branches: list[int]) -> dict:
    """What --dry-run shows of --tree: the branch factors, and the nodes and leaves of a tree without early leaves."""
    full_tree = [math.prod(branches[: d + 1]) for d in range(len(branches))]  # nodes per level
    return {"branches": branches, "nodes_per_full_tree": sum(full_tree), "leaves_per_full_tree": full_tree[-1]}


def iteration_metrics(
    trees: list[Node],
    samples: list[dict],
    buffer: list[dict],
    rank_samples: list[dict],
    nonzero_edges: int,
    iteration: int,
    update_stats: list[dict],
    lr: float,
    seconds: dict[str, float],
    level_seconds: list[float],
) -> dict:
    """One iteration's metrics.jsonl entry, over all ranks' trees: the trees (rewards, shape), the samples trained on
    (`rank_samples`: this rank's, with loss masks, entropies, sampler log-probs), the buffer, the losses (averaged
    over `update_stats`, the steps taken), times (`seconds`; `level_seconds`: each level of the rollout)."""
    trees = distributed.gather(trees)
    loss_masks = distributed.gather([s["loss_mask"] for s in rank_samples])
    nonzero_edges = int(distributed.all_sum(torch.tensor(nonzero_edges)))
    nodes = [node for tree in trees for node, _ in walk(tree)]
    leaves = [node for node in nodes if not node.children]
    generated = sum(len(node.tokens) for node in nodes)
    metrics = {
        "charts/reward": sum(leaf.reward for leaf in leaves) / len(leaves),  # mean over leaves
        "charts/root_value": sum(tree.value for tree in trees) / len(trees),  # the trees' accuracy (values backed up)
        "charts/truncation_rate": sum(leaf.finish_reason != "stop" for leaf in leaves) / len(leaves),
        "charts/generated_tokens_per_question": generated / len(trees),
        "charts/generated_tokens": generated,
        "charts/segment_tokens": sum(len(s["response_ids"]) for s in samples) / max(1, len(samples)),
        "charts/samples": len(samples),  # repeats of an edge (fill_samples) counted once per copy
        "charts/unique_samples": len({id(s) for s in samples}),
        "charts/zero_advantage_fraction": 1 - nonzero_edges / len(nodes),
        "charts/lr": lr,
        "charts/tokens_per_second": generated / max(seconds["rollout"], 1e-9),
        "charts/loss_mask_fraction": torch.cat(loss_masks).float().mean().item() if loss_masks else 0.0,
        "tree/nodes": len(nodes) / len(trees),
        "tree/leaves": len(leaves) / len(trees),
        "buffer/size": len(buffer),
        "buffer/mean_age": sum(iteration - edge["born"] for edge in buffer) / max(1, len(buffer)),
        "buffer/taken_mean_age": sum(iteration - s["born"] for s in samples) / max(1, len(samples)),
        **{f"time/{name}_seconds": value for name, value in seconds.items()},  # iteration: without eval, checkpoint
    }
    for depth in range(1, len(level_seconds)):  # one entry per tree level
        metrics[f"tree/early_leaves_depth{depth}"] = sum(
            leaf.depth == depth and leaf.finish_reason == "stop" for leaf in leaves
        ) / len(trees)
    for depth, seconds in enumerate(level_seconds, 1):
        metrics[f"time/level{depth}_seconds"] = seconds
    metrics |= rollout_metrics(rank_samples)  # entropy; the sampler against the trainer
    return metrics | bookkeeping.loss_metrics(update_stats)


def progress_line(iteration: int, metrics: dict, level_seconds: list[float]) -> str:
    """The one line printed per iteration."""
    return (
        f"iter {iteration}: reward {metrics['charts/reward']:.3f}  root value {metrics['charts/root_value']:.3f}  "
        f"edges {metrics['charts/samples']}  kl/token {metrics.get('losses/kl_per_token', 0):.2e}  "
        f"rollout {metrics['time/rollout_seconds']:.1f}s "
        f"({' / '.join(f'{seconds:.1f}' for seconds in level_seconds)})  update {metrics['time/update_seconds']:.1f}s"
    )


def sample_records(
    iteration: int, trees: list[Node], questions: list, probs: dict[int, list[float]], tokenizer, args: Args
) -> list[dict]:
    """The --save-samples records of the first --save-questions trees (written by write_samples)."""
    return [
        {
            "algorithm": "spo_tree",
            "iteration": iteration,
            "question_index": i,
            "question": questions[i].question,
            "reference": questions[i].answer,
            "prompt": questions[i].prompt,
            "prob_threshold": args.prob_threshold,
            "tree": tree_node_record(tree, None, probs, tokenizer, args.advantage),
        }
        for i, tree in enumerate(trees[: args.save_questions])
    ]


def tree_node_probs(
    model, trees: list[Node], micro_batch_size: int, temperature: float, pad_id: int, precision: Precision
) -> dict[int, list[float]]:
    """p_t of every token of every non-root node of `trees` (zero-advantage nodes too), keyed by id(node): what
    --save-samples shows, computed before the update."""
    nodes = [(tree, node, before) for tree in trees for node, before in walk(tree)]
    samples = [{"prompt_ids": tree.tokens + before, "response_ids": node.tokens} for tree, node, before in nodes]
    logps = sample_logprobs(model, samples, micro_batch_size, temperature, pad_id, precision)
    return {id(node): node_logps.exp().tolist() for (_, node, _), node_logps in zip(nodes, logps)}


def tree_node_record(
    node: Node, node_advantage: float | None, probs: dict[int, list[float]], tokenizer, advantage: str
) -> dict:
    """A saved node and its subtree, as viewer.py reads them: tokens, p_t (`probs`, by id(node)), value,
    `node_advantage` (None for the root), reward and finish reason; its children's advantages by edge_advantages
    with the --advantage baseline `advantage`."""
    ids = node.tokens if node.depth else []  # the root's tokens are the prompt, saved as text
    return {
        "token_ids": ids,
        "tokens": engines.token_pieces(tokenizer, ids),
        "probs": probs[id(node)] if node.depth else [],
        "value": node.value,
        "advantage": node_advantage,
        "reward": node.reward,
        "finish_reason": node.finish_reason,
        "children": [
            tree_node_record(child, child_advantage, probs, tokenizer, advantage)
            for child, child_advantage in zip(node.children, edge_advantages(node, advantage))
        ],
    }


if __name__ == "__main__":
    cli.run_cli(main, cli.parse(Args))
