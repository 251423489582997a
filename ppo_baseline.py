"""PPO baseline: token-level advantages from a learned critic (value head) and GAE.

For each question, sample G responses; the reward R = 1 if the graded final answer is right sits on the
last response token. A critic, a copy of the policy's backbone with a scalar value head, predicts
V(s_t) for the state before every response token; GAE turns rewards and values into per-token
advantages (gamma = lambda = 1 in the paper, so A_t = R - V(s_t)) and returns (A_t + V(s_t), the
critic's targets). The policy is updated with the PPO-clip surrogate plus a k3 KL penalty to the frozen
reference model, the critic with the clipped value loss, each with its own AdamW. This is the
token-level baseline of Segment Policy Optimization (Guo et al. 2025, arXiv 2505.23564); see README.md.

Deliberate differences from the paper's released code: README.md, "Deliberate fixes over the paper's released
code". Here also: an unfinished response ends the episode (the value after it is 0, no bootstrap), and the
critic's gradient, like the policy's, does not depend on the micro-batch split.
Choices the paper leaves open: the critic is a separate copy of the policy's backbone (no shared
weights, so the value loss never moves the policy) with a zero-initialised value head, trained by its
own AdamW (--critic-lr) on every response token; --prob-mask (off, as in the paper's PPO) restricts
only the policy loss and the whitening, with the same semantics as grpo_baseline.py.

  python ppo_baseline.py                                                   # paper GSM8K run (Rho-1B SFT)
  python ppo_baseline.py --lam 0.96                                        # the common, lower-variance GAE lambda
  python ppo_baseline.py --model smollm2-135m --task rg:chain_sum --iterations 2 --questions 4 \
      --group-size 4                                                       # offline CPU
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import Cache

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
from plumbing.lora import plain_copy
from plumbing.precision import FP32, Precision
from plumbing.rollout_correction import correct_rollouts, rollout_metrics
from plumbing.training import (
    attach_old_logprobs,
    collate,
    make_optimizer,
    micro_batches,
    new_sample,
    no_grad_batches,
    reseed,
    response_logprobs,
    sample_logprobs,
)


@dataclass
class PpoSettings:
    """PPO's own settings: first in --help."""

    group_size: ranges.PositiveInt = 8
    """responses per question (PPO needs no groups; 8 keeps the paper's 64 x 8 samples per iteration)"""
    gamma: ranges.Fraction = 1.0
    """GAE discount (paper: 1; the reward is terminal, so anything below 1 favours short responses)"""
    lam: ranges.Fraction = 1.0
    """GAE lambda (paper: 1, i.e. A_t = R - V(s_t); 0.96 is a common, lower-variance choice)"""
    critic_lr: ranges.NonNegativeFloat = 1e-6
    """critic AdamW learning rate; the critic starts from the policy's weights and shares its schedule,
    --weight-decay, --max-grad-norm (each clipped on its own) and --gradient-checkpointing"""
    value_clip_eps: ranges.PositiveFloat = 0.2
    """clipping of new values around the rollout's values in the value loss"""
    prob_mask: bool = False
    "train the policy only on tokens with p_t < prob_threshold (loss and whitening; the critic trains on every token)"
    prob_threshold: ranges.Probability = 0.9
    """probability threshold of the mask"""


# PpoSettings first in --help, then the settings every script shares (settings.TrainArgs), redeclared
# here only where this algorithm's paper default differs.
@dataclass
class Args(settings.TrainArgs, PpoSettings):
    exp_name: str = "ppo"
    """experiment name, part of the run name"""


# The paper's runs of this algorithm (Guo et al. 2025, section 5 and appendix; the authors' released configs): the
# setup all four scripts share (plumbing/paper.py: model, task, sampling, evaluation, optimizer) and what this
# algorithm sets. Args' defaults are the first run's values. --dry-run prints every setting beside the matching run's,
# and the README's settings table is generated from these (python -m tools.paper_settings --write).
# fmt: off
PAPER_SETTINGS = {
    "gsm8k": dict(paper.GSM8K_RUN, questions=64, group_size=8, epochs=2, batch_size=64, gamma=1.0, lam=1.0,
                  value_clip_eps=0.2, prob_mask=False),
}
# fmt: on


