"""OpenAI-compatible request and response bodies (the subset pdserve serves), as pydantic models."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sampling_params import InvalidParameter, SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Generation parameters shared by both endpoints (OpenAI's plus vLLM's extras)."""

    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # PD disaggregation (proxy <-> nodes)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int, max_tokens_param: str = "max_tokens") -> SamplingParams:
        if self.n != 1:
            raise InvalidParameter("n", f"only n=1 is supported, got n={self.n}")
        try:
            return self._sampling_params(max_tokens)
        except InvalidParameter as exc:  # report the field the client actually used
            if exc.param == "max_tokens" and max_tokens_param != "max_tokens":
                raise InvalidParameter(max_tokens_param, str(exc).replace("max_tokens", max_tokens_param)) from None
            raise

    def _sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidParameter("prompt", f"only one prompt per request is supported, got {len(p)}")
            return p[0]
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidParameter("messages", f"unsupported content part type {part.get('type')!r}; only text")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        if not self.messages:
            raise InvalidParameter("messages", "messages must not be empty")
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidParameter("messages", f"messages[{i}].role {m.role!r} is not one of {list(CHAT_ROLES)}")
            out.append({"role": m.role, "content": m.text()})
        return out


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
