"""GRPO baseline: one trajectory-level advantage per response, normalised within its group.

For each question, sample G responses; reward r_i = 1 if the graded final answer is right;
every token of response i gets A_i = (r_i - mean(r)) / (std(r) + 1e-8). The policy is updated
with the PPO-clip surrogate plus a k3 KL penalty to the frozen reference model. This is the
trajectory-level baseline of Segment Policy Optimization (Guo et al. 2025, arXiv 2505.23564);
see README.md for the paper's settings and results.

Deliberate differences from the paper's released code (kept identical in every script here):
- token-exact: the ids sampled are the ids trained, never decoded and re-tokenised; EOS is trained;
- unfinished (length-limited) responses score 0;
- advantages are whitened over the whole iteration batch, not per micro-batch, and the gradient
  of a batch does not depend on how it is split into micro-batches;
- --prob-mask gives the paper's GRPO+mask ablation (loss only on tokens with p_t < threshold).

  python grpo_baseline.py                                                  # paper GSM8K run (Rho-1B SFT)
  python grpo_baseline.py --model deepseek-r1-distill-qwen-1.5b --task math --context 2048 --max-new-tokens 2048 --top-p 1.0 \
      --eval-samples 1 --eval-temperature 0.6 --eval-top-p 0.95                     # paper long-CoT run, MATH -> MATH500
  python grpo_baseline.py --model smollm2-135m --task rg:chain_sum --iterations 2 --questions 4 --group-size 4  # offline CPU
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal

import torch
import tqdm
from torch.utils.checkpoint import checkpoint
from torch.utils.tensorboard import SummaryWriter
from transformers import Cache, get_linear_schedule_with_warmup

import eval as ev


@dataclass
class Args:
    exp_name: str = "grpo"
    """experiment name, part of the run name"""
    seed: int = 1
    """seed of question sampling, rollouts and initialisation (same seed on CPU gives identical metrics)"""
    model: str = "rho-1b-sft-gsm8k"
    """policy to start from: model directory, Hugging Face id or alias (see eval.py)"""
    task: str = "gsm8k"
    """training task: gsm8k | math | rg:<reasoning-gym dataset> | path.jsonl"""
    eval_task: str | None = None
    """held-out task (default: the training task's test split; MATH500 for --task math)"""
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
    """training iterations (rollout + update)"""
    questions: int = 64
    """questions per iteration (sampled with replacement)"""
    group_size: int = 8
    """responses per question (G)"""
    temperature: float = 0.6
    """sampling temperature; log-probs divide logits by it too"""
    top_p: float = 0.9
    """nucleus sampling threshold"""
    max_new_tokens: int = 1024
    """response token budget"""
    context: int = 2047
    """total context budget (prompt + response)"""
    lr: float = 1e-6
    """AdamW learning rate (3% linear warmup, then linear decay)"""
    warmup_ratio: float = 0.03
    """fraction of optimizer steps spent warming up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    epochs: int = 2
    """passes over each iteration's samples"""
    batch_size: int = 64
    """sequences per optimizer step"""
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
    eval_samples: int = 16
    """samples per held-out question (paper GSM8K protocol: 16 at temperature 0.35, top_p 0.9)"""
    eval_temperature: float = 0.35
    """evaluation sampling temperature"""
    eval_top_p: float = 0.9
    """evaluation nucleus threshold (paper GSM8K protocol: 0.9, the authors' eval config)"""
    save_every: int = 10
    """checkpoint every N iterations (and after the last)"""
    max_minutes: float | None = None
    """stop after the iteration that ends past this many minutes of training (evaluation not counted), as if it were the last"""
    save_samples: int = 0
    """every N iterations write the first --save-questions groups to runs/<run>/samples/iter_<k>.jsonl for viewer.py (0: never)"""
    save_questions: int = 2
    """questions whose responses --save-samples writes"""
    vllm_gpu_memory_utilization: float = 0.3
    """GPU memory fraction for the vLLM engine"""

    # Algorithm specific
    prob_mask: bool = False
    """GRPO+mask ablation: train only on tokens with p_t < prob_threshold"""
    prob_threshold: float = 0.9
    """probability threshold of the mask"""


# The paper's runs of this algorithm (Guo et al. 2025, section 5 and appendix; the authors' released configs).
# Args' defaults are the first run's values. --dry-run prints every setting beside the matching run's values,
# and the README's settings table is generated from this dict (python benchmarks/paper_settings.py --write).
PAPER_SETTINGS = {
    "gsm8k": dict(
        model="rho-1b-sft-gsm8k", task="gsm8k", eval_task="gsm8k", temperature=0.6, top_p=0.9, max_new_tokens=1024,
        context=2047, eval_samples=16, eval_temperature=0.35, eval_top_p=0.9, questions=64, group_size=8, epochs=2,
        batch_size=64, lr=1e-6, warmup_ratio=0.03, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, beta=1e-4,
        prob_mask=False,
    ),
    "math": dict(
        model="deepseek-r1-distill-qwen-1.5b", task="math", eval_task="math500", temperature=0.6, top_p=1.0,
        context=2048, eval_samples=1, eval_temperature=0.6, eval_top_p=0.95, questions=64, group_size=8, lr=1e-6,
        warmup_ratio=0.03, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, beta=1e-4, prob_mask=False,
    ),
}


# ----------------------------------------------------------------------------------------------
# Algorithm: advantages and loss (pure functions)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-8) -> torch.Tensor:
    """(r - group mean) / (group std + eps), groups being `group_size` consecutive rewards (std with ddof 0).

    >>> group_advantages(torch.tensor([1., 0., 0., 1., 1., 1.]), 3)
    tensor([ 1.4142, -0.7071, -0.7071,  0.0000,  0.0000,  0.0000])
    """
    groups = rewards.view(-1, group_size)  # [questions, G]
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + eps)).view_as(rewards)


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

    Rows with the same prompt (a question's G responses) share one forward pass of it: each distinct prompt runs once,
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


def accumulate_gradients(
    model, batch_samples: list[dict], *, micro_batch_size: int, temperature: float, clip_eps: float, beta: float,
    pad_id: int, on_policy: bool = False, all_sum: Callable = lambda x: x,
) -> tuple[dict, list[torch.Tensor]]:
    """Forward/backward one optimizer batch in micro-batches; gradients add up to the full-batch gradient.
    Under torchrun each rank passes its share of the batch and `all_sum=ev.all_sum`: the loss is normalised by
    the whole batch's counts, so the ranks' gradients (and stats) sum to those of the whole batch.

    Each sample holds prompt_ids, response_ids, advantages, loss_mask, and old_logps and ref_logps (both
    optional: without ref_logps the KL term is 0; with on_policy=True pi_old is this forward pass's own
    log-probs, detached, which is exact when the policy has not moved since the rollout). Returns the summed
    stats and, when on_policy, every sample's pi_old log-probs (1-D, CPU; an empty list otherwise).
    """
    counts = all_sum(torch.tensor([sum(int(s["loss_mask"].sum()) for s in batch_samples), len(batch_samples)]))
    batch_tokens, batch_sequences = max(1, int(counts[0])), int(counts[1])
    stats, sample_logps = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_count": 0.0}, [None] * len(batch_samples)
    for indices in micro_batches(batch_samples, micro_batch_size):
        batch = collate([batch_samples[i] for i in indices], pad_id, model.device)
        logps = response_logprobs(model, batch, temperature)  # [rows, R]
        old_logps = logps.detach() if on_policy else batch["old_logps"]  # [rows, R]
        ref_logps = batch.get("ref_logps", old_logps)  # without a reference model (beta 0) the KL term is 0
        loss, micro = policy_loss(
            logps, old_logps, ref_logps, batch["advantages"], batch["loss_mask"], clip_eps, beta, batch_tokens, batch_sequences,
        )
        loss.backward()
        stats["loss"] += loss.item()
        for key in micro:
            stats[key] += micro[key]
        for i, row in zip(indices, logps if on_policy else []):
            sample_logps[i] = row[: len(batch_samples[i]["response_ids"])].detach().cpu()
    stats["clip_frac"] = stats.pop("clip_count") / batch_tokens
    return stats, sample_logps if on_policy else []


def attach_targets(samples: list[dict], advantages: torch.Tensor, model, reference, args: Args, pad_id: int, on_policy: bool) -> torch.Tensor:
    """Set what the loss needs on every sample: "old_logps" (one no-grad pass; skipped on-policy, where the update's
    own forward pass provides them), "ref_logps" (the frozen reference model's, when beta > 0), "loss_mask" and
    "advantages" (the response's group advantage on each token, whitened over the masked tokens of the whole
    iteration batch, all ranks included). Returns the flat loss mask over all response tokens."""
    lengths = [len(s["response_ids"]) for s in samples]
    flat_mask = torch.ones(sum(lengths), dtype=torch.bool)  # on-policy: every response token
    if not on_policy:
        for s, logps in zip(samples, sample_logprobs(model, samples, args.micro_batch_size, args.temperature, pad_id)):
            s["old_logps"] = logps
        flat_probs = torch.cat([s["old_logps"] for s in samples]).exp()  # p_t of every response token
        flat_mask = loss_mask(flat_mask, flat_probs, args.prob_threshold, args.prob_mask, all_sum=ev.all_sum)
    if reference is not None:
        reference.to(model.device)  # parked on the CPU the rest of the time
        for s, logps in zip(samples, sample_logprobs(reference, samples, args.micro_batch_size, args.temperature, pad_id)):
            s["ref_logps"] = logps
        reference.to("cpu")
    flat_advantages = whiten(torch.repeat_interleave(advantages, torch.tensor(lengths)), flat_mask, all_sum=ev.all_sum)
    for s, mask, advantage in zip(samples, flat_mask.split(lengths), flat_advantages.split(lengths)):
        s["loss_mask"], s["advantages"] = mask, advantage
    return flat_mask


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


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, scheduler, iteration: int) -> Path:
    """Write runs/<run>/checkpoint atomically: a SIGKILL mid-save leaves the previous checkpoint intact. Every rank
    calls it (with --fsdp the weights and the optimizer state are gathered from the shards); rank 0 writes."""
    final, staging, previous = run_dir / "checkpoint", run_dir / "checkpoint.new", run_dir / "checkpoint.old"
    weights, optimizer_state = ev.full_state_dict(model), ev.optimizer_state(model, optimizer)
    if ev.rank() > 0:
        return final
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, state_dict=weights)
    tokenizer.save_pretrained(staging)
    torch.save({"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "iteration": iteration,
                "world_size": ev.world_size()}, staging / "trainer_state.pt")
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


