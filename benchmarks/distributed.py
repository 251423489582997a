"""Many processes on one CPU: the same GRPO iterations in 1 process and in 2 torchrun processes (gloo), seconds per
iteration and the share of it spent in collectives.

Work: SmolLM2-135M-Instruct on rg:chain_sum (two one-digit terms), 8 questions x 4 responses of up to 64 tokens per
iteration, two epochs of one optimizer step over the 32 sequences (the paper's --epochs 2), 3 iterations (the
first is reported apart: it warms up), no evaluation before, the last one's evaluation on 4 questions (not timed:
iteration seconds exclude evaluation).
One process uses every core (torch's threads = cores); each of the 2 processes gets half of them. Collective
seconds are what eval.py's helpers spent in torch.distributed calls (the gradient all-reduce, the sums behind the
whitening and loss counts, gathers for metrics and evaluation, barriers), waiting for the other rank included;
after the run the gradient all-reduce is timed alone (ranks started together by a barrier, median of 3): the
transfer cost of one optimizer step.

  python -m benchmarks.distributed              # writes benchmarks/results/distributed.json (--out elsewhere)
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "distributed.json"
SETTINGS = [
    "--model",
    "smollm2-135m",
    "--task",
    "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1",
    "--backend",
    "hf",
    "--iterations",
    "3",
    "--questions",
    "8",
    "--group-size",
    "4",
    "--max-new-tokens",
    "64",
    "--batch-size",
    "32",
    "--micro-batch-size",
    "8",
    "--no-eval-before",
    "--eval-every",
    "1000",
    "--eval-limit",
    "4",
    "--precision",
    "fp32",
]


def time_collectives(distributed) -> list[float]:
    """Spy on the helpers of plumbing.distributed that run collectives: their wall time (waiting for other ranks
    included) adds up in the returned [seconds], once where one calls another (sum_over_ranks through all_sum)."""
    seconds, depth = [0.0], [0]
    for name in (
        "all_sum",
        "gather",
        "broadcast",
        "barrier",
        "all_reduce_gradients",
        "gather_parameters",
        "full_state_dict",
        "optimizer_state",
    ):

        def timed(*args, _real=getattr(distributed, name), **kwargs):
            started, depth[0] = time.perf_counter(), depth[0] + 1
            try:
                return _real(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    seconds[0] += time.perf_counter() - started

        setattr(distributed, name, timed)
    return seconds


def worker(output_dir: str, report: str) -> None:
    """Run grpo_baseline.main in this process (started by python or torchrun) and let rank 0 write the report."""
    import grpo_baseline as grpo
    from plumbing import cli, distributed, models

    collective_seconds = time_collectives(distributed)
    summary = grpo.main(cli.parse(grpo.Args, SETTINGS + ["--output-dir", output_dir]))
    seconds = distributed.gather([collective_seconds[0]])
    # The gradient all-reduce alone, ranks started together (no waiting for a slower rank): the transfer cost
    # of one optimizer step's communication.
    model, _ = models.load_model(summary["checkpoint"], dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    all_reduce = []
    for _ in range(3):
        distributed.barrier()
        started = time.perf_counter()
        distributed.all_reduce_gradients(model)
        all_reduce.append(time.perf_counter() - started)
    if distributed.rank() == 0:
        metrics = [json.loads(line) for line in Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()]
        Path(report).write_text(
            json.dumps(
                {
                    "metrics": [m for m in metrics if "time/iteration_seconds" in m],
                    "collective_seconds_per_rank": seconds,
                    "gradient_all_reduce_seconds": statistics.median(all_reduce),
                    "gradient_megabytes": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
                }
            )
        )
    if torch.distributed.is_initialized():  # leave together: a rank exiting mid-teardown can abort gloo's threads
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def measure(world: int, scratch: Path) -> dict:
    cores = os.cpu_count() or 1
    report = scratch / f"world{world}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // world))}
    launcher = (
        [sys.executable]
        if world == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    )
    command = launcher + ["-m", "benchmarks.distributed", "--worker", str(scratch / f"runs{world}"), str(report)]
    print(f"{world} process(es): {' '.join(command)}", flush=True)
    subprocess.run(command, cwd=ROOT, env=env, check=True)
    result = json.loads(report.read_text())
    iterations = result["metrics"]
    timed = iterations[1:]  # iteration 1 warms up
    train = sum(m["time/iteration_seconds"] for m in iterations)
    return {
        "processes": world,
        "threads_per_process": max(1, cores // world),
        "first_iteration_seconds": iterations[0]["time/iteration_seconds"],
        "iteration_seconds": statistics.median(m["time/iteration_seconds"] for m in timed),
        "rollout_seconds": statistics.median(m["time/rollout_seconds"] for m in timed),
        "update_seconds": statistics.median(m["time/update_seconds"] for m in timed),
        "collective_seconds_per_rank": result["collective_seconds_per_rank"],
        # the collectives of the whole run (evaluation included) against its training time (evaluation excluded):
        # an upper bound on the training share
        "collective_share_of_training_upper_bound": max(result["collective_seconds_per_rank"]) / train,
        "gradient_all_reduce_seconds": result["gradient_all_reduce_seconds"] if world > 1 else 0.0,
        "gradient_megabytes": result["gradient_megabytes"],
        "reward": [m["charts/reward"] for m in iterations],
    }


def main(out: Path = RESULTS) -> None:
    """Run the same GRPO iterations in both layouts and write the figures to `out`."""
    from plumbing.precision import cpu_description
    from plumbing.runs import code_state

    code = code_state()
    with tempfile.TemporaryDirectory() as scratch:
        runs = [measure(world, Path(scratch)) for world in (1, 2)]
    result = {"cpu": cpu_description(), "code": code, "settings": SETTINGS, "cpu_cores": os.cpu_count(), "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for run in runs:
        print(
            f"{run['processes']} process(es) x {run['threads_per_process']} thread(s): "
            f"{run['iteration_seconds']:.1f} s/iteration "
            f"(rollout {run['rollout_seconds']:.1f}, update {run['update_seconds']:.1f}); collectives "
            f"{max(run['collective_seconds_per_rank']):.1f} s of the run "
            f"(<= {100 * run['collective_share_of_training_upper_bound']:.0f}% of "
            f"training); gradient all-reduce alone {run['gradient_all_reduce_seconds']:.2f} s per step "
            f"({run['gradient_megabytes']:.0f} MB)"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:  # one torchrun process of measure()'s launch
        worker(*sys.argv[2:4])
    else:
        tyro.cli(main)
