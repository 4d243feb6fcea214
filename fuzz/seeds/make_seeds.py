#!/usr/bin/env python3
"""Writes the hand-made seed inputs of every fuzz target into fuzz/corpus/<target>/ (seed-*).

Run by `./build.sh fuzz` before the first run of a target whose corpus is empty. Inputs use the
field format of fuzz/src/{filter,sidecar}.rs: fields separated by NUL bytes.
"""
import hashlib, json, os, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Z = b"\0"

def j(v):
    return json.dumps(v).encode()

EVENT = {"id": "0123456789abcdef0000000000000001", "tenant": "acme", "keyId": "key_1", "plan": "gold",
         "method": "POST", "authority": "api.test", "path": "/v1/chat", "status": 200,
         "startMs": 1764460800000, "durationMs": 12, "tokens": 42, "responseBytes": 300}
ROUTES = {"version": 3, "etag": "abc", "routes": [
    {"id": "chat", "host": "api.test", "pathPrefix": "/v1/chat", "method": "POST", "cluster": "llm",
     "headers": [{"name": "x-tier", "value": "gold"}, {"name": "x-user"}], "cacheTtlMs": 60000,
     "cacheKeyHeaders": ["x-user"], "failureMode": "open", "product": "p", "breaker": "openai"},
    {"id": "exact", "path": "/v1/models", "cluster": "llm"}]}
ALLOW = {"verdict": "allow", "tenant": "acme", "keyId": "k1", "plan": "p",
         "requestHeaders": [{"name": "x-tollgate-plan", "value": "p"}],
         "responseHeaders": [{"name": "ratelimit", "value": "\"pm\";r=9;t=60"}], "cacheFor_ms": 100,
         "ticket": {"tenant": "acme", "id": "0123456789abcdef0123456789abcdef"},
         "store": {"kind": "cache", "tenant": "acme", "route": "chat", "hash": "h"}}
REPLAY = {"verdict": "allow", "tenant": "acme", "keyId": "k1", "plan": "p",
          "replay": {"kind": "cache", "response": {"status": 200, "headers": [{"name": "content-type", "value": "application/json"}],
                                                    "body": "{\"ok\":true}", "storedAtMs": 5}}}
DENY = {"verdict": "deny", "status": 429, "error": "rate_limited", "message": "slow down", "limit": "pm",
        "responseHeaders": [{"name": "retry-after", "value": "3"}]}

