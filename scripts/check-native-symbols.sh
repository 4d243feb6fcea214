#!/usr/bin/env bash
# Every Envoy symbol the native host imports is exported by the Envoy binary in use
# (issue 41, decision 251). Envoy only warns on an ABI version mismatch and checks no signature:
# a missing callback would fail the module's load, so this says which one before a test does.
#   scripts/check-native-symbols.sh <libtollgate_native.so> <envoy binary>
set -euo pipefail
module="${1:?usage: $0 <libtollgate_native.so> <envoy binary>}"
envoy="${2:?usage: $0 <libtollgate_native.so> <envoy binary>}"
imports="$(nm -D --undefined-only "$module" | awk '{print $NF}' | { grep '^envoy_' || true; } | sort -u)"
exports="$(nm -D --defined-only "$envoy" | awk '{print $NF}' | { grep '^envoy_dynamic_module_callback_' || true; } | sort -u)"
[ -n "$imports" ] || { echo "no envoy_* import in $module: not the native host?" >&2; exit 1; }
missing="$(comm -23 <(printf '%s\n' "$imports") <(printf '%s\n' "$exports"))"
if [ -n "$missing" ]; then
  echo "the native host imports symbols $envoy does not export:" >&2
  printf '  %s\n' $missing >&2
  exit 1
fi
# The ABI version the module declares is one this Envoy knows.
grep -q 'v0.2.0' <(strings "$envoy" | grep -x 'v0\.[0-9]*\.[0-9]*') \
  || { echo "$envoy does not carry the ABI version v0.2.0 the module declares" >&2; exit 1; }
echo "native host: all $(printf '%s\n' "$imports" | wc -l) imported Envoy symbols are exported by $(basename "$envoy")"
