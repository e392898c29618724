#!/usr/bin/env bash
# No slow mode: runs the span lifecycle's total-CPU measurement as 20 separate processes and checks that no
# process is more than 1.2 x the median (a process whose producer and collector fought over the ring's cache
# lines would be). Usage: bash benches/slow_mode.sh [CONFIG] (default tickline_perfetto).
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-tickline_perfetto}
bin=$(cargo bench -p tickline-benches --bench total_cpu --no-run 2>&1 | grep -o 'target/release/deps/total_cpu-[0-9a-f]*' | head -1)
results=()
for i in $(seq 1 20); do
    results+=("$("$bin" --once "$config" span 2>/dev/null)")
done
printf '%s\n' "${results[@]}" | python3 -c '
import sys
v = sorted(float(x) for x in sys.stdin.read().split())
median = v[len(v) // 2]
worst = max(v)
print("slow_mode: 20 processes, ns per span lifecycle (all threads): " + " ".join(f"{x:.1f}" for x in v))
print(f"slow_mode: median {median:.1f}, worst {worst:.1f} = {worst / median:.2f} x the median (goal <= 1.2)")
sys.exit(0 if worst <= 1.2 * median else 1)
'