# ----------------------------------------------------------------------------------------------
# Algorithm: advantages and losses (pure functions)


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a right-padded batch; returns (advantages, returns), both [batch, T].

    Paper: PPO's advantage (baseline).

    rewards[b, t]: reward received after response token t (here the graded reward on the last token);
    values[b, t]: the critic's V(s_{t-1}), the state just before token t is sampled; mask[b, t]: response
    tokens (a prefix of each row). The value after the last response token is 0 (the episode ends);
    padding contributes nothing and gets advantage and return 0.
      delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},   return_t = A_t + V_t
    With gamma = lam = 1 and a terminal reward R: A_t = R - V_t and return_t = R.

    >>> gae_advantages(torch.tensor([[0., 1.]]), torch.tensor([[.2, .4]]), torch.ones(1, 2))  # gamma = lam = 1
    (tensor([[0.8000, 0.6000]]), tensor([[1., 1.]]))

    gamma 0.9, lambda 0.8, V after the end 0: delta = (0.9 * 0.6 - 0.5, 0.9 * 0.7 - 0.6, 1 - 0.7) = (0.04, 0.03, 0.3),
    A_2 = 0.3, A_1 = 0.03 + 0.72 * 0.3 = 0.246, A_0 = 0.04 + 0.72 * 0.246 = 0.2171; returns = A + V.

    >>> gae_advantages(torch.tensor([[0., 0., 1.]]), torch.tensor([[.5, .6, .7]]), torch.ones(1, 3), gamma=.9, lam=.8)
    (tensor([[0.2171, 0.2460, 0.3000]]), tensor([[0.7171, 0.8460, 1.0000]]))
    """
    mask = mask.to(values.dtype)
    # [batch, T]; padding values are 0: the value after the end
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0]) if values.shape[1] else None  # [batch], A_{t+1}
    for t in reversed(range(values.shape[1])):
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]  # padding stays 0, so A after the last token is 0
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def loss_mask(
    response_mask: torch.Tensor,
    probs: torch.Tensor,
    threshold: float,
    prob_mask: bool,
    all_sum: Callable = lambda x: x,
) -> torch.Tensor:
    """Tokens that count in the policy loss: response tokens, and with the probability mask only those with
    p_t < threshold.

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


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    batch_tokens: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped value loss 0.5 * max((V - ret)^2, (clip(V, V_old - eps, V_old + eps) - ret)^2), masked, for [rows, T].

    Paper: PPO's advantage (baseline).

    Like PPO's ratio clip, a new value may not move the loss down by leaving the eps-band around the
    rollout's value. Normalised by the whole batch's masked-token count `batch_tokens` (default: this
    call's), so summing micro-batch losses gives the batch loss whatever the split.

    Rollout values 0, returns 1, eps 0.2: token 0 moved to 0.5, but its clipped value 0.2 is further from the
    return, so (0.2 - 1)^2 = 0.64 binds; token 1 (0.1) stays inside the band, 0.81 both ways; token 2 overshot to
    1.5: 0.25 unclipped, 0.64 clipped. loss = 0.5 * (0.64 + 0.81 + 0.64) / 3 tokens = 0.3483; two tokens clipped.

    >>> loss, stats = value_loss(torch.tensor([[0.5, 0.1, 1.5]]), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3),
    ...                          clip_eps=0.2, batch_tokens=3)
    >>> round(loss.item(), 4), {key: round(value, 4) for key, value in stats.items()}
    (0.3483, {'value_loss': 0.3483, 'value_clip_count': 2.0})
    """
    mask = mask.float()
    batch_tokens = batch_tokens if batch_tokens is not None else max(1.0, mask.sum().item())
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)  # [rows, T]
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * (torch.max(unclipped_loss, clipped_loss) * mask).sum() / batch_tokens
    stats = {
        "value_loss": loss.item(),
        "value_clip_count": ((clipped_loss > unclipped_loss).float() * mask).sum().item(),
    }
    return loss, stats


# ----------------------------------------------------------------------------------------------
# The critic: the policy's backbone with a scalar value head


class ValueModel(torch.nn.Module):
    """V(s) for every position of a sequence: a transformer backbone (no LM head) and a linear value head (make_critic
    builds it from the policy and sets the head's start)."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int, precision: Precision = FP32):
        super().__init__()
        self.backbone = backbone
        self.precision = precision
        self.value_head = torch.nn.Linear(
            hidden_size, 1, dtype=torch.float32, device=next(backbone.parameters()).device
        )

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        cache: Cache | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, Cache | None]:
        """Values [rows, positions] of the positions given, value i = V(tokens up to i), and with use_cache=True the
        KV cache with them added (`cache`: the KV cache of the positions before them, None when they start the
        sequence)."""
        device = input_ids.device.type
        with self.precision.autocast(device):  # fp32 weights; bf16 compute where `precision` chose it
            out = self.backbone(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
            )
        return self.value_head(out.last_hidden_state.float()).squeeze(-1), out.cache  # [rows, positions]


