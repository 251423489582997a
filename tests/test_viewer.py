"""viewer.py: the HTML page (rendered by headless Chromium when it is installed), curves, and the CLI's error lines.

The sample files are written here by hand, following the format the training scripts write with
--save-samples; nothing loads a model.
"""

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import viewer

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
# Text pieces a real tokenizer produces, including ones that break naive HTML: tags, entities, quotes, newlines.
PIECES = [
    " The",
    " answer",
    " is",
    " 3",
    " +",
    " 4",
    " =",
    " 7",
    ".",
    "\n",
    " <script>",
    "alert(1)",
    "</script>",
    " &amp;",
    ' "q"',
    " 'x'",
    " \u00e9t\u00e9",
    "",
    " Let",
    " x",
    " <b>",
    "\n\n",
    " #### 7",
]
THRESHOLD = 0.9


def fake_response(rng: random.Random, length: int) -> tuple[list[int], list[str], list[float]]:
    ids = [rng.randrange(len(PIECES)) for _ in range(length)]
    ids[0] = PIECES.index(" <script>")  # every response shows the escaping case
    probs = [round(rng.random() ** 0.05, 4) for _ in ids]  # mostly confident, some low-probability tokens
    return ids, [PIECES[i] for i in ids], probs


def chain_record(rng, iteration, question_index, reward, interval=1) -> dict:
    """An spo_chain record built by the SPEC's rules: cutpoints before low-p tokens, value differences, prob mask."""
    ids, tokens, probs = fake_response(rng, rng.randint(12, 30))
    cutpoints = [t - 1 for t in range(len(ids)) if probs[t] < THRESHOLD][::interval]
    values = [round(rng.choice([0.0, 0.25, 0.5, 0.75, 1.0]), 2) for _ in cutpoints]
    positions = [(c, v) for c, v in zip(cutpoints, values) if c >= 0] + [(len(ids) - 1, reward)]
    previous = values[0] if cutpoints and cutpoints[0] == -1 else None
    advantages, start = [0.0] * len(ids), 0
    for position, value in positions:
        advantage = 0.0 if previous is None else value - previous
        for t in range(start, position + 1):
            advantages[t] = advantage if probs[t] < THRESHOLD else 0.0
        previous, start = value, position + 1
    if not cutpoints:
        advantages = [0.0] * len(ids)
    return {
        "algorithm": "spo_chain",
        "iteration": iteration,
        "question_index": question_index,
        "question": f'Question {question_index}: what is 3 + 4? (a < b & "c")',
        "reference": "7",
        "prompt": "[MATH_TASK] Problem:\n<3 + 4>\n\nSolution:",
        "reward": reward,
        "finish_reason": "stop" if reward else rng.choice(["stop", "length"]),
        "token_ids": ids,
        "tokens": tokens,
        "probs": probs,
        "advantages": advantages,
        "loss_mask": [p < THRESHOLD for p in probs],
        "prob_threshold": THRESHOLD,
        "cutpoints": cutpoints,
        "cutpoint_values": values,
        "values": None,
    }


def grpo_record(rng, iteration, question_index, reward, advantage) -> dict:
    ids, tokens, probs = fake_response(rng, rng.randint(8, 20))
    return {
        "algorithm": "grpo",
        "iteration": iteration,
        "question_index": question_index,
        "question": "What is 3 + 4?",
        "reference": "7",
        "prompt": "Problem: 3 + 4",
        "reward": reward,
        "finish_reason": "stop",
        "token_ids": ids,
        "tokens": tokens,
        "probs": probs,
        "advantages": [advantage] * len(ids),
        "loss_mask": [True] * len(ids),
        "prob_threshold": THRESHOLD,
        "cutpoints": None,
        "cutpoint_values": None,
        "values": None,
    }