def validate(args: Args) -> None:
    problems = ev.setting_problems(args)  # the settings every script shares
    if args.group_size < 2:
        problems.append("--group-size must be at least 2 (GRPO compares responses within a group)")
    if args.questions < 1 or args.iterations < 1 or args.epochs < 1:
        problems.append("--questions, --iterations and --epochs must be positive")
    if args.micro_batch_size < 1 or args.batch_size < args.micro_batch_size or args.batch_size % args.micro_batch_size:
        problems.append(f"--batch-size ({args.batch_size}) must be a positive multiple of --micro-batch-size ({args.micro_batch_size})")
    if args.context <= 0 or args.max_new_tokens <= 0 or args.temperature <= 0:
        problems.append("--context, --max-new-tokens and --temperature must be positive")
    if (args.max_minutes is not None and args.max_minutes <= 0) or args.save_samples < 0 or args.save_questions < 1:
        problems.append("--max-minutes must be positive, --save-samples at least 0 and --save-questions at least 1")
    problems += ev.world_size_problems(args, per_rank={"--questions": args.questions, "--batch-size": args.batch_size})
    if problems:
        raise ev.UsageError("; ".join(problems))


# Setup: the run directory, the models, the data, the optimizer; the log


def open_run(args: Args) -> tuple[Path, Path | None]:
    """The run directory (new, or the one --resume names) and its newest intact checkpoint (None: start from
    --model). Writes the run's settings to args.json and records this start in starts.jsonl."""
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


