#!/bin/sh
# Timeline::start() latency over many processes: the first start in each process and the starts after it.
#
#   benches/start_latency.sh [PROCESSES] [LATER_STARTS] [BIN]
#
# BIN defaults to target/release/examples/start_latency (`cargo build --release --example start_latency`).
# Prints p50/p99/max of the first start and of the later starts, in µs, and how many starts did not get
# the hardware counter. The raw JSON lines go to $OUT (default /tmp/start_latency.jsonl).
set -eu
processes=${1:-50}
later=${2:-5}
bin=${3:-target/release/examples/start_latency}
out=${OUT:-/tmp/start_latency.jsonl}
: >"$out"
i=0
while [ "$i" -lt "$processes" ]; do
    "$bin" "$later" "${WAIT_FINAL_MS:-0}" >>"$out"
    i=$((i + 1))
done
summarise() { # $1: label; stdin: one number a line
    sort -n | awk -v label="$1" '{ v[NR] = $1 } END {
        if (NR == 0) { print label ": no data"; exit }
        p50 = v[int((NR - 1) * 0.50) + 1]; p99 = v[int((NR - 1) * 0.99) + 1];
        printf "%-14s n=%-5d p50 %10.1f µs   p99 %10.1f µs   max %10.1f µs\n", label, NR, p50, p99, v[NR] }'
}
sed -n 's/.*"first_us":\([0-9.]*\).*/\1/p' "$out" | summarise "first start"
sed -n 's/.*"later_us":\[\([0-9.,]*\)\].*/\1/p' "$out" | tr ',' '\n' | grep . | summarise "later starts"
starts=$(sed -n 's/.*"sources":\[\([^]]*\)\].*/\1/p' "$out" | tr ',' '\n' | grep -c . || true)
monotonic=$(sed -n 's/.*"sources":\[\([^]]*\)\].*/\1/p' "$out" | tr ',' '\n' | grep -c Monotonic || true)
echo "starts that recorded CLOCK_MONOTONIC: $monotonic of $starts"
