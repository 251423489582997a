"""Rollout engines: token ids in, token ids and finish reasons out.

  HFSampler    transformers on any device (the tested path): a batched decode loop in which the n continuations
               of a prefix share one prefill (SPO's Monte-Carlo rollouts, tree children), exact top-p sampling
  VLLMSampler  vLLM in-process on a GPU (optional dependency, pinned version): weights synced after each update;
               under torchrun one engine per rank, on the rank's GPU
  make_sampler the engine for --backend hf | vllm | auto

Generation stops at EOS or at a stop string; a response cut by a stop string counts as finished, and its ids end
where the stop string begins. max new tokens = min(budget, context - prefix length).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from plumbing import UsageError, distributed, gpu, models
from plumbing.precision import FP32, Precision, engine_dtype


@dataclass
class Completion:
    ids: list[int]  # sampled token ids; ends with EOS when the model stopped itself; cut where a stop string begins
    finish_reason: str  # "stop" (EOS or stop string) or "length" (token or context limit: scores 0)


def cut_at_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: Sequence[str]) -> tuple[list[int], bool]:
    """Token ids up to where the first stop string begins (in decoded text), and whether one was found.

    For the ids of "5\\n\\n\\nProblem: x" and stop ["\\n\\n\\nProblem:"] it returns (the ids of "5", True).
    """
    text = tokenizer.decode(ids)
    hits = [text.find(s) for s in stop if s and s in text]
    if not hits:
        return ids, False
    end = min(hits)
    keep = 0  # the longest prefix of tokens whose text ends at or before the stop string
    while keep < len(ids) and len(tokenizer.decode(ids[: keep + 1])) <= end:
        keep += 1
    return ids[:keep], True


def stop_histories(prompts: list[list[int]], generated: int | Sequence[int], stop: Sequence[str]) -> list[list[int]]:
    """Per prompt, its last generated tokens that a stop string could begin in (at most its longest length + 2:
    a token spells at least one character)."""
    counts = [generated] * len(prompts) if isinstance(generated, int) else list(generated)
    tail = max((len(s) for s in stop), default=0) + 2 if stop else 0
    return [list(p[len(p) - min(c, tail, len(p)) :]) if c and tail else [] for p, c in zip(prompts, counts)]


def token_pieces(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text, so that "".join(pieces) == decode(ids) (byte-level BPE splits a
    character across tokens: its piece goes to the token that completes it). For viewers and sample files."""
    pieces = []
    for i in range(len(ids)):
        start = max(0, i - 8)  # a few tokens of left context are enough to complete any character
        pieces.append(tokenizer.decode(ids[start : i + 1])[len(tokenizer.decode(ids[start:i])) :])
    return pieces


def _next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, candidates: int = 64
) -> torch.Tensor:
    """Sample one token per row from logits [rows, vocab] with temperature and nucleus (top-p) filtering.

    Exact, without sorting the vocabulary every step (a full sort and a full-vocabulary multinomial cost
    more than the model's forward pass for a small model): the draw is made by inverse CDF among the
    `candidates` most likely tokens, where the nucleus nearly always lies. A row whose nucleus reaches past
    them is drawn from its fully sorted distribution; with top_p = 1, a draw that lands in the remaining
    mass is drawn from the remaining tokens in proportion to their probabilities.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    logprobs = (logits.float() / temperature).log_softmax(-1)  # [rows, vocab]; one fused pass per row
    vocab = logprobs.shape[-1]
    top_logprobs, top_ids = logprobs.topk(min(candidates, vocab), dim=-1)  # [rows, k], most likely first
    top_probs = top_logprobs.exp()  # [rows, k]
    if top_p < 1.0:  # the nucleus keeps a token while the mass before it is at most top_p
        top_probs = top_probs.masked_fill(top_probs.cumsum(-1) - top_probs > top_p, 0.0)
    cdf = top_probs.cumsum(-1)  # [rows, k]
    draw = torch.rand(logprobs.shape[0], 1, generator=generator, device=logprobs.device)  # [rows, 1]
    if top_p < 1.0:
        draw = draw * cdf[:, -1:]  # within the nucleus
    pick = torch.searchsorted(cdf, draw, right=True).clamp(max=cdf.shape[-1] - 1)  # [rows, 1]
    chosen = top_ids.gather(-1, pick).squeeze(-1)  # [rows]
    if vocab > top_ids.shape[-1]:
        # Rows the candidates do not settle: a nucleus that reaches past them, or (top_p = 1) a draw beyond their mass.
        beyond = top_probs[:, -1] > 0 if top_p < 1.0 else draw.squeeze(-1) >= cdf[:, -1]  # [rows]
        if bool(beyond.any()):
            probs = logprobs[beyond].exp()  # [beyond, vocab]
            if top_p < 1.0:  # the full sort, for these rows only
                sorted_probs, order = probs.sort(dim=-1, descending=True)
                sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs > top_p, 0.0)
                chosen[beyond] = order.gather(-1, torch.multinomial(sorted_probs, 1, generator=generator)).squeeze(-1)
            else:  # the draw fell past the candidates' mass: one of the other tokens, in proportion
                probs = probs.scatter(-1, top_ids[beyond], 0.0)
                chosen[beyond] = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return chosen


def _left_padded(
    sequences: list[list[int]], width: int, pad: int, device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, attention mask and position ids [rows, width] of token sequences left-padded to width; positions
    count from each sequence's first real token, so a token's KV does not depend on its row's padding."""
    input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences], device=device)
    attention = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)