def ppo_record(rng, iteration, question_index, reward) -> dict:
    ids, tokens, probs = fake_response(rng, rng.randint(8, 20))
    values = [round(rng.random(), 4) for _ in ids]
    advantages = [round((values[t + 1] if t + 1 < len(ids) else reward) - values[t], 4) for t in range(len(ids))]
    return {
        "algorithm": "ppo",
        "iteration": iteration,
        "question_index": question_index,
        "question": "What is 3 + 4?",
        "reference": "7",
        "prompt": "Problem: 3 + 4",
        "reward": reward,
        "finish_reason": "stop",
        "token_ids": ids,
        "tokens": tokens,
        "probs": probs,
        "advantages": advantages,
        "loss_mask": [True] * len(ids),
        "prob_threshold": THRESHOLD,
        "cutpoints": None,
        "cutpoint_values": None,
        "values": values,
    }


def tree_node(rng, depth, branches) -> dict:
    """A node with children per `branches`; values backed up as the mean of the children, rloo edge advantages."""
    ids, tokens, probs = fake_response(rng, rng.randint(4, 8)) if depth else ([], [], None)
    if depth == len(branches) or (depth and rng.random() < 0.25):
        finish_reason = "stop" if depth < len(branches) else rng.choice(["stop", "length"])
        reward = float(finish_reason == "stop" and rng.random() < 0.5)  # unfinished scores 0
        node = {"reward": reward, "finish_reason": finish_reason, "value": reward, "children": []}
    else:
        children = [tree_node(rng, depth + 1, branches) for _ in range(branches[depth])]
        node = {
            "reward": None,
            "finish_reason": None,
            "children": children,
            "value": sum(c["value"] for c in children) / len(children),
        }
        for child in children:
            child["advantage"] = round(child["value"] - node["value"], 5)
    return {"token_ids": ids, "tokens": tokens, "probs": probs, "advantage": None, **node}


def tree_record(rng, iteration, question_index) -> dict:
    return {
        "algorithm": "spo_tree",
        "iteration": iteration,
        "question_index": question_index,
        "question": "What is 3 + 4?",
        "reference": "7",
        "prompt": "Problem: 3 + 4",
        "prob_threshold": THRESHOLD,
        "tree": tree_node(rng, 0, [3, 2]),
    }


