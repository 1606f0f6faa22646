"""The official `openai` Python client against a running `astra serve`.

Usage: python3 openai_client.py BASE_URL   (e.g. http://127.0.0.1:8080)
Exits non-zero with the failed assertion when astra does not behave as the client expects.
"""
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
models = client.models.list()
model = models.data[0].id
messages = [{"role": "user", "content": "Write a short poem about the sea."}]

# Chat, whole.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=20, temperature=0)
assert r.object == "chat.completion", r
choice = r.choices[0]
assert choice.message.role == "assistant" and choice.message.content, choice
assert choice.finish_reason in ("stop", "length"), choice.finish_reason
assert r.usage.completion_tokens <= 20 and r.usage.prompt_tokens > 0, r.usage
assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage
whole = choice.message.content

# Chat, streamed, with usage: the same text, the prompt served from the cache.
stream = client.chat.completions.create(
    model=model, messages=messages, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
)
parts, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(parts) == whole, ("".join(parts), whole)
assert finish == choice.finish_reason, finish
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1, usage

# Log probabilities.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
lp = r.choices[0].logprobs.content
assert len(lp) == 4 and all(len(t.top_logprobs) == 3 for t in lp), lp
assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob for t in lp), lp

# Several choices.
r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.9, seed=1, n=2)
assert [c.index for c in r.choices] == [0, 1], r.choices

# Plain completions.
r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
assert r.object == "text_completion" and r.choices[0].text, r
assert r.usage.completion_tokens <= 8, r.usage
single = r.choices[0].text

# Several prompts in one completions request: a choice per prompt, in order.
r = client.completions.create(model=model, prompt=["The capital of France is", "Once upon a time"], max_tokens=8, temperature=0)
assert [c.index for c in r.choices] == [0, 1], r.choices
assert r.choices[0].text == single, (r.choices[0].text, single)

# Errors arrive as the client's exception types, with the server's message.
try:
    client.chat.completions.create(model=model, messages=[], max_tokens=4)
    raise AssertionError("empty messages were accepted")
except openai.BadRequestError as e:
    assert "messages" in str(e), e
try:
    client.chat.completions.create(model=model, messages=messages, temperature=5)
    raise AssertionError("temperature 5 was accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e), e

print("openai client: all checks passed")
