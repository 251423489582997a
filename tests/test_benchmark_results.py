"""benchmarks/README.md reports figures measured on today's code: every commit it names is the reshaping commit
(the floor plan: where the algorithm code took its present shape) or a later one, and every results file under
benchmarks/results/ records the commit it ran at, a checkout without uncommitted changes, and a commit the README
names."""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
RESHAPING = "dd288e4"  # "Floor plan: main() resolves the auto memory knobs as a visible step ..."


def named_commits() -> set[str]:
    return set(re.findall(r"\bcommit ([0-9a-f]{7,40})\b", README.read_text()))


def code_states(value) -> list[dict]:
    """Every {"commit": ..., "tree_modified": ...} record inside a results file's JSON."""
    if isinstance(value, dict):
        found = [value] if "commit" in value and "tree_modified" in value else []
        return found + [s for v in value.values() for s in code_states(v)]
    if isinstance(value, list):
        return [s for v in value for s in code_states(v)]
    return []


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_the_readme_names_commits():
    assert named_commits(), "benchmarks/README.md names no 'commit <hash>' for its figures"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_each_results_file_records_a_clean_named_commit(path):
    states = code_states(json.loads(path.read_text()))
    assert states, f"{path.name} records no commit and tree_modified (plumbing/runs.py: code_state())"
    for state in states:
        assert state["tree_modified"] is False, f"{path.name} was measured on a checkout with uncommitted changes"
        assert any(state["commit"].startswith(c) or c.startswith(state["commit"]) for c in named_commits()), (
            f"{path.name} ran at commit {state['commit']}, which benchmarks/README.md does not name"
        )


def test_every_named_commit_is_the_reshaping_or_later():
    if git("cat-file", "-e", f"{RESHAPING}^{{commit}}").returncode != 0:
        pytest.skip(f"this checkout lacks the history back to {RESHAPING} (a shallow clone or no git)")
    for commit in sorted(named_commits()):
        assert git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, (
            f"benchmarks/README.md names commit {commit}, which this repository does not have"
        )
        assert git("merge-base", "--is-ancestor", RESHAPING, commit).returncode == 0, (
            f"benchmarks/README.md names commit {commit}, measured before the reshaping ({RESHAPING}): re-measure"
        )
