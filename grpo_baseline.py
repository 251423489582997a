"""GRPO baseline: one trajectory-level advantage per response, normalised within its group.

For each question, sample G responses; reward r_i = 1 if the graded final answer is right;
every token of response i gets A_i = (r_i - mean(r)) / (std(r) + 1e-8). The policy is updated
with the PPO-clip surrogate plus a k3 KL penalty to the frozen reference model. This is the
trajectory-level baseline of Segment Policy Optimization (Guo et al. 2025, arXiv 2505.23564);
see README.md for the paper's settings and results.

Deliberate differences from the paper's released code: README.md, "Deliberate fixes over the paper's released
code". --prob-mask gives the paper's GRPO+mask ablation (loss only on tokens with p_t < threshold).

  python grpo_baseline.py                                                  # paper GSM8K run (Rho-1B SFT)
  python grpo_baseline.py --model deepseek-r1-distill-qwen-1.5b --task math --context 2048 --max-new-tokens 2048 \
      --top-p 1.0 --eval-samples 1 --eval-temperature 0.6 --eval-top-p 0.95     # paper long-CoT run, MATH -> MATH500
  python grpo_baseline.py --model smollm2-135m --task rg:chain_sum --iterations 2 --questions 4 \
      --group-size 4                                                            # offline CPU
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
class GrpoSettings:
    """GRPO's own settings: first in --help."""

    group_size: ranges.bounded(int, 2) = 8
    """responses per question (G)"""
    prob_mask: bool = False
    """GRPO+mask ablation: train only on tokens with p_t < prob_threshold"""
    prob_threshold: ranges.Probability = 0.9
    """probability threshold of the mask"""


# GrpoSettings first in --help, then the settings every script shares (settings.TrainArgs), redeclared
# here only where this algorithm's paper default differs.
@dataclass
class Args(settings.TrainArgs, GrpoSettings):
    exp_name: str = "grpo"
    """experiment name, part of the run name"""


# The paper's runs of this algorithm (Guo et al. 2025, section 5 and appendix; the authors' released configs): the
# setup all four scripts share (plumbing/paper.py: model, task, sampling, evaluation, optimizer) and what this
# algorithm sets. Args' defaults are the first run's values. --dry-run prints every setting beside the matching run's,
# and the README's settings table is generated from these (python -m tools.paper_settings --write).
# fmt: off
PAPER_SETTINGS = {
    "gsm8k": dict(paper.GSM8K_RUN, questions=64, group_size=8, epochs=2, batch_size=64, prob_mask=False),
    "math":  dict(paper.MATH_RUN,  questions=64, group_size=8, prob_mask=False),
}
# fmt: on


