"""Structured output, tool calls, the Anthropic Messages API and the Responses API through
the official `openai` and `anthropic` clients against a running `astra serve`, every
structured answer checked with `jsonschema`.

Usage: python3 tools_client.py BASE_URL
Exits non-zero with the failed assertion when astra does not behave as the client expects.
"""
import json
import sys

import anthropic
import jsonschema
import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
model = client.models.list().data[0].id

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "hobbies", "employed"],
    "additionalProperties": False,
}
ask_person = [{"role": "user", "content": "Describe a fictional person as JSON."}]
person_format = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}


def streamed_text(**kw):
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.delta.content:
                parts.append(c.delta.content)
            finish = c.finish_reason or finish
    return "".join(parts), finish


# 20 sampled json_schema answers parse and validate; streamed, each is the same text.
for seed in range(20):
    kw = dict(model=model, messages=ask_person, temperature=1, seed=seed, max_tokens=300, response_format=person_format)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", (seed, c)
    jsonschema.validate(json.loads(c.message.content), PERSON)
    text, finish = streamed_text(**kw)
    assert (text, finish) == (c.message.content, "stop"), (seed, text, c.message.content)


def json_prefix(text):
    """Whether `text` starts some JSON value: closed with what its open strings and
    containers need (and, where it stops inside a literal or after a key, what ends it)."""
    stack, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), (in_string if escaped or ch != '"' else False)
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
        elif ch in "]}":
            if not stack or stack.pop() != ch:
                return False
    for middle in ("", "0", "e0", "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l", ":0", '":0', "0}", '"k":0', '""'):
        try:
            json.loads(text + ('"' if in_string else "") + middle + "".join(reversed(stack)))
            return True
        except ValueError:
            pass
    return False


# json_object: an object, whatever the keys. Small models may not close one within the
# budget: then what came is the start of one.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Give a JSON object with a name and a city."}],
    temperature=0, max_tokens=200, response_format={"type": "json_object"},
)
c = r.choices[0]
if c.finish_reason == "stop":
    assert isinstance(json.loads(c.message.content), dict), c
else:
    assert c.message.content.lstrip().startswith("{") and json_prefix(c.message.content), c
assert not json_prefix('{"a": 1}}') and not json_prefix('{"a" 1') and json_prefix('{"a": [tr')

# A schema that cannot be compiled is a 400 naming the field, never free text.
for bad in ({"type": "nonsense"}, {"type": "string", "minLength": 5, "maxLength": 1}):
    try:
        client.chat.completions.create(
            model=model, messages=ask_person, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
        raise AssertionError(f"{bad} was accepted")
    except openai.BadRequestError as e:
        assert "response_format" in str(e), e

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather of a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time of a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}},
]
schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
ask_weather = [{"role": "user", "content": "What is the weather like in Paris today?"}]

# tool_choice "required": a valid call every time, at temperature 1.
for seed in range(10):
    r = client.chat.completions.create(
        model=model, messages=ask_weather, tools=tools, tool_choice="required", temperature=1, seed=seed, max_tokens=200,
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, (seed, c)
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id, call
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

# A named tool, streamed: tool_calls deltas that add up to a valid call of that tool.
calls, finish = {}, None
for chunk in client.chat.completions.create(
    model=model, messages=ask_weather, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
    temperature=0, max_tokens=200, stream=True,
):
    for c in chunk.choices:
        assert not c.delta.content, c.delta
        for d in c.delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = d.id or entry["id"]
            if d.function and d.function.name:
                entry["name"] += d.function.name
            if d.function and d.function.arguments:
                entry["arguments"] += d.function.arguments
        finish = c.finish_reason or finish
assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
assert calls[0]["name"] == "get_time" and calls[0]["id"], calls
jsonschema.validate(json.loads(calls[0]["arguments"]), schemas["get_time"])

# The whole form of the same request makes the same call.
r = client.chat.completions.create(
    model=model, messages=ask_weather, tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
    temperature=0, max_tokens=200,
)
call = r.choices[0].message.tool_calls[0]
assert (call.function.name, call.function.arguments) == ("get_time", calls[0]["arguments"]), call

# A tool's result goes back through the template and is answered in text.
history = ask_weather + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]
r = client.chat.completions.create(model=model, messages=history, tools=tools, temperature=0, max_tokens=60)
c = r.choices[0]
assert c.message.content and not c.message.tool_calls, c

# tool_choice "none": text, never a call.
r = client.chat.completions.create(model=model, messages=ask_weather, tools=tools, tool_choice="none", temperature=0, max_tokens=30)
assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r.choices[0]

# A thinking request whose model ends its turn inside the thinking still answers.
r = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0, max_tokens=64,
    extra_body={"think": True, "answer_room": 16},
)
assert r.choices[0].message.content, r.choices[0]

# Anthropic's Messages API through the `anthropic` client.
claude = anthropic.Anthropic(base_url=base, api_key="unused")
greedy = {"temperature": 0}  # the client no longer sends sampling fields itself
ask = dict(model=model, max_tokens=40, extra_body=greedy, system="Answer briefly.",
           messages=[{"role": "user", "content": "What is the capital of France?"}])
