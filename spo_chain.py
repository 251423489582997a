"""SPO-chain: Segment Policy Optimization with cutpoint segments and Monte-Carlo segment advantages.

Segment Policy Optimization (Guo et al. 2025, arXiv 2505.23564), short chain-of-thought variant.
For each question, sample G responses and score them (reward R). Every response is cut into
segments at low-probability tokens: a cutpoint c is the state s_c = prompt + y_0..y_c just before a
token with p_t < threshold is sampled, keeping every `interval`-th one. The value V(s_c) of each
cutpoint state is the mean reward of K continuations sampled from it with the current policy (no
critic). A segment's tokens get the value difference across it (V(s_next) - V(s_c); R - V(s_c_last)
for the last). With the probability mask, only low-probability tokens (p_t < threshold) keep an
advantage and count in the loss: the confident tokens in between decided nothing. The policy is
updated with the PPO-clip surrogate plus a k3 KL penalty to the frozen reference model.

Deliberate differences from the paper's released code: README.md, "Deliberate fixes over the paper's released
code". Here also: the MC prefixes are the rollout's own token ids, and a continuation from s_c keeps the rollout's
response budget (it may add at most max_new_tokens - (c+1) tokens, and must fit the context).

  python spo_chain.py                                                   # paper GSM8K run (Rho-1B SFT, int5, K=9)
  python spo_chain.py --dry-run                                         # its settings beside the paper's; loads nothing
  python spo_chain.py --interval 2 --no-prob-mask                       # int2 ablation without the probability mask
  python spo_chain.py --model smollm2-135m --task rg:chain_sum --iterations 2 --questions 2 --group-size 4 \
      --batch-size 8 --micro-batch-size 4 --max-new-tokens 64 --context 512 --mc-samples 4  # offline CPU
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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
    runs,
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
class SpoChainSettings:
    """SPO-chain's own settings: first in --help."""

    group_size: ranges.PositiveInt = 8
    """responses per question (G)"""
    mc_samples: ranges.PositiveInt = 9
    """K: Monte-Carlo continuations per cutpoint state; V(s_c) is their mean reward"""
    interval: ranges.PositiveInt = 5
    """keep every interval-th low-probability cutpoint (the paper's int2 / int5 / int100 ablations)"""
    prob_mask: bool = True
    """probability mask: only tokens with p_t < prob_threshold keep an advantage, count in the loss and in whitening"""
    prob_threshold: ranges.Probability = 0.9
    """tokens with p_t < prob_threshold are low-probability: they make cutpoints and (with the mask) are trained"""


# SpoChainSettings first in --help, then the settings every script shares (settings.TrainArgs), redeclared
# here only where this algorithm's paper default differs.
@dataclass
class Args(settings.TrainArgs, SpoChainSettings):
    exp_name: str = "spo_chain"
    """experiment name, part of the run name"""


# The paper's runs of this algorithm (Guo et al. 2025, section 5 and appendix; the authors' released configs): the
# setup all four scripts share (plumbing/paper.py: model, task, sampling, evaluation, optimizer) and what this
# algorithm sets. Args' defaults are the first run's values. --dry-run prints every setting beside the matching run's,
# and the README's settings table is generated from these (python -m tools.paper_settings --write).
# fmt: off
PAPER_SETTINGS = {
    "gsm8k": dict(paper.GSM8K_RUN, questions=64, group_size=8, epochs=2, batch_size=64, mc_samples=9, interval=5,
                  prob_mask=True, prob_threshold=0.9),
}
# fmt: on


# ----------------------------------------------------------------------------------------------
# Algorithm: partition, advantages and loss (pure functions)


