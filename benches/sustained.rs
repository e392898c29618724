//! Sustained load: 1, 2 and 4 producer threads record a span with a native scope inside as fast as they can,
//! for a fixed count, in the default configuration (drop mode, 64 Ki-record rings, the Perfetto exporter
//! writing to a file). Reported per configuration (medians of the runs): records per second the rings
//! accepted, the share dropped, and the collector's CPU per record (its drain and processing threads, from
//! `/proc/self/task`). Then the drain stage alone: records moved out of a full ring per second, on one core.
//!
//! `cargo bench -p tickline-benches --bench sustained`; `cargo test --benches` runs it once, small.

use std::time::{Duration, Instant};

use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing_subscriber::layer::SubscriberExt;

/// CPU time of this process's threads whose name starts with `prefix` (Linux; 10 ms resolution).
fn threads_cpu(prefix: &str) -> Duration {
    let mut total = Duration::ZERO;
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return total;
    };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(prefix) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = fields.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
            + fields.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        total += Duration::from_millis(ticks * 10);
    }
    total
}

struct Run {
    accepted_per_s: f64,
    dropped_share: f64,
    collector_ns_per_record: f64,
}

fn run(threads: usize, items_per_thread: u64) -> Run {
    let path = std::env::temp_dir().join(format!("tickline-sustained-{}.pftrace", std::process::id()));
    let timeline = Timeline::builder()
        .exporter(PerfettoExporter::create(&path).expect("trace file"))
        .start()
        .expect("timeline");
    let layer = timeline.layer();
    let barrier = std::sync::Barrier::new(threads);
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            let (layer, barrier) = (layer.clone(), &barrier);
            s.spawn(move || {
                tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
                    barrier.wait();
                    for i in 0..items_per_thread {
                        let _span = tracing::info_span!("item", i).entered();
                        let _scope = tickline::scope!("work");
                    }
                })
            });
        }
    });
    let elapsed = start.elapsed();
    let stats = timeline.stats();
    let collector = threads_cpu("tickline-");
    let stats_after = {
        timeline.flush().expect("flush");
        timeline.stats()
    };
    let collector_total = threads_cpu("tickline-").max(collector);
    timeline.shutdown().expect("shutdown");
    let _ = std::fs::remove_file(&path);
    let produced = stats.records + stats.dropped_records;
    Run {
        accepted_per_s: stats.records as f64 / elapsed.as_secs_f64(),
        dropped_share: stats.dropped_records as f64 / produced.max(1) as f64,
        collector_ns_per_record: collector_total.as_nanos() as f64 / stats_after.records.max(1) as f64,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (items, runs) = if full { (500_000, 5) } else { (5_000, 1) };
    for threads in [1, 2, 4] {
        let results: Vec<Run> = (0..runs).map(|_| run(threads, items / threads as u64)).collect();
        println!(
            "sustained/{threads}_threads: {:.1} M records/s accepted, {:.2} % dropped, collector {:.1} ns CPU per record",
            median(results.iter().map(|r| r.accepted_per_s / 1e6).collect()),
            median(results.iter().map(|r| r.dropped_share * 100.0).collect()),
            median(results.iter().map(|r| r.collector_ns_per_record).collect()),
        );
    }
    let rounds = if full { 2_000 } else { 20 };
    let rates: Vec<f64> = (0..if full { 9 } else { 1 })
        .map(|_| {
            let (moved, elapsed) = tickline::bench_support::drain_bench(1 << 16, rounds);
            moved as f64 / elapsed.as_secs_f64()
        })
        .collect();
    println!(
        "sustained/drain_stage_alone: {:.0} M records/s on one core",
        median(rates) / 1e6
    );
}