class _GrowingKV(DynamicLayer):
    """One layer's KV cache in a buffer with room to grow: a decode step writes its position in place, where
    DynamicLayer concatenates (copies) the whole cache every step. keys/values are views of the filled part."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, room: int, repeats: int = 1, dtype: torch.dtype | None = None
    ):
        """dtype: what the buffers hold (None: as given). Under autocast, attention reads keys and values in the
        autocast dtype, but RoPE's fp32 cos/sin hand the keys over in fp32: stored in the autocast dtype, they are
        the same numbers, cast once per position instead of the whole cache at every step."""
        super().__init__()
        self.device, self.is_initialized, self.length = keys.device, True, keys.shape[-2]
        self.key_buffer = self._with_room(
            keys, room, repeats, dtype
        )  # [rows x repeats, kv_heads, length + room, head_dim]
        self.value_buffer = self._with_room(values, room, repeats, dtype)
        self._views()

    def _with_room(
        self, filled: torch.Tensor, room: int, repeats: int = 1, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """A new buffer with `room` free positions, holding each row of `filled` `repeats` times in a row."""
        rows, heads, _, dim = filled.shape
        buffer = filled.new_empty((rows * repeats, heads, self.length + room, dim), dtype=dtype or filled.dtype)
        buffer.view(rows, repeats, heads, -1, dim)[:, :, :, : self.length] = filled[:, None, :, : self.length]
        return buffer

    def _views(self) -> None:
        self.keys, self.values = self.key_buffer[..., : self.length, :], self.value_buffer[..., : self.length, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self.length + new > self.key_buffer.shape[-2]:  # full: double the room (amortised O(1) per token)
            room = max(new, self.key_buffer.shape[-2])
            self.key_buffer, self.value_buffer = self._with_room(self.keys, room), self._with_room(self.values, room)
        self.key_buffer[..., self.length : self.length + new, :] = key_states
        self.value_buffer[..., self.length : self.length + new, :] = value_states
        self.length += new
        self._views()
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.key_buffer, self.value_buffer = (
            self.key_buffer.repeat_interleave(repeats, 0),
            self.value_buffer.repeat_interleave(repeats, 0),
        )
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._views()


class HFSampler:
    """Batched sampling with transformers on any device.

    The n continuations of a prefix share one prefill: the prompt's KV cache is computed once and
    repeated n times, which is what makes SPO's Monte-Carlo rollouts (K per cutpoint) affordable; a prompt
    that begins another one of the batch (the cutpoint states of one response) is read off its prefill.
    A batch holds at most `batch_size` rows and `max_batch_tokens` cached positions (rows x (prompt + new
    tokens)): prompts of similar length go together, so little of the batch is padding.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        seed: int = 0,
        batch_size: int = 256,
        max_batch_tokens: int = 2**16,
        precision: Precision = FP32,
    ):
        """precision: the matmul precision of the forward passes (the weights stay as they are, fp32 in training)."""
        models.check_logits_from_hidden(model)  # _prefill applies the LM head to the hidden states itself
        self.model, self.tokenizer, self.batch_size, self.max_batch_tokens = (
            model,
            tokenizer,
            batch_size,
            max_batch_tokens,
        )
        self.precision = precision
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self._stop_enders: dict[tuple, torch.Tensor] = {}
        self.wake_up()  # made awake, as vLLM's engine is

    def _can_end_stop(self, stop: Sequence[str], vocab: int) -> torch.Tensor:
        """[vocab] bool: tokens whose text holds the last character of a stop string. A stop string can only
        be complete right after one of them, so only those rows pay for a decode (once per stop set)."""
        key = (tuple(stop), vocab)
        if key not in self._stop_enders:
            last = {s[-1] for s in stop if s}
            known = min(vocab, len(self.tokenizer))
            texts = self.tokenizer.batch_decode([[i] for i in range(known)])
            enders = [any(c in text for c in last) for text in texts] + [True] * (vocab - known)
            self._stop_enders[key] = torch.tensor(enders, device=self.model.device)
        return self._stop_enders[key]

    def load_weights(self, model: PreTrainedModel) -> None:
        self.model = model  # sampling uses the training model itself: nothing to copy

    def sleep(self) -> None:
        """The same interface as VLLMSampler's: a replica has nothing to free; a sharded model goes back to its
        shards for the update."""
        if distributed.is_sharded(self.model):
            distributed.gather_parameters(self.model, False)

    def wake_up(self) -> None:
        if distributed.is_sharded(self.model):  # the whole model on every rank while it samples (see fully_shard_model)
            distributed.gather_parameters(self.model, True)

    def chunks(self, prompts: list[list[int]], limits: list[int], n: int) -> list[list[int]]:
        """Prompt indices in batches: by length (less padding), each within batch_size rows and
        max_batch_tokens cached positions (at least one prompt each)."""
        batches: list[list[int]] = []
        longest_limit = 0  # of the last batch; its longest prompt is the one being added (shortest first)
        for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
            if batches:
                rows, width = (len(batches[-1]) + 1) * n, len(prompts[i]) + max(longest_limit, limits[i])
                if rows <= self.batch_size and rows * width <= self.max_batch_tokens:
                    batches[-1].append(i)
                    longest_limit = max(longest_limit, limits[i])
                    continue
            batches.append([i])
            longest_limit = limits[i]
        return batches

    def sample(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int | list[int],
        stop: Sequence[str] = (),
        context: int | None = None,
        progress: str | None = None,
        generated: int | list[int] = 0,
        ignore_eos: bool = False,
    ) -> list[list[Completion]]:
        """n completions for each prompt (token ids).

        max_new_tokens: one budget, or one per prompt; each is capped at context - prompt length.
        generated: how many of each prompt's last tokens the policy sampled itself (the response so far,
        one count or one per prompt). A stop string that begins there and ends in the new tokens stops the
        completion too, which is then cut where it begins: to nothing when it begins before the new tokens.
        ignore_eos: sample past EOS to the token limit (as vLLM's option; for benchmarks at equal lengths).
        """
        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        limits = [max(0, min(b, context - len(p)) if context else b) for p, b in zip(prompts, budgets)]
        histories = stop_histories(prompts, generated, stop)
        # A prompt that fills the context is never prefilled: its n completions stay empty and unfinished.
        results = [[Completion(ids=[], finish_reason="length") for _ in range(n)] for _ in prompts]
        live = [i for i, p in enumerate(prompts) if context is None or len(p) < context]
        for i in live:
            results[i] = []
        # (prompt indices, rows per prompt) per batch; a prompt whose n rows alone exceed the batch caps is sampled
        # alone, in batches of at most `rows` rows.
        rows = {i: self.rows_per_batch(len(prompts[i]) + limits[i]) for i in live}
        together = [i for i in live if n <= rows[i]]
        batches = [
            ([together[j] for j in batch], n)
            for batch in self.chunks([prompts[i] for i in together], [limits[i] for i in together], n)
        ]
        batches += [([i], min(rows[i], n - start)) for i in live if n > rows[i] for start in range(0, n, rows[i])]
        device = self.model.device.type
        with self.precision.autocast(device):  # training keeps fp32 weights
            for batch, k in tqdm.tqdm(
                batches, desc=progress, leave=False, disable=progress is None or distributed.rank() > 0
            ):
                groups = self._sample_chunk(
                    [prompts[i] for i in batch],
                    [limits[i] for i in batch],
                    [histories[i] for i in batch],
                    k,
                    temperature,
                    top_p,
                    stop,
                    ignore_eos,
                )
                for i, group in zip(batch, groups):
                    results[i] = results[i] + group
        return results

    def rows_per_batch(self, width: int) -> int:
        """How many rows of `width` cached positions one batch may hold (at least 1)."""
        return max(1, min(self.batch_size, self.max_batch_tokens // max(1, width)))

    @torch.no_grad()
    def _prefill(self, prompts: list[list[int]], width: int, pad: int):
        """Next-token logits [prompts, vocab] and a KV cache [prompts, kv_heads, width, head_dim] per layer, left-padded.

        A prompt that begins another prompt of the batch is not prefilled on its own: the KV at position i depends
        only on tokens <= i, so it is read off the longer one's prefill (SPO-chain's Monte-Carlo states of one
        response are all prefixes of it: the response is prefilled once, not once per cutpoint).
        """
        model, device = self.model, self.model.device
        roots: list[list[int]] = []  # prompts that begin no longer prompt of the batch, longest first
        root_of = [0] * len(prompts)
        for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
            prompt = prompts[i]
            root_of[i] = next((r for r, root in enumerate(roots) if root[: len(prompt)] == prompt), len(roots))
            if root_of[i] == len(roots):
                roots.append(prompt)
        input_ids, attention, positions = _left_padded(roots, width, pad, device)  # [roots, width]
        out = model.base_model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        if not all(type(layer) is DynamicLayer for layer in out.cache.layers):
            return self._prefill_each(prompts, width, pad)  # e.g. sliding-window layers keep only their window
        source = torch.tensor(root_of, device=device)  # [prompts]: the root each prompt is read from
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        shift = lengths - torch.tensor(
            [len(roots[r]) for r in root_of], device=device
        )  # <= 0: where the prompt ends in its root
        last = width - 1 + shift  # [prompts]: the column of each prompt's last token in its root
        logits = model.get_output_embeddings()(out.last_hidden_state[source, last])  # [prompts, vocab]
        columns = (torch.arange(width, device=device)[None] + shift[:, None]).clamp(
            min=0
        )  # [prompts, width]; pad columns: any
        for layer in out.cache.layers:
            index = columns[:, None, :, None].expand(
                -1, layer.keys.shape[1], -1, layer.keys.shape[-1]
            )  # [prompts, kv_heads, width, head_dim]
            layer.keys, layer.values = layer.keys[source].gather(2, index), layer.values[source].gather(2, index)
        return logits, out.cache

    def _prefill_each(self, prompts: list[list[int]], width: int, pad: int):
        """_prefill without shared prefixes: every prompt prefilled on its own row."""
        input_ids, attention, positions = _left_padded(prompts, width, pad, self.model.device)  # [prompts, width]
        out = self.model(
            input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1], out.cache

    @torch.no_grad()
    def _sample_chunk(
        self, prompts, limits, histories, n, temperature, top_p, stop, ignore_eos
    ) -> list[list[Completion]]:
        model, device = self.model, self.model.device
        was_training = model.training
        model.eval()
        limits = torch.tensor(limits, device=device).repeat_interleave(n)  # [rows]
        steps = int(limits.max())
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id or 0
        attention = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device
        )  # [prompts, width], left-padded
        logits, cache = self._prefill(prompts, width, pad)  # [prompts, vocab]; cache rows left-padded to width
        # Decode steps write into buffers with room instead of concatenating the whole cache each step.
        for layer in cache.layers:
            if type(layer) is not DynamicLayer:  # e.g. a sliding-window layer: repeated as transformers keeps it
                layer.batch_repeat_interleave(n)
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        cache.layers = [
            _GrowingKV(layer.keys, layer.values, min(steps, 256), repeats=n, dtype=dtype)
            if type(layer) is DynamicLayer
            else layer
            for layer in cache.layers
        ]
        logits = logits.repeat_interleave(n, dim=0)  # [batch, vocab]: one prefill, n continuations
        attention = torch.cat([attention, attention.new_ones(len(prompts), steps)], 1).repeat_interleave(
            n, dim=0
        )  # [batch, width + steps]
        if model.config._attn_implementation == "sdpa" and all(type(layer) is _GrowingKV for layer in cache.layers):
            # Handed over as [batch, 1, 1, positions], the mask reaches SDPA as it is. Left 2D, transformers drops it when
            # no row is padded and asks SDPA for grouped-query attention (enable_gqa), which on CPU in bf16 took 5x as
            # long per layer as the packed query heads it uses when there is a mask (1.29 against 0.24 ms, 24 rows).
            attention = attention.bool()[:, None, None]  # [batch, 1, 1, width + steps]
        next_position = torch.tensor([[len(p)] for p in prompts], device=device).repeat_interleave(
            n, dim=0
        )  # [batch, 1]

        rows = len(prompts) * n
        eos = torch.tensor(
            [] if ignore_eos else sorted(models.eos_ids(model, self.tokenizer)), dtype=torch.long, device=device
        )
        tokens = torch.full((rows, max(1, steps)), pad, dtype=torch.long, device=device)  # [rows, steps]
        lengths = torch.zeros(rows, dtype=torch.long, device=device)  # tokens sampled per row
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # ended by EOS or a stop string
        batch_rows = torch.arange(rows, device=device)  # [batch]: the row each batch position samples for
        alive = limits > 0  # [batch]: still sampling; finished rows stay in the batch until enough have finished
        tail = max((len(s) for s in stop), default=0) + 2  # decoded tokens enough to contain a stop string

        for step in range(steps):
            if not bool(alive.any()):
                break
            chosen = _next_tokens(logits, temperature, top_p, self.generator)  # [batch]
            live = alive.nonzero().flatten()  # batch positions still sampling
            live_rows, live_chosen = batch_rows[live], chosen[live]
            tokens[live_rows, step] = live_chosen
            lengths[live_rows] += 1
            finished = torch.isin(live_chosen, eos)  # [live]
            if stop:
                candidates = ~finished & self._can_end_stop(stop, logits.shape[-1])[live_chosen]  # [live]
                for i in candidates.nonzero().flatten().tolist():
                    row, first = int(live_rows[i]), step + 1 - tail
                    window = (histories[row // n][first:] if first < 0 else []) + tokens[
                        row, max(0, first) : step + 1
                    ].tolist()
                    if any(s in self.tokenizer.decode(window) for s in stop):
                        finished[i] = True
            stopped[live_rows] = finished
            alive[live[finished | (lengths[live_rows] >= limits[live_rows])]] = False
            if step + 1 == steps or not bool(alive.any()):
                break
            if int((~alive).sum()) >= max(1, len(alive) // 8):
                # Finished rows leave the batch once they are an eighth of it: one long response no longer makes
                # every row pay for it, and the cache is copied only now and then.
                keep = alive.nonzero().flatten()
                cache.batch_select_indices(keep)
                batch_rows, alive, chosen = batch_rows[keep], alive[keep], chosen[keep]
                attention, next_position = attention[keep], next_position[keep]
            out = model(
                input_ids=chosen[:, None],
                attention_mask=attention[..., : width + step + 1],
                position_ids=next_position,
                cache=cache,
                use_cache=True,
            )
            logits, next_position = out.logits[:, -1], next_position + 1
        model.train(was_training)

        eos_set = set(eos.tolist())
        completions = []
        for row in range(rows):
            ids = tokens[row, : int(lengths[row])].tolist()
            if stopped[row] and ids[-1] not in eos_set:  # a stop string: train up to where it begins
                history = histories[row // n]
                ids = cut_at_stop(self.tokenizer, history + ids, stop)[0][len(history) :]
            completions.append(Completion(ids=ids, finish_reason="stop" if stopped[row] else "length"))
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]


# vLLM engine (optional, GPU). Every call below was checked against the vllm==0.30.0 source (the pin):
#   LLM(...), generate, get_tokenizer, collective_rpc, reset_prefix_cache, sleep/wake_up: vllm/entrypoints/llm.py
#   TokensPrompt: vllm/inputs/llm.py; SamplingParams: vllm/sampling_params.py; outputs: vllm/outputs.py
#   SamplingParams(n, seed): v1/engine/parallel_sampling.py gives child i seed + i; a seeded request draws its own
#   noise (v1/worker/gpu/sample/gumbel.py: from (seed, position)), whatever else is in the batch
#   "reload_weights" RPC: vllm/v1/worker/gpu_worker.py Worker.reload_weights -> gpu_model_runner.py
#   GPUModelRunner.reload_weights -> model_loader/reload/layerwise.py (in place, HF checkpoint names)
#   stop strings: vllm/v1/engine/detokenizer.py cuts .text only; token_ids keep the stop tokens, so we cut them.
# Sleep, level 2 (weights and KV cache discarded, nothing copied to the host):
#   LLM.sleep/wake_up -> v1/engine/core.py EngineCore.sleep/wake_up -> v1/executor/abstract.py Executor.sleep (tags
#   {"weights", "kv_cache"}; a second sleep while any tag sleeps is ignored) and wake_up(tags) -> v1/worker/gpu_worker.py
#   Worker.sleep/wake_up -> device_allocator/sleep_mode_backend.py CuMemBackend.suspend: level 1 offloads the
#   "weights" pool to the host, level 2 offloads nothing. The engine resumes scheduling once every tag is awake.
#   Buffers live in the "weights" pool too: Worker.sleep(level=2) keeps a host copy of model.named_buffers() (the
#   RoPE cos/sin caches, kilobytes) and Worker.wake_up puts it back when "weights" wakes. reload_weights does not
#   restore them: model_loader/reload/layerwise.py _copy_and_restore_kernel_tensors skips non-persistent buffers it
#   did not load. So waking "weights" is what restores them, and every parameter must be sent: one the engine's
#   model has and the training model lacks would keep whatever the fresh memory held (level 1 kept the old value).
# torchrun (one engine per rank, on its own GPU): distributed_executor_backend="external_launcher"
#   v1/executor/abstract.py Executor.get_class -> v1/executor/uniproc_executor.py ExecutorWithExternalLauncher: rank
#   and local rank from RANK and LOCAL_RANK, init "env://", VLLM_ENABLE_V1_MULTIPROCESSING=0 required;
#   v1/worker/gpu_worker.py Worker.init_device: cuda:LOCAL_RANK (no data-parallel offset for this backend);
#   distributed/parallel_state.py init_distributed_environment reuses an initialised torch.distributed world (ours,
#   from distributed.init_distributed; otherwise it would start a world of size 1 at rank RANK) and
#   initialize_model_parallel lays the world out as ExternalDP x DP x PP x PCP x TP: with tensor_parallel_size=1 and
#   data_parallel_size=1 (vllm/config/parallel.py defaults) every rank is an engine of its own that "can generate
#   independently". data_parallel_size > 1 would make v1/engine/llm_engine.py step the ranks' engines together
#   (has_unfinished_requests_dp), so every rank would have to call generate as often as the others.
#   Building the engine is collective (new_group for the world and each 1-rank group; ExecutorWithExternalLauncher.
#   determine_available_memory takes the minimum over ranks): every rank builds it at the same point of a script.
# tests/test_vllm_glue.py holds a strict fake vllm with these exact signatures; tests/test_vllm_source.py holds our
# calls, the fake and the facts above to the wheel's source.


class VLLMSampler:
    """In-process vLLM engine for rollouts; token ids in, token ids out. Under torchrun, one engine per rank on the
    rank's GPU, sampling the rank's own prompts.

    Sampling is reproducible as HFSampler's is: every request carries a seed drawn from `generator`, which
    training.reseed sets per iteration and rank, so a resumed run sends the same seeds as the uninterrupted one
    and ranks draw different samples.

    sleep() discards the engine's weights and KV cache (vLLM's level 2): the training update overwrites the weights
    anyway, so copying them to the host and back (level 1) would be wasted. wake_up() maps the weights' memory again
    and load_weights(model) fills it, then brings back the KV cache: sampling before that reload is refused.

    model: the training model. When FSDP shards it (--fsdp), it is gathered while the sampler is awake and back on its
    shards while it sleeps, as with HFSampler: the no-grad log-prob passes call it a different number of times on
    each rank, which a sharded model (one all-gather per call) cannot do.
    """

    def __init__(
        self,
        model_path: str,
        *,
        model: torch.nn.Module | None = None,
        seed: int = 0,
        max_model_len: int = 2048,
        gpu_memory_utilization: float = 0.5,
        dtype: str | None = None,
        enable_sleep_mode: bool = True,
        enforce_eager: bool = False,
    ):
        """dtype: the engine's ("bfloat16", "float16", ...); None: bfloat16 where the GPU has bf16, else float16.
        enforce_eager: no CUDA graphs and no torch.compile (a faster start, slower decoding)."""
        gpu.prepare_vllm(enforce_eager)  # a CUDA mismatch stops here, in a second, with its fix
        dtype = dtype or engine_dtype()
        # load_weights hands live torch tensors to the worker. That only works
        # when the engine core runs in this process. With the default ("1"),
        # vLLM starts a separate engine-core process and msgpack-encodes every
        # RPC argument; an iterator of tensors cannot go through that. The
        # variable must be set before the engine is built: EngineCore.__init__
        # then caches vllm.envs. The external launcher needs it too.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        started = time.perf_counter()
        self.llm = LLM(
            model_path,
            # The engine seeds the process's global RNGs with it (Worker.init_device), the same on every rank, as
            # torch.manual_seed(args.seed) left them; the samples differ per rank through the requests' seeds.
            seed=seed,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            # The n samples of a prompt, and prompts that share a few-shot
            # prefix, reuse the prefix's KV blocks.
            enable_prefix_caching=True,
            enable_sleep_mode=enable_sleep_mode,
            enforce_eager=enforce_eager,
            # Under torchrun each rank holds the whole model on its own GPU (see the comment above the class); in
            # one process the default single-process executor.
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher" if distributed.world_size() > 1 else None,
        )
        distributed.print0(
            f"vLLM engine ready in {time.perf_counter() - started:.0f} s ({dtype})"
            + (f", one per rank on {distributed.world_size()} ranks" if distributed.world_size() > 1 else "")
        )
        # Use the same tokenizer as vLLM's stop-string detokenizer.
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = max_model_len
        self.weight_dtype = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None
        self.sleep_enabled = enable_sleep_mode
        self.asleep = False  # weights and KV cache released (sleep() until wake_up())
        self.cache_asleep = False  # the KV cache still released (sleep() until load_weights())
        self.weights_discarded = False  # sleep() threw the weights away; load_weights() brings the model's
        # The requests' seeds come from it; training.reseed sets it per iteration and rank, rank_seed keeps the
        # ranks apart before that (rank 0: the seed of a single-process run).
        self.generator = torch.Generator().manual_seed(distributed.rank_seed(seed))
        self.model = model
        # Gathered after the engine is built: vLLM sizes its KV cache from the memory free when it starts.
        self._gather(True)

    def _gather(self, gathered: bool) -> None:
        if self.model is not None and distributed.is_sharded(self.model):
            distributed.gather_parameters(self.model, gathered)

    def sample(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int | list[int],
        stop: Sequence[str] = (),
        context: int | None = None,
        progress: str | None = None,
        generated: int | list[int] = 0,
    ) -> list[list[Completion]]:
        """n completions per prompt, in prompt order.
        Max new tokens = min(max_new_tokens (one, or one per prompt), context - len(prompt)).
        generated: as in HFSampler.sample (vLLM only looks for stop strings in the new text, so a stop string
        that begins in the response so far is found and cut here, after generation)."""
        from vllm import SamplingParams, TokensPrompt

        if self.asleep:
            raise RuntimeError("VLLMSampler.sample() called while asleep; call wake_up() first")
        if self.weights_discarded:
            raise RuntimeError(
                "VLLMSampler.sample(): weights not reloaded since sleep() discarded them; "
                "call load_weights(model) after wake_up()"
            )
        stop = list(stop)
        histories = stop_histories(prompts, generated, stop)
        limit = self.max_model_len if context is None else min(context, self.max_model_len)
        wanted = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        budgets = [min(w, limit - len(p)) for p, w in zip(prompts, wanted)]
        # Like HFSampler, a prompt with no room left gets n empty "length"
        # completions. vLLM would reject it instead: it needs max_tokens >= 1 and
        # prompt length < max_model_len.
        live = [i for i, b in enumerate(budgets) if b >= 1]
        result = [[Completion(ids=[], finish_reason="length") for _ in range(n)] for _ in prompts]
        if not live:
            return result
        # Each prompt gets its own SamplingParams because the budget can differ per
        # prompt; LLM.generate pairs a list with the prompts one by one. Each also gets
        # its own seed, drawn from self.generator: vLLM seeds its sample j with seed + j,
        # and fresh draws keep calls and prompts apart. Unseeded requests would take
        # their noise from the engine's RNG state (the v2 model runner seeds them from
        # numpy's global RNG), which no reseed reaches: a resumed run would not repeat.
        seeds = torch.randint(0, 2**62, (len(live),), generator=self.generator).tolist()
        params = [
            SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=budgets[i], stop=stop, seed=seed)
            for i, seed in zip(live, seeds)
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompts[i])) for i in live],
            sampling_params=params,
            use_tqdm=progress is not None and distributed.rank() == 0,
        )
        assert len(outs) == len(live)
        for i, out in zip(live, outs):
            assert len(out.outputs) == n
            result[i] = [self._completion(c, stop, histories[i]) for c in out.outputs]
        return result

    def _completion(self, c, stop: list[str], history: list[int]) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
        ids, finish = list(c.token_ids), c.finish_reason
        if stop:
            # vLLM's token_ids still include the token(s) that spell the stop
            # string. Cut them with the same rule as cut_at_stop. This also catches
            # a stop string that vLLM's prompt-aware incremental decode saw
            # differently, or one that begins in the response so far (history).
            cut, found = cut_at_stop(self.tokenizer, history + ids, stop)
            if found:
                ids, finish = cut[len(history) :], "stop"
        return Completion(ids=ids, finish_reason=finish)

    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the training model's current weights into the engine, in place, then bring back the KV cache if
        sleep() released it. Under torchrun every rank calls it (a sharded model's weights are gathered)."""
        if self.asleep:
            raise RuntimeError("VLLMSampler.load_weights() called while asleep; call wake_up() first")
        from torch.distributed.tensor import DTensor

        self.model = model
        model = getattr(model, "_orig_mod", model)  # unwrap torch.compile so names match the checkpoint
        dtype = self.weight_dtype

        def whole(p: torch.Tensor) -> torch.Tensor:
            # A parameter FSDP holds sharded is gathered here, one at a time: every rank walks named_parameters in
            # the same order, so the all-gathers match. wake_up() has usually gathered the model already.
            full = p.full_tensor() if isinstance(p, DTensor) else p
            return full.detach() if dtype is None else full.detach().to(dtype)

        # HF parameter names are the checkpoint format vLLM's model.load_weights
        # expects. It handles fused qkv/gate_up and tied embeddings (named_parameters
        # yields a tied lm_head once, as embed_tokens). reload_weights is the in-place
        # path (0.30.0: GPUModelRunner.reload_weights). It keeps the tensor storage
        # that CUDA graphs point to and clears the LoRA, encoder and MM caches.
        # The fp32 master weights go over in the engine's dtype, one tensor at a time:
        # the generator holds a single converted tensor, never a second copy of the
        # model. detach() keeps autograd out of vLLM's copy_.
        weights = ((name, whole(p)) for name, p in model.named_parameters())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.weights_discarded = False
        if self.cache_asleep:  # woken only now: the KV cache was not allocated while the weights loaded
            torch.cuda.empty_cache()  # the reload's temporaries (bf16 copies, gathered shards) sit in torch's cache
            self.llm.wake_up(tags=["kv_cache"])
            self.cache_asleep = False
        # KV blocks cached under the old weights would be reused for matching
        # prefixes. Drop them. vLLM returns False, and resets nothing, while any
        # request still holds blocks; stale KV would quietly skew the rollouts.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after loading weights")

    def sleep(self) -> None:
        """Release the engine's GPU memory for training: vLLM's level 2 discards the weights and the KV cache
        (load_weights after wake_up brings the weights). A sharded training model goes back to its shards. The
        engine sleeps only if built with sleep mode."""
        self._gather(False)
        if self.sleep_enabled and not self.asleep:
            if self.cache_asleep:
                # Woken for a weight load that did not come: vLLM ignores sleep while any tag sleeps (Executor.sleep),
                # so the KV cache wakes first and the weights' memory is released again below.
                self.llm.wake_up(tags=["kv_cache"])
            self.llm.sleep(level=2)
            self.asleep = self.cache_asleep = self.weights_discarded = True

    def wake_up(self) -> None:
        """Map the weights' memory again (their values come with load_weights, which then brings the KV cache
        back: the cache is not allocated while the weights load, as vLLM's sleep-mode docs advise). A sharded
        training model is gathered."""
        if self.asleep:
            # The update's activations stay in torch's caching allocator; vLLM maps its memory anew on waking, so that
            # memory must go back to the driver first (plumbing/memory.py counts on it).
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])
            self.asleep = False
        self._gather(True)


