"""Numbers that are easy to get silently wrong: scientific notation in grading, a --max-minutes budget that
ends the run inside the learning-rate warmup, task files read as JSON Lines, and the non-finite guard's message."""

import doctest
import json
from types import SimpleNamespace

import pytest

from plumbing import UsageError, bookkeeping, files, grading, tasks, training
from plumbing.precision import FP32

NAN, INF = float("nan"), float("inf")


def test_the_doctests_hold():
    for module in (grading, bookkeeping, training):
        assert doctest.testmod(module).failed == 0, module.__name__


# ---------------------------------------------------------------------------------------------------------------------
# Scientific notation: a number's value, whatever its notation (grade()'s rule 5)

SCIENTIFIC_CASES = [
    # (task, response, reference, expected)
    ("gsm8k", "The answer is 1e6.", "1e6", 1.0),
    ("gsm8k", "The answer is 1e6.", "1000000", 1.0),
    ("gsm8k", "The answer is 1000000.", "1e6", 1.0),
    ("gsm8k", "The answer is 1,000,000.", "1E6", 1.0),
    ("data/t.jsonl", "so the total is 2.5e3", "2.5e3", 1.0),  # no stated answer: the tail's last number
    ("data/t.jsonl", "#### 2500", "2.5e3", 1.0),
    ("data/t.jsonl", "#### 2,500", "2.5e3", 1.0),
    ("data/t.jsonl", "The answer is 2.5e3", "2500", 1.0),
    ("data/t.jsonl", r"\boxed{2.5e3}", "2,500", 1.0),
    ("data/t.jsonl", "The answer is 25E2", "2.5e+3", 1.0),
    ("rg:chain_sum", "Answer: 0.0012", "1.2E-3", 1.0),
    ("rg:chain_sum", "Answer: 1.2e-3", "0.0012", 1.0),
    ("gsm8k", "The answer is -2.5e3", "-2500", 1.0),
    ("gsm8k", "The answer is 2500, not 2.5e4", "2500", 1.0),  # the rejected value is dropped whole
    # different values score 0
    ("gsm8k", "The answer is 1e6.", "1e5", 0.0),
    ("gsm8k", "The answer is 1e6.", "100000", 0.0),
    ("data/t.jsonl", "#### 2.6e3", "2.5e3", 0.0),
    ("data/t.jsonl", "#### 2500", "2.5e4", 0.0),
    ("data/t.jsonl", "The answer is 2.5", "2.5e3", 0.0),  # was 1.0: "2.5e3" read as 2.5 * e * 3 elsewhere, 2.5 here
    ("rg:chain_sum", "Answer: 1.2e-3", "0.012", 0.0),
    ("gsm8k", "The answer is 1e6 or 2e6", "1e6", 0.0),  # a hedge between two values
    ("gsm8k", "The answer is 2500, not 2.5e3", "2500", 1.0),
    # not scientific notation: left as it was
    ("gsm8k", "version 1.2e is out. The answer is 7", "7", 1.0),
    ("gsm8k", "The answer is 0x1e5", "100000", 0.0),
    # a math task's LaTeX may mean 2e - 1 (Euler's e): math-verify reads it as before
    ("math", r"\boxed{2e-1}", "2e-1", 1.0),
    ("math", r"\boxed{0.2}", "2e-1", 0.0),
]


@pytest.mark.parametrize(
    "task,response,reference,expected",
    SCIENTIFIC_CASES,
    ids=[f"{c[0]}:{c[1][:30]!r}->{c[2]!r}" for c in SCIENTIFIC_CASES],
)
def test_scientific_notation_grades_as_its_value(task, response, reference, expected):
    assert tasks.grade([response], [reference], task) == [expected]


@pytest.mark.parametrize(
    "text,plain",
    [
        ("1e6", "1000000"),
        ("2.5e3", "2500"),
        ("2.5E+03", "2500"),
        ("1.2E-3", "0.0012"),
        (".5e1", "5"),
        ("-2.5e3.", "-2500."),  # a sentence's full stop is not part of it
        ("1.50e2", "150"),
        ("1.255e2", "125.5"),
        ("3e-2 or 2e3", "0.03 or 2000"),
        # not numbers in scientific notation
        ("1.2e", "1.2e"),
        ("1e", "1e"),
        ("e5", "e5"),
        ("the 3e", "the 3e"),
        ("0x1e5", "0x1e5"),
        ("v1.2e3", "v1.2e3"),
        ("1e5x", "1e5x"),
        ("1e5.3", "1e5.3"),
        ("1,2e3", "1,2e3"),
        ("2e3e4", "2e3e4"),
        ("x_1e2", "x_1e2"),
        (r"2e^{3}", r"2e^{3}"),
    ],
)
def test_plain_numbers_writes_out_only_scientific_notation(text, plain):
    assert grading._plain_numbers(text) == (plain, True)