def find_cutpoints(probs: Sequence[float], threshold: float = 0.9, interval: int = 5) -> list[int]:
    """Cutpoints of a response: the state just before every `interval`-th low-probability token.

    Paper: segment partition: SPO-chain's cutpoint-based partition.

    probs[t] = p_t, the old policy's probability of response token t. Token t is low-probability when
    p_t < threshold; its cutpoint is t - 1 (state s_{t-1} = prompt + y_0..y_{t-1}; -1 is the prompt alone).
    Cutpoints are strictly increasing and at most T - 2; there is no cap on their number.

    >>> find_cutpoints([.99, .72, 1, .85, 1, .56, .92, .23, .98, .11, 1, .5, .99], interval=2)  # low: 1,3,5,7,9,11
    [0, 4, 8]
    >>> find_cutpoints([.5, .95, .3], interval=1)  # a low first token cuts at the prompt
    [-1, 1]
    """
    if interval < 1:
        raise ValueError(f"interval must be at least 1, got {interval}")
    low = [t for t, p in enumerate(probs) if p < threshold]
    return [t - 1 for t in low][::interval]


def chain_advantages(
    probs: Sequence[float],
    cutpoints: Sequence[int],
    values: Sequence[float],
    reward: float,
    threshold: float = 0.9,
    prob_mask: bool = True,
) -> list[float]:
    """Token advantages of one response from its cutpoint values (values[i] = V(s_{cutpoints[i]})) and its reward R.

    Paper: segment advantage estimation: SPO-chain's chain-based advantage estimation.

    Value positions, left to right: each cutpoint c >= 0 carries V(s_c), the last token T-1 carries R.
    A value position's advantage is its value minus the previous one's; the first gets 0, unless
    cutpoints[0] == -1, whose V(prompt) is then the starting baseline. Every other token takes the
    advantage of the next value position to its right, so tokens c_{k-1}+1 .. c_k get
    V(s_{c_k}) - V(s_{c_{k-1}}) and the last segment gets R - V(s_{c_last}). No cutpoints: all 0.
    With prob_mask, tokens with p_t > threshold get 0.
    A cutpoint at T-1 (never produced by find_cutpoints) is the finished response: it carries R, not its V.

    >>> probs = [.99, .72, 1, .85, 1, .56, .92, .23, .98, .11, 1, .5, .99]
    >>> chain_advantages(probs, [0, 4, 8], [.5, .25, .75], reward=1.0, prob_mask=False)
    [0.0, -0.25, -0.25, -0.25, -0.25, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25]
    >>> chain_advantages(probs, [0, 4, 8], [.5, .25, .75], reward=1.0)
    [0.0, -0.25, 0.0, -0.25, 0.0, 0.5, 0.0, 0.5, 0.0, 0.25, 0.0, 0.25, 0.0]
    >>> chain_advantages([.5, .95, .3], [-1, 1], [.5, .75], reward=0.0, prob_mask=False)  # V(prompt) is the baseline
    [0.25, 0.25, -0.75]
    """
    T = len(probs)
    cutpoints = [int(c) for c in cutpoints]
    values = [float(v) for v in values]
    if len(values) != len(cutpoints):
        raise ValueError(f"{len(cutpoints)} cutpoints but {len(values)} values")
    if any(b <= a for a, b in zip(cutpoints, cutpoints[1:])) or (
        cutpoints and not -1 <= cutpoints[0] <= cutpoints[-1] <= T - 1
    ):
        raise ValueError(f"cutpoints must be strictly increasing within -1..{T - 1}, got {cutpoints}")
    if T == 0 or not cutpoints:
        return [0.0] * T
    positions = [(c, v) for c, v in zip(cutpoints, values) if 0 <= c < T - 1]
    positions.append((T - 1, float(reward)))
    previous = values[0] if cutpoints[0] == -1 else None
    advantages: list[float] = []
    for position, value in positions:
        advantage = 0.0 if previous is None else value - previous
        advantages += [advantage] * (position + 1 - len(advantages))  # the tokens up to and including this position
        previous = value
    if prob_mask:
        advantages = [0.0 if p > threshold else a for p, a in zip(probs, advantages)]
    return advantages


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
# Monte-Carlo value estimation


