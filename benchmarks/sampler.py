"""Sampler throughput against the machine's limit: eval.HFSampler (one prefill per prefix, KV cache repeated K
times) against plain `model.generate(..., num_return_sequences=K)` (what a user would write; it prefills every
copy), on SmolLM2-135M, at equal output lengths.

Fair by construction: EOS is ignored on both sides (HFSampler's ignore_eos, generate's min_new_tokens), so every
row generates exactly max_new_tokens and both sides do the same useful work. Cases: the SPO-chain Monte-Carlo case
(4 prefixes of 256 tokens, K = 9) and the SPO-tree case (4 short prompts, K = 6), 64 new tokens each.

Reported per side: seconds per call (median of 3), generated tokens per second, and the achieved model FLOP/s:
the useful work (every distinct prompt token prefilled once, every generated token, 2 FLOPs per weight of each
linear layer plus attention over the context) over the seconds, as a fraction of the matmul peak measured in this
run (2048 x 2048 x 2048) in the same dtype. bf16 autocast is measured where the CPU has fast bf16
(eval.fast_bf16); elsewhere the JSON says why it was left out and how fast a bf16 matmul is here.

  python -m benchmarks.sampler                 # writes benchmarks/results/sampler.json
  python -m benchmarks.sampler --out benchmarks/results/sampler_other_cpu.json
"""

import json
import statistics
import time
from pathlib import Path

import torch
import tyro

from plumbing import engines, models, runs, tasks
from plumbing.precision import choose_precision, cpu_description, fast_bf16

REPEATS = 3
TEMPERATURE, TOP_P = 0.6, 0.9


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Median FLOP/s of a size^3 matmul in `dtype` on this machine, now."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(times)


