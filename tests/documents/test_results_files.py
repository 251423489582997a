"""Each folder of results reports figures measured on today's code: every commit its README names is the oldest
commit whose algorithm code is today's (the floor plan) or a later one, and every results file in the folder records
the commit it ran at, a checkout without uncommitted changes, and a commit its README names."""

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# each README and the results files whose commits it names
FOLDERS = {
    ROOT / "experiments" / "README.md": ROOT / "experiments" / "results",
    ROOT / "benchmarks" / "README.md": ROOT / "benchmarks" / "results",
    ROOT / "tests" / "probe" / "README.md": ROOT / "tests" / "probe",
}
# The oldest commit whose algorithm code is today's ("Floor plan: main() resolves the auto memory knobs as a visible
# step ..."): a figure measured before it is out of date.
OLDEST_CURRENT_CODE = "dd288e4"
RESULTS = [(readme, path) for readme, folder in FOLDERS.items() for path in sorted(folder.glob("*.json"))]


def named_commits(readme: Path) -> set[str]:
    return set(re.findall(r"\bcommit ([0-9a-f]{7,40})\b", readme.read_text()))


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


@pytest.mark.parametrize("readme", list(FOLDERS), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_readme_names_commits(readme):
    assert named_commits(readme), f"{readme.relative_to(ROOT)} names no 'commit <hash>' for its figures"


@pytest.mark.parametrize("readme,path", RESULTS, ids=[str(p.relative_to(ROOT)) for _, p in RESULTS])
def test_each_results_file_records_a_clean_named_commit(readme, path):
    states = code_states(json.loads(path.read_text()))
    assert states, f"{path.name} records no commit and tree_modified (plumbing/runs.py: code_state())"
    for state in states:
        # a record that also checked the code it imports (exact_toy.machine) is clean when that code was unchanged
        clean = state["tree_modified"] is False or state.get("imported_code_modified") is False
        assert clean, f"{path.name} was measured on a checkout with uncommitted changes"
        assert any(state["commit"].startswith(c) or c.startswith(state["commit"]) for c in named_commits(readme)), (
            f"{path.name} ran at commit {state['commit']}, which {readme.relative_to(ROOT)} does not name"
        )


@pytest.mark.parametrize("readme", list(FOLDERS), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_commit_has_todays_algorithm_code(readme):
    if git("cat-file", "-e", f"{OLDEST_CURRENT_CODE}^{{commit}}").returncode != 0:
        pytest.skip(f"this checkout lacks the history back to {OLDEST_CURRENT_CODE} (a shallow clone or no git)")
    for commit in sorted(named_commits(readme)):
        assert git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0, (
            f"{readme.relative_to(ROOT)} names commit {commit}, which this repository does not have"
        )
        assert git("merge-base", "--is-ancestor", OLDEST_CURRENT_CODE, commit).returncode == 0, (
            f"{readme.relative_to(ROOT)} names commit {commit}, older than today's algorithm code "
            f"({OLDEST_CURRENT_CODE}): re-measure"
        )
