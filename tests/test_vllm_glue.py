"""Contract test for the vLLM glue in plumbing/vllm_engine.py (VLLMSampler).

vLLM cannot run here: it needs a GPU and is not installed. This test puts a small
fake `vllm` module in sys.modules instead. The fake exposes only the names the glue
uses. Its signatures are strict (no **kwargs) and reuse the parameter names and
defaults of vllm==0.30.0 (the pin in requirements-vllm.txt; tests/test_vllm_source.py
checks the fake against that version's real source):
  LLM.__init__ / generate / collective_rpc / reset_prefix_cache / sleep / wake_up /
      get_tokenizer                 vllm/entrypoints/llm.py
  max_model_len, enable_prefix_caching, enable_sleep_mode
                                    EngineArgs fields, vllm/engine/arg_utils.py
  SamplingParams(n, seed)           child i of a request is seeded with seed + i (v1/engine/parallel_sampling.py);
                                    with no script, the fake samples from that seed, or unseeded from fresh entropy
  SamplingParams fields             vllm/sampling_params.py
  TokensPrompt                      vllm/inputs/llm.py
  CompletionOutput, RequestOutput   vllm/outputs.py
  Worker.reload_weights             vllm/v1/worker/gpu_worker.py -> gpu_model_runner.py
  tensor_parallel_size, distributed_executor_backend
                                    LLM.__init__ / EngineArgs fields; "external_launcher" is
                                    vllm/v1/executor/uniproc_executor.py ExecutorWithExternalLauncher
If the glue renames a keyword or drops one, a call here fails with TypeError.
The fake keeps the engine's memory as 0.30 does: sleep(level) releases the "weights" and "kv_cache" tags
(v1/executor/abstract.py Executor.sleep, ignored while any tag sleeps), level 2 discards the weights (nothing
copied to the host), wake_up(tags) maps the named tags again, and generate needs every tag awake. What it
samples depends on the weights it holds (the digest of the last reload), so weights that were discarded and
not reloaded, or reloaded with other values, show in the samples.
Built with distributed_executor_backend="external_launcher" it checks what ExecutorWithExternalLauncher needs
from torchrun (RANK, LOCAL_RANK, MASTER_ADDR/PORT, an initialised torch.distributed world) and, like it, takes
part in a collective while it is built (every rank must build its engine at the same point).
The fake also reproduces how 0.30 handles stop strings (v1/engine/detokenizer.py):
token_ids keep the token(s) that complete the stop string, finish_reason is "stop",
and stop_reason is the matched string.
"""

import hashlib
import logging
import math
import os
import random
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, TypedDict

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from plumbing import distributed, engines, precision, rollout_correction, training, vllm_preflight
from plumbing.engines import Completion, VLLMSampler, cut_at_stop
from plumbing.training import reseed

# ----------------------------------------------------------------------------- tokenizer
# Word-level vocab whose decoder simply concatenates token strings, so decoded text
# positions are easy to reason about. No download.
VOCAB = [
    "<eos>",
    "<unk>",
    "The",
    " answer",
    " is",
    " 42",
    ".",
    "\n\n",
    "Q",
    ":",
    " 2",
    "+",
    "=",
    " 4",
    "</s",
    "olution>",
    "</solution>",
    "x",
]
T = {t: i for i, t in enumerate(VOCAB)}
EOS = T["<eos>"]


