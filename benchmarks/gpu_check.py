"""GPU check: the one prepared script for a short GPU lease (no network there; only what the working tree carries).

In one command it reports, each step on its own so that one failure loses none of the others:
  1. environment: torch and its CUDA, the driver, the device, real bf16, vLLM's pre-flight line and problems;
  2. each script's CUDA path on a small random Llama (bf16 autocast, reference model, critic, HF sampler):
     seconds per iteration, peak GPU memory, finite metrics, the memory settings `auto` chose (SPO-tree with the
     reference parked in pinned CPU memory, the others as auto places it);
  3. the update at the real DeepSeek-R1-Distill-Qwen-1.5B shape (random weights from its config): forward and
     backward of one micro-batch of 2,048-token rows, micro-batch 8 / 4 / 8 with activation checkpointing;
     peak memory and seconds; the no-grad log-prob pass's tokens per second (SPO-tree's old-log-prob pass);
  4. SPO-tree's old-log-prob pass over every edge of the paper's trees (6,6,6, 600-token segments, 2K context) on
     the small model, in micro-batches of 8 and in passes sized to free memory (its peak against the estimate),
     and its share of the pass + the update of the edges trained;
  5. the HF sampler at 30 and 240 rows (tokens per second);
  6. the reference model's cost per iteration at the real shape: pageable .to(device) and back, pinned (copied in,
     dropped after), resident; the small model's reference log-probs equal resident and parked;
  7. the vLLM sampler when vllm imports (sample, sleep / wake up, weight load, greedy equal to the HF sampler), and
     spo_tree.py with --backend vllm and every memory setting at auto, for two iterations.
`--device cpu` runs every step at toy sizes on the CPU: CI runs it (tests/test_gpu_check.py) so the check
cannot rot between leases.

  python benchmarks/gpu_check.py                          # writes benchmarks/results/gpu_check.json
  python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check_cpu.json
"""

from __future__ import annotations

import contextlib
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
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import eval as ev  # noqa: E402
import grpo_baseline  # noqa: E402
import ppo_baseline  # noqa: E402
import spo_chain  # noqa: E402
import spo_tree  # noqa: E402
from conftest import make_tokenizer  # noqa: E402
from plumbing import engines, files, gpu, memory, models, ranges, training  # noqa: E402
from plumbing.memory import model_shape  # noqa: E402
from plumbing.precision import choose_precision, gpu_has_bf16  # noqa: E402
from plumbing.training import collate, micro_batches, response_logprobs, sample_logprobs  # noqa: E402

# DeepSeek-R1-Distill-Qwen-1.5B's config (its config.json), for the update at the real shape
QWEN_1_5B = dict(
    vocab_size=151_936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


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
    smi = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        if device == "cuda"
        else None
    )
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nvidia_smi": smi.stdout.strip() if smi else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "real_bf16": gpu_has_bf16() if device == "cuda" else None,
        "vllm_preflight": gpu.describe(),
        "vllm_problems": gpu.vllm_preflight(),
    }


def build_model(directory: Path, alphabet: str, hidden: int, layers: int) -> Path:
    """A random Llama with a character tokenizer."""
    tokenizer = make_tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
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
        model=str(model),
        task=str(task),
        backend="hf",
        iterations=2,
        questions=4 if toy else 8,
        max_new_tokens=16 if toy else 128,
        context=64 if toy else 512,
        batch_size=8 if toy else 32,
        micro_batch_size=4 if toy else 16,
        epochs=1,
        lr=1e-5,
        eval_every=1000,
        eval_limit=4 if toy else 32,
        eval_samples=1,
        eval_temperature=0.0,
        save_every=1000,
        output_dir=str(out),
        seed=1,
    )
    settings.update(specific)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    summary = module.main(module.Args(**settings))
    lines = files.read_log(Path(summary["run_dir"]) / "metrics.jsonl")
    train = [m for m in lines if "charts/reward" in m]
    start = files.read_log(Path(summary["run_dir"]) / "starts.jsonl")[0]
    return {
        "iterations": len(train),
        "finite_metrics": all(isinstance(v, (int, float)) and math.isfinite(v) for m in lines for v in m.values()),
        "seconds_per_iteration": [round(m["time/iteration_seconds"], 2) for m in train],
        "peak_gpu_gb": peak_gb(device),
        "memory": start.get("memory", {}).get("line"),
    }


