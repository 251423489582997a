"""Full fine-tuning against LoRA adapters on the README's CPU quickstart (spo_chain.py, SmolLM2-135M, sums of two
one-digit numbers, 4 iterations): each variant in its own process, one after the other, with its peak resident
memory (the process's maximum RSS, from wait4), the parameters it trains, the seconds per iteration (the mean of
time/iteration_seconds) and greedy held-out accuracy before -> after (40 questions, one seed: a learning check, not a
comparison of the variants' accuracy).

  python benchmarks/lora.py              # full, --lora-rank 16 and 64; writes benchmarks/results/lora.json
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing import lora, models, runs  # noqa: E402
from plumbing.precision import cpu_description  # noqa: E402

QUICKSTART = (
    "--model smollm2-135m --task rg:chain_sum:min_terms=2,max_terms=2,max_digits=1 --iterations 4 --questions 2 "
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


def main(
    ranks: tuple[int, ...] = (0, 16, 64), lora_lr: float = 1e-3, out: Path = ROOT / "benchmarks/results/lora.json"
):
    """Run the quickstart at each rank (0: full fine-tuning at the quickstart's --lr 1e-5; else --lora-rank R at
    `lora_lr`) and write the figures to `out`."""
    results = []
    for rank in ranks:
        flags = ["--lr", "1e-5"] if rank == 0 else ["--lora-rank", str(rank), "--lr", f"{lora_lr:g}"]
        started = time.perf_counter()
        with tempfile.TemporaryDirectory() as directory:
            result = measured_run(flags, Path(directory))
        result["trainable_parameters"], result["parameters"] = trainable(rank)
        result["rank"] = rank
        results.append(result)
        print(
            f"rank {rank}: peak RSS {result['peak_rss_mib']:.0f} MiB, trains {result['trainable_parameters']:,} of "
            f"{result['parameters']:,} parameters, {result['seconds_per_iteration']:.1f} s per iteration, accuracy "
            f"{result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f} ({time.perf_counter() - started:.0f} s)"
        )
    record = {"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_description(), "code": runs.code_state()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**record, "quickstart": " ".join(QUICKSTART), "runs": results}, indent=1))
    print(f"-> {out}")


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
    """The figures of the run `out` holds: seconds per iteration, accuracy before -> after, the sampler's largest
    per-token KL against the trainer, the checkpoint's files and size."""
    run_dir = next(p for p in out.iterdir() if p.is_dir())
    summary = json.loads((run_dir / "summary.json").read_text())
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    seconds = [m["time/iteration_seconds"] for m in lines if "time/iteration_seconds" in m]
    sampler = [m["sampler/kl_per_token"] for m in lines if "sampler/kl_per_token" in m]
    return {
        "flags": " ".join(flags),
        "seconds_per_iteration": sum(seconds) / len(seconds),
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "sampler_kl_per_token_max": max(sampler, default=None),
        "checkpoint_files": sorted(p.name for p in (run_dir / "checkpoint").iterdir()),
        "checkpoint_bytes": sum(p.stat().st_size for p in (run_dir / "checkpoint").iterdir()),
    }


if __name__ == "__main__":
    tyro.cli(main)
