"""Rollout engines: token ids in, token ids and finish reasons out. The contract every engine keeps is the Sampler
protocol below, written here once; each engine's docstring says only how it differs.

HFSampler    transformers on any device (the tested path): plumbing/hf_engine.py
VLLMSampler  vLLM in-process on a GPU, or on a CPU with vLLM's CPU build (optional dependency, pinned version):
             plumbing/vllm_engine.py
make_sampler the engine for --backend hf | vllm | auto (this module; which one auto gives: resolve_backend in
             plumbing/vllm_preflight.py)
(experiments/exact_toy.py's ExactSampler keeps the same contract for a policy small enough to enumerate.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from plumbing import UsageError, distributed, memory, models, vllm_preflight
from plumbing.completions import Completion, cut_at_stop, stop_histories, token_pieces
from plumbing.hf_engine import HFSampler
from plumbing.precision import FP32, Precision, engine_dtype
from plumbing.vllm_engine import VLLMSampler
from plumbing.vllm_preflight import backend_problems, resolve_backend

__all__ = [
    "Completion",
    "HFSampler",
    "Sampler",
    "VLLMSampler",
    "backend_problems",
    "cut_at_stop",
    "make_sampler",
    "resolve_backend",
    "stop_histories",
    "token_pieces",
]


class Sampler(Protocol):
    """What a rollout engine is to the scripts.

    The cycle of a training iteration: sample() the rollouts; sleep() before the update (the engine may release its
    memory for training); wake_up() after it; load_weights(model) to sample from the updated policy (an engine that
    samples with the training model itself has nothing to copy). sample() is valid when the engine is awake and holds
    the current weights.

    `generator` (a torch.Generator) is where every draw's randomness comes from: training.reseed seeds it per
    iteration and rank, so a resumed run samples what the uninterrupted one would, and ranks draw different samples.
    """

    generator: torch.Generator

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
        """n completions for each prompt (token ids), in prompt order: result[i] holds prompt i's n Completions.

        temperature, top_p: the sampling distribution, softmax(logits / temperature) cut to the nucleus top_p;
          temperature 0 is greedy decoding.
        max_new_tokens: one budget, or one per prompt; each is capped at context - prompt length. A prompt with no
          room left (or none given) gets n empty completions finished by "length", without sampling.
        stop: stop strings (plumbing/completions.py's rule): a completion stops at EOS or where a stop string is
          complete; one cut by a stop string is finished ("stop") and its ids end where the stop string begins.
        generated: how many of each prompt's last tokens the policy sampled itself (the response so far, one count
          or one per prompt). A stop string that begins there and ends in the new tokens stops the completion too,
          which is then cut where it begins: to nothing when it begins before the new tokens.
        progress: a progress bar's label (None: no bar).

        Each Completion holds the ids, the finish reason ("stop": EOS or a stop string; "length": the token or
        context limit, which scores 0) and, per id, the log-prob the engine drew it with (log softmax(logits /
        temperature) over the whole vocabulary, before any top-p cut: what the trainer computes; or renormalised over
        the nucleus, which logprobs_top_p then names), or None where the engine does not report it.
        """
        ...

    def sleep(self) -> None:
        """Before the update: the engine may release what it holds for sampling."""
        ...

    def wake_up(self) -> None:
        """After the update: the engine is ready for load_weights."""
        ...

    def load_weights(self, model: PreTrainedModel) -> None:
        """Sample from `model`'s current weights from now on (the training model, after an update)."""
        ...


