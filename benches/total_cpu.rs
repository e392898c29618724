//! Total CPU per recorded operation, all threads included: the recording thread, tickline's drain and
//! processing threads, the exporter's encoding, and the final drain at shutdown. The question the hot-path
//! benches (`overhead.rs`) cannot answer: what a span or an event costs the machine, not just the thread that
//! records it.
//!
//! Each configuration runs `OPS` operations on one thread, then shuts its timeline down (everything is
//! processed and encoded); the process's CPU time (`CLOCK_PROCESS_CPUTIME_ID`) over that, divided by `OPS`,
//! is one sample. Configurations, measured in the same run:
//!
//! - `floor`: `registry()` + an empty layer (what `tracing` itself costs);
//! - `tickline_perfetto`: tickline with the Perfetto exporter writing to a file;
//! - `tickline_raw`: tickline writing a raw capture (`.tickline`) and no exporter;
//! - `tracing_tracy`: `tracing-tracy`'s layer (Tracy queues everything in memory: no profiler connects).
//!
//! Operations: `span` (`info_span!("span").entered()` dropped: create, enter, exit, close) and `event`
//! (`info!(i, "event")`).
//!
//! `cargo bench -p tickline-benches --bench total_cpu` prints the medians of 9 samples. `-- --once CONFIG OP`
//! prints one sample (the slow-mode check runs that as 20 separate processes: `benches/slow_mode.sh`).
//! `cargo test --benches` runs each configuration once with few operations, to keep it compiling and working.

use std::hint::black_box;
use std::time::Duration;

use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::{Dispatch, Subscriber};
use tracing_subscriber::layer::{Layer, SubscriberExt};

/// The floor: a layer that does nothing.
struct EmptyLayer;

impl<S: Subscriber> Layer<S> for EmptyLayer {}

fn process_cpu() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_PROCESS_CPUTIME_ID exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Config {
    Floor,
    TicklinePerfetto,
    TicklineRaw,
    TracingTracy,
}

const CONFIGS: [(&str, Config); 4] = [
    ("floor", Config::Floor),
    ("tickline_perfetto", Config::TicklinePerfetto),
    ("tickline_raw", Config::TicklineRaw),
    ("tracing_tracy", Config::TracingTracy),
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Span,
    Event,
}

fn run_ops(op: Op, ops: u64) {
    match op {
        Op::Span => {
            for _ in 0..ops {
                drop(black_box(tracing::info_span!("span").entered()));
            }
        }
        Op::Event => {
            for i in 0..ops {
                tracing::info!(i, "event");
            }
        }
    }
}

/// One sample: ns of process CPU per operation.
fn sample(config: Config, op: Op, ops: u64) -> f64 {
    let dir = std::env::temp_dir();
    let path = dir.join(format!("tickline-total-cpu-{}", std::process::id()));
    let start = process_cpu();
    match config {
        Config::Floor => {
            let dispatch = Dispatch::new(tracing_subscriber::registry().with(EmptyLayer));
            tracing::dispatcher::with_default(&dispatch, || run_ops(op, ops));
        }
        Config::TicklinePerfetto | Config::TicklineRaw => {
            let builder = Timeline::builder();
            let builder = if config == Config::TicklinePerfetto {
                builder.exporter(PerfettoExporter::create(path.with_extension("pftrace")).expect("trace file"))
            } else {
                builder.raw_capture(path.with_extension("tickline"))
            };
            let timeline = builder.start().expect("timeline");
            let dispatch = Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
            tracing::dispatcher::with_default(&dispatch, || run_ops(op, ops));
            drop(dispatch);
            let stats = timeline.shutdown().expect("shutdown");
            assert_eq!(
                stats.dropped_records, 0,
                "{config:?} dropped records (the sample would flatter it): {stats:?}"
            );
        }
        Config::TracingTracy => {
            let dispatch = Dispatch::new(tracing_subscriber::registry().with(tracing_tracy::TracyLayer::default()));
            tracing::dispatcher::with_default(&dispatch, || run_ops(op, ops));
        }
    }
    let elapsed = process_cpu() - start;
    for ext in ["pftrace", "tickline"] {
        let _ = std::fs::remove_file(path.with_extension(ext));
    }
    elapsed.as_nanos() as f64 / ops as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn parse_config(name: &str) -> Config {
    CONFIGS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| *c)
        .unwrap_or_else(|| panic!("unknown config {name}"))
}

fn main() {
    let _tracy = tracy_client::Client::start();
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--once") {
        let config = parse_config(&args[at + 1]);
        let op = if args.get(at + 2).map(String::as_str) == Some("event") {
            Op::Event
        } else {
            Op::Span
        };
        // Warm up (first timeline start, page faults), then one sample.
        sample(config, op, 100_000);
        println!("{:.1}", sample(config, op, 1_000_000));
        return;
    }
    let full = args.iter().any(|a| a == "--bench");
    let (ops, samples) = if full { (1_000_000, 9) } else { (10_000, 1) };
    for op in [Op::Span, Op::Event] {
        let mut floor = 0.0;
        for (name, config) in CONFIGS {
            sample(config, op, ops / 10);
            let ns = median((0..samples).map(|_| sample(config, op, ops)).collect());
            if config == Config::Floor {
                floor = ns;
                println!("total_cpu/{op:?}/{name}: {ns:.1} ns per op");
            } else {
                println!("total_cpu/{op:?}/{name}: {ns:.1} ns per op (floor + {:.1})", ns - floor);
            }
        }
    }
}
