"""GPU check: the one prepared script for a short GPU lease (no network there; only what the working tree carries).

In one command it reports, each step on its own so that one failure loses none of the others:
  1. environment: torch and its CUDA, the driver, the device, real bf16, vLLM's pre-flight line and problems;
  2. each script's CUDA path on a small random Llama (bf16 autocast, reference model, critic, HF sampler):
     seconds per iteration, peak GPU memory, finite metrics;
  3. the update at the real DeepSeek-R1-Distill-Qwen-1.5B shape (random weights from its config): forward and
     backward of one micro-batch of 2,048-token rows, micro-batch 8 / 4 / 8 with activation checkpointing;
     peak memory and seconds; the no-grad log-prob pass's tokens per second (SPO-tree's old-log-prob pass);
  4. the HF sampler at 30 and 240 rows (tokens per second);
  5. the reference model's round trip CPU -> GPU -> CPU, pageable and pinned;
  6. the vLLM sampler when vllm imports (sample, sleep / wake up, weight load, greedy equal to the HF sampler).
`--device cpu` runs every step at toy sizes on the CPU: CI runs it (tests/test_gpu_check.py) so the check
cannot rot between leases.

  python benchmarks/gpu_check.py                          # writes benchmarks/results/gpu_check.json
  python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check_cpu.json
"""

from __future__ import annotations

import json
import math
import string
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import eval as ev  # noqa: E402
from plumbing import engines, files, gpu, models, ranges  # noqa: E402
from plumbing.precision import choose_precision, gpu_has_bf16  # noqa: E402
from plumbing.training import collate, response_logprobs  # noqa: E402
import grpo_baseline  # noqa: E402
import ppo_baseline  # noqa: E402
import spo_chain  # noqa: E402
import spo_tree  # noqa: E402
from conftest import make_tokenizer  # noqa: E402

# DeepSeek-R1-Distill-Qwen-1.5B's config (its config.json), for the update at the real shape
QWEN_1_5B = dict(vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)


@dataclass
class Args:
    device: Literal["cuda", "cpu"] = "cuda"
    """cuda: the real check; cpu: every step at toy sizes (what CI runs)"""
    out: str = "benchmarks/results/gpu_check.json"
    """results JSON (relative to the repository)"""
    context: ranges.PositiveInt = 2048
    """tokens per row in the real-shape update (the paper's 2K context); --device cpu uses 64"""


def timed(step: str, results: dict, function, *args, **kwargs) -> None:
    """Run one step; its result or its error goes into results[step], and a line is printed at once."""
    started = time.time()
    try:
        results[step] = {**function(*args, **kwargs), "seconds": round(time.time() - started, 2)}
    except Exception as error:  # one failing step must not lose the others' figures on a short lease
        results[step] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-2000:]}
    print(step, json.dumps({k: v for k, v in results[step].items() if k != "trace"}), flush=True)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_gb(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 1e9, 2) if device == "cuda" else None


def environment(device: str) -> dict:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True) if device == "cuda" else None
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "nvidia_smi": smi.stdout.strip() if smi else None,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "real_bf16": gpu_has_bf16() if device == "cuda" else None,
            "vllm_preflight": gpu.describe(), "vllm_problems": gpu.vllm_preflight()}


