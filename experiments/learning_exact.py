"""Learning curves on the exact expected reward: which algorithm raises J fastest per sampled token.

What is measured. Advantage accuracy and gradient cosine on one frozen policy (credit_exact.py) do not say which
algorithm raises the reward fastest per sampled token, which is the paper's claim. Here every algorithm trains, and
after every iteration (one rollout + that script's update) the policy is enumerated exactly: the expected reward
J(theta) (mean over prompts of V(prompt)) and the KL to the start policy, KL(pi_theta || pi_start) over whole
responses (the sum over prefixes of their probability times the KL of the next-token distributions), mean over
prompts. No evaluation sample, so no evaluation noise: a curve's only randomness is its training draws.

How. The policy, the task and the enumeration are exact_toy.py's, as in credit_exact.py: a tiny Llama over five
tokens (EOS and the digits 0-3) pre-trained briefly on a synthetic corpus, answering a two-digit prompt a b with digits
that add up to a + b, then EOS. ExactSampler draws from the current policy's enumerated tables (the same enumeration
that gives J; no forward pass), through the HF sampler's interface. Each setting trains through its script's own
functions, as its main() calls them (toy_training.py: advantages, attach_*, the loss, update_policy with the script's
AdamW, grad clipping and whitening; beta 0, fp32):
  grpo, grpo_mask             G responses per prompt; group_advantages, attach_targets, update_policy (mask off / on)
  spo_chain_int1, _int5       G responses; old_and_reference_logprobs, find_cutpoints, K = 9 MC continuations per
                              distinct cutpoint state, chain_advantages (mask on), attach_advantages, update_policy
  spo_tree_uniform, _depth    grow_trees (tree_depth 3 levels of b children, M = 2), tree_edges, sample_buffer (buffer
                              age 1, every edge taken), edge_weights(depth_weights) for --edge-weight depth as main
                              applies it, fill_samples (0: every edge once), attach_targets, update_policy
  ppo_lam1, ppo_lam0.96       G responses; make_critic (at the start), add_old_logprobs_and_values,
                              add_advantages_and_returns (GAE, gamma 1), update_policy (policy and critic on the same
                              batches: the critic trains online on the rollouts, so it samples nothing of its own)
Where a script's function cannot be driven as it is, the toy's equivalent stands in: SPO-chain's mc_values and
SPO-tree's grade_trees grade decoded text through plumbing/tasks.py, so the MC values are exact_toy.mc_state_values
(the same rule: identical states once, the rollout's remaining budget, an unfinished continuation 0) and the leaves
are rewarded by exact_toy.reward (unfinished: 0). Every iteration trains on every prompt once (the scripts draw
questions with replacement).
Equal budget: each setting gets the size (G, or SPO-tree's branch factor b) whose sampled tokens per prompt per
iteration (responses, MC continuations, tree nodes) on the start policy are closest to --budget
(exact_toy.pilot_costs); what each run actually spends is recorded per iteration. It changes as the policy
learns (SPO-chain makes fewer cutpoints and SPO-tree grows smaller trees as the policy sharpens), so the plot's
x axis is the cumulative measured spend, and J at a fraction of the iterations favours a setting that spends more.
Fairness: each setting's learning rate is chosen on --tuning-seeds (never reported) on a grid of --lrs 3x apart
(--lr-step) by --rate-rule: the highest median score (final J, or on an axis the area under J) among the rates below
the smallest at which a tuning seed collapsed (a run collapses when its J falls below half its start J:
measures.collapsed); the JSON
records the mean's and the median's choices too. A chosen value on the grid's edge extends the grid by one step on
that side and that value is run (at most --max-extensions times; recorded, as is a choice still on an edge). Then
every setting runs on the same --seeds at its learning rate; differences are paired by seed (comparison_pairs).
--reported-sweep runs every rate of the grid on the reported seeds too: score against rate per setting (a second
PNG) and the paired differences at every rate the settings share. Every finished run is cached (--run-cache) under
a key of its start policy, settings, code and machine, so a sweep cut short, or a case run again with another
length or grid, recomputes only the runs it has not made.
Reported (JSON): per setting the size, the measured tokens per iteration, J at 0, 25, 50 and 100 % of the
iterations (iteration ceil(25 %), ...) with 95 % bootstrap intervals over seeds, the final KL, the iterations to
reach J_0 + --gain (a run that never does counts as iterations + 1, so the mean is a lower bound; how many did is
reported); paired 95 % bootstrap intervals (seeds resampled, measures.paired_interval) of every setting minus
grpo and of spo_tree_depth minus spo_tree_uniform, for J at 25 / 50 / 100 % and the iterations to the gain; the
sweep; every run's curve (J, KL, tokens, and per iteration the batch's reward, SPO-chain's cutpoints, SPO-tree's
edges, PPO's critic error against the exact V). The PNG: mean J against cumulative sampled tokens per prompt with
95 % bootstrap bands over seeds, and the mean KL against iterations.

Defaults, and why. Horizon 6 (0.16 s per exact J of six prompts on one thread, against ~5 s at horizon 8): the six
prompts' start J is 0.18-0.83, mean 0.49. --budget 128 sampled tokens per prompt per iteration (G 39 for GRPO and
PPO, G 9 for int1 and 28 for int5 with K 9, b 6 for SPO-tree). One epoch and one optimizer step per iteration
(--minibatches 1): every setting makes the same number of AdamW steps, so the curves compare update directions per
sampled token, not step counts (with a batch size in sequences, SPO-tree's many short edges would make more steps
from the same tokens). The ratio is then 1 in every step: PPO-clip's clip never binds. A constant learning rate:
the scripts' warmup and linear decay to 0 would flatten every curve's end by construction. 30 iterations: at the
tuned learning rates most settings' mean J passes 0.9 within 10-25 iterations, so the last iterations show which
stay there (final J punishes late collapses), and J at 25 % and 50 % and the iterations to +0.25 show the speed
(+0.1 takes one to three iterations for all but one setting and separates little). Grid 3e-4, 1e-3, 3e-3, 1e-2:
on a pilot 1e-2 destabilised every setting (final J 0.11-0.67) and 3e-4 was slow for all (0.67-0.81), the best
being 1e-3 or 3e-3. Two tuning seeds, 20 reported seeds. Two worker processes of one torch thread each (a run's
result does not depend on which process runs it).

Cost. Measured at small size (horizon 6, 3 reported seeds, 1 tuning seed, 30 iterations, one process, one thread):
0.18-0.23 s per iteration (grpo 0.18, grpo_mask 0.20, int1 0.18, int5 0.19, tree uniform 0.19, depth 0.18,
ppo_lam1 0.22, ppo_lam0.96 0.23; up to 0.31 with the other core busy), 0.16 s of it the enumeration; that run took
345 s against its printed estimate of 330-420 s. The defaults run (4 x 2 + 20) x 30 = 840 iterations per setting,
6,720 in all (+960 if every grid were extended twice): about 11 minutes on 2 free cores (13 with every extension),
twice that on one. main() prints its own estimate from two timed iterations of each setting before it starts.

What it cannot say. A toy: horizon 6, five tokens, an 18,912-parameter policy, one start policy, responses of
1-6 tokens (mean 3.3 at the start); not LLM scale, where responses are hundreds of tokens and SPO's MC values cost
far more per segment. With segments of 2 tokens, int5 keeps about one cutpoint per response. J saturates near 1:
final J mostly measures stability. The critic's learning rate (--critic-lr) is fixed, not swept (its error against
the exact V falls from 0.42 to 0.004-0.03 over a run). Two tuning seeds make a noisy choice among learning rates 3x
apart. Spend per iteration is equal only at the start (see above).

The critical-token task and the token axis. --task critical (exact_toy.CRITICAL): three-bit prompts, and the
reward is 1 for the key bit (the prompt's first bit) followed by exactly --filler bits of any value and EOS, so one
early token decides the reward and credit given to the whole response spreads over --filler irrelevant tokens
(learning_critical.py sweeps --filler). --token-budget B stops every run at B sampled tokens per prompt, chooses each
setting's rate by the area under J against cumulative tokens to B (final J measures stability more than speed), and
reports J at B / 4, B / 2 and B interpolated per seed and the area; --common-lr adds every setting at one rate,
untuned (a setting tuned to it reuses its runs).

  python -m experiments.learning_exact                      # writes experiments/results/learning_exact.{json,png}
  python -m experiments.learning_exact --token-budget 2000 --iterations 64 --tuning-seeds 1000 1001 1002 1003 \
      --common-lr 1e-3 --out experiments/results/learning_exact_tokens.json   # the token axis
  python -m experiments.learning_exact --settings grpo spo_tree_uniform spo_tree_depth --seeds 0 1 2 --out /tmp/le.json
  python -m experiments.learning_exact --tiny --out /tmp/tiny.json   # seconds: what the tests run
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from experiments import exact_toy as toy
from experiments.measures import area_under, at_tokens, collapsed, in_steps, paired_interval, rounded
from experiments.toy_training import World, enumerate_policy, run_all, train_run
from plumbing import UsageError, cli, ranges


@dataclass
class Args:
    seeds: ranges.Seeds = field(default_factory=lambda: list(range(20)))
    """reported seeds: every setting trains once per seed from the same start policy (paired by seed)"""
    tuning_seeds: ranges.Seeds = field(default_factory=lambda: [1000, 1001])
    """seeds of the learning-rate sweep (must not be reported seeds)"""
    iterations: ranges.PositiveInt = 30
    """iterations per run: one rollout and that script's update each, then the exact J and KL (with --token-budget:
    the most a run may take)"""
    token_budget: ranges.NonNegativeInt = 0
    """B > 0: every run stops once it has sampled B tokens per prompt (cumulative), the learning rate is chosen by the
    area under J against cumulative tokens from 0 to B (not final J), and J is reported at B / 4, B / 2 and B,
    interpolated per seed; 0: iterations are the axis (the run's fractions, final J)"""
    samples: ranges.NonNegativeInt = 0
    """N > 0: the samples axis instead: every setting trains on N policy-gradient samples per prompt per iteration
    (GRPO, SPO-chain, PPO: G = N responses, MC continuations not counted; SPO-tree: the branch factor whose full tree
    has the number of edges closest to N, ties the smaller), every run makes --iterations optimizer steps, the rate is
    chosen by the area under J against steps, and J is reported at 1/4, 1/2 and all of the steps; --budget is unused"""
    budget_share: ranges.Fraction = 0.0
    """s > 0: the run's length (--token-budget B, or --iterations with --samples) is fixed from GRPO first: GRPO swept
    at the length given (provisional) on --tuning-seeds, then the length is where its mean curve at the chosen rate
    first reaches J0 + s (1 - J0), s of the reachable gain (the length given if it never does); every setting, GRPO
    included, is then tuned at that length"""
    min_iterations: ranges.NonNegativeInt = 0
    """with --budget-share: the length is at least this many iterations (steps on the samples axis; tokens: this x
    --budget), so a gain GRPO reaches in Adam's first few steps (each near lr x sign(gradient), whatever the
    gradient's quality) does not set a run too short to tell gradients apart"""
    common_lr: ranges.NonNegativeFloat = 0.0
    """> 0: every setting also runs at this one learning rate on the reported seeds (no tuning), reported beside"""
    budget: ranges.PositiveInt = 128
    """sampled tokens per prompt per iteration (responses, MC continuations, tree nodes): each setting gets the size
    whose cost on the start policy is closest"""
    settings: list[str] = field(default_factory=lambda: list(toy.SETTINGS))
    """settings to run (grpo is the reference of the differences)"""
    lrs: ranges.PositiveFloats = field(default_factory=lambda: [3e-4, 1e-3, 3e-3, 1e-2])
    """learning-rate grid of the sweep (the same for every setting)"""
    lr_step: ranges.bounded(float, 1, low_open=True) = 3.0
    """factor by which the grid is extended when a setting's best learning rate is at its edge (the new value rounded
    to 3 significant digits: a sqrt(3) grid from 1e-3 keeps 3e-3)"""
    rate_rule: Literal["median-no-collapse", "median", "mean"] = "median-no-collapse"
    """how the sweep chooses a rate from its tuning seeds' scores: median-no-collapse, the highest median among the
    rates below the smallest at which a tuning seed collapsed (measures.collapsed; the grid's smallest when that one
    is); median; mean. The JSON records every rule's choice"""
    reported_sweep: bool = False
    """every rate of each setting's grid also on the reported seeds: each rate's score per seed (plotted, area against
    rate) and the paired differences at every rate all settings share, beside tuned against tuned"""
    run_cache: str = "auto"
    """where every finished run is kept and read back by a later sweep that makes the same run (toy_training.run_key:
    start policy, settings, code, CPU, torch): auto ($SPO_CACHE/toy_runs, else ~/.cache/spo/toy_runs), none, or a
    directory"""
    max_extensions: ranges.NonNegativeInt = 2
    """at most this many extensions of the grid per setting"""
    gain: ranges.PositiveFloat = 0.25
    """the fixed gain over the start J whose first iteration is reported (at the tuned learning rates +0.1 takes
    1-3 iterations for nearly every setting and separates little)"""
    bootstrap: ranges.PositiveInt = 2000
    """bootstrap resamples of the seeds for the 95% intervals and the plot's bands"""
    out: str = "experiments/results/learning_exact.json"
    """results JSON (the PNG is written beside it)"""
    tiny: bool = False
    """a seconds-long run for the tests: horizon 4, two prompts, three seeds, four iterations, a two-value sweep
    (overrides those flags)"""
    workers: ranges.PositiveInt = 2
    """processes running the (setting, learning rate, seed) runs side by side, one torch thread each"""

    # The task and the policy (exact_toy's)
    task: Literal["sum", "critical"] = "sum"
    """sum: digits that add up to the prompt's (the default); critical: a key bit then --filler free bits, the reward
    decided by the first token (exact_toy.CRITICAL)"""
    filler: ranges.PositiveInt = 4
    """--task critical: free bits after the key bit (--horizon must be --filler + 2)"""
    filler_kind: Literal["coin", "confident"] = "coin"
    """--task critical: the corpus's filler bits, coin flips (every filler token uncertain) or nearly always 0 (the
    policy confident at every filler token, the key bit its one uncertain token: exact_toy.CRITICAL_FILLER_ONES)"""
    prompts: list[str] = field(default_factory=lambda: ["11", "12", "22", "13", "23", "33"])
    """prompts as two digits a b (0-3); the response's digits must add up to a + b (--task critical: three bits;
    the default there: all eight)"""
    horizon: ranges.PositiveInt = 6
    """response token budget (max new tokens); a response without EOS by then is unfinished and scores 0"""
    temperature: ranges.PositiveFloat = 0.6
    """sampling temperature; every log-prob divides the logits by it, as the scripts do"""
    prob_threshold: ranges.Probability = 0.9
    """tokens with p_t < prob_threshold are low-probability: SPO-chain's cutpoints and the probability mask"""
    policy_seed: ranges.Seed = 0
    """seed of the start policy's initialisation and pre-training corpus"""
    hidden_size: ranges.PositiveInt = 32
    """the tiny Llama's width (2 layers, 4 heads)"""
    pretrain_steps: ranges.NonNegativeInt = 500
    """pre-training steps on exact_toy's synthetic corpus
    (--task critical: more, up to 4x, until every prompt's length is right 0.9 of the time; exact_toy.make_policy)"""
    pretrain_batch: ranges.PositiveInt = 64
    """corpus sequences per pre-training step"""
    pretrain_lr: ranges.PositiveFloat = 3e-3
    """pre-training AdamW learning rate"""
    mistake_rate: ranges.Fraction = 0.7
    """share of corpus responses with one mistake"""

    # The algorithms
    mc_samples: ranges.PositiveInt = 9
    """SPO-chain's K: MC continuations per cutpoint state (the paper: 9)"""
    tree_depth: ranges.PositiveInt = 3
    """SPO-tree levels; the branch factor b of every level is what the budget sets"""
    segment_tokens: ranges.PositiveInt = 2
    """SPO-tree's M: new tokens per segment above the last level"""
    critic_lr: ranges.PositiveFloat = 3e-3
    """PPO's critic AdamW learning rate (credit_exact's pilot choice; not swept)"""
    value_clip_eps: ranges.PositiveFloat = 0.2
    """PPO: clipping of new values around the rollout's values in the value loss"""
    clip_eps: ranges.PositiveFloat = 0.2
    """PPO-clip epsilon of every policy loss"""
    max_grad_norm: ranges.PositiveFloat = 1.0
    """gradient clipping of every optimizer step (the scripts' default)"""
    minibatches: ranges.PositiveInt = 1
    """optimizer steps per iteration: the iteration's samples split into this many batches (one epoch)"""
    micro_batch_size: ranges.PositiveInt = 512
    """sequences per forward pass (memory only: the gradients do not depend on it)"""
    threads: ranges.PositiveInt = 1
    """torch CPU threads per process"""


TINY = dict(
    horizon=4,
    prompts=["21", "13"],
    seeds=[0, 1, 2],
    tuning_seeds=[100],
    iterations=4,
    budget=32,
    lrs=[1e-3, 1e-2],
    max_extensions=1,
    pretrain_steps=300,
    tree_depth=2,
    bootstrap=200,
    workers=1,
)

POLICY_FIELDS = (
    "task",
    "filler",
    "filler_kind",
    "prompts",
    "horizon",
    "temperature",
    "prob_threshold",
    "policy_seed",
    "hidden_size",
    "pretrain_steps",
    "pretrain_batch",
    "pretrain_lr",
    "mistake_rate",
    "mc_samples",
    "tree_depth",
    "segment_tokens",
    "micro_batch_size",
)


def toy_settings(args: Args) -> toy.ToySettings:
    """The toy's settings of this run: its task, policy and estimator settings, what make_policy and pilot_costs read
    (an online critic needs no rollouts of its own: critic_batches 0)."""
    return toy.ToySettings(
        **{name: getattr(args, name) for name in POLICY_FIELDS},
        budgets=[args.budget],
        intervals=sorted({o["interval"] for f, o in toy.SETTINGS.values() if f == "spo_chain"}),
        lams=[1.0],
        critic_batches=0,
    )


# ----------------------------------------------------------------------------------------------
# Sizes and the learning-rate sweep


def closest_size(cost, budget: float, smallest: int) -> int:
    """The size whose pilot cost is closest to the budget (ties: the smaller): G = the multiple of a cost per response
    nearest the budget, or the measured size nearest it; at least `smallest`.

    >>> closest_size(3.5, 128, 2), closest_size(3.5, 2, 2), closest_size({2: 40.0, 3: 100.0, 4: 150.0}, 128, 2)
    (37, 2, 4)
    """
    if isinstance(cost, dict):
        fitting = [size for size in cost if size >= smallest] or [max(cost)]
        return min(fitting, key=lambda size: (abs(cost[size] - budget), size))
    below = max(smallest, math.floor(budget / cost))
    return min((below, below + 1), key=lambda size: (abs(size * cost - budget), size))


def tree_size_for(samples: int, depth: int) -> int:
    """SPO-tree's branch factor b on the samples axis: the one whose full tree of `depth` levels has the number of
    edges (b + b^2 + ... + b^depth, each one a policy-gradient sample) closest to `samples` (ties: the smaller); at
    least 2.

    >>> tree_size_for(16, 3), tree_size_for(32, 3), tree_size_for(64, 3), tree_size_for(16, 2)
    (2, 3, 4, 3)
    """
    return min(range(2, samples + 2), key=lambda b: (abs(sum(b**d for d in range(1, depth + 1)) - samples), b))


def plan_sizes(exacts: list[toy.Exact], names: list[str], args: Args) -> tuple[dict[str, int], dict]:
    """Each setting's size from exact_toy.pilot_costs on the start policy (GRPO and PPO: G from the exact expected
    response length; SPO-chain: G with K MC samples, drawn; SPO-tree: the branch factor, drawn) and those costs; on
    the samples axis (--samples N) G = N and SPO-tree's b = tree_size_for(N) (the costs still recorded)."""
    costs = toy.pilot_costs(exacts, toy_settings(args))
    sizes = {}
    for name in names:
        family, options = toy.SETTINGS[name]
        if args.samples:
            sizes[name] = tree_size_for(args.samples, args.tree_depth) if family == "spo_tree" else args.samples
        elif family == "spo_chain":
            sizes[name] = closest_size(costs[f"spo_chain_int{options['interval']}"], args.budget, 1)
        elif family == "spo_tree":
            sizes[name] = closest_size(costs["spo_tree"], args.budget, 2)
        else:  # PPO's online critic samples nothing of its own: it costs what GRPO's responses cost
            sizes[name] = closest_size(costs["grpo"], args.budget, 2)
    return sizes, costs


def token_marks(budget: int) -> dict[str, float]:
    """The token budgets at which J is reported with --token-budget: B / 4, B / 2, B.

    >>> token_marks(400)
    {'25%': 100.0, '50%': 200.0, '100%': 400.0}
    """
    return {f"{p}%": budget * p / 100 for p in (25, 50, 100)}


def axis_length(args: Args) -> int:
    """How far every run goes on the axis the areas are taken on: B sampled tokens per prompt (--token-budget), or the
    steps (--iterations) on the samples axis; 0 on the iterations axis (no area: final J)."""
    return args.token_budget or (args.iterations if args.samples else 0)


def on_axis(curve: dict, args: Args) -> dict:
    """The run as the area sees it: its tokens per iteration, or on the samples axis one step per iteration
    (measures.in_steps)."""
    return in_steps(curve) if args.samples else curve


def rate_score(curve: dict, args: Args) -> float:
    """What the sweep maximises for one run: its area under J to the axis length (tokens, or steps on the samples
    axis), or on the iterations axis its final J."""
    return area_under(on_axis(curve, args), axis_length(args)) if axis_length(args) else curve["J"][-1]


def length_from_grpo(curves: list[dict], args: Args) -> dict:
    """--budget-share s: the axis length at which the mean of GRPO's `curves` (its tuning runs at the chosen rate,
    from the provisional length) first reaches J0 + s (1 - J0): tokens rounded up to a whole token, or whole steps;
    the provisional length where it never does; at least --min-iterations iterations' worth, at most the provisional.

    >>> runs = [{"J": [0.5, 0.6, 0.9], "tokens": [10.0, 10.0]}, {"J": [0.5, 0.8, 0.9], "tokens": [10.0, 10.0]}]
    >>> length_from_grpo(runs, replace(Args(), token_budget=20, budget_share=0.5))["length"]  # 0.75 at 12.5 tokens
    13
    >>> length_from_grpo(runs, replace(Args(), samples=4, iterations=2, budget_share=0.5))["length"]
    2
    >>> length_from_grpo(runs, replace(Args(), token_budget=20, budget=8, budget_share=0.5, min_iterations=2))
    {'provisional': 20, 'J0': 0.5, 'target_J': 0.75, 'reached': True, 'crossing': 13, 'length': 16}
    """
    provisional, start = axis_length(args), float(np.mean([run["J"][0] for run in curves]))
    target = start + args.budget_share * (1 - start)
    grid = np.arange(provisional + 1, dtype=float) if args.samples else np.linspace(0, provisional, 4001)
    mean = np.mean([at_tokens(on_axis(run, args), grid) for run in curves], axis=0)
    reached = np.flatnonzero(mean >= target - 1e-12)
    crossing = math.ceil(grid[reached[0]] - 1e-9) if len(reached) else provisional
    floor = args.min_iterations * (1 if args.samples else args.budget)
    return {
        "provisional": provisional,
        "J0": start,
        "target_J": target,
        "reached": bool(len(reached)),
        "crossing": crossing,
        "length": min(max(crossing, floor), provisional),
    }


RATE_RULES = ("median-no-collapse", "median", "mean")


def choose_rate(scores: dict[float, list[float]], collapses: dict[float, list[bool]], rule: str) -> float:
    """The learning rate a sweep chooses from its tuning seeds' scores (final J, or the area under J on the axis) and
    collapses (ties: the smaller rate). mean: the highest mean; median: the highest median; median-no-collapse (the
    default): the highest median among the rates below the smallest one at which a tuning seed collapsed (the grid's
    smallest when that one is), since a rate above one that broke a seed is taken to break seeds too. Why: the mean
    over few seeds picks the fastest rate that survives them (a rate that breaks on 20 % of seeds survives 3 with
    probability 0.51), the median alone keeps a rate at which 2 of 5 seeds broke, and the largest rate without a
    collapse can be slower than a smaller one.

    >>> scores = {1e-3: [0.5, 0.6, 0.6], 3e-3: [0.8, 0.8, 0.25], 1e-2: [0.2, 0.9, 0.9]}
    >>> collapses = {1e-3: [False] * 3, 3e-3: [False, False, True], 1e-2: [False] * 3}
    >>> [choose_rate(scores, collapses, rule) for rule in ("mean", "median", "median-no-collapse")]
    [0.01, 0.01, 0.001]
    """
    if rule not in RATE_RULES:
        raise UsageError(f"--rate-rule {rule}: choose from {' '.join(RATE_RULES)}")
    rates = sorted(scores)
    if rule == "median-no-collapse":
        first = next((lr for lr in rates if any(collapses[lr])), math.inf)  # the smallest rate that broke a seed
        rates = [lr for lr in rates if lr < first] or rates[:1]
    average = np.median if rule != "mean" else np.mean
    return max(rates, key=lambda lr: (float(average(scores[lr])), -lr))


def extension(grid: list[float], best: float, step: float) -> tuple[str, float] | None:
    """Where the grid must grow when its best value sits on an edge: ("low", min / step) or ("high", max * step),
    rounded to 3 significant digits; None when the best is inside.

    >>> extension([1e-3, 3e-3, 1e-2], 3e-3, 3.0), extension([1e-3, 3e-3], 1e-3, 3.0)[0]
    (None, 'low')
    >>> extension([1e-3, 1.73e-3, 3e-3, 5.2e-3], 5.2e-3, 3**0.5), extension([1e-3, 3e-3], 1e-3, 3**0.5)
    (('high', 0.00901), ('low', 0.000577))
    """
    if best == min(grid):
        return "low", float(f"{min(grid) / step:.3g}")
    if best == max(grid):
        return "high", float(f"{max(grid) * step:.3g}")
    return None


def sweep(names: list[str], world: World, args: Args) -> dict[str, dict]:
    """Each setting's learning rate: every value of the grid on every tuning seed, chosen by --rate-rule from each
    run's rate_score (final J, or on an axis the area under J) and whether it collapsed; a chosen value on the grid's
    edge extends the grid by one step on that side and the new value is run (at most args.max_extensions times).
    Returns per setting the grid, each value's scores and collapses per tuning seed, every rule's choice and the
    one made, the extensions made and whether the choice is still on an edge."""
    results = {name: {"final_J": {}, "collapses": {}, "extensions": [], "curves": []} for name in names}
    pending = [(name, lr) for name in names for lr in args.lrs]
    for round_ in range(args.max_extensions + 1):
        jobs = [(name, lr, seed) for name, lr in pending for seed in args.tuning_seeds]
        for (name, lr, _), curve in zip(jobs, run_all(jobs, world, args)):
            results[name]["final_J"].setdefault(lr, []).append(rate_score(curve, args))
            results[name]["collapses"].setdefault(lr, []).append(collapsed(curve))
            results[name]["curves"].append(curve)
        pending = []
        for name in names:
            entry = results[name]
            entry["choices"] = {rule: choose_rate(entry["final_J"], entry["collapses"], rule) for rule in RATE_RULES}
            entry["chosen"] = entry["choices"][args.rate_rule]
            grow = extension(list(entry["final_J"]), entry["chosen"], args.lr_step)
            entry["at_edge"] = grow is not None
            if grow and round_ < args.max_extensions:
                entry["extensions"].append({"round": round_ + 1, "side": grow[0], "lr": grow[1]})
                pending.append((name, grow[1]))
        if not pending:
            break
    score = "auc" if axis_length(args) else "final_J"  # what the choice maximised, in the JSON
    for entry in results.values():
        entry["grid"] = sorted(entry["final_J"])
        by_lr, collapses = entry.pop("final_J"), entry.pop("collapses")
        entry[score] = {f"{lr:g}": by_lr[lr] for lr in entry["grid"]}
        entry[f"mean_{score}"] = {lr: float(np.mean(values)) for lr, values in entry[score].items()}
        entry[f"median_{score}"] = {lr: float(np.median(values)) for lr, values in entry[score].items()}
        entry["collapses"] = {f"{lr:g}": int(sum(collapses[lr])) for lr in entry["grid"]}
    return results


def comparison_pairs(names: list[str]) -> list[tuple[str, str]]:
    """The paired differences reported, (a, b) for a - b: every setting against grpo, spo_tree_depth against
    spo_tree_uniform, SPO-chain against GRPO + mask whitened the same way (with confident filler int1 is GRPO + mask
    with an MC baseline), and each scale-only whitening variant against its centre-scale setting.

    >>> comparison_pairs(["grpo", "grpo_mask", "spo_chain_int1", "spo_chain_int1_scale"])[3:]
    [('spo_chain_int1', 'grpo_mask'), ('spo_chain_int1_scale', 'spo_chain_int1')]
    """
    pairs = [(name, "grpo") for name in names if name != "grpo" and "grpo" in names]
    if {"spo_tree_depth", "spo_tree_uniform"} <= set(names):
        pairs.append(("spo_tree_depth", "spo_tree_uniform"))
    for name in names:  # against GRPO + mask whitened the same way
        mask = "grpo_mask_scale" if name.endswith("_scale") else "grpo_mask"
        if name.startswith("spo_chain") and mask in names:
            pairs.append((name, mask))
    pairs += [
        (name, name.removesuffix("_scale")) for name in names if name.removesuffix("_scale") in set(names) - {name}
    ]
    return pairs


def rate_table(by_rate: dict[str, dict[float, list[dict]]], swept: dict, args: Args) -> dict:
    """--reported-sweep: per setting and rate of its grid, the reported seeds' scores (rate_score) and collapses, the
    tuning seeds' mean and median beside them; per rate every setting ran, the paired differences of the scores
    (comparison_pairs, measures.paired_interval) on the reported seeds."""
    scores = {
        name: {lr: np.array([rate_score(run, args) for run in runs]) for lr, runs in rates.items()}
        for name, rates in by_rate.items()
    }
    score = "auc" if axis_length(args) else "final_J"
    table = {
        name: {
            f"{lr:g}": {
                "scores": scores[name][lr].tolist(),
                "mean": paired_interval(scores[name][lr], np.zeros(len(scores[name][lr])), args.bootstrap, seed=0),
                "collapses": int(sum(collapsed(run) for run in by_rate[name][lr])),
                "tuning_mean": swept[name][f"mean_{score}"][f"{lr:g}"],
                "tuning_median": swept[name][f"median_{score}"][f"{lr:g}"],
                "chosen": lr == swept[name]["chosen"],
            }
            for lr in sorted(scores[name])
        }
        for name in scores
    }
    common = sorted(set.intersection(*(set(rates) for rates in scores.values())))
    at_common = {
        f"{lr:g}": {
            f"{a} - {b}": paired_interval(scores[a][lr], scores[b][lr], args.bootstrap, seed=0)
            for a, b in comparison_pairs(list(scores))
        }
        for lr in common
    }
    return {"score": score, "by_setting": table, "at_common_rates": at_common}


# ----------------------------------------------------------------------------------------------
# Summaries: J at fractions of the run, iterations to a gain, paired bootstrap intervals


def checkpoints_of(iterations: int) -> dict[str, int]:
    """The iterations at which J is reported: ceil(25 %), ceil(50 %) and 100 % of the run.

    >>> checkpoints_of(30), checkpoints_of(4)
    ({'25%': 8, '50%': 15, '100%': 30}, {'25%': 1, '50%': 2, '100%': 4})
    """
    return {f"{p}%": math.ceil(iterations * p / 100) for p in (25, 50, 100)}


def iterations_to_gain(curve: list[float], gain: float) -> int:
    """The first iteration t >= 1 with J_t >= J_0 + gain; a run that never gets there counts as len(curve) (the
    run's iterations + 1: censored, so a mean over runs is a lower bound when some never reach it).

    >>> iterations_to_gain([0.3, 0.35, 0.41, 0.5], 0.1), iterations_to_gain([0.3, 0.35, 0.3], 0.1)
    (2, 3)
    """
    return next((t for t in range(1, len(curve)) if curve[t] >= curve[0] + gain - 1e-12), len(curve))


def bootstrap_band(matrix: np.ndarray, resamples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds (rows) of each column and its 95 % percentile bootstrap band (seeds resampled with
    replacement, whole rows at a time).

    >>> mean, low, high = bootstrap_band(np.array([[0.0, 1.0], [2.0, 1.0]]), 200)
    >>> mean.tolist(), low.tolist(), high.tolist()
    ([1.0, 1.0], [0.0, 1.0], [2.0, 1.0])
    """
    draws = np.random.default_rng(seed).integers(len(matrix), size=(resamples, len(matrix)))  # [resamples, seeds]
    means = matrix[draws].mean(axis=1)  # [resamples, columns]
    low, high = np.percentile(means, [2.5, 97.5], axis=0)
    return matrix.mean(axis=0), low, high


def summarise(curves: dict[str, list[dict]], args: Args) -> tuple[dict, dict]:
    """Per setting: tokens spent per iteration, J at 0 / 25 / 50 / 100 % with 95 % intervals, the final KL, and the
    iterations to +gain (mean with the censored rule, median, runs that reached it). Differences, paired by seed
    ([mean, low, high], measures.paired_interval): every setting minus grpo and spo_tree_depth minus
    spo_tree_uniform, of J at 25 / 50 / 100 % and of the iterations to +gain."""
    summary, columns = {}, {}
    for name, runs in curves.items():
        if axis_length(args):  # J at 1/4, 1/2 and all of B tokens (or of the steps), each run interpolated
            at = {
                mark: np.array([float(at_tokens(on_axis(r, args), t)) for r in runs])
                for mark, t in token_marks(axis_length(args)).items()
            }
            at["auc"] = np.array([rate_score(r, args) for r in runs])
        else:
            J = np.array([run["J"] for run in runs])  # [seeds, iterations + 1]
            at = {mark: J[:, t] for mark, t in checkpoints_of(args.iterations).items()}
        reach = np.array([iterations_to_gain(run["J"], args.gain) for run in runs], dtype=float)
        columns[name] = at | {"iterations_to_gain": reach}
        summary[name] = {
            "tokens_per_iteration": float(np.mean(np.concatenate([run["tokens"] for run in runs]))),
            "iterations": float(np.mean([len(run["J"]) - 1 for run in runs])),
            "tokens_first_last_iteration": [
                float(np.mean([r["tokens"][0] for r in runs])),
                float(np.mean([r["tokens"][-1] for r in runs])),
            ],
            "J0": float(np.mean([run["J"][0] for run in runs])),
            **{
                f"J_{mark}" if mark != "auc" else "auc": paired_interval(
                    values, np.zeros(len(values)), args.bootstrap, seed=0
                )
                for mark, values in at.items()
            },
            "kl_final": float(np.mean([run["kl"][-1] for run in runs])),
            "iterations_to_gain": {
                "mean_censored": float(reach.mean()),
                "median": float(np.median(reach)),
                "reached": int((reach < np.array([len(run["J"]) for run in runs])).sum()),
                "runs": len(reach),
            },
        }
    pairs = comparison_pairs(list(curves))
    differences = {
        f"{a} - {b}": {
            measure: paired_interval(columns[a][measure], columns[b][measure], args.bootstrap, seed=0)
            for measure in columns[a]
        }
        for a, b in pairs
    }
    return summary, differences


def time_iteration(name: str, world: World, args: Args) -> float:
    """Seconds per iteration of one setting: a two-iteration run at the grid's middle learning rate (discarded)."""
    curve, _ = train_run(name, args.lrs[len(args.lrs) // 2], args.tuning_seeds[0], world, replace(args, iterations=2))
    return curve["seconds"] / 2


def run_estimate(timing: dict[str, float], args: Args) -> tuple[float, float]:
    """Seconds the sweep and the reported runs will take on args.workers processes: without any extension of the
    grid, and with args.max_extensions for every setting (with --token-budget: B / --budget iterations a run).

    >>> run_estimate({"grpo": 0.2}, replace(Args(), seeds=[0, 1], tuning_seeds=[5], lrs=[1e-3], max_extensions=1,
    ...                                     iterations=10, workers=2))
    (3.0, 4.0)
    """
    iterations = (
        min(args.iterations, math.ceil(args.token_budget / args.budget)) if args.token_budget else args.iterations
    )
    per_run = sum(timing.values()) * iterations / args.workers
    reported = len(args.lrs) if args.reported_sweep else 1  # --reported-sweep: the whole grid on the reported seeds
    runs = len(args.lrs) * len(args.tuning_seeds) + len(args.seeds) * (reported + (1 if args.common_lr else 0))
    extended = args.max_extensions * (len(args.tuning_seeds) + (len(args.seeds) if args.reported_sweep else 0))
    return per_run * runs, per_run * (runs + extended)


# ----------------------------------------------------------------------------------------------
# Results: plot, table


def plot(results: dict, path: Path) -> None:
    """Left: mean exact J against the cumulative sampled tokens per prompt (the mean over seeds of each run's own
    spend), 95 % bootstrap band over seeds; right: the mean exact KL to the start policy against iterations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6), layout="constrained")
    settings = results["settings"]
    steps = bool(settings.get("samples"))  # the samples axis: x is optimizer steps
    budget = settings.get("token_budget") or (settings["iterations"] if steps else 0)
    for name, runs in results["curves"].items():
        color, style = toy.PALETTE.get(name, (None, "-"))
        if steps:
            runs = [in_steps(run) for run in runs]
        if budget:  # every run on one grid from 0 to B tokens or steps (runs end at different iterations)
            tokens = np.linspace(0, budget, 65)
            J = np.array([at_tokens(run, tokens) for run in runs])  # [seeds, grid]
            kl = np.array([at_tokens(run, tokens, "kl") for run in runs]).mean(axis=0)
        else:
            J = np.array([run["J"] for run in runs])  # [seeds, iterations + 1]
            tokens = np.concatenate([[0.0], np.cumsum(np.mean([run["tokens"] for run in runs], axis=0))])
            kl = np.mean([run["kl"] for run in runs], axis=0)
        mean, low, high = bootstrap_band(J, results["settings"]["bootstrap"])
        row = results["summary"][name]
        size = f"{'b' if toy.SETTINGS[name][0] == 'spo_tree' else 'G'} {row['size']}"
        label = f"{name} ({size}, lr {row['lr']:g}, {row['tokens_per_iteration']:.0f} tokens/iteration)"
        left.plot(tokens, mean, color=color, linestyle=style, label=label)
        left.fill_between(tokens, low, high, color=color, alpha=0.12)
        right.plot(tokens if budget else np.arange(len(kl)), kl, color=color, linestyle=style, label=name)
    axis = "optimizer steps" if steps else "sampled tokens per prompt (cumulative)"
    left.set(xlabel=axis, ylabel="exact expected reward J", title="J")
    right.set(
        xlabel=axis if budget else "iteration",
        ylabel="exact KL(pi || pi_start) per response",
        title="KL to the start policy",
    )
    left.legend(fontsize=8)
    for axis in (left, right):
        axis.grid(alpha=0.3)
    per_iteration = (
        f"{settings['samples']} samples" if steps else f"~{settings['budget']} sampled tokens"
    ) + " per prompt per iteration"
    fig.suptitle(
        f"Learning on the exact expected reward ({settings.get('task', 'sum')} task): tiny Llama, horizon "
        f"{settings['horizon']}, {len(settings['prompts'])} prompts, {per_iteration}, "
        f"{len(settings['seeds'])} seeds (mean, 95% bootstrap band over seeds)",
        fontsize=11,
    )
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def plot_rates(results: dict, path: Path) -> None:
    """--reported-sweep: each setting's score (the area under J on the axis, or final J) against the learning rate,
    mean over the reported seeds with its 95 % bootstrap interval, the tuning seeds' median dashed, the chosen rate
    circled, and the number of collapsed reported runs beside each point that has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = results["reported_sweep"]
    fig, axis = plt.subplots(figsize=(8, 5.5), layout="constrained")
    for name, by_lr in rates["by_setting"].items():
        color, style = toy.PALETTE.get(name, (None, "-"))
        lrs = [float(lr) for lr in by_lr]
        means = np.array([row["mean"] for row in by_lr.values()])  # [rates, 3]
        axis.errorbar(
            lrs,
            means[:, 0],
            yerr=[means[:, 0] - means[:, 1], means[:, 2] - means[:, 0]],
            color=color,
            linestyle=style,
            marker="o",
            markersize=3,
            capsize=2,
            label=name,
        )
        axis.plot(lrs, [row["tuning_median"] for row in by_lr.values()], color=color, linestyle=":", alpha=0.5)
        for lr, row, mean in zip(lrs, by_lr.values(), means[:, 0]):
            if row["chosen"]:
                axis.plot(lr, mean, marker="o", markersize=10, markerfacecolor="none", color=color)
            if row["collapses"]:
                axis.annotate(
                    str(row["collapses"]),
                    (lr, mean),
                    fontsize=7,
                    color=color,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
    axis.set_xscale("log")
    what = "final J" if rates["score"] == "final_J" else "area under J / length"
    axis.set(
        xlabel="learning rate",
        ylabel=f"{what} (reported seeds, mean, 95 % CI)",
        title="Rate sweep on the reported seeds (dotted: tuning seeds' median; circled: chosen; "
        "numbers: collapsed runs)",
    )
    axis.title.set_fontsize(9)
    axis.legend(fontsize=7)
    axis.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_table(results: dict, summary: dict | None = None, differences: dict | None = None) -> None:
    """One line per setting: size, spend, learning rate, J at 0 / 25 / 50 / 100 % (of the iterations, or with
    --token-budget of B tokens), final - grpo, iterations to gain. `summary` and `differences`: another set's (the
    common rate's); default the results' own."""
    summary = summary or results["summary"]
    differences = differences or results["differences"]
    gain = results["settings"]["gain"]
    print(
        f"\n{'setting':<22}{'size':>6}{'tok/it':>8}{'lr':>9}{'J0':>7}{'J25%':>7}{'J50%':>7}{'J100%':>7}"
        f"{'  final - grpo [95% CI]':<30}{f'iters to +{gain:g} (reached)':>24}"
    )
    for name, row in summary.items():
        edge = "!" if row["lr"] == results["sweep"][name]["chosen"] and results["sweep"][name]["at_edge"] else ""
        diff = differences.get(f"{name} - grpo", {}).get("100%")
        interval = f"  {diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]" if diff else ""
        reach = row["iterations_to_gain"]
        print(
            f"{name:<22}{row['size']:>6}{row['tokens_per_iteration']:>8.0f}{row['lr']:>8.0e}{edge:1}{row['J0']:>7.3f}"
            f"{row['J_25%'][0]:>7.3f}{row['J_50%'][0]:>7.3f}{row['J_100%'][0]:>7.3f}{interval:<30}"
            f"{reach['mean_censored']:>16.1f} ({reach['reached']}/{reach['runs']})"
        )
    for key, entry in differences.items():
        if not key.endswith(" - grpo"):
            diff = entry["100%"]
            print(f"{key}, final J: {diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]")
    if any(entry["at_edge"] for entry in results["sweep"].values()):
        print("(! the chosen learning rate is still at the edge of the widened grid)")
    if results["settings"].get("samples"):
        print(f"(J25% / J50% / J100%: J after 1/4, 1/2 and all of {results['settings']['iterations']} optimizer steps)")
    elif results["settings"].get("token_budget"):
        print(
            f"(J25% / J50% / J100%: J after 1/4, 1/2 and all of {results['settings']['token_budget']} sampled tokens "
            "per prompt; final - grpo: at the budget)"
        )


def validate(args: Args) -> None:
    """Every problem with the settings in one UsageError line, before anything is built."""
    problems = ranges.problems(args) + toy.task_problems(args)  # every number against its field's range; the task
    if (args.tree_depth - 1) * args.segment_tokens >= args.horizon:
        problems.append(
            "the levels above SPO-tree's last ((--tree-depth - 1) x --segment-tokens) must be shorter than --horizon"
        )
    if args.hidden_size % 4:
        problems.append(f"--hidden-size ({args.hidden_size}) must be a multiple of 4 (the tiny Llama's heads)")
    unknown = [name for name in args.settings if name not in toy.SETTINGS]
    if unknown or not args.settings:
        problems.append(f"--settings {' '.join(unknown)}: choose from {' '.join(toy.SETTINGS)}")
    if set(args.seeds) & set(args.tuning_seeds):
        problems.append("--tuning-seeds must differ from --seeds (the reported runs)")
    if args.samples and args.token_budget:
        problems.append("--samples and --token-budget are two axes: give one (steps on the samples axis: --iterations)")
    if args.budget_share and not axis_length(args):
        problems.append("--budget-share fixes the length of an axis: give --token-budget or --samples with it")
    if args.budget_share and "grpo" not in args.settings:
        problems.append("--budget-share fixes the length from GRPO's curve: keep grpo in --settings")
    if problems:
        raise UsageError("; ".join(problems))


# ----------------------------------------------------------------------------------------------
# Main


def main(args: Args) -> dict:
    # taken before anything runs: the code that ran, not the checkout at the end
    code = toy.machine(*toy.LEARNING_EXACT_CODE)
    if args.tiny:
        args = dataclasses.replace(args, **TINY)
    args = toy.task_defaults(args)
    validate(args)
    given = asdict(args)  # the settings as given, before --budget-share fixes the length
    torch.set_num_threads(args.threads)
    started, seconds = time.time(), {}
    names = list(dict.fromkeys(args.settings))

    # 1. The start policy (exact_toy's, pre-trained on its corpus), its exact tables, each setting's size.
    model, pretrain_loss, pretrain_steps = toy.make_policy(toy_settings(args))
    exacts = enumerate_policy(model, args)
    sizes, costs = plan_sizes(exacts, names, args)
    world = World(model, exacts, sizes)
    seconds["setup"] = time.time() - started

    # 2. Cost: two iterations of every setting (discarded), and the whole run's estimate from them.
    step = time.time()
    timing = {name: time_iteration(name, world, args) for name in names}
    estimate = run_estimate(timing, args)
    seconds["timing"] = time.time() - step
    print(
        "seconds per iteration: " + ", ".join(f"{name} {cost:.2f}" for name, cost in timing.items()) + "; estimate: "
        f"{estimate[0] / 60:.1f}-{estimate[1] / 60:.1f} minutes on {args.workers} worker(s) (no grid extension - "
        f"{args.max_extensions} for every setting)",
        flush=True,
    )

    # 2b. With --budget-share: the axis length from GRPO, swept at the length given (provisional).
    length = None
    if args.budget_share:
        step = time.time()
        provisional = sweep(["grpo"], world, args)["grpo"]
        chosen = [curve for curve in provisional["curves"] if curve["lr"] == provisional["chosen"]]
        length = {"grpo_lr": provisional["chosen"], **length_from_grpo(chosen, args)}
        args = replace(args, **{"iterations" if args.samples else "token_budget": length["length"]})
        seconds["length"] = time.time() - step
        print(
            f"length from GRPO (lr {length['grpo_lr']:g}): {length['length']} {'steps' if args.samples else 'tokens'} "
            f"({'reaches' if length['reached'] else 'never reaches, provisional kept:'} J {length['target_J']:.3f}"
            f" at {length['crossing']}; at least {args.min_iterations} iterations' worth)",
            flush=True,
        )

    # 3. Each setting's learning rate from the sweep on the tuning seeds.
    step = time.time()
    swept = sweep(names, world, args)
    seconds["sweep"] = time.time() - step
    print(f"sweep done, {time.time() - started:.0f}s: " + ", ".join(f"{n} {s['chosen']:g}" for n, s in swept.items()))

    # 4. The reported runs: every setting at its learning rate on every reported seed.
    step = time.time()
    jobs = [(name, swept[name]["chosen"], seed) for name in names for seed in args.seeds]
    curves: dict[str, list[dict]] = {name: [] for name in names}
    for (name, _, _), curve in zip(jobs, run_all(jobs, world, args)):
        curves[name].append(curve)
    seconds["runs"] = time.time() - step

    # 4b. With --common-lr: every setting at that one rate on the same seeds (no tuning); a setting tuned to that rate
    # has run it already (a run is a function of its setting, rate and seed).
    common = {}
    if args.common_lr:
        tuned_there = {name for name in names if swept[name]["chosen"] == args.common_lr}
        jobs = [(name, args.common_lr, seed) for name in names if name not in tuned_there for seed in args.seeds]
        common_curves = {name: list(curves[name]) if name in tuned_there else [] for name in names}
        for (name, _, _), curve in zip(jobs, run_all(jobs, world, args)):
            common_curves[name].append(curve)
        common_summary, common_differences = summarise(common_curves, args)
        for name in names:
            common_summary[name] = {"size": sizes[name], "lr": args.common_lr, **common_summary[name]}
        common = {"lr": args.common_lr, "summary": common_summary, "differences": common_differences}
        common["curves"] = common_curves

    # 4c. With --reported-sweep: every other rate of each setting's grid on the reported seeds too.
    rates = None
    if args.reported_sweep:
        step = time.time()
        by_rate = {name: {swept[name]["chosen"]: curves[name]} for name in names}
        jobs = [
            (name, lr, seed)
            for name in names
            for lr in swept[name]["grid"]
            if lr not in by_rate[name]
            for seed in args.seeds
        ]
        for (name, lr, _), curve in zip(jobs, run_all(jobs, world, args)):
            by_rate[name].setdefault(lr, []).append(curve)
        rates = rate_table(by_rate, swept, args)
        seconds["reported_sweep"] = time.time() - step

    # 5. Summaries, intervals, JSON and PNG.
    summary, differences = summarise(curves, args)
    for name in names:
        summary[name] = {"size": sizes[name], "lr": swept[name]["chosen"], **summary[name]}
    seconds["total"] = time.time() - started
    results = rounded(
        {
            "command": " ".join(["python", "-m", "experiments.learning_exact", *sys.argv[1:]]),
            "settings": asdict(args),
            "given_settings": given,
            "machine": code,
            "seconds": seconds,
            "seconds_per_iteration": timing,
            "estimate_seconds": estimate,
            "policy": {
                "pretrain_loss": pretrain_loss,
                "pretrain_steps": pretrain_steps,  # --task critical: more than --pretrain-steps where the length asked
                "parameters": sum(p.numel() for p in model.parameters()),
                "expected_reward": toy.expected_reward(exacts),
                "prompts": {text: float(exact.values[0][0]) for text, exact in zip(args.prompts, exacts)},
                "expected_length": float(np.mean([exact.expected_length() for exact in exacts])),
                # --task critical: per prompt, the probability that a response has the length the reward asks for
                "length_right": (
                    {text: toy.length_right(exact, args.filler) for text, exact in zip(args.prompts, exacts)}
                    if args.task == "critical"
                    else None
                ),
                # per response position, mean over prompts: the true |A*| and the share of low-probability tokens
                "position_map": {
                    key: np.mean([exact.position_map(args.prob_threshold)[key] for exact in exacts], axis=0).tolist()
                    for key in ("abs_advantage", "low_probability")
                },
            },
            "length_from_grpo": length,
            "pilot_costs": {
                name: ({str(b): c for b, c in cost.items()} if isinstance(cost, dict) else cost)
                for name, cost in costs.items()
            },
            "sizes": sizes,
            "checkpoints": token_marks(axis_length(args)) if axis_length(args) else checkpoints_of(args.iterations),
            "sweep": {name: {k: v for k, v in entry.items() if k != "curves"} for name, entry in swept.items()},
            "summary": summary,
            "differences": differences,
            "curves": curves,
            "sweep_curves": {name: entry["curves"] for name, entry in swept.items()},
            "common_rate": common,
            "reported_sweep": rates,
        }
    )
    output = Path(args.out)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    plot(results, output.with_suffix(".png"))
    if rates:
        plot_rates(results, output.with_name(f"{output.stem}_rates.png"))
    print_table(results)
    if common:
        print(f"\nevery setting at the common learning rate {args.common_lr:g} (no tuning):")
        print_table(results, results["common_rate"]["summary"], results["common_rate"]["differences"])
    print(f"{seconds['total']:.0f}s -> {output} and {output.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    cli.run_cli(main, ranges.cli(Args))
