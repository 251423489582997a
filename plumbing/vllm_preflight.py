"""Pre-flight for the vLLM engine: what would stop a GPU run minutes into the engine's start-up, found before it
is built, one line each with its fix.

  problems         the problems: torch's CUDA against the CUDA vLLM's compiled ops link (fatal: they do not load),
                   a missing C compiler or Python.h (Triton builds its kernel launchers with them)
  prepare_vllm     what VLLMSampler runs first: FlashInfer's sampler off unless set, the fatal problem raised, the
                   rest printed, and one line that says what was found
  elf_needed       the libraries an ELF shared object links (DT_NEEDED), read from its headers

vLLM is never imported here: its compiled ops are read as files (the installed distribution's RECORD says where).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import BinaryIO

import torch

from plumbing import UsageError, distributed

# The PyTorch index whose torch build matches each CUDA major version that vLLM wheels are built for. The GPU
# install of RUNNING.md uses the one of the pinned vllm (tests/test_vllm_source.py checks both against the wheel).
TORCH_INDEX = {12: "https://download.pytorch.org/whl/cu128", 13: "https://download.pytorch.org/whl/cu130"}


def elf_needed(file: BinaryIO) -> list[str]:
    """The DT_NEEDED entries of a 64-bit little-endian ELF file (what the dynamic loader must find), from its section
    headers: the SHT_DYNAMIC section's entries, named in the string table it links. [] for anything else.

    For vllm 0.30.0's vllm/_C_stable_libtorch.abi3.so: ["libtorch.so", "libcudart.so.13", "libcuda.so.1", ...].
    """
    file.seek(0)
    header = file.read(64)
    if header[:4] != b"\x7fELF" or header[4:6] != b"\x02\x01":  # ELFCLASS64, little-endian
        return []
    (section_offset,) = struct.unpack_from("<Q", header, 0x28)
    entry_size, count = struct.unpack_from("<HH", header, 0x3A)
    file.seek(section_offset)
    table = file.read(entry_size * count)
    # Each section header: name, type, flags, addr, offset, size, link, ... -> (type, offset, size, link).
    sections = [struct.unpack_from("<4xI16xQQI", table, i * entry_size) for i in range(count)]
    needed = []
    for kind, offset, size, link in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        file.seek(offset)
        entries = file.read(size)
        _, strings_offset, strings_size, _ = sections[link]
        file.seek(strings_offset)
        strings = file.read(strings_size)
        for tag, value in struct.iter_unpack("<qQ", entries[: len(entries) // 16 * 16]):
            if tag == 1:  # DT_NEEDED: an offset into the string table
                needed.append(strings[value : strings.index(b"\0", value)].decode())
    return needed


def linked_cuda_majors(needed: list[str]) -> set[int]:
    """The CUDA runtime major versions among linked libraries: {13} for ["libtorch.so", "libcudart.so.13"]."""
    return {int(m.group(1)) for name in needed if (m := re.fullmatch(r"libcudart\.so\.(\d+)", name))}


def cuda_major(tag: str) -> int:
    """The CUDA major version of a tag as packages spell it: "cu13" -> 13, "cu130" -> 13, "cu128" -> 12."""
    digits = tag.removeprefix("cu")
    return int(digits if len(digits) <= 2 else digits[:-1])


def extra_cuda_majors(requires: list[str]) -> set[int]:
    """The CUDA major versions that requirement extras name: {13} for ["nvidia-cutlass-dsl[cu13]==4.7.1"]."""
    return {
        cuda_major(extra.strip())
        for requirement in requires
        for extras in re.findall(r"\[([^\]]*)\]", requirement)
        for extra in extras.split(",")
        if re.fullmatch(r"\s*cu\d+\s*", extra)
    }


def vllm_build() -> tuple[str, set[int]] | None:
    """(version, the CUDA major versions its compiled ops were built for) of the installed vllm, without importing it:
    the libcudart.so.N its top-level .so files link, else the cuNN extras of its requirements. None: not installed."""
    try:
        dist = metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return None
    majors: set[int] = set()
    for file in dist.files or []:
        if len(file.parts) == 2 and file.parts[0] == "vllm" and file.name.endswith(".so"):
            try:
                with open(dist.locate_file(file), "rb") as so:
                    majors |= linked_cuda_majors(elf_needed(so))
            except (OSError, struct.error, ValueError, IndexError):
                continue  # unreadable or not ELF: the import will say more than we can
    return dist.version, majors or extra_cuda_majors(dist.requires or [])


def torch_install(major: int) -> str:
    """The command that installs this torch version built for CUDA `major`."""
    version = torch.__version__.split("+")[0]
    if major in TORCH_INDEX:
        return f"pip install --force-reinstall torch=={version} --index-url {TORCH_INDEX[major]}"
    return f"install a CUDA {major} build of torch {version} (https://pytorch.org/get-started/locally/)"


def cuda_problems() -> list[str]:
    """A line when torch's CUDA major version is not the one the installed vllm was built for (its compiled ops then
    fail to load: libcudart.so.N not found), with the pip command that fixes it."""
    build = vllm_build()
    if build is None or not build[1]:
        return []  # no vllm (its import says so), or nothing to compare
    version, majors = build
    wanted = max(majors)
    have = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
    if have == wanted:
        return []
    built = f"a CUDA {torch.version.cuda} build" if have else "a build without CUDA"
    return [
        f"torch {torch.__version__} is {built}, but vllm {version} is built for CUDA {wanted}: {torch_install(wanted)}"
    ]


def c_compiler() -> str | None:
    """The C compiler Triton would use to build its launchers: $CC, else gcc, else clang (None: none)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def python_headers() -> Path:
    """Where Python.h should be for this interpreter (Triton compiles its launchers against it)."""
    return Path(sysconfig.get_paths()["include"]) / "Python.h"


