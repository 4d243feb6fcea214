#!/usr/bin/env bash
# Stops exactly what scripts/up.sh started (the process groups recorded in .tollgate/run/*.pgid).
set -uo pipefail
RUN="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.tollgate/run"
shopt -s nullglob
stopped=0
for f in "$RUN"/*.pgid; do
  pgid="$(cat "$f")"
  name="$(basename "$f" .pgid)"
  if kill -0 -- "-$pgid" 2>/dev/null; then
    kill -TERM -- "-$pgid" 2>/dev/null
    for _ in $(seq 1 50); do kill -0 -- "-$pgid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pgid" 2>/dev/null
    echo "stopped $name"
    stopped=$((stopped + 1))
  fi
  rm -f "$f"
done
[ "$stopped" -gt 0 ] || echo "nothing was running"
