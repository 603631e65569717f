"""Offline API: `LLM().generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Any, Sequence

from tqdm import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.messages import RequestOutput
from pdserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls(**config.__dict__)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion, in order; every one is validated first.
        A prompt whose params ask for n > 1 sequences has its n outputs in its place, by index."""
        batch = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(batch):
            raise ValueError(f"got {len(param_list)} SamplingParams for {len(batch)} prompts")
        # Reject bad input before any request is queued.
        checked = [self.engine.check_request(self.engine.tokenize_prompt(p), sp) for p, sp in zip(batch, param_list)]
        added = [(self.engine.add(request).request_id, request.params.n) for request in checked]
        wanted = [(request_id, i) for request_id, n in added for i in range(n)]
        done: dict[tuple[str, int], RequestOutput] = {}
        with tqdm(total=len(wanted), disable=not use_tqdm, desc="Generating") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id, out.index] = out
                        bar.update(1)
        return [done[key] for key in wanted]

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> RequestOutput:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt, params)[0]


def _is_single_prompt(prompts: Any) -> bool:
    return isinstance(prompts, str) or (isinstance(prompts, list) and (not prompts or isinstance(prompts[0], int)))
