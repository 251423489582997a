"""plumbing/vllm_preflight.py: the checks that run before the vLLM engine is built, on CPU with faked torch, vllm
and tools.

A CUDA mismatch between torch and vllm's compiled ops is one line with the pip command that fixes it, raised before
the engine exists; a missing C compiler or Python.h is named; FlashInfer's JIT sampler is off unless the user set it.
"""

import os
import struct
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from test_vllm_glue import FakeEngine, calls, make_fake_vllm

from plumbing import UsageError, vllm_preflight
from plumbing.engines import VLLMSampler

FIX = "pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130"


def tiny_elf(needed: list[str]) -> bytes:
    """A minimal 64-bit little-endian ELF shared object whose dynamic section links `needed`: a header, the string
    table, the dynamic entries, then three section headers (null, .dynstr, .dynamic)."""
    strings = b"\0" + b"".join(name.encode() + b"\0" for name in needed)
    offsets = [strings.index(name.encode() + b"\0") for name in needed]
    dynamic = b"".join(struct.pack("<qQ", 1, offset) for offset in offsets) + struct.pack("<qQ", 0, 0)
    strings_at, dynamic_at = 64, 64 + len(strings) + (-len(strings)) % 8
    sections_at = dynamic_at + len(dynamic)
    header = struct.pack(
        "<16sHHIQQQIHHHHHH", b"\x7fELF\x02\x01\x01", 3, 62, 1, 0, 0, sections_at, 0, 64, 0, 0, 64, 3, 0
    )
    sections = (
        struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        + struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, strings_at, len(strings), 0, 0, 1, 0)
        + struct.pack("<IIQQQQIIQQ", 0, 6, 0, 0, dynamic_at, len(dynamic), 1, 0, 8, 16)
    )
    return header + strings + b"\0" * (dynamic_at - strings_at - len(strings)) + dynamic + sections


class FakeDistribution:
    """What vllm_build reads of importlib.metadata's Distribution: version, requires, files, locate_file."""

    def __init__(self, root: Path, files: dict[str, bytes], requires: list[str]):
        for name, data in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
        self.root, self.version, self.requires = root, "0.30.0", requires
        self.files = [metadata.PackagePath(name) for name in [*files, "vllm/__init__.py"]]

    def locate_file(self, path) -> Path:
        return self.root / path


@pytest.fixture
def installed(monkeypatch, tmp_path):
    """installed(files, requires): make `vllm` look installed with these files and requirements (vllm is not)."""

    def install(files: dict[str, bytes], requires: list[str] = ()):
        dist, original = FakeDistribution(tmp_path, files, list(requires)), metadata.distribution
        monkeypatch.setattr(metadata, "distribution", lambda name: dist if name == "vllm" else original(name))

    return install


CU13_OPS = {
    "vllm/_C_stable_libtorch.abi3.so": tiny_elf(["libtorch.so", "libcudart.so.13", "libcuda.so.1"]),
    "vllm/fs_io_C.abi3.so": tiny_elf(["libtorch.so", "libnvrtc.so.13"]),
    "vllm/_rust_tool_parser.abi3.so": b"not an ELF file",
}


def test_elf_needed_reads_the_dynamic_section(tmp_path):
    path = tmp_path / "ops.so"
    path.write_bytes(tiny_elf(["libtorch.so", "libcudart.so.13", "libc.so.6"]))
    with open(path, "rb") as file:
        assert vllm_preflight.elf_needed(file) == ["libtorch.so", "libcudart.so.13", "libc.so.6"]
    path.write_bytes(b"#!/bin/sh\n")
    with open(path, "rb") as file:
        assert vllm_preflight.elf_needed(file) == []


def test_elf_needed_on_a_real_library():
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    if not library.is_file():
        pytest.skip("torch ships no lib/libc10.so here")
    with open(library, "rb") as file:
        assert "libc.so.6" in vllm_preflight.elf_needed(file)


def test_cuda_major_versions():
    assert [vllm_preflight.cuda_major(tag) for tag in ("cu13", "cu130", "cu128", "cu118", "cu12")] == [
        13,
        13,
        12,
        11,
        12,
    ]
    assert vllm_preflight.linked_cuda_majors(["libtorch.so", "libcudart.so.13", "libnvrtc.so.12"]) == {13}
    assert vllm_preflight.extra_cuda_majors(
        [
            "nvidia-cutlass-dsl[cu13]==4.7.1",
            "humming-kernels[cu13]==0.1.12",
            "fastapi[standard]<0.137.0",
            "nvidia-deepstream-videodecode-cu13>=9.0.2",
        ]
    ) == {13}


