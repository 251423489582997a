"""The rollouts' policy against the trainer's: --rollout-correction tis reweighs each token's surrogate term in the
loss by min(pi_old / pi_sampler, --rollout-cap) (beyond the paper; off by default, and then nothing here touches the
loss); every run logs the gap itself per token (sampler/*) and the sampling distribution's entropy.

Beside what the loss needs (plumbing/training.py), a sample may hold, per response token (1-D tensors):
  sampler_logps    the log-prob the engine sampled the token with (Completion.logprobs): log softmax(logits /
                   temperature) of the sampler's own forward pass, over the whole vocabulary (before the top-p cut),
                   the quantity the trainer computes as old_logps; or, with sampler_top_p (vLLM at top_p < 1),
                   renormalised over the top-p nucleus the sampler drew the token from
  nucleus_logps    with sampler_top_p: the trainer's log-prob renormalised over the nucleus it rebuilds from its own
                   logits by vLLM's rule (training.nucleus_logprobs; -inf outside it), what sampler_logps is held
                   against; the loss never reads it
  entropy          the entropy of the sampling distribution softmax(logits / temperature) at the token's position,
                   from the pass that computed old_logps (training.attach_old_logprobs)
  rollout_weights  --rollout-correction tis: the weight that multiplied the token's surrogate (rollout_capped: where
                   the cap set it)
"""

from __future__ import annotations

import math

import torch

from plumbing import UsageError, distributed

# Per-token KL(sampler || trainer) above which a run prints one warning line. In fp32 the HF sampler and the trainer
# agree to rounding (1e-11 per token on SmolLM2, CPU); in bf16 autocast the sampler's KV-cached steps and the
# trainer's passes round differently: 0.9e-3 to 1.5e-3 per token on the CPU quickstart (benchmarks/README.md, "bf16
# against fp32 log-probs"). 1e-2 is seven times that: past it the rollouts come from a policy measurably different
# from the one trained (a sampler left behind by the updates, or weights that never reached it), which the ratio's
# pi_old, taken from the trainer, does not see.
SAMPLER_KL_WARNING = 1e-2


