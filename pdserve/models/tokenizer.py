"""Tokenizer of an HF model directory: `tokenizers` for the text, jinja2 for the chat template."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer

from pdserve.sampling_params import InvalidParameter


def _raise_exception(message: str):
    raise ValueError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        self._tok = FastTokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.exists() else cfg.get("chat_template")
        )
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False)) and self.bos_token is not None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of text; add_bos=False for text that continues a sequence (an answer in a history)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (what grammar libraries build their token tables from)."""
        return self._tok.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (else api/tools.py writes them into the messages)."""
        return bool(self.chat_template and "tools" in self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if self._template is None:  # a base model's file (Gemma 3 270M's GGUF has none): 400, as vLLM answers
            raise InvalidParameter("messages", "this model has no chat template: send a plain prompt to "
                                               "/v1/completions instead")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as text or as {"content": text, ...}.
    return token.get("content") if isinstance(token, dict) else token
