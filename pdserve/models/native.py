"""pdserve's own C++ kernels (csrc/), compiled once per machine with torch's cpp_extension.

`make install` builds them (`build()`); a process that finds no build
compiles them on first use. The build is cached under the pdserve cache, keyed by the source, the
torch version and the CPU's flags: it is compiled for this CPU (-march=native), so a machine with
other instructions builds its own. Without a C++ compiler (or with PDSERVE_KERNELS=portable) the
engine keeps torch's SDPA over gathered blocks, which runs anywhere.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from pdserve.platform import CpuInfo

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("bindings.cpp", "amx.cpp", "paged_decode_attention.cpp", "prefill_attention.cpp",
                                   "fused_ops.cpp", "int8_head.cpp", "int4_linear.cpp", "decode_stack.cpp")]
HEADERS = [CSRC / "vec_math.h", CSRC / "kernels.h", CSRC / "bindings.h", CSRC / "amx.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"]
MODULE_NAME = "pdserve_native"
AMX_ENV = "PDSERVE_AMX"  # "0": pdserve's kernels leave AMX's tiles alone (to compare, or to rule them out)
STALE_BUILD_LOCK_S = 600.0  # a build takes about a minute here; a lock this old belongs to a killed one


def kernels_root() -> Path:
    """Where every build of the kernels is cached (one directory per build_dir digest)."""
    from pdserve.models.locate import cache_root

    return cache_root() / "kernels"


def build_dir() -> Path:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    cpu = CpuInfo.detect()  # -march=native: another CPU needs its own build
    # Where the sources and torch's headers lie too: torch rebuilds a build directory whose recorded
    # paths differ, so two checkouts (or venvs) sharing one would rebuild it in turn, mid-run.
    for part in (torch.__version__, sys.version, sys.prefix, str(CSRC), " ".join(CFLAGS), cpu.model,
                 " ".join(sorted(cpu.flags))):
        digest.update(part.encode())
    return kernels_root() / digest.hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the (maybe inactive) venv."""
    try:
        import ninja
    except ImportError:
        return
    paths = os.environ.get("PATH", "").split(os.pathsep)
    if ninja.BIN_DIR not in paths:
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *paths])


def build(march: str = "native", directory: Path | None = None) -> ModuleType:
    """Compile (or load the cached build of) the extension; raises if that is impossible. Another
    `march` (x86-64-v3: AVX2; skylake-avx512: AVX-512 without bf16) builds what a CPU of that kind
    would, into `directory` (tests/test_other_cpus.py)."""
    from torch.utils.cpp_extension import load

    _put_ninja_on_path()
    name = MODULE_NAME if march == "native" else f"{MODULE_NAME}_{march.replace('-', '_')}"
    directory = directory or build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_lock(directory / "lock")
    cflags = [flag if flag != "-march=native" else f"-march={march}" for flag in CFLAGS]
    return load(name=name, sources=[str(s) for s in SOURCES], build_directory=str(directory), extra_cflags=cflags,
                verbose=False)


def remove_stale_lock(lock: Path) -> None:
    """torch's build lock, left by a build that was killed, makes every later build wait for ever
    (torch's FileBaton polls until the file goes): one older than any build here is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_S:
        logger.warning("removing %s, left %.0f s ago by a kernel build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


@functools.cache
def native_ops() -> ModuleType | None:
    """The compiled kernels, or None (logged once) where they cannot be built here."""
    try:
        ops = build()
    except Exception as exc:  # no compiler, no ninja, a failed build: the portable path still runs
        logger.warning("pdserve's C++ decode attention is unavailable (%s); decode attention runs "
                       "torch's SDPA over gathered blocks", str(exc).strip().splitlines()[-1] if str(exc) else exc)
        return None
    if os.environ.get(AMX_ENV) == "0":
        ops.set_amx(False)  # int4 projections and the int8 head on AVX-512 alone, as on a CPU without AMX
    return ops
