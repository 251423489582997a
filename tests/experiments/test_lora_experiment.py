"""experiments/lora.py: its --settings, --seeds and --resamples are checked before anything loads or runs (a model
for the parameter counts, the base model's evaluation, the quickstart runs), as one line naming the flag."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import lora as lora_experiment  # not `lora`: plumbing has a module of that name
from plumbing import UsageError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "settings, seeds, resamples, message",
    [
        (("r16",), (0,), 100, "--settings r16: give full:RATE or rRANK:RATE"),
        (("full:fast",), (0,), 100, "--settings full:fast: the rate fast is not a positive number"),
        (("r16:1e-3", "r0:1e-3"), (0,), 100, "--settings r0:1e-3: the rank 0 is not a positive integer"),
        (("full:nan",), (0,), 100, "--settings full:nan: the rate nan is not a positive number"),
        (("full:-1e-5",), (0,), 100, "--settings full:-1e-5: the rate -1e-5 is not a positive number"),
        (("full:1e-5", "full:1e-5"), (0,), 100, "--settings full:1e-5 is given twice"),
        ((), (0,), 100, "--settings needs at least one setting"),
        (("full:1e-5",), (), 100, "--seeds needs at least one seed"),
        (("full:1e-5",), (-1,), 100, "--seeds -1: each seed must be in [0, 4294967295]"),
        (("full:1e-5",), (0,), 0, "--resamples 0 must be at least 1"),
    ],
)
def test_settings_are_refused_before_anything_loads(settings, seeds, resamples, message, monkeypatch, tmp_path):
    def loads(*args, **kwargs):
        raise AssertionError("loaded a model or ran something before the settings were checked")

    for name in ("trainable", "held_out_scores", "measured_run", "cpu_description"):
        monkeypatch.setattr(lora_experiment, name, loads)
    with pytest.raises(UsageError, match="^" + re.escape(message)):
        lora_experiment.main(settings=settings, seeds=seeds, resamples=resamples, out=tmp_path / "lora.json")
    assert not (tmp_path / "lora.json").exists()


def test_the_command_line_says_it_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.lora", "--settings", "r16", "full:fast"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --settings r16: give full:RATE or rRANK:RATE (e.g. r16:1e-3); --settings full:fast: the rate fast is "
        "not a positive number (e.g. full:1e-5)"
    ]
