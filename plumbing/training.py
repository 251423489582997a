"""Training mechanics the four scripts share: log-probs of responses under a model, micro-batching and collate (the
update's micro-batches; the no-grad passes' batches, sized to free GPU memory), seeding an iteration, and the
optimizer with its schedule.

A sample is a dict: prompt_ids and response_ids (token ids, exactly as sampled), and what the loss needs per
response token (old_logps, ref_logps, advantages, loss_mask, and whatever a script's loss adds) as 1-D tensors.
"""

from __future__ import annotations

import random

import torch
from torch.utils.checkpoint import checkpoint
from transformers import Cache, get_linear_schedule_with_warmup

from plumbing import UsageError, distributed, lora
from plumbing.memory import KEPT_LOGITS, LOGIT_CHUNK, NUCLEUS_CHUNK, model_shape, no_grad_pass_bytes
from plumbing.precision import FP32, Precision


def micro_batches(
    samples: list[dict], micro_batch_size: int | None = None, max_positions: int | None = None
) -> list[list[int]]:
    """Indices of `samples` in micro-batches that compute few positions: at most `micro_batch_size` rows each (the
    update), or at most `max_positions` cached positions each (the no-grad passes, sized to free memory: rows x
    (longest prompt + longest response), what the pass's KV cache holds, each row its prompt's keys and values; at
    least one sample each). A micro-batch costs a forward pass of each distinct prompt in it (left-padded to the
    longest) and of each response (right-padded to the longest), see response_logprobs. Two orders are cut into
    micro-batches and the cheaper split is kept: by length (response, then prompt: least padding) and by prompt (the
    rows of a prompt together, prompts ordered by their longest response: each prompt runs once for all its rows).
    Neither log-probs nor the gradient depend on the split: the losses are normalised by the whole batch's counts.

    >>> micro_batches([{"prompt_ids": [1], "response_ids": [2] * n} for n in (5, 1, 4, 2)], 2)
    [[1, 3], [2, 0]]
    >>> micro_batches([{"prompt_ids": [p] * 8, "response_ids": [2] * n}
    ...                for p, n in ((1, 1), (2, 2), (1, 3), (2, 4))], 2)
    [[0, 2], [1, 3]]
    >>> micro_batches([{"prompt_ids": [1], "response_ids": [2] * n} for n in (5, 1, 4, 2)],
    ...               max_positions=15)  # 3 x (1 + 4), 1 x (1 + 5)
    [[1, 3, 2], [0]]
    """
    prompts = [tuple(s["prompt_ids"]) for s in samples]
    lengths = [len(s["response_ids"]) for s in samples]
    longest = {}  # prompt -> its longest response
    for prompt, length in zip(prompts, lengths):
        longest[prompt] = max(longest.get(prompt, 0), length)

    def split(order: list[int]) -> list[list[int]]:  # greedy: a new micro-batch where the next sample would not fit
        micros, widest_prompt, widest_response = [], 0, 0
        for i in order:
            prompt, response = max(widest_prompt, len(prompts[i])), max(widest_response, lengths[i])
            rows = len(micros[-1]) + 1 if micros else 1
            full = micro_batch_size is not None and rows > micro_batch_size
            full = full or max_positions is not None and rows * (prompt + response) > max_positions
            if not micros or full:
                micros.append([])
                prompt, response = len(prompts[i]), lengths[i]
            micros[-1].append(i)
            widest_prompt, widest_response = prompt, response
        return micros

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
        # [prompts, P]
        "prompt_ids": torch.tensor([[pad_id] * (prompt_len - len(p)) + list(p) for p in prompts], device=device),
        # [prompts, P]
        "prompt_mask": torch.tensor([[0] * (prompt_len - len(p)) + [1] * len(p) for p in prompts], device=device),
        "prompt_of_row": torch.tensor([prompt_index[tuple(s["prompt_ids"])] for s in samples], device=device),  # [rows]
    }
    # [rows, P + R]; position ids skip the padding
    batch["positions"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    batch["prompt_positions"] = (batch["prompt_mask"].cumsum(-1) - 1).clamp(min=0)  # [prompts, P]
    for key in ("old_logps", "ref_logps", "advantages", "loss_mask", "old_values", "returns"):  # those the samples hold
        if key in samples[0]:
            batch[key] = torch.nn.utils.rnn.pad_sequence([s[key] for s in samples], batch_first=True).to(device)[
                :, :response_len
            ]
    return batch


def nucleus_logprobs(logits: torch.Tensor, targets: torch.Tensor, top_p: float) -> torch.Tensor:
    """The log-prob of each target id under softmax(logits) cut to its top-p nucleus and renormalised over it, the
    nucleus built by vLLM's rule (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch): sort the
    logits ascending, cut every token whose cumulative probability up to and including it is at most 1 - top_p,
    keep the most likely token always. -inf for a target outside the nucleus. [tokens, vocab] logits (already
    divided by the temperature), [tokens] ids -> [tokens]. This is what vLLM reports as the processed log-prob of a
    token it sampled at top_p < 1, rebuilt from the trainer's own logits: only the sampler-vs-trainer metric reads
    it (plumbing/rollout_correction.py); the loss never does.

    >>> nucleus_logprobs(torch.tensor([[0.0, 1.0, 2.0]] * 3), torch.tensor([2, 1, 0]), 0.9)  # probs .09 .24 .67
    tensor([-0.3133, -1.3133,    -inf])
    """
    ascending, order = logits.sort(-1)  # [tokens, vocab] each
    # [tokens, vocab], in ascending order; vLLM holds top_p in float32
    cut = ascending.softmax(-1).cumsum(-1) <= 1 - torch.tensor(top_p, dtype=torch.float32)
    cut[:, -1] = False
    log_mass = ascending.masked_fill(cut, -torch.inf).logsumexp(-1)  # [tokens]: log of the nucleus's mass
    # [tokens]: the cut, back in vocabulary order, at the target
    outside = torch.empty_like(cut).scatter_(-1, order, cut).gather(-1, targets[:, None]).squeeze(-1)
    return (logits.gather(-1, targets[:, None]).squeeze(-1) - log_mass).masked_fill(outside, -torch.inf)


def token_logprobs(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy: bool = False,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """log softmax(lm_head(hidden) / temperature) at the target ids: [tokens, hidden], [tokens] -> [tokens]. Metrics
    from the same logits (no gradient) make it a tuple, in this order: with entropy=True the entropy of that
    distribution at each position, H = log Z - sum_v p_v * logit_v; with top_p < 1 the log-prob renormalised over
    the top-p nucleus (nucleus_logprobs, NUCLEUS_CHUNK positions at a time: its sort and masks stay within the room
    the chunk's logits have, memory.no_grad_pass_bytes)."""
    logits = lm_head(hidden).float() / temperature  # [tokens, vocab]
    log_z = logits.logsumexp(-1)  # [tokens]
    logps = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z  # [tokens]
    if not entropy and top_p == 1.0:
        return logps
    with torch.no_grad():
        metrics = [log_z - (logits.softmax(-1) * logits).sum(-1)] if entropy else []
        if top_p < 1.0:
            pieces = zip(logits.split(NUCLEUS_CHUNK), targets.split(NUCLEUS_CHUNK))
            metrics.append(torch.cat([nucleus_logprobs(piece, ids, top_p) for piece, ids in pieces]))
        return logps, *metrics


def last_hidden_state(model, **inputs) -> tuple[torch.Tensor, Cache | None]:
    """One forward pass without the LM head: the final hidden states [rows, positions, hidden] and, with
    use_cache=True, the KV cache (holding the positions of `cache=`, when given, before these)."""
    if distributed.is_sharded(model):  # --fsdp: only the whole model's forward gathers the embeddings and the LM head
        out = model(**inputs, output_hidden_states=True, logits_to_keep=1)
        return out.hidden_states[-1], out.cache  # hidden_states[-1] is after the final norm
    out = model.base_model(**inputs)
    return out.last_hidden_state, out.cache


def response_logprobs(
    model,
    batch: dict,
    temperature: float,
    chunk_tokens: int = LOGIT_CHUNK,
    recompute_above: int = KEPT_LOGITS,
    precision: Precision = FP32,
    entropy: bool = False,
    top_p: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """log pi(y_t | prompt, y_<t) of every response token, with logits divided by the sampling temperature
    so that exp(logp) is the probability the sampler used. entropy=True: also the entropy of pi(. | prompt, y_<t)
    at each response position; top_p < 1: also the log-prob renormalised over the top-p nucleus (nucleus_logprobs);
    each [rows, R], no gradient, from the same chunks of logits, in that order after the log-probs (token_logprobs).

    Paper: the token probabilities p_t.

    Rows with the same prompt (a question's responses, a tree node's children) share one forward pass of it: each
    distinct prompt runs once, its keys and values are repeated for its rows, and the responses run on top of them.
    The gradient flows back through the shared keys and values: it is the sum over the rows, the same as from a
    forward pass per row.
    (Under activation checkpointing, whose layers take no KV cache in a pass with gradients, every row runs its
    prompt itself.)

    The LM head runs on chunks of `chunk_tokens` response positions. When the micro-batch's fp32 logits would
    hold more than `recompute_above` entries (KEPT_LOGITS, 2**28: 1 GiB), each chunk is recomputed in the backward
    pass, so the [rows, R, vocab] logits (8 x 2048 x 151,936 x 4 bytes = 10 GB for a Qwen long-CoT micro-batch) never
    exist at once; smaller logits (16 x 128 x 49,152 x 4 bytes = 0.4 GB for SmolLM2) are kept for the backward
    pass, which saves a second LM-head pass. Either way the result is the same as from the model's full logits.
    """
    response_len, prompt_len = batch["response_mask"].shape[1], batch["prompt_ids"].shape[1]
    # fp32 weights (a 1e-6 step vanishes in bf16); bf16 compute where `precision` chose it.
    with precision.autocast(model.device.type):
        # layers checkpointed for this backward pass take no KV cache: prompt and response in one pass
        if model.is_activation_checkpointing and model.training and torch.is_grad_enabled():
            hidden, _ = last_hidden_state(
                model,
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["positions"],
                use_cache=False,
            )
            hidden = hidden[:, prompt_len - 1 : -1]  # [rows, R, hidden]; position t-1 predicts y_t
        else:
            # [prompts, P, hidden]
            prompt_hidden, cache = last_hidden_state(
                model,
                input_ids=batch["prompt_ids"],
                attention_mask=batch["prompt_mask"],
                position_ids=batch["prompt_positions"],
                use_cache=True,
            )
            # [prompts, ...] -> [rows, ...]: each row's prompt keys and values
            cache.batch_select_indices(batch["prompt_of_row"])
            # [rows, R, hidden]
            response_hidden, _ = last_hidden_state(
                model,
                input_ids=batch["input_ids"][:, prompt_len:],
                attention_mask=batch["attention_mask"],
                position_ids=batch["positions"][:, prompt_len:],
                cache=cache,
                use_cache=True,
            )
            # [rows, R, hidden]; position t-1 predicts y_t: the prompt's last position predicts y_0
            hidden = torch.cat([prompt_hidden[batch["prompt_of_row"], -1:], response_hidden[:, :-1]], dim=1)
        targets = batch["input_ids"][:, prompt_len:]  # [rows, R]
        rows, lm_head = hidden.shape[0], model.get_output_embeddings()
        recompute = torch.is_grad_enabled() and rows * response_len * lm_head.out_features > recompute_above
        chunks = zip(hidden.flatten(0, 1).split(chunk_tokens), targets.flatten().split(chunk_tokens))
        logps = [
            checkpoint(token_logprobs, lm_head, h, t, temperature, entropy, top_p, use_reentrant=False)
            if recompute
            else token_logprobs(lm_head, h, t, temperature, entropy, top_p)
            for h, t in chunks
        ]
    if entropy or top_p < 1.0:
        return tuple(torch.cat(parts).view(rows, response_len) for parts in zip(*logps))  # 2 or 3 x [rows, R]
    return torch.cat(logps).view(rows, response_len)  # [rows, R]


NO_GRAD_SHARE = 0.8  # of the free memory a no-grad pass may take: the allocator's fragmentation, estimates a little low
NO_GRAD_ROWS = (
    4096  # rows per no-grad pass at most: SDPA's memory-efficient kernel takes at most 65,535 (a CUDA grid limit)
)


def no_grad_batch_tokens(model, samples: list[dict], precision: Precision = FP32, config=None) -> int | None:
    """Cached positions (rows x (longest prompt + longest response), see micro_batches) that one no-grad forward pass
    of `model` over some of `samples` may hold in the GPU memory free now (no_grad_pass_bytes; free: what
    torch.cuda.mem_get_info reports plus what torch holds reserved but unallocated, of which the pass may take
    NO_GRAD_SHARE). None where nothing is sized: on a CPU (the passes keep the update's micro-batches, so CPU results
    and timings stay as they were) and for a sharded model whose parameters are not gathered (each pass gathers
    shards: every rank must run as many as the others). config: the transformer's config when `model` has none of
    its own (PPO's critic: its backbone's)."""
    device = next(model.parameters()).device
    sharded = distributed.is_sharded(model)
    if device.type != "cuda" or (sharded and not getattr(model, "gathered_by_spo", False)):
        return None
    context = max(len(s["prompt_ids"]) for s in samples) + max(len(s["response_ids"]) for s in samples)
    element = 2 if device.type in precision.bf16 else 4
    per_position, once = no_grad_pass_bytes(
        model_shape(config or model.config.get_text_config()), element, context, sharded
    )
    free, _ = torch.cuda.mem_get_info(device)
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's cache is free to it
    return max(1, int((NO_GRAD_SHARE * free - once) // per_position))


def no_grad_batches(
    model,
    samples: list[dict],
    micro_batch_size: int,
    precision: Precision = FP32,
    batch_tokens: int | None = None,
    config=None,
) -> list[list[int]]:
    """Indices of `samples` in the batches of a no-grad pass of `model`: at most `batch_tokens` cached positions
    (by default what the GPU's free memory holds now, no_grad_batch_tokens) and NO_GRAD_ROWS rows each; where nothing
    is sized (a CPU, an FSDP model not gathered), the update's micro-batches of `micro_batch_size` sequences."""
    batch_tokens = batch_tokens or (no_grad_batch_tokens(model, samples, precision, config) if samples else None)
    return (
        micro_batches(samples, micro_batch_size)
        if batch_tokens is None
        else micro_batches(samples, NO_GRAD_ROWS, batch_tokens)
    )


@torch.no_grad()
def sample_logprobs(
    model,
    samples: list[dict],
    micro_batch_size: int,
    temperature: float,
    pad_id: int,
    precision: Precision = FP32,
    batch_tokens: int | None = None,
    entropy: bool = False,
    top_p: float = 1.0,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], ...]:
    """Per-sample response log-probs (1-D CPU tensors; entropy=True: and their positions' entropies, a second list;
    top_p < 1: and the log-probs renormalised over the top-p nucleus, a list after those) without gradients, in
    passes of at most `batch_tokens` cached
    positions each; by default as many as the GPU's free memory holds (no_grad_batches), so that SPO-tree's pass over
    all of an iteration's new edges takes a few large passes instead of hundreds of training micro-batches. Where
    nothing is sized (a CPU), micro-batches of `micro_batch_size` sequences. The log-probs do not depend on the split
    (up to the summation order of padded rows)."""
    was_training = model.training
    model.eval()
    results = 1 + entropy + (top_p < 1.0)  # lists returned: the log-probs, then the metrics asked for
    out: list[list[torch.Tensor]] = [[None] * len(samples) for _ in range(results)]
    for indices in no_grad_batches(model, samples, micro_batch_size, precision, batch_tokens):
        batch = collate([samples[i] for i in indices], pad_id, model.device)
        rows = response_logprobs(model, batch, temperature, precision=precision, entropy=entropy, top_p=top_p)
        for per_sample, result_rows in zip(out, rows if results > 1 else (rows,)):
            for i, row in zip(indices, result_rows.cpu()):
                per_sample[i] = row[: len(samples[i]["response_ids"])]
    model.train(was_training)
    return tuple(out) if results > 1 else out[0]


def attach_old_logprobs(
    model, samples: list[dict], micro_batch_size: int, temperature: float, pad_id: int, precision: Precision = FP32
) -> list[torch.Tensor]:
    """Set each sample's "old_logps" (pi_old: the policy that sampled it, before the update) and "entropy" (of the
    sampling distribution at each response token, plumbing/rollout_correction.py) from one no-grad pass; returns the
    old log-probs. A sample whose sampler log-probs are renormalised over a top-p nucleus (sampler_top_p < 1) also
    gets "nucleus_logps": the trainer's log-probs renormalised over the nucleus rebuilt from its own logits by the
    sampler's rule (nucleus_logprobs), for the sampler-vs-trainer metric alone; old_logps stay the whole
    vocabulary's, which p_t, the ratio and the KL use."""
    top_ps = {s["sampler_top_p"] for s in samples if "sampler_top_p" in s}
    if len(top_ps) > 1:
        raise ValueError(f"samples drawn at top_p {sorted(top_ps)}: one pass rebuilds one nucleus")
    top_p = top_ps.pop() if top_ps else 1.0
    old_logps, entropies, *nucleus = sample_logprobs(
        model, samples, micro_batch_size, temperature, pad_id, precision, entropy=True, top_p=top_p
    )
    for s, logps, entropy in zip(samples, old_logps, entropies):
        s["old_logps"], s["entropy"] = logps, entropy
    if top_p < 1.0:
        (nucleus_logps,) = nucleus
        for s, logps in zip(samples, nucleus_logps):
            if "sampler_top_p" in s:
                s["nucleus_logps"] = logps
    return old_logps


def new_sample(prompt_ids: list[int], completion) -> dict:
    """A training sample of a sampled response: its prompt and response ids, and the log-probs the engine sampled
    them with when it reported them (sampler_logps, plumbing/rollout_correction.py), with the top-p of the nucleus
    they are renormalised over where it is below 1 (sampler_top_p: vLLM at top_p < 1). What an engine reports is
    checked as data: one finite log-prob per token, else one line (a NaN would make every sampler/* metric NaN)."""
    sample = {"prompt_ids": prompt_ids, "response_ids": completion.ids}
    if completion.logprobs is not None:
        logprobs = torch.tensor(completion.logprobs, dtype=torch.float32)
        if len(logprobs) != len(completion.ids):
            raise UsageError(
                f"the rollout engine reported {len(logprobs)} log-probs for a response of {len(completion.ids)} "
                "tokens: its output does not match what it sampled; check the engine (--backend hf is the tested one)"
            )
        if not torch.isfinite(logprobs).all():
            bad = logprobs[~torch.isfinite(logprobs)][0].item()
            raise UsageError(
                f"the rollout engine reported a log-prob of {bad} for a token it sampled: its forward pass overflowed "
                "or its weights are not finite; compute it in a wider dtype (--precision fp32) or check the weights"
            )
        sample["sampler_logps"] = logprobs
        if completion.logprobs_top_p < 1.0:
            sample["sampler_top_p"] = completion.logprobs_top_p
    return sample


def reseed(seed: int, iteration: int, sampler) -> random.Random:
    """Seed torch and the sampler from (seed, iteration, rank); returns the iteration's random.Random (it picks the
    questions, and SPO-tree's buffer samples), the same on every rank. torch's and the sampler's generators differ
    per rank, so ranks draw different responses. Reseeding every iteration makes a resumed run sample exactly what
    the uninterrupted one would (at the same world size)."""
    iteration_seed = seed * 1_000_003 + iteration
    rank_seed = distributed.rank_seed(iteration_seed)  # rank 0: the seed of a single-process run
    torch.manual_seed(rank_seed)
    if hasattr(sampler, "generator"):
        sampler.generator.manual_seed(rank_seed)
    return random.Random(iteration_seed)


def make_optimizer(
    model,
    lr: float,
    weight_decay: float,
    warmup_ratio: float,
    total_steps: int,
    state: dict | None = None,
    prefix: str = "",
):
    """AdamW and its schedule: int(warmup_ratio * total_steps) steps of linear warmup, then linear decay to 0 at
    total_steps; restored from a checkpoint's trainer_state (its {prefix}optimizer and {prefix}scheduler) when given.
    A --max-minutes budget does not shorten it (a schedule planned from timings would differ by machine and load):
    bookkeeping.schedule_line says so at the start when the budget cannot outlast the warmup."""
    with distributed.on_shards(model):  # --fsdp: from the shards, even while the awake sampler holds the model gathered
        # the trainable parameters: all of them, or with --lora-rank the adapters alone
        optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=lr, weight_decay=weight_decay)
        scheduler = get_linear_schedule_with_warmup(optimizer, int(warmup_ratio * total_steps), total_steps)
        if state is not None:
            distributed.load_optimizer_state(model, optimizer, state[f"{prefix}optimizer"])
            scheduler.load_state_dict(state[f"{prefix}scheduler"])
    return optimizer, scheduler
