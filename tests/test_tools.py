"""Tool calling in chat: the Hermes parser (whole and streamed), tools and tool_choice checked,
the prompt for a template that knows no tools, and a round trip with the openai client on a real
node (a named call, required calls, auto calls streamed as deltas). Through the PD proxy:
tests/test_pd_push.py."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_pd_pull import MODEL

from pdserve.api.openai_protocol import ChatCompletionRequest
from pdserve.api.tools import ToolCallStream, ToolUse, parse_tool_calls
from pdserve.sampling_params import InvalidParameter

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
    "additionalProperties": False}}}
ANSWER = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def streamed(text: str, use: ToolUse, piece: int) -> tuple[str, list]:
    stream, content, calls = ToolCallStream(use), "", []
    for i in range(0, len(text), piece):
        c, k = stream.feed(text[i:i + piece])
        content, calls = content + c, calls + k
    c, k = stream.finish()
    return content + c, calls + k


def test_hermes_calls_are_parsed_whole_and_streamed_in_any_pieces():
    content, calls = parse_tool_calls(ANSWER)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    auto = ToolUse.of([WEATHER, TIME], "auto")
    for piece in (1, 3, 7, len(ANSWER)):  # tags split anywhere across deltas
        s_content, s_calls = streamed(ANSWER, auto, piece)
        assert s_content.strip() == content and [(c.name, c.arguments) for c in s_calls] == [
            (c.name, c.arguments) for c in calls], piece
    assert parse_tool_calls("no calls, just <tools> talk") == ("no calls, just <tools> talk", [])
    assert streamed("no calls, just <tools> talk <tool", auto, 2) == ("no calls, just <tools> talk <tool", [])
    broken = 'x <tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    assert parse_tool_calls(broken) == (broken, [])  # not JSON: all content, as vLLM's parser leaves it
    unclosed = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'  # max_tokens hit before the tag
    assert [c.name for c in parse_tool_calls(unclosed)[1]] == [c.name for c in streamed(unclosed, auto, 4)[1]] == ["get_time"]
    single = ToolUse.of([WEATHER, TIME], "auto", parallel=False)
    assert [c.name for c in single.calls(ANSWER)[1]] == [c.name for c in streamed(ANSWER, single, 5)[1]] == ["get_weather"]


@pytest.mark.parametrize("tools, choice, message", [
    (None, "required", "tool_choice needs tools"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among the tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "name must be"),
    ([{"type": "retrieval"}], "auto", "tools\\[0\\] must be"),
])
def test_bad_tools_and_tool_choice_are_refused(tools, choice, message):
    with pytest.raises(InvalidParameter, match=message):
        ToolUse.of(tools, choice)


def test_forced_calls_are_json_schemas_and_conflict_with_another_constraint():
    assert ToolUse.of(None, "none") is None and ToolUse.of([WEATHER], "none") is None
    named = ToolUse.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.structure().value == TIME["function"]["parameters"]
    required = ToolUse.of([WEATHER, TIME], "required", parallel=False).structure().value
    assert required["minItems"] == required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    assert ToolUse.of([WEATHER], "auto").structure() is None
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice="required",
                                 response_format={"type": "json_object"})
    with pytest.raises(InvalidParameter, match="one structured output constraint"):
        body.to_sampling_params(8)


def test_a_template_without_tools_gets_them_the_hermes_way():
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    body = ChatCompletionRequest(messages=history, tools=[WEATHER])
    messages, tools = body.template_inputs(template_knows_tools=False)
    assert tools is None and messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n-3 C, snow\n</tool_response>"}
    messages, tools = body.template_inputs(template_knows_tools=True)  # e.g. Qwen's: the template writes them
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo",
                                                                                            "unit": "celsius"}
    with pytest.raises(InvalidParameter, match="not JSON"):
        ChatCompletionRequest(messages=[{"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}]).template_inputs(False)


@pytest.fixture
def client(fp32_node):
    return openai.OpenAI(base_url=fp32_node.url + "/v1", api_key="unused", max_retries=0)


def test_a_tool_call_round_trip_with_the_openai_client(client):
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    asked = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=60,
                                           temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = asked.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The client runs the function and sends its result back; the model answers in words.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=40,
                                            temperature=0)  # tool_choice auto: it may call again, and does not
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > asked.usage.prompt_tokens  # the call and its result are in the prompt


def test_required_calls_for_every_choice_whole_and_streamed(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Rome, and the time in Tokyo?"}],
               tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, temperature=0.8, seed=4, n=2)
    done = client.chat.completions.create(**ask)
    for choice in done.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), schema)
    deltas: dict[int, list] = {0: [], 1: []}
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            deltas[c.index] += c.delta.tool_calls or []
    for choice in done.choices:
        assert [(d.function.name, d.function.arguments) for d in deltas[choice.index]] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert [d.index for d in deltas[choice.index]] == list(range(len(choice.message.tool_calls)))


def test_auto_calls_stream_as_deltas_after_the_content(client):
    """What the model writes decides (auto). A regex holds this small model to one Hermes call, so
    the parser meets a real answer, token by token."""
    regex = (r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,10}", '
             r'"unit": "celsius"\}\}\n</tool_call>')
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Madrid?"}], tools=[WEATHER],
               max_tokens=60, temperature=0, extra_body={"guided_regex": regex})
    done = client.chat.completions.create(**ask).choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content == "Let me check."
    [call] = done.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    content, calls = "", []
    for chunk in client.chat.completions.create(**ask, stream=True):
        if chunk.choices:
            content += chunk.choices[0].delta.content or ""
            calls += chunk.choices[0].delta.tool_calls or []
    assert content.strip() == "Let me check." and [(c.function.name, c.function.arguments) for c in calls] == [
        (call.function.name, call.function.arguments)]