def make_tokenizer():
    tk = Tokenizer(models.WordLevel(vocab=T, unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


def ids(*tokens):
    return [T[t] for t in tokens]


# ----------------------------------------------------------------------------- fake vllm
class FakeTokensPrompt(TypedDict):  # vllm/inputs/llm.py TokensPrompt (TypedDict)
    prompt_token_ids: list[int]


class FakeSamplingParams:
    # Names and defaults match vllm 0.30.0 SamplingParams for the fields the glue sets.
    # The checks are a subset of SamplingParams._verify_args.
    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | None = 16,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
    ):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        if any(not s for s in stop):
            raise ValueError("stop cannot contain an empty string.")
        if temperature == 0.0 and n > 1:
            raise ValueError("n must be 1 when using greedy sampling")
        self.n, self.temperature, self.top_p, self.max_tokens, self.stop = n, temperature, top_p, max_tokens, stop
        self.seed = None if seed == -1 else seed
        if logprobs is not None and logprobs < -1:
            raise ValueError(f"logprobs must be non-negative or -1, got {logprobs}.")
        self.logprobs = logprobs


@dataclass
class FakeCompletionOutput:  # vllm/outputs.py CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: Any
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class FakeLogprob:  # vllm/logprobs.py Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeRequestOutput:  # vllm/outputs.py RequestOutput (the fields the glue may read)
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[FakeCompletionOutput]
    finished: bool = True


class FakeWorker:
    """Checks what a weight sync means, as the engine's model.load_weights would take it: every name is an
    HF checkpoint name of the engine's model (a tied lm_head never comes separately), with its shape, in
    the engine's dtype, each exactly once; the iterator is consumed lazily and holds one tensor at a time."""

    def __init__(self, log, expected=None, dtype=None):
        self.log = log
        self.expected = expected  # {name: shape} of the engine's model, or None to record only
        self.dtype = dtype
        self.sleeping_tags: set[str] = set()  # Executor.sleeping_tags: memory released by sleep, not yet woken
        # What the weights hold: None, as loaded from the model path; DISCARDED after a level-2 sleep; else the
        # digest of the weights the last reload_weights wrote.
        self.weights_state: str | None = None
        self.failed_layers: list[str] = []  # layers (class names) whose weights a reload fails to load

    # vllm/v1/worker/gpu_worker.py Worker.reload_weights forwards to
    # GPUModelRunner.reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)
    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format: bool = True):
        assert not isinstance(weights_iterator, (list, tuple, dict)), "weights must stream, not be materialised"
        # On a GPU this writes into unmapped memory (the weights' pool is asleep): a crash, or nothing kept.
        assert "weights" not in self.sleeping_tags, (
            "reload_weights while the weights sleep: wake_up(tags=['weights']) first"
        )
        received, previous = [], None
        for name, tensor in weights_iterator:
            # The glue keeps no reference to a tensor it has handed over: no second copy of the model builds up.
            assert previous is None or previous() is None, f"{name}: the previous tensor is still alive"
            if self.expected is not None:
                assert name in self.expected, f"{name} is not a checkpoint name of the engine's model"
                assert tuple(tensor.shape) == self.expected[name], f"{name}: shape {tuple(tensor.shape)}"
                assert tensor.dtype == self.dtype, f"{name}: {tensor.dtype}, engine runs {self.dtype}"
            assert not tensor.requires_grad
            received.append((name, tensor.clone()))
            previous = weakref.ref(tensor)
            del tensor
        names = [n for n, _ in received]
        assert len(set(names)) == len(names), "a weight was sent twice"
        if self.expected is not None:
            assert set(names) == set(self.expected), f"missing: {sorted(set(self.expected) - set(names))}"
        self.log.append(("reload_weights", received, weights_path, is_checkpoint_format))
        self.weights_state = weights_digest(received)
        # model_loader/reload/layerwise.py finalize_layerwise_processing: a warning for each layer that loaded
        # nothing (RoPE's cache; a tied head, its weight sent as the embedding's), and for any in failed_layers
        tied = "lm_head.weight" not in names
        for layer in ["RotaryEmbedding", *(["ParallelLMHead"] if tied else []), *self.failed_layers]:
            logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
                "%s: Failed to load weights", layer
            )


DISCARDED = "discarded"


