"""Paired comparison of learning.py's runs: every run's final policy and the starting model answer the same held-out
questions, so two algorithms can be compared question by question instead of through two separate accuracies.

learning.py records one greedy accuracy per run. Here each run's checkpoint (and the starting model) is evaluated
again with eval.py's own `main` under the settings of learning.py's in-run evaluation (the task's test split for
the run's seed, greedy, the runs' --max-new-tokens and --context, --backend hf, --precision auto); each accuracy is
checked against the one learning.py recorded, and per question the difference to a reference algorithm is taken.
Reported: each accuracy with its Wilson 95 % interval over the questions, and each algorithm minus the reference
(and minus the starting model) with a paired 95 % bootstrap interval over questions, plus the discordant questions
(right here and wrong there, and the reverse).

Across seeds (--pool A.json B.json ...: learning_paired outputs, no evaluation): an algorithm minus the reference on
every seed the files hold, each seed's paired difference, and their mean with a 95 % bootstrap interval that resamples
the seeds and, crossed with them, the questions (measures.across_seeds). Every seed answers one held-out set (the
task's test questions do not depend on the run's seed); each output records its set's fingerprint per seed
(`heldout`), and files whose seeds answered different sets are refused, not pooled.

  python -m experiments.learning_paired       # after learning.py; about 8 minutes on 2 cores (6 evaluations)
  python -m experiments.learning_paired --pool runs_a_paired.json runs_b_paired.json --algorithm spo_chain_int20 \
      --reference grpo_mask_4x4 --out pooled.json
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import tyro

import eval as ev
from experiments.measures import across_seeds, paired, wilson
from plumbing import UsageError, files, ranges, runs
from plumbing.cli import run_cli
from plumbing.precision import cpu_description
from plumbing.settings import HELDOUT_SEED

RESULTS = Path(__file__).parent / "results"


@dataclass
class Args:
    learning: Path = RESULTS / "learning_bf16_shared_prompts.json"
    """learning.py's results JSON (its runs' directories must still hold their checkpoints)"""
    out: Path = RESULTS / "learning_paired.json"
    """where the paired figures go (each model's eval.py results JSON is written beside it, in a folder)"""
    reference: str = "grpo"
    """the algorithm every other one is compared with"""
    resamples: ranges.PositiveInt = 10_000
    """bootstrap resamples of the questions"""
    pool: tuple[Path, ...] = ()
    """learning_paired outputs to pool across seeds (no evaluation): --algorithm minus --reference on every seed"""
    algorithm: str = "spo_chain_int20"
    """with --pool: the algorithm compared with --reference"""


def pool(args: Args) -> None:
    """--pool: --algorithm minus --reference on every seed of the given learning_paired outputs, and across them."""
    per_seed, sets = {}, {}
    for path in args.pool:
        if not path.is_file():
            raise UsageError(
                f"--pool {path}: no such file; run python -m experiments.learning_paired --learning ... first"
            )
        for seed, (pair, heldout) in pooled_scores(path, args.algorithm, args.reference).items():
            if seed in per_seed:
                raise UsageError(f"--pool: seed {seed} is in two files; give each seed once")
            per_seed[seed] = pair
            sets.setdefault(heldout, []).append(f"seed {seed} of {path}")
    if len(sets) > 1:
        first, second = (where[0] for where in sets.values())
        raise UsageError(
            f"--pool: {first} and {second} answered different held-out questions (fingerprints {' and '.join(sets)}):"
            " seeds are pooled only on one held-out set; evaluate them on the same --heldout-seed"
        )
    result = across_seeds(dict(sorted(per_seed.items())), args.resamples)
    out = {
        "cpu": cpu_description(),
        "code": runs.code_state(),
        "pool": [str(p) for p in args.pool],
        "heldout": next(iter(sets)),
        "algorithm": args.algorithm,
        "reference": args.reference,
        **result,
    }
    for seed, row in result["seeds"].items():
        low, high = row["ci"]
        print(
            f"seed {seed}: {args.algorithm} - {args.reference} {row['difference']:+.3f} [{low:+.3f}, {high:+.3f}] "
            f"({row['only_first_right']} / {row['only_second_right']} discordant)"
        )
    low, high = result["ci"]
    print(f"across {len(per_seed)} seeds: {result['difference']:+.3f} [{low:+.3f}, {high:+.3f}]")
    args.out.write_text(json.dumps(out, indent=1))
    print(f"-> {args.out}")


# ----------------------------------------------------------------------------------------------
# Results files read back: each field checked, so that a file cut short or edited by hand is one line naming it and
# the field, never a KeyError or a NaN in an interval

MISSING = object()  # a field the file does not have
FLAGS = ("--model", "--task", "--max-new-tokens", "--context")  # what evaluate() takes from a run's command


def described(value) -> str:
    """A field's value as a message quotes it: its JSON, cut at 60 characters ("missing" for MISSING)."""
    if value is MISSING:
        return "missing"
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def wrong(flag: str, path: Path, field: str, value, expected: str) -> UsageError:
    return UsageError(
        f"{flag} {path}: {field} is {described(value)}, not {expected}: the file was cut short or edited; write it "
        "again with the experiment that made it"
    )


def is_score(value) -> bool:
    """A question's score: a number from 0 to 1 (NaN is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def pooled_scores(path: Path, algorithm: str, reference: str) -> dict[str, tuple[tuple[list[float], list[float]], str]]:
    """seed -> ((`algorithm`'s, `reference`'s) per-question scores, the held-out set's fingerprint) of one
    learning_paired output, every field used checked."""
    saved = files.read_json(path, "--pool")
    seeds = saved.get("seeds", MISSING)
    if not isinstance(seeds, dict) or not seeds:
        raise wrong("--pool", path, '"seeds"', seeds, "an object of seeds")
    pairs = {}
    for seed, result in seeds.items():
        scores = result.get("scores", MISSING) if isinstance(result, dict) else result
        if not isinstance(scores, dict):
            raise wrong("--pool", path, f"seeds.{seed}.scores", scores, "an object of per-question scores")
        if algorithm not in scores or reference not in scores:
            raise UsageError(f"{path}: seed {seed} has scores of {sorted(scores)}, not {algorithm} and {reference}")
        for name in (algorithm, reference):
            field, values = f"seeds.{seed}.scores.{name}", scores[name]
            if not isinstance(values, list) or not values:
                raise wrong("--pool", path, field, values, "a list of per-question scores")
            for index, value in enumerate(values):
                if not is_score(value):
                    raise wrong("--pool", path, f"{field}[{index}]", value, "a score from 0 to 1")
        if len(scores[algorithm]) != len(scores[reference]):
            raise UsageError(
                f"--pool {path}: seed {seed} holds {len(scores[algorithm])} scores of {algorithm} and "
                f"{len(scores[reference])} of {reference}, where both answered the same questions: the file was "
                "edited; write it again with python -m experiments.learning_paired"
            )
        heldout = result.get("heldout", MISSING) if isinstance(result, dict) else MISSING
        if heldout is MISSING:
            raise UsageError(
                f"--pool {path}: seed {seed} records no held-out set (seeds.{seed}.heldout), so whether its questions "
                "are the other seeds' is unknown; evaluate it again with python -m experiments.learning_paired"
            )
        if not isinstance(heldout, str) or not heldout:
            raise wrong("--pool", path, f"seeds.{seed}.heldout", heldout, "a held-out set's fingerprint")
        pairs[seed] = ((scores[algorithm], scores[reference]), heldout)
    return pairs


def learning_runs(path: Path) -> list[dict]:
    """learning.py's runs, as its results JSON holds them, every field evaluate() and the table use checked."""
    saved = files.read_json(path, "--learning")
    recorded = saved.get("runs", MISSING)
    if not isinstance(recorded, list) or not recorded:
        raise wrong("--learning", path, '"runs"', recorded, "a list of runs")
    for index, run in enumerate(recorded):
        where = f"runs[{index}]"
        if not isinstance(run, dict):
            raise wrong("--learning", path, where, run, "an object")
        for key, kind, name in (
            ("algorithm", str, "a string"),
            ("run_dir", str, "a string"),
            ("command", str, "a string"),
            ("seed", int, "an integer"),
        ):
            value = run.get(key, MISSING)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise wrong("--learning", path, f"{where}.{key}", value, name)
        for key in ("accuracy_before", "accuracy_after"):
            if not is_score(value := run.get(key, MISSING)):
                raise wrong("--learning", path, f"{where}.{key}", value, "an accuracy from 0 to 1")
        words = run["command"].split()
        for name in FLAGS:
            if name not in words[:-1] or name in ("--max-new-tokens", "--context") and not is_whole(flag(run, name)):
                raise UsageError(
                    f"--learning {path}: {where}.command has no {name} VALUE"
                    f"{' (a whole number)' if name in ('--max-new-tokens', '--context') else ''}: the file was edited; "
                    "write it again with python -m experiments.learning"
                )
        if "--heldout-seed" in words and not ("--heldout-seed" in words[:-1] and is_whole(flag(run, "--heldout-seed"))):
            raise UsageError(
                f"--learning {path}: {where}.command has --heldout-seed without a whole number: the file was edited; "
                "write it again with python -m experiments.learning"
            )
    return recorded


def is_whole(text: str) -> bool:
    """A whole number written in the digits 0-9 ("²" is a digit to str.isdigit, not to int())."""
    return text.isascii() and text.isdigit()


def flag(run: dict, name: str) -> str:
    """The value of `name` on the command line learning.py ran `run` with."""
    words = run["command"].split()
    return words[words.index(name) + 1]


def heldout_fingerprint(questions: list[str]) -> str:
    """The held-out set's fingerprint: its questions, in order (16 hex digits of their SHA-256)."""
    return hashlib.sha256(json.dumps(questions).encode()).hexdigest()[:16]


def evaluate(model: str, run: dict, output: Path) -> tuple[list[float], str]:
    """Per-question greedy scores of `model` on the run's held-out questions, with the run's own settings, and the
    held-out set's fingerprint."""
    result = ev.main(
        ev.EvalArgs(
            model=model,
            task=flag(run, "--task"),
            split="test",
            samples=1,
            temperature=0.0,
            max_new_tokens=int(flag(run, "--max-new-tokens")),
            context=int(flag(run, "--context")),
            backend="hf",
            seed=run["seed"],
            heldout_seed=int(flag(run, "--heldout-seed"))
            if "--heldout-seed" in run["command"].split()
            else HELDOUT_SEED,
            precision="auto",
            output=str(output),
        )
    )
    return [r["scores"][0] for r in result["records"]], heldout_fingerprint([r["question"] for r in result["records"]])


def main(args: Args) -> None:
    if problems := ranges.problems(args):
        raise UsageError("; ".join(problems))
    if args.pool:
        return pool(args)
    if not args.learning.is_file():
        raise UsageError(f"--learning {args.learning}: no such file; run python -m experiments.learning first")
    learning = {"runs": learning_runs(args.learning)}
    missing = [r["run_dir"] for r in learning["runs"] if not (Path(r["run_dir"]) / "checkpoint").is_dir()]
    if missing:
        raise UsageError(
            f"{len(missing)} run(s) of {args.learning} have no checkpoint any more (first: {missing[0]}): re-run "
            "python -m experiments.learning with the same --output-dir"
        )
    folder = args.out.with_suffix("")
    folder.mkdir(parents=True, exist_ok=True)
    out = {"cpu": cpu_description(), "code": runs.code_state(), "learning": str(args.learning), "seeds": {}}
    for seed in sorted({r["seed"] for r in learning["runs"]}):
        seed_runs = {r["algorithm"]: r for r in learning["runs"] if r["seed"] == seed}
        if args.reference not in seed_runs:
            raise UsageError(f"--reference {args.reference}: seed {seed} has runs of {sorted(seed_runs)} only")
        first = next(iter(seed_runs.values()))
        scores, sets = {}, set()
        scores["start"], heldout = evaluate(flag(first, "--model"), first, folder / f"seed{seed}_start.json")
        sets.add(heldout)
        recorded = {"start": first["accuracy_before"]}
        for algorithm, run in seed_runs.items():
            output = folder / f"seed{seed}_{algorithm}.json"
            scores[algorithm], heldout = evaluate(str(Path(run["run_dir"]) / "checkpoint"), run, output)
            sets.add(heldout)
            recorded[algorithm] = run["accuracy_after"]
        n = len(scores["start"])
        table = {}
        for name, s in scores.items():
            accuracy = sum(s) / n
            table[name] = {
                "accuracy": accuracy,
                "wilson_ci": list(wilson(int(sum(s)), n)),
                "recorded_by_learning": recorded[name],
                "matches_recorded": abs(accuracy - recorded[name]) < 1e-9,
                "minus_start": paired(s, scores["start"], args.resamples) if name != "start" else None,
                f"minus_{args.reference}": paired(s, scores[args.reference], args.resamples)
                if name not in ("start", args.reference)
                else None,
            }
        if len(sets) > 1:
            raise UsageError(f"seed {seed}: its runs were evaluated on different held-out sets ({sorted(sets)})")
        out["seeds"][str(seed)] = {"questions": n, "heldout": heldout, "algorithms": table, "scores": scores}
        print(f"seed {seed}: {n} held-out questions, greedy")
        for name, row in table.items():
            line = f"  {name:16s} {row['accuracy']:.3f} [{row['wilson_ci'][0]:.3f}, {row['wilson_ci'][1]:.3f}]"
            if not row["matches_recorded"]:
                line += f" (learning.py recorded {row['recorded_by_learning']:.3f})"
            if versus := row[f"minus_{args.reference}"]:
                low, high = versus["ci"]
                line += (
                    f"  - {args.reference} {versus['difference']:+.3f} [{low:+.3f}, {high:+.3f}]"
                    f" ({versus['only_first_right']} / {versus['only_second_right']} discordant)"
                )
            print(line)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"-> {args.out} (each model's eval.py results in {folder}/)")


if __name__ == "__main__":
    run_cli(main, tyro.cli(Args))
