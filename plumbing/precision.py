"""Precision: fp32 master weights always; matmuls in bf16 autocast where the device does bf16 fast.

The choice is a value, not process state: choose_precision() once in main, then every forward pass (the
sampler's, the log-probs', the update's) runs under `precision.autocast(device_type)` of the Precision it is
handed. FP32 (the default everywhere) is autocast off.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}  # either makes bf16 matmuls faster than fp32 on a CPU


@dataclass(frozen=True)
class Precision:
    """Which device types compute their forward passes in bf16 autocast, and the line that says why."""

    bf16: frozenset[str] = frozenset()
    line: str = "precision: fp32"

    def autocast(self, device_type: str):
        """The autocast context for a forward pass on device_type: bf16 where chosen, else off."""
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type in self.bf16)


FP32 = Precision()


def _cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo (None where there is none, e.g. not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), None)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    return set((_cpuinfo("flags") or "").split())


def cpu_description() -> str | None:
    """The CPU's model name as Linux reports it and its bf16 flags, e.g. "AMD EPYC (avx512_bf16)", for benchmark
    records (two machines of one name can differ in exactly these); None where Linux does not report a name."""
    name = _cpuinfo("model name")
    flags = sorted(BF16_CPU_FLAGS & cpu_flags())
    return None if name is None else f"{name} ({', '.join(flags) or 'no bf16 flags'})"


def gpu_has_bf16() -> bool:
    """Whether the GPU computes bf16 in hardware (compute capability 8.0 or newer, or ROCm). torch's default check
    also counts emulation: a V100 or T4 answers True, runs bf16 slowly, and vLLM refuses bfloat16 there."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def engine_dtype(device_type: str = "cuda", precision: Precision = FP32) -> str:
    """The dtype for a vLLM engine. On the GPU: "bfloat16" where the GPU has bf16, else "float16". On the CPU (vLLM's
    CPU build) the run's own: "bfloat16" where `precision` autocasts the CPU to bf16, else "float32", so that an fp32
    run samples with the log-probs its trainer computes."""
    if device_type == "cpu":
        return "bfloat16" if "cpu" in precision.bf16 else "float32"
    return "bfloat16" if gpu_has_bf16() else "float16"


def fast_bf16(device_type: str) -> tuple[bool, str]:
    """Whether bf16 matmuls are faster than fp32 on this device type, and why."""
    if device_type == "cuda":
        if gpu_has_bf16():
            return True, "the GPU has bf16"
        return False, "the GPU has no bf16 (or only emulates it)"
    if device_type == "cpu":
        found = sorted(BF16_CPU_FLAGS & cpu_flags())
        if found:
            return True, f"the CPU has {' and '.join(found)}"
        return False, "the CPU has neither AVX-512 BF16 nor AMX, so bf16 matmuls would be slower than fp32"
    return False, f"no bf16 autocast is used on {device_type}"


def choose_precision(precision: str, device: str) -> Precision:
    """The matmul precision for the training device (and the CPU, where a reference model may be parked):
    "auto" = bf16 where fast_bf16, "bf16" or "fp32" to force. Its .line is what to print and log."""
    device_type = torch.device(device).type
    chosen, bf16 = {}, set()
    for kind in dict.fromkeys([device_type, "cpu"]):
        fast, why = fast_bf16(kind)
        use = precision == "bf16" or (precision == "auto" and fast)
        chosen[kind] = ("bf16 autocast" if use else "fp32") + (
            f" ({why})" if precision == "auto" else f" (--precision {precision})"
        )
        if use:
            bf16.add(kind)
    return Precision(
        bf16=frozenset(bf16), line="precision: " + "; ".join(f"{kind} {what}" for kind, what in chosen.items())
    )
