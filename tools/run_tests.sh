#!/usr/bin/env bash
# `make test`: the CPU suite and the Triton-interpreter suite as two concurrent pytest processes.
# Each is single-threaded for most of its time (the interpreter suite runs ~2x the CPU one), so on a
# 2-core machine the wall time is about the interpreter suite's alone instead of the two summed.
# Each suite's output is printed whole, CPU suite first, once both have finished; the exit status is
# non-zero if either failed. RECFUSE_TEST_SERIAL=1 runs them one after the other instead.
set -uo pipefail
PY=${PY:-.venv/bin/python}
if [ "${RECFUSE_TEST_SERIAL:-0}" = "1" ]; then
    "$PY" -m pytest -q -m "not interpret" "$@" && TRITON_INTERPRET=1 "$PY" -m pytest -q -m interpret "$@"
    exit $?
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
"$PY" -m pytest -q -m "not interpret" "$@" > "$logs/cpu.log" 2>&1 &
cpu_pid=$!
TRITON_INTERPRET=1 "$PY" -m pytest -q -m interpret "$@" > "$logs/interpret.log" 2>&1 &
interpret_pid=$!
echo "make test: CPU suite (pid $cpu_pid) and interpreter suite (pid $interpret_pid) running; output when both end"
wait "$cpu_pid"; cpu_status=$?
echo "=== pytest -m 'not interpret' (exit $cpu_status)"
cat "$logs/cpu.log"
wait "$interpret_pid"; interpret_status=$?
echo "=== TRITON_INTERPRET=1 pytest -m interpret (exit $interpret_status)"
cat "$logs/interpret.log"
[ "$cpu_status" -eq 0 ] && [ "$interpret_status" -eq 0 ]
