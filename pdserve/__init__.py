"""pdserve: LLM serving with prefill/decode disaggregation."""

from pdserve.llm import LLM
from pdserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
