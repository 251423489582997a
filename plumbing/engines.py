"""Rollout engines: token ids in, token ids and finish reasons out (plumbing/completions.py).

HFSampler    transformers on any device (the tested path): plumbing/hf_engine.py
VLLMSampler  vLLM in-process on a GPU (optional dependency, pinned version): plumbing/vllm_engine.py
make_sampler the engine for --backend hf | vllm | auto (this module)
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from plumbing import UsageError, distributed, models
from plumbing.completions import Completion, cut_at_stop, stop_histories, token_pieces
from plumbing.hf_engine import HFSampler
from plumbing.precision import FP32, Precision
from plumbing.vllm_engine import VLLMSampler

__all__ = ["Completion", "HFSampler", "VLLMSampler", "cut_at_stop", "make_sampler", "stop_histories", "token_pieces"]


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
            "--backend auto: vllm is not installed (pip install -r requirements-vllm.txt), "
            "so the slower HF decode loop",
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
    context: int | None = None,
    **vllm_kwargs,
):
    """The rollout engine for --backend: "hf", "vllm", or "auto" (vllm when importable and a GPU is present).
    `precision` and `sampler_batch_tokens` (positions one batch caches) are the HF sampler's (vLLM computes in its own
    dtype and schedules its own batches). `context` (--context, vLLM's max_model_len unless that is given) is refused
    beyond the model's positions, before anything is sampled."""
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
    distributed.print0(f"rollout engine: {backend} ({why})")
    if backend == "hf":
        return HFSampler(model, tokenizer, seed=seed, precision=precision, max_batch_tokens=sampler_batch_tokens)
    return VLLMSampler(models.resolve_model(model_path), model=model, seed=seed, **vllm_kwargs)


def run_sampler(args, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, checkpoint, precision: Precision):
    """A training run's rollout engine: make_sampler with the run's --backend, --seed, --sampler-batch-tokens,
    --context and vLLM flags (`args`, a script's Args); vLLM loads the checkpoint's weights when resuming (with
    --lora-rank: the base, then the checkpoint's adapters merged into it, as after every update). vLLM at
    top_p < 1 reports no log-prob to hold against the trainer's (Completion.logprobs): said in one line, and
    --rollout-correction refused."""
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
        enforce_eager=args.vllm_enforce_eager,
    )
    if isinstance(sampler, VLLMSampler) and adapters and checkpoint:
        sampler.load_weights(model)  # the resumed adapters, merged (a fresh run's start at B = 0 is the base itself)
    if isinstance(sampler, VLLMSampler) and args.top_p < 1:
        if args.rollout_correction != "none":
            raise UsageError(
                f"--rollout-correction {args.rollout_correction} needs the log-prob each token was sampled with, "
                f"which vLLM at --top-p {args.top_p:g} reports renormalised over the nucleus: use --top-p 1 or "
                "--backend hf"
            )
        distributed.print0(
            f"sampler-vs-trainer metrics (sampler/*) not logged: vLLM at --top-p {args.top_p:g} reports log-probs "
            "renormalised over the nucleus, not the trainer's (--top-p 1 or --backend hf logs them)"
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
