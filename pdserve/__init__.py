"""pdserve: LLM serving with prefill/decode disaggregation."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM is imported on first use: it brings torch (~1.4 s), which the proxy and the CLI's checks do without.
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