def load_models(args: Args, checkpoint: Path | None, device: str):
    """The policy (fp32 master weights) from the checkpoint or --model, its tokenizer, and the frozen reference
    model (None with --beta 0), which is parked on the CPU except while its log-probs are computed."""
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


def load_examples(args: Args, eval_task: str, tokenizer) -> tuple[list[ev.Example], list[ev.Example]]:
    """Training questions (those without room for a response in --context dropped) and held-out questions."""
    train_examples = ev.load_task(args.task, "train", seed=args.seed, tokenizer=tokenizer)
    eval_examples = ev.load_task(eval_task, "test", limit=args.eval_limit, seed=args.seed, tokenizer=tokenizer)
    return (ev.check_prompt_room(train_examples, args.context, f"--task {args.task}", drop=True),
            ev.check_prompt_room(eval_examples, args.context, f"--eval-task {eval_task}", drop=False))


def make_optimizer(args: Args, model, checkpoint: Path | None, total_steps: int):
    """AdamW with linear warmup and decay, restored from the checkpoint when resuming; also returns the first
    iteration to run."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)
    if checkpoint is None:
        return optimizer, scheduler, 1
    state = torch.load(checkpoint / "trainer_state.pt", map_location=model.device, weights_only=False)
    ev.load_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return optimizer, scheduler, state["iteration"] + 1


class RunLog:
    """The run's metrics.jsonl, TensorBoard and (with --track) W&B. A resumed run drops the metrics of iterations
    after its checkpoint (they are redone) and continues the training-time count of the kept ones."""

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
        if self.wandb:
            self.wandb.log(metrics, step=iteration)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# ----------------------------------------------------------------------------------------------
# One iteration's pieces around the algorithm: seeding, the update loop, evaluation, metrics, samples


def reseed(seed: int, iteration: int, sampler) -> random.Random:
    """Seed everything from (seed, iteration, rank), so a resumed run samples exactly what the uninterrupted one
    would (at the same world size). The returned generator is the same on every rank (it picks the questions);
    torch's and the sampler's differ per rank, so ranks draw different responses."""
    rank_seed = seed * 1_000_003 + iteration + (ev.rank() << 32)  # rank 0: the seed of a single-process run
    torch.manual_seed(rank_seed)
    if hasattr(sampler, "generator"):
        sampler.generator.manual_seed(rank_seed)
    return random.Random(seed * 1_000_003 + iteration)


def skipped_non_finite(stats: dict, iteration: int, streak: list[int]) -> bool:
    """True when this optimizer step's loss is inf or nan, so the step is skipped; three in a row end the run.
    `streak` ([count]) carries the number of non-finite losses in a row across steps and iterations."""
    if math.isfinite(stats["loss"]):
        streak[0] = 0
        return False
    streak[0] += 1
    warnings.warn(f"iteration {iteration}: non-finite loss, update skipped")
    if streak[0] >= 3:
        raise ev.UsageError("three non-finite losses in a row: lower --lr, or check the model and data")
    return True


def update_policy(
    model, optimizer, scheduler, samples: list[dict], args: Args, pad_id: int, on_policy: bool, iteration: int, streak: list[int],
) -> tuple[list[dict], list[torch.Tensor | None]]:
    """--epochs passes over the samples in shuffled batches of --batch-size, one optimizer step per batch (under
    torchrun each rank takes --batch-size / world size of its own samples, and the gradients are summed). Returns the stats of every step taken and, when on_policy (one step per iteration), each sample's pi_old
    log-probs from that step's forward pass (None otherwise)."""
    steps, forward_logps = [], [None] * len(samples)
    model.train()
    batch_size = args.batch_size // ev.world_size()  # this rank's share of each batch
    for _ in range(args.epochs):
        order = torch.randperm(len(samples)).tolist()
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            stats, logps = accumulate_gradients(
                model, [samples[i] for i in batch], micro_batch_size=args.micro_batch_size, temperature=args.temperature,
                clip_eps=args.clip_eps, beta=args.beta, pad_id=pad_id, on_policy=on_policy, all_sum=ev.all_sum,
            )
            for i, sample_logps in zip(batch, logps):
                forward_logps[i] = sample_logps
            stats = ev.sum_over_ranks(stats)  # every rank takes the same decision below
            if skipped_non_finite(stats, iteration, streak):
                scheduler.step()  # the schedule counts optimizer steps planned, taken or skipped
                continue
            ev.all_reduce_gradients(model)
            stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            optimizer.step()
            scheduler.step()
            steps.append(stats)
    optimizer.zero_grad(set_to_none=True)
    return steps, forward_logps


