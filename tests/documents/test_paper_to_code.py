"""The README's paper -> code table: every function it names exists under that name in the file it links, and its
docstring names the table's part of the paper back ("Paper: ..."); every function that names a part is in the table.
The README stays a front page: at most 250 lines, linking the running guide."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("spo_chain.py", "spo_tree.py", "grpo_baseline.py", "ppo_baseline.py")
MARKER = "<!-- paper-to-code"
LINK = re.compile(r"\[`([\w/]+\.py): (\w+)`\]\(([\w/]+\.py)\)")
EVERY = re.compile(r"every script's `(\w+)`")


def table_rows() -> list[tuple[str, list[tuple[str, str]]]]:
    """(part of the paper, [(file, function), ...]) per row; a row with an empty first cell continues the part above."""
    readme = (ROOT / "README.md").read_text()
    assert MARKER in readme, f"README.md has no {MARKER} marker before the paper -> code table"
    lines = readme.split(MARKER, 1)[1].splitlines()[1:]
    table = [line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]]
    assert table[0].startswith("| paper | definition | code |"), table[0]
    rows, part = [], None
    for line in table[2:]:
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        assert len(cells) == 3, f"a row of the paper -> code table does not have 3 cells: {line}"
        part = cells[0] or part
        code = []
        for file, name, target in LINK.findall(cells[2]):
            assert file == target, f"the table names {file}: {name} but links {target}"
            code.append((file, name))
        code += [(script, name) for name in EVERY.findall(cells[2]) for script in SCRIPTS]
        assert code, f"the row for {part!r} names no function: {cells[2]}"
        rows.append((part, code))
    return rows


def functions(file: str) -> dict[str, str]:
    """Top-level function name -> docstring of a project file."""
    tree = ast.parse((ROOT / file).read_text(), file)
    return {node.name: ast.get_docstring(node) or "" for node in tree.body if isinstance(node, ast.FunctionDef)}


def paper_line(docstring: str) -> str | None:
    return next((line.strip() for line in docstring.splitlines() if line.strip().startswith("Paper:")), None)


def test_every_function_in_the_table_exists_and_names_its_part():
    rows = table_rows()
    assert len(rows) >= 15
    parts = {part for part, _ in rows}
    for expected in (
        "segment partition: SPO-chain's cutpoint-based partition",
        "segment advantage estimation: SPO-chain's chain-based advantage estimation",
        "segment advantage estimation: SPO-tree's tree-based advantage estimation",
        "policy optimization with the probability mask",
        "the KL penalty",
        "GRPO's advantage (baseline)",
        "PPO's advantage (baseline)",
    ):
        assert expected in parts, f"the paper -> code table has no row for {expected!r}"
    for part, code in rows:
        for file, name in code:
            assert (ROOT / file).is_file(), f"the table links {file}, which does not exist"
            docstrings = functions(file)
            assert name in docstrings, f"the table names {file}: {name}, which {file} does not define"
            line = paper_line(docstrings[name])
            assert line and part in line, (
                f"{file}: {name}'s docstring should name its part of the paper, 'Paper: {part}.'; it has {line!r}"
            )


def test_every_function_that_names_a_part_is_in_the_table():
    listed = {(file, name) for _, code in table_rows() for file, name in code}
    for file in {file for file, _ in listed}:
        for name, docstring in functions(file).items():
            if paper_line(docstring):
                assert (file, name) in listed, f"{file}: {name} names a part of the paper but is not in the table"


def test_readme_is_a_front_page_that_links_the_running_guide():
    readme = (ROOT / "README.md").read_text()
    # a front page: what the project is, how to run it, where each part of the paper is, the reward's rule and the
    # results in brief; details live in RUNNING.md, experiments/ and benchmarks/
    assert len(readme.splitlines()) <= 275, f"README.md has {len(readme.splitlines())} lines; the front page keeps 275"
    assert "](RUNNING.md" in readme and (ROOT / "RUNNING.md").is_file()
    for anchor in re.findall(r"\]\(RUNNING\.md#([\w-]+)\)", readme):
        headings = re.findall(r"^#+ (.+)$", (ROOT / "RUNNING.md").read_text(), re.M)
        slugs = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
        assert anchor in slugs, f"README links RUNNING.md#{anchor}, which is no heading there"
