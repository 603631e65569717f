"""OpenAI-compatible request and response bodies (the subset pdserve serves), as pydantic models."""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.api.tools import ToolUse, hermes_messages
from pdserve.sampling_params import InvalidParameter, SamplingParams, StructuredOutputs

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
logger = logging.getLogger(__name__)


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


# Fields OpenAI or vLLM define that pdserve does not serve yet (issue 20): a request that asks for
# one gets a 400 naming it, not an answer that silently differs from what it asked. Each test says
# whether a value asks for the feature (null, false, "none", n=1... ask for nothing).
NOT_SERVED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: _set(v) and v != 1, "use_beam_search": _set, "suffix": lambda v: _set(v) and v != "",
    "functions": _set, "function_call": lambda v: _set(v) and v != "none",
    "audio": _set, "modalities": lambda v: _set(v) and v != ["text"], "prediction": _set,
}
# vLLM's constraints with a value (structured_outputs keys, guided_* fields), besides its json_object
# flag; and the backends whose place llguidance takes.
VALUED_KINDS = ("json", "regex", "choice", "grammar")
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")
_unknown_logged: set[str] = set()


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
    # Structured output (one at a time): OpenAI's response_format; vLLM's structured_outputs and its
    # older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

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

    def requested_structure(self) -> StructuredOutputs | None:
        """The one constraint the output must match, from whichever field asked for it."""
        asked: list[StructuredOutputs] = []
        if self.response_format is not None:
            asked += _response_format(self.response_format)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            unknown = sorted(set(so) - {*VALUED_KINDS, "json_object"})
            if unknown:
                raise InvalidParameter("structured_outputs", f"structured_outputs.{unknown[0]} is not supported by "
                                                             f"this server; it takes one of {[*VALUED_KINDS, 'json_object']}")
            asked += [StructuredOutputs(k, so[k], "structured_outputs") for k in VALUED_KINDS if so.get(k) is not None]
            if so.get("json_object"):
                asked.append(StructuredOutputs("json_object", None, "structured_outputs"))
        for kind in VALUED_KINDS:
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                asked.append(StructuredOutputs(kind, value, f"guided_{kind}"))
        if self.guided_decoding_backend not in (None, *GRAMMAR_BACKENDS):
            raise InvalidParameter("guided_decoding_backend", f"this server's structured output runs on llguidance; "
                                   f"guided_decoding_backend must be one of {list(GRAMMAR_BACKENDS)}, "
                                   f"got {self.guided_decoding_backend!r}")
        tools = self.tool_use()
        forced = tools.structure() if tools is not None else None  # required / named: a schema forces the calls
        if forced is not None:
            asked.append(forced)
        if len(asked) > 1:
            raise InvalidParameter(asked[1].field, "one structured output constraint per request, got "
                                                   + " and ".join(f"{a.field} ({a.kind})" for a in asked))
        return asked[0] if asked else None

    def tool_use(self) -> ToolUse | None:
        """Chat's tools and tool_choice (completions have none)."""
        return None

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
            structured=self.requested_structure(),
        )


def _response_format(rf: dict[str, Any]) -> list[StructuredOutputs]:
    """OpenAI's response_format: text (nothing), json_object, or json_schema {name, schema, strict}."""
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [StructuredOutputs("json_object", None, "response_format")]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise InvalidParameter("response_format", "response_format json_schema needs "
                                                      "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return [StructuredOutputs("json", spec["schema"], "response_format")]
    raise InvalidParameter("response_format", f"response_format type must be text, json_object or json_schema, "
                                              f"got {kind!r}")


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
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers

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
    tools: list[dict[str, Any]] | None = None  # functions the model may call (api/tools.py)
    tool_choice: str | dict[str, Any] | None = None  # none | auto (default with tools) | required | a function
    parallel_tool_calls: bool | None = None  # false: one call at most

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

    def tool_use(self) -> ToolUse | None:
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_inputs(self, template_knows_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """The chat template's messages and tools. A template that knows nothing of tools gets the
        conversation the Hermes way (api/tools.py), and no tools."""
        messages, use = self.template_messages(), self.tool_use()
        tools = use.tools if use is not None else None
        if template_knows_tools:
            return messages, tools
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return hermes_messages(messages, tools or []), None
        return messages, None

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as HF chat templates take them (a call's arguments as an object)."""
        if not self.messages:
            raise InvalidParameter("messages", "messages must not be empty")
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidParameter("messages", f"messages[{i}].role {m.role!r} is not one of {list(CHAT_ROLES)}")
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [_template_call(i, call) for call in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


def _template_call(i: int, call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier call, its arguments parsed (HF templates take them as an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidParameter("messages", f"messages[{i}].tool_calls: each call needs function.name and "
                                           "function.arguments")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            raise InvalidParameter("messages", f"messages[{i}].tool_calls: arguments of {function['name']!r} "
                                               "are not JSON") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


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
