"""The tree's shape a reader can hold: no Python file but the four algorithm scripts is over 1,000 lines (a longer
module is split along a seam a reader can name), and the experiments, benchmarks and tools import the project plainly,
run as modules from the repository root (`python -m experiments.learning_exact`), so none of them edits sys.path."""

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {"spo_chain.py", "spo_tree.py", "grpo_baseline.py", "ppo_baseline.py"}  # as long as their algorithm needs
MOST_LINES = 1000
RUN_AS_MODULES = ("experiments", "benchmarks", "tools")


def python_files() -> list[Path]:
    """The tree's .py files, tracked or new (what .gitignore ignores, such as the virtual environments, left out)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "*.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of the tree's files")
    return [ROOT / name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def edits_sys_path(source: str) -> bool:
    """Whether the code touches sys.path (insert, append, slice assignment, a new list): any use of `sys.path`.

    >>> edits_sys_path("import sys\\nsys.path.insert(0, 'x')"), edits_sys_path("import sys\\nsys.exit(0)")
    (True, False)
    """
    return any(
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
        for node in ast.walk(ast.parse(source))
    )


def test_no_file_but_the_four_scripts_is_over_a_thousand_lines():
    long = {
        str(path.relative_to(ROOT)): count
        for path in python_files()
        if path.relative_to(ROOT).as_posix() not in SCRIPTS
        and (count := len(path.read_text(encoding="utf-8").splitlines())) > MOST_LINES
    }
    assert not long, f"over {MOST_LINES} lines: {long}; split each along a seam a reader can name"


def test_experiments_benchmarks_and_tools_do_not_edit_sys_path():
    files = [path for path in python_files() if path.relative_to(ROOT).parts[0] in RUN_AS_MODULES]
    assert {path.relative_to(ROOT).parts[0] for path in files} == set(RUN_AS_MODULES)
    editing = [str(path.relative_to(ROOT)) for path in files if edits_sys_path(path.read_text(encoding="utf-8"))]
    assert not editing, f"run these as modules (python -m folder.name) and import the project plainly: {editing}"
    for folder in RUN_AS_MODULES:  # a package, so python -m finds its modules and they import one another by name
        assert (ROOT / folder / "__init__.py").is_file(), folder


def test_a_sys_path_edit_is_found():
    assert edits_sys_path("import sys\nsys.path[:0] = ['a', 'b']")
    assert edits_sys_path("import sys\ndef f():\n    sys.path.append('a')")
    assert not edits_sys_path("from pathlib import Path\npath = Path('sys.path')")