# ----------------------------------------------------------------------------------------------
# Algorithm: advantages and loss (pure functions)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-8) -> torch.Tensor:
    """(r - group mean) / (group std + eps), groups being `group_size` consecutive rewards (std with ddof 0).

    Paper: GRPO's advantage (baseline).

    >>> group_advantages(torch.tensor([1., 0., 0., 1., 1., 1.]), 3)
    tensor([ 1.4142, -0.7071, -0.7071,  0.0000,  0.0000,  0.0000])
    """
    groups = rewards.view(-1, group_size)  # [questions, G]
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + eps)).view_as(rewards)


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
# The update: what the loss needs, gradients, optimizer steps


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
    Under torchrun each rank passes its share of the batch and `all_sum=distributed.all_sum`: the loss is normalised by
    the whole batch's counts, so the ranks' gradients (and stats) sum to those of the whole batch.

    Each sample holds prompt_ids, response_ids, advantages, loss_mask, old_logps and, optionally, ref_logps (without
    them the KL term is 0). Returns the summed stats.
    """
    counts = all_sum(torch.tensor([sum(int(s["loss_mask"].sum()) for s in batch_samples), len(batch_samples)]))
    batch_tokens = max(1, int(counts[0]))
    batch_sequences = int(counts[1])
    stats = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "kl_per_token": 0.0, "clip_count": 0.0}
    for indices in micro_batches(batch_samples, micro_batch_size):
        batch = collate([batch_samples[i] for i in indices], pad_id, model.device)
        logps = response_logprobs(model, batch, temperature, precision=precision)  # [rows, R]
        old_logps = batch["old_logps"]  # [rows, R]
        ref_logps = batch.get("ref_logps", old_logps)  # without a reference model (beta 0) the KL term is 0
        loss, micro = policy_loss(
            logps,
            old_logps,
            ref_logps,
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


def attach_targets(
    samples: list[dict],
    advantages: torch.Tensor,
    model,
    reference,
    args: Args,
    pad_id: int,
    precision: Precision = FP32,
) -> tuple[torch.Tensor, dict]:
    """Set what the loss needs on every sample: "old_logps" (one no-grad pass, which sets "entropy" too),
    "ref_logps" (the frozen reference model's, when beta > 0), "loss_mask" and "advantages" (the response's group
    advantage on each token, whitened over the masked tokens of the whole iteration batch, all ranks included).
    Returns the flat loss mask over all response tokens and the whitening's counts (bookkeeping.whitening_metrics)."""
    lengths = [len(s["response_ids"]) for s in samples]
    attach_old_logprobs(model, samples, args.micro_batch_size, args.temperature, pad_id, precision)
    flat_probs = torch.cat([s["old_logps"] for s in samples]).exp()  # p_t of every response token
    every_token = torch.ones(sum(lengths), dtype=torch.bool)
    flat_mask = loss_mask(every_token, flat_probs, args.prob_threshold, args.prob_mask, all_sum=distributed.all_sum)
    if reference is not None:
        # Parked in pinned CPU memory (--reference-on-device False): copied in for this pass
        with models.on_device(reference):
            for s, logps in zip(
                samples, sample_logprobs(reference, samples, args.micro_batch_size, args.temperature, pad_id, precision)
            ):
                s["ref_logps"] = logps
    raw = torch.repeat_interleave(advantages, torch.tensor(lengths))  # [all response tokens]
    flat_advantages = whiten(raw, flat_mask, all_sum=distributed.all_sum, mode=args.whiten)
    for s, mask, advantage in zip(samples, flat_mask.split(lengths), flat_advantages.split(lengths)):
        s["loss_mask"] = mask
        s["advantages"] = advantage
    return flat_mask, bookkeeping.whitening_metrics(raw, flat_advantages, flat_mask)


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
    """--epochs passes over the samples in shuffled batches of --batch-size, one optimizer step per batch (under
    torchrun each rank takes --batch-size / world size of its own samples, and the gradients are summed). Returns the
    stats of every step taken."""
    steps = []
    model.train()
    batch_size = args.batch_size // distributed.world_size()  # this rank's share of each batch
    for _ in range(args.epochs):
        order = torch.randperm(len(samples)).tolist()
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                model,
                [samples[i] for i in batch],
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
                scheduler.step()  # the schedule counts optimizer steps planned, taken or skipped
                continue
            optimizer.step()
            scheduler.step()
            steps.append(stats)
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
    steps_per_iteration = args.epochs * math.ceil(args.questions * args.group_size / args.batch_size)
    optimizer, scheduler = make_optimizer(
        model, args.lr, args.weight_decay, args.warmup_ratio, args.iterations * steps_per_iteration, run.state
    )
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
        rewards = torch.tensor([s if c.finish_reason == "stop" else 0.0 for s, c in zip(scores, completions)])

        # 3. Advantages: group-normalised, broadcast to every token, whitened over the iteration's masked tokens
        #    (of all ranks: distributed.all_sum).
        #    pi_old and the reference model's log-probs come from one no-grad pass each.
        advantages = group_advantages(rewards, args.group_size)
        samples = [new_sample(questions[i // args.group_size].prompt_ids, c) for i, c in enumerate(completions)]
        flat_mask, whitening = attach_targets(samples, advantages, model, reference, args, pad_id, run.precision)
        correct_rollouts(samples, args.rollout_correction, args.rollout_cap)  # beyond the paper; none: the paper's

        # 4. Update: epochs x shuffled batches x micro-batches (the rollout engine sleeps meanwhile).
        sampler.sleep()
        with book.timed("update"):
            update_stats = update_policy(
                model, optimizer, scheduler, samples, args, pad_id, iteration, book.guard, run.precision
            )
        sampler.wake_up()
        sampler.load_weights(model)
        seconds, last = book.end_iteration()  # rollout, update, iteration (without evaluation and checkpoint), train

        # 5. Log (over all ranks' responses), save samples, evaluate, checkpoint.
        lr = scheduler.get_last_lr()[0]
        metrics = iteration_metrics(
            rewards, completions, samples, flat_mask, args.group_size, update_stats, lr, seconds
        )
        metrics |= whitening  # the loss-masked tokens and what the whitening moved
        book.log(iteration, metrics, progress_line(iteration, metrics))
        if book.saves_samples(iteration):  # rank 0's questions
            records = sample_records(iteration, questions, completions, rewards, advantages, samples, tokenizer, args)
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
    rewards: torch.Tensor,
    completions: list[engines.Completion],
    samples: list[dict],
    flat_mask: torch.Tensor,
    group_size: int,
    update_stats: list[dict],
    lr: float,
    seconds: dict[str, float],
) -> dict:
    """One iteration's metrics.jsonl entry, over all ranks' responses (`samples`: what the update trained on, for the
    entropy and sampler metrics; `update_stats`: the optimizer steps taken; `seconds`: rollout, update, iteration and
    train timings)."""
    rewards = distributed.gather(rewards)
    completions = distributed.gather(completions)
    flat_mask = distributed.gather(flat_mask)
    generated = sum(len(completion.ids) for completion in completions)
    metrics = {
        "charts/reward": rewards.mean().item(),
        "charts/zero_spread_groups": (rewards.view(-1, group_size).std(dim=1) == 0).float().mean().item(),
        "charts/response_tokens": generated / len(completions),
        "charts/truncation_rate": sum(completion.finish_reason == "length" for completion in completions)
        / len(completions),
        "charts/lr": lr,
        "charts/tokens_per_second": generated / max(seconds["rollout"], 1e-9),
        "charts/generated_tokens": generated,
        "charts/loss_mask_fraction": flat_mask.float().mean().item(),
        # iteration: without evaluation and checkpoint
        **{f"time/{name}_seconds": value for name, value in seconds.items()},  # iteration: without eval, checkpoint
    }
    metrics |= rollout_metrics(samples)  # entropy; the sampler against the trainer
    return metrics | bookkeeping.loss_metrics(update_stats)


def progress_line(iteration: int, metrics: dict) -> str:
    """The one line printed per iteration."""
    return (
        f"iter {iteration}: reward {metrics['charts/reward']:.3f}  len {metrics['charts/response_tokens']:.0f}  "
        f"kl/token {metrics.get('losses/kl_per_token', 0):.2e}  rollout {metrics['time/rollout_seconds']:.1f}s  "
        f"update {metrics['time/update_seconds']:.1f}s"
    )


def sample_records(
    iteration: int,
    questions: list[tasks.Example],
    completions: list[engines.Completion],
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    samples: list[dict],
    tokenizer,
    args: Args,
) -> list[dict]:
    """The first --save-questions groups as viewer.py records: tokens, p_t, advantage (before whitening), loss mask."""
    return [
        runs.response_record(
            "grpo",
            iteration,
            i // args.group_size,
            questions[i // args.group_size],
            completions[i],
            rewards[i].item(),
            samples[i],
            [advantages[i].item()] * len(completions[i].ids),
            args.prob_threshold,
            tokenizer,
        )
        for i in range(min(args.save_questions, len(questions)) * args.group_size)
    ]


if __name__ == "__main__":
    cli.run_cli(main, cli.parse(Args))