def weights_digest(weights: list[tuple[str, torch.Tensor]]) -> str:
    """A digest of named tensors (their names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in weights:
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


@dataclass
class FakeEngine:
    """State shared by the fake module; `script(prompt_ids, index)` yields the tokens the
    'model' would sample for sample `index` of that prompt (None: random tokens, from the
    sample's seed when the request has one)."""

    script: Any = None
    reset_ok: bool = True  # what reset_prefix_cache returns (False: blocks still in use)
    weights: Any = None  # {name: shape} the engine's model loads, checked by FakeWorker
    # the log-prob the 'model' samples token `token` with at response position `position` (processed_logprobs)
    logprob: Any = lambda prompt, position, token: -(1 + token % 5) / 10
    log: list = field(default_factory=list)
    llm: Any = None


def make_fake_vllm(engine: FakeEngine, tokenizer=None):
    """The fake `vllm` module; `tokenizer`: the engine's (get_tokenizer, stop strings, EOS; default
    make_tokenizer())."""
    tok = tokenizer or make_tokenizer()
    eos = tok.eos_token_id

    class FakeLLM:
        def __init__(
            self,
            model: str,
            *,
            tensor_parallel_size: int = 1,
            dtype: str = "auto",
            seed: int = 0,
            gpu_memory_utilization: float = 0.92,
            enforce_eager: bool = False,
            max_model_len: int | None = None,
            enable_prefix_caching: bool | None = None,
            enable_sleep_mode: bool = False,
            distributed_executor_backend: str | None = None,
            trust_remote_code: bool = False,
            logprobs_mode: str = "raw_logprobs",
            kv_cache_memory_bytes: int | None = None,
            enable_chunked_prefill: bool | None = None,
        ):
            # In-process engine core is required for passing tensors through collective_rpc.
            assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
            engine.log.append(
                (
                    "LLM",
                    model,
                    dict(
                        seed=seed,
                        dtype=dtype,
                        gpu_memory_utilization=gpu_memory_utilization,
                        max_model_len=max_model_len,
                        enable_prefix_caching=enable_prefix_caching,
                        enable_sleep_mode=enable_sleep_mode,
                        enforce_eager=enforce_eager,
                        tensor_parallel_size=tensor_parallel_size,
                        distributed_executor_backend=distributed_executor_backend,
                        trust_remote_code=trust_remote_code,
                        logprobs_mode=logprobs_mode,
                        kv_cache_memory_bytes=kv_cache_memory_bytes,
                        enable_chunked_prefill=enable_chunked_prefill,
                    ),
                )
            )
            engine.log.append(("world", self._join_world(distributed_executor_backend, tensor_parallel_size)))
            # What the GPU worker sets for the whole process: Worker.__init__ the float32 matmul precision
            # (VLLM_FLOAT32_MATMUL_PRECISION, default "highest"), compile_or_warm_up_model one torch thread for serving
            # unless the user set OMP_NUM_THREADS (utils/torch_utils.py set_torch_threads_for_runtime)
            torch.set_float32_matmul_precision("highest")
            if "OMP_NUM_THREADS" not in os.environ:
                torch.set_num_threads(1)
            self.max_model_len = max_model_len
            self.enable_sleep_mode = enable_sleep_mode
            self.worker = FakeWorker(engine.log, engine.weights, getattr(torch, dtype, None))
            engine.llm = self

        @staticmethod
        def _join_world(backend, tensor_parallel_size) -> dict:
            """What 0.30's executors need of the process: ExecutorWithExternalLauncher reads RANK and LOCAL_RANK
            and joins "env://"; init_distributed_environment reuses an initialised torch.distributed world (else
            it would start one of size tensor_parallel_size x ... at rank RANK). The single-process executor
            under torchrun would put every rank's engine on cuda:0 (UniProcExecutor._distributed_args)."""
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            if backend != "external_launcher":
                assert world == 1, (
                    f"a single-process engine in a torch.distributed world of {world}: use external_launcher"
                )
                return {"world_size": world}
            missing = [v for v in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            assert not missing, f"external_launcher outside torchrun: no {missing}"
            assert dist.is_initialized(), "external_launcher before torch.distributed is initialised"
            assert world % tensor_parallel_size == 0
            # Building the engine is collective (new_group for vLLM's groups; the minimum free memory over ranks).
            free = torch.tensor([int(os.environ["RANK"]) + 1])
            dist.all_reduce(free, op=dist.ReduceOp.MIN, group=dist.new_group(backend="gloo"))
            return {
                "world_size": world,
                "rank": int(os.environ["RANK"]),
                "local_rank": int(os.environ["LOCAL_RANK"]),
                "torch_rank": dist.get_rank(),
                "min_over_ranks": int(free),
            }

        def get_tokenizer(self):
            return tok

        def generate(
            self,
            prompts,
            sampling_params=None,
            *,
            use_tqdm=True,
            lora_request=None,
            priority=None,
            tokenization_kwargs=None,
            mm_processor_kwargs=None,
        ):
            assert not self.worker.sleeping_tags, f"generate while {sorted(self.worker.sleeping_tags)} sleep"
            assert self.worker.weights_state != DISCARDED, "generate with the weights a level-2 sleep discarded"
            engine.log.append(("generate", prompts, sampling_params, use_tqdm))
            if not isinstance(sampling_params, list):
                sampling_params = [sampling_params] * len(prompts)
            assert len(sampling_params) == len(prompts)
            results = []
            for rid, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
                assert isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}
                p = prompt["prompt_token_ids"]
                assert all(isinstance(t, int) for t in p)
                assert len(p) < self.max_model_len
                outs = [self._run(p, i, sp) for i in range(sp.n)]
                results.append(FakeRequestOutput(str(rid), None, p, outs))
            return results

        def _run(self, p, index, sp):
            # Step-by-step emulation of V1 stopping: EOS, stop string (checked on the
            # decoded text; token ids are NOT trimmed), max_tokens / max_model_len.
            out, finish, reason = [], None, None
            seed = None if sp.seed is None else sp.seed + index  # v1/engine/parallel_sampling.py
            # A sample follows from the prompt, the weights and the seed (greedy: no seed); unseeded: fresh entropy.
            if sp.temperature == 0:
                source = f"greedy/{p}/{self.worker.weights_state}"
            else:
                source = None if seed is None else f"{seed}/{p}/{self.worker.weights_state}"
            for t in engine.script(p, index) if engine.script else self._random_tokens(source):
                out.append(t)
                text = tok.decode(out, skip_special_tokens=True)
                if t == eos:
                    finish = "stop"
                elif hits := [s for s in sp.stop if s in text]:
                    finish, reason = "stop", min(hits, key=lambda s: text.find(s) + len(s))
                    text = text[: text.find(reason)]
                elif len(out) >= sp.max_tokens or len(p) + len(out) >= self.max_model_len:
                    finish = "length"
                if finish:
                    # logprobs=k: per token, {id: Logprob} holding the sampled token and the k most likely others
                    logprobs = None
                    if sp.logprobs is not None:
                        logprobs = [{t: FakeLogprob(engine.logprob(p, j, t), 1)} for j, t in enumerate(out)]
                    return FakeCompletionOutput(index, text, list(out), None, logprobs, finish, reason)
            raise AssertionError("script ran out of tokens")

        @staticmethod
        def _random_tokens(source):
            rng = random.Random(source)  # None: fresh entropy, as an unseeded request draws from state no one resets
            while True:
                yield eos if rng.random() < 0.1 else rng.randrange(2, len(tok))

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            assert isinstance(method, str)
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]

        def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
            engine.log.append(("reset_prefix_cache",))
            return engine.reset_ok

        def sleep(self, level: int = 1, mode: str = "abort"):
            assert self.enable_sleep_mode
            if self.worker.sleeping_tags:  # Executor.sleep: "Executor is already sleeping", nothing released
                engine.log.append(("sleep ignored", level, mode))
                return
            engine.log.append(("sleep", level, mode))
            self.worker.sleeping_tags = {"weights", "kv_cache"}
            if level == 2:  # CuMemBackend.suspend: level 1 offloads the weights to the host, level 2 nothing
                self.worker.weights_state = DISCARDED

        def wake_up(self, tags: list[str] | None = None):
            # Executor.wake_up: only tags that sleep (one that does not: a warning, nothing woken); None: all.
            if not self.worker.sleeping_tags or (tags and not set(tags) <= self.worker.sleeping_tags):
                engine.log.append(("wake_up ignored", tags))
                return
            engine.log.append(("wake_up", tags))
            self.worker.sleeping_tags -= set(tags) if tags else self.worker.sleeping_tags

    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams, mod.TokensPrompt = FakeLLM, FakeSamplingParams, FakeTokensPrompt
    mod.__version__ = "0.30.0"
    return mod


