//! tickline in one screen: a small multi-threaded "app" recorded through `tracing` and native scopes,
//! written to a Perfetto trace.
//!
//! `cargo run --release --example quickstart [-- path/to/trace.pftrace]`

use std::time::{Duration, Instant};

use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::{debug, info, info_span};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// A stand-in for real work: spin for about `micros` µs so the slices have visible widths.
fn busy(micros: u64) -> u64 {
    let end = Instant::now() + Duration::from_micros(micros);
    let mut x = 0u64;
    while Instant::now() < end {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    }
    x
}

fn worker(id: usize, jobs: usize) {
    for job in 0..jobs {
        let span = info_span!("job", worker = id, job, kind = tracing::field::Empty);
        let _job = span.enter();
        span.record("kind", if job % 3 == 0 { "heavy" } else { "light" });
        {
            let _load = info_span!("load", bytes = 4096 * (job + 1)).entered();
            busy(40);
        }
        {
            let _compute = info_span!("compute").entered();
            for step in 0..3 {
                let _s = tickline::scope!("kernel step");
                busy(if job % 3 == 0 { 60 } else { 20 });
                tickline::counter!("worker steps", (job * 3 + step) as f64);
            }
        }
        debug!(worker = id, job, "job finished");
    }
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "quickstart.pftrace".to_owned());
    let exporter = match PerfettoExporter::create(&path) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("quickstart: cannot write the trace: {e}");
            std::process::exit(1);
        }
    };
    let timeline = match Timeline::builder().exporter(exporter).start() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("quickstart: cannot start tickline: {e}");
            std::process::exit(1);
        }
    };
    tracing_subscriber::registry().with(timeline.layer()).init();

    {
        let _app = info_span!("app", workers = 4).entered();
        info!("starting {} workers", 4);
        std::thread::scope(|s| {
            for id in 0..4 {
                std::thread::Builder::new()
                    .name(format!("worker-{id}"))
                    .spawn_scoped(s, move || worker(id, 50))
                    .expect("spawn worker");
            }
        });
        tickline::instant!("all workers joined");
    }

    let stats = match timeline.shutdown() {
        Ok(stats) => stats,
        Err(e) => {
            eprintln!("quickstart: the trace is incomplete: {e}");
            std::process::exit(1);
        }
    };
    println!(
        "wrote {path}: {} events from {} threads ({} records, {} dropped)",
        stats.events, stats.threads, stats.records, stats.dropped_records
    );
    println!("open it at https://ui.perfetto.dev (\"Open trace file\")");
}
