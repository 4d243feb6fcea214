#!/usr/bin/env python3
"""The podman tier of ./build.sh test (issue 40; docs/deploy.md, "What was tested here").

Plays deploy/k8s/base (rendered by render.py for podman) with two gateway pods, Redis, the broker,
PostgreSQL, billing and the echo upstream, then from outside the pods, through the real Envoys:

1. the README's flow: 200 with a key, 401 without one and with an unknown one, and the demo
   plan's 10 a minute exact across both pods (10 x 200, then 429 with Retry-After);
2. a rolling restart under load: a steady stream of several tenants (an exact limit hammered
   past its count, token-budget requests in flight) while each gateway pod in turn is stopped
   (SIGTERM: drain) and played again. Pass: no request failed that the client could not retry
   by its rule (a refused connection: nothing was sent; retried on the other pod), no 5xx, the
   exact limit admitted exactly its limit, and the billing rollup has every answer exactly once
   (per tenant: requests ok = 200s, denied = 429s, tokens = the upstream's);
3. a pod killed with SIGKILL while the broker is paused (its acknowledged events only in its
   spool): played again with the same volumes, every acknowledged event is billed once and its
   exact limit admitted exactly its limit across the kill.

It prints the figures. The images are the tier's (`--tag`), built by build.sh beforehand.
"""

import argparse
import datetime
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import render  # noqa: E402

PM = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
DAY = 86_400

# the tier's plans, added to the base's sidecar.toml (the base's own demo plan is kept)
PLANS = """
# ---- the podman tier's plans (deploy/test/podman_tier.py) ----
[[plans.steady.limits]]
name = "per-minute"
algorithm = "fixed_window"
subject = "key"
limit = 1000000
window = "60s"

[[plans.hammer.limits]]
name = "per-hour"
algorithm = "sliding_log"
subject = "key"
limit = {hammer}
window = "1h"
failure_mode = "closed"

[[plans.tokens.limits]]
name = "monthly-tokens"
algorithm = "token_budget"
subject = "tenant"
limit = 1000000000
estimate = 100

[[plans.killed.limits]]
name = "per-hour"
algorithm = "sliding_log"
subject = "key"
limit = {killed}
window = "1h"
failure_mode = "closed"
"""
# the Kubernetes version whose schemas the manifests are checked against: the oldest with native
# sidecar containers on by default (the examples use them)
K8S_SCHEMA_VERSION = "1.29.0"
HAMMER_LIMIT = 300
KILLED_LIMIT = 100
TOKENS_PER_REQUEST = 50