def evaluate_policy(model, tokenizer, sampler, eval_task: str, eval_examples: list[ev.Example], args: Args) -> dict:
    """The eval/... metrics of the current policy on the held-out questions (the --eval-* protocol)."""
    result = ev.evaluate(
        model, tokenizer, eval_task, examples=eval_examples, samples=args.eval_samples, temperature=args.eval_temperature,
        top_p=args.eval_top_p, max_new_tokens=args.max_new_tokens, context=args.context, sampler=sampler, seed=args.seed,
    )
    return {"eval/accuracy": result["accuracy"], f"eval/pass@{args.eval_samples}": result[f"pass@{args.eval_samples}"],
            "eval/majority_accuracy": result["majority_accuracy"], "eval/truncation_rate": result["truncation_rate"]}


def iteration_metrics(
    rewards: torch.Tensor, completions: list[ev.Completion], flat_mask: torch.Tensor, steps: list[dict], lr: float,
    group_size: int, seconds: dict[str, float],
) -> dict:
    """The metrics.jsonl entry of one iteration (`seconds`: rollout, update, iteration, train)."""
    generated = sum(len(completion.ids) for completion in completions)
    metrics = {
        "charts/reward": rewards.mean().item(),
        "charts/zero_spread_groups": (rewards.view(-1, group_size).std(dim=1) == 0).float().mean().item(),
        "charts/response_tokens": generated / len(completions),
        "charts/truncation_rate": sum(completion.finish_reason == "length" for completion in completions) / len(completions),
        "charts/lr": lr,
        "charts/tokens_per_second": generated / max(seconds["rollout"], 1e-9),
        "charts/generated_tokens": generated,
        "charts/loss_mask_fraction": flat_mask.float().mean().item(),
        **{f"time/{name}_seconds": value for name, value in seconds.items()},  # iteration: without evaluation and checkpoint
    }
    for key in ("loss", "pg_loss", "kl", "clip_frac", "grad_norm"):
        if steps:
            metrics[f"losses/{key}"] = sum(step[key] for step in steps) / len(steps)
    return metrics


