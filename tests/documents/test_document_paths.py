"""Every path the documents name exists: the relative links of every README (and RUNNING.md), each file or folder
they name in backticks or in a command line, and each of the project's modules a command runs (`python -m
experiments.learning_exact`), so a moved file cannot leave a reader at a dead link or command."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ["README.md", "RUNNING.md", "benchmarks/README.md", "experiments/README.md", "tools/README.md"]
DOCUMENTS += ["tests/probe/README.md"]
# a named path: a file of the project's kinds, or a folder (ending in /); placeholders (<run>, *, $VAR) and what a run
# writes (runs/..., .whl/, the venvs) are not the tree's
NAMED = re.compile(r"(?<![\w/.$~-])((?:[\w.-]+/)*[\w.-]+\.(?:py|sh|md|txt|json|png|jsonl)|(?:[\w.-]+/)+)(?![\w/*-])")
# what a run writes (a run directory, its checkpoint, samples and metric namespaces), and the venvs and wheels
WRITTEN_BY_RUNS = ("runs/", "RUN/", "checkpoint/", "samples/", "time/", ".whl/", ".venv", ".ci-venv", "merged/")
# a module of the project's folders that a command runs with python -m
RUN_MODULE = re.compile(r"-m ((?:experiments|benchmarks|tools|plumbing)(?:\.\w+)+)")


def links(text: str) -> list[str]:
    """The relative targets of markdown links and images, without their #anchors."""
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


def named_paths(text: str) -> list[str]:
    """The paths named in `backticks` and in fenced command blocks."""
    spans = re.findall(r"`([^`\n]+)`", text) + re.findall(r"```\w*\n(.*?)```", text, flags=re.S)
    found = []
    for span in spans:
        for path in NAMED.findall(span):
            if "/" in path and not path.startswith(WRITTEN_BY_RUNS) and not re.search(r"[<>*]", path):
                found.append(path)
    return found


def run_modules(text: str) -> list[str]:
    """The project's modules that the document's commands run (`python -m benchmarks.sampler`), as file paths."""
    return [name.replace(".", "/") + ".py" for name in RUN_MODULE.findall(text)]


def exists(path: str, document: Path) -> bool:
    """A path counts when it exists beside the document or from the repository's root."""
    return (document.parent / path).exists() or (ROOT / path).exists()


@pytest.mark.parametrize("name", DOCUMENTS)
def test_every_link_and_named_path_exists(name):
    document = ROOT / name
    text = document.read_text()
    missing = [p for p in links(text) if not (document.parent / p).exists()]
    missing += [p for p in named_paths(text) if not exists(p, document)]
    missing += [p for p in run_modules(text) if not (ROOT / p).is_file()]
    assert not missing, f"{name} names paths that do not exist: {sorted(set(missing))}"


def test_every_readme_of_the_tree_is_checked():
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    readmes = {name for name in tracked.splitlines() if name.endswith("README.md")}
    assert readmes <= set(DOCUMENTS), f"add to DOCUMENTS: {sorted(readmes - set(DOCUMENTS))}"


def test_a_dead_link_and_a_moved_script_are_found(tmp_path):
    assert links("see [the guide](RUNNING.md#lora) and [gone](old/place.md), [web](https://x.org)") == [
        "RUNNING.md",
        "old/place.md",
    ]
    assert named_paths("run `python benchmarks/lora.py` then\n```bash\nbash tools/x.sh runs/<run>/a.json\n```") == [
        "benchmarks/lora.py",
        "tools/x.sh",
    ]
    assert run_modules("`python -m experiments.gone --seeds 0`, python -m pytest, python -m plumbing.checkpoints") == [
        "experiments/gone.py",
        "plumbing/checkpoints.py",
    ]