def test_a_huge_exponent_is_left_as_written_and_refused_as_a_reference():
    assert grading._plain_numbers("1e1001") == ("1e1001", False)
    assert grading._plain_numbers("1e" + "0" * 5000 + "1") == ("10", True)  # int() never sees 5,000 digits
    assert grading._plain_numbers("1e" + "9" * 5000)[1] is False
    assert tasks.check_references(["2.5e3", "1.2E-3", "1e1000", "1e1001", "1e99999"], "data/t.jsonl") == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert tasks.grade(["The answer is 1e1001", "The answer is 1e1001"], ["1e1000", "1"], "gsm8k") == [0.0, 0.0]


def test_a_task_file_reference_in_scientific_notation_grades_its_answers(tmp_path):
    task = tmp_path / "t.jsonl"
    rows = [{"question": "How many?", "answer": "... #### 2.5e3"}, {"question": "How far?", "answer": 1e20}]
    task.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples = tasks.load_task(str(task))
    assert [e.answer for e in examples] == ["2.5e3", "1e+20"]
    responses = ["The answer is 2500.", "The answer is 100000000000000000000."]
    assert tasks.grade(responses, [e.answer for e in examples], str(task)) == [1.0, 1.0]
    assert tasks.grade(["The answer is 2501.", "The answer is 1e19"], [e.answer for e in examples], str(task)) == [0, 0]


# ---------------------------------------------------------------------------------------------------------------------
# --max-minutes and the learning-rate schedule


def settings(**given) -> SimpleNamespace:
    values = {"max_minutes": None, "iterations": 1000, "warmup_ratio": 0.03, "lr": 1e-6, **given}
    return SimpleNamespace(**values)


@pytest.mark.parametrize(
    "given,first,spent,said",
    [
        ({}, 1, 0.0, False),  # no --max-minutes: never
        ({"iterations": 10**9}, 1, 0.0, False),
        ({"max_minutes": 30, "iterations": 10**9}, 1, 0.0, True),  # the issue's run: 30,000,000 warmup iterations
        ({"max_minutes": 30, "iterations": 10**9, "warmup_ratio": 0.0}, 1, 0.0, False),  # no warmup
        ({"max_minutes": 30}, 1, 0.0, False),  # 30 warmup iterations may well fit in 1,800 seconds
        ({"max_minutes": 0.001}, 1, 0.0, True),  # 0.06 seconds hold 6 of them at 100 a second
        ({"max_minutes": 1e-6, "iterations": 5}, 1, 0.0, False),  # int(0.15): no warmup iteration
        ({"max_minutes": 1, "iterations": 300_000}, 1, 0.0, True),  # 9,000 warmup iterations, 6,000 at most
        ({"max_minutes": 1, "iterations": 300_000}, 4000, 0.0, False),  # resumed past 3,000: 6,000 more may fit
        ({"max_minutes": 1, "iterations": 300_000}, 4000, 30.0, True),  # ... but only 30 seconds are left
        ({"max_minutes": 1, "iterations": 300_000}, 9001, 60.0, False),  # the warmup is behind it
    ],
)
def test_a_budget_that_ends_the_run_inside_the_warmup_is_stated(given, first, spent, said):
    args = settings(**given)
    line = bookkeeping.schedule_line(args, first, spent)
    assert (line is not None) == said
    if said:
        assert "\n" not in line and line.startswith(f"--max-minutes {args.max_minutes:g} ends the run inside")
        assert f"--iterations {args.iterations:,}" in line


def test_the_issue_run_is_told_its_rate():
    line = bookkeeping.schedule_line(settings(max_minutes=30, iterations=10**9), 1)
    assert "whose first 30,000,000 warm up to --lr 1e-06" in line
    assert "holds at most 180,000 more even at 100 iterations a second" in line and "stays below 6e-09" in line


def test_the_loop_prints_the_line_at_the_start_only_with_max_minutes(tmp_path, capsys):
    def loop_output(**given) -> str:
        args = settings(track=False, eval_before=False, **given)
        run_dir = tmp_path / str(len(list(tmp_path.iterdir())))
        run_dir.mkdir()
        run = bookkeeping.Run(run_dir, None, None, FP32, None)
        bookkeeping.Loop(run, args, "gsm8k", dict).log_file.close()
        return capsys.readouterr().out

    assert loop_output(iterations=10**9) == ""
    assert loop_output(max_minutes=30, iterations=1000) == ""
    out = loop_output(max_minutes=30, iterations=10**9)
    assert out.count("\n") == 1 and out.startswith("--max-minutes 30 ends the run inside the learning-rate warmup")


