#!/usr/bin/env python3
"""Rewrites a rendered Envoy configuration (stdin) to load the native host instead of the Wasm
filter (stdout): the `envoy.filters.http.wasm` entry becomes the dynamic module
`libtollgate_native.so` with the same plugin configuration, its counters under the Wasm filter's
names (`metrics_namespace: wasmcustom`, decision 253). Envoy finds the module through
ENVOY_DYNAMIC_MODULES_SEARCH_PATH. Used by scripts/up.sh (`./build.sh up --host native`); the
test harness does the same in tests/src/envoy.rs (`native_filter`)."""
import sys

lines = sys.stdin.read().split("\n")
indent_of = lambda l: len(l) - len(l.lstrip())
start = next(i for i, l in enumerate(lines) if l.strip() == "- name: envoy.filters.http.wasm")
indent = indent_of(lines[start])
assert lines[start + 1].strip() == "typed_config:", "the Wasm filter's typed_config follows its name"
end = start + 2
while end < len(lines) and not (lines[end].strip() and indent_of(lines[end]) <= indent + 2):
    end += 1
value = next(l.strip()[len("value: "):] for l in lines[start + 2:end] if l.strip().startswith("value: "))
pad = " " * indent
native = [
    f"{pad}- name: envoy.filters.http.dynamic_modules",
    f"{pad}  typed_config:",
    f'{pad}    "@type": type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter',
    f"{pad}    dynamic_module_config: {{name: tollgate_native, do_not_close: true, metrics_namespace: wasmcustom}}",
    f"{pad}    filter_name: tollgate",
    f"{pad}    filter_config:",
    f'{pad}      "@type": type.googleapis.com/google.protobuf.StringValue',
    f"{pad}      value: {value}",
]
# Prometheus names as the Wasm filter's (`tollgate_requests_allowed`), and Envoy's admin layer.
runtime = [
    "layered_runtime:",
    "  layers:",
    "  - name: tollgate_native",
    "    static_layer: {envoy.reloadable_features.dynamic_modules_strip_custom_stat_prefix: true}",
    "  - name: admin",
    "    admin_layer: {}",
]
sys.stdout.write("\n".join(lines[:start] + native + lines[end:] + runtime) + "\n")
