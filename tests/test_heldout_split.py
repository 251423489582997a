"""One held-out set for every seed: a generated task's test questions are drawn with --heldout-seed (default: the draw
seed-1 runs made before, 1 + 1,000,003), whatever the run's --seed; a run records it in args.json, an old run resumes
with its own, and a resume that would change it is refused."""

import json
from dataclasses import asdict

import pytest
import reasoning_gym

import grpo_baseline
import spo_tree
from plumbing import UsageError, cli, runs, settings, tasks

TASK = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=2"


def questions(examples) -> list[str]:
    return [e.question for e in examples]


def test_two_seeds_draw_the_same_held_out_questions_and_train_on_others():
    held_out = {seed: questions(tasks.load_task(TASK, "test", limit=40, seed=seed)) for seed in (0, 1, 3)}
    assert held_out[0] == held_out[1] == held_out[3] and len(set(held_out[0])) == 40
    for seed in (0, 3):
        train = set(questions(tasks.load_task(TASK, "train", limit=500, seed=seed)))
        assert not train & set(held_out[0])  # the training split never holds a held-out question
    # seed 0 and seed 3 train on their own draws
    assert questions(tasks.load_task(TASK, "train", limit=50, seed=0)) != questions(
        tasks.load_task(TASK, "train", limit=50, seed=3)
    )


def test_the_held_out_set_is_the_draw_seed_1_runs_made():
    """Seed-1 runs (the default) keep their held-out questions: reasoning-gym's draw at 1 + 1,000,003."""
    dataset = reasoning_gym.create_dataset(
        "chain_sum", seed=1 + 1_000_003, size=200, min_terms=2, max_terms=2, max_digits=2
    )
    first = list(dict.fromkeys(row["question"] for row in dataset))[:20]
    assert questions(tasks.load_task(TASK, "test", limit=20, seed=5)) == first
    other = questions(tasks.load_task(TASK, "test", limit=20, seed=5, heldout_seed=7))
    assert other != first  # --heldout-seed draws another set


def test_a_run_records_its_held_out_seed_and_an_old_run_resumes_with_its_own(tmp_path):
    saved = grpo_baseline.Args(model="my/model", task=TASK, iterations=3, seed=3)
    assert asdict(saved)["heldout_seed"] == settings.HELDOUT_SEED  # written to args.json with every setting
    run = tmp_path / "run"
    run.mkdir()
    values = asdict(saved)
    values.pop("heldout_seed")  # a run made when the held-out draw was the run's seed + 1,000,003
    (run / "args.json").write_text(json.dumps(values))
    resumed = settings.saved_settings(grpo_baseline.Args, run)
    assert resumed.heldout_seed == 3 + 1_000_003
    args = cli.parse(grpo_baseline.Args, ["--resume", str(run)])
    settings.check_resume_settings(args, run, runs.FINGERPRINTS)  # its own split: accepted
    args = cli.parse(grpo_baseline.Args, ["--resume", str(run), "--heldout-seed", str(settings.HELDOUT_SEED)])
    with pytest.raises(UsageError, match=r"--heldout-seed 1000004 \(the run has 1000006\) would change"):
        settings.check_resume_settings(args, run, runs.FINGERPRINTS)


def test_dry_run_shows_the_held_out_seed(tmp_path):
    result = spo_tree.main(spo_tree.Args(task=TASK, dry_run=True, output_dir=str(tmp_path)))
    assert result["settings"]["heldout_seed"] == settings.HELDOUT_SEED