def build_model(directory: Path, alphabet: str, hidden: int, layers: int) -> Path:
    """A random Llama with a character tokenizer."""
    tokenizer = make_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_task(path: Path) -> Path:
    """Every answer is 7: a random digits-only model ends on 7 about one time in ten, so rewards vary within groups
    and trees and every update path runs."""
    rows = [{"question": f"{a} {b}", "answer": "7"} for a in range(12) for b in range(12)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_script(module, model: Path, task: Path, out: Path, device: str, **specific) -> dict:
    toy = device == "cpu"
    settings = dict(
        model=str(model), task=str(task), backend="hf", iterations=2, questions=4 if toy else 8,
        max_new_tokens=16 if toy else 128, context=64 if toy else 512, batch_size=8 if toy else 32,
        micro_batch_size=4 if toy else 16, epochs=1, lr=1e-5, eval_every=1000, eval_limit=4 if toy else 32,
        eval_samples=1, eval_temperature=0.0, save_every=1000, output_dir=str(out), seed=1,
    )
    settings.update(specific)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    summary = module.main(module.Args(**settings))
    lines = files.read_log(Path(summary["run_dir"]) / "metrics.jsonl")
    train = [m for m in lines if "charts/reward" in m]
    return {"iterations": len(train), "finite_metrics": all(isinstance(v, (int, float)) and math.isfinite(v) for m in lines for v in m.values()),
            "seconds_per_iteration": [round(m["time/iteration_seconds"], 2) for m in train], "peak_gpu_gb": peak_gb(device)}


def real_shape_update(device: str, context: int) -> dict:
    """Forward and backward of one micro-batch at the policy's real shape, as the update runs it."""
    config = dict(QWEN_1_5B) if device == "cuda" else dict(QWEN_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).to(device)  # fp32 master weights, as training holds them
    precision = choose_precision("auto", device)
    prompt, response = context // 4, context - context // 4
    results = {"parameters": sum(p.numel() for p in model.parameters()), "precision": precision.line}
    for rows, checkpointing in ((8, False), (4, False), (8, True)):
        model.activation_checkpointing_enable() if checkpointing else model.activation_checkpointing_disable()
        model.train()
        # distinct prompts: every row pays for its prompt, the update's worst case
        samples = [{"prompt_ids": torch.randint(10, config["vocab_size"], (prompt,)).tolist(),
                    "response_ids": torch.randint(10, config["vocab_size"], (response,)).tolist()} for _ in range(rows)]
        batch = collate(samples, 0, device)
        model.zero_grad(set_to_none=True)
        synchronize(device)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        started = time.time()
        response_logprobs(model, batch, 0.6, precision=precision).sum().backward()
        synchronize(device)
        results[f"rows{rows}{'_gc' if checkpointing else ''}"] = {"seconds": round(time.time() - started, 2), "peak_gpu_gb": peak_gb(device)}
    model.activation_checkpointing_disable()
    model.eval()
    with torch.no_grad():  # the old-log-prob and reference passes
        samples = [{"prompt_ids": samples[0]["prompt_ids"], "response_ids": torch.randint(10, config["vocab_size"], (response,)).tolist()}
                   for _ in range(16)]
        batch = collate(samples, 0, device)
        synchronize(device)
        started = time.time()
        response_logprobs(model, batch, 0.6, precision=precision)
        synchronize(device)
    results["no_grad_logprob_tokens_per_second"] = round(16 * response / (time.time() - started))
    return results


def sampler_rows(model_dir: Path, device: str) -> dict:
    model, tokenizer = models.load_model(str(model_dir), device=device)
    prompts = [ev.encode_prompt(f"Problem: what is {i} + {i + 1}?\n", tokenizer) for i in range(30)]
    sampler = engines.HFSampler(model, tokenizer, seed=0, batch_size=256, precision=choose_precision("auto", device))
    new_tokens = 16 if device == "cpu" else 256
    results = {}
    for prompts_used, n in ((30, 1), (30, 8)):  # 30 and 240 rows
        synchronize(device)
        started = time.time()
        groups = sampler.sample(prompts[:prompts_used], n, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, ignore_eos=True)
        synchronize(device)
        tokens = sum(len(c.ids) for group in groups for c in group)
        results[f"rows{prompts_used * n}"] = {"tokens": tokens, "tokens_per_second": round(tokens / (time.time() - started))}
    return results


def reference_round_trip(model_dir: Path, device: str) -> dict:
    """What parking the reference model on the CPU costs per iteration: to the device and back, pageable and pinned."""
    model, _ = models.load_model(str(model_dir), device="cpu")
    results = {"gigabytes": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9, 3)}
    for pinned in (False, True):
        tensors = [p.detach().pin_memory() if pinned and device == "cuda" else p.detach() for p in model.parameters()]
        synchronize(device)
        started = time.time()
        moved = [t.to(device, non_blocking=pinned) for t in tensors]
        synchronize(device)
        back = [t.to("cpu") for t in moved]
        synchronize(device)
        results["pinned" if pinned else "pageable"] = round(time.time() - started, 3)
        del moved, back
    return results


def vllm_sampler(model_dir: Path, device: str) -> dict:
    """The vLLM engine where vllm imports: sample, sleep and wake up, load weights, greedy equal to the HF sampler."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not installed here (its wheel is too large to carry; run where it is installed)"}
    model, tokenizer = models.load_model(str(model_dir), device=device)
    prompts = [ev.encode_prompt(f"Problem: what is {i} + 1?\n", tokenizer) for i in range(8)]
    engine = engines.VLLMSampler(str(model_dir), seed=0, max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True)
    greedy = engine.sample(prompts, 1, temperature=0, top_p=1.0, max_new_tokens=32)
    engine.sleep()
    engine.wake_up()
    engine.load_weights(model)
    reference = engines.HFSampler(model, tokenizer).sample(prompts, 1, temperature=0, top_p=1.0, max_new_tokens=32)
    same = sum(g[0].ids == r[0].ids for g, r in zip(greedy, reference))
    return {"greedy_equal_to_hf": f"{same} of {len(prompts)}", "sampled_after_wake": len(engine.sample(prompts, 2, temperature=1.0, top_p=1.0, max_new_tokens=8))}


def main(args: Args) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here: run on the GPU machine, or --device cpu for the toy-size check")
    results: dict = {"measured": time.strftime("%Y-%m-%d %H:%M"), "device_mode": args.device}
    timed("environment", results, environment, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        hidden, layers = (64, 2) if args.device == "cpu" else (512, 8)
        model, task = build_model(tmp / "digits", "0123456789 ", hidden, layers), build_task(tmp / "sevens.jsonl")
        printable = build_model(tmp / "printable", string.printable, hidden, layers)
        for module, name, specific in [
            (grpo_baseline, "grpo", dict(group_size=4 if args.device == "cpu" else 8)),
            (spo_chain, "spo_chain", dict(group_size=4 if args.device == "cpu" else 8, mc_samples=9)),
            (spo_tree, "spo_tree", dict(tree="3,3" if args.device == "cpu" else "6,6", segment_tokens=4 if args.device == "cpu" else 30,
                                        samples_per_iteration=16 if args.device == "cpu" else 64)),
            (ppo_baseline, "ppo", dict(group_size=4 if args.device == "cpu" else 8)),
        ]:
            timed(f"script_{name}", results, run_script, module, model, task, tmp / "runs" / name, args.device, **specific)
        timed("real_shape_update", results, real_shape_update, args.device, 64 if args.device == "cpu" else args.context)
        timed("hf_sampler", results, sampler_rows, printable, args.device)
        timed("reference_round_trip", results, reference_round_trip, printable, args.device)
        timed("vllm_sampler", results, vllm_sampler, printable, args.device)
    out = ROOT / args.out
    files.write_atomic(out, json.dumps(results, indent=1), "the GPU check's results")
    failed = [step for step, value in results.items() if isinstance(value, dict) and "error" in value]
    print(f"-> {out}" + (f"; failed steps: {', '.join(failed)}" if failed else "; every step ran"))
    return results


if __name__ == "__main__":
    main(ranges.cli(Args))
