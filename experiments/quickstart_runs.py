"""The README's CPU quickstart (spo_chain.py, SmolLM2-135M, sums of two one-digit numbers, 4 iterations) run in a
process of its own and measured, for lora.py and lora_merge_gap.py: its peak resident memory, seconds per iteration,
accuracy before -> after, per-token KL and checkpoint (measured_run, collect), and the parameters a --lora-rank trains
(trainable)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from plumbing import lora, models

ROOT = Path(__file__).resolve().parents[1]

TASK = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
QUICKSTART = (
    f"--model smollm2-135m --task {TASK} --iterations 4 --questions 2 "
    "--group-size 4 --mc-samples 4 --batch-size 8 --micro-batch-size 4 --max-new-tokens 64 --context 512 --epochs 1 "
    "--eval-every 4 --eval-limit 40 --eval-samples 1 --eval-temperature 0 --save-every 4"
).split()


def trainable(rank: int) -> tuple[int, int]:
    """(trainable, all) parameters of SmolLM2-135M at --lora-rank `rank` (0: full fine-tuning)."""
    model, _ = models.load_model("smollm2-135m", device="cpu")
    total = sum(p.numel() for p in model.parameters())
    if rank:
        lora.add_adapters(model, lora.lora_config(rank, None, 0.0, lora.DEFAULT_TARGET))
        total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total


def measured_run(flags: list[str], out: Path) -> dict:
    """One quickstart run with `flags` added, in a process of its own, waited for with wait4 (which reports the
    process's own peak RSS): its figures."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "spo_chain.py"), *QUICKSTART, *flags, "--output-dir", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    error = process.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise SystemExit(f"{' '.join(flags)}: exit {process.returncode}\n{error[-2000:]}")
    return {**collect(flags, out), "peak_rss_mib": usage.ru_maxrss / 1024}


def collect(flags: list[str], out: Path) -> dict:
    """The figures of the run `out` holds: seconds per iteration, accuracy before -> after, the per-token KL to the
    reference at the last iteration, the sampler's largest per-token KL against the trainer, the checkpoint's files
    and size."""
    run_dir = next(p for p in out.iterdir() if p.is_dir())
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [m["time/iteration_seconds"] for m in lines if "time/iteration_seconds" in m]
    sampler = [m["sampler/kl_per_token"] for m in lines if "sampler/kl_per_token" in m]
    kl = [m["losses/kl_per_token"] for m in lines if "losses/kl_per_token" in m]
    return {
        "flags": " ".join(flags),
        "seconds_per_iteration": sum(seconds) / len(seconds),
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "kl_per_token_last": kl[-1] if kl else None,
        "kl_per_token_per_iteration": kl,
        "sampler_kl_per_token_max": max(sampler, default=None),
        "checkpoint_files": sorted(p.name for p in (run_dir / "checkpoint").iterdir()),
        "checkpoint_bytes": sum(p.stat().st_size for p in (run_dir / "checkpoint").iterdir()),
    }
