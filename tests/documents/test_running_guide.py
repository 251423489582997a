"""RUNNING.md, the running guide: its table of what a resume may change lists exactly the settings
plumbing/settings.py lets a resume change (RESUMABLE_SETTINGS, less --resume and --dry-run, which are not
settings of the run), marks as changing the numbers exactly those RESUMED_CHANGES states, and names no flag the
scripts lack; the README links the guide's sections that exist."""

import re
from pathlib import Path

from plumbing import settings

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- resumable-settings"


def resumable_rows() -> dict[str, bool]:
    """flag name (underscores) -> whether the guide says its change shows in the numbers."""
    guide = (ROOT / "RUNNING.md").read_text()
    assert MARKER in guide, f"RUNNING.md has no {MARKER} marker before the table of resumable settings"
    lines = guide.split(MARKER, 1)[1].splitlines()[1:]
    table = lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    assert table[0] == "| setting | on resume | numbers |", table[0]
    rows = {}
    for line in table[2:]:
        flags_cell, _, numbers = [cell.strip() for cell in line.strip("|").split("|")]
        assert numbers in ("yes", "no"), line
        for flag in re.findall(r"`--([\w-]+)`", flags_cell):
            rows[flag.replace("-", "_")] = numbers == "yes"
    return rows


def test_the_guide_lists_what_a_resume_may_change():
    rows = resumable_rows()
    expected = set(settings.RESUMABLE_SETTINGS) - {"resume", "dry_run"}
    assert set(rows) == expected, (
        f"RUNNING.md's resumable settings differ from plumbing/settings.py: missing {sorted(expected - set(rows))}, "
        f"extra {sorted(set(rows) - expected)}"
    )
    assert {name for name, numbers in rows.items() if numbers} == set(settings.RESUMED_CHANGES)
    fields = {f for f in settings.TrainArgs.__dataclass_fields__}
    assert set(rows) <= fields


def test_the_guide_holds_the_generated_tables_and_the_gpu_install():
    guide = (ROOT / "RUNNING.md").read_text()
    for marker in ("<!-- memory-plan", "<!-- /memory-plan -->", "<!-- gpu-install"):
        assert marker in guide, f"RUNNING.md lacks {marker}"
    readme = (ROOT / "README.md").read_text()
    assert "<!-- memory-plan" not in readme and "<!-- gpu-install" not in readme  # each lives in one place
