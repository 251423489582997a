"""Full fine-tuning against LoRA adapters on the README's CPU quickstart (spo_chain.py, SmolLM2-135M, sums of two
one-digit numbers, 4 iterations): which learning rate a rank-16 adapter wants, on several seeds. Each setting and seed
runs in its own process, one after the other, alone on the machine; for each: the peak resident memory (the process's
maximum RSS, from wait4), the parameters it trains, the seconds per iteration (the mean of time/iteration_seconds),
the per-token KL to the reference at the last iteration (losses/kl_per_token), and greedy held-out accuracy on the
run's 40 held-out questions (eval.py on the final checkpoint, per question) against the base model's on the same
questions (eval.py on the base, once per seed).

Across seeds: each setting's gain (after - before) and each LoRA setting's final accuracy minus full fine-tuning's, the
mean over seeds of the per-seed paired difference, with a 95 % bootstrap interval resampling the seeds and, crossed,
the questions (measures.across_seeds): every seed answers the same held-out questions.

  python -m experiments.lora                      # full 1e-5; r16 at 1e-4, 3e-4, 1e-3; seeds 0-2 (~45 min)
  python -m experiments.lora --seeds 0 --settings r16:1e-3
"""

import json
import math
import sys
import tempfile
import time
from pathlib import Path

import tyro

import eval as ev
from experiments.measures import across_seeds
from experiments.quickstart_runs import QUICKSTART, TASK, measured_run, trainable
from plumbing import UsageError, runs, shown
from plumbing.precision import cpu_description

ROOT = Path(__file__).resolve().parents[1]


def setting_flags(setting: str) -> tuple[int, list[str]]:
    """'full:1e-5' -> (0, ['--lr', '1e-5']); 'r16:1e-3' -> (16, ['--lora-rank', '16', '--lr', '1e-3']).

    >>> setting_flags("r16:3e-4")
    (16, ['--lora-rank', '16', '--lr', '3e-4'])
    """
    if problem := setting_problem(setting):
        raise UsageError(problem)
    kind, rate = setting.split(":")
    if kind == "full":
        return 0, ["--lr", rate]
    return int(kind[1:]), ["--lora-rank", kind[1:], "--lr", rate]


def setting_problem(setting: str) -> str | None:
    """Why `setting` is not full:RATE or rRANK:RATE with a positive rank and a positive rate; None when it is.

    >>> setting_problem("r16:3e-4"), setting_problem("full:fast")
    (None, '--settings full:fast: the rate fast is not a positive number (e.g. full:1e-5)')
    """
    kind, colon, rate = setting.partition(":")
    if not colon or kind != "full" and not (kind[:1] == "r" and kind[1:].isascii() and kind[1:].isdigit()):
        return f"--settings {setting}: give full:RATE or rRANK:RATE (e.g. r16:1e-3)"
    if kind != "full" and int(kind[1:]) < 1:
        return f"--settings {setting}: the rank {kind[1:]} is not a positive integer"
    try:
        value = float(rate)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        return f"--settings {setting}: the rate {rate} is not a positive number (e.g. {kind}:1e-5)"
    return None


def check_flags(settings: tuple[str, ...], seeds: tuple[int, ...], resamples: int) -> None:
    """Every problem with the command line in one UsageError, before anything loads (a setting refused only by its
    run would come after the base model's evaluation)."""
    problems = [problem for setting in settings if (problem := setting_problem(setting))]
    problems += [
        f"--settings {setting} is given twice" for setting in sorted(set(settings)) if settings.count(setting) > 1
    ]
    if not settings:
        problems.append("--settings needs at least one setting")
    if not seeds:
        problems.append("--seeds needs at least one seed")
    if bad := [str(seed) for seed in seeds if not 0 <= seed < 2**32]:
        problems.append(f"--seeds {' '.join(bad)}: each seed must be in [0, {2**32 - 1}]")
    if resamples < 1:
        problems.append(f"--resamples {resamples} must be at least 1")
    if problems:
        raise UsageError("; ".join(problems))


def held_out_scores(model: str, seed: int, output: Path) -> list[float]:
    """Per-question greedy scores of `model` on the quickstart's 40 held-out questions, the same for every `seed` (the
    questions and settings of the run's own evaluation; eval.py's results JSON goes to `output`)."""
    result = ev.main(
        ev.EvalArgs(
            model=model,
            task=TASK,
            split="test",
            limit=40,
            samples=1,
            temperature=0.0,
            max_new_tokens=64,
            context=512,
            backend="hf",
            seed=seed,
            precision="auto",
            output=str(output),
        )
    )
    return [r["scores"][0] for r in result["records"]]