@pytest.fixture
def engine(monkeypatch):
    eng = FakeEngine()
    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm(eng))
    # the glue sets these; monkeypatch restores the original environment afterwards
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    # the fake is no installed distribution (test_gpu_preflight.py)
    monkeypatch.setattr(vllm_preflight, "vllm_build", lambda: None)
    threads, matmul_precision = torch.get_num_threads(), torch.get_float32_matmul_precision()
    yield eng
    torch.set_num_threads(threads)  # what the fake engine set, whatever VLLMSampler did
    torch.set_float32_matmul_precision(matmul_precision)


def calls(eng, name):
    return [c for c in eng.log if c[0] == name]


def cycle(*tokens):
    while True:
        yield from tokens


# ----------------------------------------------------------------------------- tests
def test_constructor(engine, monkeypatch):
    monkeypatch.setattr(precision, "gpu_has_bf16", lambda: True)
    s = VLLMSampler("/ckpt/model", seed=7, max_model_len=64, gpu_memory_utilization=0.3)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    [(_, model, kw)] = calls(engine, "LLM")
    assert model == "/ckpt/model"
    assert kw == dict(
        seed=7,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        max_model_len=64,
        enable_prefix_caching=True,
        enable_sleep_mode=True,
        enforce_eager=False,
        tensor_parallel_size=1,
        # one process: vLLM's own executor
        distributed_executor_backend=None,
        trust_remote_code=False,
        # the log-probs it reports are after temperature, as the trainer's (the default is before)
        logprobs_mode="processed_logprobs",
        # a GPU engine sizes its KV cache from gpu_memory_utilization and chunks long prefills as vLLM does (only
        # the CPU build's engine is given a KV cache and whole prefills)
        kv_cache_memory_bytes=None,
        enable_chunked_prefill=None,
    )
    assert calls(engine, "world") == [("world", {"world_size": 1})]
    assert s.tokenizer is engine.llm.get_tokenizer()

    VLLMSampler("m", max_model_len=64, enforce_eager=True)
    assert calls(engine, "LLM")[-1][2]["enforce_eager"] is True


def test_engine_dtype_follows_the_gpu(engine, monkeypatch):
    # A V100 or T4 only emulates bf16 (vLLM refuses bfloat16 there): the engine runs float16, and the weights go over
    # in float16. An explicit dtype wins.
    monkeypatch.setattr(precision, "gpu_has_bf16", lambda: False)
    s = VLLMSampler("m", max_model_len=64)
    assert calls(engine, "LLM")[-1][2]["dtype"] == "float16" and s.weight_dtype == torch.float16
    VLLMSampler("m", max_model_len=64, dtype="bfloat16")
    assert calls(engine, "LLM")[-1][2]["dtype"] == "bfloat16"


def test_token_id_prompts_n_and_context_clamp(engine):
    engine.script = lambda p, i: cycle(T["x"])
    s = VLLMSampler("m", max_model_len=64)
    prompts = [[T["Q"]] * 5, [T["Q"]] * 14, [T["Q"]] * 18]
    out = s.sample(prompts, 3, temperature=0.9, top_p=0.95, max_new_tokens=10, context=20, stop=["\n\nQ:"])
    [(_, sent, params, use_tqdm)] = calls(engine, "generate")
    assert sent == [{"prompt_token_ids": p} for p in prompts]
    assert use_tqdm is False
    assert [sp.max_tokens for sp in params] == [10, 6, 2]  # min(max_new_tokens, context - len)
    assert all((sp.n, sp.temperature, sp.top_p, sp.stop) == (3, 0.9, 0.95, ["\n\nQ:"]) for sp in params)
    assert [[len(c.ids) for c in row] for row in out] == [[10] * 3, [6] * 3, [2] * 3]
    assert all(c.finish_reason == "length" for row in out for c in row)

    s.sample(prompts[:1], 2, temperature=1.0, top_p=1.0, max_new_tokens=12)  # no context
    assert [sp.max_tokens for sp in calls(engine, "generate")[-1][2]] == [12]

    s.sample(prompts, 1, temperature=1.0, top_p=1.0, max_new_tokens=[3, 9, 9], context=20)  # one budget per prompt
    assert [sp.max_tokens for sp in calls(engine, "generate")[-1][2]] == [3, 6, 2]


