"""Memory sizing: the `auto` values of the memory knobs, chosen from the GPU's free memory, the model's shape and the
run's context, before anything large is loaded.

    --micro-batch-size         sequences per forward/backward of the update
    --gradient-checkpointing   recompute each layer's activations in the backward pass
    --reference-on-device      keep the frozen reference model on the GPU, or in pinned CPU memory between its passes
    --vllm-gpu-memory-utilization   the vLLM engine's share of the GPU (its weights, activations and KV cache)
    --sampler-batch-tokens     positions one batch of the HF sampler caches

The formula (bytes; P parameters, L layers, hidden h, MLP width I, vocab V, r = KV heads / query heads):
  training state     16 P   fp32 weights 4 P, gradients 4 P, AdamW's two moments 8 P (twice with a second model
                            trained in full, ppo_baseline.py's value model; --fsdp over N ranks: divided by N, plus
                            4 P for the whole model the sampler gathers)
  autocast copies     2 P   the bf16 copies of the weights that autocast keeps during a forward/backward pass
  reference model     4 P   fp32, on the GPU (--reference-on-device) or moved in for its pass
  with --lora-rank    e P + 16 A   the frozen base (e: 2 in bf16), the A adapter parameters' fp32 weights, gradients
                            and moments (adapter_params); no reference model (the policy with its adapters off), no
                            autocast copies of a bf16 base; a second model as above; activations as above (LoRA's
                            measure 5-10 % below: tests/test_memory.py)
  activations         per token of a micro-batch (micro-batch x context tokens at most), + 8 h for the final norm:
                      L (38 h + 6 r h + 8 I)        without checkpointing: what bf16 autocast saves for the backward
                                                    pass of a pre-norm decoder layer (norms in fp32, linear inputs and
                                                    MLP products in bf16, attention saving q, k, v and its output);
                                                    the coefficients are autograd's saved bytes, measured
                      4 L h + (38 h + 6 r h + 8 I)  with checkpointing: each layer's fp32 input, and one layer again
  LM head             the log-prob chunks' fp32 logits: at most 2**28 entries kept, and 512 positions in flight
  margin              5 % of the GPU and 1 GiB: the CUDA context, the allocator's fragmentation
During rollout the update's activations are gone (emptied from torch's cache) and the engine gets what is left once
the no-grad passes, which run while it is awake, have their room (the reference 4 P, autocast's copies, an LM-head
chunk, four full-context rows: no_grad_pass_bytes):
vLLM's share = (free - weights 4 P - AdamW 8 P - no-grad room - margin) / total, capped at 0.9; the HF sampler's
batch caches 2 L r h bytes x 2 (bf16) per position. tests/test_memory.py checks the activation term against the
bytes autograd saves for the backward pass (bf16 autocast on a CPU, small Qwen2 models: within 10 %).

Choice, in this order: no checkpointing before checkpointing, then the largest micro-batch (a divisor of the rank's
batch, at most 8), then the reference on the GPU before the CPU. A value given on the command line is kept. A run
whose training state does not fit even with micro-batch 1, checkpointing and the reference on the CPU is refused.
On a CPU: micro-batch 8 (or the largest divisor of the batch below it), no checkpointing, the reference where it is,
65,536 sampler positions; the vLLM CPU build's engine gets a KV cache for as many positions (cpu_kv_cache_bytes). The
no-grad log-prob passes are sized apart, to the memory free when they run
(training.no_grad_batch_tokens).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from plumbing import UsageError, distributed, lora, models, shown, vllm_preflight
from plumbing.precision import Precision

GiB = 2**30
CPU_SAMPLER_TOKENS = 2**16  # the HF sampler's batch on a CPU (benchmarks/sampler.py)
LARGEST_MICRO_BATCH = 8
LOGIT_CHUNK = 512  # positions per LM-head chunk (training.response_logprobs)
KEPT_LOGITS = 2**28  # logits entries above which the chunks are recomputed (training.response_logprobs)
# Positions per nucleus rebuilt at top-p < 1 (training.token_logprobs): its sort, cumulative mass and masks, about 21
# bytes a logit, stay within the room an LM-head chunk of LOGIT_CHUNK positions has (no_grad_pass_bytes)
NUCLEUS_CHUNK = 128
VLLM_SHARE_CAP = 0.9


@dataclass(frozen=True)
class ModelShape:
    """What the formula needs from a model's config."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def model_shape(config) -> ModelShape:
    """The shape of a decoder-only transformers config (Llama, Qwen2, Mistral, SmolLM2...), with its parameter count.

    >>> import transformers
    >>> model_shape(transformers.Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
    ...     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False)).params
    1777088000
    """
    h, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    intermediate = config.intermediate_size
    bias = getattr(config, "attention_bias", None)
    bias = type(config).__name__.startswith("Qwen2") if bias is None else bias  # Qwen2's q, k, v carry biases
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2 + (heads + 2 * kv_heads) * head_dim * bias
    per_layer = attention + 3 * h * intermediate + 2 * h  # + two RMSNorm weights
    embeddings = vocab * h * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    return ModelShape(layers * per_layer + embeddings + h, layers, h, intermediate, vocab, heads, kv_heads)


ADAPTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_params(shape: ModelShape, rank: int, target: str = "all-linear") -> int:
    """LoRA's trainable parameters: rank x (in + out) for each adapted linear layer of the attention and MLP blocks
    (--lora-target: all-linear, or module names separated by commas).

    >>> adapter_params(ModelShape(0, 1, 8, 16, 0, 2, 1), rank=2, target="q_proj,down_proj")
    64
    """
    h, d, I = shape.hidden, shape.head_dim, shape.intermediate  # noqa: E741
    sizes = dict(
        q_proj=h + shape.heads * d,
        k_proj=h + shape.kv_heads * d,
        v_proj=h + shape.kv_heads * d,
        o_proj=shape.heads * d + h,
        gate_proj=h + I,
        up_proj=h + I,
        down_proj=I + h,
    )
    names = ADAPTED_MODULES if target == "all-linear" else [n.strip() for n in target.split(",")]
    return shape.layers * rank * sum(sizes.get(name, 0) for name in names)


def activation_bytes_per_token(shape: ModelShape, checkpointing: bool) -> int:
    """Bytes the update keeps for its backward pass per token of a micro-batch (bf16 autocast, fp32 weights)."""
    h, r = shape.hidden, shape.kv_heads / shape.heads
    layer = 38 * h + 6 * r * h + 8 * shape.intermediate  # tests/test_memory.py measures these on a small model
    return int(8 * h + (4 * shape.layers * h + layer if checkpointing else shape.layers * layer))


def pass_bytes(shape: ModelShape, tokens: int, checkpointing: bool) -> int:
    """What one micro-batch of `tokens` positions adds during its forward and backward pass: the activations kept for
    the backward pass, the fp32 logits kept (at most KEPT_LOGITS entries), a chunk's logits and gradient in flight."""
    kept_logits = min(tokens * shape.vocab, KEPT_LOGITS) * 4
    return tokens * activation_bytes_per_token(shape, checkpointing) + kept_logits + 2 * LOGIT_CHUNK * shape.vocab * 4


def kv_bytes_per_position(shape: ModelShape, element: int = 2) -> int:
    """Keys and values of one position in every layer (element: 2 for bf16/fp16, 4 for fp32)."""
    return 2 * shape.layers * shape.kv_heads * shape.head_dim * element