def progress_line(iteration: int, metrics: dict) -> str:
    """The one line printed per iteration."""
    return (f"iter {iteration}: reward {metrics['charts/reward']:.3f}  len {metrics['charts/response_tokens']:.0f}  "
            f"kl {metrics.get('losses/kl', 0):.2e}  rollout {metrics['time/rollout_seconds']:.1f}s  "
            f"update {metrics['time/update_seconds']:.1f}s")


def sample_records(
    iteration: int, questions: list[ev.Example], completions: list[ev.Completion], rewards: torch.Tensor,
    advantages: torch.Tensor, samples: list[dict], tokenizer, args: Args,
) -> list[dict]:
    """The first --save-questions groups as viewer.py records: tokens, p_t, advantage (before whitening), loss mask."""
    records = []
    for i in range(min(args.save_questions, len(questions)) * args.group_size):
        question = questions[i // args.group_size]
        records.append({
            "algorithm": "grpo", "iteration": iteration, "question_index": i // args.group_size,
            "question": question.question, "reference": question.answer, "prompt": question.prompt,
            "reward": rewards[i].item(), "finish_reason": completions[i].finish_reason, "token_ids": completions[i].ids,
            "tokens": ev.token_pieces(tokenizer, completions[i].ids), "probs": samples[i]["old_logps"].exp().tolist(),
            "advantages": [advantages[i].item()] * len(completions[i].ids),
            "loss_mask": samples[i]["loss_mask"].tolist(), "prob_threshold": args.prob_threshold,
            "cutpoints": None, "cutpoint_values": None, "values": None,
        })
    return records


def finish_run(run_dir: Path, log: RunLog, accuracy_before: float | None, accuracy_after: float | None, eval_task: str) -> dict:
    """Close the log, write summary.json and print the one-line result (rank 0 under torchrun)."""
    log.close()
    summary = {"run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoint"), "accuracy_before": accuracy_before, "accuracy_after": accuracy_after}
    if ev.rank() > 0:
        return summary
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    before = f"{accuracy_before:.3f}" if accuracy_before is not None else "n/a (resumed, or --no-eval-before)"
    after = f"{accuracy_after:.3f}" if accuracy_after is not None else "n/a (no iteration ran)"
    print(f"accuracy {before} -> {after} on {eval_task}; metrics {log.path}; checkpoint {run_dir / 'checkpoint'}")
    return summary


# ----------------------------------------------------------------------------------------------
# Main loop