def response_values(critic, batch: dict) -> torch.Tensor:
    """V(s_{t-1}) for every response token y_t under a critic (a ValueModel): the value at the position of
    the token before it
    (the prompt's last token for y_0), the same positions whose logits give log pi(y_t). As in
    response_logprobs, each distinct prompt runs once and its rows' responses continue its KV cache."""
    prompt_len = batch["prompt_ids"].shape[1]
    # As in response_logprobs: with activation checkpointing the backward pass recomputes one whole pass
    if critic.backbone.is_activation_checkpointing and critic.training and torch.is_grad_enabled():
        values, _ = critic(batch["input_ids"], batch["attention_mask"], batch["positions"])  # [rows, P + R]
        return values[:, prompt_len - 1 : -1]  # [rows, R]; the value after the last column belongs to no token
    # [prompts, P]
    prompt_values, cache = critic(batch["prompt_ids"], batch["prompt_mask"], batch["prompt_positions"], use_cache=True)
    cache.batch_select_indices(batch["prompt_of_row"])  # [prompts, ...] -> [rows, ...]
    response_ids = batch["input_ids"][:, prompt_len:]
    positions = batch["positions"][:, prompt_len:]
    values, _ = critic(response_ids, batch["attention_mask"], positions, cache, use_cache=True)  # [rows, R]
    return torch.cat([prompt_values[batch["prompt_of_row"], -1:], values[:, :-1]], dim=1)  # [rows, R]


@torch.no_grad()
def sample_values(critic, samples: list[dict], micro_batch_size: int, pad_id: int) -> list[torch.Tensor]:
    """Per-sample values of the states before each response token (1-D CPU tensors), in passes sized to the GPU's
    free memory as sample_logprobs' (micro-batches of `micro_batch_size` where nothing is sized: a CPU, --fsdp)."""
    was_training = critic.training
    critic.eval()
    device = next(critic.parameters()).device
    out: list[torch.Tensor] = [None] * len(samples)
    for indices in no_grad_batches(critic, samples, micro_batch_size, critic.precision, config=critic.backbone.config):
        values = response_values(critic, collate([samples[i] for i in indices], pad_id, device)).cpu()
        for i, row in zip(indices, values):
            out[i] = row[: len(samples[i]["response_ids"])]
    critic.train(was_training)
    return out


def make_critic(policy, precision: Precision = FP32) -> ValueModel:
    """A critic initialised from the policy's weights: a separate copy of its backbone (the LM head is dropped) and a
    linear value head that starts at zero, so the untrained critic predicts 0 for every state: a neutral baseline
    (with gamma = lambda = 1 the first advantages are the rewards themselves) instead of random values that would
    add noise; the backbone gets gradients from the second step on, once the head is non-zero.

    Paper: PPO's advantage (baseline).
    """
    # plain_copy: with --lora-rank, without the policy's adapters (the critic trains its own weights in full)
    critic = ValueModel(plain_copy(policy.base_model), policy.config.hidden_size, precision)
    torch.nn.init.zeros_(critic.value_head.weight)
    torch.nn.init.zeros_(critic.value_head.bias)
    return critic


