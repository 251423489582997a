"""--resume RUN keeps the run's own settings (RUN/args.json) in every script; only safe settings may change."""

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from plumbing import UsageError, checkpoints, cli, runs, settings

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [spo_chain, spo_tree, grpo_baseline, ppo_baseline]


def _saved_run(module, run_dir: Path, **settings):
    run_dir.mkdir(parents=True, exist_ok=True)
    saved = module.Args(model="my/model", task="my.jsonl", iterations=3, lr=3e-6, seed=7, **settings)
    (run_dir / "args.json").write_text(json.dumps(asdict(saved), indent=1))
    return saved


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda m: m.__name__)
def test_resume_takes_the_runs_settings_and_explicit_safe_flags(module, tmp_path):
    saved = _saved_run(module, tmp_path / "run")
    args = cli.parse(module.Args, ["--resume", str(tmp_path / "run")])
    assert asdict(args) == {**asdict(saved), "resume": str(tmp_path / "run")}  # not the script's defaults
    args = cli.parse(module.Args, [f"--resume={tmp_path / 'run'}", "--iterations", "9", "--max-minutes", "5"])
    assert (args.iterations, args.max_minutes, args.model, args.lr) == (9, 5.0, "my/model", 3e-6)
    settings.check_resume_settings(args, tmp_path / "run", runs.FINGERPRINTS)  # safe changes pass


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda m: m.__name__)
def test_resume_refuses_a_setting_that_changes_the_algorithm(module, tmp_path):
    _saved_run(module, tmp_path / "run")
    args = cli.parse(module.Args, ["--resume", str(tmp_path / "run"), "--seed", "8", "--lr", "1e-3"])
    with pytest.raises(UsageError, match=r"--seed 8 \(the run has 7\), --lr 0.001 \(the run has 3e-06\) would change"):
        settings.check_resume_settings(args, tmp_path / "run", runs.FINGERPRINTS)


def test_resume_of_another_scripts_run_is_one_clear_error(tmp_path):
    _saved_run(grpo_baseline, tmp_path / "run")
    with pytest.raises(UsageError, match="resume a run with the script that started it"):
        settings.saved_settings(spo_tree.Args, tmp_path / "run")
    with pytest.raises(UsageError, match="nothing-here: not a directory; give a run directory"):
        settings.saved_settings(spo_tree.Args, tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match=r"the run's settings .*empty/args.json does not exist"):
        settings.saved_settings(spo_tree.Args, tmp_path / "empty")


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda m: m.__name__)
def test_saved_settings_round_trip(module, tmp_path):
    saved = _saved_run(module, tmp_path / "run", eval_limit=5)
    assert settings.saved_settings(module.Args, tmp_path / "run") == saved


def test_a_run_saved_before_a_new_setting_resumes_only_if_that_setting_cannot_change_the_algorithm(tmp_path):
    saved = _saved_run(spo_tree, tmp_path / "run")
    values = json.loads((tmp_path / "run" / "args.json").read_text())
    values.pop("dry_run")  # a run started before --dry-run existed
    (tmp_path / "run" / "args.json").write_text(json.dumps(values))
    assert settings.saved_settings(spo_tree.Args, tmp_path / "run") == saved
    values.pop("samples_per_iteration")  # one before --samples-per-iteration: its default would change the run
    (tmp_path / "run" / "args.json").write_text(json.dumps(values))
    with pytest.raises(UsageError, match=r"differing: samples_per_iteration\)"):
        settings.saved_settings(spo_tree.Args, tmp_path / "run")


@pytest.mark.parametrize("module", SCRIPTS, ids=lambda m: m.__name__)
def test_a_run_saved_before_whiten_resumes_with_the_papers_centre_scale(module, tmp_path):
    """--whiten came after runs were made: an args.json without it is a run that centred and scaled (the paper's)."""
    saved = _saved_run(module, tmp_path / "run")
    values = json.loads((tmp_path / "run" / "args.json").read_text())
    values.pop("whiten")
    (tmp_path / "run" / "args.json").write_text(json.dumps(values))
    resumed = settings.saved_settings(module.Args, tmp_path / "run")
    assert resumed == saved and resumed.whiten == "centre-scale"
    args = cli.parse(module.Args, ["--resume", str(tmp_path / "run"), "--whiten", "scale"])
    with pytest.raises(UsageError, match=r"--whiten 'scale' \(the run has 'centre-scale'\) would change"):
        settings.check_resume_settings(args, tmp_path / "run", runs.FINGERPRINTS)


