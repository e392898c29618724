#!/usr/bin/env bash
# No slow mode: runs the span lifecycle's measurement (`total_cpu --once`) as 20 separate processes and checks
# that no process's recording thread is more than 1.2 x the median, the issue's criterion: the hot path, what the
# `overhead` bench measures, once per process. A process whose producer waited on the collector's cache lines
# was 1.6-2.9 x. The total (all threads) is printed too: it also varies with where the scheduler puts the
# collector's two threads (the drain beside the recording thread, or beside the processing thread, which then
# falls behind), which is not a slow mode of the hot path. Usage: bash benches/slow_mode.sh [CONFIG] (default
# tickline_perfetto).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-tickline_perfetto}
bin=$(cargo bench -p tickline-benches --bench total_cpu --no-run 2>&1 | grep -o 'target/release/deps/total_cpu-[0-9a-f]*' | head -1)
results=()
for i in $(seq 1 20); do
    # One process: its total on stdout, "recording thread X" on stderr.
    out=$("$bin" --once "$config" span 2>&1)
    total=$(grep -E '^[0-9.]+$' <<<"$out")
    recording=$(grep -o 'recording thread [0-9.]*' <<<"$out" | awk '{print $3}')
    results+=("$recording $total")
done
printf '%s\n' "${results[@]}" | python3 -c '
import sys
rows = [line.split() for line in sys.stdin.read().strip().splitlines()]
def report(label, values):
    v = sorted(values)
    median = v[len(v) // 2]
    worst = max(v)
    print(f"slow_mode: {label}, 20 processes, ns per span lifecycle: " + " ".join(f"{x:.1f}" for x in v))
    print(f"slow_mode: {label}: median {median:.1f}, worst {worst:.1f} = {worst / median:.2f} x the median")
    return worst / median
recording = report("recording thread", [float(r[0]) for r in rows])
report("all threads", [float(r[1]) for r in rows])
print(f"slow_mode: recording thread worst / median {recording:.2f} (goal <= 1.2)")
sys.exit(0 if recording <= 1.2 else 1)
'
