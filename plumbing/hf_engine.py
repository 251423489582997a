"""The HF rollout engine: transformers on any device (the tested path), a batched decode loop in which the n
continuations of a prefix share one prefill (SPO's Monte-Carlo rollouts, tree children), with exact top-p sampling.
max new tokens = min(budget, context - prefix length).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from plumbing import distributed, models
from plumbing.completions import Completion, cut_at_stop, stop_histories
from plumbing.precision import FP32, Precision


def _next_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, candidates: int = 64
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample one token per row from logits [rows, vocab] with temperature and nucleus (top-p) filtering. Returns the
    tokens [rows] and their log-probs under softmax(logits / temperature) over the whole vocabulary, before the top-p
    cut ([rows]; what the trainer computes; None when greedy, temperature 0).

    Exact, without sorting the vocabulary every step (a full sort and a full-vocabulary multinomial cost
    more than the model's forward pass for a small model): the draw is made by inverse CDF among the
    `candidates` most likely tokens, where the nucleus nearly always lies. A row whose nucleus reaches past
    them is drawn from its fully sorted distribution; with top_p = 1, a draw that lands in the remaining
    mass is drawn from the remaining tokens in proportion to their probabilities.
    """
    if temperature <= 0:
        return logits.argmax(-1), None
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
    return chosen, logprobs.gather(-1, chosen[:, None]).squeeze(-1)


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
        # [rows x repeats, kv_heads, length + room, head_dim]
        self.key_buffer = self._with_room(keys, room, repeats, dtype)
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
        """Sampling uses the training model itself: nothing to copy."""
        self.model = model

    def sleep(self) -> None:
        """A replica has nothing to free; a sharded model goes back to its shards for the update."""
        if distributed.is_sharded(self.model):
            distributed.gather_parameters(self.model, False)

    def wake_up(self) -> None:
        """A sharded model is gathered: the whole model on every rank while it samples (see fully_shard_model)."""
        if distributed.is_sharded(self.model):
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
        """The Sampler contract (plumbing/engines.py). Log-probs: reported except when greedy (temperature 0).
        ignore_eos (HF only): sample past EOS to the token limit, as vLLM's option of that name; the speed
        benchmarks use it for equal lengths on both sides."""
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
        """Next-token logits [prompts, vocab] and a KV cache [prompts, kv_heads, width, head_dim] per layer,
        left-padded.

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
        # <= 0: where the prompt ends in its root
        shift = lengths - torch.tensor([len(roots[r]) for r in root_of], device=device)
        last = width - 1 + shift  # [prompts]: the column of each prompt's last token in its root
        logits = model.get_output_embeddings()(out.last_hidden_state[source, last])  # [prompts, vocab]
        # [prompts, width]; pad columns: any
        columns = (torch.arange(width, device=device)[None] + shift[:, None]).clamp(min=0)
        for layer in out.cache.layers:
            # [prompts, kv_heads, width, head_dim]
            index = columns[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
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
        # [prompts, width], left-padded
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
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
        # [batch, width + steps]
        attention = torch.cat([attention, attention.new_ones(len(prompts), steps)], 1).repeat_interleave(n, dim=0)
        if model.config._attn_implementation == "sdpa" and all(type(layer) is _GrowingKV for layer in cache.layers):
            # Handed over as [batch, 1, 1, positions], the mask reaches SDPA as it is. Left 2D, transformers drops it
            # when no row is padded and asks SDPA for grouped-query attention (enable_gqa), which on CPU in bf16 took
            # 5x as long per layer as the packed query heads it uses when there is a mask (1.29 against 0.24 ms,
            # 24 rows).
            attention = attention.bool()[:, None, None]  # [batch, 1, 1, width + steps]
        # [batch, 1]
        next_position = torch.tensor([[len(p)] for p in prompts], device=device).repeat_interleave(n, dim=0)

        rows = len(prompts) * n
        eos = torch.tensor(
            [] if ignore_eos else sorted(models.eos_ids(model, self.tokenizer)), dtype=torch.long, device=device
        )
        tokens = torch.full((rows, max(1, steps)), pad, dtype=torch.long, device=device)  # [rows, steps]
        token_logps = torch.zeros(rows, max(1, steps), device=device)  # [rows, steps]: what each was sampled with
        lengths = torch.zeros(rows, dtype=torch.long, device=device)  # tokens sampled per row
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # ended by EOS or a stop string
        batch_rows = torch.arange(rows, device=device)  # [batch]: the row each batch position samples for
        alive = limits > 0  # [batch]: still sampling; finished rows stay in the batch until enough have finished
        tail = max((len(s) for s in stop), default=0) + 2  # decoded tokens enough to contain a stop string

        for step in range(steps):
            if not bool(alive.any()):
                break
            chosen, chosen_logps = _next_tokens(logits, temperature, top_p, self.generator)  # [batch], [batch]
            live = alive.nonzero().flatten()  # batch positions still sampling
            live_rows, live_chosen = batch_rows[live], chosen[live]
            tokens[live_rows, step] = live_chosen
            if chosen_logps is not None:
                token_logps[live_rows, step] = chosen_logps[live]
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
            logps = token_logps[row, : len(ids)].tolist() if temperature > 0 else None
            completions.append(Completion(ids, "stop" if stopped[row] else "length", logps))
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]
