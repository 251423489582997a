"""experiments/trl_side_by_side.py: the prompts of each step are grpo_baseline.py's, per-step intervals from polled
marks, medians without the warm-up step, ratios and targets, the table and the results file. TRL is a benchmark-only
dependency (requirements-bench.txt): the one test that runs it is skipped where it is not installed (CI)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_baseline as grpo
from experiments import trl_side_by_side as bench
from plumbing import tasks
from plumbing.precision import cpu_description

pytestmark = pytest.mark.slow  # run with --slow (README, Tests)

ROOT = Path(__file__).resolve().parents[2]


def test_prompts_for_steps_are_the_questions_grpo_baseline_trains_on(tiny_model_dir, gsm8k_jsonl, tmp_path):
    summary = grpo.main(
        grpo.Args(
            model=str(tiny_model_dir),
            task=str(gsm8k_jsonl),
            backend="hf",
            iterations=2,
            questions=3,
            group_size=2,
            max_new_tokens=2,
            context=128,
            batch_size=6,
            micro_batch_size=6,
            epochs=1,
            eval_every=1000,
            eval_limit=1,
            eval_samples=1,
            save_every=1000,
            save_samples=1,
            save_questions=3,
            output_dir=str(tmp_path),
            seed=5,
        )
    )
    examples = tasks.load_task(str(gsm8k_jsonl), "train", seed=5)
    expected = bench.prompts_for_steps(examples, questions=3, steps=2, seed=5)
    for iteration in (1, 2):
        records = (Path(summary["run_dir"]) / "samples" / f"iter_{iteration}.jsonl").read_text().splitlines()
        trained = [json.loads(line)["question"] for line in records][::2]  # group size 2
        assert trained == [q.question for q in expected[iteration - 1]]
    assert expected[0] != expected[1]  # each step draws anew


def test_intervals_are_differences_between_first_appearances():
    marks = [
        {"lines": 1, "wall": 5.0, "cpu": 8.0},  # record 0 (e.g. the evaluation before training)
        {"lines": 2, "wall": 15.0, "cpu": 27.0},  # step 1
        {"lines": 4, "wall": 26.0, "cpu": 49.0},  # steps 2 and 3 seen in the same poll
    ]
    assert bench.intervals(marks, [1, 2], "cpu") == [19.0, 22.0]
    assert bench.intervals(marks, [1, 2, 3], "wall") == [10.0, 11.0, None]  # step 3 is not resolvable
    with pytest.raises(ValueError, match="never observed"):
        bench.first_seen(marks, 4)


def _run(side, round_index, walls, cpus, peak, tokens=100, rewards=None):
    rewards = rewards or [0.0] * len(walls)
    steps = [
        {"step": k, "wall_seconds": w, "cpu_seconds": c, "generated_tokens": tokens, "reward": r}
        for k, (w, c, r) in enumerate(zip(walls, cpus, rewards), 1)
    ]
    return {
        "side": side,
        "round": round_index,
        "steps": steps,
        "peak_rss_train_gb": peak,
        "peak_rss_overall_gb": peak + 0.5,
        "peak_tree_rss_gb": peak + 1.0,
    }


def test_summary_medians_skip_the_warm_up_step_and_ratios_meet_targets():
    runs = [
        _run("ours", 1, [50.0, 10.0, 12.0], [90.0, 20.0, 22.0], 2.0, tokens=3000, rewards=[0.1, 0.2, 0.3]),
        _run("trl", 1, [99.0, 20.0, 30.0], [150.0, 40.0, 44.0], 10.0, tokens=2000),
        _run("ours", 2, [40.0, 14.0, 16.0], [80.0, 24.0, 26.0], 3.0, tokens=3000, rewards=[0.3, 0.4, 0.5]),
        _run("trl", 2, [88.0, 25.0, 35.0], [140.0, 42.0, 46.0], 9.0, tokens=2000),
    ]
    summary = bench.summarise(runs, steps=3)
    assert summary["ours"]["wall_seconds_per_step"] == 13.0  # median of 10, 12, 14, 16: step 1 left out
    assert summary["ours"]["wall_seconds_per_step_all_steps"] == 15.0  # 10 12 14 16 40 50
    assert summary["trl"]["cpu_seconds_per_step"] == 43.0
    assert summary["ours"]["peak_rss_gb"] == 3.0 and summary["trl"]["peak_rss_gb"] == 10.0  # max over rounds
    assert summary["ours"]["reward_per_step"] == pytest.approx([0.2, 0.3, 0.4])  # mean over rounds, per step
    assert summary["ratio"]["wall"] == pytest.approx(13.0 / 27.5)
    assert summary["ratio"]["memory"] == pytest.approx(0.3)
    assert summary["ratio"]["generated_tokens"] == pytest.approx(1.5)
    assert summary["targets"] == {"time_at_most_0.8x": True, "memory_at_most_0.5x": True}
    table = bench.format_table(summary)
    assert "target <= 0.8x: met" in table and "NOT met" not in table and "steps 2..3" in table

    slow = bench.summarise([_run("ours", 1, [30.0], [30.0], 6.0), _run("trl", 1, [30.0], [30.0], 10.0)], steps=1)
    assert slow["median_over"] == "all steps of every round" and slow["ours"]["wall_seconds_per_step"] == 30.0
    assert slow["targets"] == {"time_at_most_0.8x": False, "memory_at_most_0.5x": False}
    assert bench.format_table(slow).count("NOT met") == 2


def test_write_json_is_atomic_and_creates_the_folder(tmp_path):
    path = tmp_path / "results" / "out.json"
    bench.write_json(path, {"a": [1, 2.5, None]})
    assert json.loads(path.read_text()) == {"a": [1, 2.5, None]}
    assert [p.name for p in path.parent.iterdir()] == ["out.json"]  # no staging file left behind


def test_mismatches_name_stop_strings_only_when_there_are_some():
    assert not any(line.startswith("stop strings") for line in bench.mismatches([]))
    assert any(line.startswith("stop strings") for line in bench.mismatches(["\n\n\nProblem:"]))


def test_mismatches_state_the_precision_both_sides_ran_in():
    [fp32] = [line for line in bench.mismatches([]) if line.startswith("precision")]
    [bf16] = [line for line in bench.mismatches([], "bf16") if line.startswith("precision")]
    assert "fp32 on both" in fp32 and "bf16=False" in fp32
    assert "bf16 autocast over fp32 weights on both" in bf16 and "TRL bf16=True" in bf16


def test_side_by_side_run_on_a_tiny_model(tiny_model_dir, gsm8k_jsonl, tmp_path):
    pytest.importorskip("trl")  # requirements-bench.txt only
    out = tmp_path / "result.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.trl_side_by_side",
            "--model",
            str(tiny_model_dir),
            "--task",
            str(gsm8k_jsonl),
            "--questions",
            "2",
            "--group-size",
            "4",
            "--max-new-tokens",
            "8",
            "--context",
            "512",  # the tiny model has 1024 positions; grpo_baseline.py's default is the paper's 2047
            "--micro-batch-size",
            "4",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        cwd=ROOT,
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert [r["side"] for r in result["runs"]] == ["ours", "trl"]
    assert result["same_prompts_last_step"] is True
    for run in result["runs"]:
        assert [s["step"] for s in run["steps"]] == [1, 2]
        assert all(s["wall_seconds"] > 0 and 0 < s["generated_tokens"] <= 8 * 8 for s in run["steps"])
        assert 0 < run["peak_rss_train_gb"] <= run["peak_rss_overall_gb"]
    assert result["trl_config"]["loss_type"] == "dapo" and result["trl_config"]["gradient_accumulation_steps"] == 2
    assert result["summary"]["ratio"]["memory"] > 0
    # Which CPU measured it (figures from different machines differ); the name only: conftest hides bf16 flags from
    # this process.
    assert result["machine"]["cpu"].startswith(cpu_description().rsplit(" (", 1)[0] + " (")