def test_sampled_log_probs_travel_through_the_sampler_to_the_metric(engine):
    # top_p = 1: each token's log-prob as vLLM sampled it (logprobs=0: the sampled token only), cut with the ids at a
    # stop string; from there to the training sample and the sampler-vs-trainer metrics.
    engine.script = lambda p, i: iter(ids(" 2", "+", " 2", "\n\n", "Q", ":") + [T["x"]] * 8)
    s = VLLMSampler("m", max_model_len=64)
    [[c]] = s.sample([[T["Q"]] * 3], 1, temperature=0.7, top_p=1.0, max_new_tokens=10, stop=["\n\nQ:"])
    assert calls(engine, "generate")[-1][2][0].logprobs == 0
    assert c.ids == ids(" 2", "+", " 2") and c.finish_reason == "stop"
    assert c.logprobs == [engine.logprob(None, j, t) for j, t in enumerate(c.ids)]
    sample = training.new_sample([T["Q"]] * 3, c)
    assert torch.equal(sample["sampler_logps"], torch.tensor(c.logprobs))
    # The trainer puts the first token 0.25 higher, the second 0.05 lower, the third where the sampler did.
    sample["old_logps"] = sample["sampler_logps"] + torch.tensor([0.25, -0.05, 0.0])
    sample["loss_mask"], sample["entropy"] = torch.ones(3, dtype=torch.bool), torch.tensor([1.0, 2.0, 3.0])
    metrics = rollout_correction.rollout_metrics([sample])
    assert metrics["sampler/logp_gap_mean"] == pytest.approx(0.1)
    assert metrics["sampler/logp_gap_max"] == pytest.approx(0.25)
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731
    assert metrics["sampler/kl_per_token"] == pytest.approx((k3(0.25) + k3(-0.05)) / 3)
    assert metrics["policy/entropy"] == pytest.approx(2.0)

    # top_p < 1: vLLM's processed log-probs are renormalised over the nucleus it drew from: asked for all the same,
    # kept with the top_p they are relative to, and held against the trainer's log-probs renormalised over the
    # nucleus it rebuilds (nucleus_logps), never its whole-vocabulary old_logps.
    [[c]] = s.sample([[T["Q"]] * 3], 1, temperature=0.7, top_p=0.9, max_new_tokens=4)
    assert calls(engine, "generate")[-1][2][0].logprobs == 0
    assert c.logprobs == [engine.logprob(None, j, t) for j, t in enumerate(c.ids)] and c.logprobs_top_p == 0.9
    sample = training.new_sample([T["Q"]] * 3, c)
    assert torch.equal(sample["sampler_logps"], torch.tensor(c.logprobs)) and sample["sampler_top_p"] == 0.9
    # Over its nucleus the trainer puts the first token 0.25 higher, the second where the sampler did, the fourth 0.1
    # lower, and the third outside its nucleus (-inf: a near tie at the edge): a gap of 10 nats, the clip.
    sample["nucleus_logps"] = sample["sampler_logps"] + torch.tensor([0.25, 0.0, -math.inf, -0.1])
    sample["old_logps"] = sample["sampler_logps"] - 3.0  # the whole vocabulary's: not what is compared
    sample["loss_mask"], sample["entropy"] = torch.ones(4, dtype=torch.bool), torch.ones(4)
    metrics = rollout_correction.rollout_metrics([sample])
    assert metrics["sampler/logp_gap_mean"] == pytest.approx((0.25 + 10.0 + 0.1) / 4)
    assert metrics["sampler/logp_gap_max"] == pytest.approx(10.0)
    assert metrics["sampler/kl_per_token"] == pytest.approx((k3(0.25) + k3(-10.0) + k3(-0.1)) / 4)
    assert metrics["sampler/outside_nucleus_fraction"] == pytest.approx(1 / 4)
    # with the top_p 1 sample beside it: both compared, the fraction over the nucleus's tokens alone
    plain = training.new_sample([T["Q"]] * 3, Completion(ids(" 2", "+"), "stop", [-0.5, -0.5]))
    plain |= {"old_logps": plain["sampler_logps"] + 0.5, "loss_mask": torch.ones(2, dtype=torch.bool)}
    metrics = rollout_correction.rollout_metrics([sample, plain])
    assert metrics["sampler/logp_gap_mean"] == pytest.approx((0.25 + 10.0 + 0.1 + 2 * 0.5) / 6)
    assert metrics["sampler/outside_nucleus_fraction"] == pytest.approx(1 / 4)
    assert "sampler/outside_nucleus_fraction" not in rollout_correction.rollout_metrics([plain])


def test_prompts_without_room_get_empty_length_completions(engine):
    # Same as HFSampler: no room -> n empty "length" completions. Such prompts are
    # never sent to vLLM, which needs max_tokens >= 1 and prompt length < max_model_len.
    engine.script = lambda p, i: cycle(T["x"])
    s = VLLMSampler("m", max_model_len=32)
    prompts = [[T["Q"]] * 20, [T["Q"]] * 4, [T["Q"]] * 40]
    out = s.sample(prompts, 2, temperature=1.0, top_p=1.0, max_new_tokens=8, context=20)
    assert [[(c.ids, c.finish_reason) for c in row] for row in out] == [
        [([], "length")] * 2,
        [([T["x"]] * 8, "length")] * 2,
        [([], "length")] * 2,
    ]
    [(_, sent, params, _)] = calls(engine, "generate")
    assert sent == [{"prompt_token_ids": prompts[1]}] and [sp.max_tokens for sp in params] == [8]

    # without `context`, max_model_len is the limit
    out = s.sample([[T["Q"]] * 28], 1, temperature=1.0, top_p=1.0, max_new_tokens=8)
    assert [sp.max_tokens for sp in calls(engine, "generate")[-1][2]] == [4]
    assert len(out[0][0].ids) == 4

    n_calls = len(calls(engine, "generate"))
    assert s.sample([[T["Q"]] * 32], 3, temperature=1.0, top_p=1.0, max_new_tokens=8) == [
        [Completion([], "length")] * 3
    ]
    assert s.sample([], 4, temperature=1.0, top_p=1.0, max_new_tokens=8) == []
    assert len(calls(engine, "generate")) == n_calls  # nothing to do: vLLM not called


