"""Bad input fails fast: every script's CLI, given one bad flag, exits non-zero before loading anything, with no
traceback and a message that names the flag.

The cases run in-process (runpy, as `python script.py ...` would: the same `__main__` block) so the table takes
seconds; two of them also run as real subprocesses. Every case passes a model that does not exist: a check that
came after model loading would show up as "cannot load model" instead of the flag's message.
"""

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ["spo_chain.py", "spo_tree.py", "grpo_baseline.py", "ppo_baseline.py"]
NO_MODEL = ["--model", "/no/such/model"]

# (flags, text the error must contain). Applies to every training script.
COMMON = [
    (["--lr", "0"], "--lr (0.0) must be positive"),
    (["--lr", "-1e-6"], "--lr"),
    (["--top-p", "1.5"], "--top-p (1.5) must be in (0, 1]"),
    (["--eval-top-p", "0"], "--eval-top-p"),
    (["--eval-samples", "0"], "--eval-samples (0) must be at least 1"),
    (["--eval-temperature", "-1"], "--eval-temperature"),
    (["--eval-every", "0"], "--eval-every"),
    (["--eval-limit", "0"], "--eval-limit"),
    (["--task", "gsm9k"], "--task: unknown task 'gsm9k'"),
    (["--task", "rg:no_such_dataset"], "reasoning-gym has no dataset 'no_such_dataset'"),
    (["--task", "missing.jsonl"], "--task missing.jsonl: the file does not exist"),
    (["--eval-task", "gsm9k"], "--eval-task: unknown task"),
    (["--output-dir", "FILE"], "is a file, not a directory"),
    (["--output-dir", "FILE/runs"], "cannot be created"),
    (["--backend", "vllm"], "--backend vllm needs a CUDA GPU"),
    (["--context", "0"], "--context"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--iterations", "0"], "--iterations"),
    (["--batch-size", "6", "--micro-batch-size", "4"], "--batch-size (6) must be a positive multiple"),
    # a division by zero otherwise
    (["--micro-batch-size", "0"], "--micro-batch-size (0) must be at least 1"),
    # numbers that would run and change the algorithm silently: each is outside the range its field declares
    (["--max-grad-norm", "-1"], "--max-grad-norm (-1.0) must be positive"),  # torch would scale by -1/|g|: ascent
    (["--warmup-ratio", "-0.5"], "--warmup-ratio (-0.5) must be in [0, 1)"),
    (["--warmup-ratio", "3"], "--warmup-ratio (3.0) must be in [0, 1)"),
    (["--lr", "inf"], "--lr (inf) must be a finite number, positive"),  # ran, and saved a checkpoint of NaNs
    (["--temperature", "nan"], "--temperature (nan) must be a finite number, positive"),
    (["--weight-decay", "-1"], "--weight-decay (-1.0) must be 0 or positive"),  # failed only after the model loaded
    (["--seed", "-3"], "--seed (-3) must be in [0, 4294967295]"),
    (["--vllm-gpu-memory-utilization", "1.5"], "--vllm-gpu-memory-utilization (1.5) must be in (0, 1]"),
    (["--max-minutes", "0"], "--max-minutes (0.0) must be positive"),
    (["--beta", "nan"], "--beta (nan) must be a finite number"),
]
SPECIFIC = {
    "spo_chain.py": [
        (["--mc-samples", "0"], "--mc-samples"),
        (["--interval", "0"], "--interval"),
        (["--prob-threshold", "1.5"], "--prob-threshold"),
    ],
    "spo_tree.py": [
        (["--tree", "0,3"], "--tree"),
        (["--segment-tokens", "0"], "--segment-tokens"),
        (["--edges-per-question", "0"], "--edges-per-question"),
        # started a 4-hour level with no word: refused with its size
        (
            ["--tree", "100,100,100"],
            "--tree 100,100,100 grows up to 32,000,000 leaves and 27,329,920,000 generated "
            "tokens per iteration (--questions 32): over the 1,000,000-leaf limit",
        ),
    ],
    "grpo_baseline.py": [
        (["--group-size", "1"], "--group-size (1) must be at least 2"),
        # with the mask on, a threshold outside (0, 1] would turn the mask off silently
        (["--prob-mask", "--prob-threshold", "0"], "--prob-threshold (0.0) must be in (0, 1]"),
        (["--prob-mask", "--prob-threshold", "1.5"], "--prob-threshold (1.5) must be in (0, 1]"),
    ],
    "ppo_baseline.py": [
        (["--lam", "2"], "--lam"),
        (["--critic-lr", "-1"], "--critic-lr"),
        (["--prob-mask", "--prob-threshold", "-0.2"], "--prob-threshold (-0.2) must be in (0, 1]"),
        (["--gamma", "nan"], "--gamma (nan) must be a finite number, in [0, 1]"),
    ],
}
EVAL = [
    (["--samples", "0"], "--samples (0) must be at least 1"),
    (["--temperature", "-0.5"], "--temperature (-0.5) must be 0 or positive"),
    (["--temperature", "nan"], "--temperature (nan) must be a finite number"),  # exited 0 with responses "NNNN"
    (["--seed", "-1"], "--seed (-1) must be in [0, 4294967295]"),
    (["--top-p", "0"], "--top-p (0.0) must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens (0) must be at least 1"),
    (["--limit", "0"], "--limit"),
    (["--split", "validation"], "--split 'validation' is not a split"),
    (["--task", "gsm9k"], "--task: unknown task"),
    (["--output", "DIR"], "is a directory: give a file path"),
    (["--backend", "vllm"], "--backend vllm needs a CUDA GPU"),
]
CASES = [(s, flags, text) for s in TRAINING for flags, text in COMMON + SPECIFIC[s]] + [
    ("eval.py", f, t) for f, t in EVAL
]


def _fill(flags, tmp_path):
    (tmp_path / "FILE").write_text("not a directory")
    (tmp_path / "DIR").mkdir(exist_ok=True)
    return [
        str(tmp_path / f) if f in ("FILE", "DIR") else str(tmp_path / "FILE" / "runs") if f == "FILE/runs" else f
        for f in flags
    ]


def run_in_process(script, flags, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    captured = capsys.readouterr()
    code = exited.value.code
    # sys.exit("error: ...") prints the string to stderr and exits 1; tyro prints its own message and exits 2.
    return (1, captured.err + f"{code}\n") if isinstance(code, str) else (code, captured.err)


@pytest.mark.parametrize("script,flags,text", CASES, ids=[f"{c[0]}:{' '.join(c[1])}" for c in CASES])
def test_bad_flag_is_one_clear_line_before_loading(script, flags, text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, err = run_in_process(script, NO_MODEL + _fill(flags, tmp_path), monkeypatch, capsys)
    assert code not in (0, None)
    assert "Traceback" not in err and "cannot load model" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], err


@pytest.mark.parametrize(
    "script,flag,value",
    [(s, "--backend", "tpu") for s in TRAINING + ["eval.py"]] + [("spo_tree.py", "--advantage", "gae")],
)
def test_flags_with_fixed_choices_are_rejected_while_parsing(script, flag, value, monkeypatch, capsys):
    code, err = run_in_process(script, NO_MODEL + [flag, value], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and flag in err and value in err


@pytest.mark.parametrize(
    "script,flags,text",
    [
        ("spo_tree.py", ["--lr", "0"], "--lr (0.0) must be positive"),
        ("eval.py", ["--samples", "0"], "--samples (0) must be at least 1"),
    ],
)
def test_bad_flag_as_a_real_command(script, flags, text, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *NO_MODEL, *flags],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and text in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing made for a run that never started


def test_context_shorter_than_every_prompt_fails_and_leaves_no_run_directory(tiny_model_dir, gsm8k_jsonl, tmp_path):
    # Found only once the task is tokenised, after the run directory was made: the failed run is removed again.
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "grpo_baseline.py"),
            "--model",
            str(tiny_model_dir),
            "--task",
            str(gsm8k_jsonl),
            "--backend",
            "hf",
            "--context",
            "40",
            "--output-dir",
            str(tmp_path / "runs"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("error: --context 40 leaves no room for a response after any prompt")
    )
    assert list((tmp_path / "runs").iterdir()) == []


def test_some_prompts_without_room_are_dropped_from_training_with_a_warning(gsm8k_jsonl):
    from plumbing import UsageError, tasks

    examples = tasks.load_task(str(gsm8k_jsonl), "train")
    for e, n in zip(examples, range(len(examples))):
        e.prompt_ids = [0] * (10 + n)  # 10, 11, ... tokens
    with pytest.warns(
        UserWarning, match=f"{len(examples) - 2} of {len(examples)} prompts of T leave no room .*dropped"
    ):
        kept = tasks.check_prompt_room(examples, 12, "T", drop=True)
    assert [len(e.prompt_ids) for e in kept] == [10, 11]
    with pytest.warns(UserWarning, match="kept; they score 0"):
        assert tasks.check_prompt_room(examples, 12, "T", drop=False) == examples
    with pytest.raises(UsageError, match="--context 10 leaves no room .*prompts are 10-17 tokens"):
        tasks.check_prompt_room(examples, 10, "T", drop=True)


# ----------------------------------------------------------------------------------------------
# Every numeric flag declares its valid range on its field (plumbing/ranges.py)


# the folders of the project's other command lines: experiments, benchmarks, tools and the bad-input probe
FOLDERS = ("experiments", "benchmarks", "tools", "tests/probe")


def _command_lines():
    """Every dataclass a command line of the project is parsed into: the four scripts, eval.py, viewer.py, the
    benchmarks."""
    import dataclasses
    import importlib

    sys.path[:0] = [str(ROOT), *(str(ROOT / folder) for folder in FOLDERS)]
    modules = {
        "spo_chain": ["Args"],
        "spo_tree": ["Args"],
        "grpo_baseline": ["Args"],
        "ppo_baseline": ["Args"],
        "eval": ["EvalArgs"],
        "viewer": ["Html", "Curves"],
        "credit_assignment": ["Args"],
        "learning": ["Args"],
        "logprob_memory": ["Args"],
        "trl_side_by_side": ["Args"],
        "credit_exact": ["Args"],
        "learning_exact": ["Args"],
        "learning_critical": ["Args"],
        "learning_paired": ["Args"],
        "bad_input_probe": ["Args"],
        "gpu_check": ["Args"],
    }
    found = [getattr(importlib.import_module(name), cls) for name, classes in modules.items() for cls in classes]
    # a benchmark added later with a tyro dataclass of its own must be listed above
    for path in sorted(path for folder in FOLDERS for path in (ROOT / folder).glob("*.py")):
        if "tyro.cli(Args)" in path.read_text() or "ranges.cli(Args)" in path.read_text():
            assert path.stem in modules, f"{path.name} parses an Args: add it to _command_lines"
    return [c for c in found if dataclasses.is_dataclass(c)]


def test_every_numeric_flag_declares_a_range_that_its_default_satisfies():
    import dataclasses

    from plumbing import ranges

    checked = 0
    for args_class in _command_lines():
        for field in dataclasses.fields(args_class):
            if not ranges.is_numeric(args_class, field.name):
                continue
            assert ranges.field_range(args_class, field.name) is not None, (
                f"{args_class.__module__}.{args_class.__name__}.{field.name} has no range: "
                "declare one (plumbing/ranges.py)"
            )
            checked += 1
        if all(
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            for f in dataclasses.fields(args_class)
        ):
            assert ranges.problems(args_class()) == [], args_class  # the defaults are valid
    assert checked >= 100  # 4 scripts x ~27 + eval + viewer + benchmarks


def test_a_range_shows_in_help_and_rejects_non_finite_values():
    from dataclasses import dataclass

    from plumbing import ranges

    @dataclass
    class Demo:
        rate: ranges.PositiveFloat = 1.0
        share: ranges.Probability = 0.5
        limit: ranges.OptionalPositiveInt = None
        seeds: ranges.Seeds = (1,)

    assert ranges.problems(Demo()) == []
    assert ranges.problems(Demo(rate=float("inf"), share=0.0, limit=0, seeds=[])) == [
        "--rate (inf) must be a finite number, positive",
        "--share (0.0) must be in (0, 1]",
        "--limit (0) must be at least 1",
        "--seeds needs at least one value",
    ]
    assert ranges.problems(Demo(rate=-0.0, share=1.0, limit=None, seeds=[2, -1, 2**32])) == [
        "--rate (-0.0) must be positive",
        "--seeds (-1 4294967296): each value must be in [0, 4294967295]",
    ]
    assert ranges.field_range(Demo, "rate") == (ranges.Range(0, None, low_open=True), float)


@pytest.mark.parametrize(
    "command,text",
    [
        (["viewer.py", "html", "RUN", "--questions", "0"], "--questions (0) must be at least 1"),
        (["viewer.py", "html", "RUN", "--iterations"], "--iterations needs at least one value"),
        (["viewer.py", "curves", "RUN", "--smooth", "1"], "--smooth (1.0) must be in [0, 1)"),
        # exited 0 and wrote an empty table
        (["experiments/learning.py", "--seeds"], "--seeds needs at least one value"),
        (["experiments/learning.py", "--minutes", "nan"], "--minutes (nan) must be a finite number"),
        (["experiments/trl_side_by_side.py", "--group-size", "1"], "--group-size (1) must be at least 2"),
        (["experiments/credit_exact.py", "--intervals", "0", "5"], "--intervals (0): each value must be at least 1"),
        (["benchmarks/logprob_memory.py", "--rows", "0"], "--rows (0) must be at least 1"),
    ],
)
def test_viewer_and_benchmark_flags_out_of_range_are_one_line(command, text, tmp_path, monkeypatch, capsys):
    (tmp_path / "RUN").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / Path(command[0]).parent))
    code, err = run_in_process(command[0], command[1:], monkeypatch, capsys)
    assert code not in (0, None) and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RUN"]  # nothing written


@pytest.mark.slow
def test_the_bad_input_probe_builds_its_damaged_files_and_judges_its_cases(tmp_path):
    sys.path.insert(0, str(ROOT / "tests" / "probe"))
    import bad_input_probe

    rows = bad_input_probe.main(bad_input_probe.Args(only="--resume ARGS"))  # three cases; writes no results file
    assert [r["verdict"] for r in rows] == ["ok", "ok", "ok"] and all(r["exit_code"] == 1 for r in rows)
    fixtures = bad_input_probe.make_fixtures(tmp_path)
    # the verdicts it can give: a message that names another problem, and a command that exits 0
    assert bad_input_probe.run_case("eval.py --samples 0", "--top-p", fixtures, tmp_path)["verdict"] == "unclear"
    assert bad_input_probe.run_case("viewer.py --help", "--smooth", fixtures, tmp_path)["verdict"] == "silent"