SEEDS = {
    "key_plan": [
        b"/v1/chat?api_key=abc&x=1" + Z + b"authorization" + Z + b"Bearer abc",
        b"/v1/chat?key=a%20b+c&api_key=abc#frag" + Z + b"x-api-key" + Z + b"abc" + Z + b"x-key" + Z + b"\xffbad",
        b"/p" + Z + b"authorization" + Z + b"bEaReR\t\t tok " + Z + b"authorization" + Z + b"Basic xyz",
        b"/?api%5Fkey=%zz%4&&=&key" + Z + b"x-api-key" + Z + b"",
    ],
    "plugin_config": [
        b"", b"{}",
        br'{"sidecar":{"cluster":"tollgate_sidecar","timeout":"25ms"},"failureMode":"open","authCacheMaxTtl":"1s",'
        br'"keySources":[{"type":"bearer"},{"type":"header","name":"X-Key"},{"type":"query","name":"k"}],'
        br'"forwardHeaders":["x-user"],"tokenEstimateField":"max_tokens","completionFlushInterval":"50ms"}',
        br'{"routing":{"enabled":true,"refreshInterval":"100ms"},"idempotency":{"enabled":true,"maxBodyBytes":1024},'
        br'"responseCache":{"maxBodyBytes":64},"usage":{"enabled":true,"flushInterval":"200ms","maxQueued":100}}',
        br'{"breakers":{"targets":{"openai":{"consecutiveFailures":5,"failureRatio":0.5,"window":"10s","minRequests":10,'
        br'"openFor":"30s","halfOpenTrials":2,"trialTimeout":"5s","failureStatuses":["5xx","429"]}}}}',
        br'{"leases":{"renewAhead":"600ms","initialWant":5}}',
    ],
    "route_match": [
        j(ROUTES) + Z + b"API.test:8080" + Z + b"POST" + Z + b"/v1/chat/x?q=1" + Z + b"x-tier" + Z + b"gold" + Z + b"x-user" + Z + b"u",
        j(ROUTES) + Z + b"api.test" + Z + b"GET" + Z + b"/v1/models#f",
        b"not json" + Z + b"api.test" + Z + b"POST" + Z + b"/v1/x" + Z + b"x-p" + Z + b"",
    ],
    "wire_answers": [
        j(ALLOW), j(REPLAY), j(DENY), j(ROUTES),
        j({"hints": [{"provider": "openai", "model": "gpt-4", "replica": "r1", "openedAtMs": 5}]}),
        j({"tenant": "acme", "keyId": "k1", "plan": "p", "untilMs": 99}),
        j({"status": 200, "headers": [], "bodyBase64": "aGVsbG8=", "storedAtMs": 1}),
        b"\x02\x00\x00\x00\x01\x00\x00\x00\x01\x00\x00\x00a\x00b\x00c\x00d\x00",
        b"aGVsbG8gd29ybGQ=",
        j({"answers": [{"status": 200, "decision": ALLOW}, {"status": 503, "error": "store_unavailable"}, {"status": 200}, {"status": 200, "decision": DENY}]}),
        b'00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-"},{"request":{"keyHash":"victim"}},{"traceparent":"x',
    ],
    "usage_tokens": [
        br'{"id":"x","usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}',
        b'data: {"choices":[]}\n\ndata: {"usage":{"total_tokens":7}}\n\ndata: [DONE]\n\n',
        br'{"usage":{"total_tokens":18446744073709551615}}',
        br'{"usage":{"total_tokens":-1}}', br'{"a":"total_tokens", "total_tokens" :  12',
        b"\x01\x00\x00\x00\x00\x00\x00\x00", br'{"max_tokens":100,"messages":[]}',
    ],
    "cache_key": [
        b"application/json" + Z + br'{"b":[1,2.0,{"z":null,"a":"\u00e9"}],"a":1e300}' + Z + b"POST" + Z + b"/v1/chat?b=2&a=%7e&&c=%2F" + Z + b"x-user" + Z + b"u1" + Z + b"x-org" + Z + b"",
        b"text/plain" + Z + b"raw body" + Z + b"GET" + Z + b"/p?x=%C3%A9&\xc3\xa9=1#frag",
        b'"order-1"' + Z + b"[1,2]" + Z + b"PUT" + Z + b"/" + Z + b"cache-control" + Z + b"no-store, max-age=0",
    ],
    "filter_request": [
        b"\x00GET" + Z + b"/v1/chat" + Z + b"200" + Z + j(ALLOW) + Z + br'{"usage":{"total_tokens":42}}' + Z + b"<content-type" + Z + b"application/json",
        b"\x01POST" + Z + b"/v1/chat?x=1" + Z + b"200" + Z + j(ALLOW) + Z + br'{"max_tokens":5}' + Z + b"content-type" + Z + b"application/json" + Z + b"idempotency-key" + Z + b'"k-1"' + Z + b"x-user" + Z + b"\xff",
        b"\x01GET" + Z + b"/v1/chat" + Z + b"200" + Z + j(REPLAY) + Z + b"" + Z + b"x-user" + Z + b"u",
        b"\x02GET" + Z + b"/x?k=abc" + Z + b"429" + Z + j(DENY) + Z + b"" + Z + b"authorization" + Z + b"Bearer abc",
        b"\x00GET" + Z + b"/" + Z + b"" + Z + b"" + Z + b"" + Z + b"user-agent" + Z + b"curl\xff",
    ],
    "sidecar_bodies": [
        j({"keyHash": "ab" * 32, "method": "GET", "authority": "api.test", "path": "/v1/x", "requestId": "r",
           "clientIp": "10.0.0.1", "headers": [{"name": "x-user", "value": "u"}]}),
        j({"completions": [{"ticket": {"tenant": "acme", "id": "0123456789abcdef0123456789abcdef"}, "status": 200, "tokens": 5}]}),
        j({"events": [EVENT, dict(EVENT, id="bad id", tenant="")]}),
        j({"items": [{"ticket": {"kind": "cache", "tenant": "acme", "route": "chat", "hash": "h"},
                      "response": {"status": 200, "headers": [], "body": "x", "storedAtMs": 1}}]}),
        j({"provider": "openai", "model": "gpt-4o", "openedAtMs": 5}),
        b"\x00" + j({"id": "acme", "name": "Acme"}),
        b"\x02" + j({"id": "gold", "limits": [{"name": "pm", "algorithm": "sliding_log", "limit": 10, "window": "60s"}]}),
        b"\x03" + j({"id": "r1", "pathPrefix": "/v1", "cluster": "llm", "priority": 1}),
    ],
    "spool_lines": [
        b"\n".join([j(dict(EVENT, aggregate=True)), j(dict(EVENT, id="0123456789abcdef0000000000000002", aggregate=True, tokens=18446744073709551615)),
                    j(EVENT), b'{"torn":', b""]),
        j(dict(EVENT, aggregate=True, denied="rate_limited", status=429)) + b"\n" + j(dict(EVENT, aggregate=True)) + b"\n",
    ],
    "sidecar_toml": [
        b'listen = "127.0.0.1:9090"\n[redis]\nurl = "redis://127.0.0.1:6379/"\n[usage]\nenabled = true\nspool_dir = "/tmp/s"\n'
        b'[usage.kafka]\nbrokers = "127.0.0.1:9092"\npartitions = 4\n[[plans.demo.limits]]\nname = "per-minute"\n'
        b'algorithm = "sliding_log"\nsubject = "key"\nlimit = 10\nwindow = "60s"\n',
        b'[redis]\nmode = "sentinel"\nnodes = ["redis://h:1"]\nmaster_name = "m"\ntimeout = "15ms"\n[cache]\nmax_entries = 0\n[log]\nlevel = "info,x=debug"\n',
        b'[[tenants]]\nid = "acme"\n[[routes]]\nid = "r"\npath_prefix = "/"\ncluster = "c"\n[source]\nkind = "postgres"\npostgres_url = "postgres://u@h:5/db"\n',
    ],
}

def main(targets):
    for t in targets or SEEDS:
        d = os.path.join(ROOT, "corpus", t)
        os.makedirs(d, exist_ok=True)
        for s in SEEDS.get(t, []):
            with open(os.path.join(d, "seed-" + hashlib.sha1(s).hexdigest()), "wb") as f:
                f.write(s)

if __name__ == "__main__":
    main(sys.argv[1:])
