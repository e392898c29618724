#!/bin/sh
# Does tickline keep a good TSC when the machine is busy? Starts BUSY_LOOPS CPU-bound loops (default: one per
# core, like a game or a compute job), then PROCESSES processes that each start 1 + LATER timelines and wait for
# the process's final tick-source decision. Counts the processes that recorded CLOCK_MONOTONIC or whose final
# decision rejected the TSC (on a machine whose TSC is good, every one is a false fallback), and reports the
# start latency under that load.
#
#   benches/tsc_decision_under_load.sh [PROCESSES] [BUSY_LOOPS] [BIN]
#
#   cargo build --release --example start_latency
#   benches/tsc_decision_under_load.sh 200        # two busy loops on a 2-core machine
#   benches/tsc_decision_under_load.sh 200 0      # the same without load
#
# BIN defaults to target/release/examples/start_latency. The JSON lines go to $OUT (default
# /tmp/tsc_decision_under_load.jsonl). A binary without the final decision (before issue 14) prints
# "final":null; then only the starts are counted.
set -eu
processes=${1:-200}
busy=${2:-$(nproc)}
bin=${3:-target/release/examples/start_latency}
later=${LATER:-5}
out=${OUT:-/tmp/tsc_decision_under_load.jsonl}
here=$(dirname "$0")

pids=""
stop_loops() {
    for pid in $pids; do kill "$pid" 2>/dev/null || true; done
}
trap stop_loops EXIT INT TERM
i=0
while [ "$i" -lt "$busy" ]; do
    sh -c 'while :; do :; done' &
    pids="$pids $!"
    i=$((i + 1))
done
echo "$busy busy loop(s) running beside $processes processes on $(nproc) CPUs; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
started=$(date +%s)

OUT="$out" WAIT_FINAL_MS=${WAIT_FINAL_MS:-20000} "$here/start_latency.sh" "$processes" "$later" "$bin"

stop_loops
pids=""
finals=$(grep -c '"stage":"final"' "$out" || true)
final_fallbacks=$(grep -c '"fallback":true' "$out" || true)
provisional=$(grep -c '"stage":"provisional"' "$out" || true)
first_monotonic=$(grep -c '"sources":\["Monotonic"' "$out" || true)
echo "processes whose first timeline recorded CLOCK_MONOTONIC: $first_monotonic of $processes"
echo "final decisions: $finals (still provisional after the wait: $provisional); final fallbacks: $final_fallbacks"
if [ "$final_fallbacks" -gt 0 ] || [ "$first_monotonic" -gt 0 ]; then
    echo "reasons:"
    sed -n 's/.*"first_fallback_reason":\("[^"]*"\).*/  first start: \1/p' "$out" | sort | uniq -c | sort -rn | head -20
    sed -n 's/.*"fallback":true.*"reason":\("[^"]*"\).*/  final: \1/p' "$out" | sort | uniq -c | sort -rn | head -20
fi
warned=$(grep -c '"warnings":\["' "$out" || true)
echo "final decisions with warnings (checks that stayed inconclusive or unconfirmed): $warned"
echo "took $(( $(date +%s) - started )) s"