def make_sampler(
    backend: str,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    model_path: str,
    seed: int = 0,
    precision: Precision = FP32,
    sampler_batch_tokens: int = 2**16,
    context: int | None = None,
    **vllm_kwargs,
):
    """The rollout engine for --backend: "hf", "vllm", or "auto" (vllm when importable and a GPU is present).
    `precision` and `sampler_batch_tokens` (positions one batch caches) are the HF sampler's; on a GPU vLLM computes
    in its own dtype and schedules its own batches, while the CPU build's engine computes in the run's precision
    (fp32, or bf16 where the run autocasts) and holds the sampler batch's positions in its KV cache
    (memory.cpu_kv_cache_bytes; VLLM_CPU_KVCACHE_SPACE, when set, is vLLM's and wins). `context` (--context, vLLM's
    max_model_len unless that is given) is refused beyond the model's positions, before anything is sampled."""
    backend, why = resolve_backend(backend)
    if problems := backend_problems(backend):
        raise UsageError(problems[0])
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and context is not None and context > positions:
        raise UsageError(
            f"--context {context} is beyond the model's {positions} positions ({model_path}): it never saw a "
            f"position past {positions - 1}; give --context {positions} or less"
        )
    vllm_kwargs.setdefault("max_model_len", context)
    if isinstance(positions, int) and (vllm_kwargs["max_model_len"] or 0) > positions:
        # a default window (eval.py's 4096) beyond the model's positions, which vLLM refuses: the model's own
        vllm_kwargs["max_model_len"] = positions
    distributed.print0(f"rollout engine: {backend} ({why})")
    if backend == "hf":
        return HFSampler(model, tokenizer, seed=seed, precision=precision, max_batch_tokens=sampler_batch_tokens)
    if vllm_preflight.cpu_build():
        dtype = vllm_kwargs.setdefault("dtype", engine_dtype("cpu", precision))
        if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # set: the user's size, which vLLM takes instead
            vllm_kwargs.setdefault(
                "kv_cache_bytes",
                memory.cpu_kv_cache_bytes(
                    memory.model_shape(model.config),
                    sampler_batch_tokens,
                    4 if dtype == "float32" else 2,
                    vllm_preflight.free_memory(),
                    distributed.world_size(),
                ),
            )
    return VLLMSampler(models.resolve_model(model_path), model=model, seed=seed, **vllm_kwargs)


def run_sampler(args, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, checkpoint, precision: Precision):
    """A training run's rollout engine: make_sampler with the run's --backend, --seed, --sampler-batch-tokens,
    --context and vLLM flags (`args`, a script's Args); vLLM loads the checkpoint's weights when resuming (with
    --lora-rank: the base, then the checkpoint's adapters merged into it, as after every update). vLLM at
    top_p < 1 reports each token's log-prob renormalised over the nucleus (Completion.logprobs_top_p): one line
    says which gap sampler/* logs then, and --rollout-correction is refused (its weight is stated for the whole
    vocabulary's log-probs)."""
    adapters = getattr(args, "lora_rank", 0) > 0
    sampler = make_sampler(
        args.backend,
        model,
        tokenizer,
        # an adapter checkpoint is not a model directory: the engine starts from the base, and gets the merge below
        str(checkpoint) if checkpoint and not adapters else args.model,
        seed=args.seed,
        precision=precision,
        sampler_batch_tokens=args.sampler_batch_tokens,
        context=args.context,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        # the flag asks for eager; without it the engine's own default: CUDA graphs on a GPU, eager on a CPU
        enforce_eager=args.vllm_enforce_eager or None,
    )
    if isinstance(sampler, VLLMSampler) and adapters and checkpoint:
        sampler.load_weights(model)  # the resumed adapters, merged (a fresh run's start at B = 0 is the base itself)
    if isinstance(sampler, VLLMSampler) and args.top_p < 1:
        if args.rollout_correction != "none":
            raise UsageError(
                f"--rollout-correction {args.rollout_correction} needs each token's log-prob under the whole "
                f"vocabulary, and vLLM at --top-p {args.top_p:g} reports it renormalised over the nucleus (the "
                "weight is not stated for the truncated distribution): use --top-p 1 or --backend hf"
            )
        if args.temperature > 0:
            distributed.print0(
                f"sampler/* compare vLLM's log-probs with the trainer's, both renormalised over the top-p "
                f"{args.top_p:g} nucleus (the trainer's rebuilt from its own logits by vLLM's rule; "
                "sampler/outside_nucleus_fraction: sampled tokens outside it, each a gap of 10 nats)"
            )
    return sampler


def sampling_settings(args, stop: list[str]) -> dict:
    """A training run's sampling keywords, as sampler.sample and the scripts' rollouts take them: --temperature,
    --top-p, --max-new-tokens and --context of `args` (a script's Args) and the task's `stop` strings."""
    return dict(
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        context=args.context,
        stop=stop,
    )