def test_progress_turns_on_vllm_progress_bar(engine):
    engine.script = lambda p, i: iter([EOS])
    s = VLLMSampler("m", max_model_len=64)
    s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4, progress="rollouts")
    assert calls(engine, "generate")[-1][3] is True


def test_completions_map_back_to_their_prompt_in_order(engine):
    # sample i of the prompt starting with token a emits: a, then i copies of "x", then EOS
    engine.script = lambda p, i: iter([p[0]] + [T["x"]] * i + [EOS])
    s = VLLMSampler("m", max_model_len=64)
    prompts = [ids("The", " is"), ids(" 2", "+"), ids("Q")]
    out = s.sample(prompts, 4, temperature=1.0, top_p=1.0, max_new_tokens=16)
    assert len(out) == 3 and all(len(row) == 4 for row in out)
    for p, row in zip(prompts, out):
        for i, c in enumerate(row):
            assert isinstance(c, Completion)
            assert c.ids == [p[0]] + [T["x"]] * i + [EOS]  # ends with EOS: model stopped itself
            assert c.finish_reason == "stop"


def test_stop_strings_are_cut_and_finish_reasons(engine):
    answer = ids("The", " answer", " is", " 42", ".")
    scripts = {
        # stop string spread over three tokens; vLLM keeps all three in token_ids
        0: answer + ids("\n\n", "Q", ":", "x", "x"),
        # model ends itself: EOS is kept
        1: answer + [EOS],
        # never stops: cut by max_tokens
        2: ids(" 2", "+", " 2", "=", " 4") * 10,
        # stop string split across tokens "</s" + "olution>"
        3: answer + ids("</s", "olution>", "x"),
        # stop string as a single token
        4: answer + ids("</solution>", "x"),
    }
    engine.script = lambda p, i: iter(scripts[i])
    s = VLLMSampler("m", max_model_len=64)
    stop = ["\n\nQ:", "</solution>"]
    [row] = s.sample([ids("Q", ":")], 5, temperature=1.0, top_p=1.0, max_new_tokens=12, stop=stop)

    assert (row[0].ids, row[0].finish_reason) == (answer, "stop")
    assert (row[1].ids, row[1].finish_reason) == (answer + [EOS], "stop")
    assert (row[2].ids, row[2].finish_reason) == (scripts[2][:12], "length")
    assert (row[3].ids, row[3].finish_reason) == (answer, "stop")
    assert (row[4].ids, row[4].finish_reason) == (answer, "stop")
    tok = make_tokenizer()
    for c in row:
        text = tok.decode(c.ids, skip_special_tokens=True)
        assert not any(s_ in text for s_ in stop)
        # the glue's output agrees with cut_at_stop, the HF sampler's own cut rule
        assert cut_at_stop(tok, c.ids, stop) == (c.ids, False)


def test_stop_string_on_last_allowed_token_is_stop_not_length(engine):
    engine.script = lambda p, i: iter(ids("The", "\n\n", "Q", ":", "x"))
    s = VLLMSampler("m", max_model_len=64)
    [[c]] = s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4, stop=["\n\nQ:"])
    assert (c.ids, c.finish_reason) == (ids("The"), "stop")


def test_without_stop_strings_ids_are_returned_verbatim(engine):
    engine.script = lambda p, i: iter(ids("The", "\n\n", "Q", ":") + [EOS])
    s = VLLMSampler("m", max_model_len=64)
    [[c]] = s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=8)
    assert (c.ids, c.finish_reason) == (ids("The", "\n\n", "Q", ":") + [EOS], "stop")
    assert calls(engine, "generate")[0][2][0].stop == []


