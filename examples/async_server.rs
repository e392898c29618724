//! An async server on tokio, recorded as tasks: each simulated request is a task with its life on its own
//! track (creation to close), its polls as children (the gaps between them are its awaits), a flow from each
//! poll on the worker thread that ran it, and its child tasks (a database query, a cache lookup) as child
//! tracks under it.
//!
//! `cargo run --release --example async_server [-- path/to/trace.pftrace]` (default `async_server.pftrace`),
//! then open the trace in <https://ui.perfetto.dev>. What to look for is in the README ("Async tasks").

use std::error::Error;
use std::time::{Duration, Instant};

use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

/// Requests the server handles.
const REQUESTS: u64 = 200;

/// A cache lookup: one quick await.
async fn cache_lookup(key: u64) -> bool {
    tokio::time::sleep(Duration::from_micros(200)).await;
    key % 3 != 0
}

/// A database query: a few round trips.
async fn query(rows: u64) -> u64 {
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_micros(300 + rows * 20)).await;
    }
    rows * 2
}

/// Busy CPU work inside a poll (it holds the worker: no other task runs there meanwhile).
fn render(rows: u64) -> u64 {
    let _span = tracing::info_span!("render", rows).entered();
    let start = Instant::now();
    let mut x = rows;
    while start.elapsed() < Duration::from_micros(150) {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
    }
    x
}

/// One request: a cache lookup, on a miss a query in a child task, a blocking section, a response.
async fn handle(id: u64) -> u64 {
    let hit = cache_lookup(id)
        .instrument(tracing::info_span!("cache lookup", key = id))
        .await;
    let rows = if hit {
        1
    } else {
        // A child task: its track nests under this request's.
        tokio::spawn(query(id % 10 + 1).instrument(tracing::info_span!("db query", id)))
            .await
            .expect("the query task panicked")
    };
    // Blocking work done right: on the blocking pool, awaited here.
    let checksum = tokio::task::spawn_blocking(move || render(rows))
        .await
        .expect("the render task panicked");
    tracing::info!(id, rows, "responded");
    checksum
}

fn main() -> std::process::ExitCode {
    // Errors in words (returned from `main`, they would print as `Debug`).
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("async_server: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "async_server.pftrace".to_owned());
    let timeline = Timeline::builder().exporter(PerfettoExporter::create(&path)?).start()?;
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    tracing::dispatcher::set_global_default(dispatch)?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()?;
    runtime.block_on(async {
        let mut handles = Vec::new();
        for id in 0..REQUESTS {
            // Requests arrive over time, several in flight at once.
            tokio::time::sleep(Duration::from_micros(100)).await;
            handles.push(tokio::spawn(handle(id).instrument(tracing::info_span!(
                "request",
                id,
                path = "/items"
            ))));
        }
        for handle in handles {
            handle.await.expect("a request task panicked");
        }
    });
    drop(runtime);

    let stats = timeline.shutdown()?;
    println!(
        "wrote {path}: {} async tasks with {} polls, {} records, {} dropped",
        stats.async_tasks, stats.async_polls, stats.records, stats.dropped_records
    );
    Ok(())
}
