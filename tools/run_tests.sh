#!/usr/bin/env bash
# `make test`: the CPU suite and the Triton-interpreter suite as concurrent pytest processes, the
# interpreter suite split into RECFUSE_INTERPRET_SHARDS round-robin shards (default 2; tests/conftest.py,
# RECFUSE_TEST_SHARD). Each process is single-threaded for most of its time and the interpreter suite
# runs ~2.5x the CPU one, so on a 2-core machine three processes keep both cores busy to the end,
# where two left one idle for the interpreter suite's last ~8 minutes.
# Each process's output is printed whole, CPU suite first, once all have finished; the exit status is
# non-zero if any failed. RECFUSE_TEST_SERIAL=1 runs the two suites one after the other instead.
set -uo pipefail
PY=${PY:-.venv/bin/python}
if [ "${RECFUSE_TEST_SERIAL:-0}" = "1" ]; then
    "$PY" -m pytest -q -m "not interpret" "$@" && TRITON_INTERPRET=1 "$PY" -m pytest -q -m interpret "$@"
    exit $?
fi
shards=${RECFUSE_INTERPRET_SHARDS:-2}
if ! [[ "$shards" =~ ^[1-9][0-9]*$ ]]; then
    echo "RECFUSE_INTERPRET_SHARDS must be a positive integer, got '$shards'" >&2
    exit 2
fi
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
"$PY" -m pytest -q -m "not interpret" "$@" > "$logs/cpu.log" 2>&1 &
pids=($!)
names=("pytest -m 'not interpret'")
for ((i = 0; i < shards; i++)); do
    RECFUSE_TEST_SHARD="$i/$shards" TRITON_INTERPRET=1 "$PY" -m pytest -q -m interpret "$@" \
        > "$logs/interpret$i.log" 2>&1 &
    pids+=($!)
    names+=("TRITON_INTERPRET=1 RECFUSE_TEST_SHARD=$i/$shards pytest -m interpret")
done
echo "make test: CPU suite and $shards interpreter shard(s) running (pids ${pids[*]}); output when all end"
status=0
logs_in_order=("$logs/cpu.log")
for ((i = 0; i < shards; i++)); do logs_in_order+=("$logs/interpret$i.log"); done
for k in "${!pids[@]}"; do
    wait "${pids[$k]}"; rc=$?
    echo "=== ${names[$k]} (exit $rc)"
    cat "${logs_in_order[$k]}"
    [ "$rc" -eq 0 ] || status=1
done
exit "$status"