def no_grad_pass_bytes(shape, element: int, context: int, sharded: bool = False) -> tuple[int, int]:
    """(bytes per cached position, bytes once per pass) of a no-grad log-prob pass (training.response_logprobs) of a
    model of `shape` (ModelShape); element: 2 under bf16 autocast, 4 without; context: the longest prompt +
    the longest response; sharded: an FSDP model (gathered), whose forward keeps every layer's hidden state.

    Per cached position (rows x (longest prompt + longest response), see training.micro_batches); L layers,
    hidden h, MLP width I, q / kv heads of head_dim d, e = element:
      keys (fp32: transformers' RoPE leaves them so under autocast) and values (e) of every layer   L kv d (4 + e)
      one layer's attention: fp32 queries, keys and values repeated to every query head (SDPA with    q d (8 + 4 e)
        a mask gets no GQA), their autocast copies, its output
      the fp32 residual stream, RMSNorm's fp32 temporaries, the final hidden states the LM head      28 h
        reads (the prompts', the responses', the two joined)
      one layer's MLP: gate, up and their product                                                    3 e I
      the attention mask (bool) and SDPA's additive copy, one entry per key                          (1 + 2 e) context
      sharded: every layer's hidden state (output_hidden_states)                                     4 (L + 1) h
    Once: a chunk of the LM head, 512 positions x vocab x (e + 12) (its logits, in fp32, divided by the temperature,
    their log-sum-exp; at top-p < 1 the nucleus rebuilt from them, 128 positions x vocab x 21 at a time, fits in
    the room their temporaries leave), and under autocast the e-byte copies of the weights it caches for the pass."""
    e, d = element, shape.head_dim
    per_position = (
        shape.layers * shape.kv_heads * d * (4 + e)
        + shape.heads * d * (8 + 4 * e)
        + 28 * shape.hidden
        + 3 * e * shape.intermediate
        + (1 + 2 * e) * context
        + (4 * (shape.layers + 1) * shape.hidden if sharded else 0)
    )
    return per_position, LOGIT_CHUNK * shape.vocab * (e + 12) + (shape.params * e if e == 2 else 0)


@dataclass(frozen=True)
class Plan:
    micro_batch_size: int
    gradient_checkpointing: bool
    reference_on_device: bool
    vllm_gpu_memory_utilization: float
    sampler_batch_tokens: int
    peak_gb: float | None = None  # the update's estimated peak (None on a CPU)
    fits: bool = True  # False: values given on the command line exceed the estimate (a warning, not a refusal)
    line: str = ""
    adapters: bool = False  # LoRA: the reference is the policy with its adapters off, never a model of its own

    def settings(self) -> dict:
        """The knobs' values (what main() puts into its args)."""
        return {name: getattr(self, name) for name in KNOBS}


def micro_batch_candidates(batch_per_rank: int, requested) -> list[int]:
    """The micro-batch sizes to try, largest first: the one given, or the divisors of the rank's batch up to 8."""
    if requested != "auto":
        return [requested]
    return [m for m in range(min(LARGEST_MICRO_BATCH, batch_per_rank), 0, -1) if batch_per_rank % m == 0]


def cpu_plan(batch_per_rank: int, requested: dict, adapters: bool = False) -> Plan:
    """Today's values where there is no GPU memory to size: what is given, else micro-batch 8 (or the largest divisor
    of the batch below it), no checkpointing, the reference where the model is, vLLM's share 0.3 (unused: the CPU
    build's engine takes a KV cache for the sampler batch, cpu_kv_cache_bytes)."""
    pick = lambda name, default: default if requested.get(name, "auto") == "auto" else requested[name]  # noqa: E731
    plan = Plan(
        micro_batch_size=micro_batch_candidates(batch_per_rank, requested.get("micro_batch_size", "auto"))[0],
        gradient_checkpointing=pick("gradient_checkpointing", False),
        reference_on_device=pick("reference_on_device", True),
        vllm_gpu_memory_utilization=pick("vllm_gpu_memory_utilization", 0.3),
        sampler_batch_tokens=pick("sampler_batch_tokens", CPU_SAMPLER_TOKENS),
        adapters=adapters,
    )
    return dataclasses.replace(plan, line=f"memory: {describe(plan)} (CPU: no sizing)")


