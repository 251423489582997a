"""Training on the exact toy (exact_toy.py), what learning_exact.py measures: one setting trained from the start
policy through its script's own functions (grpo_baseline's, spo_chain's, spo_tree's, ppo_baseline's), with the exact
expected reward J and the exact KL to the start policy after every update, and many such runs side by side in worker
processes. Which functions each setting calls, and where the toy's equivalent stands in for a script's: the docstring
of learning_exact.py. `args` in every function here is learning_exact's Args.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import multiprocessing
import platform
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from experiments import exact_toy as toy
from plumbing import UsageError, bookkeeping, files, models, precision
from plumbing.precision import FP32
from plumbing.training import make_optimizer, reseed, sample_logprobs

# ----------------------------------------------------------------------------------------------
# The exact answer after every update: J and the KL to the start policy, by enumeration


def enumerate_policy(model, args) -> list[toy.Exact]:
    """exact_toy.enumerate_prompts: the current policy's exact tables and values for every prompt."""
    model.eval()
    return toy.enumerate_prompts(model, args)


def exact_kl(exacts: list[toy.Exact], starts: list[toy.Exact]) -> float:
    """KL(pi || pi_start) between the distributions of whole responses, mean over prompts: by the chain rule, the sum
    over prefixes s of P_pi(s) KL(pi(.|s) || pi_start(.|s)). Each term is written p log(p/q) - p + q, which is >= 0
    (so is the sum: exactly 0 for the same policy, and round-off cannot make it negative); the -p + q parts add up
    to 0 over a distribution.

    >>> table = toy.Exact([1, 1], 0, [np.array([[0.5, 0.5, 0, 0, 0]])], [np.ones(1)], [np.zeros(4), np.zeros(1)])
    >>> other = toy.Exact([1, 1], 0, [np.array([[0.25, 0.75, 0, 0, 0]])], [np.ones(1)], [np.zeros(4), np.zeros(1)])
    >>> exact_kl([table], [table]), round(exact_kl([table], [other]), 6)  # 0.5 log 2 + 0.5 log(2/3)
    (0.0, 0.143841)
    """
    total = 0.0
    for exact, start in zip(exacts, starts):
        for reach, p, q in zip(exact.reach, exact.probs, start.probs):
            with np.errstate(divide="ignore", invalid="ignore"):
                terms = np.where(p > 0, p * np.log(p / q), 0.0) - p + q  # [prefixes, VOCAB]
            total += float(reach @ np.maximum(terms, 0.0).sum(-1))
    return total / len(exacts)


# ----------------------------------------------------------------------------------------------
# One run: the start policy trained by one setting through its script's own functions


@dataclass
class World:
    """What every run starts from: the pre-trained policy, its exact tables, and each setting's size."""

    model: torch.nn.Module
    exacts: list[toy.Exact]
    sizes: dict[str, int]


@dataclass
class Learner:
    """A run's moving parts: the policy, the script's Args for it, the optimizer(s), and what the script keeps
    between iterations (SPO-tree's replay buffer; PPO's critic)."""

    family: str
    model: torch.nn.Module
    script_args: object
    minibatches: int
    optimizer: torch.optim.Optimizer
    scheduler: object
    guard: bookkeeping.NonFiniteGuard = field(default_factory=bookkeeping.NonFiniteGuard)
    critic: torch.nn.Module | None = None
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: object = None
    buffer: list[dict] = field(default_factory=list)