class TinyLM(torch.nn.Module):
    """HF-like naming, with tied input/output embeddings."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(len(VOCAB), 8)
        self.model.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.model.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, len(VOCAB), bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def test_load_weights_pushes_every_parameter_then_resets_prefix_cache(engine):
    lm = TinyLM()  # fp32 master weights, as training keeps them
    engine.weights = {name: tuple(p.shape) for name, p in lm.named_parameters()}
    s = VLLMSampler("m", max_model_len=64, dtype="bfloat16")
    s.load_weights(lm)
    names = [c[0] for c in engine.log if c[0] in ("reload_weights", "reset_prefix_cache")]
    assert names == ["reload_weights", "reset_prefix_cache"]
    [(_, pushed, weights_path, is_ckpt)] = calls(engine, "reload_weights")
    assert weights_path is None and is_ckpt is True
    expected = dict(lm.named_parameters())
    assert [n for n, _ in pushed] == list(expected)
    assert "lm_head.weight" not in expected  # tied: sent once, as model.embed_tokens.weight
    assert "model.layers.1.weight" in expected and "model.norm.bias" in expected
    for name, t in pushed:
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[name].detach().to(torch.bfloat16))

    # a torch.compile'd model (OptimizedModule keeps the original as `_orig_mod`)
    class Compiled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    s.load_weights(Compiled(lm))
    assert [n for n, _ in calls(engine, "reload_weights")[-1][1]] == list(expected)
    assert len(calls(engine, "reset_prefix_cache")) == 2

    engine.reset_ok = False  # vLLM could not drop the stale KV blocks: fail loudly
    with pytest.raises(RuntimeError):
        s.load_weights(lm)


@pytest.mark.parametrize("tied,dtype", [(False, "bfloat16"), (True, "bfloat16"), (False, "float32")])
def test_load_weights_sends_the_checkpoint_names_shapes_and_engine_dtype(engine, tmp_path, tied, dtype):
    # vLLM's loader takes the names and shapes a checkpoint directory holds: what save_pretrained wrote.
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as checkpoint:
        engine.weights = {name: tuple(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys()}
    assert ("lm_head.weight" in engine.weights) == (not tied)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    s = VLLMSampler(str(tmp_path), max_model_len=64, dtype=dtype)
    s.load_weights(model)  # FakeWorker asserts names, shapes, dtype, each once, streamed
    [(_, pushed, _, _)] = calls(engine, "reload_weights")
    assert {t.dtype for _, t in pushed} == {getattr(torch, dtype)}

    engine.llm.worker.expected = {**engine.weights, "model.extra.weight": (1,)}  # a weight the glue never sends
    with pytest.raises(AssertionError, match="missing: \\['model.extra.weight'\\]"):
        s.load_weights(model)


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_a_reload_leaves_out_only_the_harmless_warnings(engine, tied, caplog):
    # vLLM warns "Failed to load weights" on every reload for RotaryEmbedding and a tied head, whose tensors are put
    # back as they were: left out of the log. The same warning for any other layer, or for an untied head, stays.
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    s = VLLMSampler("m", max_model_len=64)
    engine.llm.worker.failed_layers = ["QKVParallelLinear", *([] if tied else ["ParallelLMHead"])]
    with caplog.at_level(logging.WARNING):
        s.load_weights(model)
    warned = [r.getMessage() for r in caplog.records if "Failed to load weights" in r.getMessage()]
    assert warned == ["QKVParallelLinear: Failed to load weights"] + (
        [] if tied else ["ParallelLMHead: Failed to load weights"]
    )
    assert not logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").filters  # only while reloading


def test_load_weights_never_holds_a_second_copy(engine):
    # The fake's worker checks that each tensor is freed before the next arrives; a glue that built a list
    # first (a full copy of the model in bf16 on the GPU) fails here.
    s = VLLMSampler("m", max_model_len=64)
    lm = TinyLM()
    materialised = [(n, p.detach().to(torch.bfloat16)) for n, p in lm.named_parameters()]
    with pytest.raises(AssertionError, match="still alive|must stream"):
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(materialised)})
    s.load_weights(lm)


def memory_calls(eng) -> list:
    """The engine's sleep / wake / weight-load calls, in order."""
    return [
        c[0] if c[0] in ("reload_weights", "reset_prefix_cache") else c
        for c in eng.log
        if c[0] in ("sleep", "sleep ignored", "wake_up", "wake_up ignored", "reload_weights", "reset_prefix_cache")
    ]


def test_sleep_discards_the_weights_and_wake_up_reloads_them_before_the_kv_cache(engine):
    # Level 2: the update overwrites the weights, so none is copied to the host. wake_up maps only the weights'
    # memory; load_weights fills it, then the KV cache comes back (not allocated while the weights load).
    engine.script = lambda p, i: iter([EOS])
    s, lm = VLLMSampler("m", max_model_len=64), TinyLM()
    s.sleep()
    s.sleep()  # idempotent
    assert memory_calls(engine) == [("sleep", 2, "abort")]
    with pytest.raises(RuntimeError, match="while asleep; call wake_up"):
        s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4)
    with pytest.raises(RuntimeError, match="while asleep; call wake_up"):
        s.load_weights(lm)
    s.wake_up()
    s.wake_up()
    assert memory_calls(engine)[1:] == [("wake_up", ["weights"])]
    with pytest.raises(RuntimeError, match="weights not reloaded since sleep"):  # the weights hold nothing yet
        s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4)
    s.load_weights(lm)
    assert memory_calls(engine)[2:] == ["reload_weights", ("wake_up", ["kv_cache"]), "reset_prefix_cache"]
    [[c]] = s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4)
    assert c.ids == [EOS]
    s.load_weights(lm)  # awake: a sync only
    assert memory_calls(engine)[5:] == ["reload_weights", "reset_prefix_cache"]


def test_sleep_after_a_wake_up_without_weights_releases_them_again(engine):
    # vLLM ignores sleep() while any of its memory sleeps (Executor.sleep): the KV cache wakes first, or the
    # weights woken for a load that never came would stay on the GPU through the update.
    s, lm = VLLMSampler("m", max_model_len=64), TinyLM()
    s.sleep()
    s.wake_up()
    s.sleep()
    assert memory_calls(engine) == [
        ("sleep", 2, "abort"),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
        ("sleep", 2, "abort"),
    ]
    s.wake_up()
    s.load_weights(lm)
    s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4)


def test_seeded_and_greedy_samples_are_the_same_after_a_sleep_cycle(engine):
    # The fake samples from the weights it holds: what the engine held before sleep() is what it holds after
    # wake_up() and load_weights() of the same model; another model's weights sample differently.
    s, lm = VLLMSampler("m", seed=3, max_model_len=64), TinyLM()
    prompts = [ids("Q", ":"), ids("The")]

    def draw():
        reseed(3, 1, s)
        seeded = s.sample(prompts, 3, temperature=1.0, top_p=1.0, max_new_tokens=8)
        greedy = s.sample(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=8)
        return [[tuple(c.ids) for c in row] for row in seeded + greedy]

    s.load_weights(lm)
    before = draw()
    s.sleep()
    s.wake_up()
    s.load_weights(lm)
    assert draw() == before
    s.load_weights(TinyLM())
    assert draw() != before


