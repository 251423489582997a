"""Memory of one training micro-batch: full-vocabulary logits against the scripts' chunked LM head,
with and without gradient checkpointing, on SmolLM2-135M (fp32, CPU).

The scripts compute response log-probs by running the LM head on chunks of 512 response positions
(`response_logprobs` in every algorithm script), each recomputed in the backward pass when the micro-batch's
logits would exceed 2**28 entries and kept for it below that: "chunked" is what the scripts do at the measured
size, "chunked-recomputed" forces the recomputation. The reference is the plain way, log-softmax of the model's
full [rows, R, vocab] logits. Each variant runs in its own
process (freed memory is not returned to the system, so variants would skew each other): forward and
backward of the same micro-batch twice, and the figure is the peak resident memory (VmHWM) of the second
pass above what the process held before it (weights, gradients, runtime), with its seconds.

  python -m benchmarks.logprob_memory                       # 16 rows x (64 prompt + 64 response) tokens
  python -m benchmarks.logprob_memory --rows 8 --response-tokens 256
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

import grpo_baseline
from plumbing import models, ranges, runs
from plumbing.precision import cpu_description

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Args:
    model: str = "smollm2-135m"
    """model to measure"""
    rows: ranges.PositiveInt = 16
    """sequences in the micro-batch"""
    prompt_tokens: ranges.PositiveInt = 64
    """prompt length of every row"""
    response_tokens: ranges.PositiveInt = 64
    """response length of every row"""
    out: str = "benchmarks/results/logprob_memory.json"
    """where the JSON goes"""
    variant: str | None = None
    """(internal) run one variant in this process: full | chunked | chunked-recomputed, each also with +gc"""


VARIANTS = ["full", "chunked", "chunked-recomputed", "full+gc", "chunked+gc", "chunked-recomputed+gc"]


def full_logits_logprobs(model, batch: dict, temperature: float) -> torch.Tensor:
    """The reference: the model's full [rows, R, vocab] logits, then log-softmax at the sampled ids."""
    response_len = batch["response_mask"].shape[1]
    positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    # [rows, R, vocab]
    logits = (
        model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=positions,
            use_cache=False,
            logits_to_keep=response_len + 1,
        )
        .logits[:, :-1]
        .float()
        / temperature
    )
    targets = batch["input_ids"][:, -response_len:]  # [rows, R]
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)  # [rows, R]


def peak_rss_kb() -> int:
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))


def measure(args: Args) -> dict:
    """Forward + backward of one micro-batch twice; the second pass's peak above its starting memory."""
    torch.manual_seed(0)
    model, _ = models.load_model(args.model, dtype=torch.float32, device="cpu")
    if args.variant.endswith("+gc"):
        model.activation_checkpointing_enable()
    model.train()
    vocab = model.config.vocab_size
    samples = [
        {
            "prompt_ids": torch.randint(0, vocab, (args.prompt_tokens,)).tolist(),
            "response_ids": torch.randint(0, vocab, (args.response_tokens,)).tolist(),
        }
        for _ in range(args.rows)
    ]
    batch = grpo_baseline.collate(samples, 0, "cpu")
    if args.variant.startswith("full"):
        logprobs = full_logits_logprobs
    elif args.variant.startswith("chunked-recomputed"):
        logprobs = partial(grpo_baseline.response_logprobs, recompute_above=0)
    else:
        logprobs = grpo_baseline.response_logprobs
    weights = torch.randn(args.rows, args.response_tokens)
    for _ in range(2):
        model.zero_grad(set_to_none=False)  # gradients stay allocated: they are part of the base
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident memory
        base, started = peak_rss_kb(), time.perf_counter()
        logps = logprobs(model, batch, 0.7)  # [rows, R]
        (weights * logps).sum().backward()
        seconds, peak = time.perf_counter() - started, peak_rss_kb()
    return {
        "variant": args.variant,
        "base_gb": base / 2**20,
        "peak_above_base_gb": (peak - base) / 2**20,
        "seconds": seconds,
        "logprob_sum": logps.sum().item(),
        "vocab_size": vocab,
    }


def main(args: Args) -> None:
    if args.variant:
        print(json.dumps(measure(args)))
        return
    results = []
    for variant in VARIANTS:
        command = [
            sys.executable,
            "-m",
            "benchmarks.logprob_memory",
            "--variant",
            variant,
            "--model",
            args.model,
            "--rows",
            str(args.rows),
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--response-tokens",
            str(args.response_tokens),
        ]
        done = subprocess.run(
            command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
        if done.returncode:
            raise SystemExit(f"variant {variant} failed:\n{done.stderr[-2000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(
            f"{variant:22s} peak above base {r['peak_above_base_gb']:.2f} GB  {r['seconds']:.1f} s  "
            f"(base {r['base_gb']:.2f} GB)"
        )
    logits_gb = args.rows * args.response_tokens * results[0]["vocab_size"] * 4 / 2**30
    record = {
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": cpu_description(),
        "code": runs.code_state(),
        "settings": asdict(args),
        "one_fp32_logits_tensor_gb": logits_gb,
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"one fp32 [rows, R, vocab] logits tensor: {logits_gb:.2f} GB -> {args.out}")


if __name__ == "__main__":
    main(ranges.cli(Args))