def main(args: Args) -> dict:
    device = ev.init_distributed()  # torchrun: this rank's GPU (or CPU over gloo); plain python: one process
    validate(args)
    eval_task = args.eval_task or ev.default_eval_task(args.task)
    if args.dry_run:  # nothing is loaded: the alias is expanded by name only
        return ev.dry_run(args, PAPER_SETTINGS, resolved={"eval_task": eval_task, "model_id": ev.ALIASES.get(args.model, args.model)})
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
    steps_per_iteration = args.epochs * math.ceil(args.questions * args.group_size / args.batch_size)
    # One optimizer step per iteration and no probability mask: pi_old is the policy of that step's own forward
    # pass, so the separate no-grad pass over the batch for old log-probs is skipped (same loss and gradient).
    on_policy = steps_per_iteration == 1 and not args.prob_mask
    optimizer, scheduler, start_iteration = make_optimizer(args, model, checkpoint, args.iterations * steps_per_iteration)
    log, streak = RunLog(run_dir, start_iteration, args), [0]  # streak: non-finite losses in a row
    accuracy_before = accuracy_after = None
    if start_iteration == 1 and args.eval_before:
        log.write(0, evaluation := evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args))
        accuracy_before = accuracy_after = evaluation["eval/accuracy"]

    progress = tqdm.tqdm(range(start_iteration, args.iterations + 1), desc="iterations", initial=start_iteration - 1,
                         total=args.iterations, disable=ev.rank() > 0)
    for iteration in progress:
        rng = reseed(args.seed, iteration, sampler)

        # 1. Rollout: G responses per question (under torchrun, per question of this rank's share).
        started = iteration_started = time.time()
        questions = ev.shard([rng.choice(train_examples) for _ in range(args.questions)])
        groups = sampler.sample(
            [q.prompt_ids for q in questions], args.group_size, temperature=args.temperature, top_p=args.top_p,
            max_new_tokens=args.max_new_tokens, stop=stop, context=args.context, progress="rollout",
        )
        completions = [completion for group in groups for completion in group]
        rollout_seconds = time.time() - started

        # 2. Rewards: the graded final answer; an unfinished response scores 0.
        texts = [tokenizer.decode(completion.ids, skip_special_tokens=True) for completion in completions]
        scores = ev.grade(texts, [q.answer for q in questions for _ in range(args.group_size)], args.task)
        rewards = torch.tensor([s if completion.finish_reason == "stop" else 0.0 for s, completion in zip(scores, completions)])

        # 3. Advantages: group-normalised, broadcast to every token, whitened over the iteration's masked tokens
        #    (of all ranks: ev.all_sum).
        #    pi_old and the reference model's log-probs come from one no-grad pass each; on-policy, pi_old comes
        #    from the update's own forward pass instead (step 4), and every token is in the loss mask.
        advantages = group_advantages(rewards, args.group_size)
        samples = [{"prompt_ids": questions[i // args.group_size].prompt_ids, "response_ids": c.ids} for i, c in enumerate(completions)]
        flat_mask = attach_targets(samples, advantages, model, reference, args, pad_id, on_policy)

        # 4. Update: epochs x shuffled batches x micro-batches (the rollout engine sleeps meanwhile).
        sampler.sleep()
        started = time.time()
        steps, forward_logps = update_policy(model, optimizer, scheduler, samples, args, pad_id, on_policy, iteration, streak)
        if on_policy:  # pi_old is what the update's forward pass computed: keep it for the samples file
            for s, logps in zip(samples, forward_logps):
                s["old_logps"] = logps
        update_seconds = time.time() - started
        sampler.wake_up()
        sampler.load_weights(model)
        iteration_seconds = time.time() - iteration_started
        log.train_seconds += iteration_seconds
        last = ev.broadcast(iteration == args.iterations or (args.max_minutes is not None and log.train_seconds >= 60 * args.max_minutes))

        # 5. Log (over all ranks' responses), save samples, evaluate, checkpoint.
        metrics = iteration_metrics(ev.gather(rewards), ev.gather(completions), ev.gather(flat_mask), steps, scheduler.get_last_lr()[0], args.group_size, {
            "rollout": rollout_seconds, "update": update_seconds, "iteration": iteration_seconds, "train": log.train_seconds,
        })
        log.write(iteration, metrics)
        progress.set_postfix(reward=f"{metrics['charts/reward']:.3f}")
        ev.print0(progress_line(iteration, metrics), tqdm.tqdm.write)
        if args.save_samples and iteration % args.save_samples == 0 and ev.rank() == 0:  # rank 0's questions
            write_samples(run_dir / "samples" / f"iter_{iteration}.jsonl",
                          sample_records(iteration, questions, completions, rewards, advantages, samples, tokenizer, args))
        if iteration % args.eval_every == 0 or last:
            log.write(iteration, evaluation := evaluate_policy(model, tokenizer, sampler, eval_task, eval_examples, args))
            accuracy_after = evaluation["eval/accuracy"]
        if iteration % args.save_every == 0 or last:
            save_checkpoint(run_dir, model, tokenizer, optimizer, scheduler, iteration)
        ev.barrier()  # under torchrun no rank runs ahead of the checkpoint
        if last:
            break
    return finish_run(run_dir, log, accuracy_before, accuracy_after, eval_task)


if __name__ == "__main__":
    ev.run_cli(main, ev.cli(Args))
