"""The official `openai` Python client calling through Tollgate (issue 42), run by
tests/tests/openai_client.rs with the gateway's URL and three API keys (sent as the client sends
its key: `Authorization: Bearer`):

  main   a plan with a money budget that covers the calls: a chat completion, then a stream
         with `stream_options.include_usage` — each answer read by the client as OpenAI's;
  tight  a plan of one request per 8 s (a sliding log): the second call is refused with 429 and
         `Retry-After`, raised as `openai.RateLimitError` (no retries), then with retries the
         client waits what `Retry-After` says and succeeds;
  broke  a plan whose money budget cannot cover one call: `RateLimitError` with
         `budget_exhausted`, and a `Retry-After` (the month's end) past the client's two minutes,
         so even with retries it does not call again.

Every check is an assert: the script exits non-zero on the first that fails, and prints one JSON
line of what it saw when all hold.
"""

import json
import sys
import time

import openai
from openai import OpenAI

url, main, tight, broke = sys.argv[1:5]
echo = {"x-echo-llm": "openai", "x-echo-llm-model": "gpt-4o-mini-2024-07-18"}
messages = [{"role": "user", "content": "Say hi"}]


def client(key, retries):
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=retries, default_headers=echo, timeout=15)


seen = {}

# a chat completion, read as OpenAI's
r = client(main, 0).chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=7)
assert r.model == "gpt-4o-mini-2024-07-18", r
assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (20, 7, 27), r.usage
assert r.usage.prompt_tokens_details.cached_tokens == 16, r.usage
assert r.choices[0].message.content.startswith("word0 "), r.choices
seen["chat"] = r.usage.total_tokens

# a stream with its usage in the last chunk
stream = client(main, 0).chat.completions.create(
    model="gpt-4o-mini",
    messages=messages,
    max_tokens=7,
    stream=True,
    stream_options={"include_usage": True},
    extra_headers={"x-echo-llm": "openai-sse"},
)
chunks = list(stream)
text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert text.startswith("word0 word1 "), text
assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 27, chunks[-1]
seen["stream_chunks"] = len(chunks)

# a rate limit: RateLimitError without retries, carrying our error and Retry-After
t = client(tight, 0)
t.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=7)
try:
    t.chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=7)
    raise AssertionError("the second call in the window was admitted")
except openai.RateLimitError as e:
    assert e.status_code == 429, e
    # the client hands on our body's `error` (its `body`); the whole body is the response's
    assert e.body == "rate_limited" and e.response.json()["limit"] == "per-8s", e.response.text
    retry_after = int(e.response.headers["retry-after"])
    assert 1 <= retry_after <= 8, retry_after
    seen["retry_after"] = retry_after
# with retries, the client honours Retry-After: it waits, then its retry is admitted
start = time.monotonic()
raw = client(tight, 3).chat.completions.with_raw_response.create(model="gpt-4o-mini", messages=messages, max_tokens=7)
waited = time.monotonic() - start
assert raw.parse().usage.total_tokens == 27
seen["retries"] = raw.retries_taken
seen["waited_s"] = round(waited, 3)
assert raw.retries_taken >= 1, raw.retries_taken
# it waited what Retry-After said (until the first call leaves the 8 s log: at least 1 s), more
# than the 0.5 s its own backoff would start at: the header was read
assert waited >= 0.9, waited

# a money budget that cannot cover a call: RateLimitError with budget_exhausted, not retried
start = time.monotonic()
try:
    client(broke, 2).chat.completions.create(model="gpt-4o-mini", messages=messages, max_tokens=7)
    raise AssertionError("a call the budget cannot cover was admitted")
except openai.RateLimitError as e:
    assert e.body == "budget_exhausted" and e.response.json()["limit"] == "month", e.response.text
    assert int(e.response.headers["retry-after"]) > 120, e.response.headers
    seen["budget_retry_after"] = int(e.response.headers["retry-after"])
seen["budget_refused_in_s"] = round(time.monotonic() - start, 3)

print(json.dumps(seen))
