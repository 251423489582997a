"""The paper's settings: every script's defaults are its first paper run, --dry-run compares any command line with
the matching run and loads nothing, the README's table is generated from the same data, and the worked examples
in the pure functions' docstrings hold."""

import dataclasses
import doctest
import subprocess
import sys
from pathlib import Path

import pytest

import eval as ev
import grpo_baseline
import ppo_baseline
import spo_chain
import spo_tree
from plumbing import tasks
from tools import paper_settings

ROOT = Path(__file__).resolve().parents[2]

SCRIPTS = [spo_chain, spo_tree, grpo_baseline, ppo_baseline]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_paper_settings_name_real_flags_and_the_defaults_are_the_first_run(script, tmp_path, monkeypatch):
    def loads(*args, **kwargs):
        raise AssertionError("--dry-run loaded something")

    for module, name in ((ev, "load_model"), (ev, "make_sampler"), (tasks, "load_task"), (tasks, "grade")):
        monkeypatch.setattr(module, name, loads)
    fields = {f.name for f in dataclasses.fields(script.Args)}
    for run, paper in script.PAPER_SETTINGS.items():
        assert set(paper) <= fields, (run, set(paper) - fields)
        assert {"model", "task", "eval_task", "lr", "temperature", "top_p", "eval_samples", "eval_top_p"} <= set(paper)
    result = script.main(script.Args(dry_run=True, output_dir=str(tmp_path / "runs")))
    assert result["paper_run"] == next(iter(script.PAPER_SETTINGS))
    assert result["differences"] == []
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda m: m.__name__)
def test_every_paper_run_is_reproduced_by_its_flags(script, tmp_path):
    """Setting exactly the values a paper run states gives no difference, and the run is found by its task."""
    for run, paper in script.PAPER_SETTINGS.items():
        args = script.Args(**{**paper, "eval_task": None, "output_dir": str(tmp_path / "runs")})
        result = script.main(dataclasses.replace(args, dry_run=True))
        assert (result["paper_run"], result["differences"]) == (run, [])
        assert result["settings"]["eval_task"] == paper["eval_task"]  # what a missing --eval-task resolves to


def test_dry_run_marks_each_difference_and_falls_back_to_the_model_run(tmp_path, capsys):
    args = spo_tree.Args(task="gsm8k", model="realtreetune/rho-1b-sft-GSM8K", eval_top_p=0.95, dry_run=True)
    result = spo_tree.main(args)
    assert result["paper_run"] == "gsm8k"  # the alias and the hub id name the same model
    assert "model" not in result["differences"] and {"eval_top_p", "segment_tokens"} <= set(result["differences"])
    lines = capsys.readouterr().out.splitlines()
    marked = [line.split()[1] for line in lines if line.startswith("*")]
    assert marked == [f"--{name.replace('_', '-')}" for name in result["differences"]]
    assert any(
        line.startswith("* --eval-top-p") and line.split()[2] == "0.95" and line.endswith("paper: 0.9")
        for line in lines
    )
    assert lines[-1].startswith(f"{len(result['differences'])} difference(s) from the paper")

    off_task = grpo_baseline.main(
        grpo_baseline.Args(task="rg:chain_sum", model="deepseek-r1-distill-qwen-1.5b", dry_run=True)
    )
    assert off_task["paper_run"] == "math"  # no paper run on the task: the one of the same model
    assert "task" in off_task["differences"]


def test_dry_run_from_the_command_line_loads_nothing(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ppo_baseline.py"),
            "--dry-run",
            "--lam",
            "0.96",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "* --lam" in result.stdout and "1 difference(s) from the paper; nothing was loaded" in result.stdout
    assert "transformers" not in result.stderr and not (tmp_path / "runs").exists()


def test_readme_table_is_generated_from_the_scripts():
    readme = (ROOT / "README.md").read_text()
    assert paper_settings.readme_with_table(readme) == readme, "run: python -m tools.paper_settings --write"
    table = paper_settings.table()
    assert "| `--eval-top-p` | 0.9 | 0.95 | 0.9 | 0.9 | 0.95 | 0.9 |" in table
    assert "| `--samples-per-iteration` |  | 512 | 1024 |" in table


@pytest.mark.parametrize("module", [*SCRIPTS, ev], ids=lambda m: m.__name__)
def test_worked_examples_in_docstrings_hold(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    if module is not ev:
        assert result.attempted >= 8  # every script's loss_mask, whiten and policy_loss carry examples
