"""Credit assignment against the exact answer: each algorithm's advantages and loss gradient beside the truth.

What is measured. A policy small enough that nothing about it has to be sampled to be known: a tiny Llama over five
tokens (EOS and the digits 0-3) answers a prompt of two digits a, b with digits that must add up to a + b, then EOS
(reward 1; a wrong sum, or no EOS within --horizon tokens, scores 0, as unfinished responses do in the scripts).
Every continuation of every prefix is enumerated under the sampling distribution (softmax(logits / temperature),
top_p 1): 4^8 = 65,536 unfinished and 21,845 finished responses per prompt at the default horizon of 8. That gives,
exactly, V(s) of every prefix s, the advantage of every token A*_t = V(s_<=t) - V(s_<t) (the value of a finished
response is its reward), and the gradient of the expected reward J = mean over prompts of V(prompt) with respect to
every policy parameter: sum over complete responses of P(y) R(y) grad log P(y) (the R = 0 terms vanish, so the
rewarded responses are run, in batches, once). The policy is frozen while the estimators draw (beta 0, fp32).
Two measures per estimator, against the sampled tokens it spent (responses, MC continuations, tree nodes and the
critic's training rollouts all count):
  1. advantage accuracy: Pearson correlation and mean squared error with A*, and sign agreement where |A*| >= 0.25,
     per token (the advantage the token is trained with: 0 where the loss mask leaves it out) and per segment (each
     estimator's unit of credit: GRPO's response, SPO-chain's segment between value positions, SPO-tree's edge,
     a token for PPO and the per-token MC; its truth is the sum of A* over the segment);
  2. gradient accuracy: the cosine between minus the gradient of the algorithm's loss on its batch and grad J.

How. The task, the policy, its enumeration and the sampler are exact_toy.py's. Sampling is this benchmark's own:
ExactSampler draws from the enumerated next-token tables (no forward pass) through the interface of
plumbing.engines.HFSampler, so spo_tree.grow_trees grows the trees as in training. The advantages and the losses are
the scripts' own functions, imported:
  grpo                       grpo_baseline.group_advantages; attach_targets + accumulate_gradients
  spo_chain_int{1,5}[_nomask] spo_chain.find_cutpoints on p_t from the training log-probs, K MC continuations per
                             distinct cutpoint state, spo_chain.chain_advantages; attach_advantages +
                             accumulate_gradients (the probability mask on, or off: the same draws)
  spo_tree[_nomask]          spo_tree.grow_trees (--tree-depth levels of b children, --segment-tokens M);
                             Node, backup_values, edge_advantages, tree_segments; attach_targets +
                             accumulate_gradients (mask on, or off)
  ppo_lam{1,0.96}            ppo_baseline.make_critic (the policy's backbone, zero value head) trained with
                             response_values + value_loss on --critic-batches earlier batches (counted), then
                             add_old_logprobs_and_values + add_advantages_and_returns (gae_advantages) on the batch;
                             accumulate_gradients (the policy's part of the gradient)
  mc_token                   a per-token Monte-Carlo estimate, the ceiling of sampled values: every state of the
                             response is a cutpoint (spo_chain.chain_advantages with cutpoints -1..T-2, K each)
  exact_advantage            reference, gradient only: A* itself on G responses per prompt through spo_chain's loss
                             (no mask): how close a perfect advantage gets through the whitened, token-normalised loss
  spo_tree_exact_edges       reference, gradient only: the same trees' edges with their exact V(child) - V(parent)
                             through spo_tree's loss: what the tree's sample weighting alone allows
Budgets are tokens per prompt: for each, every estimator gets the largest size (responses per prompt G, or SPO-tree's
branch factor b) whose cost, measured on a pilot draw with its own seed, fits (none: it is left out at that budget);
what it then spends is recorded. Each seed draws every estimator afresh; each measure is pooled over the six prompts'
tokens (segments) of one seed, and differences are paired by seed, with 95% bootstrap intervals over the seeds: for
every estimator against the measure's best, and for every two estimators ("pairwise" in the JSON).

The policy. A random tiny Llama is nearly uniform (every token low-probability, success 0.05-0.11) and one trained
longer on a cleaner corpus nearly deterministic (few cutpoints, success near 0.9); neither has much credit to assign.
So it is pre-trained briefly (--pretrain-steps, seconds) on a synthetic corpus built like a policy that reasons: a free
first digit (1 or 2: a fork where either choice can succeed), then the largest digit up to 2 that still fits (confident
tokens), then EOS; in --mistake-rate of the corpus one mistake: stopping early or an extra random digit. The model
learns forks and mistakes at particular places: a mix of confident tokens (p_t >= 0.9) and low-probability ones (46-90%
of a prompt's tokens), exact success rates from 0.28 to 0.85 per prompt (mean 0.54). The JSON records each prompt's
success rate, expected length and low-probability share.

What the numbers show: on this policy and task, how close each estimator's credit is to the exact credit per token
spent, with the intervals saying which differences the seeds resolve. What they do not show: learning speed or
final accuracy (experiments/learning.py), long responses (here 2-5 tokens, so int5 mostly keeps the first cutpoint and
SPO-tree's segments are M = 2 tokens), real language, or a critic trained over a whole run (here it sees a few
batches of a frozen policy, with --critic-lr chosen for this small model, not the paper's 1e-6).

--task critical swaps the task: digits 0 and 1, a prompt of three bits, reward 1 for the key bit (the first), then
exactly --filler bits of any value, then EOS (--horizon --filler + 2; CRITICAL): one early token decides the reward.
The same enumeration, sampler and estimators run on it.

Defaults take about 4 minutes on 2 CPU cores (one torch thread); training PPO's critics is half of it.

  python -m experiments.credit_exact                       # writes experiments/results/credit_exact.{json,png}
  python -m experiments.credit_exact --seeds 0 1 2 --budgets 64 256 --out /tmp/credit_exact.json
  python -m experiments.credit_exact --tiny --out /tmp/tiny.json   # seconds: what the tests run
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from experiments.exact_toy import (
    EOS,
    PROMPT_LENGTH,
    Exact,
    ExactSampler,
    draw_responses,
    enumerate_prompts,
    exact_gradient,
    expected_reward,
    flat_gradient,
    machine,
    make_policy,
    mc_state_values,
    pilot_costs,
    reward,
    task_defaults,
    task_problems,
    tree_branches,
)
from experiments.measures import paired_interval, pearson, rounded, sign_agreement
from plumbing import UsageError, cli, ranges
from plumbing.precision import FP32
from plumbing.training import collate, micro_batches, sample_logprobs


@dataclass
class Args:
    seeds: ranges.Seeds = field(default_factory=lambda: list(range(20)))
    """seeds: each draws every estimator afresh at every budget (the policy and its exact values stay the same)"""
    budgets: ranges.PositiveInts = field(default_factory=lambda: [32, 128, 512, 2048])
    """sampled tokens per prompt each estimator may spend (responses, MC continuations, tree nodes, critic rollouts)"""
    out: str = "experiments/results/credit_exact.json"
    """results JSON (the PNG is written beside it)"""
    tiny: bool = False
    "a seconds-long run for the tests: horizon 4, two prompts, three seeds, budgets 16 and 64 (overrides those flags)"
    task: Literal["sum", "critical"] = "sum"
    """sum: digits that add up to the prompt's (0-3, the default); critical: one key bit, then --filler free bits
    (CRITICAL's docstring): a reward that one early token decides"""
    filler: ranges.PositiveInt = 6
    """--task critical: the free bits after the key bit (--horizon must be --filler + 2)"""
    filler_kind: Literal["coin", "confident"] = "coin"
    """--task critical: the corpus's filler bits, coin flips (every filler token uncertain) or nearly always 0 (the
    policy confident at every filler token: exact_toy.CRITICAL_FILLER_ONES)"""
    prompts: list[str] = field(default_factory=lambda: ["11", "12", "22", "13", "23", "33"])
    """prompts as two digits a b (0-3); the response's digits must add up to a + b (--task critical: three bits,
    e.g. 011, whose first bit is the key)"""
    horizon: ranges.PositiveInt = 8
    """response token budget (max new tokens); a response without EOS by then is unfinished and scores 0"""
    temperature: ranges.PositiveFloat = 0.6
    """sampling temperature (the scripts' default); every log-prob divides the logits by it, as the scripts do"""
    prob_threshold: ranges.Probability = 0.9
    """tokens with p_t < prob_threshold are low-probability: SPO-chain's cutpoints and the probability mask"""

    # The estimators
    mc_samples: ranges.PositiveInt = 9
    """K: MC continuations per state, SPO-chain's cutpoints and the per-token MC (the paper: 9)"""
    intervals: ranges.PositiveInts = field(default_factory=lambda: [1, 5])
    """SPO-chain cutpoint intervals (int1, int5)"""
    tree_depth: ranges.PositiveInt = 3
    """SPO-tree levels; the branch factor b of every level is what the budget sets (the paper: 6,6,6)"""
    segment_tokens: ranges.PositiveInt = 2
    """SPO-tree's M: new tokens per segment above the last level"""
    lams: ranges.bounded(float, 0, 1, many=True) = field(default_factory=lambda: [1.0, 0.96])
    """PPO's GAE lambdas (gamma 1): the paper's 1 and the common 0.96"""
    critic_batches: ranges.NonNegativeInt = 3
    """PPO: batches (of the measured batch's size) the critic is trained on before the measured batch; all counted"""
    critic_epochs: ranges.PositiveInt = 2
    """PPO: passes of the value loss over each earlier batch (the paper's 2 epochs)"""
    critic_batch_size: ranges.PositiveInt = 64
    """PPO: sequences per critic optimizer step (the paper's batch 64)"""
    critic_lr: ranges.NonNegativeFloat = 3e-3
    """PPO: critic AdamW learning rate: the best of 1e-3, 3e-3, 1e-2 on a pilot (the paper's 1e-6 would leave this
    small critic at its zero start)"""
    value_clip_eps: ranges.PositiveFloat = 0.2
    """PPO: clipping of new values around the batch's values in the value loss"""
    clip_eps: ranges.PositiveFloat = 0.2
    """PPO-clip epsilon of every policy loss (the ratio is 1 here: the policy is frozen)"""

    # Scores
    sign_threshold: ranges.NonNegativeFloat = 0.25
    """sign agreement counts tokens and segments with |A*| >= this"""
    bootstrap: ranges.PositiveInt = 2000
    """bootstrap resamples of the seeds for the 95% intervals"""

    # The policy
    policy_seed: ranges.Seed = 0
    """seed of the policy's initialisation and pre-training corpus"""
    hidden_size: ranges.PositiveInt = 32
    """the tiny Llama's width (2 layers, 4 heads)"""
    pretrain_steps: ranges.NonNegativeInt = 500
    """pre-training steps on the synthetic corpus
    (--task critical: more, up to 4x, until every prompt's length is right 0.9 of the time; exact_toy.make_policy)"""
    pretrain_batch: ranges.PositiveInt = 64
    """corpus sequences per pre-training step"""
    pretrain_lr: ranges.PositiveFloat = 3e-3
    """pre-training AdamW learning rate"""
    mistake_rate: ranges.Fraction = 0.7
    """share of corpus responses with one mistake (an early EOS or an extra random digit)"""
    micro_batch_size: ranges.PositiveInt = 512
    """sequences per forward pass (memory only: the gradients do not depend on it)"""
    threads: ranges.PositiveInt = 1
    """torch CPU threads"""


TINY = dict(
    horizon=4,
    prompts=["21", "13"],
    seeds=[0, 1, 2],
    budgets=[16, 64],
    pretrain_steps=300,
    tree_depth=2,
    critic_batches=1,
    bootstrap=200,
)


# ----------------------------------------------------------------------------------------------
# The estimators, each through its script's own functions. Each returns Runs: what it spent, its per-token and
# per-segment credit beside the truth, and the gradient of its loss on its batch.


@dataclass
class Run:
    tokens: int  # sampled tokens spent, per prompt
    token_estimates: list[float]  # the advantage each token is trained with (0 outside the loss mask), before whitening
    token_truth: list[float]  # A* of the same tokens
    segment_estimates: list[float]  # one per unit of credit (response, segment, edge or token)
    segment_truth: list[float]  # the sum of A* over the unit
    gradient: torch.Tensor | None  # flat gradient of the loss on the batch (None: not computed)
    record: dict = field(default_factory=dict)  # what the tests recompute from (samples, values, trees)


def attach_old_logprobs(model, samples: list[dict], args: Args) -> list[list[float]]:
    """old_logps (= ref_logps: beta 0) of every sample from the training log-probs, as the scripts compute them;
    returns p_t of every response token."""
    for s, logps in zip(samples, sample_logprobs(model, samples, args.micro_batch_size, args.temperature, EOS, FP32)):
        s["old_logps"] = s["ref_logps"] = logps
    return [s["old_logps"].exp().tolist() for s in samples]


def loss_gradient(model, accumulate, samples: list[dict], args: Args) -> torch.Tensor:
    """The gradient of one batch's loss as the script computes it: accumulate(model, samples, **settings) is its
    accumulate_gradients, with beta 0 and fp32."""
    model.zero_grad(set_to_none=True)
    accumulate(
        model,
        samples,
        micro_batch_size=args.micro_batch_size,
        temperature=args.temperature,
        clip_eps=args.clip_eps,
        beta=0.0,
        pad_id=EOS,
        precision=FP32,
    )
    gradient = flat_gradient(model)
    model.zero_grad(set_to_none=True)
    return gradient


def trained_estimates(samples: list[dict], advantages: list[list[float]]) -> list[float]:
    """Each token's advantage where the sample's loss mask keeps it, else 0, all responses in one list."""
    return [
        a if kept else 0.0
        for s, response in zip(samples, advantages)
        for a, kept in zip(response, s["loss_mask"].tolist())
    ]


def truth_of(samples: list[dict], owners: list[Exact]) -> list[float]:
    return [a for s, exact in zip(samples, owners) for a in exact.advantages(s["response_ids"])]


def run_grpo(model, sampler, exacts, group_size: int, args: Args) -> dict[str, Run]:
    """grpo_baseline: group-normalised rewards on every token; the loss through attach_targets +
    accumulate_gradients, without the probability mask (grpo) and with it (grpo_mask: the paper's GRPO+mask
    ablation, the script's --prob-mask), on the same draws."""
    samples, owners, rewards = draw_responses(sampler, exacts, group_size)
    advantages = grpo_baseline.group_advantages(torch.tensor(rewards), group_size)  # [N]
    per_token = [[float(a)] * len(s["response_ids"]) for a, s in zip(advantages, samples)]
    runs = {}
    for prob_mask in (False, True):
        script_args = grpo_baseline.Args(
            temperature=args.temperature,
            micro_batch_size=args.micro_batch_size,
            prob_mask=prob_mask,
            prob_threshold=args.prob_threshold,
            beta=0.0,
        )
        grpo_baseline.attach_targets(samples, advantages, model, None, script_args, EOS, precision=FP32)
        runs["grpo_mask" if prob_mask else "grpo"] = Run(
            sampler.tokens,
            trained_estimates(samples, per_token),
            truth_of(samples, owners),
            advantages.tolist(),
            [r - exact.value([]) for r, exact in zip(rewards, owners)],
            loss_gradient(model, grpo_baseline.accumulate_gradients, samples, args),
            {"samples": [dict(s) for s in samples], "rewards": rewards},
        )
    return runs


def chain_segments(cutpoints: list[int], length: int) -> list[tuple[int, int]]:
    """SPO-chain's units of credit: (first, last) token of each run between value positions (a cutpoint c >= 0 ends one
    at token c; the last ends at T-1). No cutpoint: one segment, the whole response.

    >>> chain_segments([-1, 1, 3], 6), chain_segments([], 3)
    ([(0, 1), (2, 3), (4, 5)], [(0, 2)])
    """
    ends = [c for c in cutpoints if 0 <= c < length - 1] + [length - 1]
    return [(start, end) for start, end in zip([0] + [e + 1 for e in ends[:-1]], ends)]


def run_chain(model, sampler, exacts, group_size: int, args: Args, interval: int | None) -> dict[str, Run]:
    """spo_chain with cutpoints every `interval`-th low-probability token (None: every state of the response, the
    per-token MC "mc_token"): K continuations per distinct cutpoint state, chain_advantages, the loss through
    attach_advantages + accumulate_gradients, with the probability mask and without (the same draws)."""
    samples, owners, rewards = draw_responses(sampler, exacts, group_size)
    probs = attach_old_logprobs(model, samples, args)
    if interval is None:
        cutpoints = [list(range(-1, len(p) - 1)) for p in probs]
    else:
        cutpoints = [spo_chain.find_cutpoints(p, args.prob_threshold, interval) for p in probs]
    states = [
        (exact, tuple(s["response_ids"][: c + 1])) for s, exact, cuts in zip(samples, owners, cutpoints) for c in cuts
    ]
    estimated = mc_state_values(sampler, states, args.mc_samples)
    values = [
        [estimated[(id(exact), tuple(s["response_ids"][: c + 1]))] for c in cuts]
        for s, exact, cuts in zip(samples, owners, cutpoints)
    ]
    flat_probs = torch.cat([s["old_logps"] for s in samples]).exp()  # [all response tokens], p_t
    truth, segment_estimates, segment_truth = truth_of(samples, owners), [], []
    raw = [
        spo_chain.chain_advantages(p, cuts, v, r, args.prob_threshold, prob_mask=False)
        for p, cuts, v, r in zip(probs, cutpoints, values, rewards)
    ]
    for s, exact, cuts, advantages in zip(samples, owners, cutpoints, raw):
        for first, last in chain_segments(cuts, len(advantages)):
            segment_estimates.append(advantages[last])
            segment_truth.append(exact.value(s["response_ids"][: last + 1]) - exact.value(s["response_ids"][:first]))
    name = "mc_token" if interval is None else f"spo_chain_int{interval}"
    runs = {}
    for prob_mask in (False,) if interval is None else (True, False):
        advantages = [
            spo_chain.chain_advantages(p, cuts, v, r, args.prob_threshold, prob_mask)
            for p, cuts, v, r in zip(probs, cutpoints, values, rewards)
        ]
        spo_chain.attach_advantages(samples, advantages, flat_probs, args.prob_threshold, prob_mask)
        runs[name + ("" if prob_mask or interval is None else "_nomask")] = Run(
            sampler.tokens,
            trained_estimates(samples, advantages),
            truth,
            segment_estimates,
            segment_truth,
            loss_gradient(model, spo_chain.accumulate_gradients, samples, args),
            {
                "samples": [dict(s) for s in samples],
                "rewards": rewards,
                "probs": probs,
                "cutpoints": cutpoints,
                "values": values,
            },
        )
    return runs


def run_exact_advantage(model, sampler, exacts, group_size: int, args: Args) -> dict[str, Run]:
    """Reference: A* itself on G responses per prompt, through spo_chain's loss without the mask."""
    samples, owners, _ = draw_responses(sampler, exacts, group_size)
    probs = attach_old_logprobs(model, samples, args)
    advantages = [exact.advantages(s["response_ids"]) for s, exact in zip(samples, owners)]
    spo_chain.attach_advantages(
        samples, advantages, torch.tensor([p for ps in probs for p in ps]), args.prob_threshold, False
    )
    return {
        "exact_advantage": Run(
            sampler.tokens, [], [], [], [], loss_gradient(model, spo_chain.accumulate_gradients, samples, args)
        )
    }


def run_tree(model, sampler, exacts, branch: int, args: Args, wide: bool = False) -> dict[str, Run]:
    """spo_tree: one tree per prompt grown by grow_trees (tree_branches: tree_depth levels of `branch` children, or
    2 * branch at the first level when `wide`; M tokens per segment), leaves graded by the reward, tree_segments'
    edges as samples; the loss through attach_targets + accumulate_gradients, with the probability mask and without
    (the same trees), and with the mask under --edge-weight depth (spo_tree.depth_weights: gradient only, the
    advantages are the uniform rows'). Names start with spo_tree, or spo_tree_wide."""
    name, branches = "spo_tree_wide" if wide else "spo_tree", tree_branches(branch, args, wide)
    roots, _ = spo_tree.grow_trees(
        sampler,
        [exact.prompt for exact in exacts],
        branches,
        segment_tokens=args.segment_tokens,
        max_new_tokens=args.horizon,
        context=PROMPT_LENGTH[args.task] + args.horizon,
        temperature=args.temperature,
        top_p=1.0,
        stop=[],
    )
    for exact, root in zip(exacts, roots):
        for node, before in spo_tree.walk(root):
            if not node.children:
                node.reward = reward(exact, before + node.tokens, node.finish_reason)
    # tree_segments backs the values up
    samples = [
        {"prompt_ids": query, "response_ids": segment, "advantage": advantage, "depth": depth}
        for root in roots
        for query, segment, advantage, depth in spo_tree.tree_segments(root, "rloo")
    ]
    # Every edge (zero ones too: the estimator gives them 0) beside its truth, per token and as a segment, in
    # tree_segments' order (depth-first pre-order), so the non-zero ones line up with the samples.
    edges = []  # (Exact, ids before the segment, segment ids, edge advantage)

    def visit(exact: Exact, node, before: list[int]) -> None:
        for child, advantage in zip(node.children, spo_tree.edge_advantages(node, "rloo")):
            edges.append((exact, before, child.tokens, advantage))
            visit(exact, child, before + child.tokens)

    for exact, root in zip(exacts, roots):
        visit(exact, root, [])
    truth = [a for exact, before, segment, _ in edges for a in exact.advantages(before + segment)[len(before) :]]
    segment_truth = [exact.value(before + segment) - exact.value(before) for exact, before, segment, _ in edges]
    segment_estimates = [advantage for *_, advantage in edges]
    attach_old_logprobs(model, samples, args)
    runs = {}
    for prob_mask in (True, False):
        spo_tree.attach_targets(
            samples,
            None,
            micro_batch_size=args.micro_batch_size,
            temperature=args.temperature,
            pad_id=EOS,
            prob_threshold=args.prob_threshold,
            prob_mask=prob_mask,
            precision=FP32,
        )
        estimates, trained = [], iter(samples)
        for *_, segment, advantage in edges:
            # a zero edge is not trained
            kept = next(trained)["loss_mask"].tolist() if advantage != 0 else [False] * len(segment)
            estimates += [advantage if keep else 0.0 for keep in kept]
        runs[name + ("" if prob_mask else "_nomask")] = Run(
            sampler.tokens,
            estimates,
            truth,
            segment_estimates,
            segment_truth,
            loss_gradient(model, spo_tree.accumulate_gradients, samples, args) if samples else None,
            {"samples": [dict(s) for s in samples], "roots": roots},
        )
    # --edge-weight depth: the same edges, every one kept (E_q / k_q = 1), each weighted by its depth's weight.
    by_depth = spo_tree.depth_weights(branches)
    weighted = [{**s, "weight": by_depth[s["depth"] - 1]} for s in samples]
    spo_tree.attach_targets(
        weighted,
        None,
        micro_batch_size=args.micro_batch_size,
        temperature=args.temperature,
        pad_id=EOS,
        prob_threshold=args.prob_threshold,
        prob_mask=True,
        precision=FP32,
    )
    runs[name + "_depth"] = Run(
        sampler.tokens,
        [],
        [],
        [],
        [],
        loss_gradient(model, spo_tree.accumulate_gradients, weighted, args) if weighted else None,
    )
    if wide:
        return runs
    # Reference: the same trees' edges with their exact advantage V(child) - V(parent), through the same loss.
    exact_edges = [
        {"prompt_ids": exact.prompt + before, "response_ids": segment, "advantage": value}
        for (exact, before, segment, _), value in zip(edges, segment_truth)
        if value != 0
    ]
    attach_old_logprobs(model, exact_edges, args)
    spo_tree.attach_targets(
        exact_edges,
        None,
        micro_batch_size=args.micro_batch_size,
        temperature=args.temperature,
        pad_id=EOS,
        prob_threshold=args.prob_threshold,
        prob_mask=True,
        precision=FP32,
    )
    runs["spo_tree_exact_edges"] = Run(
        sampler.tokens,
        [],
        [],
        [],
        [],
        loss_gradient(model, spo_tree.accumulate_gradients, exact_edges, args) if exact_edges else None,
    )
    return runs


def train_critic(model, critic, sampler, exacts, group_size: int, lam: float, args: Args) -> None:
    """--critic-batches batches of G responses per prompt, each: the critic's values and the GAE returns
    (ppo_baseline.add_old_logprobs_and_values + add_advantages_and_returns), then --critic-epochs passes of
    ppo_baseline.value_loss over response_values in shuffled steps of --critic-batch-size sequences."""
    optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(int(sampler.rng.integers(2**31)))
    critic.train()
    for _ in range(args.critic_batches):
        samples, _, rewards = draw_responses(sampler, exacts, group_size)
        ppo_baseline.add_old_logprobs_and_values(
            samples,
            model,
            None,
            critic,
            micro_batch_size=args.micro_batch_size,
            temperature=args.temperature,
            pad_id=EOS,
            precision=FP32,
        )
        ppo_baseline.add_advantages_and_returns(
            samples, torch.tensor(rewards), gamma=1.0, lam=lam, prob_threshold=args.prob_threshold, prob_mask=False
        )
        for _ in range(args.critic_epochs):
            order = torch.randperm(len(samples), generator=generator).tolist()
            for start in range(0, len(order), args.critic_batch_size):
                step = [samples[i] for i in order[start : start + args.critic_batch_size]]
                tokens = sum(len(s["response_ids"]) for s in step)
                optimizer.zero_grad(set_to_none=True)
                for indices in micro_batches(step, args.micro_batch_size):
                    batch = collate([step[i] for i in indices], EOS, model.device)
                    values = ppo_baseline.response_values(critic, batch)  # [rows, R]
                    loss, _ = ppo_baseline.value_loss(
                        values,
                        batch["old_values"],
                        batch["returns"],
                        batch["response_mask"],
                        args.value_clip_eps,
                        tokens,
                    )
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                optimizer.step()
    critic.eval()


def run_ppo(model, sampler, exacts, group_size: int, args: Args, lam: float) -> dict[str, Run]:
    """ppo_baseline: a critic made from the policy and trained on earlier batches (train_critic), then on the measured
    batch its values, GAE advantages (gamma 1, lambda `lam`) and the policy's gradient of accumulate_gradients."""
    critic = ppo_baseline.make_critic(model, FP32)
    train_critic(model, critic, sampler, exacts, group_size, lam, args)
    samples, owners, rewards = draw_responses(sampler, exacts, group_size)
    ppo_baseline.add_old_logprobs_and_values(
        samples,
        model,
        None,
        critic,
        micro_batch_size=args.micro_batch_size,
        temperature=args.temperature,
        pad_id=EOS,
        precision=FP32,
    )
    # [N, T]
    gae, _ = ppo_baseline.add_advantages_and_returns(
        samples, torch.tensor(rewards), gamma=1.0, lam=lam, prob_threshold=args.prob_threshold, prob_mask=False
    )
    advantages = [gae[i, : len(s["response_ids"])].tolist() for i, s in enumerate(samples)]
    estimates, truth = trained_estimates(samples, advantages), truth_of(samples, owners)
    values_error = float(
        np.mean(
            [
                (v - exact.value(s["response_ids"][:t])) ** 2
                for s, exact in zip(samples, owners)
                for t, v in enumerate(s["old_values"].tolist())
            ]
        )
    )
    # the critic's part is not read
    gradient = loss_gradient(
        model,
        lambda model, samples, **settings: ppo_baseline.accumulate_gradients(
            model, critic, samples, value_clip_eps=args.value_clip_eps, **settings
        ),
        samples,
        args,
    )
    return {
        f"ppo_lam{lam:g}": Run(
            sampler.tokens,
            estimates,
            truth,
            estimates,
            truth,
            gradient,
            {"samples": samples, "rewards": rewards, "critic_value_mse": values_error},
        )
    }


# ----------------------------------------------------------------------------------------------
# Budgets: each estimator's size from a pilot draw of its cost


def families(args: Args) -> dict[str, tuple]:
    """Each draw family: (run function(model, sampler, exacts, size, args), smallest size). A family's one draw gives
    one or two estimators (the probability mask on and off)."""
    out = {"grpo": (run_grpo, 2)}
    for interval in args.intervals:
        out[f"spo_chain_int{interval}"] = (lambda *a, interval=interval: run_chain(*a, interval=interval), 1)
    out["spo_tree"] = (run_tree, 2)
    out["spo_tree_wide"] = (lambda *a: run_tree(*a, wide=True), 2)
    for lam in args.lams:
        out[f"ppo_lam{lam:g}"] = (lambda *a, lam=lam: run_ppo(*a, lam=lam), 2)
    out["mc_token"] = (lambda *a: run_chain(*a, interval=None), 1)
    out["exact_advantage"] = (run_exact_advantage, 1)
    return out


def size_for(cost, budget: int, smallest: int) -> int | None:
    """The largest size whose pilot cost fits the budget: G = floor(budget / cost per response) for a cost per response,
    else the largest measured size that fits; None when even the smallest size does not.

    >>> size_for(3.5, 32, 2), size_for(20.0, 32, 2), size_for({2: 10.0, 3: 30.0, 4: 70.0}, 32, 2)
    (9, None, 3)
    """
    if isinstance(cost, dict):
        fitting = [size for size, tokens in cost.items() if tokens <= budget and size >= smallest]
        return max(fitting) if fitting else None
    size = int(budget // cost)
    return size if size >= smallest else None


# ----------------------------------------------------------------------------------------------
# Scores and the paired bootstrap

METRICS = (
    "token_pearson",
    "token_mse",
    "token_sign",
    "segment_pearson",
    "segment_mse",
    "segment_sign",
    "gradient_cosine",
)
LOWER_IS_BETTER = {"token_mse", "segment_mse"}
REFERENCES = {"exact_advantage", "spo_tree_exact_edges"}  # not ranked: they read the answer


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    norm = float(a.norm() * b.norm())
    return float(a @ b) / norm if norm > 0 else None


def score(run: Run, exact_grad: torch.Tensor, sign_threshold: float) -> dict:
    """One run's measures (None where undefined, e.g. a correlation with a constant side)."""
    out = {"tokens": run.tokens}
    for unit, estimates, truth in (
        ("token", run.token_estimates, run.token_truth),
        ("segment", run.segment_estimates, run.segment_truth),
    ):
        out[f"{unit}_pearson"] = pearson(estimates, truth)
        out[f"{unit}_mse"] = float(np.mean((np.asarray(estimates) - np.asarray(truth)) ** 2)) if estimates else None
        out[f"{unit}_sign"] = sign_agreement(estimates, truth, sign_threshold)[0]
    # -run.gradient: the loss is minimised
    out["gradient_cosine"] = None if run.gradient is None else cosine(-run.gradient, exact_grad)
    return out


def summarise(per_seed: dict[str, list[dict]], resamples: int, seed: int) -> dict:
    """Per estimator and measure: the mean over seeds with its 95% bootstrap interval, and the paired difference from
    the measure's best estimator (the references, which read the answer, are not ranked); per measure, the paired
    difference of every two ranked estimators ("a - b": [mean, low, high]). Rows are in seed order."""
    out = {
        name: {"size": rows[0]["size"], "tokens": float(np.mean([r["tokens"] for r in rows]))}
        for name, rows in per_seed.items()
    }
    best, pairwise = {}, {}
    for metric in METRICS:
        columns = {
            name: np.array([np.nan if r[metric] is None else r[metric] for r in rows], dtype=float)
            for name, rows in per_seed.items()
        }
        means = {name: float(np.nanmean(c)) if np.isfinite(c).any() else None for name, c in columns.items()}
        ranked = [name for name in columns if name not in REFERENCES and means[name] is not None]
        best[metric] = (min if metric in LOWER_IS_BETTER else max)(ranked, key=means.get) if ranked else None
        for name, column in columns.items():
            interval = paired_interval(column, np.zeros_like(column), resamples, seed)
            entry = {"mean": means[name], "n": int(np.isfinite(column).sum()), "ci": interval[1:] if interval else None}
            if best[metric] is not None and name != best[metric]:
                difference = paired_interval(column, columns[best[metric]], resamples, seed)
                entry["minus_best"], entry["minus_best_ci"] = (
                    (difference[0], difference[1:]) if difference else (None, None)
                )
            out[name][metric] = entry
        pairwise[metric] = {
            f"{a} - {b}": paired_interval(columns[a], columns[b], resamples, seed)
            for i, a in enumerate(ranked)
            for b in ranked[i + 1 :]
        }
    return {"estimators": out, "best": best, "pairwise": pairwise}


# ----------------------------------------------------------------------------------------------
# Results: JSON, plot, table


def plot(results: dict, path: Path) -> None:
    """One panel per measure: the mean over seeds (95% bootstrap interval) against the tokens spent per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(20, 9), layout="constrained")
    titles = {
        "token_pearson": "Pearson with A*, per token",
        "token_mse": "MSE with A*, per token",
        "token_sign": "sign agreement, per token (|A*| >= 0.25)",
        "segment_pearson": "Pearson with the segment's A*",
        "segment_mse": "MSE with the segment's A*",
        "segment_sign": "sign agreement, per segment",
        "gradient_cosine": "cosine(-grad loss, exact grad J)",
    }
    names = list(dict.fromkeys(name for level in results["budgets"] for name in level["estimators"]))
    palette = {
        "grpo": "tab:blue",
        "spo_chain_int1": "tab:red",
        "spo_chain_int5": "tab:orange",
        "spo_tree": "tab:green",
        "grpo_mask": "tab:cyan",
        "spo_tree_wide": "tab:pink",
        "ppo_lam1": "tab:purple",
        "ppo_lam0.96": "tab:brown",
        "mc_token": "tab:gray",
        "exact_advantage": "black",
        "spo_tree_exact_edges": "tab:olive",
    }
    for axis, metric in zip(axes.flat, METRICS):
        for name in names:
            points = [
                (level["estimators"][name]["tokens"], level["estimators"][name][metric])
                for level in results["budgets"]
                if name in level["estimators"] and level["estimators"][name][metric]["mean"] is not None
            ]
            if not points:
                continue
            x = [p[0] for p in points]
            y = [p[1]["mean"] for p in points]
            errors = [
                [max(0.0, p[1]["mean"] - p[1]["ci"][0]) if p[1]["ci"] else 0 for p in points],
                [max(0.0, p[1]["ci"][1] - p[1]["mean"]) if p[1]["ci"] else 0 for p in points],
            ]
            base = name.removesuffix("_nomask").removesuffix("_depth")
            variant = base != name  # the same draws as its masked uniform row: dotted, same colour
            axis.errorbar(
                x,
                y,
                yerr=errors,
                marker=("s" if name.endswith("_depth") else "x") if variant else "o",
                ms=4,
                capsize=2,
                label=name,
                color=palette.get(base, None),
                linestyle=":" if variant else "--" if name in REFERENCES or name == "mc_token" else "-",
            )
        axis.set_xscale("log")
        if metric.endswith("mse"):
            axis.set_yscale("log")
        axis.set(title=titles[metric], xlabel="sampled tokens per prompt")
        axis.grid(alpha=0.3)
    handles, labels = axes.flat[-2].get_legend_handles_labels()
    axes.flat[-1].axis("off")
    axes.flat[-1].legend(handles, labels, loc="center", fontsize=10)
    settings = results["settings"]
    fig.suptitle(
        "Credit assignment against the exact answer: tiny Llama, digits that sum to the prompt's target, "
        f"horizon {settings['horizon']}, "
        f"temperature {settings['temperature']}, {len(settings['seeds'])} seeds (mean, 95% bootstrap CI)",
        fontsize=11,
    )
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def print_table(results: dict) -> None:
    for level in results["budgets"]:
        print(
            f"\nbudget {level['budget']} tokens per prompt (best: "
            + ", ".join(f"{m} {b}" for m, b in level["best"].items())
            + ")"
        )
        print(f"{'estimator':<22}{'size':>5}{'tokens':>8}" + "".join(f"{m:>17}" for m in METRICS))
        for name, row in level["estimators"].items():
            cells = []
            for metric in METRICS:
                entry = row[metric]
                mark = (
                    ""
                    if "minus_best_ci" not in entry or entry["minus_best_ci"] is None
                    else ("*" if entry["minus_best_ci"][0] > 0 or entry["minus_best_ci"][1] < 0 else "~")
                )
                cells.append("n/a" if entry["mean"] is None else f"{entry['mean']:.3f}{mark}")
            print(f"{name:<22}{row['size']:>5}{row['tokens']:>8.0f}" + "".join(f"{c:>17}" for c in cells))
    print("(* differs from the best with a paired 95% interval excluding 0; ~ not distinguished)")


def validate(args: Args) -> None:
    problems = ranges.problems(args) + task_problems(args)  # every number against its field's range; the task
    if (args.tree_depth - 1) * args.segment_tokens >= args.horizon:
        problems.append(
            "the levels above SPO-tree's last ((--tree-depth - 1) x --segment-tokens) must be shorter than --horizon"
        )
    if args.hidden_size % 4:
        problems.append(
            f"--hidden-size ({args.hidden_size}) must be a multiple of 4 (the tiny Llama's attention heads)"
        )
    if problems:
        raise UsageError("; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Main


def main(args: Args) -> dict:
    if args.tiny:
        args = dataclasses.replace(args, **TINY)
    args = task_defaults(args)
    validate(args)
    torch.set_num_threads(args.threads)
    started, seconds = time.time(), {}

    # 1. The policy, pre-trained on the synthetic corpus; its exact answer for every prompt; the exact gradient.
    model, pretrain_loss, pretrain_steps = make_policy(args)
    seconds["pretrain"] = time.time() - started
    step = time.time()
    exacts = enumerate_prompts(model, args)
    exact_grad = exact_gradient(model, exacts, args.temperature, args.micro_batch_size)
    seconds["exact"] = time.time() - step

    # 2. Sizes: for each budget, each family's largest size whose pilot cost fits.
    costs = pilot_costs(exacts, args)
    plan = {
        budget: {name: size_for(costs[name], budget, smallest) for name, (_, smallest) in families(args).items()}
        for budget in args.budgets
    }

    # 3. Every seed draws every family afresh at every budget; scores against the exact answer.
    step = time.time()
    per_seed: dict[int, dict[str, list[dict]]] = {budget: {} for budget in args.budgets}
    critic_errors: dict[int, dict[str, list[float]]] = {budget: {} for budget in args.budgets}
    for seed in args.seeds:
        for budget in args.budgets:
            for index, (family, (run, _)) in enumerate(families(args).items()):
                size = plan[budget][family]
                if size is None:
                    continue
                sampler = ExactSampler(exacts, args.temperature, seed=seed * 1_000_003 + budget * 101 + index)
                torch.manual_seed(seed)
                family_started = time.time()
                results = run(model, sampler, exacts, size, args)
                seconds[f"family/{family}"] = seconds.get(f"family/{family}", 0.0) + time.time() - family_started
                for name, result in results.items():
                    result.tokens = result.tokens / len(exacts)
                    per_seed[budget].setdefault(name, []).append(
                        {"seed": seed, "size": size, **score(result, exact_grad, args.sign_threshold)}
                    )
                    if "critic_value_mse" in result.record:
                        critic_errors[budget].setdefault(name, []).append(result.record["critic_value_mse"])
        print(f"seed {seed} done, {time.time() - started:.0f}s", flush=True)
    seconds["estimators"] = time.time() - step

    # 4. Results.
    budgets = []
    for budget in args.budgets:
        level = {"budget": budget, **summarise(per_seed[budget], args.bootstrap, seed=0)}
        level["critic_value_mse"] = {name: float(np.mean(errors)) for name, errors in critic_errors[budget].items()}
        level["per_seed"] = per_seed[budget]
        budgets.append(level)
    seconds["total"] = time.time() - started
    results = rounded(
        {
            "command": " ".join(["python", "-m", "experiments.credit_exact", *sys.argv[1:]]),
            "settings": asdict(args),
            "machine": machine("experiments/credit_exact.py"),
            "seconds": seconds,
            "policy": {
                "pretrain_loss": pretrain_loss,
                "pretrain_steps": pretrain_steps,  # --task critical: more than --pretrain-steps where the length asked
                "parameters": sum(p.numel() for p in model.parameters()),
                "expected_reward": expected_reward(exacts),
                "exact_gradient_norm": float(exact_grad.norm()),
                "prompts": [
                    {
                        "prompt": text,
                        "target": exact.target,
                        "value": float(exact.values[0][0]),
                        "expected_length": exact.expected_length(),
                        "low_probability_share": exact.low_probability_share(args.prob_threshold),
                        "responses_enumerated": int(
                            sum(exact.digits**k for k in range(args.horizon)) + exact.digits**args.horizon
                        ),
                    }
                    for text, exact in zip(args.prompts, exacts)
                ],
            },
            "pilot_costs": {
                name: ({str(b): c for b, c in cost.items()} if isinstance(cost, dict) else cost)
                for name, cost in costs.items()
            },
            "budgets": budgets,
        }
    )
    output = Path(args.out)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    plot(results, output.with_suffix(".png"))
    print_table(results)
    print(
        f"J = {results['policy']['expected_reward']:.3f}, {len(args.seeds)} seeds, {seconds['total']:.0f}s -> {output} "
        f"and {output.with_suffix('.png')}"
    )
    return results


if __name__ == "__main__":
    cli.run_cli(main, ranges.cli(Args))
