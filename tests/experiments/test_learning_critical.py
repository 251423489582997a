"""experiments/learning_critical.py: a case's JSON that the sweep reads back (reused by its settings and the code's
hash, which do not cover the file's contents) is checked as data: a hand edit is one line naming the file and the
field, never a TypeError, and never a NaN or a null in the summary."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

from experiments import learning_critical as lc
from plumbing import UsageError

ROOT = Path(__file__).resolve().parents[2]

CASE = ROOT / "experiments" / "results" / "learning_critical_confident_samples_L3.json"  # a case the sweep wrote


def tiny_args(tmp_path: Path) -> lc.Args:
    return dataclasses.replace(lc.Args(), **lc.TINY, tiny=True, out=str(tmp_path / "critical.json"))


def cached_case(run: dict, edit=lambda results: results) -> Path:
    """CASE written where the sweep looks for `run`'s results, with `run`'s settings and this code's hash (a case it
    reuses), after `edit` (which returns what the file holds)."""
    results = json.loads(CASE.read_text())
    results["given_settings"] = json.loads(json.dumps(lc.rounded(run)))
    results["machine"]["code_hash"] = lc.toy.code_hash(*lc.toy.LEARNING_EXACT_CODE)
    Path(run["out"]).write_text(json.dumps(edit(results)))
    return Path(run["out"])


def changed(change):
    def edit(results):
        change(results)
        return results

    return edit


EDITS = [
    (changed(lambda r: r["curves"]["grpo"][0]["J"].__setitem__(3, float("nan"))), "curves.grpo[0].J[3] is NaN, not"),
    (changed(lambda r: r.pop("summary")), "summary is missing, not an object"),
    (changed(lambda r: r.update(curves="grpo")), 'curves is "grpo", not an object'),
    (changed(lambda r: r.update(policy=None)), "policy is null, not an object"),
    (lambda r: list(r), "holds a JSON list, not a JSON object"),
    (changed(lambda r: r["summary"]["grpo"].update(J0="0.5")), 'summary.grpo.J0 is "0.5", not a number from 0'),
    (changed(lambda r: r["summary"]["grpo"].update(J0=1.0)), "summary.grpo.J0 is 1.0, not a number from 0 to below 1"),
    (changed(lambda r: r["summary"]["grpo"].update(auc=[0.5])), "summary.grpo.auc is [0.5], not"),
    (changed(lambda r: r["curves"]["spo_chain_int1"].pop()), "curves.spo_chain_int1 holds 9 runs and curves.grpo 10"),
    (changed(lambda r: r["curves"]["grpo"][1].update(tokens=[1.0])), "curves.grpo[1].tokens holds 1 values for 17"),
    (changed(lambda r: r["length_from_grpo"].update(reached="yes")), 'length_from_grpo.reached is "yes", not true'),
    (changed(lambda r: r["sweep"].pop("grpo_mask")), "sweep.grpo_mask is missing, not an object"),
    (
        changed(lambda r: r["differences"]["ppo_lam1 - grpo"]["auc"].__setitem__(0, float("inf"))),
        "differences.ppo_lam1 - grpo.auc[0] is Infinity, not",
    ),
    (changed(lambda r: r["policy"]["length_right"].update({"000": None})), "policy.length_right.000 is null, not"),
]


def test_a_case_the_sweep_wrote_is_reused_as_it_is(tmp_path):
    run = lc.run_args("coin", "samples", 1, tiny_args(tmp_path))
    cached_case(run)
    results = lc.earlier_run(run)
    assert results["summary"] == json.loads(CASE.read_text())["summary"]
    assert set(lc.leads(results)) >= {"grpo", "spo_chain_int1"}


def test_a_case_cut_short_by_an_interrupted_write_is_run_again(tmp_path):
    run = lc.run_args("coin", "samples", 1, tiny_args(tmp_path))
    cached_case(run)
    path = Path(run["out"])
    path.write_text(path.read_text()[:1000])
    assert lc.earlier_run(run) is None


@pytest.mark.parametrize("edit, message", EDITS)
def test_a_reused_case_edited_by_hand_is_one_line_naming_the_file_and_the_field(edit, message, tmp_path):
    run = lc.run_args("coin", "samples", 1, tiny_args(tmp_path))
    path = cached_case(run, edit)
    with pytest.raises(UsageError, match=re.escape(message)) as error:
        lc.earlier_run(run)
    assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_the_summary_of_reused_cases_holds_no_nan_and_an_edited_one_stops_it(tmp_path):
    args = tiny_args(tmp_path)
    runs = [lc.run_args(kind, axis, filler, args) for kind in lc.KINDS for axis in lc.AXES for filler in args.fillers]
    for run in runs:
        cached_case(run)
    summary = lc.main(args)  # every case reused: no learning_exact.py run
    assert json.loads(Path(args.out).read_text())["cases"] == summary["cases"]
    for by_axis in summary["cases"].values():
        for by_filler in by_axis.values():
            for case in by_filler.values():
                shares = [
                    row["share_of_gain"] for name, row in case["leads"].items() if name != "grpo" and " - " not in name
                ]
                settings = len(json.loads(CASE.read_text())["summary"])  # GRPO is the reference
                assert len(shares) == settings - 1 and all(len(s) == 3 and all(map(math.isfinite, s)) for s in shares)
                pairs = [row["share_of_gain"] for name, row in case["leads"].items() if " - " in name]
                assert pairs and all(len(s) == 3 and all(map(math.isfinite, s)) for s in pairs)
    Path(args.out).unlink()
    cached_case(runs[-1], EDITS[0][0])
    with pytest.raises(UsageError, match=re.escape(f"{runs[-1]['out']}: curves.grpo[0].J[3] is NaN")):
        lc.main(args)
    assert not Path(args.out).exists()