def test_sleep_is_a_no_op_without_sleep_mode(engine):
    s = VLLMSampler("m", max_model_len=64, enable_sleep_mode=False)
    s.sleep()
    s.wake_up()
    assert not calls(engine, "sleep") and not calls(engine, "wake_up")
    s.sample([ids("Q")], 1, temperature=1.0, top_p=1.0, max_new_tokens=4)  # the weights were never discarded


def test_the_trainers_torch_settings_are_kept_beside_the_engine(engine, monkeypatch):
    # The engine runs in the trainer's process: on a GPU its worker drops torch to one thread for serving (unless
    # OMP_NUM_THREADS is set) and sets the float32 matmul precision. The trainer's own come back once it is built.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("high")
    VLLMSampler("m", max_model_len=64)
    assert torch.get_num_threads() == 2 and torch.get_float32_matmul_precision() == "high"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's: vLLM leaves the threads alone, and so do we
    torch.set_num_threads(3)
    VLLMSampler("m", max_model_len=64)
    assert torch.get_num_threads() == 3


def test_each_rank_draws_its_own_request_seeds(engine, monkeypatch):
    # Under torchrun the ranks' engines must not share noise: the requests' seeds differ per rank from the start
    # (training.reseed then sets them per iteration and rank); rank 0 sends a single process's.
    def first_seed(rank: int) -> int:
        monkeypatch.setattr(distributed, "rank", lambda: rank)
        VLLMSampler("m", seed=3, max_model_len=64).sample([ids("Q")], 2, temperature=1.0, top_p=1.0, max_new_tokens=4)
        return calls(engine, "generate")[-1][2][0].seed

    single = torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(3)).item()
    assert first_seed(0) == single
    assert len({single, first_seed(1), first_seed(2)}) == 3


def test_auto_chooses_vllm_under_torchrun(engine, monkeypatch):
    # One engine per rank (the external launcher, tests/test_vllm_ranks.py): --backend auto does not fall back to
    # the HF sampler under torchrun, and --backend vllm is not refused there.
    monkeypatch.setattr(engines.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    backend, why = engines.resolve_backend("auto")
    assert backend == "vllm" and "one engine per rank" in why
    args = types.SimpleNamespace(backend="vllm", fsdp=True)
    assert distributed.world_size_problems(args, per_rank={"--questions": 4, "--batch-size": 8}) == []
    monkeypatch.setattr(engines.torch.cuda, "is_available", lambda: False)
    assert engines.resolve_backend("auto") == ("hf", "--backend auto: no CUDA GPU")


def test_stop_string_beginning_in_the_response_so_far_cuts_to_nothing(engine):
    # The prompt ends with "\n\n" that the policy generated; the continuation starts with "Q:". vLLM only
    # watches the new text, so it runs on; the glue finds the stop string across the boundary and cuts.
    engine.script = lambda p, i: iter(ids("Q", ":", "x", "x"))
    s = VLLMSampler("m", max_model_len=64)
    prompt = ids("Q", ":", "The", "\n\n")
    [[c]] = s.sample([prompt], 1, temperature=1.0, top_p=1.0, max_new_tokens=4, stop=["\n\nQ:"], generated=2)
    assert (c.ids, c.finish_reason) == ([], "stop")
    [[plain]] = s.sample([prompt], 1, temperature=1.0, top_p=1.0, max_new_tokens=4, stop=["\n\nQ:"])
    assert (plain.ids, plain.finish_reason) == (ids("Q", ":", "x", "x"), "length")  # without the history: not seen


def test_reseeded_sampler_repeats_its_samples(engine):
    # training.reseed sets the sampler's generator each iteration, as for HFSampler: the same iteration draws the same
    # samples again (a resumed run repeats the uninterrupted one); the samples of one call still differ.
    s = VLLMSampler("m", seed=3, max_model_len=64)
    prompts = [ids("Q", ":"), ids("Q", ":"), ids("The")]  # two identical prompts: still two different draws

    def draw():
        return [
            [tuple(c.ids) for c in row] for row in s.sample(prompts, 4, temperature=1.0, top_p=1.0, max_new_tokens=8)
        ]

    reseed(3, 5, s)
    first, second = draw(), draw()
    reseed(3, 5, s)
    assert draw() == first and draw() == second
    reseed(3, 6, s)
    assert draw() != first
    assert first != second and first[0] != first[1]
    assert all(len(set(row)) > 1 for row in first)  # the n samples of a prompt are not copies of one
    seeds = [sp.seed for _, _, params, _ in calls(engine, "generate") for sp in params]
    assert all(isinstance(seed, int) and 0 <= seed < 2**62 for seed in seeds)
    assert len(set(seeds[:6])) == 6  # the first two calls' requests: each its own seed


def test_an_odd_kv_cache_space_is_one_line(monkeypatch):
    # VLLM_CPU_KVCACHE_SPACE is whole GiB in the digits 0-9; anything else is one line, never a traceback ("²" passes
    # str.isdigit, and int() refuses it)
    monkeypatch.setattr(vllm_preflight, "free_memory", lambda: 8 * 2**30)
    for value in ("²", "٣", "half", "1.5", "0", " 2", "-1"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
        [line] = vllm_preflight.kv_cache_space_problems()
        assert line == (
            f"VLLM_CPU_KVCACHE_SPACE={value!r} is not a whole number of GiB: set it to 1 or more, or unset it"
        )
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert vllm_preflight.kv_cache_space_problems() == []