def test_the_schedule_is_the_same_with_or_without_a_budget():
    """make_optimizer never sees --max-minutes: a run with a budget trains at the rates of the same run without."""
    import inspect

    assert "max_minutes" not in inspect.signature(training.make_optimizer).parameters


# ---------------------------------------------------------------------------------------------------------------------
# Task files read as JSON Lines


def lines_of(tmp_path, data: bytes) -> list[tuple[int, str]]:
    path = tmp_path / "t.jsonl"
    path.write_bytes(data)
    return list(files.read_lines(path, "task file"))


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\x85"])
def test_a_line_ends_at_newline_alone(tmp_path, separator):
    """str.splitlines breaks at these; a JSON string may hold them raw (json.dumps(ensure_ascii=False) writes them)."""
    rows = [{"question": f"one{separator}two", "answer": "3"}, {"question": "next", "answer": "4"}]
    data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
    assert separator in data.decode("utf-8")
    lines = lines_of(tmp_path, data)
    assert [(number, json.loads(line)) for number, line in lines] == [(1, rows[0]), (2, rows[1])]


@pytest.mark.parametrize("separator", ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"])
def test_other_breaks_stay_inside_their_line(tmp_path, separator):
    """Between two tokens a raw carriage return is JSON whitespace; the other controls make the line invalid JSON,
    which the caller reports at the line it is on."""
    data = f'{{"question": "q",{separator}"answer": "3"}}\n{{"question": "next", "answer": "4"}}\n'.encode()
    lines = lines_of(tmp_path, data)
    assert [number for number, _ in lines] == [1, 2] and json.loads(lines[1][1])["answer"] == "4"
    if separator == "\r":
        assert json.loads(lines[0][1]) == {"question": "q", "answer": "3"}
    else:
        with pytest.raises(ValueError):
            json.loads(lines[0][1])


def test_crlf_and_a_missing_last_newline_are_tolerated(tmp_path):
    lines = lines_of(tmp_path, b'{"a": 1}\r\n\r\n{"a": 2}')
    assert lines == [(1, '{"a": 1}'), (2, ""), (3, '{"a": 2}')]


def test_a_repeated_key_is_one_line_naming_the_file_the_line_and_the_key(tmp_path):
    data = b'{"question": "q", "answer": "1"}\n{"question": "q2", "answer": "1", "answer": "2"}\n'
    with pytest.raises(UsageError) as error:
        lines_of(tmp_path, data)
    message = str(error.value)
    assert message == (
        f'task file {tmp_path / "t.jsonl"} line 2 repeats the key "answer" (JSON readers keep one of the values): '
        "give each key once"
    )
    with pytest.raises(UsageError, match='line 1 repeats the key "k"'):  # in a nested object too
        lines_of(tmp_path, b'{"question": "q", "answer": "1", "meta": {"k": 1, "k": 2}}\n')


def test_a_repeated_key_is_quoted_shown(tmp_path):
    with pytest.raises(UsageError) as error:
        lines_of(tmp_path, b'{"\\u001b[31mred": 1, "\\u001b[31mred": 2}\n')
    assert "\x1b" not in str(error.value) and '"\\x1b[31mred"' in str(error.value)
    with pytest.raises(UsageError) as error:
        lines_of(tmp_path, ('{"' + "k" * 500 + '": 1, "' + "k" * 500 + '": 2}\n').encode())
    assert len(str(error.value)) < 300 and "k" * 80 + '..."' in str(error.value)


def test_lines_that_are_not_json_are_the_callers_to_report(tmp_path):
    assert lines_of(tmp_path, b"not json\n[1, 2\n" + b"[" * 100_000 + b"\n") == [
        (1, "not json"),
        (2, "[1, 2"),
        (3, "[" * 100_000),
    ]


def test_a_task_file_with_a_raw_line_separator_in_a_question_loads(tmp_path):
    task = tmp_path / "t.jsonl"
    rows = [{"question": "Add 2\u2028and 3.\x85Go.", "answer": "#### 5"}, {"question": "Add 1 and 1.", "answer": "2"}]
    task.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    examples = tasks.load_task(str(task))
    assert [(e.question, e.answer) for e in examples] == [("Add 2\u2028and 3.\x85Go.", "5"), ("Add 1 and 1.", "2")]


def test_a_task_file_with_a_repeated_key_stops_with_one_line(tmp_path):
    task = tmp_path / "t.jsonl"
    task.write_text('{"question": "Add 2 and 3.", "answer": "5", "answer": "6"}\n')
    with pytest.raises(UsageError, match=r'line 1 repeats the key "answer"'):
        tasks.load_task(str(task))


def test_logs_keep_their_reading(tmp_path):
    """read_log (metrics, starts.jsonl) is unchanged: split at newlines, a torn last line dropped."""
    log = tmp_path / "metrics.jsonl"
    # a raw line separator inside a string, as a JSON writer may leave it: read_log splits at "\n" alone
    log.write_text('{"iteration": 1, "note": "a\u2028b"}\n{"iteration": 2}\n{"iter', encoding="utf-8")
    with pytest.warns(UserWarning, match="cut short"):
        assert files.read_log(log) == [{"iteration": 1, "note": "a\u2028b"}, {"iteration": 2}]


# ---------------------------------------------------------------------------------------------------------------------
# The non-finite guard names the term that is not finite


@pytest.mark.parametrize(
    "stats,fix,names",
    [
        # the policy's own log-probs (both terms use them): diverged weights or overflowing logits
        ({"loss": NAN, "pg_loss": NAN, "kl": NAN, "clip_frac": 0.0}, "lower --lr", ["pg_loss = nan", "--lr", "fp32"]),
        # only the KL term: the reference model's log-probs
        ({"loss": NAN, "pg_loss": 0.1, "kl": NAN}, "lower --lr", ["kl = nan", "reference model", "--precision fp32"]),
        # only the policy-gradient term: the rollout's log-probs or the advantages (the ratio is clamped)
        ({"loss": INF, "pg_loss": INF, "kl": 0.2}, "lower --lr", ["pg_loss = inf", "old_logps", "--precision fp32"]),
        # both terms finite, their sum not: beta
        ({"loss": INF, "pg_loss": -0.1, "kl": 1e300}, "lower --lr", ["loss = pg_loss + beta * kl = inf", "--beta"]),
        # PPO's critic
        (
            {"loss": 0.1, "pg_loss": 0.1, "kl": 0.0, "value_loss": NAN},
            "lower --lr / --critic-lr",
            ["value_loss = nan", "--critic-lr"],
        ),
        (
            {"loss": NAN, "pg_loss": NAN, "kl": 0.0, "value_loss": NAN},
            "lower --lr / --critic-lr",
            ["value_loss = nan, and pg_loss with it", "--critic-lr"],
        ),
        # a gradient norm, where the caller checks it
        ({"loss": 0.1, "pg_loss": 0.1, "kl": 0.0, "grad_norm": INF}, "lower --lr", ["gradient norm", "fp32"]),
        ({"loss": 0.1, "value_loss": 0.1, "critic_grad_norm": NAN}, "lower --lr", ["the critic's gradient norm"]),
        # stats that name nothing: the caller's fix
        ({"loss": NAN}, "lower --lr", ["lower --lr, or check the model and data"]),
    ],
)
def test_three_non_finite_steps_name_the_term_that_is_not_finite(stats, fix, names):
    """The policy's terms as plumbing names them; PPO's critic terms as ppo_baseline passes them (its causes)."""
    import ppo_baseline

    keys = tuple(key for key in ("loss", "value_loss", "grad_norm", "critic_grad_norm") if key in stats)
    guard = bookkeeping.NonFiniteGuard()
    guard.in_a_row = 2
    with pytest.warns(UserWarning, match="non-finite loss"), pytest.raises(UsageError) as error:
        guard.skips(stats, 7, keys=keys, fix=fix, causes=ppo_baseline.NON_FINITE_CAUSES)
    message = str(error.value)
    assert message.startswith("three non-finite losses in a row: ") and "\n" not in message
    assert all(name in message for name in names), message


def test_a_tiny_temperature_is_still_named_first():
    cause = bookkeeping.non_finite_cause({"loss": NAN, "pg_loss": NAN, "kl": NAN}, temperature=1e-40)
    assert cause.startswith("--temperature 1e-40 divides the logits")


def test_a_finite_step_is_not_skipped_and_ends_the_streak():
    guard = bookkeeping.NonFiniteGuard()
    guard.in_a_row = 2
    assert not guard.skips({"loss": 0.1, "pg_loss": 0.1, "kl": NAN}, 1)  # kl is not a key
    assert guard.in_a_row == 0