def real_shape_update(device: str, context: int) -> dict:
    """Forward and backward of one micro-batch at the policy's real shape, as the update runs it."""
    config = (
        dict(QWEN_1_5B)
        if device == "cuda"
        else dict(
            QWEN_1_5B,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**config)).to(device)  # fp32 master weights, as training holds them
    precision = choose_precision("auto", device)
    prompt, response = context // 4, context - context // 4
    results = {"parameters": sum(p.numel() for p in model.parameters()), "precision": precision.line}
    for rows, checkpointing in ((8, False), (4, False), (8, True)):
        model.activation_checkpointing_enable() if checkpointing else model.activation_checkpointing_disable()
        model.train()
        # distinct prompts: every row pays for its prompt, the update's worst case
        samples = [
            {
                "prompt_ids": torch.randint(10, config["vocab_size"], (prompt,)).tolist(),
                "response_ids": torch.randint(10, config["vocab_size"], (response,)).tolist(),
            }
            for _ in range(rows)
        ]
        batch = collate(samples, 0, device)
        model.zero_grad(set_to_none=True)
        synchronize(device)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        started = time.time()
        response_logprobs(model, batch, 0.6, precision=precision).sum().backward()
        synchronize(device)
        # plumbing/memory.py's estimate of the same: weights, gradients, autocast's bf16 copies and the pass
        shape, element = model_shape(model.config), 2 if device in precision.bf16 else 0
        estimate = (8 + element) * shape.params + memory.pass_bytes(shape, rows * context, checkpointing)
        results[f"rows{rows}{'_gc' if checkpointing else ''}"] = {
            "seconds": round(time.time() - started, 2),
            "peak_gpu_gb": peak_gb(device),
            "estimated_gb": round(estimate / 1e9, 2),
        }
    model.activation_checkpointing_disable()
    model.eval()
    with torch.no_grad():  # the old-log-prob and reference passes
        samples = [
            {
                "prompt_ids": samples[0]["prompt_ids"],
                "response_ids": torch.randint(10, config["vocab_size"], (response,)).tolist(),
            }
            for _ in range(16)
        ]
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
        groups = sampler.sample(
            prompts[:prompts_used], n, temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, ignore_eos=True
        )
        synchronize(device)
        tokens = sum(len(c.ids) for group in groups for c in group)
        results[f"rows{prompts_used * n}"] = {
            "tokens": tokens,
            "tokens_per_second": round(tokens / (time.time() - started)),
        }
    return results


def reference_round_trip(model_dir: Path, device: str) -> dict:
    """What the reference model's place costs per iteration (one reference pass each) at the real
    DeepSeek-R1-Distill-Qwen-1.5B shape (fp32, uninitialised weights: only bytes move): pageable .to(device) and back
    (the scripts before --reference-on-device), parked in pinned CPU memory (models.park once, then on_device: copied
    in without blocking, dropped after), resident (nothing moves). Then the small model's reference log-probs,
    resident and parked: equal, and the parked one back on the CPU, pinned, after its pass."""
    config = (
        dict(QWEN_1_5B)
        if device == "cuda"
        else dict(
            QWEN_1_5B,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1000,
        )
    )

    def empty_model(where: str) -> torch.nn.Module:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(Qwen2Config(**config))
        return model.to_empty(device=where).requires_grad_(False)

    def seconds(function) -> float:
        synchronize(device)
        started = time.time()
        function()
        synchronize(device)
        return round(time.time() - started, 3)

    reference = empty_model("cpu")
    results = {
        "gigabytes": round(sum(p.numel() * p.element_size() for p in reference.parameters()) / 1e9, 3),
        "pageable": seconds(lambda: reference.to(device).to("cpu")),
    }
    results["pin_once"] = seconds(lambda: models.park(reference, device))

    def visit(model):
        with models.on_device(model):
            pass

    results["pinned"] = [
        seconds(lambda: visit(reference)) for _ in range(3)
    ]  # the first visit also grows torch's cache
    resident = empty_model(device)
    results["resident"] = seconds(lambda: visit(resident))
    reference = resident = None  # noqa: F841 (7 GB each at the real shape: freed before the next part)
    if device == "cuda":
        torch.cuda.empty_cache()

    precision = choose_precision("auto", device)
    samples = [{"prompt_ids": [10 + i, 11, 12], "response_ids": [13, 14 + i, 15, 16]} for i in range(6)]
    logps = {}
    for on_device in (True, False):
        _, _, small = models.load_policy(str(model_dir), None, device, 1e-4, reference_on_device=on_device)
        with models.on_device(small):
            logps[on_device] = torch.cat(sample_logprobs(small, samples, 8, 0.6, 0, precision))
    results["logprobs_equal_resident_and_parked"] = torch.equal(logps[True], logps[False])
    results["parked_after_its_pass"] = sorted(
        {f"{t.device.type}{', pinned' if t.is_pinned() else ''}" for t in [*small.parameters(), *small.buffers()]}
    )
    return results