def load_critic(args: Args, model, checkpoint: Path | None, device: str, precision: Precision = FP32) -> ValueModel:
    """The critic from the policy's weights, or the checkpoint's critic.pt; then --gradient-checkpointing and
    --fsdp for policy and critic (after make_critic copied the policy's backbone)."""
    critic = make_critic(model, precision)
    if checkpoint:
        critic.load_state_dict(checkpoints.load_data(checkpoint / "critic.pt"))  # data only, never code
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable()  # transformers 5 name of gradient_checkpointing_enable
        critic.backbone.activation_checkpointing_enable()
    if args.fsdp:  # the reference stays whole
        distributed.fully_shard_model(model)
        distributed.fully_shard_model(critic)
    return critic


# ----------------------------------------------------------------------------------------------
# The update: what the loss needs, gradients, optimizer steps


def add_old_logprobs_and_values(
    samples: list[dict],
    model,
    reference,
    critic: ValueModel,
    micro_batch_size: int,
    temperature: float,
    pad_id: int,
    precision: Precision = FP32,
) -> None:
    """Store in each sample, once per iteration and without gradients: old_logps (the policy before this iteration's
    update, with the entropy of each token's sampling distribution), ref_logps (the reference model's; the old ones
    when there is none, beta 0) and old_values (the critic's)."""
    for sample, logps in zip(
        samples, attach_old_logprobs(model, samples, micro_batch_size, temperature, pad_id, precision)
    ):
        sample["ref_logps"] = logps
    if reference is not None:
        # Parked in pinned CPU memory (--reference-on-device False): copied in for this pass
        with models.on_device(reference):
            for sample, logps in zip(
                samples, sample_logprobs(reference, samples, micro_batch_size, temperature, pad_id, precision)
            ):
                sample["ref_logps"] = logps
    for sample, values in zip(samples, sample_values(critic, samples, micro_batch_size, pad_id)):
        sample["old_values"] = values


def add_advantages_and_returns(
    samples: list[dict],
    rewards: torch.Tensor,
    gamma: float,
    lam: float,
    prob_threshold: float,
    prob_mask: bool,
    whiten_mode: str = "centre-scale",
) -> tuple[torch.Tensor, dict]:
    """GAE over the whole iteration batch, from each sample's old_values and its reward (rewards[i], on the last
    response token); stores each sample's loss_mask, advantages (whitened over the masked tokens of the whole batch,
    all ranks included, by --whiten's `whiten_mode`) and returns (the critic's targets). Returns the GAE advantages
    before whitening, [N, T] right-padded, and the whitening's counts (bookkeeping.whitening_metrics)."""
    lengths = torch.tensor([len(s["response_ids"]) for s in samples])
    old_values = torch.nn.utils.rnn.pad_sequence([s["old_values"] for s in samples], batch_first=True)  # [N, T]
    response_mask = torch.arange(old_values.shape[1])[None] < lengths[:, None]  # [N, T]
    token_rewards = torch.zeros_like(old_values)  # [N, T]: the graded reward on each response's last token
    nonempty = lengths > 0  # a prompt that filled the context gets an empty response: no token to reward
    token_rewards[nonempty.nonzero().squeeze(-1), lengths[nonempty] - 1] = rewards[nonempty]
    advantages, returns = gae_advantages(token_rewards, old_values, response_mask, gamma, lam)  # [N, T]
    flat_probs = torch.cat([s["old_logps"] for s in samples]).exp()  # p_t of every response token
    flat_mask = loss_mask(
        torch.ones_like(flat_probs, dtype=torch.bool),
        flat_probs,
        prob_threshold,
        prob_mask,
        all_sum=distributed.all_sum,
    )
    raw = advantages[response_mask]  # [all response tokens]
    flat_advantages = whiten(raw, flat_mask, all_sum=distributed.all_sum, mode=whiten_mode)
    flat_returns = returns[response_mask]
    split = lengths.tolist()
    for s, mask, whitened, targets in zip(
        samples, flat_mask.split(split), flat_advantages.split(split), flat_returns.split(split)
    ):
        s["loss_mask"] = mask
        s["advantages"] = whitened
        s["returns"] = targets
    return advantages, bookkeeping.whitening_metrics(raw, flat_advantages, flat_mask)