m = claude.messages.create(**ask)
assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text, m
assert m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason
with claude.messages.stream(**ask) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed == m.content[0].text and final.content[0].text == streamed, (streamed, m.content)
assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens, (final, m)
# count_tokens counts the whole prompt: the usage splits it into cache reads and the rest.
fresh = dict(ask, messages=[{"role": "user", "content": f"Count the words of this sentence, number {seed}."}])
counted = claude.messages.count_tokens(model=model, system=fresh["system"], messages=fresh["messages"]).input_tokens
m = claude.messages.create(**fresh)
assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens, (counted, m.usage)
# A stop sequence is reported as such.
m = claude.messages.create(**dict(ask, max_tokens=60, stop_sequences=[" "]))
assert m.stop_reason == "stop_sequence" and m.stop_sequence == " ", m
# tool_choice any: a tool_use block whose input validates.
claude_tools = [{"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": t["function"]["parameters"]} for t in tools]
m = claude.messages.create(model=model, max_tokens=200, messages=ask_weather, tools=claude_tools, tool_choice={"type": "any"})
uses = [b for b in m.content if b.type == "tool_use"]
assert m.stop_reason == "tool_use" and uses, m
for u in uses:
    jsonschema.validate(u.input, schemas[u.name])
# The result goes back as a tool_result block and is answered in text.
m = claude.messages.create(model=model, max_tokens=60, extra_body=greedy, tools=claude_tools, messages=ask_weather + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees, sunny"}]},
])
assert m.content and m.content[0].type == "text" and m.content[0].text, m
# A named tool, streamed: the same call as whole.
named = dict(model=model, max_tokens=200, extra_body=greedy, messages=ask_weather, tools=claude_tools, tool_choice={"type": "tool", "name": "get_time"})
with claude.messages.stream(**named) as stream:
    final = stream.get_final_message()
whole = claude.messages.create(**named)
assert [(b.type, b.name, b.input) for b in final.content] == [(b.type, b.name, b.input) for b in whole.content], (final, whole)
assert final.content[0].type == "tool_use" and final.content[0].name == "get_time", final
# Structured output through output_config.
m = claude.messages.create(model=model, max_tokens=300, messages=ask_person, output_config={"format": {"type": "json_schema", "schema": PERSON}})
jsonschema.validate(json.loads(m.content[0].text), PERSON)
# Errors arrive in Anthropic's shape as the client's exception types.
try:
    claude.messages.create(model=model, max_tokens=8, messages=[{"role": "robot", "content": "x"}])
    raise AssertionError("a bad role was accepted")
except anthropic.BadRequestError as e:
    assert "role" in str(e), e

# The Responses API: streamed equals whole; structured output through text.format; calls.
kw = dict(model=model, input="Write one sentence about the sea.", instructions="Be brief.", max_output_tokens=40, temperature=0)
r = client.responses.create(**kw)
assert r.output_text and r.status in ("completed", "incomplete"), r
deltas, done = [], None
for event in client.responses.create(stream=True, **kw):
    if event.type == "response.output_text.delta":
        deltas.append(event.delta)
    if event.type in ("response.completed", "response.incomplete"):
        done = event.response
assert "".join(deltas) == r.output_text and done.output_text == r.output_text, (deltas, r.output_text)
assert done.usage.output_tokens == r.usage.output_tokens, (done.usage, r.usage)
# Cut by the token budget: the response and its message item are incomplete, the text kept.
kw = dict(model=model, input="Write a long story about the sea.", max_output_tokens=6, temperature=0)
r = client.responses.create(**kw)
assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r
assert r.output[-1].type == "message" and r.output[-1].status == "incomplete" and r.output_text, r
items = [e.item for e in client.responses.create(stream=True, **kw) if e.type == "response.output_item.done"]
assert items[-1].status == "incomplete" and items[-1].content[0].text == r.output_text, (items, r)
r = client.responses.create(model=model, input=ask_person, temperature=1, max_output_tokens=300,
                            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
jsonschema.validate(json.loads(r.output_text), PERSON)
flat_tools = [dict(type="function", **t["function"]) for t in tools]
r = client.responses.create(model=model, input=ask_weather, tools=flat_tools, tool_choice="required", max_output_tokens=200)
calls = [o for o in r.output if o.type == "function_call"]
assert calls, r.output
for call in calls:
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
r = client.responses.create(model=model, max_output_tokens=60, temperature=0, tools=flat_tools, input=ask_weather + [
    {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name, "arguments": calls[0].arguments},
    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees, sunny"},
])
assert r.output_text and not [o for o in r.output if o.type == "function_call"], r.output
try:
    client.responses.create(model=model, input="hi", previous_response_id="resp_1")
    raise AssertionError("previous_response_id was accepted")
except openai.BadRequestError as e:
    assert "previous_response_id" in str(e), e

print("tools client: all checks passed")