def main(
    settings: tuple[str, ...] = ("full:1e-5", "r16:1e-4", "r16:3e-4", "r16:1e-3"),
    seeds: tuple[int, ...] = (0, 1, 2),
    resamples: int = 10_000,
    out: Path = ROOT / "experiments/results/lora.json",
):
    """Run the quickstart for each setting (full:RATE = full fine-tuning at --lr RATE; rRANK:RATE = --lora-rank RANK
    at --lr RATE) and seed; write the figures and the across-seed comparisons to `out`."""
    check_flags(settings, seeds, resamples)
    record = {"measured": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_description(), "code": runs.code_state()}
    parameters = {setting: trainable(setting_flags(setting)[0]) for setting in settings}
    before, results = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in seeds:
            before[seed] = held_out_scores("smollm2-135m", seed, Path(scratch) / f"base_{seed}.json")
            print(f"seed {seed}: the base model {sum(before[seed]) / len(before[seed]):.3f} on the held-out questions")
            for setting in settings:
                rank, flags = setting_flags(setting)
                started = time.perf_counter()
                run_dir = Path(scratch) / f"{setting.replace(':', '_')}_{seed}"
                result = measured_run([*flags, "--seed", str(seed)], run_dir)
                run = next(p for p in run_dir.iterdir() if p.is_dir())
                after = held_out_scores(str(run / "checkpoint"), seed, Path(scratch) / f"eval_{run.name}.json")
                trained, total = parameters[setting]
                result |= {"setting": setting, "rank": rank, "seed": seed, "trainable_parameters": trained}
                result |= {"parameters": total, "scores_before": before[seed], "scores_after": after}
                results.append(result)
                print(
                    f"{setting} seed {seed}: {sum(before[seed]) / 40:.3f} -> {sum(after) / 40:.3f} (the run's own: "
                    f"{result['accuracy_before']:.3f} -> {result['accuracy_after']:.3f}), KL/token "
                    f"{result['kl_per_token_last']:.3g}, peak RSS {result['peak_rss_mib']:.0f} MiB, "
                    f"{result['seconds_per_iteration']:.1f} s per iteration ({time.perf_counter() - started:.0f} s)"
                )
    summary = summarise(results, settings, resamples)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {**record, "quickstart": " ".join(QUICKSTART), "seeds": list(seeds), "summary": summary, "runs": results}
    out.write_text(json.dumps(body, indent=1))
    print(f"-> {out}")


def summarise(results: list[dict], settings: tuple[str, ...], resamples: int) -> dict:
    """Per setting, across seeds: mean accuracy before and after, the gain (after - before) with its interval, the
    final accuracy minus the first setting's (full fine-tuning), the KL at the end, memory and speed."""
    by_setting = {s: [r for r in results if r["setting"] == s] for s in settings}
    summary = {}
    for setting, rows in by_setting.items():
        gain = across_seeds({str(r["seed"]): (r["scores_after"], r["scores_before"]) for r in rows}, resamples)
        reference = {r["seed"]: r for r in by_setting[settings[0]]}
        versus = across_seeds(
            {str(r["seed"]): (r["scores_after"], reference[r["seed"]]["scores_after"]) for r in rows}, resamples
        )
        mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        summary[setting] = {
            "before": sum(sum(r["scores_before"]) / len(r["scores_before"]) for r in rows) / len(rows),
            "after": sum(sum(r["scores_after"]) / len(r["scores_after"]) for r in rows) / len(rows),
            "after_per_seed": [sum(r["scores_after"]) / len(r["scores_after"]) for r in rows],
            "gain": gain["difference"],
            "gain_ci": gain["ci"],
            f"after_minus_{settings[0]}": versus["difference"],
            f"after_minus_{settings[0]}_ci": versus["ci"],
            "kl_per_token_last": mean("kl_per_token_last"),
            "kl_per_token_last_per_seed": [r["kl_per_token_last"] for r in rows],
            "peak_rss_mib": mean("peak_rss_mib"),
            "seconds_per_iteration": mean("seconds_per_iteration"),
        }
        low, high = gain["ci"]
        print(
            f"{setting}: {summary[setting]['before']:.3f} -> {summary[setting]['after']:.3f}, gain "
            f"{gain['difference']:+.3f} [{low:+.3f}, {high:+.3f}] over {len(rows)} seeds; KL/token at the end "
            f"{summary[setting]['kl_per_token_last']:.3g}"
        )
    return summary


if __name__ == "__main__":
    try:
        tyro.cli(main)
    except UsageError as error:
        sys.exit(f"error: {shown(error)}")
