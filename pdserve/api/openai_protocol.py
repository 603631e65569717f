"""OpenAI-compatible request and response bodies (the subset pdserve serves), as pydantic models."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.sampling_params import InvalidParameter, SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
logger = logging.getLogger(__name__)


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


# Fields OpenAI or vLLM define that pdserve does not serve yet (issue 20): a request that asks for
# one gets a 400 naming it, not an answer that silently differs from what it asked. Each test says
# whether a value asks for the feature (null, false, "none", n=1... ask for nothing).
NOT_SERVED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: _set(v) and v != 1, "use_beam_search": _set, "suffix": lambda v: _set(v) and v != "",
    "response_format": lambda v: _set(v) and not (isinstance(v, dict) and v.get("type") == "text"),
    "tools": _set, "tool_choice": lambda v: _set(v) and v != "none", "functions": _set,
    "function_call": lambda v: _set(v) and v != "none", "guided_json": _set, "guided_regex": _set,
    "guided_choice": _set, "guided_grammar": _set, "structured_outputs": _set, "guided_decoding_backend": _set,
    "audio": _set, "modalities": lambda v: _set(v) and v != ["text"], "prediction": _set,
}
_unknown_logged: set[str] = set()


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # token id (as JSON keys are strings) -> bias
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # PD disaggregation (proxy <-> nodes)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many most likely

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """How many alternatives to report per token (0: the sampled one only); None: no logprobs."""
        return None

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_sampling_params(self, max_tokens: int, max_tokens_param: str = "max_tokens") -> SamplingParams:
        self.refuse_unserved()
        try:
            return self._sampling_params(max_tokens)
        except InvalidParameter as exc:  # report the field the client actually used
            if exc.param == "max_tokens" and max_tokens_param != "max_tokens":
                raise InvalidParameter(max_tokens_param, str(exc).replace("max_tokens", max_tokens_param)) from None
            raise

    def refuse_unserved(self) -> None:
        """400 for a known field pdserve does not serve yet; a field no server defines is logged once."""
        for name, value in (self.model_extra or {}).items():
            asks = NOT_SERVED.get(name)
            if asks is not None and asks(value):
                raise InvalidParameter(name, f"{name} is not supported by this server yet (got {value!r}); "
                                             "leave it out or unset")
            if asks is None and name not in _unknown_logged:
                _unknown_logged.add(name)
                logger.warning("request field %r is not an OpenAI or vLLM field pdserve knows: ignored", name)

    def _logit_bias(self) -> dict[int, float]:
        try:
            return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise InvalidParameter("logit_bias", "logit_bias keys must be token ids, e.g. {\"50256\": -100}") from None

    def _sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            logit_bias=self._logit_bias(),
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # OpenAI's legacy format: this many alternatives per token
    echo: bool = False  # the prompt before the answer (and, with logprobs, its tokens' logprobs)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None  # echo's logprobs cover the prompt too

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
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # vLLM's chat extension (the last message's text before the answer): not served yet

    def refuse_unserved(self) -> None:
        if self.echo:
            raise InvalidParameter("echo", "echo on chat completions is not supported by this server yet")
        super().refuse_unserved()

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

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
