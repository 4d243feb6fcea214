#!/usr/bin/env bash
# Starts the demo stack in the background: Redis, the sidecar, the echo upstream and Envoy with
# the Tollgate filter, and for usage metering a Kafka-compatible broker (tansu), PostgreSQL and
# the billing consumer; issues a demo key; writes .tollgate/demo.env. Called by `./build.sh up`,
# which installs and builds first and exports TOLLGATE_ENVOY_BIN, TOLLGATE_WASM,
# TOLLGATE_SIDECAR_BIN (and TOLLGATE_NATIVE_MODULE). Ports can be changed with the variables below.
# `--host native` loads the filter as an Envoy dynamic module instead of Wasm
# (docs/architecture.md, "The native host").
set -euo pipefail
HOST=wasm
while [ $# -gt 0 ]; do
  case "$1" in
    --host) HOST="${2:-}"; shift 2 ;;
    --host=*) HOST="${1#--host=}"; shift ;;
    *) echo "usage: ./build.sh up [--host wasm|native]" >&2; exit 2 ;;
  esac
done
case "$HOST" in wasm|native) ;; *) echo "error: --host is wasm or native, not '$HOST'" >&2; exit 2 ;; esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN="$ROOT/.tollgate/run"
ENVOY_PORT="${TOLLGATE_ENVOY_PORT:-10000}"
ENVOY_ADMIN_PORT="${TOLLGATE_ENVOY_ADMIN_PORT:-9901}"
SIDECAR_PORT="${TOLLGATE_SIDECAR_PORT:-9090}"
UPSTREAM_PORT="${TOLLGATE_UPSTREAM_PORT:-9080}"
REDIS_PORT="${TOLLGATE_REDIS_PORT:-6380}"
ADMIN_PORT="${TOLLGATE_ADMIN_PORT:-9091}"
KAFKA_PORT="${TOLLGATE_KAFKA_PORT:-9092}"
PG_PORT="${TOLLGATE_PG_PORT:-5433}"
PROMETHEUS_PORT="${TOLLGATE_PROMETHEUS_PORT:-9094}"
BILLING_METRICS_PORT="${TOLLGATE_BILLING_METRICS_PORT:-9095}"
ECHO_BIN="$ROOT/target/release/tollgate-echo"

"$ROOT/scripts/down.sh" >/dev/null 2>&1 || true
mkdir -p "$RUN"

for p in "$ENVOY_PORT" "$ENVOY_ADMIN_PORT" "$SIDECAR_PORT" "$UPSTREAM_PORT" "$REDIS_PORT" "$ADMIN_PORT" "$KAFKA_PORT" "$PG_PORT" "$PROMETHEUS_PORT" "$BILLING_METRICS_PORT"; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
    echo "error: port $p is in use; set TOLLGATE_*_PORT (see scripts/up.sh) or stop what uses it" >&2
    exit 1
  fi
done

# Each service runs under its own session leader that stays alive (Envoy gets SIGTERM when the
# process that started it exits); the leader's pid is the process group that down.sh stops.
start_bg() {
  local name="$1"; shift
  setsid bash -c '"$@" </dev/null >>"'"$RUN/$name.log"'" 2>&1 & wait' _ "$@" </dev/null >/dev/null 2>&1 &
  echo $! > "$RUN/$name.pgid"
}

wait_for() {
  local what="$1" url="$2" tries=0
  until curl -fsS -o /dev/null "$url" 2>/dev/null; do
    tries=$((tries + 1))
    if [ "$tries" -gt 300 ]; then
      echo "error: $what did not become ready; its log:" >&2
      tail -n 30 "$RUN/$what.log" >&2 || true
      exit 1
    fi
    sleep 0.1
  done
}

mkdir -p "$RUN/redis"
start_bg redis redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save 60 1 --appendonly yes \
  --dir "$RUN/redis" --daemonize no
tries=0
until redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; do
  tries=$((tries + 1)); [ "$tries" -lt 200 ] || { echo "error: redis did not start" >&2; exit 1; }
  sleep 0.05
done

# Usage metering: tansu (memory storage: a demo broker), PostgreSQL for the billing rollup.
start_bg broker "$TOLLGATE_TANSU_BIN" broker --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
  --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT" --storage-engine memory://tansu/
