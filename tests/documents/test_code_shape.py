"""House rules the formatter does not enforce: a comment that would push its line past ruff's 120 columns goes on its
own line above the statement, so no statement is split just to hold a comment (a line of only closing brackets, then
the comment); and in the scripts one assignment per line (`a, b = x, y` packs two statements into one to save a
line; names that come from one call, `count, total = f()`, belong together and stay)."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# `)  # ...`, `):  # ...`, `],  # ...`, `).round()  # ...`: the brackets that close a statement or an element (and calls
# chained onto it), then the comment
CLOSED_FOR_A_COMMENT = re.compile(r"^\s*[)\]}]+(\.\w+\([^()]*\))*[)\]}:,]*\s*#")
# directives that must stay where they are: they apply to the statement they end
DIRECTIVE = re.compile(r"#\s*(fmt:|noqa|type:)")


def tracked_python_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of tracked files")
    return [ROOT / name for name in listed.split("\0") if name]


def test_no_statement_is_split_to_hold_a_trailing_comment():
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in tracked_python_files()
        if path.is_file()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if CLOSED_FOR_A_COMMENT.match(line) and not DIRECTIVE.search(line)
    ]
    assert not found, "put these comments on their own line above the statement, and join it back:\n" + "\n".join(found)


SCRIPTS = ["spo_chain.py", "spo_tree.py", "grpo_baseline.py", "ppo_baseline.py", "eval.py"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_scripts_assign_one_name_a_line(name):
    source = (ROOT / name).read_text()
    packed = [
        f"{name}:{node.lineno}: {ast.get_source_segment(source, node)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple)
    ]
    assert not packed, "one assignment per line:\n" + "\n".join(packed)
