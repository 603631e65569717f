"""What this machine runs well: its CPU (or GPU), ISA, and the dtype and kernel path chosen from them.

bfloat16 is the fast choice only where the CPU has bf16 arithmetic: avx512_bf16, AMX or
avx_ne_convert. There the projections run on bf16 weights pre-packed for oneDNN (about 4x float32's
prefill on a Xeon with avx512_bf16). Elsewhere `auto` picks float32 on the portable path (torch's own
operators, which run on any CPU and on CUDA):
- AVX2-only CPUs (many AMD EPYC): oneDNN refuses bf16 outright ("bf16 path needs the cpu support
  avx_ne_convert or avx512bw, avx512vl and avx512dq");
- AVX-512 CPUs without avx512_bf16: oneDNN accepts bf16 but emulates it, and measured 3.7x slower
  than float32 in prefill (docs/benchmarks.md).

`PDSERVE_KERNELS=portable` forces the portable path (and float32 for `auto`) on any machine, so that
both paths can be tested everywhere.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KERNELS_ENV = "PDSERVE_KERNELS"
# Variables that change which kernels run: recorded beside every benchmark figure. The first three
# make this machine run as an AVX2-only CPU would (ATen's dispatch, oneDNN, MKL).
CPU_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", KERNELS_ENV)
# Set before torch loads, these make an AVX-512 machine choose and run kernels as an AVX2-only one
# does: oneDNN then refuses bf16 with the very error an AMD EPYC gives.
AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
KERNEL_MODES = ("auto", "portable")  # what a user may ask for
ONEDNN, PORTABLE = "onednn", "portable"  # the kernel paths
# oneDNN takes bf16 with all three, or avx_ne_convert (torch's own check at pack time)...
ONEDNN_BF16_FEATURES = ("avx512bw", "avx512vl", "avx512dq")
# ... but computes it natively only with one of these (else it converts to float32 and back).
NATIVE_BF16_FEATURES = ("amx_bf16", "avx512_bf16", "avx_ne_convert")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "AMD EPYC 7B13", "Intel(R) Xeon(R) Processor", ...
    isa: str  # ATen's dispatch level: torch.backends.cpu.get_cpu_capability() ("AVX512", "AVX2", ...)
    flags: frozenset[str]  # /proc/cpuinfo flags, plus what torch reports of NATIVE_BF16_FEATURES
    onednn_bf16: bool  # oneDNN takes bf16 GEMMs here (natively or emulated)

    @classmethod
    def detect(cls) -> CpuInfo:
        model, flags = "", frozenset()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    key = key.strip()
                    if key == "model name" and not model:
                        model = value.strip()
                    elif key == "flags" and not flags:
                        flags = frozenset(value.split())
        except OSError:
            pass
        # torch's own reading (cpuinfo) where /proc has none: these are the ones that decide.
        for name, ask in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx_bf16", "_is_amx_tile_supported")):
            if getattr(torch.cpu, ask, lambda: False)():
                flags |= {name}
        onednn_bf16 = torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return cls(model or platform.processor() or platform.machine(), torch.backends.cpu.get_cpu_capability(),
                   flags, onednn_bf16)

    @property
    def native_bf16(self) -> bool:
        """bf16 GEMMs in bf16 arithmetic, not emulated."""
        return self.onednn_bf16 and any(f in self.flags for f in NATIVE_BF16_FEATURES)

    def bf16_missing(self) -> str:
        """Why this CPU has no native bf16 GEMMs, naming the features it lacks."""
        if self.onednn_bf16:
            return "the CPU lacks avx512_bf16, amx_bf16 and avx_ne_convert, so oneDNN emulates bf16 GEMMs"
        missing = [f for f in ONEDNN_BF16_FEATURES if f not in self.flags]
        if self.flags and (not missing or "avx_ne_convert" in self.flags):
            return "oneDNN reports no bf16 support although the CPU lists its features (ONEDNN_MAX_CPU_ISA may cap it)"
        return (f"the CPU lacks {', '.join(missing)} (oneDNN's bf16 GEMMs need avx512bw, avx512vl and avx512dq, "
                "or avx_ne_convert)")


@functools.cache
def onednn_bf16_prepack_works() -> bool:
    """Pack a small bf16 weight for oneDNN and run it: the pack-time check torch makes, and the result."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 32, generator=gen).bfloat16()
    x = torch.randn(5, 32, generator=gen).bfloat16()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(out.float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=5e-2)