def cpu_kv_cache_bytes(shape: ModelShape, positions: int, element: int, free: int | None, ranks: int = 1) -> int:
    """The KV cache of the vLLM CPU build's engine, in whole GiB as VLLM_CPU_KVCACHE_SPACE gives it: the keys and
    values of `positions` (the sampler batch, --sampler-batch-tokens) in the engine's dtype (element: 4 for fp32, 2
    for bf16), at least 1 GiB, at most this rank's share of the `free` memory (bytes, None: unknown; `ranks` engines
    share the machine) less the margin of 1 GiB. A cache below the batch makes vLLM run fewer sequences at once.
    Raises UsageError where not even 1 GiB is free.

    >>> smollm2 = ModelShape(134515008, 30, 576, 1536, 49152, 9, 3)
    >>> cpu_kv_cache_bytes(smollm2, 65536, 4, 20 * GiB) // GiB, cpu_kv_cache_bytes(smollm2, 65536, 2, 20 * GiB) // GiB
    (3, 2)
    """
    wanted = max(1, math.ceil(positions * kv_bytes_per_position(shape, element) / GiB))
    if free is None:
        return wanted * GiB
    room = int((free / ranks - GiB) // GiB)
    if room < 1:
        raise UsageError(
            f"the vLLM engine's KV cache needs 1 GiB beside the trainer, and {free / GiB:.1f} GiB of memory is free"
            + (f" for {ranks} ranks" if ranks > 1 else "")
            + ": free some memory, or use --backend hf"
        )
    return min(wanted, room) * GiB


def describe(plan: Plan, backend: str = "hf") -> str:
    """The plan in words, with the knob of the rollout engine that runs (vLLM's share, or the HF sampler's batch)."""
    engine = (
        f"vLLM share {plan.vllm_gpu_memory_utilization:.2f}"
        if backend == "vllm"
        else f"sampler batch {plan.sampler_batch_tokens:,} positions"
    )
    return (
        f"micro-batch {plan.micro_batch_size}, checkpointing {'on' if plan.gradient_checkpointing else 'off'}, "
        + (
            "reference: the base (adapters off)"
            if plan.adapters
            else f"reference on {'device' if plan.reference_on_device else 'CPU (pinned)'}"
        )
        + f", {engine}"
    )


def plan(
    shape: ModelShape,
    *,
    total: int,
    free: int,
    context: int,
    batch_per_rank: int,
    backend: str,
    beta: float,
    requested: dict,
    second_model: bool = False,
    fsdp_ranks: int = 1,
    element: int = 2,
    adapters: int = 0,
) -> Plan:
    """The memory knobs for one GPU with `total` bytes of which `free` are free, by the formula of this module's
    docstring. `requested`: the command line's values ("auto" or a value, which is kept). backend: the rollout engine
    ("hf" or "vllm"). second_model: a second model trained in full beside the policy, with its own AdamW (a
    second copy of the training state and activations). element: bytes
    of a bf16/fp16 value (2), or 4 where the GPU computes in fp32. adapters: LoRA's trainable parameters
    (adapter_params; 0: full fine-tuning). Raises UsageError when nothing fits."""
    P, copies = shape.params, 2 if second_model else 1
    margin = 0.05 * total + GiB
    sharded = fsdp_ranks > 1
    # (training state, resident during rollout: weights + AdamW, autocast's bf16 weight copies during a pass) of a
    # model trained in full, and of the policy: with adapters, a frozen base of `element` bytes a parameter, the
    # adapters' fp32 weights, gradients and moments. A second model is trained in full either way (lora.plain_copy).
    full = (16 * P / fsdp_ranks, 12 * P / fsdp_ranks, (P / fsdp_ranks if sharded else P) * element)
    policy = (element * P + 16 * adapters, element * P + 12 * adapters, element * adapters) if adapters else full
    gathered = 4 * P if sharded else 0  # the whole model the sampler gathers
    state, resident_rollout, autocast_copies = (
        mine + (theirs if second_model else 0) + extra
        for mine, theirs, extra in zip(policy, full, (gathered, gathered, 0))
    )
    reference = 4 * P if beta > 0 and not adapters else 0  # with adapters: the policy with its adapters off

    # The no-grad passes (old log-probs, reference, a second model's) run while the engine is awake: vLLM's share must
    # leave them the reference (resident, or its copy visiting), autocast's weight copies, an LM-head chunk and a
    # pass of at least one full-context row (no_grad_pass_bytes).
    per_position, once = no_grad_pass_bytes(shape, element, context, sharded)
    if adapters and element == 2 and not second_model:
        once -= P * element  # a bf16 base: autocast copies no weights
    no_grad_reserve = reference + once + 4 * context * per_position  # `once` holds autocast's weight copies

    def rollout_room(reference_on_device: bool) -> float:
        return free - margin - resident_rollout - (reference if reference_on_device else 0)

    def engine_room() -> float:
        return free - margin - resident_rollout - no_grad_reserve

    def update_peak(micro: int, checkpointing: bool, reference_on_device: bool) -> float:
        # + 10 %: the allocator's fragmentation
        activations = copies * pass_bytes(shape, micro * context, checkpointing)
        return state + autocast_copies + (reference if reference_on_device else 0) + 1.1 * activations

    vllm_need = 2 * P + 2 * GiB + context * kv_bytes_per_position(shape)  # bf16 weights, warm-up, one full sequence
    want = lambda name: requested.get(name, "auto")  # noqa: E731
    options = lambda name, auto: auto if want(name) == "auto" else (want(name),)  # noqa: E731
    engine_fits = backend != "vllm" or want("vllm_gpu_memory_utilization") != "auto" or engine_room() >= vllm_need
    candidates = (
        (micro, checkpointing, on_device)  # in order of preference: see the module's docstring
        for checkpointing in options("gradient_checkpointing", (False, True))
        for micro in micro_batch_candidates(batch_per_rank, want("micro_batch_size"))
        for on_device in ((True,) if beta == 0 else options("reference_on_device", (True, False)))
    )
    chosen = next((c for c in candidates if engine_fits and update_peak(*c) <= free - margin), None)
    given = [
        name for name in ("micro_batch_size", "gradient_checkpointing", "reference_on_device") if want(name) != "auto"
    ]
    if chosen is None:
        smallest = update_peak(1, True, beta == 0)
        if given and smallest <= free - margin:  # the values given do not fit, but others would: keep them, warn
            chosen = (
                micro_batch_candidates(batch_per_rank, want("micro_batch_size"))[0],
                bool(want("gradient_checkpointing")) if want("gradient_checkpointing") != "auto" else True,
                bool(want("reference_on_device")) if want("reference_on_device") != "auto" else False,
            )
        else:
            need = max(smallest, (resident_rollout + no_grad_reserve + vllm_need) if backend == "vllm" else 0) + margin
            raise UsageError(
                f"this run needs about {need / GiB:.0f} GiB of GPU memory even with --micro-batch-size 1, "
                f"--gradient-checkpointing True and --reference-on-device False, and the GPU has {free / GiB:.0f} GiB "
                f"free of {total / GiB:.0f}: use a GPU with more memory, --fsdp over several GPUs (torchrun), "
                "a shorter "
                "--context, or --beta 0 (no reference model)"
                + ("" if adapters else ", or --lora-rank 16 (adapters on a frozen bf16 base, no reference copy)")
                + (", or --backend hf (no engine beside training)" if backend == "vllm" else "")
            )
    micro, checkpointing, on_device = chosen
    fits = update_peak(micro, checkpointing, on_device) <= free - margin
    if want("vllm_gpu_memory_utilization") != "auto":
        share = float(want("vllm_gpu_memory_utilization"))
    else:
        share = max(0.05, min(VLLM_SHARE_CAP, engine_room() / total))
        share = math.floor(share * 100) / 100
    if want("sampler_batch_tokens") != "auto":
        sampler_tokens = int(want("sampler_batch_tokens"))
    else:
        room = rollout_room(on_device) - autocast_copies - 256 * shape.vocab * 4 * 3  # + a step's logits for 256 rows
        sampler_tokens = int(max(context, min(room / (1.2 * kv_bytes_per_position(shape, element)), 256 * context)))
    peak = update_peak(micro, checkpointing, on_device)
    result = Plan(
        micro, checkpointing, on_device, share, sampler_tokens, round(peak / GiB, 1), fits, adapters=adapters > 0
    )
    note = f"; {', '.join('--' + n.replace('_', '-') for n in given)} as given" if given else ""
    return dataclasses.replace(
        result,
        line=(
            f"memory: {describe(result, backend)}; update peak ~{peak / GiB:.0f} GiB of {free / GiB:.0f} GiB free "
            f"(computed{note})"
        ),
    )


KNOBS = (
    "micro_batch_size",
    "gradient_checkpointing",
    "reference_on_device",
    "vllm_gpu_memory_utilization",
    "sampler_batch_tokens",
)


def size_run(
    args,
    device,
    precision: Precision,
    model_path: str,
    first_start: dict | None = None,
    second_model: bool = False,
) -> Plan:
    """The plan for every memory knob of `args` (a training script's Args) on this device: a value given on the command
    line is kept, an `auto` one is computed. `args` is not changed: main() takes the plan's settings (its .line is
    printed and recorded in RUN/starts.jsonl; args.json keeps "auto").

    precision: what main() chose (bf16 values are 2 bytes, fp32 ones 4). model_path: the model the run trains (its
    config gives the shape). first_start: the run's first starts.jsonl entry when resuming: its sampler batch is kept,
    so that a resumed run samples what the uninterrupted one would. second_model: the script trains a second model
    in full beside the policy (plan). Under torchrun every rank takes the same values,
    from the least free memory of any rank."""
    # Before the run directory is made and before AutoConfig reads the model: a local model directory that is not a
    # model, or that asks for custom code, is refused here on any device (models.model_directory_problem).
    if models.is_local_path(model_path) and (problem := models.model_directory_problem(model_path)):
        raise UsageError(f"cannot load model {model_path!r}: {problem}")
    if models.is_local_path(model_path) and lora.is_adapter_checkpoint(model_path):
        model_path = lora.base_record(Path(model_path))["model"]  # an adapter has no config: its base's shape
    requested = {name: getattr(args, name) for name in KNOBS}
    earlier = (first_start or {}).get("memory") or {}
    if requested["sampler_batch_tokens"] == "auto" and isinstance(earlier.get("sampler_batch_tokens"), int):
        requested["sampler_batch_tokens"] = earlier["sampler_batch_tokens"]
    batch_per_rank = max(1, args.batch_size // distributed.world_size())
    device = torch.device(device)
    if device.type != "cuda":
        result = cpu_plan(batch_per_rank, requested, adapters=getattr(args, "lora_rank", 0) > 0)
    else:
        free, total = torch.cuda.mem_get_info(device)
        free = min(distributed.gather([free]))  # every rank must take the same micro-batches (collectives match)
        try:
            config = AutoConfig.from_pretrained(models.resolve_model(model_path), trust_remote_code=False)
        except (OSError, ValueError) as error:  # a Hub model that is unreachable offline, or needs its own code
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise UsageError(f"cannot read the config of model {model_path!r} ({shown(reason)})") from None
        shape = model_shape(config)
        rank = getattr(args, "lora_rank", 0)
        result = plan(
            shape,
            total=total,
            free=free,
            context=args.context,
            batch_per_rank=batch_per_rank,
            backend=vllm_preflight.resolve_backend(args.backend)[0],
            beta=args.beta,
            requested=requested,
            second_model=second_model,
            fsdp_ranks=distributed.world_size() if args.fsdp else 1,
            element=2 if device.type in precision.bf16 else 4,
            adapters=adapter_params(shape, rank, args.lora_target) if rank else 0,
        )
    distributed.print0(result.line)
    if not result.fits:
        warnings.warn(
            f"the memory settings given may not fit ({result.line}); if the update runs out of memory, "
            "leave them at auto"
        )
    return result
