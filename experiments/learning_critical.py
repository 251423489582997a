"""Does segment credit help where one early token decides the reward? learning_exact.py's critical-token task, swept
over the filler length L, on two axes and in two regimes.

The task (exact_toy.CRITICAL): a prompt of three bits; the reward is 1 for the key bit (the prompt's first bit) as
the first token, then exactly L bits of any value, then EOS. One pre-training recipe at every L (exact_toy.make_policy:
500 steps, then on, 50 at a time, up to 2,000, until every prompt's length is right at least 0.9 of the time, as
often as the corpus makes it, else the case is refused; the key wrong in 45 % of the corpus, so P(key) is about a
half): so only the key decides the start policy's reward (each case records its steps and every prompt's
length_right). Two regimes
(--filler-kinds): coin, every filler bit a coin flip in the corpus, so every filler token is uncertain (p about 0.5,
below SPO's 0.9 threshold: each is a cutpoint and passes the probability mask); confident, the filler bits nearly
always 0, so the policy is sure of every filler token (p > 0.99 at temperature 0.6) and the key is the one uncertain
token: SPO's regime, where cutpoints and the mask fall on the token that decides. Each L's JSON records the start
policy's exact map of credit (policy.position_map: the true |A*| and the share of low-probability tokens at every
response position).

Two axes (--axes), each with its own rates (below):
  tokens   every run stops at B sampled tokens per prompt (responses, MC continuations, tree nodes); each setting's
           size is the one whose cost is closest to --per-iteration x (L + 2) tokens per prompt per iteration
  samples  every setting trains on --samples policy-gradient samples per prompt per iteration (GRPO, SPO-chain, PPO:
           G responses, MC continuations not counted; SPO-tree: the branch factor whose 3-level tree has the number of
           edges closest to it, b 2 for 16: 14 edges), for S optimizer steps
No floor: at each (regime, axis, L) the length (B or S) is where GRPO reaches half its reachable gain, J0 + 0.5 (1 - J0)
(learning_exact --budget-share): GRPO is swept at a provisional length of --steps optimizer steps on both axes (80;
tokens: 80 x --per-iteration x (L + 2) tokens, its G 64 for 80 iterations: at 2,000 x (L + 2), 31 iterations, GRPO
reached half its gain at no L with coin fillers), the length is fixed from its mean curve at the chosen rate, but at
least --min-steps optimizer steps (16; tokens: 16 iterations' worth), and then every setting, GRPO included, is tuned at
that length. The minimum: on the samples axis GRPO gains half in 4-7 steps with confident fillers, where Adam's update
is still near lr x sign(gradient) and the areas rest on 3 points. SPO-tree has 3 levels of 2-token segments at every L
(so L >= 3).
Rates. Each setting's rate comes from 5 tuning seeds on a grid sqrt(3) apart that holds 1e-3 and 3e-3 (1e-3, 1.73e-3,
3e-3, 5.2e-3; a choice on an edge extends it): the highest median area among the rates below the smallest at which a
tuning seed collapsed (--rate-rule; a run collapses when its exact J falls below half its start J, measures.collapsed,
and a rate above one that broke a seed is taken to break seeds too). With 3
seeds and the mean, the sweep picked the fastest rate that survived 3 seeds, often at the edge of collapse; each case
records which choices the mean would have made instead. Every rate of the grid also runs on the reported seeds
(learning_exact --reported-sweep): area against rate per setting (<case>_rates.png), each compared pair's lead at every
rate the settings share beside tuned against tuned, and each setting's collapsed reported runs. "GRPO gains nothing"
in a case: GRPO's own gain, (area - J0) / (1 - J0), has a 95 % interval reaching 0; a lead there is over a policy
that did not move, and the summary marks it. Whitening: grpo_mask_scale and spo_chain_int1_scale are GRPO + mask and
int1 with scale-only whitening (--whiten scale: an advantage of 0 stays 0), each compared with its centre-scale
setting, and int1 with GRPO + mask whitened the same way.
Every run is cached (learning_exact --run-cache, keyed by start policy, settings, code, CPU and torch), so a sweep
cut short goes on from the runs it finished.

Leads over GRPO are paired by seed; the trend reads them on a normalised scale, (area - GRPO's area) / (1 - J0), the
share of the reachable gain, from the shortest L to the longest (unpaired: different start policies).

The prediction, stated before the runs. Samples axis: GRPO's gradient gets noisier with L (the one decisive token's
credit is spread over L + 1 others) while SPO's segment values are not, so if segment credit helps, SPO's normalised
lead over GRPO grows with L, in both regimes. Tokens axis: SPO-chain pays K = 9 MC continuations at every cutpoint;
with coin fillers every filler token is one, so its cost grows about as K (L + 1) / 2 per response and its lead
should shrink with L; with confident fillers there is one cutpoint (the key) per response and its cost is about K +
1 response lengths at every L, so the samples-axis trend should carry over.

Each case is one learning_exact.py run, in a process of its own, writing <out stem>_<kind>_<axis>_L<L>.json + PNG;
the summary (--out, PNG beside it) holds every case's lengths, sizes, leads with paired 95 % intervals, the advantage
maps and the trend. A case whose JSON holds the settings this sweep gives it and was computed by the same code (a
hash, not the commit) is read back, not run again; the summary records each case's commit and hash.

  python -m experiments.learning_critical                    # experiments/results/learning_critical{,_*_L*}.{json,png}
  python -m experiments.learning_critical --filler-kinds confident --axes samples --fillers 3   # one case
  python -m experiments.learning_critical --tiny --out /tmp/critical.json   # seconds: what the tests run
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from experiments import exact_toy as toy
from experiments.measures import area_under, collapsed, in_steps, paired_interval, rounded
from plumbing import UsageError, cli, files, ranges

EXPERIMENT = "experiments.learning_exact"  # what computes each case (python -m), in a process of its own
KINDS = ("coin", "confident")
AXES = ("tokens", "samples")


@dataclass
class Args:
    fillers: ranges.PositiveInts = field(default_factory=lambda: [3, 5, 7])
    """filler lengths L, at least 3 (horizon L + 2; SPO-tree's 3 levels of 2-token segments end inside it)"""
    filler_kinds: list[Literal["coin", "confident"]] = field(default_factory=lambda: list(KINDS))
    """the regimes: coin-flip filler bits (every filler token uncertain), confident ones (the key the one uncertain)"""
    axes: list[Literal["tokens", "samples"]] = field(default_factory=lambda: list(AXES))
    """tokens: equal sampled tokens; samples: equal policy-gradient samples and optimizer steps"""
    per_iteration: ranges.PositiveInt = 64
    """tokens axis: sampled tokens per prompt per iteration = this x (L + 2) (GRPO's G = this)"""
    samples: ranges.PositiveInt = 16
    """samples axis: policy-gradient samples per prompt per iteration (G; SPO-tree: its tree's edges)"""
    steps: ranges.PositiveInt = 80
    """the provisional length of GRPO's length sweep on both axes: this many optimizer steps (tokens axis: B = this x
    the per-iteration tokens, 80 x 64 x (L + 2))"""
    budget_share: ranges.bounded(float, 0, 1, low_open=True, high_open=True) = 0.5
    """the length of each case is where GRPO's mean curve reaches J0 + this x (1 - J0) ..."""
    min_steps: ranges.NonNegativeInt = 16
    """... but at least this many optimizer steps (tokens axis: this x the per-iteration tokens): GRPO gains half in
    4-7 steps on the samples axis with confident fillers, where Adam's update is still near lr x sign(gradient)"""
    seeds: ranges.Seeds = field(default_factory=lambda: list(range(10)))
    """reported seeds (paired by seed)"""
    tuning_seeds: ranges.Seeds = field(default_factory=lambda: [1000, 1001, 1002, 1003, 1004])
    """seeds of the rate sweeps (not reported)"""
    lrs: ranges.PositiveFloats = field(default_factory=lambda: [1e-3, 1.73e-3, 3e-3, 5.2e-3])
    """the rate grid, sqrt(3) apart (extended by --lr-step at an edge, --max-extensions times)"""
    lr_step: ranges.bounded(float, 1, low_open=True) = 3**0.5
    """the grid's extension factor (learning_exact --lr-step; new values rounded to 3 significant digits)"""
    rate_rule: Literal["median-no-collapse", "median", "mean"] = "median-no-collapse"
    """how each setting's rate is chosen from the tuning seeds (learning_exact --rate-rule; every rule's choice is
    recorded, so the summary says which choices the rule changed against the mean)"""
    max_extensions: ranges.NonNegativeInt = 2
    """grid extensions per setting"""
    mistake_rate: ranges.Fraction = 0.9
    """share of corpus rows with a mistake (half of them a wrong key bit): the start policy's P(key) is about 0.5"""
    settings: list[str] = field(
        default_factory=lambda: [
            "grpo",
            "grpo_mask",
            "grpo_mask_scale",
            "spo_chain_int1",
            "spo_chain_int1_scale",
            "spo_tree_uniform",
            "spo_tree_depth",
            "ppo_lam1",
        ]
    )
    """settings to run (grpo is the reference; the _scale ones whiten scale-only, --whiten scale; int5 and PPO lambda
    0.96 are left out by default to fit the compute)"""
    workers: ranges.PositiveInt = 2
    """processes of one torch thread each"""
    out: str = "experiments/results/learning_critical.json"
    """summary JSON (PNG beside it); each case's learning_exact results go to <out stem>_<kind>_<axis>_L<L>.json"""
    tiny: bool = False
    """a seconds-long run for the tests: L 1 and 2 (SPO-tree 2 levels), two prompts, three settings, three seeds"""


TINY = dict(
    fillers=[1, 2],
    per_iteration=4,
    samples=4,
    steps=6,
    min_steps=2,
    seeds=[0, 1, 2],
    tuning_seeds=[100],
    lrs=[1e-3, 1e-2],
    settings=["grpo", "grpo_mask", "spo_chain_int1", "spo_tree_depth"],
)
TINY_RUN = dict(pretrain_steps=200, tree_depth=2, bootstrap=200, workers=1, prompts=["011", "100"])


def case_name(kind: str, axis: str, filler: int) -> str:
    """A case's name in the summary and its file's suffix.

    >>> case_name("coin", "tokens", 3)
    'coin_tokens_L3'
    """
    return f"{kind}_{axis}_L{filler}"


def run_args(kind: str, axis: str, filler: int, args: Args) -> dict:
    """learning_exact's settings for one case, by field name (its flags; the others keep its defaults)."""
    length = filler + 2
    run = dict(
        task="critical",
        filler=filler,
        filler_kind=kind,
        horizon=length,
        tree_depth=3,
        prompts=list(toy.CRITICAL["prompts"]),  # all eight three-bit prompts
        mistake_rate=args.mistake_rate,
        budget_share=args.budget_share,
        min_iterations=args.min_steps,
        seeds=args.seeds,
        tuning_seeds=args.tuning_seeds,
        lrs=args.lrs,
        lr_step=args.lr_step,
        rate_rule=args.rate_rule,
        reported_sweep=True,
        max_extensions=args.max_extensions,
        settings=args.settings,
        workers=args.workers,
        out=str(Path(args.out).with_name(f"{Path(args.out).stem}_{case_name(kind, axis, filler)}.json")),
    )
    if axis == "tokens":  # the provisional B; a run that collapses to short responses stops at 4x the nominal steps
        run.update(
            token_budget=args.steps * args.per_iteration * length,  # GRPO's G for --steps iterations
            budget=args.per_iteration * length,
            iterations=4 * args.steps,
        )
    else:
        run.update(samples=args.samples, iterations=args.steps)
    return {**run, **TINY_RUN} if args.tiny else run


def flags(run: dict) -> list[str]:
    """learning_exact.py's command-line flags for the settings `run` holds.

    >>> flags({"task": "critical", "tuning_seeds": [100, 101], "budget_share": 0.5, "reported_sweep": True})
    ['--task', 'critical', '--tuning-seeds', '100', '101', '--budget-share', '0.5', '--reported-sweep']
    """
    words = []
    for name, value in run.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            words.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            words += [f"--{flag}", *map(str, value if isinstance(value, (list, tuple)) else [value])]
    return words


def earlier_run(run: dict) -> dict | None:
    """The results this case's run wrote before, when its JSON was made with exactly the settings `run` gives it
    (before --budget-share fixed the length: the command's own flags) by the code as it is now (exact_toy.code_hash of
    learning_exact.py, toy_training.py and what they import: the same hash, whatever the commit); else None. An
    interrupted sweep goes on from the next case (its file cut short is run again), and a longer list of L reuses the
    shorter one's cases. The hash covers the code, not the file: what is reused is checked as data (check_case)."""
    path = Path(run["out"])
    if not path.exists():
        return None
    try:
        results = json.loads(files.read_text(path, "the case's results"))
    except (ValueError, RecursionError):  # cut short: a write the sweep's interruption stopped
        print(f"(not reusing {path}: it is not whole JSON, as an interrupted write leaves it; running it again)")
        return None
    if not isinstance(results, dict):
        raise UsageError(f"{path} holds a JSON {type(results).__name__}, not a JSON object: {EDITED}")
    given = field(results, "given_settings", "given_settings", path, "an object")
    made = field(results, "machine", "machine", path, "an object")
    if {name: given.get(name) for name in run} != json.loads(json.dumps(rounded(run))):
        return None
    if made.get("code_hash") != toy.code_hash(*toy.LEARNING_EXACT_CODE):
        print(f"(not reusing {path}: computed by other code, commit {made.get('commit')})", flush=True)
        return None
    check_case(results, path)
    print(f"(reusing {path}: the same settings and code, commit {made.get('commit')})", flush=True)
    return results


def run_learning_exact(run: dict) -> dict:
    """One L: learning_exact.py with `run`'s settings, in a process of its own; the results JSON it wrote."""
    command = [sys.executable, "-m", EXPERIMENT, *flags(run)]
    if subprocess.run(command).returncode:
        raise UsageError(f"L = {run['filler']}: {' '.join(command[1:])} failed (its error is above)")
    return check_case(files.read_json(run["out"], "the case's results"), Path(run["out"]))


# ----------------------------------------------------------------------------------------------
# A case's JSON read back, checked as data: every field the sweep reads, so that a hand edit is one line naming the
# file and the field, and no NaN, null or string reaches the summary's leads and trends

MISSING = object()  # a field the file does not have
FIELD_KINDS = {
    "an object": lambda value: isinstance(value, dict),
    "a list": lambda value: isinstance(value, list),
    "a number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
    "a positive number": lambda value: FIELD_KINDS["a number"](value) and value > 0,
    "a number from 0 to below 1": lambda value: FIELD_KINDS["a number"](value) and 0 <= value < 1,
    "true or false": lambda value: isinstance(value, bool),
}
EDITED = "the case's JSON was edited or damaged; delete it to run the case again"


def field(container: dict | list, key, name: str, path: Path, kind: str):
    """container[key] (the field `name` of the case's JSON at `path`) when it is `kind` (a key of FIELD_KINDS), else
    the UsageError naming the file and the field."""
    value = container.get(key, MISSING) if isinstance(container, dict) else container[key]
    if value is MISSING or not FIELD_KINDS[kind](value):
        quoted = "missing" if value is MISSING else json.dumps(value)
        raise UsageError(
            f"{path}: {name} is {quoted if len(quoted) <= 60 else quoted[:57] + '...'}, not {kind}: {EDITED}"
        )
    return value


def numbers(container: dict, key: str, name: str, path: Path, length: int | None = None) -> list:
    """container[key], the field `name`: a list of finite numbers (`length` of them, when given)."""
    values = field(container, key, name, path, "a list")
    if length is not None and len(values) != length:
        raise UsageError(f"{path}: {name} is {json.dumps(values)[:60]}, not a list of {length} numbers: {EDITED}")
    for index in range(len(values)):
        field(values, index, f"{name}[{index}]", path, "a number")
    return values


def check_case(results: dict, path: Path) -> dict:
    """`results`, one case's learning_exact.py JSON, when every field that main, leads and trend read is what
    learning_exact.py writes; else one UsageError naming the file and the field."""
    policy = field(results, "policy", "policy", path, "an object")
    field(policy, "expected_reward", "policy.expected_reward", path, "a number")
    if policy.get("pretrain_steps") is not None:
        field(policy, "pretrain_steps", "policy.pretrain_steps", path, "a number")
    rights = field(policy, "length_right", "policy.length_right", path, "an object") if "length_right" in policy else {}
    for prompt in rights:
        field(rights, prompt, f"policy.length_right.{prompt}", path, "a number")
    for key in field(policy, "position_map", "policy.position_map", path, "an object"):
        numbers(policy["position_map"], key, f"policy.position_map.{key}", path)
    length = field(results, "length_from_grpo", "length_from_grpo", path, "an object")
    field(length, "length", "length_from_grpo.length", path, "a positive number")
    field(length, "grpo_lr", "length_from_grpo.grpo_lr", path, "a positive number")
    field(length, "reached", "length_from_grpo.reached", path, "true or false")
    settings = field(results, "settings", "settings", path, "an object")
    budget = "iterations" if settings.get("samples") else "token_budget"  # what seed_areas divides by
    field(settings, budget, f"settings.{budget}", path, "a positive number")
    summary = field(results, "summary", "summary", path, "an object")
    curves = field(results, "curves", "curves", path, "an object")
    sweep = field(results, "sweep", "sweep", path, "an object")
    differences = field(results, "differences", "differences", path, "an object")
    field(summary, "grpo", "summary.grpo", path, "an object")
    seeds = len(field(curves, "grpo", "curves.grpo", path, "a list"))
    for name in summary:
        row = field(summary, name, f"summary.{name}", path, "an object")
        field(row, "J0", f"summary.{name}.J0", path, "a number from 0 to below 1")  # leads divide by 1 - J0
        for key in ("size", "lr", "tokens_per_iteration", "iterations"):
            field(row, key, f"summary.{name}.{key}", path, "a number")
        for key in ("auc", "J_100%"):
            numbers(row, key, f"summary.{name}.{key}", path, length=3)
        tuned = field(sweep, name, f"sweep.{name}", path, "an object")
        field(tuned, "at_edge", f"sweep.{name}.at_edge", path, "true or false")
        runs = field(curves, name, f"curves.{name}", path, "a list")
        if len(runs) != seeds or not runs:  # leads pair them with GRPO's by seed
            raise UsageError(
                f"{path}: curves.{name} holds {len(runs)} runs and curves.grpo {seeds}, one a seed: {EDITED}"
            )
        for index in range(len(runs)):
            where = f"curves.{name}[{index}]"
            run = field(runs, index, where, path, "an object")
            j = numbers(run, "J", f"{where}.J", path)
            tokens = numbers(run, "tokens", f"{where}.tokens", path)
            if not j or len(tokens) < len(j) - 1:  # a J before the first iteration and after each
                raise UsageError(f"{path}: {where}.tokens holds {len(tokens)} values for {len(j)} J: {EDITED}")
            stats = field(run, "stats", f"{where}.stats", path, "a list") if "stats" in run else []
            for step in range(len(stats)):
                stat = field(stats, step, f"{where}.stats[{step}]", path, "an object")
                if "samples" in stat:
                    field(stat, "samples", f"{where}.stats[{step}].samples", path, "a number")
    for key in differences:
        entry = field(differences, key, f"differences.{key}", path, "an object")
        for measure in ("auc", "100%"):
            if measure in entry:
                numbers(entry, measure, f"differences.{key}.{measure}", path, length=3)
    return results


def seed_areas(results: dict) -> dict[str, np.ndarray]:
    """[seeds] per setting: the area under J to the case's length on its axis (tokens, or steps on the samples
    axis), from its saved curves at the tuned rates."""
    settings = results["settings"]
    steps = bool(settings.get("samples"))
    length = settings["iterations"] if steps else settings["token_budget"]
    return {
        name: np.array([area_under(in_steps(run) if steps else run, length) for run in runs])
        for name, runs in results["curves"].items()
    }


def share(a: np.ndarray, b: np.ndarray, j0: float, resamples: int) -> list[float] | None:
    """(a - b) / (1 - j0) per seed, a lead as a share of the reachable gain: [mean, low, high], paired 95 % interval."""
    return paired_interval(a / (1 - j0), b / (1 - j0), resamples, seed=0)


def grpo_gain(results: dict, resamples: int = 2000) -> dict:
    """GRPO's own gain in the case, (area - J0) / (1 - J0) per reported seed with its 95 % interval, and whether GRPO
    "gains nothing": that interval reaches 0 or below (a lead over it is then a lead over a policy that did not move).
    """
    areas, j0 = seed_areas(results)["grpo"], results["summary"]["grpo"]["J0"]
    interval = share(areas, np.full(len(areas), j0), j0, resamples)
    return {"share_of_gain": interval, "gains_nothing": interval[1] <= 0}


def collapses(results: dict) -> dict[str, int]:
    """Per setting, how many of its reported runs at its chosen rate collapsed (learning_exact.collapsed: J below half
    the start J after some iteration)."""
    return {name: sum(collapsed(run) for run in runs) for name, runs in results["curves"].items()}


def rate_leads(results: dict, resamples: int = 2000) -> dict:
    """From the reported seeds' sweep (learning_exact --reported-sweep), at every rate all settings ran: each compared
    pair's lead as a share of the reachable gain, paired by seed ({} for a case run without the sweep)."""
    rates = results.get("reported_sweep") or {}
    j0 = results["summary"]["grpo"]["J0"]
    by_setting = rates.get("by_setting", {})
    return {
        lr: {
            pair: share(
                np.array(by_setting[pair.split(" - ")[0]][lr]["scores"]),
                np.array(by_setting[pair.split(" - ")[1]][lr]["scores"]),
                j0,
                resamples,
            )
            for pair in pairs
        }
        for lr, pairs in rates.get("at_common_rates", {}).items()
    }


def whitening_counts(runs: list[dict]) -> dict:
    """What the whitening met in a setting's reported runs, from each iteration's stats: the loss-masked tokens of the
    iteration batch (mean over iterations; the fewest of a run, and of its last iteration, mean over runs) and how many
    advantage-0 tokens the whitening turned positive per iteration (mean). None for runs that did not record them.

    >>> whitening_counts([{"stats": [{"masked_tokens": 40, "zeros_made_positive": 2},
    ...                              {"masked_tokens": 10, "zeros_made_positive": 6}]}])
    {'masked_tokens': {'mean': 25.0, 'fewest': 10.0, 'last': 10.0}, 'zeros_made_positive': 4.0}
    """
    stats = [run["stats"] for run in runs if run["stats"] and "masked_tokens" in run["stats"][0]]
    if not stats:
        return {"masked_tokens": None, "zeros_made_positive": None}
    masked = [[step["masked_tokens"] for step in run] for run in stats]
    return {
        "masked_tokens": {
            "mean": float(np.mean([m for run in masked for m in run])),
            "fewest": float(np.mean([min(run) for run in masked])),
            "last": float(np.mean([run[-1] for run in masked])),
        },
        "zeros_made_positive": float(np.mean([step["zeros_made_positive"] for run in stats for step in run])),
    }


def leads(results: dict, resamples: int = 2000) -> dict:
    """Per setting of one case: its size, rate (and the rate the tuning seeds' mean would have chosen), samples and
    tokens per iteration, area and J at the length, those minus GRPO's (paired by seed), the lead as a share of the
    reachable gain, (area - GRPO's) / (1 - J0), paired 95 % interval, and its collapsed reported runs; then each other
    compared pair (learning_exact.comparison_pairs: SPO-chain against GRPO + mask, scale-only whitening against
    centre-scale, depth against uniform) as "a - b" with the same share."""
    areas, table, fallen = seed_areas(results), {}, collapses(results)
    for name, row in results["summary"].items():
        versus = results["differences"].get(f"{name} - grpo", {})
        runs = results["curves"][name]
        table[name] = {
            "size": row["size"],
            "lr": row["lr"],
            "at_edge": results["sweep"][name]["at_edge"],
            "mean_rule_lr": results["sweep"][name].get("choices", {}).get("mean"),
            "collapsed_runs": fallen[name],
            "runs": len(runs),
            **whitening_counts(runs),
            "samples_per_iteration": float(np.mean([s.get("samples", 0.0) for r in runs for s in r["stats"]])),
            "tokens_per_iteration": row["tokens_per_iteration"],
            "iterations": row["iterations"],
            "J0": row["J0"],
            "auc": row["auc"],
            "J_B": row["J_100%"],
            "auc_minus_grpo": versus.get("auc"),
            "J_B_minus_grpo": versus.get("100%"),
            "share_of_gain": share(areas[name], areas["grpo"], row["J0"], resamples) if name != "grpo" else None,
        }
    j0 = results["summary"]["grpo"]["J0"]
    for pair, difference in results["differences"].items():
        a, b = pair.split(" - ")
        if b != "grpo":
            table[pair] = {
                "auc": difference["auc"],
                "J_B": difference["100%"],
                "share_of_gain": share(areas[a], areas[b], j0, resamples),
            }
    return table


def trend(first: dict, last: dict, resamples: int = 2000, seed: int = 0) -> dict:
    """Whether a setting's lead over GRPO grows with L: per setting, [mean, low, high] of (its lead at the longest L)
    - (its lead at the shortest), each lead (area - GRPO's area) / (1 - J0) per seed (a share of the reachable gain),
    the 95 % interval from resampling each L's seeds on their own (the two L's runs start from different policies:
    unpaired).

    >>> run = lambda j0, areas: {"settings": {"token_budget": 1}, "summary": {"grpo": {"J0": j0}},
    ...     "curves": {n: [{"J": [a, a], "tokens": [1.0]} for a in v] for n, v in areas.items()}}
    >>> trend(run(0.5, {"grpo": [0.5, 0.5], "spo": [0.4, 0.6]}), run(0.6, {"grpo": [0.6, 0.6], "spo": [0.72, 0.72]}))
    {'spo': [0.3, 0.1, 0.5]}
    """
    rng, result = np.random.default_rng(seed), {}
    low_areas, high_areas = seed_areas(first), seed_areas(last)
    low_scale, high_scale = 1 - first["summary"]["grpo"]["J0"], 1 - last["summary"]["grpo"]["J0"]
    for name in low_areas:
        if name == "grpo" or name not in high_areas:
            continue
        a = (high_areas[name] - high_areas["grpo"]) / high_scale
        b = (low_areas[name] - low_areas["grpo"]) / low_scale
        draws = rng.choice(a, (resamples, len(a))).mean(1) - rng.choice(b, (resamples, len(b))).mean(1)
        low, high = np.percentile(draws, [2.5, 97.5])
        result[name] = [round(float(a.mean() - b.mean()), 6), round(float(low), 6), round(float(high), 6)]
    return result


def plot(summary: dict, path: Path) -> None:
    """Each setting's lead over GRPO as a share of the reachable gain against L, paired 95 % intervals: one panel per
    regime and axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = summary["cases"]
    panels = [(kind, axis) for kind in cases for axis in cases[kind]]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), sharey=True, squeeze=False)
    for axis_plot, (kind, axis) in zip(axes[0], panels):
        by_filler = cases[kind][axis]
        fillers = sorted(int(f) for f in by_filler)
        names = [n for n in by_filler[str(fillers[0])]["leads"] if n != "grpo" and " - " not in n]
        for offset, name in enumerate(names):
            rows = [by_filler[str(f)]["leads"][name]["share_of_gain"] for f in fillers]
            x = [f + 0.08 * (offset - len(names) / 2) for f in fillers]
            color, style = toy.PALETTE.get(name, ("gray", "-"))
            axis_plot.errorbar(
                x,
                [r[0] for r in rows],
                yerr=[[r[0] - r[1] for r in rows], [r[2] - r[0] for r in rows]],
                color=color,
                linestyle=style,
                marker="o",
                capsize=2,
                label=name,
            )
        axis_plot.axhline(0, color="black", linewidth=0.8)
        axis_plot.set_xticks(fillers)
        axis_plot.set_xlabel("filler bits L")
        axis_plot.set_title(f"{kind} fillers, equal {'sampled tokens' if axis == 'tokens' else 'samples and steps'}")
    axes[0][0].set_ylabel("(area - GRPO's) / (1 - J0), paired 95 % CI")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def validate(args: Args) -> None:
    """Every problem with the settings in one UsageError line, before any case runs."""
    problems = ranges.problems(args)
    if not args.tiny and min(args.fillers) < 3:
        problems.append(f"--fillers {min(args.fillers)}: at least 3 (SPO-tree's 3 levels of 2-token segments)")
    if "grpo" not in args.settings:
        problems.append("--settings must hold grpo (the reference, and what fixes each case's length)")
    if problems:
        raise UsageError("; ".join(problems))


def main(args: Args) -> dict:
    if args.tiny:
        args = dataclasses.replace(args, **TINY)
    validate(args)
    started = time.time()
    code = toy.machine("experiments/learning_critical.py", *toy.LEARNING_EXACT_CODE)  # the code as it starts
    cases, trends, maps, files, made = {}, {}, {}, {}, {}
    for kind in args.filler_kinds:
        for axis in args.axes:
            ends = []  # the shortest and the longest L's results
            for filler in args.fillers:
                name = case_name(kind, axis, filler)
                print(f"--- {name}: {kind} fillers, the {axis} axis, L {filler} (horizon {filler + 2})", flush=True)
                run = run_args(kind, axis, filler, args)
                results = earlier_run(run) or run_learning_exact(run)
                policy = results["policy"]
                rights = policy.get("length_right") or {}
                cases.setdefault(kind, {}).setdefault(axis, {})[str(filler)] = {
                    "start_policy": {
                        "J0": policy["expected_reward"],
                        "pretrain_steps": policy.get("pretrain_steps"),
                        "length_right_min": min(rights.values(), default=None),
                    },
                    "length": results["length_from_grpo"],
                    "grpo_gain": grpo_gain(results),
                    "leads": leads(results),
                    "leads_at_rates": rate_leads(results),
                }
                maps.setdefault(kind, {})[str(filler)] = results["policy"]["position_map"]
                files[name] = run["out"]
                made[name] = {
                    key: results["machine"].get(key)
                    for key in ("commit", "tree_modified", "imported_code_modified", "code_hash")
                }
                ends = [ends[0] if ends else results, results]
            trends.setdefault(kind, {})[axis] = trend(*ends)
    summary = rounded(
        {
            "command": " ".join(["python", "-m", "experiments.learning_critical", *sys.argv[1:]]),
            "settings": asdict(args),
            "files": files,
            "code_by_case": made,  # each case's JSON's own code: reused ones keep the commit that computed them
            "seconds": time.time() - started,
            "machine": code,
            "advantage_maps": maps,  # per regime and L: per response position, the start policy's true |A*| and
            "cases": cases,  # share of low-probability tokens
            "trend": {"from_filler": args.fillers[0], "to_filler": args.fillers[-1], **trends},
        }
    )
    output = Path(args.out)
    output.write_text(json.dumps(summary, indent=1))
    plot(summary, output.with_suffix(".png"))
    print_summary(summary)
    print(f"{summary['seconds']:.0f}s -> {output} and {output.with_suffix('.png')}")
    return summary


def interval(value: list[float]) -> str:
    """[mean, low, high] as the tables print it.

    >>> interval([0.1, -0.02, 0.3])
    '+0.100 [-0.020, +0.300]'
    """
    return f"{value[0]:+.3f} [{value[1]:+.3f}, {value[2]:+.3f}]"


def print_summary(summary: dict) -> None:
    """Per case: the length, then each setting's size, rate and lead as a share of the reachable gain; the trends."""
    for kind, by_axis in summary["cases"].items():
        for axis, by_filler in by_axis.items():
            for filler, case in by_filler.items():
                length = case["length"]
                unit = "steps" if axis == "samples" else "tokens"
                gain = case["grpo_gain"]["share_of_gain"]
                print(
                    f"\n{kind} fillers, {axis} axis, L {filler}: {length['length']} {unit} (GRPO lr "
                    f"{length['grpo_lr']:g}{'' if length['reached'] else ', half gain not reached'}); GRPO's own gain "
                    f"{interval(gain)}{' - GRPO GAINS NOTHING' if case['grpo_gain']['gains_nothing'] else ''}"
                )
                for name, row in case["leads"].items():
                    if " - " in name:
                        print(f"  {name:<40} {interval(row['share_of_gain'])}")
                        continue
                    cell = interval(row["share_of_gain"]) if row["share_of_gain"] else "reference"
                    changed = (
                        f" (mean rule: {row['mean_rule_lr']:g})" if row["mean_rule_lr"] not in (None, row["lr"]) else ""
                    )
                    fallen = f"  {row['collapsed_runs']}/{row['runs']} collapsed" if row["collapsed_runs"] else ""
                    masked = row["masked_tokens"]
                    if masked:
                        fallen += f"  masked tokens {masked['mean']:.0f} (fewest {masked['fewest']:.0f})"
                        fallen += f", zeros made positive {row['zeros_made_positive']:.1f}"
                    print(
                        f"  {name:<22} size {row['size']:>3} lr {row['lr']:<8g} area {row['auc'][0]:.3f}  {cell}"
                        f"{fallen}{changed}"
                    )
                for lr, pairs in case["leads_at_rates"].items():
                    cells = ", ".join(f"{pair} {interval(value)}" for pair, value in pairs.items() if value)
                    print(f"  at lr {lr}: {cells}")
    print(
        f"\nlead at L {summary['trend']['to_filler']} minus lead at L {summary['trend']['from_filler']} "
        "(share of the reachable gain, unpaired 95 % CI):"
    )
    for kind in summary["cases"]:
        for axis, changes in summary["trend"][kind].items():
            for name, c in changes.items():
                print(f"  {kind:<10} {axis:<8} {name:<18} {c[0]:+.3f} [{c[1]:+.3f}, {c[2]:+.3f}]")


if __name__ == "__main__":
    cli.run_cli(main, ranges.cli(Args))