def log(msg):
    print(f"[podman tier {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg):
    log(f"FAILED: {msg}")
    raise SystemExit(1)


def run(args, check=True, quiet=False, timeout=300):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        fail(f"{' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    if not quiet and r.stderr.strip() and r.returncode != 0:
        log(r.stderr.strip())
    return r


def _fixed_port_range():
    """From 10000 to the start of the kernel's ephemeral range: ports no `bind(:0)` and no
    outgoing connection takes (decision 213, as the Rust harness's free_port)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return 10000, low


_PORTS = {"next": None, "given": set()}


def free_port():
    """A loopback port free now and never handed out before by this run. A port taken from
    `bind(:0)` and closed could be handed out again before its first user bound it (two pods on
    one port: gateway b's Envoy found gateway a's sidecar there)."""
    low, high = _fixed_port_range()
    span = high - low
    if _PORTS["next"] is None:
        _PORTS["next"] = os.getpid() * 7919 % span
    for _ in range(span):
        port = low + _PORTS["next"]
        _PORTS["next"] = (_PORTS["next"] + 1) % span
        if port in _PORTS["given"]:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS["given"].add(port)
        return port
    fail(f"no free loopback port in {low}..{high}")


def wait_until(what, check, timeout=90, every=0.2):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # a store not up yet
            pass
        if time.monotonic() > deadline:
            fail(f"{what}: not within {timeout}s")
        time.sleep(every)


def port_open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def request(port, path="/hello", headers=None, timeout=10):
    """One request on its own connection. Returns (status, headers dict, body) or raises."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path, headers={"Connection": "close", **(headers or {})})
        r = c.getresponse()
        body = r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body
    finally:
        c.close()


class Stack:
    def __init__(self, tag, workdir, sidecar_env=(), envoy_env=()):
        self.tag = tag
        self.workdir = workdir
        self.ports = render.Ports(free_port)
        units, self.volumes = render.render(self.ports, tag, os.path.join(workdir, "secrets"),
                                            PLANS.format(hammer=HAMMER_LIMIT, killed=KILLED_LIMIT), sidecar_env, envoy_env)
        self.files = render.write(units, workdir)

    def pod(self, unit_name):
        return f"{unit_name}-pod-0"

    def container(self, deployment, container):
        return f"{deployment}-pod-0-{container}"

    def down(self):
        for path in self.files.values():
            run(PM + ["kube", "down", path], check=False, quiet=True)
        for v in self.volumes:
            run(PM + ["volume", "rm", "-f", v], check=False, quiet=True)

    def play(self, unit, replace=False):
        run(PM + ["kube", "play", "--network", "host"] + (["--replace"] if replace else []) + [self.files[unit]])

    def exec(self, container, *cmd, check=True):
        return run(PM + ["exec", container] + list(cmd), check=check, quiet=not check)

    def gateway_ready(self, name):
        return self.exec(self.container(f"tollgate-gateway-{name}", "envoy"), "tollgate-gateway", "ready", check=False).returncode == 0

    def wait_gateway(self, name, timeout=90):
        wait_until(f"gateway {name} ready (its readiness probe)", lambda: self.gateway_ready(name), timeout=timeout)

    def psql(self, sql):
        r = self.exec(self.container("tollgate-postgres", "postgres"), "psql", "-h", "127.0.0.1", "-p",
                      str(self.ports.postgres), "-U", "postgres", "-At", "-F", ",", "-c", sql)
        return [line.split(",") for line in r.stdout.strip().splitlines() if line]

    def rollup(self, tenant):
        """(requests_ok, requests_denied, tokens, events) billed for the tenant, over every day."""
        try:
            rows = self.psql("SELECT coalesce(sum(requests_ok),0), coalesce(sum(requests_denied),0), coalesce(sum(tokens),0) "
                             f"FROM usage_daily WHERE tenant = '{tenant}'")
            events = self.psql(f"SELECT count(*) FROM usage_events WHERE tenant = '{tenant}'")
        except SystemExit:
            return (0, 0, 0, 0)  # the billing consumer has not made its tables yet
        ok, denied, tokens = (int(x) for x in rows[0])
        return ok, denied, tokens, int(events[0][0])

    def create_key(self, gateway, tenant, plan):
        out = self.exec(self.container(f"tollgate-gateway-{gateway}", "sidecar"), "tollgate-sidecar", "keys", "create",
                        "--tenant", tenant, "--plan", plan).stdout
        return out.strip().splitlines()[-1].strip()

    def logs(self, container, lines=40):
        return run(PM + ["logs", "--tail", str(lines), container], check=False, quiet=True)


class Load:
    """A steady open-loop stream: each (tenant, rate) its own thread, each request on a new
    connection to the next gateway pod in rotation (round robin), as a Service would send it.
    A pod leaves the rotation a moment after its SIGTERM (Kubernetes removes a terminating pod's
    endpoint while its Envoy drains; the drain's graceful period covers that lag) and comes back
    once its readiness probe passes. A refused connection (nothing was sent) is retried on the
    other pod — the client's rule; any other error is a failure."""

    def __init__(self, stack, streams):
        self.stack = stack
        self.streams = streams  # [(tenant, key, rate, headers)]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.by_tenant = {}  # tenant -> {status: count}
        self.failures = []  # (tenant, error) not retryable by the rule
        self.retries = 0
        self.sent = 0
        self.five_xx = []
        self.threads = []
        self.rotation = ["a", "b"]

    def _one(self, tenant, key, headers, turn):
        for attempt in range(4):
            names = list(self.rotation)
            name = names[(turn + attempt) % len(names)]
            port = self.stack.ports.gateways[name]["listen"]
            try:
                status, h, body = request(port, "/hello", {"x-api-key": key, **headers}, timeout=30)
            except ConnectionRefusedError:
                with self.lock:
                    self.retries += 1
                time.sleep(0.02 * (attempt + 1))
                continue
            except Exception as e:  # sent and lost: not retryable by the rule
                with self.lock:
                    self.failures.append((tenant, name, f"{time.monotonic() - self.t0:.1f}s", repr(e)))
                return
            with self.lock:
                counts = self.by_tenant.setdefault(tenant, {})
                counts[status] = counts.get(status, 0) + 1
                if status >= 500:
                    self.five_xx.append((tenant, name, f"{time.monotonic() - self.t0:.1f}s", status, h.get("retry-after"), body[:120]))
            return
        with self.lock:
            self.failures.append((tenant, "both", "refused by both pods"))

    def _stream(self, tenant, key, rate, headers):
        interval = 1.0 / rate
        nxt = time.monotonic()
        turn = 0
        inflight = []
        while not self.stop.is_set():
            now = time.monotonic()
            if now < nxt:
                time.sleep(min(nxt - now, 0.05))
                continue
            nxt += interval
            turn += 1
            with self.lock:
                self.sent += 1
            t = threading.Thread(target=self._one, args=(tenant, key, headers, turn), daemon=True)
            t.start()
            inflight.append(t)
            inflight = [x for x in inflight if x.is_alive()]
        for t in inflight:
            t.join(60)

    def start(self):
        self.t0 = time.monotonic()
        for tenant, key, rate, headers in self.streams:
            t = threading.Thread(target=self._stream, args=(tenant, key, rate, headers), daemon=True)
            t.start()
            self.threads.append(t)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(90)

    def count(self, tenant, status):
        return self.by_tenant.get(tenant, {}).get(status, 0)


def check_images(tag, wasm):
    """The images as docs/deploy.md says: non-root, the filter image's single file is the filter."""
    import hashlib
    import json
    for name in ("gateway", "sidecar", "billing"):
        info = json.loads(run(PM + ["image", "inspect", f"localhost/tollgate-{name}:{tag}"]).stdout)[0]
        user = info["Config"].get("User", "")
        if user != "65532:65532":
            fail(f"tollgate-{name} runs as {user!r}, not 65532:65532")
    ref = f"localhost/tollgate-filter:{tag}"
    info = json.loads(run(PM + ["image", "inspect", ref]).stdout)[0]
    layers = info["RootFS"]["Layers"]
    root = run(PM + ["image", "mount", ref]).stdout.strip()
    try:
        files = sorted(os.listdir(root))
        with open(os.path.join(root, "plugin.wasm"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    finally:
        run(PM + ["image", "unmount", ref], check=False)
    with open(wasm, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    if len(layers) != 1 or files != ["plugin.wasm"] or digest != want:
        fail(f"tollgate-filter: {len(layers)} layers, files {files}, plugin.wasm sha256 {digest} (the filter's: {want})")
    log(f"images: gateway, sidecar, billing run as 65532:65532; tollgate-filter is one layer holding /plugin.wasm "
        f"(sha256 {digest[:16]}..., the built filter's)")


def check_manifests():
    """Every manifest of the base and the examples is YAML with an apiVersion, a kind and a name
    (the examples' CRDs have no schema here to check against: docs/deploy.md)."""
    import glob
    import yaml
    n = 0
    here = os.path.dirname(os.path.abspath(__file__))
    for path in sorted(glob.glob(os.path.join(here, "..", "k8s", "*", "*.yaml"))):
        if path.endswith("kustomization.yaml"):
            continue
        for doc in yaml.safe_load_all(open(path)):
            if not doc:
                continue
            if not (doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name")):
                fail(f"{path}: a document without apiVersion, kind or metadata.name")
            n += 1
    log(f"manifests: {n} objects in deploy/k8s/base and deploy/k8s/examples parse, each with apiVersion, kind, name")
    # Kubernetes' own schemas (kubernetes-validate, offline), strict: unknown fields refused. The
    # examples' CRDs (Istio, Envoy Gateway) have no schema there; a strategic-merge patch is not
    # a whole object.
    validator = os.environ.get("TOLLGATE_KUBERNETES_VALIDATE", "")
    if not (validator and os.access(validator, os.X_OK)):
        log("manifests: schema check skipped (kubernetes-validate not installed: ./build.sh deps installs it)")
        return
    files = [p for p in sorted(glob.glob(os.path.join(here, "..", "k8s", "*", "*.yaml")))
             if not p.endswith(("kustomization.yaml", "-patch.yaml"))]
    r = run([validator, "--strict", "-k", K8S_SCHEMA_VERSION] + files, check=False, quiet=True)
    out = r.stdout + r.stderr
    passed = out.count(" passed for resource ")
    no_schema = sorted({line.split("kind ")[1].split(" ")[0] for line in out.splitlines() if "Couldn't find schema" in line})
    if r.returncode != 0 or "ERROR" in out:
        fail(f"kubernetes-validate --strict -k {K8S_SCHEMA_VERSION}:\n{out}")
    log(f"manifests: {passed} objects valid against Kubernetes {K8S_SCHEMA_VERSION}'s schemas (strict); "
        f"no schema offline for {', '.join(no_schema)}")


def readme_flow(stack):
    a = stack.ports.gateways["a"]["listen"]
    b = stack.ports.gateways["b"]["listen"]
    key = stack.create_key("a", "demo", "demo")
    status, h, body = request(a, "/hello", {"Authorization": f"Bearer {key}"})
    if status != 200 or b"x-tollgate-tenant" not in body or key.encode() in body:
        fail(f"README flow: a key's request answered {status} {body[:300]!r}")
    status, _, body = request(b, "/hello")
    if status != 401 or b"missing_key" not in body:
        fail(f"README flow: no key answered {status} {body[:200]!r}")
    status, _, body = request(b, "/hello", {"x-api-key": "tg_wrong"})
    if status != 401 or b"unknown_key" not in body:
        fail(f"README flow: an unknown key answered {status} {body[:200]!r}")
    answers = []
    for i in range(12):  # the demo plan: 10 a minute, one was spent above
        status, h, _ = request(a if i % 2 else b, "/hello", {"x-api-key": key})
        answers.append(status)
        if status == 429 and not h.get("retry-after"):
            fail("README flow: a 429 without Retry-After")
    if answers.count(200) != 9 or answers.count(429) != 3:
        fail(f"README flow: the demo plan's limit across both pods: {answers}")
    # the admin CLI in the sidecar image, over the admin API, its token from the mounted Secret
    sidecar = stack.container("tollgate-gateway-b", "sidecar")
    out = stack.exec(sidecar, "tollgate", "--admin-url", f"http://127.0.0.1:{stack.ports.gateways['b']['sidecar_admin']}",
                     "--token-file", "/etc/tollgate/secret/admin-token", "--json", "keys", "list", "--tenant", "demo").stdout
    if '"demo"' not in out or out.count("\n") != 1:
        fail(f"tollgate keys list --tenant demo in pod b (admin.token_file): {out[:300]!r}")
    log(f"README flow: 200 with a key, 401 missing_key, 401 unknown_key; the admin CLI in pod b lists the key "
        f"(admin API, token from the mounted Secret); the limit of 10 across both pods: "
        f"{1 + answers.count(200)} x 200 then {answers.count(429)} x 429 with Retry-After")


# how long after a pod's SIGTERM the client stops sending to it (Kubernetes' endpoint removal
# lag; the gateway's graceful drain, 5 s, is sized to cover it)
ENDPOINT_LAG = 1.0


def restart(stack, load, name):
    """Replaces gateway pod `name`: SIGTERM (drain), then played again; returns (stop s, total s)."""
    pod = stack.pod(f"tollgate-gateway-{name}")
    t0 = time.monotonic()
    stopping = threading.Thread(target=run, args=(PM + ["pod", "stop", "-t", "60", pod],), kwargs={"timeout": 120})
    stopping.start()
    time.sleep(ENDPOINT_LAG)
    load.rotation = [n for n in load.rotation if n != name]
    stopping.join()
    stopped = time.monotonic() - t0
    stack.play(f"gateway-{name}", replace=True)
    stack.wait_gateway(name)
    load.rotation = sorted(load.rotation + [name])
    return stopped, time.monotonic() - t0


def wait_billed(stack, tenant, ok, denied, tokens=None, timeout=90):
    want = (ok, denied)

    def settled():
        got = stack.rollup(tenant)
        return got[:2] == want and got[3] == ok + denied and (tokens is None or got[2] == tokens)

    deadline = time.monotonic() + timeout
    while not settled():
        if time.monotonic() > deadline:
            got = stack.rollup(tenant)
            fail(f"billing for {tenant}: rollup ok/denied/tokens/events {got}, the clients saw ok {ok}, denied {denied}"
                 + (f", tokens {tokens}" if tokens is not None else ""))
        time.sleep(0.5)
    return stack.rollup(tenant)


def redis_meter(stack, tenant, field):
    """The sidecars' Redis meter of today and yesterday (UTC): events they acknowledged."""
    total = 0
    for d in (datetime.datetime.utcnow(), datetime.datetime.utcnow() - datetime.timedelta(days=1)):
        r = stack.exec(stack.container("tollgate-redis", "redis"), "redis-cli", "-p", str(stack.ports.redis),
                       "HGET", f"usage:{{{tenant}}}:{d.strftime('%Y%m%d')}", field)
        total += int(r.stdout.strip() or 0)
    return total


def budget_used(stack, tenant):
    """The tokens a tenant's monthly budgets hold in Redis (decide.lua reserves the estimate,
    complete.lua moves it to what the upstream reported)."""
    redis = stack.container("tollgate-redis", "redis")
    port = str(stack.ports.redis)
    keys = stack.exec(redis, "redis-cli", "-p", port, "--scan", "--pattern", f"q:tokens:{{{tenant}}}:*").stdout.split()
    return sum(int(stack.exec(redis, "redis-cli", "-p", port, "GET", k).stdout.strip() or 0) for k in keys)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", default="tier")
    ap.add_argument("--wasm", default=os.environ.get("TOLLGATE_WASM", ""), help="the filter the images were built with")
    ap.add_argument("--keep", action="store_true", help="leave the pods running (debugging)")
    ap.add_argument("--seconds", type=float, default=6.0, help="load before, between and after the restarts")
    ap.add_argument("--sidecar-env", action="append", default=[], metavar="K=V",
                    help="an environment variable for the sidecars (e.g. TOLLGATE_SIDECAR_SERVER__SHUTDOWN_WAIT=0s)")
    ap.add_argument("--envoy-env", action="append", default=[], metavar="K=V", help="one for the gateway containers")
    args = ap.parse_args()
    started = time.monotonic()
    check_manifests()
    if args.wasm:
        check_images(args.tag, args.wasm)
    workdir = tempfile.mkdtemp(prefix="tollgate-podman-")
    split = lambda kvs: [tuple(kv.split("=", 1)) for kv in kvs]  # noqa: E731
    stack = Stack(args.tag, workdir, split(args.sidecar_env), split(args.envoy_env))
    stack.down()
    try:
        log(f"playing the stores (Redis :{stack.ports.redis}, broker :{stack.ports.broker}, "
            f"PostgreSQL :{stack.ports.postgres}, upstream :{stack.ports.upstream})")
        stack.play("stores")
        wait_until("redis", lambda: stack.exec(stack.container("tollgate-redis", "redis"), "redis-cli", "-p",
                                                str(stack.ports.redis), "ping", check=False).stdout.strip() == "PONG")
        wait_until("postgres", lambda: stack.exec(stack.container("tollgate-postgres", "postgres"), "pg_isready", "-h",
                                                   "127.0.0.1", "-p", str(stack.ports.postgres), check=False).returncode == 0)
        wait_until("broker", lambda: port_open(stack.ports.broker))
        wait_until("upstream", lambda: port_open(stack.ports.upstream))
        stack.play("billing")
        for name in ("a", "b"):
            p = stack.ports.gateways[name]
            log(f"playing gateway pod {name} (Envoy :{p['listen']}, admin :{p['admin']}, sidecar :{p['sidecar']})")
            stack.play(f"gateway-{name}")
        for name in ("a", "b"):
            stack.wait_gateway(name)
        log(f"everything played and ready in {time.monotonic() - started:.1f}s")

        readme_flow(stack)

        # ---- the rolling restart under load ----
        keys = {t: stack.create_key("a", t, p) for t, p in
                [("steady-1", "steady"), ("steady-2", "steady"), ("hammer", "hammer"), ("tokens", "tokens")]}
        streams = [
            ("steady-1", keys["steady-1"], 120, {}),
            ("steady-2", keys["steady-2"], 120, {}),
            ("hammer", keys["hammer"], 40, {}),
            # in flight 150 ms each, the upstream reports 50 tokens
            ("tokens", keys["tokens"], 30, {"x-echo-usage": str(TOKENS_PER_REQUEST), "x-echo-delay-ms": "150"}),
        ]
        load = Load(stack, streams)
        t_load = time.monotonic()
        load.start()
        time.sleep(args.seconds)
        durations = {}
        for name in ("a", "b"):
            log(f"replacing gateway pod {name} under load")
            durations[name] = restart(stack, load, name)
            log(f"gateway pod {name}: stopped (drained) in {durations[name][0]:.1f}s, replaced and ready in {durations[name][1]:.1f}s "
                f"(load time {time.monotonic() - load.t0:.1f}s)")
            time.sleep(args.seconds)
        load.finish()
        elapsed = time.monotonic() - t_load

        log(f"rolling restart: {load.sent} requests in {elapsed:.1f}s ({load.sent / elapsed:.0f}/s), "
            f"{load.retries} refused connections retried on the other pod; pod a replaced in {durations['a'][1]:.1f}s "
            f"(drained and stopped in {durations['a'][0]:.1f}s), pod b in {durations['b'][1]:.1f}s ({durations['b'][0]:.1f}s)")
        for tenant, counts in sorted(load.by_tenant.items()):
            log(f"  {tenant}: " + ", ".join(f"{s} x {n}" for s, n in sorted(counts.items())))
        if load.failures:
            fail(f"{len(load.failures)} requests failed that the client could not retry, e.g. {load.failures[:5]} ... {load.failures[-3:]}")
        if load.five_xx:
            codes = {}
            for x in load.five_xx:
                codes[x[5][:60]] = codes.get(x[5][:60], 0) + 1
            fail(f"{len(load.five_xx)} answers 5xx {codes}, e.g. {load.five_xx[:5]}")
        if load.sent < 200 * elapsed:
            fail(f"the load generator sent {load.sent / elapsed:.0f} requests/s of the 310 asked: the figures would not mean much")
        answered = sum(sum(c.values()) for c in load.by_tenant.values())
        if answered != load.sent:
            fail(f"{load.sent} sent, {answered} answered")
        hammer_ok = load.count("hammer", 200)
        if hammer_ok != HAMMER_LIMIT:
            fail(f"the exact limit ({HAMMER_LIMIT} an hour) admitted {hammer_ok} over the run")
        log(f"exact limit: {hammer_ok} admitted of {HAMMER_LIMIT} allowed, {load.count('hammer', 429)} refused (429)")
        for tenant in ("steady-1", "steady-2", "hammer", "tokens"):
            ok, denied = load.count(tenant, 200), load.count(tenant, 429)
            tokens = ok * TOKENS_PER_REQUEST if tenant == "tokens" else None
            got = wait_billed(stack, tenant, ok, denied, tokens)
            log(f"billing {tenant}: clients saw {ok} x 200 + {denied} x 429; rollup ok {got[0]}, denied {got[1]}, "
                f"tokens {got[2]}, events {got[3]} (each once)")
        # every completion of a request in flight across the restarts settled its reservation
        want = load.count("tokens", 200) * TOKENS_PER_REQUEST
        wait_until(f"the token budget settled at {want}", lambda: budget_used(stack, "tokens") == want, timeout=30)
        log(f"token budget: {budget_used(stack, 'tokens')} tokens held in Redis = {load.count('tokens', 200)} completions "
            f"x {TOKENS_PER_REQUEST} (each reservation of 100 settled to what the upstream reported)")

        # ---- SIGKILL with acknowledged events only in the spool ----
        killed_key = stack.create_key("b", "killed", "killed")
        broker = stack.container("tollgate-broker", "broker")
        run(PM + ["pause", broker])
        b = stack.ports.gateways["b"]["listen"]
        before = [request(b, "/hello", {"x-api-key": killed_key})[0] for _ in range(KILLED_LIMIT * 6 // 10)]
        # acknowledged: the sidecar's meter counts what it spooled (fsync'd before its 200)
        wait_until("pod b's sidecar acknowledged its events",
                   lambda: redis_meter(stack, "killed", "ok") == before.count(200), timeout=30)
        pod_b = stack.pod("tollgate-gateway-b")
        t0 = time.monotonic()
        run(PM + ["pod", "kill", "--signal", "KILL", pod_b])
        run(PM + ["unpause", broker])
        run(PM + ["pod", "start", pod_b])
        stack.wait_gateway("b")
        log(f"pod b killed (SIGKILL) with {before.count(200)} acknowledged events unshipped (broker paused); "
            f"started again with its volumes in {time.monotonic() - t0:.1f}s")
        after = [request(stack.ports.gateways[n]["listen"], "/hello", {"x-api-key": killed_key})[0]
                 for n in ("a", "b") for _ in range(KILLED_LIMIT * 3 // 10)]
        ok = before.count(200) + after.count(200)
        denied = before.count(429) + after.count(429)
        if ok != KILLED_LIMIT or ok + denied != len(before) + len(after):
            fail(f"across the kill the exact limit ({KILLED_LIMIT}) admitted {ok}; answers {before} / {after}")
        got = wait_billed(stack, "killed", ok, denied)
        log(f"SIGKILL: {ok} admitted of {KILLED_LIMIT} allowed, {denied} refused; rollup ok {got[0]}, denied {got[1]}, "
            f"events {got[3]} (the spool recovered: none lost, none twice)")
        log(f"PASSED in {time.monotonic() - started:.1f}s")
    except BaseException:
        import urllib.request
        for name, p in stack.ports.gateways.items():
            try:
                url = f"http://127.0.0.1:{p['admin']}/stats?filter=downstream_cx_|downstream_rq_|overload|wasm"
                stats = urllib.request.urlopen(url, timeout=5).read().decode()
                print(f"---- gateway {name}: Envoy stats ----\n{stats}", flush=True)
            except Exception as e:  # its Envoy is down
                print(f"---- gateway {name}: no Envoy stats ({e}) ----", flush=True)
        for c in ("tollgate-gateway-a-pod-0-envoy", "tollgate-gateway-a-pod-0-sidecar", "tollgate-gateway-b-pod-0-envoy",
                  "tollgate-gateway-b-pod-0-sidecar", "tollgate-billing-pod-0-billing"):
            r = stack.logs(c)
            print(f"---- {c} ----\n{r.stdout[-3000:]}{r.stderr[-3000:]}", flush=True)
        raise
    finally:
        if not args.keep:
            stack.down()
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
