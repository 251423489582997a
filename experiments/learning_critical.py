"""Does segment credit help where one early token decides the reward? learning_exact.py's critical-token task, swept
over the filler length L.

The task (exact_toy.CRITICAL): a prompt of three bits; the reward is 1 for the key bit (the prompt's first bit) as
the first token, then exactly L bits of any value, then EOS. The start policy (pre-trained on a corpus whose key bit is
wrong in --mistake-rate / 2 of its rows) has not learned the key: P(key) is about a half on every prompt, while the
length is nearly always right. So the reward is decided by one token, and credit given to the whole response (GRPO,
PPO with lambda 1) spreads over L + 1 tokens that do not affect it, while segment credit (SPO-chain's MC values at
cutpoints, SPO-tree's sibling segments) can localise it. The prediction under test, whichever way it falls: if
segment credit helps, SPO's lead over GRPO grows with L.

Each L is one learning_exact.py run, in a process of its own (every setting through its script's own functions, the
exact J after every iteration), on the token axis: every run stops at B = --responses x (L + 2) sampled tokens per
prompt (the same number of full-length responses' worth at every L), each setting's rate is the best area under J
against tokens on --tuning-seeds, J is reported at B / 4, B / 2, B interpolated per seed, paired by seed against GRPO;
and every setting again at --common-lr, untuned. The per-iteration size is --per-iteration x (L + 2) tokens per prompt
(GRPO: --per-iteration responses a group). A run whose policy collapses to short responses would need hundreds of
iterations to spend B: every run stops at 4 x the nominal --responses / --per-iteration iterations, and its last J holds
for the rest of B (recorded per run: its tokens). SPO-tree has 3 levels where they fit the horizon (2 at L <= 2). Writes
one learning_exact JSON + PNG per L (out_L{L}.json) and a summary JSON + PNG (--out): per L and setting, the area and J
at B minus GRPO's with paired 95 % intervals, at the tuned rates and at the common rate. An L whose JSON already holds
exactly the settings this sweep gives it (run_args; the others are learning_exact's defaults) is read, not run again.

  python experiments/learning_critical.py                    # experiments/results/learning_critical{,_L*}.{json,png}
  python experiments/learning_critical.py --tiny --out /tmp/critical.json   # seconds: what the tests run
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import exact_toy as toy  # noqa: E402
from measures import area_under, rounded  # noqa: E402

from plumbing import UsageError, cli, ranges  # noqa: E402

EXPERIMENT = "experiments/learning_exact.py"  # what computes each L, in a process of its own


@dataclass
class Args:
    fillers: ranges.PositiveInts = field(default_factory=lambda: [1, 2, 5, 7])
    """filler lengths L (horizon L + 2; the exact enumeration costs 2^(L + 2) prefixes a prompt)"""
    responses: ranges.PositiveInt = 375
    """B = this x (L + 2) sampled tokens per prompt: where every run stops"""
    per_iteration: ranges.PositiveInt = 16
    """learning_exact's --budget = this x (L + 2): sampled tokens per prompt per iteration (GRPO's G = this)"""
    seeds: ranges.Seeds = field(default_factory=lambda: list(range(10)))
    """reported seeds (paired by seed)"""
    tuning_seeds: ranges.Seeds = field(default_factory=lambda: [1000, 1001, 1002, 1003])
    """seeds of the rate sweep (not reported)"""
    lrs: ranges.PositiveFloats = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    """the rate grid (extended by 3x at an edge, --max-extensions times)"""
    max_extensions: ranges.NonNegativeInt = 2
    """grid extensions per setting"""
    common_lr: ranges.PositiveFloat = 1e-3
    """every setting also runs at this rate, untuned"""
    mistake_rate: ranges.Fraction = 0.9
    """share of corpus rows with a mistake (half of them a wrong key bit): the start policy's P(key) is about 0.5"""
    settings: list[str] = field(default_factory=lambda: list(toy.SETTINGS))
    """settings to run (grpo is the reference)"""
    workers: ranges.PositiveInt = 2
    """processes of one torch thread each"""
    out: str = "experiments/results/learning_critical.json"
    """summary JSON (PNG beside it); each L's learning_exact results go to <out stem>_L<L>.json"""
    tiny: bool = False
    """a seconds-long run for the tests: L 1 and 2, two prompts, three seeds, one tuning seed, two rates"""


TINY = dict(fillers=[1, 2], responses=20, per_iteration=4, seeds=[0, 1, 2], tuning_seeds=[100], lrs=[1e-3, 1e-2])
TINY_RUN = dict(pretrain_steps=300, tree_depth=2, bootstrap=200, workers=1)


