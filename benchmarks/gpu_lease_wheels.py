"""The wheels the lent GPU machine lacks, downloaded here for its Python 3.12 on x86-64 into .whl/ (git-ignored): a
lease carries the folder and benchmarks/gpu_lease.sh installs it into a scratch path before anything runs.

The lent machine cannot reach a registry and has its own packages (benchmarks/gpu_lease_packages.txt). Of the project's
imports it lacks tyro and math-verify, and some of what they require. Its transformers 5.17.0 lacks names plumbing/
calls (activation_checkpointing_enable, is_activation_checkpointing, the `cache` keyword and output: gpu_check's
environment step probes them), so requirements.txt's transformers 5.24.0 travels too: pure Python, and its
requirements accept the machine's huggingface-hub 1.33.0, tokenizers 0.23.2 and safetensors 0.8.0. Its torch
2.11.0+cu130 stays: a CUDA build of torch is far larger than the 64 MiB one call carries.
tests/benchmarks/test_gpu_lease.py checks this list against the project's imports and the machine's list, without
downloading anything.

  python -m benchmarks.gpu_lease_wheels          # download into .whl/ (needs PyPI), each wheel's size, the total
  python -m benchmarks.gpu_lease_wheels --list   # the requirements it downloads, one a line
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / ".whl"
CARRY_LIMIT = 64 * 2**20  # what one call to the lent machine carries: the working tree and the wheels together
# What travels, and why. Versions: requirements.txt's pin, else VERSIONS.
CARRIED = {
    "tyro": "every command line (plumbing/cli.py, plumbing/ranges.py)",
    "docstring-parser": "tyro's",
    "typeguard": "tyro's",
    "typing-extensions": "typeguard 4.6.1 needs 4.14 or newer; the machine's version is not known",
    "math-verify": "grading (plumbing/grading.py)",
    "latex2sympy2-extended": "math-verify's",
    "antlr4-python3-runtime": "latex2sympy2-extended's",
    "transformers": "the machine's 5.17.0 lacks the 5.24 names plumbing/ calls",
    "peft": "LoRA (plumbing/lora.py); the machine's version is not known",
}
VERSIONS = {"docstring-parser": "0.18.0", "typeguard": "4.6.1", "typing-extensions": "4.16.0"}  # unpinned there
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def normalize(name: str) -> str:
    """A distribution's name as pip compares them: "Latex2Sympy2_Extended" -> "latex2sympy2-extended"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path = ROOT / "requirements.txt") -> dict[str, str]:
    """name -> version of the `name==version` lines of a requirements file."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(name): version for name, version in (line.split("==", 1) for line in lines if "==" in line)}


def requirements() -> list[str]:
    """NAME==VERSION of every carried wheel, in CARRIED's order."""
    pinned = pins()
    return [f"{name}=={pinned.get(name) or VERSIONS[name]}" for name in CARRIED]


def folder_bytes(paths) -> int:
    return sum(p.stat().st_size for p in paths if p.is_file())


def working_tree_bytes() -> int | None:
    """What else travels: tracked and untracked-but-not-ignored files (None without git)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    )
    if listed.returncode:
        return None
    return folder_bytes(ROOT / name for name in listed.stdout.decode().split("\0") if name)


def download() -> None:
    """Empty .whl/ of wheels, download every carried one for CPython 3.12 on x86-64 Linux (pure Python: py3-none-any),
    and refuse a folder that would not fit a call beside the working tree."""
    FOLDER.mkdir(exist_ok=True)
    for old in FOLDER.glob("*.whl"):  # one version of each: two would stop the install on the machine
        old.unlink()
    platforms = [word for platform in PLATFORMS for word in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", *platforms, "--dest", str(FOLDER), *requirements()]
    subprocess.run(command, check=True)
    wheels = sorted(FOLDER.glob("*.whl"))
    got = {normalize(w.name.split("-")[0]) for w in wheels}
    if got != set(CARRIED):
        sys.exit(f"error: .whl/ holds {sorted(got)}, not {sorted(CARRIED)}")
    for wheel in wheels:
        print(f"{wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    total, tree = folder_bytes(wheels), working_tree_bytes()
    print(
        f"{total / 2**20:7.2f} MiB in {len(wheels)} wheels" + (f", {tree / 2**20:.2f} MiB working tree" if tree else "")
    )
    if total + (tree or 0) > CARRY_LIMIT:
        sys.exit(f"error: over the {CARRY_LIMIT / 2**20:.0f} MiB a lease carries")
    print('carry: [".whl"]')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the requirements, download nothing")
    if parser.parse_args().list:
        print("\n".join(requirements()))
    else:
        download()


if __name__ == "__main__":
    main()