def accumulate_gradients(
    model,
    critic: ValueModel,
    batch_samples: list[dict],
    *,
    micro_batch_size: int,
    temperature: float,
    clip_eps: float,
    beta: float,
    value_clip_eps: float,
    pad_id: int,
    all_sum: Callable = lambda x: x,
    precision: Precision = FP32,
) -> dict:
    """Forward/backward one optimizer batch through policy and critic in micro-batches; each model's
    gradients add up to its full-batch gradient. Under torchrun each rank passes its share of the batch and
    `all_sum=distributed.all_sum`: both losses are normalised by the whole batch's counts, so the ranks' gradients (and
    stats) sum to those of the whole batch."""
    # The whole batch's counts: the policy's masked tokens, the critic's tokens (every response token), sequences
    masked_tokens = sum(int(s["loss_mask"].sum()) for s in batch_samples)
    response_tokens = sum(len(s["response_ids"]) for s in batch_samples)
    counts = all_sum(torch.tensor([masked_tokens, response_tokens, len(batch_samples)]))
    batch_tokens = max(1, int(counts[0]))
    value_tokens = max(1, int(counts[1]))
    batch_sequences = int(counts[2])
    stats = dict.fromkeys(
        ("loss", "pg_loss", "kl", "kl_per_token", "clip_count", "value_loss", "value_clip_count"), 0.0
    )
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
        values = response_values(critic, batch)
        critic_loss, critic_micro = value_loss(
            values, batch["old_values"], batch["returns"], batch["response_mask"], value_clip_eps, value_tokens
        )
        critic_loss.backward()
        for key, value in {**micro, **critic_micro}.items():
            stats[key] = stats.get(key, 0.0) + value
    stats["clip_frac"] = stats.pop("clip_count") / batch_tokens
    stats["value_clip_frac"] = stats.pop("value_clip_count") / value_tokens
    return stats


# What the critic's terms point to when an update is not finite (bookkeeping.non_finite_cause reads the policy's).
NON_FINITE_CAUSES = {"value_loss": "the critic's values diverged (the advantages are the critic's): lower --critic-lr"}


def update_policy(
    model,
    critic: ValueModel,
    optimizer,
    scheduler,
    critic_optimizer,
    critic_scheduler,
    samples: list[dict],
    args: Args,
    pad_id: int,
    iteration: int,
    guard: bookkeeping.NonFiniteGuard,
    precision: Precision = FP32,
) -> list[dict]:
    """--epochs passes over the iteration's samples in shuffled batches of --batch-size, policy and critic on the
    same batches, one optimizer step each per batch (under torchrun each rank takes --batch-size / world size of
    its own samples, and the gradients are summed); returns the stats of the steps taken."""
    step_stats = []
    model.train()
    critic.train()
    batch_size = args.batch_size // distributed.world_size()  # this rank's share of each batch
    for _ in range(args.epochs):
        order = torch.randperm(len(samples)).tolist()
        for start in range(0, len(order), batch_size):
            optimizer.zero_grad(set_to_none=True)
            critic_optimizer.zero_grad(set_to_none=True)
            stats = accumulate_gradients(
                model,
                critic,
                [samples[i] for i in order[start : start + batch_size]],
                micro_batch_size=args.micro_batch_size,
                temperature=args.temperature,
                clip_eps=args.clip_eps,
                beta=args.beta,
                value_clip_eps=args.value_clip_eps,
                pad_id=pad_id,
                all_sum=distributed.all_sum,
                precision=precision,
            )
            stats = distributed.sum_over_ranks(stats)  # every rank takes the same decision below
            distributed.all_reduce_gradients(model, critic)
            stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            stats["critic_grad_norm"] = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm).item()
            if not guard.skips(
                stats,
                iteration,
                keys=("loss", "value_loss", "grad_norm", "critic_grad_norm"),
                fix="lower --lr / --critic-lr",
                temperature=args.temperature,
                causes={
                    "value_loss": "the critic's values diverged (the advantages are the critic's): lower --critic-lr"
                },
            ):
                optimizer.step()
                critic_optimizer.step()
                step_stats.append(stats)
            scheduler.step()  # a skipped update still uses up its step of the schedule
            critic_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    critic_optimizer.zero_grad(set_to_none=True)
    return step_stats


