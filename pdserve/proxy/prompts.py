"""The prompt's token ids as a node will compute them: the model's tokenizer and chat template,
applied as the node applies them (node/server.py), so the proxy's block hashes are the node's."""

from __future__ import annotations

from pathlib import Path

from pdserve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.models.tokenizer import Tokenizer


class PromptTokens:
    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = Tokenizer(model_dir)

    def of(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            prompt = self.tokenizer.apply_chat_template(body.template_messages(), body.add_generation_prompt)
        else:
            prompt = body.single_prompt()
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