def make_run(directory: Path, algorithm: str, iterations=(1, 2), questions=2, group=4, seed=0) -> Path:
    """runs/<name>/{args.json, metrics.jsonl, samples/iter_<k>.jsonl} as the training scripts write them."""
    rng = random.Random(seed)
    (directory / "samples").mkdir(parents=True)
    args = {
        "exp_name": algorithm,
        "model": "tiny",
        "task": "rg:chain_sum",
        "seed": seed,
        "prob_threshold": THRESHOLD,
        "prob_mask": algorithm in ("spo_chain", "spo_tree"),
    }
    (directory / "args.json").write_text(json.dumps(args))
    for k in iterations:
        records = []
        for q in range(questions):
            if algorithm == "spo_tree":
                records.append(tree_record(rng, k, q))
                continue
            rewards = [float(rng.random() < 0.5) for _ in range(group)]
            mean = sum(rewards) / group
            std = (sum((r - mean) ** 2 for r in rewards) / group) ** 0.5
            for r in rewards:
                if algorithm == "spo_chain":
                    records.append(chain_record(rng, k, q, r))
                elif algorithm == "grpo":
                    records.append(grpo_record(rng, k, q, r, round((r - mean) / (std + 1e-8), 5)))
                else:
                    records.append(ppo_record(rng, k, q, r))
        (directory / "samples" / f"iter_{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = [{"iteration": 0, "eval/accuracy": 0.1}]
    total = 0.0
    for k in range(1, 6):
        total += 20.0 + k
        metrics.append(
            {
                "iteration": k,
                "charts/reward": 0.1 * k + 0.05 * seed * rng.random(),
                "losses/kl_per_token": 1e-4 * k * (1 + seed),
                "losses/kl_per_sequence": 3e-3 * k * (1 + seed),
                "policy/entropy": 1.5 - 0.1 * k,
                "sampler/kl_per_token": 1e-7 * k,
                "charts/response_tokens": 30 + k + 3 * seed,
                "time/iteration_seconds": 20.0 + k,
                "time/train_seconds": total,
                "charts/generated_tokens": 100,
            }
        )
    metrics.append({"iteration": 5, "eval/accuracy": 0.3 + 0.05 * seed})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return directory


@pytest.fixture
def four_runs(tmp_path) -> list[Path]:
    return [
        make_run(tmp_path / "runs" / f"{algorithm}_run", algorithm, seed=i)
        for i, algorithm in enumerate(["spo_chain", "spo_tree", "grpo", "ppo"])
    ]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "viewer.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def count_tree(node) -> tuple[int, int]:
    """(non-root nodes, their tokens) of a saved tree."""
    nodes, tokens = 0, 0
    for child in node["children"]:
        below = count_tree(child)
        nodes, tokens = nodes + 1 + below[0], tokens + len(child["tokens"]) + below[1]
    return nodes, tokens


def render_in_chromium(page: str, profile: Path) -> tuple[str, list[str]]:
    """The DOM after the page's scripts ran (--dump-dom) and Chromium's console lines (an error or uncaught
    exception)."""
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1200,900",
            "--dump-dom",
            page,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # Console messages come out as "...:INFO:CONSOLE:<line>] "message", source: file:///...": the page logs nothing,
    # so any is an error.
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return result.stdout, console


# ---- the page in a real browser


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium); .ci/run installs it"
)
def test_page_renders_every_algorithm_in_headless_chromium_without_errors(four_runs, tmp_path):
    output = tmp_path / "view.html"
    result = cli("html", *map(str, four_runs), "-o", str(output))
    assert result.returncode == 0, result.stderr
    for iteration in (1, 2):
        dom, console = render_in_chromium(f"{output.as_uri()}#iteration={iteration}", tmp_path / "profile")
        assert console == [], console
        assert 'id="js-error"' not in dom
        assert f'data-rendered="{iteration}"' in dom  # render() ran to its last line
        # Every saved token became one span, every cutpoint one bar, every tree node one line.
        records = [
            [json.loads(line) for line in (run / "samples" / f"iter_{iteration}.jsonl").read_text().splitlines()]
            for run in four_runs
        ]
        responses = [r for run in records for r in run if "tree" not in r]
        trees = [count_tree(r["tree"]) for run in records for r in run if "tree" in r]
        assert dom.count('<span class="tok') == sum(len(r["tokens"]) for r in responses) + sum(t[1] for t in trees)
        assert dom.count('class="cut"') == sum(len(r["cutpoints"] or []) for r in responses) + 1  # + the legend's bar
        assert dom.count('class="nline"') == sum(1 + t[0] for t in trees)
        assert dom.count('class="resp"') == len(responses)
        # Text from the data lands as text: the "<script>" token is escaped, no element came from it.
        assert "&lt;script&gt;" in dom and "<script>alert" not in dom
        assert "V(s_c) = " in dom