def toolchain_problems(enforce_eager: bool) -> list[str]:
    """Lines for a missing C compiler or Python.h. Triton compiles each kernel's launcher with both, and vLLM runs
    Triton kernels (its sampler) and, unless eager, torch.compile, whose kernels are Triton's too."""
    eager = (
        ""
        if enforce_eager
        else "; --vllm-enforce-eager does not avoid it: it skips torch.compile, not vLLM's own Triton kernels"
    )
    problems = []
    if c_compiler() is None:
        problems.append(f"no C compiler (gcc, clang or $CC), which Triton needs: apt-get install gcc{eager}")
    if not python_headers().is_file():
        dev = f"python{sys.version_info.major}.{sys.version_info.minor}-dev"
        problems.append(f"no {python_headers()}, which Triton needs: apt-get install {dev}{eager}")
    return problems


def problems(enforce_eager: bool = False) -> list[str]:
    """Every problem that would stop the vLLM engine on this machine, one line each with its fix ([]: none)."""
    return cuda_problems() + toolchain_problems(enforce_eager)


def describe(enforce_eager: bool = False) -> str:
    """One line: what the engine will run with, e.g. "vLLM pre-flight: torch 2.13.0+cu130 (CUDA 13.0), vllm 0.30.0
    (CUDA 13), cc /usr/bin/gcc, Python.h found, FlashInfer sampler off, CUDA graphs"."""
    build = vllm_build()
    vllm = (
        "vllm not installed"
        if build is None
        else f"vllm {build[0]} (CUDA {', '.join(map(str, sorted(build[1]))) or '?'})"
    )
    flashinfer = "on" if os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "1") != "0" else "off"
    return (
        f"vLLM pre-flight: torch {torch.__version__} (CUDA {torch.version.cuda}), {vllm}, cc {c_compiler()}, "
        f"Python.h {'found' if python_headers().is_file() else 'missing'}, FlashInfer sampler {flashinfer}, "
        f"{'eager' if enforce_eager else 'CUDA graphs'}"
    )


def prepare_vllm(enforce_eager: bool = False) -> None:
    """Run before the vLLM engine is built. FlashInfer's top-p sampler is JIT-compiled with nvcc while the engine
    warms up (vllm/envs.py: VLLM_USE_FLASHINFER_SAMPLER defaults on), so it is turned off unless the user set it:
    no CUDA toolkit needed, and seeded requests skip it anyway. A CUDA mismatch or a missing compiler or Python.h
    raises (one line, with the apt command, or --backend hf, which compiles nothing): the engine would die in its
    warm-up, after minutes of loading."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if problems := cuda_problems():
        raise UsageError(problems[0])
    if problems := toolchain_problems(enforce_eager):
        raise UsageError("; ".join(problems) + "; or run with --backend hf, which compiles nothing")
    distributed.print0(describe(enforce_eager))