def mc_values(
    sampler,
    tokenizer,
    states: list[tuple[list[int], list[int], str]],
    *,
    mc_samples: int,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    context: int,
    task: str,
    stop: list[str],
) -> tuple[list[float], dict]:
    """V(s) of each state (prompt_ids, response_prefix_ids, answer): mean reward of `mc_samples` continuations.

    Paper: segment advantage estimation: SPO-chain's chain-based advantage estimation.

    Identical states (same token ids, same answer) are estimated once: for instance c = -1, the prompt
    itself, is shared by every response of a question whose first token is low-probability. All states go
    to the sampler in one call; HFSampler prefills each prefix once and repeats its KV cache K times.
    Continuations are sampled like the rollouts (`temperature`, `top_p`, the `stop` strings) and keep the
    rollout's budget, min(max_new_tokens - len(response prefix), context - len(prefix)) new tokens (the
    sampler takes one budget per prefix); an unfinished continuation scores 0. The reward grades the whole
    response against the answer with `task`'s grader: the response prefix's ids + the continuation's ids,
    decoded once. Returns the values in the order of `states` and the counts
    {"mc_states": distinct states, "mc_rollouts": continuations sampled, "mc_tokens": tokens they generated}.
    """
    unique = list(dict.fromkeys((tuple(prompt), tuple(prefix), answer) for prompt, prefix, answer in states))
    stats = {"mc_states": len(unique), "mc_rollouts": len(unique) * mc_samples, "mc_tokens": 0}
    if not unique:
        return [], stats
    groups = sampler.sample(
        [list(prompt + prefix) for prompt, prefix, _ in unique],
        mc_samples,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=[max_new_tokens - len(prefix) for _, prefix, _ in unique],
        stop=stop,
        context=context,
        progress="mc",
        generated=[len(prefix) for _, prefix, _ in unique],  # a stop string may begin in the response prefix
    )
    texts = []
    answers = []
    finished = []
    for (_, prefix, answer), group in zip(unique, groups):
        for continuation in group:
            texts.append(tokenizer.decode(list(prefix) + continuation.ids, skip_special_tokens=True))
            answers.append(answer)
            finished.append(continuation.finish_reason == "stop")
            stats["mc_tokens"] += len(continuation.ids)
    scores = [score if done else 0.0 for score, done in zip(tasks.grade(texts, answers, task), finished)]
    K = mc_samples
    value_of = {state: sum(scores[i * K : (i + 1) * K]) / K for i, state in enumerate(unique)}
    return [value_of[(tuple(prompt), tuple(prefix), answer)] for prompt, prefix, answer in states], stats


# ----------------------------------------------------------------------------------------------
# The update: what the loss needs, gradients, optimizer steps


