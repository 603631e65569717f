"""The prompt's token ids as a node will compute them: the model's tokenizer and chat template,
applied as the node applies them (node/server.py), so the proxy's block hashes are the node's."""

from __future__ import annotations

from pathlib import Path

from pdserve.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.models.tokenizer import Tokenizer
from pdserve.sampling_params import InvalidParameter


class PromptTokens:
    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = Tokenizer(model_dir)

    def of(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """InvalidParameter (a 400) where the node would refuse the prompt too."""
        if isinstance(body, ChatCompletionRequest):
            try:
                messages, tools = body.template_inputs(self.tokenizer.template_knows_tools)
                prompt = self.tokenizer.apply_chat_template(messages, body.add_generation_prompt, tools)
            except InvalidParameter:
                raise
            except ValueError as exc:  # the template refused the messages
                raise InvalidParameter("messages", str(exc)) from None
        else:
            prompt = body.single_prompt()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidParameter("prompt", "prompt must not be empty")
        return ids