def backend_problems(backend: str) -> list[str]:
    if backend not in ("auto", "hf", "vllm"):
        return [f"--backend {backend!r} is not a backend: use hf, vllm or auto"]
    if backend == "vllm" and not torch.cuda.is_available():
        return ["--backend vllm needs a CUDA GPU; use --backend hf"]
    return []


def resolve_backend(backend: str) -> tuple[str, str]:
    """The engine --backend names, and why: "auto" is vllm when it imports and a GPU is present (under torchrun: one
    engine per rank), else hf."""
    if backend != "auto":
        return backend, f"--backend {backend}"
    if not torch.cuda.is_available():
        return "hf", "--backend auto: no CUDA GPU"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "hf",
            "--backend auto: vllm is not installed (pip install -r requirements-vllm.txt), so the slower HF decode loop",
        )
    if distributed.world_size() > 1:
        return (
            "vllm",
            "--backend auto: vllm installed and a CUDA GPU present (under torchrun: one engine per rank, on its GPU)",
        )
    return "vllm", "--backend auto: vllm installed and a CUDA GPU present"


def make_sampler(
    backend: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_path: str,
    seed: int = 0,
    precision: Precision = FP32,
    sampler_batch_tokens: int = 2**16,
    **vllm_kwargs,
):
    """The rollout engine for --backend: "hf", "vllm", or "auto" (vllm when importable and a GPU is present).
    `precision` and `sampler_batch_tokens` (positions one batch caches) are the HF sampler's (vLLM computes in its own
    dtype and schedules its own batches)."""
    backend, why = resolve_backend(backend)
    if problems := backend_problems(backend):
        raise UsageError(problems[0])
    distributed.print0(f"rollout engine: {backend} ({why})")
    if backend == "hf":
        return HFSampler(model, tokenizer, seed=seed, precision=precision, max_batch_tokens=sampler_batch_tokens)
    return VLLMSampler(models.resolve_model(model_path), model=model, seed=seed, **vllm_kwargs)