def with_script(page: Path, script: str) -> Path:
    """A copy of the page that runs `script` after the page's own scripts (to hover and click, as a reader would)."""
    copy = page.with_name(page.stem + "_driven.html")
    copy.write_text(page.read_text().replace("</body>", f"<script>{script}</script></body>"))
    return copy


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium); .ci/run installs it"
)
def test_hovering_a_token_shows_its_probability_advantage_and_critic_value(four_runs, tmp_path):
    page = tmp_path / "view.html"
    page.write_text(viewer.build_page([viewer.load_samples(four_runs[3])]))  # the PPO run
    hover = """const token = document.querySelector(".tok");
    token.dispatchEvent(new MouseEvent("mouseover", {bubbles: true, clientX: 10, clientY: 10}));
    document.body.dataset.hovered = token.textContent;"""
    dom, console = render_in_chromium(with_script(page, hover).as_uri() + "#iteration=1", tmp_path / "profile")
    assert console == [] and 'id="js-error"' not in dom
    record = json.loads((four_runs[3] / "samples" / "iter_1.jsonl").read_text().splitlines()[0])
    tip = re.search(r'<div id="tip">(.*?)</div>', dom, re.S)[1]  # no longer hidden
    assert f"id {record['token_ids'][0]}" in tip and f"p_t        {record['probs'][0]:g}" in tip
    assert "advantage  " in tip and f"critic V   {record['values'][0]:g}" in tip


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium); .ci/run installs it"
)
def test_a_large_tree_opens_one_level_and_draws_a_subtree_when_expanded(tmp_path):
    run = make_run(tmp_path / "run", "spo_tree", iterations=(1,), questions=1)
    path = run / "samples" / "iter_1.jsonl"
    record = json.loads(path.read_text())
    rng = random.Random(1)

    def lengthen(node):  # long segments, as in the paper's long-CoT trees (600 tokens): over 5000 tokens in all
        if node["token_ids"]:
            node["token_ids"], node["tokens"], node["probs"] = fake_response(rng, 2000)
        node["children"] and [lengthen(child) for child in node["children"]]

    lengthen(record["tree"])
    path.write_text(json.dumps(record) + "\n")
    page = tmp_path / "view.html"
    page.write_text(viewer.build_page([viewer.load_samples(run)]))
    first_level = len(record["tree"]["children"])
    collapsed = next(c for c in record["tree"]["children"] if c["children"])
    click = "document.querySelectorAll('.kids .tg:not(:disabled)')[0].click();"
    dom, console = render_in_chromium(page.as_uri(), tmp_path / "profile")
    assert console == [] and dom.count('class="nline"') == 1 + first_level
    dom, console = render_in_chromium(with_script(page, click).as_uri(), tmp_path / "profile")
    assert console == [] and dom.count('class="nline"') == 1 + first_level + len(collapsed["children"])


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium); .ci/run installs it"
)
def test_chromium_check_catches_a_script_error(tmp_path):
    """The check above would see a broken page: both the console line and the page's own error box."""
    page = tmp_path / "broken.html"
    page.write_text(
        viewer.PAGE.replace("__JS__", "undefinedFunction();")
        .replace("__DATA__", "{}")
        .replace("__CSS__", "")
        .replace("__TITLE__", "broken")
    )
    dom, console = render_in_chromium(page.as_uri(), tmp_path / "profile")
    assert any("undefinedFunction" in line for line in console)
    assert 'id="js-error"' in dom and "undefinedFunction" in dom


# ---- the page's content without a browser


def embedded_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', page, re.S)
    return json.loads(match[1])


def test_page_escapes_text_and_embeds_the_data_unchanged(four_runs):
    runs = [viewer.load_samples(run) for run in four_runs]
    page = viewer.build_page(runs)
    assert page.count("<script") == 3 and page.count("</script>") == 3  # the tokens "<script>", "</script>" add none
    assert "http://" not in page and "https://" not in page  # self-contained
    data = embedded_data(page)
    chain = data["runs"][0]["iterations"]["1"][0]
    assert chain["responses"][0]["tokens"][0] == " <script>"
    assert chain["question"] == 'Question 0: what is 3 + 4? (a < b & "c")'
    saved = json.loads((four_runs[0] / "samples" / "iter_1.jsonl").read_text().splitlines()[0])
    for key in ("tokens", "token_ids", "probs", "advantages", "loss_mask", "cutpoints", "cutpoint_values"):
        assert chain["responses"][0][key] == saved[key]
    assert data["runs"][1]["iterations"]["2"][0]["tree"]["children"]


def test_page_turns_nan_into_null_and_keeps_only_the_asked_iterations(tmp_path):
    run = make_run(tmp_path / "run", "ppo", iterations=(1, 2, 3))
    path = run / "samples" / "iter_2.jsonl"
    lines = path.read_text().splitlines()
    record = json.loads(lines[0])
    record["values"][0] = float("nan")
    path.write_text("\n".join([json.dumps(record)] + lines[1:]) + "\n")
    loaded = viewer.load_samples(run, iterations=(2, 3), questions=1)
    assert sorted(loaded["iterations"]) == [2, 3]
    assert {g["question_index"] for g in loaded["iterations"][2]} == {0}
    assert loaded["iterations"][2][0]["responses"][0]["values"][0] is None
    embedded_data(viewer.build_page([loaded]))  # valid JSON (no NaN)