def rollout_weights(old_logps: torch.Tensor, sampler_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Token-level truncated importance sampling: min(pi_old_trainer / pi_sampler, cap) per token, the weight of its
    surrogate term. The trainer's pi_old is what the ratio assumes sampled the token; the sampler's own probability
    is what did. The cap bounds the variance a token the sampler found far less likely than the trainer adds.

    Paper: rollout correction (beyond the paper).

    >>> rollout_weights(torch.log(torch.tensor([0.5, 0.5, 0.9])), torch.log(torch.tensor([0.5, 0.25, 0.1])), 2.0)
    tensor([1., 2., 2.])
    >>> rollout_weights(torch.log(torch.tensor([0.2])), torch.log(torch.tensor([0.4])), 2.0)
    tensor([0.5000])
    """
    return torch.exp(torch.clamp(old_logps - sampler_logps, max=math.log(cap)))


def correct_rollouts(samples: list[dict], correction: str, cap: float) -> None:
    """--rollout-correction: with "tis" each sample's advantages (already whitened) are multiplied by its tokens'
    rollout_weights, stored as "rollout_weights". A weight w > 0 factors out of PPO-clip's min, so this is the
    surrogate weighted per token (as SPO-tree's edge weights are); the KL term and the token count stay unweighted.
    A sample without sampler log-probs (greedy rollouts, a replay-buffer edge from before they were kept) keeps
    weight 1. "none": nothing changes. A sample listed twice (SPO-tree's fill_samples) is weighted once."""
    if correction == "none":
        return
    if samples and not any("sampler_logps" in s for s in samples):
        raise UsageError(
            f"--rollout-correction {correction} needs the log-prob each token was sampled with, and the rollout engine "
            "reported none for this iteration's samples: use --rollout-correction none, or an engine that reports "
            "them (--backend hf; vLLM at --top-p 1)"
        )
    for s in {id(s): s for s in samples}.values():
        if "sampler_logps" in s:
            s["rollout_weights"] = rollout_weights(s["old_logps"], s["sampler_logps"], cap)
            s["rollout_capped"] = s["old_logps"] - s["sampler_logps"] >= math.log(cap)
            s["advantages"] = s["advantages"] * s["rollout_weights"]


def rollout_metrics(samples: list[dict]) -> dict:
    """The entropy, sampler and correction metrics of the samples an update trains on, over every rank's samples:
    policy/entropy (mean per response token, nats) and policy/entropy_loss_masked (over the loss-masked tokens);
    sampler/logp_gap_mean and sampler/logp_gap_max (|sampler - trainer| log-prob per token) and sampler/kl_per_token
    (k3 with d = trainer - sampler, whose mean under the sampler's draws estimates KL(sampler || trainer));
    sampler/tis_weight_mean and sampler/tis_capped_fraction with --rollout-correction tis. A metric whose tokens
    are missing (no sampler log-probs: greedy) is left out.

    The trainer's log-prob is old_logps, or where the sampler's is renormalised over a top-p nucleus (sampler_top_p
    < 1: vLLM at top_p < 1) nucleus_logps, renormalised over the nucleus the trainer rebuilds from its own logits:
    both sides then are log-probs under the same truncated distribution. d is clipped to [-10, 10] nats per token,
    so a token the trainer puts outside its nucleus (nucleus_logps -inf: a near tie at the nucleus's edge, bf16
    rounding) counts as a gap of exactly 10 nats (d = -10) instead of an infinite one; sampler/outside_nucleus_fraction
    is the share of those tokens among the compared tokens of such samples (logged only where there are any)."""
    sums = torch.zeros(12, dtype=torch.float64)
    largest_gap = torch.zeros(1, dtype=torch.float64)
    for s in samples:
        if "entropy" in s:
            mask = s["loss_mask"].bool()
            sums[:4] += torch.tensor([len(mask), s["entropy"].sum(), mask.sum(), s["entropy"][mask].sum()])
        if "sampler_logps" in s and len(s["sampler_logps"]):
            nucleus = s.get("sampler_top_p", 1.0) < 1.0
            trainer = s["nucleus_logps"] if nucleus else s["old_logps"]
            d = torch.clamp(trainer.double() - s["sampler_logps"].double(), -10.0, 10.0)
            sums[4:7] += torch.tensor([len(d), d.abs().sum(), (d.exp() - d - 1).sum()])
            largest_gap = torch.maximum(largest_gap, d.abs().max())
            if nucleus:
                sums[10:] += torch.tensor([len(d), torch.isneginf(trainer).sum()])
        if "rollout_weights" in s:
            sums[7:10] += torch.tensor(
                [len(s["rollout_weights"]), s["rollout_weights"].sum(), s["rollout_capped"].sum()]
            )
    return summarise(distributed.all_sum(sums), distributed.gather(largest_gap).max().item())


def summarise(sums: torch.Tensor, largest_gap: float) -> dict:
    """rollout_metrics' entries from its sums over ranks."""
    tokens, entropy, masked, masked_entropy, gap_tokens, gap, k3, weighted, weights, capped, nucleus, outside = (
        sums.tolist()
    )
    metrics = {}
    if tokens:
        metrics["policy/entropy"] = entropy / tokens
    if masked:
        metrics["policy/entropy_loss_masked"] = masked_entropy / masked
    if gap_tokens:
        metrics["sampler/logp_gap_mean"] = gap / gap_tokens
        metrics["sampler/logp_gap_max"] = largest_gap
        metrics["sampler/kl_per_token"] = k3 / gap_tokens
    if nucleus:
        metrics["sampler/outside_nucleus_fraction"] = outside / nucleus
    if weighted:
        metrics["sampler/tis_weight_mean"] = weights / weighted
        metrics["sampler/tis_capped_fraction"] = capped / weighted
    return metrics


def sampler_warning(iteration: int, metrics: dict) -> str | None:
    """The warning line for an iteration whose sampler/kl_per_token passes SAMPLER_KL_WARNING (None below it)."""
    kl = metrics.get("sampler/kl_per_token", 0.0)
    if not kl > SAMPLER_KL_WARNING:
        return None
    return (
        f"warning: iteration {iteration}: the sampler's log-probs differ from the trainer's by a KL of {kl:.2g} per "
        f"token (above {SAMPLER_KL_WARNING:g}; mean gap {metrics['sampler/logp_gap_mean']:.2g}, largest "
        f"{metrics['sampler/logp_gap_max']:.2g}): the rollouts come from another policy than the one trained; check "
        "that the engine receives the weights, compute the engine in a wider dtype, or --rollout-correction tis"
    )