@pytest.mark.parametrize("torch_cuda, built", [("12.8", "a CUDA 12.8 build"), (None, "a build without CUDA")])
def test_cuda_mismatch_is_one_line_with_the_fix(monkeypatch, installed, torch_cuda, built):
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    installed(CU13_OPS)
    assert vllm_preflight.vllm_build() == ("0.30.0", {13})
    [line] = vllm_preflight.problems()[:1]
    assert built in line and "vllm 0.30.0 is built for CUDA 13" in line and line.endswith(FIX) and "\n" not in line
    with pytest.raises(UsageError, match="built for CUDA 13: " + FIX.replace(".", r"\.")):
        vllm_preflight.prepare_vllm()


def test_metadata_extras_stand_in_for_unreadable_ops(monkeypatch, installed):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    installed({}, ["torch==2.13.0", "nvidia-cutlass-dsl[cu13]==4.7.1", 'zentorch==2.13.0.0; extra == "zen"'])
    assert vllm_preflight.vllm_build() == ("0.30.0", {13})
    assert vllm_preflight.cuda_problems()[0].endswith(FIX)


def test_matching_cuda_or_no_vllm_is_no_problem(monkeypatch, installed):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    installed(CU13_OPS)
    assert vllm_preflight.cuda_problems() == []

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    # importing vllm says it is missing
    assert vllm_preflight.vllm_build() is None and vllm_preflight.cuda_problems() == []


def test_missing_compiler_and_headers_are_named(monkeypatch, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(vllm_preflight.shutil, "which", lambda name: None)
    monkeypatch.setattr(vllm_preflight.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    compiler, headers = vllm_preflight.toolchain_problems(enforce_eager=False)
    assert "no C compiler" in compiler and "apt-get install gcc" in compiler and "--vllm-enforce-eager" in compiler
    dev = f"python{sys.version_info.major}.{sys.version_info.minor}-dev"
    assert str(tmp_path / "Python.h") in headers and dev in headers and "--vllm-enforce-eager" in headers
    assert all("enforce-eager" not in line for line in vllm_preflight.toolchain_problems(enforce_eager=True))

    monkeypatch.setattr(vllm_preflight, "cuda_problems", lambda: [])
    with pytest.raises(UsageError, match=r"apt-get install gcc.*; or run with --backend hf, which compiles nothing"):
        vllm_preflight.prepare_vllm()  # refused before the engine is built: it would die in its warm-up

    (tmp_path / "Python.h").write_text("")
    monkeypatch.setenv("CC", "/opt/cc")
    assert vllm_preflight.toolchain_problems(enforce_eager=False) == []


def test_flashinfer_sampler_off_only_when_unset(monkeypatch):
    monkeypatch.setattr(vllm_preflight, "cuda_problems", lambda: [])
    monkeypatch.setattr(vllm_preflight, "toolchain_problems", lambda enforce_eager: [])
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    vllm_preflight.prepare_vllm()
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    vllm_preflight.prepare_vllm()
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_vllm_sampler_checks_before_building_the_engine(monkeypatch, installed, capsys):
    engine = FakeEngine()
    monkeypatch.setitem(sys.modules, "vllm", make_fake_vllm(engine))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    installed(CU13_OPS)
    with pytest.raises(UsageError, match=FIX.replace(".", r"\.")):
        VLLMSampler("m", max_model_len=64)
    assert calls(engine, "LLM") == []  # stopped in a second, not minutes into the engine's start-up

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    VLLMSampler("m", max_model_len=64)
    out = capsys.readouterr().out
    assert "vLLM pre-flight: " in out and "vllm 0.30.0 (CUDA 13)" in out and "FlashInfer sampler off" in out
    assert "vLLM engine ready in " in out and os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_the_rollout_engine_is_named_with_the_reason_it_was_chosen(monkeypatch):
    import builtins

    from plumbing import engines

    assert engines.resolve_backend("hf") == ("hf", "--backend hf")
    monkeypatch.setattr(engines.torch.cuda, "is_available", lambda: False)
    assert engines.resolve_backend("auto") == ("hf", "--backend auto: no CUDA GPU")
    monkeypatch.setattr(engines.torch.cuda, "is_available", lambda: True)
    real_import = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(ImportError(name)) if name == "vllm" else real_import(name, *a, **k)
        ),
    )
    backend, why = engines.resolve_backend("auto")
    assert backend == "hf" and "vllm is not installed" in why  # the fallback is said, not silent