def old_and_reference_logprobs(
    model,
    reference,
    samples: list[dict],
    micro_batch_size: int,
    temperature: float,
    pad_id: int,
    precision: Precision = FP32,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-sample response log-probs of the policy before its update (set as each sample's old_logps, with its
    entropy) and of the frozen reference model.

    Without a reference model (beta = 0) the policy's own log-probs stand in (the KL term is then 0).
    A reference model parked in pinned CPU memory (--reference-on-device False) visits the device only here.
    """
    old_logps = attach_old_logprobs(model, samples, micro_batch_size, temperature, pad_id, precision)
    if reference is None:
        return old_logps, old_logps
    with models.on_device(reference):
        ref_logps = sample_logprobs(reference, samples, micro_batch_size, temperature, pad_id, precision)
    return old_logps, ref_logps


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
    """Forward/backward one optimizer batch in micro-batches of `micro_batch_size`; gradients add up to the
    full-batch gradient. Returns the batch's loss, pg_loss, kl and clip_frac (fraction of masked tokens clipped).
    Under torchrun each rank passes its share of the batch and `all_sum=distributed.all_sum`: the loss is normalised by
    the whole batch's counts, so the ranks' gradients (and stats) sum to those of the whole batch."""
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


def attach_advantages(
    samples: list[dict],
    advantages: list[list[float]],
    flat_probs: torch.Tensor,
    prob_threshold: float,
    prob_mask: bool,
    whiten_mode: str = "centre-scale",
) -> tuple[torch.Tensor, dict]:
    """Set each sample's "loss_mask" and "advantages" (its chain advantages, whitened over the masked tokens of the
    whole iteration batch, all ranks included, by --whiten's `whiten_mode`); `flat_probs` holds p_t of every response
    token. Returns the flat loss mask and the whitening's counts (bookkeeping.whitening_metrics)."""
    lengths = [len(s["response_ids"]) for s in samples]
    flat_advantages = torch.tensor([a for response in advantages for a in response])  # [all response tokens]
    flat_mask = loss_mask(
        torch.ones_like(flat_probs, dtype=torch.bool),
        flat_probs,
        prob_threshold,
        prob_mask,
        all_sum=distributed.all_sum,
    )
    whitened = whiten(flat_advantages, flat_mask, all_sum=distributed.all_sum, mode=whiten_mode)
    for s, mask, advantage in zip(samples, flat_mask.split(lengths), whitened.split(lengths)):
        s["loss_mask"] = mask
        s["advantages"] = advantage
    return flat_mask, bookkeeping.whitening_metrics(flat_advantages, whitened, flat_mask)


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
    """--epochs passes over the iteration's samples in shuffled batches of --batch-size: one clipped optimizer step
    per batch (under torchrun each rank takes --batch-size / world size of its own samples, and the gradients are
    summed). A skipped (non-finite) batch still steps the scheduler. Returns the stats of the steps taken."""
    model.train()
    steps = []
    batch_size = args.batch_size // distributed.world_size()  # this rank's share of each batch
    for _ in range(args.epochs):
        order = torch.randperm(len(samples)).tolist()
        for start in range(0, len(order), batch_size):
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
            if not guard.skips(stats, iteration, keys=("loss", "grad_norm"), temperature=args.temperature):
                optimizer.step()
                steps.append(stats)
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return steps


# ----------------------------------------------------------------------------------------------
# Main loop: the algorithm box


def main(args: Args) -> dict:
    # torchrun: this rank's GPU (or the CPU over gloo); plain python: one process
    device = distributed.init_distributed(args)
    validate(args)
    eval_task = args.eval_task or tasks.default_eval_task(args.task)
    if args.dry_run:  # nothing is loaded: the alias is expanded by name only
        return paper.dry_run(args, PAPER_SETTINGS, eval_task)
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
    total_steps = args.iterations * args.epochs * math.ceil(args.questions * args.group_size / args.batch_size)
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, args.warmup_ratio, total_steps, run.state)
    evaluate = lambda: ev.evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args)  # noqa: E731
    book = bookkeeping.Loop(run, args, eval_task, evaluate)

    for iteration in book.iterations():
        rng = reseed(args.seed, iteration, sampler)  # a resumed run samples what the uninterrupted one would

        # 1. Rollout: G responses per question (under torchrun, per question of this rank's share).
        questions = distributed.shard([rng.choice(train_examples) for _ in range(args.questions)])
        with book.timed("rollout"):
            groups = sampler.sample([q.prompt_ids for q in questions], args.group_size, **sampling, progress="rollout")
        completions = [completion for group in groups for completion in group]

        # 2. Rewards: the graded final answer; an unfinished response scores 0.
        texts = [tokenizer.decode(completion.ids, skip_special_tokens=True) for completion in completions]
        answers = [q.answer for q in questions for _ in range(args.group_size)]
        scores = tasks.grade(texts, answers, args.task)
        rewards = [s if c.finish_reason == "stop" else 0.0 for s, c in zip(scores, completions)]

        # 3. Old and reference log-probs, once; p_t = exp(old log-prob) comes from the same forward pass.
        samples = [new_sample(questions[i // args.group_size].prompt_ids, c) for i, c in enumerate(completions)]
        old_logps, ref_logps = old_and_reference_logprobs(
            model, reference, samples, args.micro_batch_size, args.temperature, pad_id, run.precision
        )
        for s, old, ref in zip(samples, old_logps, ref_logps):
            s["old_logps"] = old
            s["ref_logps"] = ref
        flat_probs = torch.cat(old_logps).exp()  # [all response tokens], p_t
        probs = [p.tolist() for p in flat_probs.split([len(s["response_ids"]) for s in samples])]

        # 4. Partition: cutpoints before every interval-th low-probability token.
        cutpoints = [find_cutpoints(p, args.prob_threshold, args.interval) for p in probs]

        # 5. Segment values: V(s_c) from K MC continuations of every cutpoint state, all states in one sampler call.
        states = [
            (s["prompt_ids"], s["response_ids"][: cut + 1], answer)
            for s, cuts, answer in zip(samples, cutpoints, answers)
            for cut in cuts
        ]
        with book.timed("mc"):
            flat_values, mc_stats = mc_values(
                sampler, tokenizer, states, mc_samples=args.mc_samples, task=args.task, **sampling
            )

        # 6. Chain advantages (prob-masked), whitened over the loss-masked tokens of the whole iteration batch.
        flat = iter(flat_values)
        values = [[next(flat) for _ in cuts] for cuts in cutpoints]  # V(s_c) of each response's cutpoints
        advantages = [
            chain_advantages(p, cuts, v, reward, args.prob_threshold, args.prob_mask)
            for p, cuts, v, reward in zip(probs, cutpoints, values, rewards)
        ]
        flat_mask, whitening = attach_advantages(
            samples, advantages, flat_probs, args.prob_threshold, args.prob_mask, args.whiten
        )
        correct_rollouts(samples, args.rollout_correction, args.rollout_cap)  # beyond the paper; none: the paper's

        # 7. Update: epochs x shuffled batches x micro-batches (the rollout engine sleeps meanwhile).
        sampler.sleep()
        with book.timed("update"):
            update_stats = update_policy(
                model, optimizer, scheduler, samples, args, pad_id, iteration, book.guard, run.precision
            )
        sampler.wake_up()
        sampler.load_weights(model)
        seconds, last = book.end_iteration()  # rollout, mc, update, iteration (without evaluation, checkpoint), train

        # 8. Log (over all ranks' responses), save samples, evaluate, checkpoint.
        lr = scheduler.get_last_lr()[0]
        metrics = iteration_metrics(
            rewards, completions, samples, flat_mask, cutpoints, flat_values, mc_stats, update_stats, lr, seconds
        )
        metrics |= whitening  # the loss-masked tokens and what the whitening moved
        book.log(iteration, metrics, progress_line(iteration, metrics))
        if book.saves_samples(iteration):  # rank 0's questions
            records = sample_records(
                iteration, questions, completions, rewards, advantages, samples, cutpoints, values, tokenizer, args
            )
            book.write_samples(iteration, records)
        if book.due(iteration, args.eval_every, last):
            book.evaluate(iteration)
        if book.due(iteration, args.save_every, last):
            trainer_state = {**checkpoints.optimizer_checkpoint(model, optimizer, scheduler), "iteration": iteration}
            checkpoints.save_checkpoint(run.dir, model, tokenizer, trainer_state)
    return book.finish()


# ----------------------------------------------------------------------------------------------
# Below main: this script's settings check, metrics and sample records


def validate(args: Args) -> None:
    # the settings every script shares
    problems = settings.setting_problems(args, tasks.task_problems, engines.backend_problems)
    problems += distributed.world_size_problems(
        args, per_rank={"--questions": args.questions, "--batch-size": args.batch_size}
    )
    if problems:
        raise UsageError("; ".join(problems))


def iteration_metrics(
    rewards: list[float],
    completions: list,
    samples: list[dict],
    flat_mask: torch.Tensor,
    cutpoints: list[list[int]],
    flat_values: list[float],
    mc_stats: dict,
    update_stats: list[dict],
    lr: float,
    seconds: dict[str, float],
) -> dict:
    """One iteration's metrics.jsonl entry, over all ranks' responses (`samples`: what the update trained on, for the
    entropy and sampler metrics; `update_stats`: the optimizer steps taken; `seconds`: rollout, mc, update,
    iteration and train timings)."""
    rewards = distributed.gather(rewards)
    completions = distributed.gather(completions)
    flat_mask = distributed.gather(flat_mask)
    cutpoints = distributed.gather(cutpoints)
    flat_values = distributed.gather(flat_values)
    mc_stats = distributed.sum_over_ranks(mc_stats)
    generated = sum(len(completion.ids) for completion in completions)
    # A response's segments: the runs of tokens between value positions (one segment if it has no cutpoint).
    segments = sum(len(cuts) + (not cuts or cuts[0] >= 0) for cuts in cutpoints)
    metrics = {
        "charts/reward": sum(rewards) / len(rewards),
        "charts/response_tokens": generated / len(completions),
        "charts/truncation_rate": sum(completion.finish_reason == "length" for completion in completions)
        / len(completions),
        "charts/lr": lr,
        "charts/tokens_per_second": generated / max(seconds["rollout"], 1e-9),
        "charts/loss_mask_fraction": flat_mask.float().mean().item() if generated else 0.0,
        "charts/cutpoints_per_response": sum(map(len, cutpoints)) / len(cutpoints),
        "charts/segment_tokens": generated / segments,
        "charts/no_cutpoint_fraction": sum(not cuts for cuts in cutpoints) / len(cutpoints),
        "charts/mc_states": mc_stats["mc_states"],
        "charts/mc_rollouts": mc_stats["mc_rollouts"],
        "charts/mc_tokens": mc_stats["mc_tokens"],
        "charts/generated_tokens": generated + mc_stats["mc_tokens"],  # responses and MC continuations
        **{f"time/{name}_seconds": value for name, value in seconds.items()},  # iteration: without eval, checkpoint
    }
    if flat_values:
        metrics["charts/mc_value_mean"] = torch.tensor(flat_values).mean().item()
        metrics["charts/mc_value_std"] = torch.tensor(flat_values).std(unbiased=False).item()
    metrics |= rollout_metrics(samples)  # entropy; the sampler against the trainer
    return metrics | bookkeeping.loss_metrics(update_stats)


def progress_line(iteration: int, metrics: dict) -> str:
    """The iteration's one-line summary on the console."""
    return (
        f"iter {iteration}: reward {metrics['charts/reward']:.3f}  len {metrics['charts/response_tokens']:.0f}  "
        f"cutpoints {metrics['charts/cutpoints_per_response']:.1f}  "
        f"kl/token {metrics.get('losses/kl_per_token', 0):.2e}  "
        f"rollout {metrics['time/rollout_seconds']:.1f}s  mc {metrics['time/mc_seconds']:.1f}s "
        f"({metrics['charts/mc_rollouts']} rollouts)  update {metrics['time/update_seconds']:.1f}s"
    )


def sample_records(
    iteration: int,
    questions: list,
    completions: list,
    rewards: list[float],
    advantages: list[list[float]],
    samples: list[dict],
    cutpoints: list[list[int]],
    cutpoint_values: list[list[float]],
    tokenizer,
    args: Args,
) -> list[dict]:
    """The --save-samples records (viewer.py's format) of the first --save-questions questions' responses."""
    return [
        runs.response_record(
            "spo_chain",
            iteration,
            i // args.group_size,
            questions[i // args.group_size],
            completions[i],
            rewards[i],
            samples[i],
            advantages[i],  # before whitening, prob mask applied
            args.prob_threshold,
            tokenizer,
            cutpoints=cutpoints[i],
            cutpoint_values=cutpoint_values[i],
        )
        for i in range(min(args.save_questions, len(questions)) * args.group_size)
    ]


if __name__ == "__main__":
    cli.run_cli(main, cli.parse(Args))