# ---- error lines


def test_malformed_samples_line_is_one_clear_error(tmp_path):
    run = make_run(tmp_path / "run", "grpo", iterations=(1,))
    path = run / "samples" / "iter_1.jsonl"
    path.write_text(path.read_text().splitlines()[0] + '\n{"algorithm": "grpo", "tok\n')
    result = cli("html", str(run), "-o", str(tmp_path / "view.html"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"error: {path} line 2 is not valid JSON") and "delete that line" in result.stderr
    assert not (tmp_path / "view.html").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("advantages"), "line 1 lacks advantages"),
        (lambda r: r["probs"].pop(), "probs has"),
        (lambda r: r.update(cutpoints=[0], cutpoint_values=None), "cutpoint_values must have one value per cutpoint"),
        (lambda r: r.update(token_ids=7), "line 1 does not follow the samples format"),
    ],
)
def test_record_that_breaks_the_schema_names_the_problem(tmp_path, change, message):
    run = make_run(tmp_path / "run", "grpo", iterations=(1,))
    path = run / "samples" / "iter_1.jsonl"
    record = json.loads(path.read_text().splitlines()[0])
    change(record)
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(viewer.UsageError, match=re.escape(message)):
        viewer.load_samples(run)


def test_run_without_samples_says_how_to_get_them(tmp_path):
    (tmp_path / "run").mkdir()
    result = cli("html", str(tmp_path / "run"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"error: {tmp_path / 'run'} has no samples/iter_<k>.jsonl; "
        "train with --save-samples N to save the rollouts of every N-th iteration"
    )
    assert "is not a directory" in cli("html", str(tmp_path / "missing")).stderr
    run = make_run(tmp_path / "saved", "ppo", iterations=(2, 4))
    with pytest.raises(viewer.UsageError, match="has no samples for iterations 3; it has iterations 2, 4"):
        viewer.load_samples(run, iterations=(3,))


# ---- curves


def test_curves_of_two_runs_write_a_png(tmp_path):
    # "_b": a label matplotlib would hide
    runs = [make_run(tmp_path / name, "grpo", iterations=(1,)) for name in ("a", "_b")]
    for x in ("iteration", "seconds", "tokens"):
        output = tmp_path / f"curves_{x}.png"
        plotted = viewer.plot_curves(runs, output, x=x, smooth=0.5 if x == "tokens" else 0.0)
        assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000
    assert plotted == list(viewer.PANELS)


def test_curves_x_axis_is_cumulative_and_starts_eval_at_zero(tmp_path):
    series = viewer.load_metrics(make_run(tmp_path / "a", "grpo", iterations=(1,)))
    assert viewer.x_positions(series, "seconds", tmp_path)[0] == 0.0  # the eval before training
    assert viewer.x_positions(series, "seconds", tmp_path)[2] == 21.0 + 22.0
    assert viewer.x_positions(series, "tokens", tmp_path)[5] == 500.0
    del series["time/train_seconds"]
    assert viewer.x_positions(series, "seconds", tmp_path)[2] == 21.0 + 22.0  # summed from time/iteration_seconds
    del series["time/iteration_seconds"]
    with pytest.raises(viewer.UsageError, match="--x seconds needs"):
        viewer.x_positions(series, "seconds", tmp_path)


def test_curves_without_metrics_is_one_clear_error(tmp_path):
    good = make_run(tmp_path / "a", "grpo", iterations=(1,))
    (tmp_path / "b").mkdir()
    result = cli("curves", str(good), str(tmp_path / "b"), "-o", str(tmp_path / "c.png"))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert (
        result.stderr.strip() == f"error: {tmp_path / 'b'} has no metrics.jsonl; "
        "pass a run directory the training scripts wrote (runs/<run_name>)"
    )
    assert not (tmp_path / "c.png").exists()


def test_curve_labels_come_from_the_runs_args(tmp_path):
    run = tmp_path / "rg-chain_sum__spo_tree__2__1796006195"
    run.mkdir()
    (run / "args.json").write_text(json.dumps({"exp_name": "spo_tree", "seed": 2}))
    assert viewer.run_label(run) == "spo_tree seed 2"
    (tmp_path / "bare").mkdir()
    assert viewer.run_label(tmp_path / "bare") == "bare"  # no args.json: the directory name


@pytest.mark.parametrize(
    "command,text",
    [
        (["html", "RUN", "-o", "page.txt"], "-o page.txt: give a file name ending in .html, .htm"),
        # wrote out.png, said "wrote out"
        (["curves", "RUN", "-o", "out"], "-o out: give a file name ending in .png, .pdf, .svg"),
        (
            ["html", "RUN", "-o", "AFILE/page.html"],
            "cannot write the page AFILE/page.html: AFILE is a file, not a folder",
        ),
        (
            ["curves", "RUN", "-o", "AFILE/curves.png"],
            "cannot write the plot AFILE/curves.png: AFILE is a file, not a folder",
        ),
    ],
)
def test_outputs_that_cannot_be_written_are_one_line_and_leave_nothing(command, text, tmp_path):
    make_run(tmp_path / "RUN", "grpo")
    (tmp_path / "AFILE").write_text("a file, not a folder")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = subprocess.run(
        [sys.executable, str(ROOT / "viewer.py"), *command], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert result.returncode == 1 and result.stderr.strip() == f"error: {text}", result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_curves_of_a_metric_too_large_for_a_float_is_one_clear_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 1, "charts/reward": ' + "9" * 400 + "}\n")
    with pytest.raises(viewer.UsageError, match=r"metrics.jsonl line 1: charts/reward is an integer too large to plot"):
        viewer.load_metrics(run)


# ---- runs handed over by someone else


@pytest.mark.parametrize("command, output", [("html", "view.html"), ("curves", "curves.png")])
def test_a_link_whose_target_holds_terminal_escapes_is_named_escaped(command, output, tmp_path):
    run = make_run(tmp_path / "run", "grpo", iterations=(1,))
    (run / "notes").symlink_to("\x1b]0;owned\x07\x1b[2J")  # would set the window title and clear the screen
    result = cli(command, str(run), "-o", str(tmp_path / output))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "is a symbolic link (to \\x1b]0;owned\\x07\\x1b[2J)" in result.stderr


def test_two_files_of_one_iteration_are_both_refused_by_name(tmp_path):
    run = make_run(tmp_path / "run", "grpo", iterations=(1, 2))
    shutil.copy(run / "samples" / "iter_1.jsonl", run / "samples" / "iter_01.jsonl")
    with pytest.raises(viewer.UsageError, match=r"iter_01\.jsonl and iter_1\.jsonl, which are both iteration 1"):
        viewer.load_samples(run)
    assert sorted(viewer.load_samples(run, iterations=(2,))["iterations"]) == [2]  # the other iteration is not in doubt
    result = cli("html", str(run), "-o", str(tmp_path / "view.html"))
    assert result.returncode == 1 and "both iteration 1" in result.stderr and not (tmp_path / "view.html").exists()


def test_a_raw_line_separator_inside_a_json_string_is_part_of_its_line(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028 and U+0085 raw: JSON Lines ends a line at "\\n" alone."""
    run = make_run(tmp_path / "run", "grpo", iterations=(1,))
    path = run / "samples" / "iter_1.jsonl"
    records = [json.loads(line) for line in path.read_text().split("\n") if line]
    records[0]["question"] = "first\u2028second\x85third\rfourth"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    metrics = run / "metrics.jsonl"
    note = json.dumps({"iteration": 6, "note": "a\u2028b"}, ensure_ascii=False)
    metrics.write_text(metrics.read_text() + note + "\n")
    loaded = viewer.load_samples(run)
    assert loaded["iterations"][1][0]["question"] == "first\u2028second\x85third\rfourth"
    assert sum(len(group["responses"]) for group in loaded["iterations"][1]) == len(records)
    assert max(viewer.load_metrics(run)["charts/reward"]) == 5
