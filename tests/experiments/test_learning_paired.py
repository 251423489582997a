"""experiments/learning_paired.py: the intervals it takes from measures.py (Wilson for one accuracy, paired bootstrap
for a difference, within a seed and across seeds), and its comparison of learning.py's runs question by question (the
evaluation itself replaced by fixed scores)."""

import json
import re
from pathlib import Path

import pytest

from experiments import learning_paired as lp
from experiments import measures
from plumbing import UsageError


def test_wilson_interval_matches_the_textbook_values():
    low, high = measures.wilson(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    low, high = measures.wilson(0, 20)
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(0.1611, abs=1e-4)


def test_paired_difference_and_its_interval():
    same = measures.paired([1, 0, 1, 1], [1, 0, 1, 1], resamples=200)
    assert same["difference"] == 0 and same["ci"] == [0, 0]
    assert (same["only_first_right"], same["only_second_right"]) == (0, 0)
    a = [1, 1, 1, 0, 1, 0, 1, 1, 0, 1] * 5
    b = [1, 0, 0, 0, 1, 1, 0, 1, 0, 0] * 5
    result = measures.paired(a, b, resamples=2000)
    assert result["difference"] == pytest.approx(0.3)
    assert result["ci"][0] < 0.3 < result["ci"][1] and result["ci"][0] > 0  # 20 + vs 5 - over 50 questions
    assert (result["only_first_right"], result["only_second_right"]) == (20, 5)


def learning_results(tmp_path: Path, accuracy_after: dict[str, float]) -> Path:
    runs = []
    for algorithm, after in accuracy_after.items():
        run_dir = tmp_path / "runs" / algorithm
        (run_dir / "checkpoint").mkdir(parents=True)
        command = "python x.py --model smollm2-135m --task rg:chain_sum --seed 2 --max-new-tokens 128 --context 512"
        runs.append(
            {
                "algorithm": algorithm,
                "seed": 2,
                "run_dir": str(run_dir),
                "command": command,
                "accuracy_before": 0.25,
                "accuracy_after": after,
            }
        )
    path = tmp_path / "learning.json"
    path.write_text(json.dumps({"args": {}, "runs": runs}))
    return path


SCORES = {"start": [1, 0, 0, 0], "grpo": [1, 1, 0, 0], "spo_tree": [1, 1, 1, 0]}


def fake_evaluate(calls):
    def evaluate(model, run, output):
        calls.append((model, run["seed"], output.name))
        name = "start" if model == "smollm2-135m" else Path(model).parent.name
        return SCORES[name], "set-a"

    return evaluate


def test_runs_are_compared_question_by_question(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(lp, "evaluate", fake_evaluate(calls))
    path = learning_results(tmp_path, {"grpo": 0.5, "spo_tree": 0.5})  # spo_tree's re-evaluation gives 0.75
    out = tmp_path / "paired.json"
    lp.main(lp.Args(learning=path, out=out, resamples=500))
    assert [c[0] for c in calls] == [
        "smollm2-135m",
        str(tmp_path / "runs/grpo/checkpoint"),
        str(tmp_path / "runs/spo_tree/checkpoint"),
    ]
    assert json.loads(out.read_text())["seeds"]["2"]["heldout"] == "set-a"  # what --pool checks
    table = json.loads(out.read_text())["seeds"]["2"]["algorithms"]
    assert table["start"]["accuracy"] == 0.25 and table["start"]["matches_recorded"]
    assert table["grpo"]["matches_recorded"] and table["grpo"]["minus_grpo"] is None
    assert table["spo_tree"]["accuracy"] == 0.75 and not table["spo_tree"]["matches_recorded"]
    assert table["spo_tree"]["minus_grpo"]["difference"] == 0.25
    assert table["spo_tree"]["minus_start"]["difference"] == 0.5
    assert (
        table["spo_tree"]["minus_grpo"]["only_first_right"],
        table["spo_tree"]["minus_grpo"]["only_second_right"],
    ) == (1, 0)


def test_missing_checkpoints_and_reference_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(lp, "evaluate", fake_evaluate([]))
    path = learning_results(tmp_path, {"spo_tree": 0.75})
    with pytest.raises(UsageError, match="--reference grpo: seed 2 has runs of \\['spo_tree'\\] only"):
        lp.main(lp.Args(learning=path, out=tmp_path / "paired.json"))
    (tmp_path / "runs" / "spo_tree" / "checkpoint").rmdir()
    with pytest.raises(UsageError, match="have no checkpoint any more"):
        lp.main(lp.Args(learning=path, out=tmp_path / "paired.json"))


def test_seeds_pool_as_the_mean_of_their_paired_differences(tmp_path):
    def paired_output(path: Path, seeds: dict[str, tuple[list[int], list[int]]], heldout: str = "set-a") -> Path:
        seeds = {s: {"heldout": heldout, "scores": {"int20": a, "mask": b}} for s, (a, b) in seeds.items()}
        path.write_text(json.dumps({"seeds": seeds}))
        return path

    one = paired_output(tmp_path / "a.json", {"2": ([1, 1, 1, 1], [1, 0, 1, 0])})  # +0.5
    two = paired_output(tmp_path / "b.json", {"0": ([1, 0, 1, 1], [1, 0, 1, 1]), "1": ([1, 1, 0, 0], [0, 1, 0, 0])})
    out = tmp_path / "pooled.json"
    lp.main(lp.Args(pool=(one, two), algorithm="int20", reference="mask", out=out, resamples=500))
    result = json.loads(out.read_text())
    assert result["difference"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert [result["seeds"][s]["difference"] for s in ("0", "1", "2")] == [0.0, 0.25, 0.5]
    assert result["ci"][0] <= result["difference"] <= result["ci"][1]
    assert result["heldout"] == "set-a"
    # seeds and questions resampled: runs that agree on every question of every seed add no spread ...
    same = measures.across_seeds({"0": ([1, 0], [1, 0]), "1": ([0, 1], [0, 1])}, 100)
    assert same["difference"] == 0 and same["ci"] == [0, 0]
    # ... and the seeds' own spread widens the interval: +1 on every question of one seed, -1 on the other's, where
    # resampling questions within seeds alone gives [0, 0]
    spread = measures.across_seeds({"0": ([1, 1, 1], [0, 0, 0]), "1": ([0, 0, 0], [1, 1, 1])}, 2000)
    assert spread["difference"] == 0 and spread["ci"] == [-1, 1]
    # the same question draw for every seed: two seeds that differ on the same question move together
    crossed = measures.across_seeds({"0": ([1, 0, 0, 0], [0, 0, 0, 0]), "1": ([1, 0, 0, 0], [0, 0, 0, 0])}, 4000)
    within = measures.paired([1, 0, 0, 0] * 2, [0] * 8, 4000)  # 8 questions each drawn on its own
    assert crossed["ci"][1] - crossed["ci"][0] > within["ci"][1] - within["ci"][0]
    with pytest.raises(ValueError, match="different numbers of questions"):
        measures.across_seeds({"0": ([1, 0], [1, 0]), "1": ([0, 1, 1], [0, 1, 1])}, 100)
    # seeds evaluated on different held-out sets are refused, as is a file that records none
    other = paired_output(tmp_path / "c.json", {"3": ([1, 1, 1, 1], [0, 0, 0, 0])}, heldout="set-b")
    with pytest.raises(UsageError, match="answered different held-out questions"):
        lp.main(lp.Args(pool=(one, other), algorithm="int20", reference="mask", out=tmp_path / "refused.json"))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"seeds": {"4": {"scores": {"int20": [1], "mask": [0]}}}}))
    with pytest.raises(UsageError, match="records no held-out set"):
        lp.main(lp.Args(pool=(one, old), algorithm="int20", reference="mask", out=tmp_path / "refused.json"))
    assert not (tmp_path / "refused.json").exists()
    with pytest.raises(UsageError, match="seed 2 is in two files"):
        lp.main(lp.Args(pool=(one, one), algorithm="int20", reference="mask", out=out))
    with pytest.raises(UsageError, match="not ppo and mask"):
        lp.main(lp.Args(pool=(one,), algorithm="ppo", reference="mask", out=out))


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"seeds": {"2": {"scores": {"int20": [1, 0', "is not valid JSON"),  # cut short
        ("[]", "holds a JSON list, not a JSON object"),
        ('{"seeds": {}}', '"seeds" is {}, not an object of seeds'),
        ('{"seeds": {"2": {"scores": null}}}', "seeds.2.scores is null, not an object"),
        ('{"seeds": {"2": {"scores": {"int20": [1, NaN], "mask": [1, 0]}}}}', "seeds.2.scores.int20[1] is NaN, not"),
        ('{"seeds": {"2": {"scores": {"int20": [1, "1"], "mask": [1, 0]}}}}', 'seeds.2.scores.int20[1] is "1", not'),
        ('{"seeds": {"2": {"scores": {"int20": [1, 0], "mask": "1, 0"}}}}', 'seeds.2.scores.mask is "1, 0", not a'),
        ('{"seeds": {"2": {"scores": {"int20": [], "mask": []}}}}', "seeds.2.scores.int20 is [], not a list"),
        ('{"seeds": {"2": {"scores": {"int20": [1, 0, 1], "mask": [1, 0]}}}}', "3 scores of int20 and 2 of mask"),
        ('{"seeds": {"2": {"scores": {"int20": [1, 7], "mask": [1, 0]}}}}', "seeds.2.scores.int20[1] is 7, not a"),
        ('{"seeds": {"2": {"heldout": null, "scores": {"int20": [1], "mask": [1]}}}}', "seeds.2.heldout is null, not"),
        ('{"seeds": {"2": {"scores": {"int20": [1], "mask": [1]}}}}', "seed 2 records no held-out set"),
    ],
)
def test_a_pool_file_cut_short_or_edited_is_one_line_naming_the_field(content, message, tmp_path):
    path = tmp_path / "edited.json"
    path.write_text(content)
    out = tmp_path / "pooled.json"
    with pytest.raises(UsageError, match=re.escape(message)) as error:
        lp.main(lp.Args(pool=(path,), algorithm="int20", reference="mask", out=out, resamples=100))
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert not out.exists()  # no NaN and no partial figure written as a result


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda runs: runs[0].pop("seed"), "runs[0].seed is missing, not an integer"),
        (lambda runs: runs[1].update(accuracy_after=float("nan")), "runs[1].accuracy_after is NaN, not a"),
        (lambda runs: runs[0].update(command="python x.py --model m"), "runs[0].command has no --task VALUE"),
        (lambda runs: runs[0].update(command=runs[0]["command"] + " --heldout-seed ²"), "--heldout-seed without a"),
        (lambda runs: runs[0].update(command=runs[0]["command"] + " --heldout-seed"), "--heldout-seed without a"),
        (lambda runs: runs[0].update(run_dir=None), "runs[0].run_dir is null, not a string"),
        (lambda runs: runs.append("grpo"), 'runs[2] is "grpo", not an object'),
    ],
)
def test_a_learning_file_edited_by_hand_is_one_line_naming_the_field(change, message, tmp_path, monkeypatch):
    monkeypatch.setattr(lp, "evaluate", fake_evaluate([]))
    path = learning_results(tmp_path, {"grpo": 0.5, "spo_tree": 0.5})
    saved = json.loads(path.read_text())
    change(saved["runs"])
    path.write_text(json.dumps(saved))
    out = tmp_path / "paired.json"
    with pytest.raises(UsageError, match=re.escape(message)) as error:
        lp.main(lp.Args(learning=path, out=out, resamples=100))
    assert str(path) in str(error.value) and not out.exists()