@functools.cache
def onednn_float32_works() -> bool:
    """Run a small float32 GEMM on oneDNN with a plain (unpacked) weight, as models/layers.py's
    float32 path does, and check the result: where it fails, float32 GEMMs stay on F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 32, generator=gen), torch.randn(5, 32, generator=gen)
    try:
        out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(out, F.linear(x, weight), rtol=1e-4, atol=1e-5)


@dataclass(frozen=True)
class KernelPlan:
    """The dtype and kernel path a node runs, and why."""

    device: str
    device_name: str  # CPU model or GPU name
    isa: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    kernels: str  # onednn (pre-packed bf16 weights) | portable (torch's own operators)
    reason: str
    warning: str | None = None  # logged once at start
    compiled: bool = False  # pdserve's own C++ kernels may run (CPU, not forced portable)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def prepack(self) -> bool:
        return self.kernels == ONEDNN

    def labels(self) -> dict[str, str]:
        """For the `pdserve:engine_info` gauge and the benchmarks' JSON."""
        return {"device": self.device, "device_name": self.device_name, "isa": self.isa, "dtype": self.dtype,
                "kernels": self.kernels}

    def describe(self) -> str:
        return f"{self.device_name} ({self.isa}): {self.dtype} on {self.kernels} kernels ({self.reason})"


def kernel_mode(kernels: str | None = None) -> str:
    """`kernels` if given, else $PDSERVE_KERNELS, else auto; ValueError for anything else."""
    mode = kernels if kernels is not None else (os.environ.get(KERNELS_ENV) or "auto")
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels ({KERNELS_ENV}) must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode


def plan_kernels(dtype: str = "auto", device: str = "cpu", kernels: str | None = None,
                 cpu: CpuInfo | None = None) -> KernelPlan:
    """Choose the dtype (for `auto`) and the kernel path from what the device reports."""
    mode = kernel_mode(kernels)
    if device != "cpu":
        return _plan_accelerator(dtype, device)
    cpu = cpu or CpuInfo.detect()

    def plan(resolved: str, path: str, reason: str, warning: str | None = None) -> KernelPlan:
        return KernelPlan(device, cpu.model, cpu.isa, resolved, path, reason, warning, compiled=mode != "portable")

    if mode == "portable":
        return plan("float32" if dtype == "auto" else dtype, PORTABLE, f"{KERNELS_ENV}=portable")
    if dtype in ("float32", "float16"):
        return plan(dtype, PORTABLE, f"{dtype} asked for")
    packs = cpu.onednn_bf16 and onednn_bf16_prepack_works()
    if packs and cpu.native_bf16:
        return plan("bfloat16", ONEDNN, "native bf16 GEMMs")
    why = cpu.bf16_missing()
    if dtype == "auto":
        return plan("float32", PORTABLE, f"no native bf16: {why}")
    # bfloat16 asked for without native support: the best bf16 path there is, said once.
    path = ONEDNN if packs else PORTABLE
    return plan("bfloat16", path, "bfloat16 asked for",
                f"--dtype bfloat16: no native bf16 GEMMs on this CPU; {why}. Running bfloat16 on {path} kernels: "
                "correct, but slower than float32 here (--dtype auto picks float32)")


def _plan_accelerator(dtype: str, device: str) -> KernelPlan:
    dev = torch.device(device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        name, isa = torch.cuda.get_device_name(dev), f"sm_{major}{minor}"
        native_bf16 = torch.cuda.is_bf16_supported()
    else:
        name, isa, native_bf16 = dev.type, dev.type, True
    if dtype == "auto":
        dtype = "bfloat16" if native_bf16 else "float16"
        return KernelPlan(device, name, isa, dtype, PORTABLE, f"auto on {dev.type}")
    return KernelPlan(device, name, isa, dtype, PORTABLE, f"{dtype} asked for")
