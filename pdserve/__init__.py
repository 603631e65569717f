"""pdserve: LLM serving with prefill/decode disaggregation."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Imported on first use: the proxy and the CLI's checks need neither, and LLM brings torch (~1.4 s).
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