def model_flops(model, prompts: list[list[int]], k: int, new_tokens: int) -> float:
    """Useful FLOPs of sampling k continuations of new_tokens from each prompt: each prompt token once, each
    generated token once; 2 per linear weight, and 4 x layers x attention width x positions attended."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    config = model.config
    attention = (
        4 * config.num_hidden_layers * config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    )
    total = 0.0
    for prompt in prompts:
        total += sum(2 * linear + attention * (i + 1) for i in range(len(prompt)))
        total += k * sum(2 * linear + attention * (len(prompt) + j + 1) for j in range(new_tokens))
    return total


def long_prefixes(tokenizer, count: int, length: int) -> list[list[int]]:
    """Prompt + the start of a worked solution, cut to `length` tokens: a state mid-response."""
    examples = tasks.load_task(
        "rg:chain_sum:min_terms=5,max_terms=6,max_digits=3", "train", limit=count * 4, tokenizer=tokenizer
    )
    prefixes = []
    for i in range(count):
        ids = []
        for example in examples[i * 4 : (i + 1) * 4]:  # several problems in a row make a long prefix
            ids += (
                example.prompt_ids + tokenizer(f"Let me add the numbers one by one: {example.question}\n")["input_ids"]
            )
        prefixes.append(ids[:length])
    return prefixes


def run_hf_sampler(model, tokenizer, prompts, k, new_tokens, precision) -> tuple[float, int]:
    sampler = engines.HFSampler(model, tokenizer, seed=0, precision=precision)
    started = time.perf_counter()
    groups = sampler.sample(
        prompts, k, temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=new_tokens, ignore_eos=True
    )
    return time.perf_counter() - started, sum(len(c.ids) for g in groups for c in g)


def run_generate(model, tokenizer, prompts, k, new_tokens, precision) -> tuple[float, int]:
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.no_grad(), precision.autocast("cpu"):
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            num_return_sequences=k,
            pad_token_id=pad,
        )
    return time.perf_counter() - started, out[:, width:].numel()


def measure(model, tokenizer, prompts, k, new_tokens, peak: float, precision) -> dict:
    flops = model_flops(model, prompts, k, new_tokens)
    result = {
        "prompts": len(prompts),
        "k": k,
        "prompt_tokens": statistics.mean(len(p) for p in prompts),
        "new_tokens": new_tokens,
        "useful_gflop": flops / 1e9,
    }
    for name, fn in (("hf_sampler", run_hf_sampler), ("generate", run_generate)):
        runs = [fn(model, tokenizer, prompts, k, new_tokens, precision) for _ in range(REPEATS)]
        assert all(tokens == len(prompts) * k * new_tokens for _, tokens in runs), "unequal output lengths"
        seconds = statistics.median(s for s, _ in runs)
        result[name] = {
            "seconds": seconds,
            "runs_seconds": [s for s, _ in runs],
            "tokens_per_second": runs[0][1] / seconds,
            "model_gflops": flops / seconds / 1e9,
            "fraction_of_matmul_peak": flops / seconds / peak,
        }
    result["speedup"] = result["generate"]["seconds"] / result["hf_sampler"]["seconds"]
    return result


def bf16_over_fp32_generate(precisions: dict) -> dict:
    """HFSampler in bf16 (what --precision auto runs where bf16 is fast) against generate in fp32 (what a user
    would write), per case, from the measured seconds of both precisions; empty when bf16 was not measured.

    >>> bf16_over_fp32_generate({"fp32": {"c": {"generate": {"seconds": 30.0}}},
    ...                          "bf16": {"c": {"hf_sampler": {"seconds": 10.0}}}})
    {'c': 3.0}
    """
    if "skipped" in precisions.get("bf16", {"skipped": True}):
        return {}
    return {
        name: case["generate"]["seconds"] / precisions["bf16"][name]["hf_sampler"]["seconds"]
        for name, case in precisions["fp32"].items()
    }


def main(out: Path = Path(__file__).parent / "results" / "sampler.json") -> None:
    """Measure both cases in fp32 (and bf16 where the CPU has fast bf16) and write the results JSON to `out`."""
    model, tokenizer = models.load_model("smollm2-135m")
    short = [
        e.prompt_ids
        for e in tasks.load_task(
            "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1", "train", limit=4, tokenizer=tokenizer
        )
    ]
    long = long_prefixes(tokenizer, 4, 256)
    fast, why = fast_bf16("cpu")
    peaks = {"fp32": matmul_peak(torch.float32)}
    peaks["bf16"] = matmul_peak(torch.bfloat16) if fast else matmul_peak(torch.bfloat16, size=512, repeats=3)
    results = {
        "model": "smollm2-135m",
        "device": "cpu",
        "cpu": cpu_description(),
        "code": runs.code_state(),
        "threads": torch.get_num_threads(),
        "fast_bf16": fast,
        "why": why,
        "matmul_peak_gflops": {k: v / 1e9 for k, v in peaks.items()},
        "precisions": {},
    }
    for precision in ("fp32", "bf16"):
        if precision == "bf16" and not fast:
            results["precisions"]["bf16"] = {"skipped": f"{why} (bf16 matmul here: {peaks['bf16'] / 1e9:.1f} GFLOP/s)"}
            continue
        chosen = choose_precision(precision, "cpu")
        results["precisions"][precision] = {
            "mc_k9_prefix256": measure(model, tokenizer, long, 9, 64, peaks[precision], chosen),
            "tree_k6_short": measure(model, tokenizer, short, 6, 64, peaks[precision], chosen),
        }
    results["hf_sampler_bf16_over_generate_fp32"] = bf16_over_fp32_generate(results["precisions"])
    output = Path(out)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1))
    print(f"matmul peak: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s ({why})")
    for precision, cases in results["precisions"].items():
        for name, case in cases.items():
            if name == "skipped":
                print(f"{precision}: skipped, {case}")
                continue
            ours, theirs = case["hf_sampler"], case["generate"]
            print(
                f"{precision} {name}: HFSampler {ours['seconds']:.1f} s ({ours['tokens_per_second']:.0f} tok/s, "
                f"{ours['model_gflops']:.1f} GFLOP/s = {ours['fraction_of_matmul_peak']:.0%} of peak), "
                f"generate {theirs['seconds']:.1f} s "
                f"({theirs['tokens_per_second']:.0f} tok/s, {theirs['fraction_of_matmul_peak']:.0%}), "
                f"speedup {case['speedup']:.2f}x"
            )
    for name, speedup in results["hf_sampler_bf16_over_generate_fp32"].items():
        print(f"{name}: HFSampler in bf16 against generate in fp32 (what a user would write): {speedup:.2f}x")
    print(f"-> {output}")


if __name__ == "__main__":
    tyro.cli(main)
