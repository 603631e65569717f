"""Auto mode's profile when none is given: the one cached for this machine, model and engine
settings, else a quick one measured now (about two minutes) and cached for the next start.

A profile prices prefill, decode and transfers on one machine for one model at one set of engine
settings; any of them changing (another CPU, torch, the model, dtype, quantization, token budget,
threads, ...) changes the costs, so each such combination has its own file under the cache root
(PDSERVE_CACHE_DIR, else the user cache), beside the converted models. What drifts after that
(a busier host, a faster engine) the proxy follows by itself (proxy/speed.py); `--profile` and
`pdserve profile` remain for a profile made on purpose.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, replace
from pathlib import Path

import torch

from pdserve.config import EngineConfig
from pdserve.models.locate import cache_root, resolve_model_dir
from pdserve.plan.profile import Profile, ProfilePoints, run_profile
from pdserve.platform import CpuInfo

log = logging.getLogger("pdserve.profile")


def profile_key(config: EngineConfig) -> dict:
    """Everything a profile's costs depend on: the machine, the software, the model, the settings."""
    cpu = CpuInfo.detect()
    settings = asdict(replace(config, model=str(resolve_model_dir(config.model).resolve())))
    settings.pop("kv_transfer")  # where KV goes, not what computing it costs (the transfers are measured apart)
    return {"cpu": cpu.model, "isa": cpu.isa, "flags": sorted(cpu.flags), "torch": torch.__version__,
            "kernels_env": os.environ.get("PDSERVE_KERNELS"), "engine": settings}


def cached_profile_path(config: EngineConfig) -> Path:
    key = profile_key(config)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "profiles" / f"{Path(key['engine']['model']).name}-{digest}.json"


def profile_for(config: EngineConfig) -> tuple[Path, bool]:
    """(the profile's path, whether it was measured now) for nodes running `config` on this machine."""
    path = cached_profile_path(config)
    if path.is_file():
        try:
            Profile.load(path)
            log.info("auto mode: no --profile given; using the one cached for this machine, model and settings: %s",
                     path)
            return path, False
        except ValueError as exc:  # an older pdserve's cost models: measure again
            log.warning("auto mode: cached profile %s is unreadable (%s); measuring a new one", path, exc)
    log.info("auto mode: no --profile given and none cached for this machine, model and settings; measuring a "
             "quick one (about two minutes), cached in %s for the next start", path)
    profile = run_profile(config, ProfilePoints.quick())
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    profile.save(partial)
    partial.replace(path)  # whole or absent: a start that dies mid-write leaves nothing to misread
    return path, True