def _cli(*flags, cwd):
    return subprocess.run(
        [sys.executable, str(ROOT / "grpo_baseline.py"), *flags], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_cli_resume_continues_the_run_and_records_every_start(tiny_model_dir, gsm8k_jsonl, tmp_path):
    first = _cli(
        "--model",
        str(tiny_model_dir),
        "--task",
        str(gsm8k_jsonl),
        "--backend",
        "hf",
        "--iterations",
        "1",
        "--questions",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--context",
        "96",
        "--batch-size",
        "4",
        "--micro-batch-size",
        "2",
        "--epochs",
        "1",
        "--eval-every",
        "1",
        "--eval-samples",
        "1",
        "--eval-limit",
        "2",
        "--save-every",
        "1",
        "--output-dir",
        str(tmp_path / "runs"),
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    [run_dir] = (tmp_path / "runs").iterdir()
    saved = json.loads((run_dir / "args.json").read_text())

    refused = _cli("--resume", str(run_dir), "--lr", "0.5", "--iterations", "2", cwd=tmp_path)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("error: --resume")
    assert "--lr 0.5 (the run has 1e-06)" in refused.stderr
    assert json.loads((run_dir / "args.json").read_text()) == saved  # nothing overwritten

    resumed = _cli("--resume", str(run_dir), "--iterations", "2", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    now = json.loads((run_dir / "args.json").read_text())
    assert now == {**saved, "iterations": 2, "resume": str(run_dir)}  # the tiny model and task, not the defaults
    starts = [json.loads(line) for line in (run_dir / "starts.jsonl").read_text().splitlines()]
    assert [s["resumed"] for s in starts] == [False, True]
    assert starts[1]["argv"][1:] == ["--resume", str(run_dir), "--iterations", "2"] and "commit" in starts[1]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(m["iteration"] for m in metrics) == 2


def test_damaged_checkpoint_falls_back_to_the_old_one_or_names_the_file(tiny_model_dir, gsm8k_jsonl, tmp_path):
    import shutil

    summary = grpo_baseline.main(
        grpo_baseline.Args(
            model=str(tiny_model_dir),
            task=str(gsm8k_jsonl),
            backend="hf",
            iterations=1,
            questions=2,
            group_size=2,
            max_new_tokens=4,
            context=128,
            batch_size=4,
            micro_batch_size=2,
            epochs=1,
            eval_every=1000,
            eval_samples=1,
            eval_limit=2,
            save_every=1,
            output_dir=str(tmp_path / "runs"),
        )
    )
    run_dir, checkpoint = Path(summary["run_dir"]), Path(summary["checkpoint"])
    assert checkpoints.latest_checkpoint(run_dir) == checkpoint and checkpoints.checkpoint_problem(checkpoint) is None
    shutil.copytree(checkpoint, run_dir / "checkpoint.old")

    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated, e.g. by a full disk or a partial copy
    assert "model.safetensors is truncated" in checkpoints.checkpoint_problem(checkpoint)
    with pytest.warns(UserWarning, match="model.safetensors is truncated.*resuming from .*checkpoint.old"):
        assert checkpoints.latest_checkpoint(run_dir) == run_dir / "checkpoint.old"

    state = run_dir / "checkpoint.old" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: len(state.read_bytes()) // 2])
    with pytest.raises(UsageError, match="checkpoint.old/trainer_state.pt is damaged.*no intact checkpoint is left"):
        checkpoints.latest_checkpoint(run_dir)
    resumed = subprocess.run(
        [sys.executable, str(ROOT / "grpo_baseline.py"), "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    assert "model.safetensors is truncated" in resumed.stderr.strip().splitlines()[-1]


def test_an_args_json_without_a_setting_that_shapes_the_algorithm_is_refused_naming_it(tmp_path):
    """A setting the run directory does not record is not guessed: resuming with today's default of a setting that
    changes the algorithm (here SPO-tree's edge weighting) would make a run other than the one it continues."""
    _saved_run(spo_tree, tmp_path / "run")
    values = json.loads((tmp_path / "run" / "args.json").read_text())
    values.pop("edge_weight")
    (tmp_path / "run" / "args.json").write_text(json.dumps(values))
    with pytest.raises(UsageError, match=r"does not fit this script's settings \(differing: edge_weight\)"):
        settings.saved_settings(spo_tree.Args, tmp_path / "run")
