"""Sampler throughput: eval.HFSampler (one prefill per prefix, KV cache repeated K times) against
plain `model.generate(..., num_return_sequences=K)` (which prefills every copy), on SmolLM2-135M.

Cases: the SPO-chain Monte-Carlo case (K = 9 continuations of 64 new tokens from ~256-token prefixes)
and the SPO-tree case (K = 6 from short prompts). Same sampling settings and seed for both; reports
generated tokens per second, the ratio, and the length distribution of the outputs.

  python benchmarks/sampler.py                 # writes benchmarks/results/sampler.json
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import eval as ev  # noqa: E402

REPEATS = 3


def long_prefixes(tokenizer, count: int, length: int) -> list[list[int]]:
    """Prompt + the start of a worked solution, cut to `length` tokens: a state mid-response."""
    examples = ev.load_task("rg:chain_sum:min_terms=5,max_terms=6,max_digits=3", "train", limit=count * 4, tokenizer=tokenizer)
    prefixes = []
    for i in range(count):
        ids = []
        for example in examples[i * 4 : (i + 1) * 4]:  # several problems in a row make a long prefix
            ids += example.prompt_ids + tokenizer(f"Let me add the numbers one by one: {example.question}\n")["input_ids"]
        prefixes.append(ids[:length])
    return prefixes


def run_hf_sampler(model, tokenizer, prompts, k, max_new_tokens):
    sampler = ev.HFSampler(model, tokenizer, seed=0, batch_size=len(prompts) * k)
    started = time.perf_counter()
    groups = sampler.sample(prompts, k, temperature=0.6, top_p=0.9, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - started
    return seconds, [len(c.ids) for g in groups for c in g]


def run_generate(model, tokenizer, prompts, k, max_new_tokens):
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=True, temperature=0.6, top_p=0.9, top_k=0,
                             max_new_tokens=max_new_tokens, num_return_sequences=k, pad_token_id=pad)
    seconds = time.perf_counter() - started
    eos = ev.eos_ids(model, tokenizer)
    lengths = []
    for row in out[:, width:].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        lengths.append(ends[0] + 1 if ends else len(row))
    return seconds, lengths


def measure(model, tokenizer, prompts, k, max_new_tokens) -> dict:
    result = {"prompts": len(prompts), "k": k, "prompt_tokens": statistics.mean(len(p) for p in prompts), "max_new_tokens": max_new_tokens}
    for name, fn in (("hf_sampler", run_hf_sampler), ("generate", run_generate)):
        runs = [fn(model, tokenizer, prompts, k, max_new_tokens) for _ in range(REPEATS)]
        rates = [sum(lengths) / seconds for seconds, lengths in runs]
        lengths = [n for _, ls in runs for n in ls]
        result[name] = {"tokens_per_second": statistics.median(rates), "runs_tokens_per_second": rates,
                        "mean_length": statistics.mean(lengths), "std_length": statistics.pstdev(lengths)}
    result["speedup"] = result["hf_sampler"]["tokens_per_second"] / result["generate"]["tokens_per_second"]
    return result


def main() -> None:
    torch.set_num_threads(torch.get_num_threads())
    model, tokenizer = ev.load_model("smollm2-135m")
    short = [e.prompt_ids for e in ev.load_task("rg:chain_sum:min_terms=2,max_terms=2,max_digits=1", "train", limit=4, tokenizer=tokenizer)]
    cases = {
        "mc_k9_prefix256": measure(model, tokenizer, long_prefixes(tokenizer, 4, 256), 9, 64),
        "tree_k6_short": measure(model, tokenizer, short, 6, 64),
    }
    output = Path(__file__).parent / "results" / "sampler.json"
    output.write_text(json.dumps({"model": "smollm2-135m", "device": "cpu", "threads": torch.get_num_threads(), "cases": cases}, indent=1))
    for name, case in cases.items():
        print(f"{name}: HFSampler {case['hf_sampler']['tokens_per_second']:.0f} tok/s, generate {case['generate']['tokens_per_second']:.0f} tok/s, "
              f"speedup {case['speedup']:.2f}x (mean lengths {case['hf_sampler']['mean_length']:.1f} vs {case['generate']['mean_length']:.1f})")
    print(f"-> {output}")


if __name__ == "__main__":
    main()