def run_args(filler: int, args: Args) -> dict:
    """learning_exact's settings for one filler length L, by field name (its flags; the others keep its defaults)."""
    length = filler + 2
    run = dict(
        task="critical",
        filler=filler,
        horizon=length,
        tree_depth=min(3, (length - 1) // 2 + 1),  # SPO-tree's levels above its last (2 tokens each) end inside
        prompts=list(toy.CRITICAL["prompts"]),  # all eight three-bit prompts
        mistake_rate=args.mistake_rate,
        token_budget=args.responses * length,
        budget=args.per_iteration * length,
        iterations=4 * math.ceil(args.responses / args.per_iteration),  # 4 x the nominal count: see the docstring
        seeds=args.seeds,
        tuning_seeds=args.tuning_seeds,
        lrs=args.lrs,
        max_extensions=args.max_extensions,
        common_lr=args.common_lr,
        settings=args.settings,
        workers=args.workers,
        out=str(Path(args.out).with_name(f"{Path(args.out).stem}_L{filler}.json")),
    )
    return {**run, "prompts": ["011", "100"], **TINY_RUN} if args.tiny else run


def flags(run: dict) -> list[str]:
    """learning_exact.py's command-line flags for the settings `run` holds.

    >>> flags({"task": "critical", "tuning_seeds": [100, 101], "common_lr": 0.001})
    ['--task', 'critical', '--tuning-seeds', '100', '101', '--common-lr', '0.001']
    """
    words = []
    for name, value in run.items():
        words += [f"--{name.replace('_', '-')}", *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return words


def earlier_run(run: dict) -> dict | None:
    """The results this L's run wrote before, when its JSON holds exactly the settings `run` gives it and was computed
    by the code as it is now (exact_toy.code_hash of learning_exact.py and what it imports: the same hash, whatever
    the commit); else None. An interrupted sweep goes on from the next L, and a longer list of L reuses the shorter
    one's runs."""
    path = Path(run["out"])
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    saved = results.get("settings") or {}
    if {name: saved.get(name) for name in run} != json.loads(json.dumps(rounded(run))):
        return None
    made = results.get("machine") or {}
    if made.get("code_hash") != toy.code_hash(EXPERIMENT):
        print(f"(not reusing {path}: computed by other code, commit {made.get('commit')})", flush=True)
        return None
    print(f"(reusing {path}: the same settings and code, commit {made.get('commit')})", flush=True)
    return results


def run_learning_exact(run: dict) -> dict:
    """One L: learning_exact.py with `run`'s settings, in a process of its own; the results JSON it wrote."""
    command = [sys.executable, os.path.relpath(toy.ROOT / EXPERIMENT), *flags(run)]
    if subprocess.run(command).returncode:
        raise UsageError(f"L = {run['filler']}: {' '.join(command[1:])} failed (its error is above)")
    return json.loads(Path(run["out"]).read_text())


def leads(results: dict) -> dict:
    """Per setting of one L's results: its rate, area and J at B, and those minus GRPO's (paired by seed) at the
    tuned rates and at the common rate."""
    table = {}
    for kind, summary, differences in (
        ("tuned", results["summary"], results["differences"]),
        ("common", results["common_rate"]["summary"], results["common_rate"]["differences"]),
    ):
        for name, row in summary.items():
            versus = differences.get(f"{name} - grpo", {})
            table.setdefault(name, {})[kind] = {
                "lr": row["lr"],
                "J0": row["J0"],
                "auc": row["auc"],
                "J_B": row["J_100%"],
                "auc_minus_grpo": versus.get("auc"),
                "J_B_minus_grpo": versus.get("100%"),
            }
        depth = differences.get("spo_tree_depth - spo_tree_uniform")
        if depth:
            table.setdefault("spo_tree_depth - spo_tree_uniform", {})[kind] = {
                "auc": depth["auc"],
                "J_B": depth["100%"],
            }
    return table


def seed_leads(results: dict, kind: str) -> dict[str, np.ndarray]:
    """[seeds] per setting: its area under J to B minus GRPO's on the same seed, from one L's saved curves ("tuned"
    rates or the "common" rate)."""
    curves = results["curves"] if kind == "tuned" else results["common_rate"]["curves"]
    budget = results["settings"]["token_budget"]
    reference = np.array([area_under(run, budget) for run in curves["grpo"]])
    return {
        name: np.array([area_under(run, budget) for run in runs]) - reference
        for name, runs in curves.items()
        if name != "grpo"
    }


def trend(first: dict, last: dict, resamples: int = 2000, seed: int = 0) -> dict:
    """Whether a setting's lead over GRPO grows with L: per setting and kind, [mean, low, high] of (its lead at the
    longest L) - (its lead at the shortest), the 95 % interval from resampling each L's seeds on their own (the two
    L's runs start from different policies: unpaired).

    >>> run = lambda areas: {"settings": {"token_budget": 1}, "curves": {n: [{"J": [a, a], "tokens": [1.0]} for a in v]
    ...     for n, v in areas.items()}, "common_rate": {"curves": {"grpo": [{"J": [0.5, 0.5], "tokens": [1.0]}] * 2,
    ...     "spo": [{"J": [0.5, 0.5], "tokens": [1.0]}] * 2}}}
    >>> trend(run({"grpo": [0.5, 0.5], "spo": [0.4, 0.6]}), run({"grpo": [0.5, 0.5], "spo": [0.7, 0.7]}))["tuned"]
    {'spo': [0.2, 0.1, 0.3]}
    """
    rng, result = np.random.default_rng(seed), {}
    for kind in ("tuned", "common"):
        low_leads, high_leads = seed_leads(first, kind), seed_leads(last, kind)
        result[kind] = {}
        for name in low_leads:
            a, b = high_leads[name], low_leads[name]
            draws = rng.choice(a, (resamples, len(a))).mean(1) - rng.choice(b, (resamples, len(b))).mean(1)
            low, high = np.percentile(draws, [2.5, 97.5])
            result[kind][name] = [round(float(a.mean() - b.mean()), 6), round(float(low), 6), round(float(high), 6)]
    return result


def plot(summary: dict, path: Path) -> None:
    """Each setting's area under J minus GRPO's against L, with paired 95 % intervals: tuned rates, common rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fillers = [int(f) for f in summary["by_filler"]]
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    names = [n for n in summary["by_filler"][str(fillers[0])] if n != "grpo" and " - " not in n]
    for axis, kind in zip(axes, ("tuned", "common")):
        for offset, name in enumerate(names):
            rows = [summary["by_filler"][str(f)][name][kind]["auc_minus_grpo"] for f in fillers]
            x = [f + 0.08 * (offset - len(names) / 2) for f in fillers]
            color, style = toy.PALETTE.get(name, ("gray", "-"))
            axis.errorbar(
                x,
                [r[0] for r in rows],
                yerr=[[r[0] - r[1] for r in rows], [r[2] - r[0] for r in rows]],
                color=color,
                linestyle=style,
                marker="o",
                capsize=2,
                label=name,
            )
        axis.axhline(0, color="black", linewidth=0.8)
        axis.set_xticks(fillers)
        axis.set_xlabel("filler bits L (tokens that do not decide the reward)")
        axis.set_title(
            "tuned rates (area under J to B)" if kind == "tuned" else f"common rate {summary['common_lr']:g}"
        )
    axes[0].set_ylabel("area under J to B, minus GRPO's (95 % paired CI)")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(args: Args) -> dict:
    if args.tiny:
        args = dataclasses.replace(args, **TINY)
    started = time.time()
    code = toy.machine("experiments/learning_critical.py", EXPERIMENT)  # the code as it starts
    by_filler, files, made, ends = {}, {}, {}, []  # ends: the shortest and the longest L's results
    for filler in args.fillers:
        length = filler + 2
        print(f"--- L = {filler}: horizon {length}, B = {args.responses * length} tokens per prompt", flush=True)
        run = run_args(filler, args)
        results = earlier_run(run) or run_learning_exact(run)
        by_filler[str(filler)] = leads(results)
        files[str(filler)] = run["out"]
        made[str(filler)] = {key: results["machine"].get(key) for key in ("commit", "tree_modified", "code_hash")}
        ends = [ends[0] if ends else results, results]
    summary = rounded(
        {
            "command": " ".join(["python"] + sys.argv),
            "settings": asdict(args),
            "common_lr": args.common_lr,
            "files": files,
            "code_by_filler": made,  # each L's JSON's own code: reused ones keep the commit that computed them
            "seconds": time.time() - started,
            "machine": code,
            "by_filler": by_filler,
            "trend": {"from_filler": args.fillers[0], "to_filler": args.fillers[-1], **trend(*ends)},
        }
    )
    output = Path(args.out)
    output.write_text(json.dumps(summary, indent=1))
    plot(summary, output.with_suffix(".png"))
    print("\narea under J to B minus GRPO's [95 % paired CI], tuned rates | common rate:")
    for filler, table in by_filler.items():
        for name, row in table.items():
            if name == "grpo" or " - " in name:
                continue
            cells = [row[k]["auc_minus_grpo"] for k in ("tuned", "common")]
            print(f"L {filler:>2}  {name:<18}" + " | ".join(f"{c[0]:+.3f} [{c[1]:+.3f}, {c[2]:+.3f}]" for c in cells))
    print(f"\nlead at L {args.fillers[-1]} minus lead at L {args.fillers[0]} (area, unpaired 95 % CI), tuned | common:")
    for name, change in summary["trend"]["tuned"].items():
        cells = [change, summary["trend"]["common"][name]]
        print(f"{name:<18}" + " | ".join(f"{c[0]:+.3f} [{c[1]:+.3f}, {c[2]:+.3f}]" for c in cells))
    print(f"{summary['seconds']:.0f}s -> {output} and {output.with_suffix('.png')}")
    return summary


if __name__ == "__main__":
    cli.run_cli(main, ranges.cli(Args))
