"""CI: RUNNING.md's GPU install resolves with every pin unchanged (pip's resolver, metadata only, no download).

Reads the ```bash block after `<!-- gpu-install` in RUNNING.md, checks that it installs the torch pin of
requirements.txt, then requirements.txt, then requirements-vllm.txt, and runs
`pip install --dry-run --ignore-installed -r requirements.txt -r requirements-vllm.txt`. It fails when
the resolver finds no solution (a pin bumped without the others) or resolves a pinned package to
another version. The CUDA build of torch comes from PyTorch's own index on a GPU node; its metadata
requires the same packages, so the registry's build stands in for it here.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ["requirements.txt", "requirements-vllm.txt"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return dict(line.split("==", 1) for line in lines if "==" in line)


def gpu_install(readme: str) -> list[list[str]] | None:
    """The commands (as words) of the ```bash block after `<!-- gpu-install` in the guide's text; None: no block.
    tests/test_vllm_source.py reads the torch index from them."""
    block = re.search(r"```bash\n(.*?)```", readme.split("<!-- gpu-install", 1)[-1], re.S)
    if "<!-- gpu-install" not in readme or block is None:
        return None
    return [line.split("#", 1)[0].split() for line in block.group(1).splitlines() if line.strip()]


def main() -> None:
    commands = gpu_install((ROOT / "RUNNING.md").read_text())
    if commands is None:
        sys.exit("gpu_resolve: RUNNING.md has no ```bash block after a <!-- gpu-install comment")
    wanted = {name: version for f in FILES for name, version in pins(ROOT / f).items()}
    # each command starts with these words (flags may follow)
    expected = [
        ["pip", "install", f"torch=={wanted['torch']}"],
        ["pip", "install", "-r", FILES[0]],
        ["pip", "install", "-r", FILES[1]],
    ]
    if len(commands) != len(expected) or any(c[: len(e)] != e for c, e in zip(commands, expected)):
        sys.exit(f"gpu_resolve: RUNNING.md's GPU install should begin, in order: {expected}; it is {commands}")
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
        ] + [a for f in FILES for a in ("-r", f)]
        resolved = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if resolved.returncode != 0:
            errors = [line for line in resolved.stderr.splitlines() if not line.startswith("WARNING: Location")]
            sys.exit("gpu_resolve: the GPU install does not resolve:\n" + "\n".join(errors[-25:]))
        installed = {
            normalize(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
    wrong = {
        name: (version, installed.get(normalize(name)))
        for name, version in wanted.items()
        if installed.get(normalize(name), "").split("+")[0] != version
    }
    if wrong:
        sys.exit(f"gpu_resolve: resolved versions differ from the pins (pin, resolved): {wrong}")
    print(
        "gpu_resolve: the GPU install resolves with every pin; "
        + ", ".join(f"{name} {installed[name]}" for name in ("torch", "transformers", "vllm"))
    )


if __name__ == "__main__":
    main()
