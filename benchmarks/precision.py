"""What bf16 autocast does to the numbers the algorithms use: p_t = pi(y_t | ...) of real SmolLM2 rollouts,
computed by the training code (grpo_baseline.sample_logprobs, logits divided by the temperature) in fp32 and in
bf16 autocast, over the same token ids.

Reports max and mean |delta log p| over response tokens, the fraction of tokens whose p_t falls on the other
side of the 0.9 probability-mask threshold, the fraction whose ratio exp(delta) leaves the clip range
[0.8, 1.2], and the seconds of each pass on this machine (with whether the CPU has fast bf16).

  python -m benchmarks.precision               # writes benchmarks/results/precision.json (--out elsewhere)
"""

import json
import time
from pathlib import Path

import torch
import tyro

import grpo_baseline as grpo
from plumbing import engines, models, runs, tasks
from plumbing.precision import choose_precision, cpu_description, fast_bf16

TASK, QUESTIONS, SAMPLES, NEW_TOKENS, TEMPERATURE, THRESHOLD = (
    "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1",
    6,
    4,
    64,
    0.6,
    0.9,
)


def main(out: Path = Path(__file__).parent / "results" / "precision.json") -> None:
    """Compute the same rollouts' log-probs in fp32 and in bf16 autocast and write the comparison to `out`."""
    model, tokenizer = models.load_model("smollm2-135m")
    examples = tasks.load_task(TASK, "train", limit=QUESTIONS, tokenizer=tokenizer)
    groups = engines.HFSampler(model, tokenizer, seed=0).sample(
        [e.prompt_ids for e in examples],
        SAMPLES,
        temperature=TEMPERATURE,
        top_p=1.0,
        max_new_tokens=NEW_TOKENS,
        progress="rollouts",
    )
    samples = [
        {"prompt_ids": e.prompt_ids, "response_ids": c.ids} for e, g in zip(examples, groups) for c in g if c.ids
    ]
    logps, seconds = {}, {}
    for precision in ("fp32", "bf16"):
        started = time.perf_counter()
        logps[precision] = torch.cat(
            grpo.sample_logprobs(
                model, samples, 8, TEMPERATURE, tokenizer.pad_token_id, choose_precision(precision, "cpu")
            )
        )
        seconds[precision] = time.perf_counter() - started
    delta = (logps["bf16"] - logps["fp32"]).abs()
    p32, p16 = logps["fp32"].exp(), logps["bf16"].exp()
    ratio = (logps["bf16"] - logps["fp32"]).exp()
    result = {
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_description(),
        "code": runs.code_state(),
        "model": "smollm2-135m",
        "task": TASK,
        "rollouts": len(samples),
        "response_tokens": delta.numel(),
        "temperature": TEMPERATURE,
        "max_abs_delta_logp": delta.max().item(),
        "mean_abs_delta_logp": delta.mean().item(),
        "median_abs_delta_logp": delta.median().item(),
        "fraction_crossing_threshold": ((p32 < THRESHOLD) != (p16 < THRESHOLD)).float().mean().item(),
        "fraction_below_threshold_fp32": (p32 < THRESHOLD).float().mean().item(),
        "fraction_ratio_outside_clip": ((ratio < 0.8) | (ratio > 1.2)).float().mean().item(),
        "seconds": seconds,
        "fast_bf16": fast_bf16("cpu")[0],
        "why": fast_bf16("cpu")[1],
    }
    output = out
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1))
    print(
        f"{result['rollouts']} rollouts, {result['response_tokens']} response tokens: "
        f"|delta log p| max {result['max_abs_delta_logp']:.3f}, "
        f"mean {result['mean_abs_delta_logp']:.4f}; p_t crosses {THRESHOLD}: "
        f"{result['fraction_crossing_threshold']:.2%} of tokens "
        f"({result['fraction_below_threshold_fp32']:.1%} below it in fp32); ratio outside [0.8, 1.2]: "
        f"{result['fraction_ratio_outside_clip']:.2%}"
    )
    print(f"log-prob pass: fp32 {seconds['fp32']:.1f} s, bf16 {seconds['bf16']:.1f} s ({result['why']}) -> {output}")


if __name__ == "__main__":
    tyro.cli(main)
