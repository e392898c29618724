#!/usr/bin/env bash
# No slow mode: runs the span lifecycle's measurement (`total_cpu --once`) as 20 separate processes and checks
# that no process's recording thread is more than 1.2 x the median, the issue's criterion: the hot path, what the
# `overhead` bench measures, once per process. A process whose producer waited on the collector's cache lines
# was 1.6-2.9 x for seconds at a time.
#
# Each process reports the median of 3 samples of 1,000,000 spans (`--median 3`): what that process runs at, so
# that a slow mode (which lasts) shows and a single interruption by the VM's neighbours (which does not) is not
# taken for one. The floor (registry + empty layer, no tickline) runs as 20 processes of its own, interleaved
# with tickline's: its spread is this machine's, and the line to read tickline's against.
#
# The total (all threads) is printed too: it also varies with where the scheduler puts the collector's two
# threads (the drain beside the recording thread, or beside the processing thread, which then falls behind),
# which is not a slow mode of the hot path. Usage: bash benches/slow_mode.sh [CONFIG] (default
# tickline_perfetto).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-tickline_perfetto}
bin=$(cargo bench -p tickline-benches --bench total_cpu --no-run 2>&1 | grep -o 'target/release/deps/total_cpu-[0-9a-f]*' | head -1)
results=()
floor=()
one() {
    # One process: its total on stdout, "recording thread X" on stderr.
    local out
    out=$("$bin" --once "$1" span --median 3 2>&1)
    echo "$(grep -o 'recording thread [0-9.]*' <<<"$out" | awk '{print $3}') $(grep -E '^[0-9.]+$' <<<"$out")"
}
for i in $(seq 1 20); do
    results+=("$(one "$config")")
    floor+=("$(one floor)")
done
{
    printf '%s\n' "${results[@]}"
    echo --
    printf '%s\n' "${floor[@]}"
} | python3 -c '
import sys
text = sys.stdin.read().strip().split("--")
rows, floor = ([line.split() for line in part.strip().splitlines()] for part in text)
def report(label, values):
    v = sorted(values)
    median = v[len(v) // 2]
    worst = max(v)
    print(f"slow_mode: {label}, 20 processes, ns per span lifecycle: " + " ".join(f"{x:.1f}" for x in v))
    print(f"slow_mode: {label}: median {median:.1f}, worst {worst:.1f} = {worst / median:.2f} x the median")
    return worst / median
recording = report("recording thread", [float(r[0]) for r in rows])
report("all threads", [float(r[1]) for r in rows])
floor_ratio = report("floor (no tickline), recording thread", [float(r[0]) for r in floor])
print(f"slow_mode: recording thread worst / median {recording:.2f} (goal <= 1.2; the floor in the same run: {floor_ratio:.2f})")
sys.exit(0 if recording <= 1.2 else 1)
'
