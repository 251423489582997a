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

Deliberate differences from the paper's released code (kept identical in every script here):
- token-exact: a child continues from its parent's exact token ids; nothing is decoded and re-tokenised;
  EOS is trained;
- unfinished (length-limited) leaves score 0;
- advantages are whitened over the whole iteration batch, not per micro-batch, and the gradient of a
  batch does not depend on how it is split into micro-batches;
- --no-prob-mask removes the mask everywhere (loss and whitening statistics).
Choices the paper leaves open, made here:
- a stop string that straddles a segment boundary ends the response there (the sampler is told how many
  of its prompt tokens the policy generated, and looks for stop strings across them);
- edges wait in the replay buffer for at most --buffer-max-age iterations; an edge taken for training
  leaves the buffer (as in the paper's code), so each edge is trained on in one iteration only, with the
  old log-probs of the policy that generated it;
- every iteration trains on exactly --samples-per-iteration segment samples, as the authors' episode
  generator does (512 MATH, 1024 GSM8K): a random subset of the edges the buffer offers when it offers
  more (the others go back to the buffer, keeping their age), edges repeated at random when it offers
  fewer (a repeat counts once per copy in the whitening and the loss normalisation); 0 trains every
  offered edge once;
- the learning rate schedule advances once per iteration, not per optimizer step: with
  --samples-per-iteration 0 the number of edges, and so of steps, per iteration varies, and an iteration
  without edges still moves the schedule on; with a fixed count the two differ only within an iteration.

  python spo_tree.py                                       # paper long-CoT run: R1-Distill-Qwen-1.5B on MATH, 6-6-6, M=600, 2K context
  python spo_tree.py --model rho-1b-sft-gsm8k --task gsm8k --segment-tokens 30 --questions 16 --samples-per-iteration 1024 \\
      --context 2047 --max-new-tokens 1024 --top-p 0.9 --eval-samples 16 --eval-temperature 0.35 --eval-top-p 0.9   # paper GSM8K run
  python spo_tree.py --model smollm2-135m --task rg:chain_sum:min_terms=2,max_terms=2,max_digits=1 --tree 3,3 \\
      --segment-tokens 16 --iterations 2 --questions 2 --samples-per-iteration 16 --batch-size 8 --micro-batch-size 4 \\
      --max-new-tokens 64 --context 512 --eval-limit 10 --eval-samples 1               # offline CPU
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Literal

import torch
import tqdm
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter
from transformers import Cache, get_linear_schedule_with_warmup

import eval as ev


@dataclass
class Args:
    exp_name: str = "spo_tree"
    """experiment name, part of the run name"""
    seed: int = 1
    """seed of question sampling, rollouts, buffer sampling and initialisation (same seed on CPU gives identical metrics)"""
    model: str = "deepseek-r1-distill-qwen-1.5b"
    """policy to start from: model directory, Hugging Face id or alias (see eval.py)"""
    task: str = "math"
    """training task: gsm8k | math | rg:<reasoning-gym dataset> | path.jsonl"""
    eval_task: str | None = None
    """held-out task (default: math500 for --task math, else the training task's test split)"""
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """rollout engine: hf | vllm | auto (vllm when installed and a GPU is present)"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """matmul precision: auto = bf16 autocast where the device has fast bf16 (CUDA; CPUs with AVX-512 BF16 or
    AMX), else fp32; fp32 master weights always"""
    output_dir: str = "runs"
    """where runs/<run_name>/ (metrics, checkpoint, TensorBoard) are written"""
    resume: str | None = None
    """continue the run in this directory (runs/<run_name>) from its last checkpoint"""
    track: bool = False
    """also log to Weights & Biases"""
    dry_run: bool = False
    """print every setting beside the paper's value (PAPER_SETTINGS) and exit; loads nothing"""

    iterations: int = 1000
    """training iterations (tree rollout + update)"""
    questions: int = 32
    """questions per iteration, one tree each (sampled with replacement)"""
    temperature: float = 0.6
    """sampling temperature; log-probs divide logits by it too"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    max_new_tokens: int = 2048
    """response token budget of a whole root-to-leaf path (the context budget usually binds first)"""
    context: int = 2048
    """total context budget (prompt + response)"""
    lr: float = 1e-6
    """AdamW learning rate (3% linear warmup, then linear decay, stepped once per iteration)"""
    warmup_ratio: float = 0.03
    """fraction of iterations spent warming up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    epochs: int = 1
    """passes over each iteration's edges"""
    batch_size: int = 128
    """sequences (edges) per optimizer step"""
    micro_batch_size: int = 8
    """sequences per forward/backward (memory only: the gradient is the same for any split)"""
    clip_eps: float = 0.2
    """PPO ratio clipping"""
    beta: float = 1e-4
    """k3 KL penalty to the reference model (0 disables the reference model)"""
    fsdp: bool = False
    """under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP2), for models whose
    replica does not fit one GPU; the sampler gathers the whole model while it samples"""
    gradient_checkpointing: bool = False
    """trade compute for memory in the update"""
    eval_every: int = 10
    """evaluate every N iterations (and before the first and after the last)"""
    eval_before: bool = True
    """evaluate the starting model before the first iteration (the closing line's "before"); --no-eval-before
    skips it when that accuracy is already known"""
    eval_limit: int | None = None
    """held-out questions to evaluate on (default: all)"""
    eval_samples: int = 1
    """samples per held-out question (paper long-CoT protocol: 1 at temperature 0.6, top_p 0.95)"""
    eval_temperature: float = 0.6
    """evaluation sampling temperature"""
    eval_top_p: float = 0.95
    """evaluation nucleus threshold"""
    save_every: int = 10
    """checkpoint every N iterations (and after the last)"""
    max_minutes: float | None = None
    """stop after the iteration that ends past this many minutes of training (evaluation not counted), as if it were the last"""
    save_samples: int = 0
    """every N iterations write the first --save-questions questions' trees to runs/<run>/samples/iter_<k>.jsonl for viewer.py (0: never)"""
    save_questions: int = 2
    """questions whose trees --save-samples writes"""
    vllm_gpu_memory_utilization: float = 0.3
    """GPU memory fraction for the vLLM engine"""

    # Algorithm specific
    tree: str = "6,6,6"
    """branch factor per depth, b_0,b_1,...: depth = number of entries (paper: 6,6,6)"""
    segment_tokens: int = 600
    """M: new tokens per segment above the last level (paper: 600 long CoT, 30 GSM8K)"""
    advantage: Literal["rloo", "grpo"] = "rloo"
    """edge advantage: rloo = V(child) - V(parent); grpo = that / (std of the siblings' values + 1e-8)"""
    prob_mask: bool = True
    """train only on tokens with p_t < prob_threshold (--no-prob-mask: every response token)"""
    prob_threshold: float = 0.9
    """probability threshold of the mask"""
    buffer_max_age: int = 8
    """iterations an edge may wait in the replay buffer (1: only this iteration's edges are used)"""
    edges_per_question: int = 32
    """edges taken from the buffer per question per iteration, at random; the rest wait"""
    samples_per_iteration: int = 512
    """segment samples trained on per iteration (paper: 512 MATH, 1024 GSM8K): a random subset of the edges the buffer offers when it offers more (the rest stay in the buffer), edges repeated at random when it offers fewer; 0: every edge the buffer offers, once"""


# The paper's runs of this algorithm (Guo et al. 2025, section 5 and appendix; the authors' released configs).
# Args' defaults are the first run's values. --dry-run prints every setting beside the matching run's values,
# and the README's settings table is generated from this dict (python benchmarks/paper_settings.py --write).
PAPER_SETTINGS = {
    "math": dict(
        model="deepseek-r1-distill-qwen-1.5b", task="math", eval_task="math500", temperature=0.6, top_p=1.0,
        context=2048, eval_samples=1, eval_temperature=0.6, eval_top_p=0.95, questions=32, samples_per_iteration=512,
        epochs=1, batch_size=128, lr=1e-6, warmup_ratio=0.03, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
        beta=1e-4, tree="6,6,6", segment_tokens=600, advantage="rloo", prob_mask=True, prob_threshold=0.9,
        buffer_max_age=8, edges_per_question=32,
    ),
    "gsm8k": dict(
        model="rho-1b-sft-gsm8k", task="gsm8k", eval_task="gsm8k", temperature=0.6, top_p=0.9, max_new_tokens=1024,
        context=2047, eval_samples=16, eval_temperature=0.35, eval_top_p=0.9, questions=16,
        samples_per_iteration=1024, epochs=1, batch_size=128, lr=1e-6, warmup_ratio=0.03, weight_decay=0.0,
        max_grad_norm=1.0, clip_eps=0.2, beta=1e-4, tree="6,6,6", segment_tokens=30, advantage="rloo",
        prob_mask=True, prob_threshold=0.9, buffer_max_age=8, edges_per_question=32,
    ),
}


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
            raise ValueError(f"{spec!r}: branch factor {part!r} at depth {depth} is not a positive integer (write one per depth, e.g. 6,6,6)")
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


def backup_values(root: Node) -> float:
    """Fill every node's value: a leaf's is its reward, an inner node's the mean of its children's values
    (recursive, not leaf-weighted); return the root's value.

    >>> backup_values(Node([0], [Node([1], reward=1.0), Node([2], [Node([3], reward=0.0), Node([4], reward=1.0)])]))
    0.75
    """
    if not root.children:
        if root.reward is None:
            raise ValueError(f"leaf at depth {root.depth} has no reward")
        root.value = float(root.reward)
    else:
        root.value = sum(backup_values(child) for child in root.children) / len(root.children)
    return root.value


def edge_advantages(parent: Node, advantage: str = "rloo") -> list[float]:
    """Advantage of each child of `parent` (values already backed up): "rloo" V(child) - V(parent),
    "grpo" that / (population std of the children's values + 1e-8).

    >>> edge_advantages(Node([0], [Node([1], value=1.0), Node([2], value=0.0)], value=0.5))
    [0.5, -0.5]
    """
    scale = statistics.pstdev([child.value for child in parent.children]) + 1e-8 if advantage == "grpo" and parent.children else 1.0
    return [(child.value - parent.value) / scale for child in parent.children]


def tree_segments(root: Node, advantage: str = "rloo") -> list[tuple[list[int], list[int], float]]:
    """Training samples of a tree: (query ids, segment ids, advantage) per non-root node, depth-first pre-order
    (a node, then its subtree, then its next sibling). Calls backup_values.

    query = root.tokens + the ancestors' segments; advantage "rloo" = V(node) - V(parent), "grpo" = that
    / (population std of the node and its siblings' values + 1e-8). Edges with advantage exactly 0 are
    dropped: siblings that agree carry no signal.

    >>> root = Node([9], [Node([1], reward=1.0), Node([2], [Node([3], reward=0.0), Node([4], reward=1.0)])])
    >>> tree_segments(root)
    [([9], [1], 0.25), ([9], [2], -0.25), ([9, 2], [3], -0.5), ([9, 2], [4], 0.5)]
    """
    if advantage not in ADVANTAGES:
        raise ValueError(f"unknown advantage {advantage!r}: use {' or '.join(ADVANTAGES)}")
    backup_values(root)
    segments = []

    def visit(node: Node, query: list[int]) -> None:
        for child, edge_advantage in zip(node.children, edge_advantages(node, advantage)):
            if edge_advantage != 0:
                segments.append((list(query), list(child.tokens), edge_advantage))
            visit(child, query + child.tokens)

    visit(root, list(root.tokens))
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
    """Replay-buffer edges of one iteration's trees (tree_segments of each, with the question's index and the
    iteration it was born in) and the number of edges with a non-zero advantage. An empty segment (a stop
    string that began in the parent's segment) has no token to train and makes no edge, but is counted.

    >>> tree = Node([9], [Node([1], reward=1.0), Node([2], reward=0.0)])
    >>> edges, nonzero = tree_edges([tree], [7], iteration=3, advantage="rloo")
    >>> [(e["question"], e["born"], e["prompt_ids"], e["response_ids"], e["advantage"]) for e in edges], nonzero
    ([(7, 3, [9], [1], 0.5), (7, 3, [9], [2], -0.5)], 2)
    """
    edges, nonzero = [], 0
    for question_id, tree in zip(question_ids, trees):
        segments = tree_segments(tree, advantage)
        nonzero += len(segments)
        edges += [
            {"question": question_id, "born": iteration, "prompt_ids": query, "response_ids": segment, "advantage": edge_advantage}
            for query, segment, edge_advantage in segments if segment
        ]
    return edges, nonzero


def sample_buffer(
    buffer: list[dict], iteration: int, max_age: int, per_question: int, rng: random.Random
) -> tuple[list[dict], list[dict]]:
    """Replay buffer step: drop edges older than `max_age` iterations, then take at most `per_question`
    random edges per question. Returns (taken, remaining); taken edges leave the buffer.

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
        return samples, sorted(remaining + returned, key=lambda edge: edge["born"])  # stable: both lists are oldest first
    return taken + [rng.choice(taken) for _ in range(n - len(taken))], remaining


def loss_mask(
    response_mask: torch.Tensor, probs: torch.Tensor, threshold: float, prob_mask: bool, all_sum: Callable = lambda x: x,
) -> torch.Tensor:
    """Tokens that count in the loss: response tokens, and with the probability mask only those with p_t < threshold.

    Falls back to all response tokens when no token of the batch is below the threshold. `all_sum` sums a tensor
    over the processes that share the batch (ev.all_sum under torchrun; the identity in one process).

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


def whiten(advantages: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, all_sum: Callable = lambda x: x) -> torch.Tensor:
    """Shift and scale advantages to mean 0, std 1 over the masked tokens (std with ddof 0); unmasked tokens are
    shifted and scaled too, but do not count in the statistics. No masked token at all: returned unchanged.
    `all_sum` sums a tensor over the processes that share the batch (ev.all_sum under torchrun), so the
    statistics are those of the whole batch.

    >>> whiten(torch.tensor([1., 3., 5., 100.]), torch.tensor([True, True, True, False]))
    tensor([-1.2247,  0.0000,  1.2247, 59.4001])
    """
    count, total = all_sum(torch.stack([mask.sum().to(advantages.dtype), (advantages * mask).sum()]))
    if count == 0:
        return advantages
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

    Normalised by the whole batch's masked-token count (`batch_tokens`) and sequence count
    (`batch_sequences`), so summing micro-batch losses gives the batch loss whatever the split.
    KL: k3 = exp(d) - d - 1 with d = ref - logp, summed over a sequence's masked tokens, mean over sequences.
    Both log-ratios are clamped to [-10, 10] (as in the authors' code): a token the policy has nearly ruled out
    would otherwise make exp() overflow to inf and the whole update non-finite.

    Token 0 doubled its probability (ratio 2, clipped to 1.2 for a positive advantage); token 1 did not move:
    pg_loss = -(1.2 * 1 + 1 * -1) / 2 tokens = -0.1; kl = exp(log 0.5) - log 0.5 - 1 = 0.1931 (token 1 adds 0).

    >>> old = torch.log(torch.tensor([[0.25, 0.5]]))
    >>> loss, stats = policy_loss(torch.log(torch.tensor([[0.5, 0.5]])), old, old, torch.tensor([[1.0, -1.0]]),
    ...                           torch.tensor([[True, True]]), clip_eps=0.2, beta=0.1, batch_tokens=2, batch_sequences=1)
    >>> round(loss.item(), 4), {key: round(value, 4) for key, value in stats.items()}
    (-0.0807, {'pg_loss': -0.1, 'kl': 0.1931, 'clip_count': 1.0})
    """
    mask = mask.float()
    ratio = torch.exp(torch.clamp(logps - old_logps, -10.0, 10.0))  # [rows, T]
    surrogate = torch.min(ratio * advantages, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages)
    pg_loss = -(surrogate * mask).sum() / batch_tokens
    log_ref_ratio = torch.clamp(ref_logps - logps, -10.0, 10.0)  # [rows, T]
    kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # [rows, T], k3 estimator: unbiased, always >= 0
    kl_loss = (kl * mask).sum() / batch_sequences
    clipped = ((ratio - 1).abs() > clip_eps).float()
    stats = {"pg_loss": pg_loss.item(), "kl": kl_loss.item(), "clip_count": (clipped * mask).sum().item()}
    return pg_loss + beta * kl_loss, stats


# ----------------------------------------------------------------------------------------------
# Rollout: grow the trees level by level, grade the leaves


def grow_trees(
    sampler, prompts: list[list[int]], branches: list[int], *, segment_tokens: int, max_new_tokens: int,
    context: int, temperature: float, top_p: float, stop: list[str],
) -> tuple[list[Node], list[float]]:
    """One tree per prompt, grown level by level with one batched sampler call per level across all trees.

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
        started, last = time.time(), depth == len(branches) - 1
        generated = depth * segment_tokens  # every open node's path holds exactly `depth` full segments
        groups = sampler.sample(
            [prompt + path for _, prompt, path in frontier], branch, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens - generated if last else segment_tokens, stop=stop, context=context,
            progress=f"level {depth + 1}/{len(branches)}",
            generated=[len(path) for _, _, path in frontier],  # a stop string may begin in an ancestor's segment
        )
        next_frontier = []
        for (parent, prompt, path), completions in zip(frontier, groups):
            for completion in completions:
                ids, finish = completion.ids, completion.finish_reason  # empty when a stop string began in the path
                child = Node(tokens=list(ids), finish_reason=finish, depth=depth + 1)
                parent.children.append(child)
                room = context - len(prompt) - len(path) - len(ids)
                if not last and finish == "length" and len(ids) == segment_tokens and room > 0:
                    next_frontier.append((child, prompt, path + child.tokens))
        frontier = next_frontier
        seconds.append(time.time() - started)
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
        scores = ev.grade([text for _, text, _ in finished], [answer for _, _, answer in finished], task)
        for (node, _, _), score in zip(finished, scores):
            node.reward = score


# ----------------------------------------------------------------------------------------------
# Training helpers: batching, log-probs, one optimizer step


def micro_batches(samples: list[dict], micro_batch_size: int) -> list[list[int]]:
    """Indices of `samples` in micro-batches that compute few positions. A micro-batch costs a forward pass of each
    distinct prompt in it (left-padded to the longest) and of each response (right-padded to the longest), see
    response_logprobs. Two orders are cut into micro-batches and the cheaper split is kept: by length (response,
    then prompt: least padding) and by prompt (the rows of a prompt together, prompts ordered by their longest
    response: each prompt runs once for all its rows). Neither log-probs nor the gradient depend on the split: the
    losses are normalised by the whole batch's counts.

    >>> micro_batches([{"prompt_ids": [1], "response_ids": [2] * n} for n in (5, 1, 4, 2)], 2)
    [[1, 3], [2, 0]]
    >>> micro_batches([{"prompt_ids": [p] * 8, "response_ids": [2] * n} for p, n in ((1, 1), (2, 2), (1, 3), (2, 4))], 2)
    [[0, 2], [1, 3]]
    """
    prompts = [tuple(s["prompt_ids"]) for s in samples]
    lengths = [len(s["response_ids"]) for s in samples]
    longest = {}  # prompt -> its longest response
    for prompt, length in zip(prompts, lengths):
        longest[prompt] = max(longest.get(prompt, 0), length)

    def split(order: list[int]) -> list[list[int]]:
        return [order[start : start + micro_batch_size] for start in range(0, len(order), micro_batch_size)]

    def positions(micro: list[int]) -> int:  # distinct prompts x longest prompt + rows x longest response
        distinct = {prompts[i] for i in micro}
        return len(distinct) * max(map(len, distinct)) + len(micro) * max(lengths[i] for i in micro)

    by_length = sorted(range(len(samples)), key=lambda i: (lengths[i], len(prompts[i])))
    by_prompt = sorted(range(len(samples)), key=lambda i: (longest[prompts[i]], prompts[i], lengths[i]))
    return min(split(by_length), split(by_prompt), key=lambda micros: sum(map(positions, micros)))


def collate(samples: list[dict], pad_id: int, device) -> dict:
    """Pad a list of samples into tensors: prompts left-padded, responses right-padded, so every
    response starts at the same column and only the last R+1 logits are needed. Each distinct prompt
    is also padded once (prompt_ids, prompt_mask), with the one each row continues (prompt_of_row)."""
    prompt_len = max(len(s["prompt_ids"]) for s in samples)
    response_len = max(1, max(len(s["response_ids"]) for s in samples))
    prompts = list(dict.fromkeys(tuple(s["prompt_ids"]) for s in samples))  # distinct, in order of first use
    prompt_index = {p: i for i, p in enumerate(prompts)}
    input_ids, attention, response_mask = [], [], []
    for s in samples:
        p, r = s["prompt_ids"], s["response_ids"]
        left, right = prompt_len - len(p), response_len - len(r)
        input_ids.append([pad_id] * left + p + r + [pad_id] * right)
        attention.append([0] * left + [1] * (len(p) + len(r)) + [0] * right)
        response_mask.append([True] * len(r) + [False] * right)
    batch = {
        "input_ids": torch.tensor(input_ids, device=device),  # [rows, P + R]
        "attention_mask": torch.tensor(attention, device=device),  # [rows, P + R]
        "response_mask": torch.tensor(response_mask, device=device),  # [rows, R]; EOS included when sampled
        "prompt_ids": torch.tensor([[pad_id] * (prompt_len - len(p)) + list(p) for p in prompts], device=device),  # [prompts, P]
        "prompt_mask": torch.tensor([[0] * (prompt_len - len(p)) + [1] * len(p) for p in prompts], device=device),  # [prompts, P]
        "prompt_of_row": torch.tensor([prompt_index[tuple(s["prompt_ids"])] for s in samples], device=device),  # [rows]
    }
    batch["positions"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # [rows, P + R]; position ids skip the padding
    batch["prompt_positions"] = (batch["prompt_mask"].cumsum(-1) - 1).clamp(min=0)  # [prompts, P]
    for key in ("old_logps", "ref_logps", "advantages", "loss_mask"):
        if key in samples[0]:
            batch[key] = torch.nn.utils.rnn.pad_sequence([s[key] for s in samples], batch_first=True).to(device)[:, :response_len]
    return batch


def token_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(lm_head(hidden) / temperature) at the target ids: [tokens, hidden], [tokens] -> [tokens]."""
    logits = lm_head(hidden).float() / temperature  # [tokens, vocab]
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)  # [tokens]


def last_hidden_state(model, **inputs) -> tuple[torch.Tensor, Cache | None]:
    """One forward pass without the LM head: the final hidden states [rows, positions, hidden] and, with
    use_cache=True, the KV cache (holding the positions of `cache=`, when given, before these)."""
    if ev.is_sharded(model):  # --fsdp: only the whole model's forward gathers the embeddings and the LM head
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1], out.cache  # hidden_states[-1] is after the final norm
    out = model.base_model(**inputs)
    return out.last_hidden_state, out.cache


def response_logprobs(
    model, batch: dict, temperature: float, chunk_tokens: int = 512, recompute_above: int = 2**28
) -> torch.Tensor:
    """log pi(y_t | prompt, y_<t) of every response token, with logits divided by the sampling temperature
    so that exp(logp) is the probability the sampler used.

    Rows with the same prompt (the sibling segments of a tree node) share one forward pass of it: each distinct prompt runs once,
    its keys and values are repeated for its rows, and the responses run on top of them. The gradient flows back
    through the shared keys and values: it is the sum over the rows, the same as from a forward pass per row.
    (Under activation checkpointing, whose layers take no KV cache in a pass with gradients, every row runs its
    prompt itself.)

    The LM head runs on chunks of `chunk_tokens` response positions. When the micro-batch's fp32 logits would
    hold more than `recompute_above` entries (2**28: 1 GiB), each chunk is recomputed in the backward pass, so
    the [rows, R, vocab] logits (8 x 2048 x 151,936 x 4 bytes = 10 GB for a Qwen long-CoT micro-batch) never
    exist at once; smaller logits (16 x 128 x 49,152 x 4 bytes = 0.4 GB for SmolLM2) are kept for the backward
    pass, which saves a second LM-head pass. Either way the result is the same as from the model's full logits.
    """
    response_len, prompt_len = batch["response_mask"].shape[1], batch["prompt_ids"].shape[1]
    # fp32 weights (a 1e-6 step vanishes in bf16); bf16 compute where ev.set_precision chose it.
    with ev.autocast(model.device.type):
        # layers checkpointed for this backward pass take no KV cache: prompt and response in one pass
        if model.is_activation_checkpointing and model.training and torch.is_grad_enabled():
            hidden, _ = last_hidden_state(
                model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["positions"],
                use_cache=False,
            )
            hidden = hidden[:, prompt_len - 1 : -1]  # [rows, R, hidden]; position t-1 predicts y_t
        else:
            prompt_hidden, cache = last_hidden_state(
                model, input_ids=batch["prompt_ids"], attention_mask=batch["prompt_mask"], position_ids=batch["prompt_positions"],
                use_cache=True,
            )  # [prompts, P, hidden]
            cache.batch_select_indices(batch["prompt_of_row"])  # [prompts, ...] -> [rows, ...]: each row's prompt keys and values
            response_hidden, _ = last_hidden_state(
                model, input_ids=batch["input_ids"][:, prompt_len:], attention_mask=batch["attention_mask"],
                position_ids=batch["positions"][:, prompt_len:], cache=cache, use_cache=True,
            )  # [rows, R, hidden]
            # position t-1 predicts y_t: the prompt's last position predicts y_0
            hidden = torch.cat([prompt_hidden[batch["prompt_of_row"], -1:], response_hidden[:, :-1]], dim=1)  # [rows, R, hidden]
        targets = batch["input_ids"][:, prompt_len:]  # [rows, R]
        rows, lm_head = hidden.shape[0], model.get_output_embeddings()
        recompute = torch.is_grad_enabled() and rows * response_len * lm_head.out_features > recompute_above
        chunks = zip(hidden.flatten(0, 1).split(chunk_tokens), targets.flatten().split(chunk_tokens))
        logps = [
            checkpoint(token_logprobs, lm_head, h, t, temperature, use_reentrant=False) if recompute
            else token_logprobs(lm_head, h, t, temperature)
            for h, t in chunks
        ]
    return torch.cat(logps).view(rows, response_len)  # [rows, R]


@torch.no_grad()
def sample_logprobs(model, samples: list[dict], micro_batch_size: int, temperature: float, pad_id: int) -> list[torch.Tensor]:
    """Per-sample response log-probs (1-D CPU tensors) without gradients, in micro-batches."""
    was_training = model.training
    model.eval()
    out: list[torch.Tensor] = [None] * len(samples)
    for indices in micro_batches(samples, micro_batch_size):
        logps = response_logprobs(model, collate([samples[i] for i in indices], pad_id, model.device), temperature).cpu()
        for i, row in zip(indices, logps):
            out[i] = row[: len(samples[i]["response_ids"])]
    model.train(was_training)
    return out


def attach_targets(
    samples: list[dict], reference, *, device, micro_batch_size: int, temperature: float, pad_id: int,
    prob_threshold: float, prob_mask: bool,
) -> None:
    """Set what the loss needs on every sample: "ref_logps" (the frozen reference model's log-probs; the old ones
    when there is no reference model, beta = 0), "loss_mask" (response tokens, with the probability mask only
    those with p_t < prob_threshold) and "advantages" (the edge's advantage on each token, whitened over the
    masked tokens of all samples, of every rank under torchrun). A sample listed twice (fill_samples) counts twice
    in the whitening."""
    edges = list({id(s): s for s in samples}.values())  # each edge once: a repeat is the same dict
    for s in edges:
        s["ref_logps"] = s["old_logps"]
    if reference is not None:  # parked on the CPU the rest of the time
        reference.to(device)
        for s, logps in zip(edges, sample_logprobs(reference, edges, micro_batch_size, temperature, pad_id)):
            s["ref_logps"] = logps
        reference.to("cpu")
    lengths = [len(s["response_ids"]) for s in samples]
    flat_probs = torch.cat([s["old_logps"] for s in samples] or [torch.zeros(0)]).exp()  # [tokens], p_t of every response token
    flat_mask = loss_mask(torch.ones_like(flat_probs, dtype=torch.bool), flat_probs, prob_threshold, prob_mask, all_sum=ev.all_sum)
    flat_advantages = torch.repeat_interleave(torch.tensor([s["advantage"] for s in samples]), torch.tensor(lengths, dtype=torch.long))
    flat_advantages = whiten(flat_advantages, flat_mask, all_sum=ev.all_sum)  # over the whole iteration batch's masked tokens
    for s, mask, advantage in zip(samples, flat_mask.split(lengths), flat_advantages.split(lengths)):
        s["loss_mask"], s["advantages"] = mask, advantage


def accumulate_gradients(
    model, batch_samples: list[dict], *, micro_batch_size: int, temperature: float, clip_eps: float, beta: float, pad_id: int,
    all_sum: Callable = lambda x: x,
) -> dict:
    """Forward/backward one optimizer batch in micro-batches; gradients add up to the full-batch gradient.
    Under torchrun each rank passes its share of the batch (possibly none) and `all_sum=ev.all_sum`: the loss is
    normalised by the whole batch's counts, so the ranks' gradients (and stats) sum to those of the whole batch."""
    counts = all_sum(torch.tensor([sum(int(s["loss_mask"].sum()) for s in batch_samples), len(batch_samples)]))
    batch_tokens, batch_sequences = max(1, int(counts[0])), int(counts[1])
    stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_count": 0.0}
    for indices in micro_batches(batch_samples, micro_batch_size):
        batch = collate([batch_samples[i] for i in indices], pad_id, model.device)
        logps = response_logprobs(model, batch, temperature)
        loss, micro = policy_loss(
            logps, batch["old_logps"], batch["ref_logps"], batch["advantages"], batch["loss_mask"],
            clip_eps, beta, batch_tokens, batch_sequences,
        )
        loss.backward()
        stats["loss"] += loss.item()
        for key in micro:
            stats[key] += micro[key]
    stats["clip_frac"] = stats.pop("clip_count") / batch_tokens
    return stats


# ----------------------------------------------------------------------------------------------
# Checkpoints and saved samples


def write_samples(path: Path, records: list[dict]) -> None:
    """One JSON record per line (the format viewer.py reads); floats rounded to keep the files small."""
    def rounded(value):
        if isinstance(value, float):
            return round(value, 5)
        if isinstance(value, list):
            return [rounded(v) for v in value]
        if isinstance(value, dict):
            return {key: rounded(v) for key, v in value.items()}
        return value

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(rounded(r)) + "\n" for r in records))


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, scheduler, iteration: int, buffer: list[dict]) -> Path:
    """Write runs/<run>/checkpoint atomically: a SIGKILL mid-save leaves the previous checkpoint intact.
    The replay buffer is saved with the optimizer: a resumed run trains on the same edges."""
    final, staging, previous = run_dir / "checkpoint", run_dir / "checkpoint.new", run_dir / "checkpoint.old"
    weights, optimizer_state = ev.full_state_dict(model), ev.optimizer_state(model, optimizer)
    if ev.rank() > 0:  # every rank calls this (with --fsdp the shards are gathered); rank 0 writes
        return final
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, state_dict=weights)
    tokenizer.save_pretrained(staging)
    torch.save(
        {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "iteration": iteration, "buffer": buffer,
         "world_size": ev.world_size()},
        staging / "trainer_state.pt",
    )
    if final.exists():
        final.rename(previous)
    staging.rename(final)
    shutil.rmtree(previous, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest whole checkpoint: checkpoint/, else checkpoint.old/ (killed between the two renames, or damaged)."""
    damaged = []
    for candidate in (run_dir / "checkpoint", run_dir / "checkpoint.old"):
        if (candidate / "trainer_state.pt").exists():
            problem = ev.checkpoint_problem(candidate)
            if problem is None:
                if damaged:
                    warnings.warn(f"{damaged[0]}; resuming from {candidate} instead")
                return candidate
            damaged.append(problem)
    if damaged:
        raise ev.UsageError(f"--resume {run_dir}: {'; '.join(damaged)}, and no intact checkpoint is left; start a new run")
    return None


# ----------------------------------------------------------------------------------------------
# Main loop


def validate(args: Args) -> list[int]:
    """Check the configuration; return the branch factors of --tree."""
    problems, branches = ev.setting_problems(args), []  # the settings every script shares first
    try:
        branches = parse_tree(args.tree)
    except ValueError as error:
        problems.append(f"--tree {error}")
    if args.questions < 1 or args.iterations < 1 or args.epochs < 1:
        problems.append("--questions, --iterations and --epochs must be positive")
    if args.micro_batch_size < 1 or args.batch_size < args.micro_batch_size or args.batch_size % args.micro_batch_size:
        problems.append(f"--batch-size ({args.batch_size}) must be a positive multiple of --micro-batch-size ({args.micro_batch_size})")
    if args.context <= 0 or args.max_new_tokens <= 0 or args.temperature <= 0:
        problems.append("--context, --max-new-tokens and --temperature must be positive")
    if args.segment_tokens < 1:
        problems.append("--segment-tokens must be positive")
    elif branches and (len(branches) - 1) * args.segment_tokens >= min(args.max_new_tokens, args.context):
        problems.append(
            f"--tree {args.tree} with --segment-tokens {args.segment_tokens} generates {(len(branches) - 1) * args.segment_tokens} tokens "
            f"before its last level, leaving no room within --max-new-tokens and --context: raise them or lower --segment-tokens"
        )
    if args.advantage not in ADVANTAGES:
        problems.append(f"--advantage must be {' or '.join(ADVANTAGES)}, not {args.advantage!r}")
    if args.buffer_max_age < 1 or args.edges_per_question < 1:
        problems.append("--buffer-max-age and --edges-per-question must be positive")
    if args.samples_per_iteration < 0:
        problems.append(f"--samples-per-iteration ({args.samples_per_iteration}) must be at least 0 (0: every edge the buffer offers)")
    if (args.max_minutes is not None and args.max_minutes <= 0) or args.save_samples < 0 or args.save_questions < 1:
        problems.append("--max-minutes must be positive, --save-samples at least 0 and --save-questions at least 1")
    # --fsdp: every rank must run as many forward/backward passes as the others (each gathers shards), so each trains
    # an equal share of exactly --samples-per-iteration samples.
    per_rank = {"--questions": args.questions, "--batch-size": args.batch_size}
    if args.fsdp:
        if args.samples_per_iteration == 0:
            problems.append("--fsdp needs a fixed --samples-per-iteration (not 0): every rank must train an equal share")
        per_rank["--samples-per-iteration"] = args.samples_per_iteration
    problems += ev.world_size_problems(args, per_rank=per_rank)
    if problems:
        raise ev.UsageError("; ".join(problems))
    return branches


def open_run(args: Args) -> tuple[Path, Path | None]:
    """The run directory (new, or --resume's) and its newest intact checkpoint (None: start over); writes
    args.json and records the start in the run."""
    if args.resume:
        run_dir = Path(args.resume)
        checkpoint = latest_checkpoint(run_dir)  # None: stopped before its first checkpoint, so it starts over
        if checkpoint is None and not (run_dir / "args.json").exists():
            raise ev.UsageError(f"--resume {run_dir}: no checkpoint found there (expected {run_dir}/checkpoint/trainer_state.pt)")
        ev.check_resume_settings(args, run_dir)  # the run owns its settings; only RESUMABLE_SETTINGS may change
        if checkpoint is not None:
            ev.check_world_size(checkpoint)  # each rank's questions and seeds depend on it
    else:
        run_name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{args.task}__{args.exp_name}__{args.seed}__{int(time.time())}")
        run_dir, checkpoint = ev.broadcast(Path(args.output_dir) / run_name), None  # rank 0's clock names the run
    if ev.rank() == 0:  # under torchrun rank 0 writes the run's files; the others read the same directory
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "args.json").write_text(json.dumps(asdict(args), indent=1))
        ev.record_start(run_dir, resumed=bool(args.resume))
    ev.barrier()
    return run_dir, checkpoint


def load_models(args: Args, checkpoint: Path | None, device: str) -> tuple:
    """The policy (from the checkpoint when resuming, fp32 master weights), its tokenizer and the frozen
    reference model (the starting model, parked on the CPU except while its log-probs are computed; None when
    beta = 0)."""
    model, tokenizer = ev.load_model(str(checkpoint) if checkpoint else args.model, dtype=torch.float32, device=device)
    ev.check_logits_from_hidden(model)  # response_logprobs applies the LM head itself
    reference = None
    if args.beta > 0:
        reference, _ = ev.load_model(args.model, dtype=model.dtype, device="cpu")
        reference.requires_grad_(False)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()
    if args.fsdp:
        ev.fully_shard_model(model)  # the reference stays whole, parked on the CPU
    return model, tokenizer, reference


def load_examples(args: Args, eval_task: str, tokenizer) -> tuple[list, list]:
    """Training and held-out questions with their prompts. A prompt that leaves no room for a response within
    --context is dropped from training but kept (scoring 0) in evaluation, which keeps its denominator."""
    train_examples = ev.load_task(args.task, "train", seed=args.seed, tokenizer=tokenizer)
    eval_examples = ev.load_task(eval_task, "test", limit=args.eval_limit, seed=args.seed, tokenizer=tokenizer)
    train_examples = ev.check_prompt_room(train_examples, args.context, f"--task {args.task}", drop=True)
    eval_examples = ev.check_prompt_room(eval_examples, args.context, f"--eval-task {eval_task}", drop=False)
    return train_examples, eval_examples


def make_optimizer(args: Args, model, checkpoint: Path | None) -> tuple:
    """AdamW and its schedule (--warmup-ratio linear warmup, then linear decay, stepped once per iteration),
    restored from the checkpoint when resuming; returns (optimizer, scheduler, first iteration to run, replay
    buffer: the edges waiting to be trained on, oldest first)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * args.iterations), args.iterations)
    if checkpoint is None:
        return optimizer, scheduler, 1, []
    # On the CPU: the buffer's log-probs stay there with the new edges'; the optimizer moves its state to the parameters.
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
    ev.load_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return optimizer, scheduler, state["iteration"] + 1, state["buffer"]


class RunLog:
    """The run's metrics: runs/<run>/metrics.jsonl (one line per iteration and per evaluation), TensorBoard, and
    Weights & Biases with --track. Lines of iterations >= start_iteration are dropped (they will be redone), and
    `train_seconds` continues from the kept lines."""

    def __init__(self, run_dir: Path, start_iteration: int, args: Args):
        self.path, self.train_seconds, self.writer, self.wandb = run_dir / "metrics.jsonl", 0.0, None, None
        if ev.rank() > 0:  # under torchrun only rank 0 logs (the metrics are already reduced over ranks)
            return
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        kept = [line for line in lines if json.loads(line)["iteration"] < start_iteration]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.train_seconds = max([json.loads(line).get("time/train_seconds", 0.0) for line in kept], default=0.0)
        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        if args.track:
            import wandb

            wandb.init(project="spo", name=run_dir.name, config=asdict(args), dir=str(run_dir), resume="allow")
            self.wandb = wandb

    def write(self, iteration: int, metrics: dict) -> None:
        if self.writer is None:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"iteration": iteration, **metrics}) + "\n")
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, iteration)
        if self.wandb is not None:
            self.wandb.log(metrics, step=iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def evaluate_policy(model, tokenizer, sampler, eval_task: str, eval_examples: list, args: Args) -> dict:
    """Held-out accuracy of the current policy (--eval-samples per question), as eval/... metrics."""
    result = ev.evaluate(
        model, tokenizer, eval_task, examples=eval_examples, samples=args.eval_samples,
        temperature=args.eval_temperature, top_p=args.eval_top_p, max_new_tokens=args.max_new_tokens,
        context=args.context, sampler=sampler, seed=args.seed,
    )
    return {"eval/accuracy": result["accuracy"], f"eval/pass@{args.eval_samples}": result[f"pass@{args.eval_samples}"],
            "eval/majority_accuracy": result["majority_accuracy"], "eval/truncation_rate": result["truncation_rate"]}


def reseed(seed: int, iteration: int, sampler) -> random.Random:
    """Seed torch and the sampler from (seed, iteration, rank) and return the iteration's random.Random (questions,
    buffer; the same on every rank): a resumed run samples exactly what the uninterrupted one would (at the same
    world size)."""
    iteration_seed = seed * 1_000_003 + iteration
    rank_seed = iteration_seed + (ev.rank() << 32)  # rank 0: the seed of a single-process run
    torch.manual_seed(rank_seed)
    if hasattr(sampler, "generator"):
        sampler.generator.manual_seed(rank_seed)
    return random.Random(iteration_seed)


def node_probs(model, trees: list[Node], micro_batch_size: int, temperature: float, pad_id: int) -> dict[int, list[float]]:
    """p_t of every token of every non-root node of `trees` (zero-advantage nodes too), keyed by id(node): what
    --save-samples shows, computed before the update."""
    nodes = [(tree, node, before) for tree in trees for node, before in walk(tree)]
    logps = sample_logprobs(
        model, [{"prompt_ids": tree.tokens + before, "response_ids": node.tokens} for tree, node, before in nodes],
        micro_batch_size, temperature, pad_id,
    )
    return {id(node): node_logps.exp().tolist() for (_, node, _), node_logps in zip(nodes, logps)}


def skipped_non_finite(stats: dict, iteration: int, streak: list[int]) -> bool:
    """True when a batch's loss is not finite (its update is skipped); `streak` counts such batches in a row,
    across iterations, and the third ends the run."""
    if math.isfinite(stats["loss"]):
        streak[0] = 0
        return False
    streak[0] += 1
    warnings.warn(f"iteration {iteration}: non-finite loss, update skipped")
    if streak[0] >= 3:
        raise ev.UsageError("three non-finite losses in a row: lower --lr, or check the model and data")
    return True


def update_policy(model, optimizer, scheduler, samples: list[dict], args: Args, pad_id: int, iteration: int, streak: list[int]) -> list[dict]:
    """--epochs passes over the samples in shuffled batches of --batch-size, each accumulated in micro-batches
    and clipped into one optimizer step; then one scheduler step. Returns the stats of the steps taken.
    Under torchrun `samples` is this rank's share: every rank takes the steps the whole iteration's samples make,
    each with --batch-size / world size of its own (the last ones possibly none), and the gradients are summed."""
    model.train()
    model_stats, batch_size = [], args.batch_size // ev.world_size()  # this rank's share of each batch
    steps = math.ceil(int(ev.all_sum(torch.tensor(len(samples)))) / args.batch_size)  # per epoch, the same on every rank
    for _ in range(args.epochs):
        order = torch.randperm(len(samples)).tolist()
        for start in range(0, steps * batch_size, batch_size):
            optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                model, [samples[i] for i in order[start : start + batch_size]], micro_batch_size=args.micro_batch_size,
                temperature=args.temperature, clip_eps=args.clip_eps, beta=args.beta, pad_id=pad_id, all_sum=ev.all_sum,
            )
            stats = ev.sum_over_ranks(stats)  # every rank takes the same decision below
            if skipped_non_finite(stats, iteration, streak):
                continue
            ev.all_reduce_gradients(model)
            stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            optimizer.step()
            model_stats.append(stats)
    optimizer.zero_grad(set_to_none=True)
    # Once per iteration, not per step: one rule whether the number of steps varies (--samples-per-iteration 0) or not.
    with warnings.catch_warnings():  # an iteration without edges makes no optimizer step; the schedule still advances
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()
    return model_stats


def iteration_metrics(
    iteration: int, trees: list[Node], samples: list[dict], buffer: list[dict], loss_masks: list[torch.Tensor], *, nonzero_edges: int,
    model_stats: list[dict], lr: float, level_seconds: list[float], rollout_seconds: float, update_seconds: float,
    iteration_seconds: float, train_seconds: float,
) -> dict:
    """The iteration's metrics: the trees (rewards, shape), the samples trained on and their loss masks, the buffer,
    the losses and times."""
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
        "charts/tokens_per_second": generated / max(rollout_seconds, 1e-9),
        "charts/loss_mask_fraction": torch.cat(loss_masks).float().mean().item() if loss_masks else 0.0,
        "tree/nodes": len(nodes) / len(trees),
        "tree/leaves": len(leaves) / len(trees),
        "buffer/size": len(buffer),
        "buffer/mean_age": sum(iteration - edge["born"] for edge in buffer) / max(1, len(buffer)),
        "buffer/taken_mean_age": sum(iteration - s["born"] for s in samples) / max(1, len(samples)),
        "time/rollout_seconds": rollout_seconds,
        "time/update_seconds": update_seconds,
        "time/iteration_seconds": iteration_seconds,  # without evaluation and checkpoint
        "time/train_seconds": train_seconds,
    }
    for depth in range(1, len(level_seconds)):  # one entry per tree level
        metrics[f"tree/early_leaves_depth{depth}"] = sum(leaf.depth == depth and leaf.finish_reason == "stop" for leaf in leaves) / len(trees)
    for depth, seconds in enumerate(level_seconds, 1):
        metrics[f"time/level{depth}_seconds"] = seconds
    for key in ("loss", "pg_loss", "kl", "clip_frac", "grad_norm"):
        if model_stats:
            metrics[f"losses/{key}"] = sum(step[key] for step in model_stats) / len(model_stats)
    return metrics


def progress_line(iteration: int, metrics: dict, level_seconds: list[float]) -> str:
    """The one line printed per iteration."""
    return (
        f"iter {iteration}: reward {metrics['charts/reward']:.3f}  root value {metrics['charts/root_value']:.3f}  "
        f"edges {metrics['charts/samples']}  kl {metrics.get('losses/kl', 0):.2e}  rollout {metrics['time/rollout_seconds']:.1f}s "
        f"({' / '.join(f'{seconds:.1f}' for seconds in level_seconds)})  update {metrics['time/update_seconds']:.1f}s"
    )


def node_record(node: Node, advantage: float | None, probs: dict[int, list[float]], tokenizer, advantage_kind: str) -> dict:
    """A saved tree node and its subtree, as viewer.py reads them: tokens, p_t (`probs`, by id(node)), value,
    `advantage` (None for the root; its children's by `advantage_kind`, rloo or grpo), reward and finish reason."""
    ids = node.tokens if node.depth else []  # the root's tokens are the prompt, saved as text
    return {
        "token_ids": ids, "tokens": ev.token_pieces(tokenizer, ids),
        "probs": probs[id(node)] if node.depth else [], "value": node.value, "advantage": advantage,
        "reward": node.reward, "finish_reason": node.finish_reason,
        "children": [
            node_record(child, child_advantage, probs, tokenizer, advantage_kind)
            for child, child_advantage in zip(node.children, edge_advantages(node, advantage_kind))
        ],
    }


def sample_records(iteration: int, trees: list[Node], questions: list, probs: dict[int, list[float]], tokenizer, args: Args) -> list[dict]:
    """The --save-samples records of the first --save-questions trees (written by write_samples)."""
    return [
        {
            "algorithm": "spo_tree", "iteration": iteration, "question_index": i, "question": questions[i].question,
            "reference": questions[i].answer, "prompt": questions[i].prompt, "prob_threshold": args.prob_threshold,
            "tree": node_record(tree, None, probs, tokenizer, args.advantage),
        }
        for i, tree in enumerate(trees[: args.save_questions])
    ]


def finish_run(run_dir: Path, log: RunLog, accuracy_before: float | None, accuracy_after: float | None, eval_task: str) -> dict:
    """Close the log, write summary.json and print the run's one-line result (rank 0 under torchrun)."""
    log.close()
    summary = {"run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoint"), "accuracy_before": accuracy_before, "accuracy_after": accuracy_after}
    if ev.rank() > 0:
        return summary
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    before = f"{accuracy_before:.3f}" if accuracy_before is not None else "n/a (resumed, or --no-eval-before)"
    after = f"{accuracy_after:.3f}" if accuracy_after is not None else "n/a (no iteration ran)"
    print(f"accuracy {before} -> {after} on {eval_task}; metrics {log.path}; checkpoint {run_dir / 'checkpoint'}")
    return summary


def main(args: Args) -> dict:
    device = ev.init_distributed()  # torchrun: this rank's GPU (or CPU over gloo); plain python: one process
    branches = validate(args)
    eval_task = args.eval_task or ev.default_eval_task(args.task)
    if args.dry_run:  # nothing is loaded: the alias is expanded by name only
        full_tree = [math.prod(branches[: d + 1]) for d in range(len(branches))]  # nodes per level without early leaves
        return ev.dry_run(args, PAPER_SETTINGS, resolved={
            "eval_task": eval_task, "model_id": ev.ALIASES.get(args.model, args.model), "branches": branches,
            "nodes_per_full_tree": sum(full_tree), "leaves_per_full_tree": full_tree[-1],
        })
    torch.manual_seed(args.seed)
    ev.print0(ev.set_precision(args.precision, device))
    run_dir, checkpoint = open_run(args)

    model, tokenizer, reference = load_models(args, checkpoint, device)
    train_examples, eval_examples = load_examples(args, eval_task, tokenizer)
    pad_id, stop = tokenizer.pad_token_id, ev.stop_strings(tokenizer)
    sampler = ev.make_sampler(
        args.backend, model, tokenizer, str(checkpoint) if checkpoint else args.model, seed=args.seed,
        max_model_len=args.context, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
    )
    optimizer, scheduler, start_iteration, buffer = make_optimizer(args, model, checkpoint)
    log = RunLog(run_dir, start_iteration, args)

    accuracy_before = accuracy_after = None
    if start_iteration == 1 and args.eval_before:
        log.write(0, eval_metrics := evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args))
        accuracy_before = accuracy_after = eval_metrics["eval/accuracy"]
    streak = [0]  # non-finite losses in a row
    progress = tqdm.tqdm(range(start_iteration, args.iterations + 1), desc="iterations", initial=start_iteration - 1,
                         total=args.iterations, disable=ev.rank() > 0)
    for iteration in progress:
        rng = reseed(args.seed, iteration, sampler)

        # 1. Rollout: one tree per question, grown level by level across all trees (this rank's share of them).
        started = iteration_started = time.time()
        question_ids = ev.shard([rng.randrange(len(train_examples)) for _ in range(args.questions)])
        questions = [train_examples[i] for i in question_ids]
        trees, level_seconds = grow_trees(
            sampler, [q.prompt_ids for q in questions], branches, segment_tokens=args.segment_tokens,
            max_new_tokens=args.max_new_tokens, context=args.context, temperature=args.temperature, top_p=args.top_p, stop=stop,
        )
        rollout_seconds = time.time() - started

        # 2. Rewards: every finished leaf graded on its full response; unfinished leaves score 0.
        grade_trees(trees, [q.answer for q in questions], tokenizer, args.task)

        # 3. Values and segment advantages; old log-probs of the new edges under the policy that sampled them.
        #    Under torchrun every rank gets every rank's edges: the replay buffer is one, the same on all ranks.
        new_edges, nonzero_edges = tree_edges(trees, question_ids, iteration, args.advantage)
        for edge, logps in zip(new_edges, sample_logprobs(model, new_edges, args.micro_batch_size, args.temperature, pad_id)):
            edge["old_logps"] = logps
        new_edges = ev.gather(new_edges)
        saving = args.save_samples and iteration % args.save_samples == 0
        saved_probs = node_probs(model, trees[: args.save_questions], args.micro_batch_size, args.temperature, pad_id) if saving else {}

        # 4. Replay buffer: at most --edges-per-question edges per question, then exactly --samples-per-iteration
        #    samples of them (each rank trains its share); reference log-probs, loss mask, whitened advantages.
        taken, buffer = sample_buffer(buffer + new_edges, iteration, args.buffer_max_age, args.edges_per_question, rng)
        samples, buffer = fill_samples(taken, buffer, args.samples_per_iteration, rng)  # the buffer the checkpoint keeps
        rank_samples = ev.shard(samples)
        attach_targets(rank_samples, reference, device=device, micro_batch_size=args.micro_batch_size, temperature=args.temperature,
                       pad_id=pad_id, prob_threshold=args.prob_threshold, prob_mask=args.prob_mask)

        # 5. Update: epochs x shuffled batches x micro-batches; the sampler sleeps meanwhile, then takes the new weights.
        sampler.sleep()
        started, lr = time.time(), scheduler.get_last_lr()[0]
        model_stats = update_policy(model, optimizer, scheduler, rank_samples, args, pad_id, iteration, streak)
        update_seconds = time.time() - started
        sampler.wake_up()
        sampler.load_weights(model)
        iteration_seconds = time.time() - iteration_started
        log.train_seconds += iteration_seconds
        last = ev.broadcast(iteration == args.iterations or (args.max_minutes is not None and log.train_seconds >= 60 * args.max_minutes))

        # 6. Log (over all ranks' trees), save samples, evaluate, checkpoint.
        metrics = iteration_metrics(
            iteration, ev.gather(trees), samples, buffer, ev.gather([s["loss_mask"] for s in rank_samples]),
            nonzero_edges=int(ev.all_sum(torch.tensor(nonzero_edges))), model_stats=model_stats, lr=lr,
            level_seconds=level_seconds, rollout_seconds=rollout_seconds, update_seconds=update_seconds,
            iteration_seconds=iteration_seconds, train_seconds=log.train_seconds,
        )
        log.write(iteration, metrics)
        progress.set_postfix(reward=f"{metrics['charts/reward']:.3f}")
        ev.print0(progress_line(iteration, metrics, level_seconds), tqdm.tqdm.write)
        if saving and ev.rank() == 0:  # rank 0's trees
            write_samples(run_dir / "samples" / f"iter_{iteration}.jsonl", sample_records(iteration, trees, questions, saved_probs, tokenizer, args))
        if iteration % args.eval_every == 0 or last:
            log.write(iteration, eval_metrics := evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args))
            accuracy_after = eval_metrics["eval/accuracy"]
        if iteration % args.save_every == 0 or last:
            save_checkpoint(run_dir, model, tokenizer, optimizer, scheduler, iteration, buffer)
        ev.barrier()  # under torchrun no rank runs ahead of the checkpoint
        if last:
            break
    return finish_run(run_dir, log, accuracy_before, accuracy_after, eval_task)


if __name__ == "__main__":
    ev.run_cli(main, ev.cli(Args))