# ----------------------------------------------------------------------------------------------
# Main loop: the algorithm box


def main(args: Args) -> dict:
    # torchrun: this rank's GPU (or the CPU over gloo); plain python: one process
    device = distributed.init_distributed(args)
    validate(args)
    eval_task = args.eval_task or tasks.default_eval_task(args.task)
    if args.dry_run:  # nothing is loaded: the alias is expanded by name only
        return paper.dry_run(args, PAPER_SETTINGS, eval_task)
    # seed, precision, run directory, newest checkpoint, memory plan (for the policy and the critic)
    run = bookkeeping.start_run(args, device, second_model=True)
    if run.finished:
        return run.finished  # resumed after its last iteration: reported, left as it is
    args = replace(args, **run.plan.settings())  # from here on the memory knobs hold this device's values
    # The critic is a copy of the policy: gradient checkpointing and --fsdp are applied by load_critic, after the copy.
    model, tokenizer, reference = models.load_run_models(args, run.checkpoint, device, False, run.precision)
    critic = load_critic(args, model, run.checkpoint, device, run.precision)
    train_examples, eval_examples = tasks.load_examples(
        args.task, eval_task, args.context, args.eval_limit, args.seed, tokenizer, args.heldout_seed
    )
    sampler = engines.run_sampler(args, model, tokenizer, run.checkpoint, run.precision)
    sampling = engines.sampling_settings(args, tasks.stop_strings(args.task, tokenizer))
    pad_id = tokenizer.pad_token_id
    total_steps = args.iterations * args.epochs * math.ceil(args.questions * args.group_size / args.batch_size)
    # The policy's and the critic's AdamW, each with its schedule, restored from the checkpoint when resuming.
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, args.warmup_ratio, total_steps, run.state)
    critic_optimizer, critic_scheduler = make_optimizer(
        critic, args.critic_lr, args.weight_decay, args.warmup_ratio, total_steps, run.state, prefix="critic_"
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

        # 3. Old log-probs, reference log-probs and values once; then GAE over the whole iteration batch (the
        #    loss mask's fallback and the whitening over all ranks' tokens: distributed.all_sum).
        samples = [new_sample(questions[i // args.group_size].prompt_ids, c) for i, c in enumerate(completions)]
        add_old_logprobs_and_values(
            samples, model, reference, critic, args.micro_batch_size, args.temperature, pad_id, run.precision
        )
        # [N, T], before whitening
        advantages, whitening = add_advantages_and_returns(
            samples, rewards, args.gamma, args.lam, args.prob_threshold, args.prob_mask, args.whiten
        )
        correct_rollouts(samples, args.rollout_correction, args.rollout_cap)  # beyond the paper; none: the paper's

        # 4. Update: epochs x shuffled batches x micro-batches, policy and critic on the same batches (the rollout
        #    engine sleeps meanwhile).
        sampler.sleep()
        with book.timed("update"):
            update_stats = update_policy(
                model,
                critic,
                optimizer,
                scheduler,
                critic_optimizer,
                critic_scheduler,
                samples,
                args,
                pad_id,
                iteration,
                book.guard,
                run.precision,
            )
        sampler.wake_up()
        sampler.load_weights(model)
        seconds, last = book.end_iteration()  # rollout, update, iteration (without evaluation and checkpoint), train

        # 5. Log (over all ranks' responses), save samples, evaluate, checkpoint.
        lr = scheduler.get_last_lr()[0]
        critic_lr = critic_scheduler.get_last_lr()[0]
        metrics = iteration_metrics(rewards, completions, samples, update_stats, lr, critic_lr, seconds)
        metrics |= whitening  # the loss-masked tokens and what the whitening moved
        book.log(iteration, metrics, progress_line(iteration, metrics))
        if book.saves_samples(iteration):  # rank 0's questions
            records = sample_records(iteration, questions, completions, rewards, advantages, samples, tokenizer, args)
            book.write_samples(iteration, records)
        if book.due(iteration, args.eval_every, last):
            book.evaluate(iteration)
        # every rank: with --fsdp the states are gathered from the shards
        if book.due(iteration, args.save_every, last):
            trainer_state = {
                **checkpoints.optimizer_checkpoint(model, optimizer, scheduler),
                **checkpoints.optimizer_checkpoint(critic, critic_optimizer, critic_scheduler, prefix="critic_"),
                "iteration": iteration,
            }
            checkpoints.save_checkpoint(run.dir, model, tokenizer, trainer_state, modules={"critic": critic})
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
    update_stats: list[dict],
    lr: float,
    critic_lr: float,
    seconds: dict[str, float],
) -> dict:
    """One iteration's metrics.jsonl entry, over all ranks' responses (losses/ averaged over `update_stats`, the
    optimizer steps taken; `seconds`: rollout, update, iteration and train timings)."""
    rewards = distributed.gather(rewards)
    completions = distributed.gather(completions)
    rank_samples = samples
    # What the metrics read of each sample, from every rank
    samples = distributed.gather([{key: s[key] for key in ("loss_mask", "old_values", "returns")} for s in samples])
    generated = sum(len(c.ids) for c in completions)
    flat_mask = torch.cat([s["loss_mask"] for s in samples])  # every response token of the iteration
    flat_values = torch.cat([s["old_values"] for s in samples])
    flat_returns = torch.cat([s["returns"] for s in samples])
    metrics = {
        "charts/reward": rewards.mean().item(),
        "charts/response_tokens": generated / len(completions),
        "charts/truncation_rate": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "charts/lr": lr,
        "charts/critic_lr": critic_lr,
        "charts/tokens_per_second": generated / max(seconds["rollout"], 1e-9),
        "charts/loss_mask_fraction": flat_mask.float().mean().item(),
        "charts/mean_value": flat_values.mean().item() if len(flat_values) else 0.0,
        "charts/generated_tokens": generated,
        **{f"time/{name}_seconds": value for name, value in seconds.items()},  # iteration: without eval, checkpoint
    }
    # Explained variance of the rollout's values against the returns: 1 = perfect critic, 0 = no better
    # than a constant, undefined (not logged) when every return is the same.
    if len(flat_returns) > 1 and flat_returns.var() > 0:
        metrics["losses/explained_variance"] = (1 - (flat_returns - flat_values).var() / flat_returns.var()).item()
    metrics |= rollout_metrics(rank_samples)  # entropy; the sampler against the trainer
    return metrics | bookkeeping.loss_metrics(update_stats)


def progress_line(iteration: int, metrics: dict) -> str:
    """The one line printed per iteration."""
    return (
        f"iter {iteration}: reward {metrics['charts/reward']:.3f}  len {metrics['charts/response_tokens']:.0f}  "
        f"kl/token {metrics.get('losses/kl_per_token', 0):.2e}  value loss {metrics.get('losses/value_loss', 0):.3f}  "
        f"rollout {metrics['time/rollout_seconds']:.1f}s  update {metrics['time/update_seconds']:.1f}s"
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
    """The --save-samples records (viewer.py's format) of the first --save-questions questions' responses."""
    return [
        runs.response_record(
            "ppo",
            iteration,
            i // args.group_size,
            questions[i // args.group_size],
            completions[i],
            rewards[i].item(),
            samples[i],
            advantages[i, : len(completions[i].ids)].tolist(),  # GAE, before whitening
            args.prob_threshold,
            tokenizer,
            values=samples[i]["old_values"].tolist(),
        )
        for i in range(min(args.save_questions, len(questions)) * args.group_size)
    ]


if __name__ == "__main__":
    cli.run_cli(main, cli.parse(Args))
