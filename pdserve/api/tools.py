"""Tool calling in chat, as vLLM serves it with its `hermes` parser.

- The prompt: a chat template that knows tools gets them (and assistant tool calls with their
  arguments as objects, as HF templates expect). One that does not (SmolLM2's plain ChatML) gets
  them the Hermes way instead: the tools' signatures in a system message, each earlier call as
  `<tool_call>{"name", "arguments"}</tool_call>` in the assistant's text, each result as
  `<tool_response>...</tool_response>` from the user.
- `tool_choice`: `none` (no tools in the prompt, no parsing), `auto` (the model decides; calls are
  parsed from its text), `required` (a JSON schema forces an array of one or more calls) or a named
  function (a JSON schema forces its arguments).
- Parsing: `parse_tool_calls` for a whole answer, `ToolCallStream` for a streamed one: content
  passes through until a `<tool_call>` tag begins; each call goes out as one delta once its closing
  tag (or the end) arrives.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pdserve.sampling_params import InvalidParameter, StructuredOutputs

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

HERMES_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to help with the user's request. Their signatures "
    "are within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each call, answer with a "
    "JSON object holding the function's name and arguments within <tool_call></tool_call> XML tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-json-object>}}\n</tool_call>"
)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's format)
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolUse:
    """What a request's tools and tool_choice ask of its answer."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, validated
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the function, when named
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None = None) -> ToolUse | None:
        """None when nothing about tools applies (no tools, or tool_choice none)."""
        if tool_choice is not None and not tools:
            if tool_choice == "none":
                return None
            raise InvalidParameter("tool_choice", "tool_choice needs tools")
        if not tools:
            return None
        names = [_tool_name(i, t) for i, t in enumerate(tools)]
        parallel = parallel is not False
        if tool_choice in (None, "auto"):
            return cls(tools, "auto", parallel=parallel)
        if tool_choice == "none":
            return None
        if tool_choice == "required":
            return cls(tools, "required", parallel=parallel)
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            name = (tool_choice.get("function") or {}).get("name")
            if name not in names:
                raise InvalidParameter("tool_choice", f"tool_choice names function {name!r}, which is not among "
                                                      f"the tools {names}")
            return cls(tools, "named", name, parallel)
        raise InvalidParameter("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", "
                                              f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}")

    def structure(self) -> StructuredOutputs | None:
        """The JSON schema that forces calls (required, named); None when the model decides (auto)."""
        if self.choice == "named":
            return StructuredOutputs("json", _parameters(self._function(self.name)), "tool_choice")
        if self.choice == "required":
            calls = [{"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                       "parameters": _parameters(t["function"])},
                      "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return StructuredOutputs("json", array if self.parallel else {**array, "maxItems": 1}, "tool_choice")
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The answer's content and tool calls."""
        if self.choice == "named":
            return None, [ToolCall(self.name, text)]
        if self.choice == "required":
            try:
                forced = json.loads(text)
                return None, [ToolCall(c["name"], json.dumps(c["parameters"])) for c in forced]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens: what came is content
                return text, []
        content, calls = parse_tool_calls(text)
        return content, calls if self.parallel else calls[:1]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: tool_calls when the model called (auto, required); a named call stops as usual."""
        return "tool_calls" if called and self.choice != "named" and reason == "stop" else reason

    def _function(self, name: str) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def _tool_name(i: int, tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise InvalidParameter("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise InvalidParameter("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, "
                                        f"got {name!r}")
    if not isinstance(function.get("parameters", {}), dict):
        raise InvalidParameter("tools", f"tools[{i}].function.parameters must be a JSON schema object")
    return name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style calls in a whole answer: the text before the first tag is the content. A call
    whose JSON does not parse leaves the whole answer as content (as vLLM's parser does)."""
    if CALL_OPEN not in text:
        return text, []
    calls = []
    for body in _CALL.findall(text):
        call = _call(body)
        if call is None:
            return text, []
        calls.append(call)
    content = text[: text.index(CALL_OPEN)].strip()
    return content or None, calls


def _call(body: str) -> ToolCall | None:
    try:
        parsed = json.loads(body)
        name, arguments = parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if not isinstance(name, str):
        return None
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments))


class ToolCallStream:
    """One choice's streamed text, split into content deltas and whole tool calls (auto); forced
    calls (required, named) are JSON: they go out at the end. Content is the text before the first
    call, as in a whole answer."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.buffer = ""  # text not sent yet: a possible opening tag, or a call in progress
        self.in_call = False
        self.called = False  # a call has begun: later text outside calls is not content
        self.sent = 0  # calls sent so far (parallel_tool_calls false: one at most)

    def delta(self, text: str, finished: bool, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """One output's part of the stream: the content to send, the calls (as OpenAI's deltas) and,
        at the end, the finish reason."""
        content, calls = self.feed(text)
        if finished:
            rest, more = self.finish()
            content, calls = content + rest, calls + more
        deltas = [call.to_openai(self.sent - len(calls) + i) for i, call in enumerate(calls)]
        return content, deltas, self.use.finish_reason(reason, self.sent > 0) if finished else None

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Content to send now, and the calls this delta completed."""
        content, calls = self._feed(delta)
        return content, self._count(calls)

    def _count(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.use.parallel:
            calls = calls[: max(0, 1 - self.sent)]
        self.sent += len(calls)
        return calls

    def _feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.use.choice != "auto":
            return "", []
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(CALL_CLOSE)
                if end < 0:
                    return content, calls
                call = _call(self.buffer[:end].strip())
                calls += [call] if call is not None else []
                self.buffer, self.in_call = self.buffer[end + len(CALL_CLOSE):], False
                continue
            start = self.buffer.find(CALL_OPEN)
            if start >= 0:
                content += "" if self.called else self.buffer[:start]
                self.buffer, self.in_call, self.called = self.buffer[start + len(CALL_OPEN):], True, True
                continue
            keep = _partial_tag(self.buffer)  # hold back what may begin a tag
            content += "" if self.called else self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end: the forced calls, an unclosed call, or held-back text."""
        rest, self.buffer = self.buffer, ""
        if self.use.choice != "auto":
            content, calls = self.use.calls(rest)
            return content or "", self._count(calls)
        if self.in_call:
            call = _call(rest.strip())
            return "", self._count([call] if call is not None else [])
        return ("" if self.called else rest), []


def _partial_tag(text: str) -> int:
    """How many trailing characters of text could begin the opening tag."""
    for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation for a template that knows nothing of tools: tools in the system message,
    calls and results as text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{CALL_OPEN}\n{json.dumps(_hermes_call(c))}\n{CALL_CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if not tools:  # a history with calls, and no tools offered now
        return out
    preamble = HERMES_PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out


def _hermes_call(call: dict[str, Any]) -> dict[str, Any]:
    return {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