def paper_tree_edges(
    vocab: int, questions: int, branches: list[int], segment: int, prompt: int, context: int, generator: torch.Generator
) -> list[dict]:
    """The edges of `questions` full trees (every node expanded: the most edges and tokens a tree can have), random
    tokens: SPO-tree's samples, each a node's query (the prompt + its ancestors' segments) and its segment, inner
    segments of `segment` tokens, the last level's to the context's end."""
    edges = []
    for _ in range(questions):
        level = [torch.randint(10, vocab, (prompt,), generator=generator).tolist()]  # the states at one depth
        for depth, branch in enumerate(branches):
            length = segment if depth < len(branches) - 1 else context - prompt - segment * depth
            children = []
            for state in level:
                for _ in range(branch):
                    tokens = torch.randint(10, vocab, (length,), generator=generator).tolist()
                    edges.append({"prompt_ids": state, "response_ids": tokens})
                    children.append(state + tokens)
            level = children
    return edges


def spo_tree_old_logprob_pass(model_dir: Path, device: str) -> dict:
    """SPO-tree's old-log-prob pass (every new edge of an iteration's trees) against the update (the edges trained),
    on the small model: the paper's long-CoT trees (6,6,6, 600-token segments, 200-token prompts, 2K context: 258
    edges each), 8 of them, of which 16 edges each are trained (the paper: 512 of 32 trees') in one batch of 128 in
    micro-batches of 8. The pass in micro-batches of 8 (the scripts before) and sized to the free memory (now): its
    seconds, passes, peak GPU memory against the estimate (memory.no_grad_pass_bytes), and its share of pass +
    update; the largest difference of the two passes' log-probs."""
    toy = device == "cpu"
    model, _ = models.load_model(str(model_dir), dtype=torch.float32, device=device)  # fp32 master weights, as training
    precision = choose_precision("auto", device)
    questions, branches, segment, prompt, context, trained = (
        (2, [3, 3], 4, 8, 32, 8) if toy else (8, [6, 6, 6], 600, 200, 2048, 128)
    )
    generator = torch.Generator().manual_seed(0)
    edges = paper_tree_edges(model.config.vocab_size, questions, branches, segment, prompt, context, generator)

    def cached(micro: list[int]) -> int:  # positions a micro-batch's KV cache holds
        widest_prompt = max(len(edges[i]["prompt_ids"]) for i in micro)
        return len(micro) * (widest_prompt + max(len(edges[i]["response_ids"]) for i in micro))

    per_position, once = memory.no_grad_pass_bytes(
        model_shape(model.config), 2 if device in precision.bf16 else 4, context
    )
    results = {
        "edges": len(edges),
        "response_tokens": sum(len(e["response_ids"]) for e in edges),
        "precision": precision.line,
    }
    logps = {}
    for name, sized in (("micro_batch_8", False), ("sized_to_memory", True)):
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        budget = training.no_grad_batch_tokens(model, edges, precision) if sized else None  # what sample_logprobs finds
        split = training.no_grad_batches(model, edges, 8, precision, budget) if sized else micro_batches(edges, 8)
        with (
            contextlib.nullcontext()
            if sized
            else mock.patch.object(training, "no_grad_batch_tokens", return_value=None)
        ):
            synchronize(device)
            started = time.time()
            logps[name] = sample_logprobs(model, edges, 8, 0.6, 0, precision, batch_tokens=budget)
            synchronize(device)
        results[name] = {
            "seconds": round(time.time() - started, 2),
            "budget_positions": budget,
            "passes": len(split),
            "largest_pass_positions": max(map(cached, split)),
            "peak_gpu_gb_above_start": round((torch.cuda.max_memory_allocated() - before) / 1e9, 2)
            if device == "cuda"
            else None,
            "estimated_gb": round((max(map(cached, split)) * per_position + once) / 1e9, 2),
        }
    # bf16 kernels may round differently for other batch shapes; fp32 differs by a few ulps (tests/test_logprobs.py)
    results["logprob_max_difference"] = max(float((a - b).abs().max()) for a, b in zip(*logps.values()))

    # the update: the edges trained, with their old log-probs, in one optimizer step
    picked = torch.randperm(len(edges), generator=generator)[:trained].tolist()
    samples = [
        {
            **edges[i],
            "old_logps": logps["sized_to_memory"][i],
            "ref_logps": logps["sized_to_memory"][i],
            "advantages": torch.full((len(edges[i]["response_ids"]),), 1.0 if k % 2 else -1.0),
            "loss_mask": torch.ones(len(edges[i]["response_ids"]), dtype=torch.bool),
        }
        for k, i in enumerate(picked)
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    started = time.time()
    spo_tree.accumulate_gradients(
        model, samples, micro_batch_size=8, temperature=0.6, clip_eps=0.2, beta=1e-4, pad_id=0, precision=precision
    )
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    synchronize(device)
    update = time.time() - started
    results["update"] = {"seconds": round(update, 2), "edges": len(samples), "peak_gpu_gb": peak_gb(device)}
    for name in ("micro_batch_8", "sized_to_memory"):  # of the pass + the update (the rollout not counted)
        results[name]["share_of_pass_and_update"] = round(
            results[name]["seconds"] / (results[name]["seconds"] + update), 3
        )
    return results


def vllm_sampler(model_dir: Path, device: str) -> dict:
    """The vLLM engine where vllm imports: sample, sleep and wake up, load weights, greedy equal to the HF sampler."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not installed here (its wheel is too large to carry; run where it is installed)"}
    model, tokenizer = models.load_model(str(model_dir), device=device)
    prompts = [ev.encode_prompt(f"Problem: what is {i} + 1?\n", tokenizer) for i in range(8)]
    engine = engines.VLLMSampler(
        str(model_dir), seed=0, max_model_len=512, gpu_memory_utilization=0.3, enforce_eager=True
    )
    greedy = engine.sample(prompts, 1, temperature=0, top_p=1.0, max_new_tokens=32)
    engine.sleep()
    engine.wake_up()
    engine.load_weights(model)
    reference = engines.HFSampler(model, tokenizer).sample(prompts, 1, temperature=0, top_p=1.0, max_new_tokens=32)
    same = sum(g[0].ids == r[0].ids for g, r in zip(greedy, reference))
    return {
        "greedy_equal_to_hf": f"{same} of {len(prompts)}",
        "sampled_after_wake": len(engine.sample(prompts, 2, temperature=1.0, top_p=1.0, max_new_tokens=8)),
    }


def vllm_script(model: Path, task: Path, out: Path, device: str) -> dict:
    """spo_tree.py's main with --backend vllm and the memory settings at auto, where vllm imports."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return {"skipped": "vllm is not installed here"}
    return run_script(
        spo_tree,
        model,
        task,
        out,
        device,
        backend="vllm",
        micro_batch_size="auto",
        tree="6,6",
        segment_tokens=30,
        samples_per_iteration=64,
        vllm_enforce_eager=True,
    )


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
            (
                spo_tree,
                "spo_tree",
                dict(
                    tree="3,3" if args.device == "cpu" else "6,6",
                    segment_tokens=4 if args.device == "cpu" else 30,
                    samples_per_iteration=16 if args.device == "cpu" else 64,
                    reference_on_device=False,
                ),
            ),
            (ppo_baseline, "ppo", dict(group_size=4 if args.device == "cpu" else 8)),
        ]:
            timed(
                f"script_{name}", results, run_script, module, model, task, tmp / "runs" / name, args.device, **specific
            )
        timed(
            "real_shape_update", results, real_shape_update, args.device, 64 if args.device == "cpu" else args.context
        )
        timed("spo_tree_old_logprob_pass", results, spo_tree_old_logprob_pass, printable, args.device)
        timed("hf_sampler", results, sampler_rows, printable, args.device)
        timed("reference_round_trip", results, reference_round_trip, printable, args.device)
        timed("vllm_sampler", results, vllm_sampler, printable, args.device)
        # SPO-tree with vLLM and every memory setting at auto: the engine's share beside the no-grad passes, the
        # level-2 sleep and the reload, for two iterations (last: a failed engine start loses no other step)
        timed("script_spo_tree_vllm", results, vllm_script, model, task, tmp / "runs" / "spo_tree_vllm", args.device)
    out = ROOT / args.out
    files.write_atomic(out, json.dumps(results, indent=1), "the GPU check's results")
    failed = [step for step, value in results.items() if isinstance(value, dict) and "error" in value]
    print(f"-> {out}" + (f"; failed steps: {', '.join(failed)}" if failed else "; every step ran"))
    return results


if __name__ == "__main__":
    main(ranges.cli(Args))