PG_BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
as_pg() { if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
if [ ! -f "$RUN/pg/data/PG_VERSION" ]; then
  mkdir -p "$RUN/pg"
  [ "$(id -u)" -eq 0 ] && chown -R postgres:postgres "$RUN/pg" && chmod 755 "$ROOT/.tollgate" "$RUN"
  as_pg "$PG_BIN/initdb" -D "$RUN/pg/data" -A trust -U postgres >"$RUN/pg-init.log" 2>&1
fi
PG_CMD=("$PG_BIN/postgres" -D "$RUN/pg/data" -p "$PG_PORT" -k "$RUN/pg" -c listen_addresses=127.0.0.1)
if [ "$(id -u)" -eq 0 ]; then
  start_bg postgres runuser -u postgres -- "${PG_CMD[@]}"
else
  start_bg postgres "${PG_CMD[@]}"
fi
tries=0
until "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; do
  tries=$((tries + 1)); [ "$tries" -lt 300 ] || { echo "error: postgres did not start" >&2; tail -n 20 "$RUN/postgres.log" >&2; exit 1; }
  sleep 0.1
done
export TOLLGATE_BILLING_KAFKA__BROKERS="127.0.0.1:$KAFKA_PORT"
export TOLLGATE_BILLING_POSTGRES__URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
export TOLLGATE_BILLING_LOG__FORMAT=text
TOLLGATE_BILLING_METRICS_LISTEN="127.0.0.1:$BILLING_METRICS_PORT" start_bg billing "$TOLLGATE_BILLING_BIN"

# Secrets of this deployment, fresh per `up`: the filter secret (the sidecar's [server] secret and
# the plugin's sidecar.secret) and the admin API's token. They go in files only the owner reads
# (sidecar.toml, envoy.yaml), never in an environment another process inherits.
FILTER_SECRET="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
ADMIN_TOKEN="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
rm -f "$RUN/sidecar.toml" "$RUN/envoy.yaml"   # fresh files: an old one may have a wider mode
( umask 077; : > "$RUN/sidecar.toml"; : > "$RUN/envoy.yaml" )
cat > "$RUN/sidecar.toml" <<TOML
listen = "127.0.0.1:$SIDECAR_PORT"
[server]
secret = "$FILTER_SECRET"
[redis]
url = "redis://127.0.0.1:$REDIS_PORT/"

# The admin API (docs/configuration.md); its token is read by the sidecar alone.
[admin]
listen = "127.0.0.1:$ADMIN_PORT"
token = "$ADMIN_TOKEN"

# The web console on the admin listener (docs/console.md); usage from the billing rollup,
# figures per tenant from the Prometheus started below.
[console]
enabled = true
usage_url = "postgres://postgres@127.0.0.1:$PG_PORT/postgres"
prometheus_url = "http://127.0.0.1:$PROMETHEUS_PORT"

# The demo tenant (its console user is made below).
[[tenants]]
id = "demo"
name = "Demo tenant"

[usage]
enabled = true
spool_dir = "$RUN/usage-spool"
[usage.kafka]
brokers = "127.0.0.1:$KAFKA_PORT"
partitions = 4

# The demo plan: small enough to hit by hand.
[[plans.demo.limits]]
name = "per-minute"
algorithm = "sliding_log"
subject = "key"
limit = 10
window = "60s"
TOML
export TOLLGATE_SIDECAR_CONFIG="$RUN/sidecar.toml"
start_bg sidecar "$TOLLGATE_SIDECAR_BIN"
start_bg upstream "$ECHO_BIN" --port "$UPSTREAM_PORT"

# the native host calls the sidecar on a connection of its own (`sidecar.address`, decision 219)
direct=""
if [ "$HOST" = native ]; then direct=',"address":"127.0.0.1:'"$SIDECAR_PORT"'"'; fi
plugin='{"sidecar":{"timeout":"25ms","secret":"'"$FILTER_SECRET"'"'"$direct"'},"failureMode":"closed","usage":{"enabled":true}}'
# Envoy reaches the sidecar by HTTP/2 (h2c) over loopback TCP (docs/configuration.md, "Transport
# to the sidecar"). HTTP/1.1: '{http_protocol_options: {}}'. A unix socket: listen_unix in
# sidecar.toml and "{pipe: {path: <that path>}}" as the address.
sidecar_protocol='{http2_protocol_options: {}}'
sidecar_address="{socket_address: {address: 127.0.0.1, port_value: $SIDECAR_PORT}}"
sed -e "s|\${ADMIN_PORT}|$ENVOY_ADMIN_PORT|; s|\${LISTEN_PORT}|$ENVOY_PORT|; s|\${UPSTREAM_PORT}|$UPSTREAM_PORT|" \
    -e "s|\${SIDECAR_PROTOCOL}|$sidecar_protocol|; s|\${SIDECAR_ADDRESS}|$sidecar_address|" \
    -e "s|\${WASM_PATH}|$TOLLGATE_WASM|; s|\${PLUGIN_CONFIG}|$plugin|" \
    "$ROOT/envoy/tollgate.yaml.tmpl" > "$RUN/envoy.yaml"
grep -q '\${' "$RUN/envoy.yaml" && { echo "error: unfilled placeholder in $RUN/envoy.yaml" >&2; exit 1; }
if [ "$HOST" = native ]; then
  ( umask 077; python3 "$ROOT/scripts/native-filter.py" < "$RUN/envoy.yaml" > "$RUN/envoy.yaml.native" )
  cat "$RUN/envoy.yaml.native" > "$RUN/envoy.yaml" && rm -f "$RUN/envoy.yaml.native"
  export ENVOY_DYNAMIC_MODULES_SEARCH_PATH="$(dirname "$TOLLGATE_NATIVE_MODULE")"
fi
start_bg envoy "$TOLLGATE_ENVOY_BIN" -c "$RUN/envoy.yaml" --concurrency 2 --disable-hot-restart \
  --base-id "$ENVOY_ADMIN_PORT" -l warning --component-log-level wasm:info,dynamic_modules:info

wait_for sidecar "http://127.0.0.1:$SIDECAR_PORT/healthz"
wait_for upstream "http://127.0.0.1:$UPSTREAM_PORT/"
wait_for envoy "http://127.0.0.1:$ENVOY_ADMIN_PORT/ready"

# Prometheus (Debian's package) scraping Envoy and the sidecar, with Tollgate's alert and
# recording rules; the Grafana dashboard to import is observability/grafana/tollgate-overview.json.
cat > "$RUN/prometheus.yml" <<YAML
global: {scrape_interval: 5s, evaluation_interval: 5s}
rule_files: ["$ROOT/observability/rules.yml"]
scrape_configs:
  - job_name: envoy
    metrics_path: /stats/prometheus
    static_configs: [{targets: ["127.0.0.1:$ENVOY_ADMIN_PORT"]}]
  - job_name: tollgate-sidecar
    static_configs: [{targets: ["127.0.0.1:$SIDECAR_PORT"]}]
  - job_name: tollgate-billing
    static_configs: [{targets: ["127.0.0.1:$BILLING_METRICS_PORT"]}]
YAML
start_bg prometheus "${TOLLGATE_PROMETHEUS_BIN:-prometheus}" --config.file="$RUN/prometheus.yml" \
  --storage.tsdb.path="$RUN/prometheus-data" --web.listen-address="127.0.0.1:$PROMETHEUS_PORT"
wait_for prometheus "http://127.0.0.1:$PROMETHEUS_PORT/-/ready"

key_out="$("$TOLLGATE_SIDECAR_BIN" keys create --tenant demo --plan demo)"
DEMO_KEY="$(tail -n 1 <<<"$key_out")"
DEMO_KEY_ID="$(sed -n 's/^key id: *//p' <<<"$key_out")"

# The demo tenant's console user, made through the console's own operator forms (the token read
# from its file, never on a command line); its password is fresh per `up`, in an owner-only file.
CONSOLE="http://127.0.0.1:$ADMIN_PORT/console"
DEMO_PASSWORD="demo-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
rm -f "$RUN/console.password"
( umask 077; printf '%s\n' "$DEMO_PASSWORD" > "$RUN/console.password"; printf 'token=%s' "$ADMIN_TOKEN" > "$RUN/console.signin" )
console_cookie="$(curl -s -D - -o /dev/null --data-binary "@$RUN/console.signin" "$CONSOLE/operator/signin" | tr -d '\r' | sed -n 's/^[Ss]et-[Cc]ookie: \(tollgate_console=[^;]*\).*/\1/p')"
rm -f "$RUN/console.signin"
console_csrf="$(curl -s -H "cookie: $console_cookie" "$CONSOLE/operator" | sed -n 's/.*name="csrf" value="\([^"]*\)".*/\1/p')"
# a user an earlier `up` made (Redis keeps it) is made again, with this run's password
curl -s -o /dev/null -H "cookie: $console_cookie" --data-urlencode "csrf=$console_csrf" --data-urlencode tenant=demo \
  "$CONSOLE/operator/users/demo@example.com/delete"
made="$(curl -s -o /dev/null -w '%{http_code}' -H "cookie: $console_cookie" --data-urlencode "csrf=$console_csrf" --data-urlencode tenant=demo \
  --data-urlencode login=demo@example.com --data-urlencode name=Demo --data-urlencode plan=demo --data-urlencode "password=$DEMO_PASSWORD" "$CONSOLE/operator/users")"
[ "$made" = 303 ] || echo "warning: the demo tenant's console user was not made (HTTP $made); see .tollgate/run/sidecar.log" >&2
curl -s -o /dev/null -H "cookie: $console_cookie" --data-urlencode "csrf=$console_csrf" "$CONSOLE/signout"

# The CLI reads the admin token from an owner-only file: a shell that sources demo.env passes no
# secret on to what it starts.
rm -f "$RUN/admin.token"
( umask 077; printf '%s\n' "$ADMIN_TOKEN" > "$RUN/admin.token" )
cat > "$ROOT/.tollgate/demo.env" <<ENV
# Written by ./build.sh up — source it: . .tollgate/demo.env
export TOLLGATE_URL="http://127.0.0.1:$ENVOY_PORT"
export TOLLGATE_DEMO_KEY="$DEMO_KEY"
export TOLLGATE_DEMO_KEY_ID="$DEMO_KEY_ID"
export TOLLGATE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT/"
export TOLLGATE_SIDECAR_URL="http://127.0.0.1:$SIDECAR_PORT"
export TOLLGATE_ENVOY_ADMIN_URL="http://127.0.0.1:$ENVOY_ADMIN_PORT"
export TOLLGATE_SIDECAR_CONFIG="$RUN/sidecar.toml"
export TOLLGATE_SIDECAR_BIN="$TOLLGATE_SIDECAR_BIN"
export TOLLGATE_ADMIN_URL="http://127.0.0.1:$ADMIN_PORT"
export TOLLGATE_ADMIN_TOKEN_FILE="$RUN/admin.token"
export TOLLGATE_CLI="$ROOT/target/release/tollgate"
export PATH="$ROOT/target/release:\$PATH"
export TOLLGATE_PROMETHEUS_URL="http://127.0.0.1:$PROMETHEUS_PORT"
export TOLLGATE_KAFKA_BROKERS="127.0.0.1:$KAFKA_PORT"
export TOLLGATE_BILLING_BIN="$TOLLGATE_BILLING_BIN"
export TOLLGATE_BILLING_KAFKA__BROKERS="127.0.0.1:$KAFKA_PORT"
export TOLLGATE_BILLING_POSTGRES__URL="postgres://postgres@127.0.0.1:$PG_PORT/postgres"
ENV
chmod 600 "$ROOT/.tollgate/demo.env"

cat <<MSG

Tollgate is up ($HOST filter host): Envoy on :$ENVOY_PORT (admin :$ENVOY_ADMIN_PORT), sidecar on :$SIDECAR_PORT,
echo upstream on :$UPSTREAM_PORT, Redis on :$REDIS_PORT, broker (tansu) on :$KAFKA_PORT,
PostgreSQL on :$PG_PORT, billing consumer running, Prometheus on http://127.0.0.1:$PROMETHEUS_PORT
Logs: .tollgate/run/*.log

  . .tollgate/demo.env
  curl -i -H "Authorization: Bearer \$TOLLGATE_DEMO_KEY" \$TOLLGATE_URL/hello      # 200, upstream sees x-tollgate-tenant: demo
  curl -i \$TOLLGATE_URL/hello                                                     # 401 missing_key
  curl -i -H "x-api-key: tg_wrong" \$TOLLGATE_URL/hello                            # 401 unknown_key
  for i in \$(seq 11); do curl -s -o /dev/null -w '%{http_code} ' -H "x-api-key: \$TOLLGATE_DEMO_KEY" \$TOLLGATE_URL/hello; done; echo
                                                  # the demo plan allows 10 a minute: ten 200s, then 429
  curl -i -H "x-api-key: \$TOLLGATE_DEMO_KEY" \$TOLLGATE_URL/hello                # 429 rate_limited, Retry-After, RateLimit headers
  \$TOLLGATE_BILLING_BIN usage --tenant demo --redis \$TOLLGATE_REDIS_URL              # today's usage: rollup vs Redis meter
  \$TOLLGATE_SIDECAR_BIN keys revoke \$TOLLGATE_DEMO_KEY_ID                          # then the first curl gives 401 revoked_key

  curl -s "\$TOLLGATE_PROMETHEUS_URL/api/v1/query" --data-urlencode \\
    'query=sum by (tenant, outcome) (tollgate_requests_total)'                     # requests per tenant and outcome
  tollgate keys list --tenant demo                                                  # the admin CLI (on PATH after sourcing demo.env)

The console (docs/console.md): $CONSOLE
  operator:    sign in with the admin token:   cat .tollgate/run/admin.token
  demo tenant: demo@example.com, password:     cat .tollgate/run/console.password

Stop everything with ./build.sh down
MSG
