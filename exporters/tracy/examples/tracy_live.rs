//! The quickstart's workload, live in Tracy: worker threads recorded through `tracing` and native scopes, a
//! render thread with frame marks and GPU work on tickline's simulated GPU, running until interrupted (Ctrl-C)
//! or for `--seconds N`, exported to Tracy and, with `--perfetto PATH`, to a Perfetto trace at the same time
//! (both exporters on one timeline).
//!
//! `cargo run --release -p tickline-tracy --example tracy_live -- [--seconds N] [--perfetto trace.pftrace]`, then connect the
//! Tracy profiler (0.14.x) to this machine. Build with `--features tickline-tracy/ondemand` for Tracy's
//! on-demand mode (nothing is kept until a profiler connects).

#[path = "../../../examples/support/workload.rs"]
mod workload;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tickline::gpu::sim::{SimGpu, SimGpuConfig};
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tickline_tracy::TracyExporter;
use tracing::{info, info_span};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn running(end: Option<Instant>) -> bool {
    !STOP.load(Ordering::Relaxed) && end.is_none_or(|end| Instant::now() < end)
}

fn worker(id: usize, end: Option<Instant>) {
    let mut job = 0usize;
    while running(end) {
        workload::job(id, job);
        job += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Each frame: a `tracing` span, GPU scopes on a graphics and a transfer queue of the simulated GPU, a wait
/// for the GPU, a frame mark.
fn render(timeline: &Timeline, end: Option<Instant>) -> Result<(), tickline::TicklineError> {
    let config = SimGpuConfig {
        hardware_queues: 2,
        ..Default::default()
    };
    let gpu = timeline.gpu(SimGpu::new(config)?)?;
    println!("GPU: {} ({})", gpu.info().name, gpu.info().api);
    let graphics = gpu.queue("graphics")?;
    let transfer = gpu.queue("transfer")?;
    let mut frame = 0u32;
    while running(end) {
        workload::simulated_frame(gpu.backend(), &graphics, &transfer, frame);
        tickline::frame_mark!();
        frame += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

fn usage() -> ! {
    eprintln!("usage: tracy_live [--seconds N] [--perfetto PATH]");
    std::process::exit(2);
}

fn main() {
    let mut seconds = None;
    let mut perfetto = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                seconds = Some(
                    args.next()
                        .and_then(|s| s.parse::<f64>().ok())
                        .unwrap_or_else(|| usage()),
                )
            }
            "--perfetto" => perfetto = Some(args.next().unwrap_or_else(|| usage())),
            _ => usage(),
        }
    }
    // SAFETY: `on_interrupt` only stores to an atomic, which is async-signal-safe; installing a handler for
    // SIGINT has no other precondition.
    unsafe { libc::signal(libc::SIGINT, on_interrupt as *const () as libc::sighandler_t) };

    let tracy = TracyExporter::new();
    let tracy_stats = tracy.stats();
    // Live sessions want GPU slices soon: hold one at most 500 ms for a calibration point after it.
    let mut builder = tracy.install(Timeline::builder().gpu_latency_bound(Duration::from_millis(500)));
    if let Some(path) = &perfetto {
        match PerfettoExporter::create(path) {
            Ok(exporter) => builder = builder.exporter(exporter),
            Err(e) => {
                eprintln!("tracy_live: cannot write the Perfetto trace: {e}");
                std::process::exit(1);
            }
        }
    }
    let timeline = match builder.start() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("tracy_live: cannot start tickline: {e}");
            std::process::exit(1);
        }
    };
    if let Some(reason) = timeline.tsc_fallback_reason() {
        eprintln!("tracy_live: tickline records CLOCK_MONOTONIC ({reason}); GPU zones are placed by ns");
    }
    tracing_subscriber::registry().with(timeline.layer()).init();
    let end = seconds.map(|s| Instant::now() + Duration::from_secs_f64(s));
    match seconds {
        Some(s) => println!("running for {s} s: connect the Tracy profiler to this machine"),
        None => println!("running until Ctrl-C: connect the Tracy profiler to this machine"),
    }

    {
        let _app = info_span!("app", workers = 4).entered();
        info!("starting {} workers", 4);
        std::thread::scope(|s| {
            let timeline = &timeline;
            std::thread::Builder::new()
                .name("render".into())
                .spawn_scoped(s, move || {
                    if let Err(e) = render(timeline, end) {
                        eprintln!("tracy_live: no GPU timeline: {e}");
                    }
                })
                .expect("spawn render thread");
            for id in 0..4 {
                std::thread::Builder::new()
                    .name(format!("worker-{id}"))
                    .spawn_scoped(s, move || worker(id, end))
                    .expect("spawn worker");
            }
        });
        tickline::instant!("all workers joined");
    }

    let stats = match timeline.shutdown() {
        Ok(stats) => stats,
        Err(e) => {
            eprintln!("tracy_live: export failed: {e}");
            std::process::exit(1);
        }
    };
    let t = tracy_stats.get();
    println!(
        "{} events from {} threads ({} records, {} dropped), {} GPU scopes; Tracy: {} GPU zones in {} contexts, \
         {} anchors (longest call {:.0} ns), {} not captured, {} stale",
        stats.events,
        stats.threads,
        stats.records,
        stats.dropped_records,
        stats.gpu_scopes,
        t.gpu_zones,
        t.gpu_contexts,
        t.anchors,
        t.anchor_latency_max_ns,
        t.gpu_zones_not_captured,
        t.stale_gpu_zones,
    );
    if let Some(path) = perfetto {
        println!("wrote {path}: open it at https://ui.perfetto.dev");
    }
}