def constant_optimizer(model, lr: float):
    """The scripts' AdamW (training.make_optimizer, weight decay 0) with a constant learning rate: the scripts'
    warmup and linear decay would make the end of every curve flat by construction."""
    optimizer, _ = make_optimizer(model, lr, 0.0, 0.0, total_steps=1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def script_args(family: str, options: dict, size: int, lr: float, args):
    """The script's own Args for this setting: its size (G, or SPO-tree's branch factor), beta 0, one epoch, the
    scripts' clip and grad clipping; batch_size is set per iteration (batch_size_for)."""
    common = dict(
        temperature=args.temperature,
        top_p=1.0,
        micro_batch_size=args.micro_batch_size,
        lr=lr,
        weight_decay=0.0,
        warmup_ratio=0.0,
        epochs=1,
        beta=0.0,
        clip_eps=args.clip_eps,
        max_grad_norm=args.max_grad_norm,
        prob_threshold=args.prob_threshold,
    )
    if family == "grpo":
        return grpo_baseline.Args(**common, group_size=size, **options)
    if family == "spo_chain":
        return spo_chain.Args(**common, group_size=size, mc_samples=args.mc_samples, prob_mask=True, **options)
    if family == "spo_tree":
        return spo_tree.Args(
            **common,
            tree=",".join([str(size)] * args.tree_depth),
            segment_tokens=args.segment_tokens,
            prob_mask=True,
            buffer_max_age=1,  # this iteration's edges only
            edges_per_question=sum(size**d for d in range(1, args.tree_depth + 1)),  # every edge of a full tree
            samples_per_iteration=0,  # every edge once
            max_new_tokens=args.horizon,
            context=toy.PROMPT_LENGTH[args.task] + args.horizon,
            **options,
        )
    return ppo_baseline.Args(
        **common, group_size=size, gamma=1.0, critic_lr=args.critic_lr, value_clip_eps=args.value_clip_eps, **options
    )


def make_learner(name: str, world: World, lr: float, args) -> Learner:
    """A fresh copy of the start policy with the setting's script Args and optimizer (PPO: and a critic made from
    the policy by ppo_baseline.make_critic, with its own AdamW)."""
    family, options = toy.SETTINGS[name]
    model = copy.deepcopy(world.model)
    optimizer, scheduler = constant_optimizer(model, lr)
    learner = Learner(
        family, model, script_args(family, options, world.sizes[name], lr, args), args.minibatches, optimizer, scheduler
    )
    if family == "ppo":
        learner.critic = ppo_baseline.make_critic(model, FP32)
        learner.critic_optimizer, learner.critic_scheduler = constant_optimizer(learner.critic, args.critic_lr)
    return learner


def whitening_stats(metrics: dict) -> dict:
    """An iteration's whitening counts (bookkeeping.whitening_metrics) as a curve's stats keep them: the loss-masked
    tokens of the iteration batch, and those whose advantage 0 the whitening turned positive (centring does when the
    masked mean is negative; --whiten scale never does).

    >>> whitening_stats({"charts/loss_mask_tokens": 12, "charts/zero_advantages_made_positive": 3})
    {'masked_tokens': 12, 'zeros_made_positive': 3}
    """
    return {
        "masked_tokens": metrics["charts/loss_mask_tokens"],
        "zeros_made_positive": metrics["charts/zero_advantages_made_positive"],
    }


def batch_size_for(samples: int, minibatches: int) -> int:
    """Sequences per optimizer step so that one epoch over `samples` takes `minibatches` steps (fewer when there are
    fewer samples).

    >>> batch_size_for(216, 1), batch_size_for(216, 4), batch_size_for(0, 1)
    (216, 54, 1)
    """
    return max(1, math.ceil(samples / minibatches))


def grpo_iteration(learner: Learner, sampler, exacts, iteration: int, rng) -> dict:
    """grpo_baseline's main loop, steps 1-4: G responses per prompt, group_advantages, attach_targets, update_policy."""
    a = learner.script_args
    samples, _, rewards = toy.draw_responses(sampler, exacts, a.group_size)
    a = replace(a, batch_size=batch_size_for(len(samples), learner.minibatches))
    advantages = grpo_baseline.group_advantages(torch.tensor(rewards), a.group_size)
    _, whitening = grpo_baseline.attach_targets(samples, advantages, learner.model, None, a, toy.EOS, FP32)
    grpo_baseline.update_policy(
        learner.model, learner.optimizer, learner.scheduler, samples, a, toy.EOS, iteration, learner.guard
    )
    return {"reward": float(np.mean(rewards)), "samples": len(samples) / len(exacts), **whitening_stats(whitening)}


def chain_iteration(learner: Learner, sampler, exacts, iteration: int, rng) -> dict:
    """spo_chain's main loop, steps 1-7: G responses per prompt, old_and_reference_logprobs, find_cutpoints on p_t,
    K MC continuations per distinct cutpoint state (exact_toy.mc_state_values: spo_chain.mc_values grades text
    through plumbing/tasks.py), chain_advantages with the mask, attach_advantages, update_policy."""
    a = learner.script_args
    samples, owners, rewards = toy.draw_responses(sampler, exacts, a.group_size)
    a = replace(a, batch_size=batch_size_for(len(samples), learner.minibatches))
    old_logps, ref_logps = spo_chain.old_and_reference_logprobs(
        learner.model, None, samples, a.micro_batch_size, a.temperature, toy.EOS, FP32
    )
    for s, old, ref in zip(samples, old_logps, ref_logps):
        s["old_logps"], s["ref_logps"] = old, ref
    flat_probs = torch.cat(old_logps).exp()  # [all response tokens], p_t
    probs = [p.tolist() for p in flat_probs.split([len(s["response_ids"]) for s in samples])]
    cutpoints = [spo_chain.find_cutpoints(p, a.prob_threshold, a.interval) for p in probs]
    prefixes = [[tuple(s["response_ids"][: c + 1]) for c in cuts] for s, cuts in zip(samples, cutpoints)]
    values = toy.mc_state_values(
        sampler, [(exact, prefix) for exact, row in zip(owners, prefixes) for prefix in row], a.mc_samples
    )
    advantages = [
        spo_chain.chain_advantages(
            p, cuts, [values[(id(exact), prefix)] for prefix in row], r, a.prob_threshold, a.prob_mask
        )
        for p, cuts, row, exact, r in zip(probs, cutpoints, prefixes, owners, rewards)
    ]
    _, whitening = spo_chain.attach_advantages(samples, advantages, flat_probs, a.prob_threshold, a.prob_mask, a.whiten)
    spo_chain.update_policy(
        learner.model, learner.optimizer, learner.scheduler, samples, a, toy.EOS, iteration, learner.guard
    )
    return {
        "reward": float(np.mean(rewards)),
        "samples": len(samples) / len(exacts),
        "cutpoints": float(np.mean([len(c) for c in cutpoints])),
        **whitening_stats(whitening),
    }


def tree_iteration(learner: Learner, sampler, exacts, iteration: int, rng) -> dict:
    """spo_tree's main loop, steps 1-5: grow_trees (one tree per prompt), the leaves rewarded as grade_trees does (0
    when unfinished), tree_edges, old log-probs of the new edges, sample_buffer (age 1: this iteration's edges, all
    taken), edge_weights with --edge-weight depth, fill_samples (0: every edge once), attach_targets,
    update_policy."""
    a = learner.script_args
    branches = spo_tree.parse_tree(a.tree)
    roots, _ = spo_tree.grow_trees(
        sampler,
        [exact.prompt for exact in exacts],
        branches,
        segment_tokens=a.segment_tokens,
        max_new_tokens=a.max_new_tokens,
        context=a.context,
        temperature=a.temperature,
        top_p=a.top_p,
        stop=[],
    )
    for exact, root in zip(exacts, roots):
        for node, before in spo_tree.walk(root):
            if not node.children:
                node.reward = toy.reward(exact, before + node.tokens, node.finish_reason)
    new_edges, _ = spo_tree.tree_edges(roots, list(range(len(exacts))), iteration, a.advantage)
    for edge, logps in zip(
        new_edges, sample_logprobs(learner.model, new_edges, a.micro_batch_size, a.temperature, toy.EOS, FP32)
    ):
        edge["old_logps"] = logps
    taken, learner.buffer = spo_tree.sample_buffer(
        learner.buffer + new_edges, iteration, a.buffer_max_age, a.edges_per_question, rng
    )
    if a.edge_weight == "depth":
        for edge, weight in zip(taken, spo_tree.edge_weights(taken, learner.buffer, spo_tree.depth_weights(branches))):
            edge["weight"] = weight
    samples, learner.buffer = spo_tree.fill_samples(taken, learner.buffer, a.samples_per_iteration, rng)
    whitening = spo_tree.attach_targets(
        samples,
        None,
        micro_batch_size=a.micro_batch_size,
        temperature=a.temperature,
        pad_id=toy.EOS,
        prob_threshold=a.prob_threshold,
        prob_mask=a.prob_mask,
        precision=FP32,
        whiten_mode=a.whiten,
    )
    a = replace(a, batch_size=batch_size_for(len(samples), learner.minibatches))
    spo_tree.update_policy(
        learner.model, learner.optimizer, learner.scheduler, samples, a, toy.EOS, iteration, learner.guard
    )
    root_values = [root.value for root in roots]  # backed up by tree_segments
    return {
        "reward": float(np.mean(root_values)),
        "samples": len(samples) / len(exacts),
        "edges": len(samples),
        **whitening_stats(whitening),
    }


def ppo_iteration(learner: Learner, sampler, exacts, iteration: int, rng) -> dict:
    """ppo_baseline's main loop, steps 1-4: G responses per prompt, add_old_logprobs_and_values (the critic's values),
    add_advantages_and_returns (GAE), update_policy (policy and critic on the same batches: the critic trains online,
    on the same rollouts, so it samples nothing of its own)."""
    a = learner.script_args
    samples, owners, rewards = toy.draw_responses(sampler, exacts, a.group_size)
    a = replace(a, batch_size=batch_size_for(len(samples), learner.minibatches))
    ppo_baseline.add_old_logprobs_and_values(
        samples,
        learner.model,
        None,
        learner.critic,
        micro_batch_size=a.micro_batch_size,
        temperature=a.temperature,
        pad_id=toy.EOS,
        precision=FP32,
    )
    _, whitening = ppo_baseline.add_advantages_and_returns(
        samples, torch.tensor(rewards), a.gamma, a.lam, a.prob_threshold, a.prob_mask, a.whiten
    )
    # the critic against the exact V of the states it valued, before this update
    value_error = float(
        np.mean(
            [
                (value - exact.value(s["response_ids"][:t])) ** 2
                for s, exact in zip(samples, owners)
                for t, value in enumerate(s["old_values"].tolist())
            ]
        )
    )
    ppo_baseline.update_policy(
        learner.model,
        learner.critic,
        learner.optimizer,
        learner.scheduler,
        learner.critic_optimizer,
        learner.critic_scheduler,
        samples,
        a,
        toy.EOS,
        iteration,
        learner.guard,
    )
    return {
        "reward": float(np.mean(rewards)),
        "samples": len(samples) / len(exacts),
        "critic_value_mse": value_error,
        **whitening_stats(whitening),
    }


ITERATIONS = {"grpo": grpo_iteration, "spo_chain": chain_iteration, "spo_tree": tree_iteration, "ppo": ppo_iteration}


def train_run(name: str, lr: float, seed: int, world: World, args) -> tuple[dict, Learner]:
    """One run: `args.iterations` iterations of rollout + the setting's update from the start policy; after each, the
    exact J and the exact KL to the start policy. The sampler draws from the current policy's exact tables (the same
    enumeration that gives J), seeded by (seed, iteration) like the scripts' reseed. A run the script stops (three
    non-finite losses in a row) keeps its last policy for the remaining iterations (recorded as "stopped"). Returns
    the curve and the learner (its model is the trained policy)."""
    learner = make_learner(name, world, lr, args)
    exacts, started = world.exacts, time.time()
    curve = {
        "seed": seed,
        "lr": lr,
        "J": [toy.expected_reward(exacts)],
        "kl": [exact_kl(exacts, world.exacts)],
        "tokens": [],
        "stats": [],
    }
    for iteration in range(1, args.iterations + 1):
        if args.token_budget and sum(curve["tokens"]) >= args.token_budget:
            break  # the budget is spent: J past it is interpolated to B, the last iteration's overshoot unused
        sampler = toy.ExactSampler(exacts, args.temperature, seed=seed * 1_000_003 + iteration)
        rng = reseed(seed, iteration, sampler)  # torch (the update's shuffles) and the iteration's random.Random
        try:
            stats = ITERATIONS[learner.family](learner, sampler, exacts, iteration, rng)
        except UsageError as error:  # the script's own stop (three non-finite losses in a row): the policy stays
            curve["stopped"] = {"iteration": iteration, "reason": str(error)}
            if args.token_budget:  # on the token axis the curve ends: its last J holds for the rest of the budget
                break
            pad = args.iterations + 1 - iteration
            curve["J"], curve["kl"] = curve["J"] + [curve["J"][-1]] * pad, curve["kl"] + [curve["kl"][-1]] * pad
            curve["tokens"] += [0.0] * pad
            break
        curve["tokens"].append(sampler.tokens / len(exacts))
        curve["stats"].append(stats)
        exacts = enumerate_policy(learner.model, args)
        curve["J"].append(toy.expected_reward(exacts))
        curve["kl"].append(exact_kl(exacts, world.exacts))
    curve["seconds"] = time.time() - started
    return curve, learner


# ----------------------------------------------------------------------------------------------
# Many runs: side by side in worker processes (each run is seeded on its own: the result does not depend on them)


def run_all(jobs: list[tuple[str, float, int]], world: World, args) -> list[dict]:
    """The curve of every (setting, lr, seed) job, in order: read back from the run cache (args.run_cache) where the
    same run was made before, the others computed (in this process with one worker, else in a pool of forked
    processes) and each written to the cache as it finishes, so an interrupted sweep keeps every run it finished."""
    cache = run_cache_dir(args.run_cache)
    keys = [run_key(job, world, args) for job in jobs] if cache else []
    curves = [read_cached(cache / f"{key}.json") for key in keys] if cache else [None] * len(jobs)
    todo = [index for index, curve in enumerate(curves) if curve is None]
    if cache and len(todo) < len(jobs):
        print(f"({len(jobs) - len(todo)} of {len(jobs)} runs read back from {cache})", flush=True)
    for index, curve in zip(todo, _compute([jobs[index] for index in todo], world, args)):
        if cache:
            files.write_atomic(cache / f"{keys[index]}.json", json.dumps(curve), "the run cache's file")
        curves[index] = curve
    return curves


def _compute(jobs: list[tuple[str, float, int]], world: World, args) -> Iterator[dict]:
    """Each job's curve as it finishes, in order."""
    if not jobs:
        return
    if args.workers == 1 or len(jobs) == 1:
        _start_worker(world, args)
        yield from map(_run, jobs)
        return
    with multiprocessing.get_context("fork").Pool(args.workers, _start_pool_worker, (world, args)) as pool:
        yield from pool.imap(_run, jobs, chunksize=1)


# ----------------------------------------------------------------------------------------------
# The run cache: a run is a function of its start policy, its settings, its code and the machine's arithmetic

# learning_exact's settings that one run reads besides the start policy (hashed whole: its weights) and the size
RUN_FIELDS = (
    "task",
    "filler",
    "prompts",
    "horizon",
    "temperature",
    "prob_threshold",
    "mc_samples",
    "tree_depth",
    "segment_tokens",
    "critic_lr",
    "value_clip_eps",
    "clip_eps",
    "max_grad_norm",
    "minibatches",
    "micro_batch_size",
    "iterations",
    "token_budget",
    "threads",
)
RUN_CODE = ("experiments/toy_training.py",)  # with exact_toy.SHARED_CODE: the scripts, plumbing, exact_toy, measures


def run_cache_dir(setting: str) -> Path | None:
    """Where runs are cached: --run-cache auto is $SPO_CACHE/toy_runs (else ~/.cache/spo/toy_runs), none is no
    cache, anything else a directory.

    >>> run_cache_dir("none"), run_cache_dir("/tmp/runs")
    (None, PosixPath('/tmp/runs'))
    """
    if setting == "none":
        return None
    return models.cache_dir() / "toy_runs" if setting == "auto" else Path(setting)


def run_key(job: tuple[str, float, int], world: World, args) -> str:
    """The cache key of one (setting, lr, seed) run: a hash of the start policy's weights, the setting's size, the
    settings a run reads (RUN_FIELDS), the code it runs (exact_toy.code_hash: a commit that changes none of it keeps
    every run), and the machine's arithmetic (the CPU's name and flags, torch, numpy and Python versions: one seed
    trains differently on another CPU)."""
    name, lr, seed = job
    weights = hashlib.sha256()
    for key, tensor in world.model.state_dict().items():
        weights.update(key.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    identity = {
        "setting": name,
        "lr": float(lr),
        "seed": seed,
        "size": world.sizes[name],
        "start_policy": weights.hexdigest(),
        "settings": {field_name: getattr(args, field_name) for field_name in RUN_FIELDS},
        "code": toy.code_hash(*RUN_CODE),
        "cpu": precision.cpu_description(),
        "cpu_flags": hashlib.sha256(" ".join(sorted(precision.cpu_flags())).encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def read_cached(path: Path) -> dict | None:
    """A cached run's curve, or None where there is none (or only a file an interrupted write left)."""
    try:
        curve = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return curve if isinstance(curve, dict) and "J" in curve else None


_WORKER: dict = {}


def _start_worker(world: World, args) -> None:
    """A worker's setup: its torch threads, and the start policy and settings every job of it reads."""
    torch.set_num_threads(args.threads)
    _WORKER.update(world=world, args=args)


def _start_pool_worker(world: World, args) -> None:
    """A pool worker's setup: SIGTERM back to its default (the pool ends its workers so; the handler of cli.run_cli,
    inherited at fork, would print a traceback for each), then _start_worker."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _start_worker(world, args)


def _run(job: tuple[str, float, int]) -> dict:
    """One (setting, lr, seed) job's curve."""
    return train_run(*job, _WORKER["world"], _WORKER["args"])[0]
