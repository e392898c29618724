//! wgpu frames on the CPU's timeline: a compute pass and a render pass into an offscreen texture, timed at the wgpu
//! level with `tickline::gpu::wgpu::WgpuProfiler` (the wgpu-profiler replacement that aligns), inside `tracing`
//! spans, written to a Perfetto trace.
//!
//! `cargo run --release --features wgpu --example wgpu_frame [-- path/to/trace.pftrace]`
//!
//! Runs on any Vulkan adapter wgpu finds with `TIMESTAMP_QUERY` (Mesa's lavapipe will do). The device is opened with
//! `tickline::gpu::wgpu::request_device`, which adds the calibrated-timestamps extension where offered. Each frame
//! has the GPU scopes "frame" > "simulate" (a compute pass) > "dispatch", and "draw" (a render pass) > "triangle".
//! Without a Vulkan driver it says so and exits with status 1.

#[path = "support/wgpu.rs"]
mod wgpu_support;

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use tickline::gpu::wgpu::{WgpuProfiler, WgpuProfilerSettings};
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;
use wgpu_support::{FrameWork, WgpuSetup};

const FRAMES: u64 = 48;

fn run(path: &str) -> Result<(), Box<dyn Error>> {
    let setup = WgpuSetup::new(WgpuProfiler::ALL_WGPU_TIMER_FEATURES, true)?;
    println!("device: {}; features {:?}", setup.name, setup.device.features());
    let exporter = PerfettoExporter::create(path)?;
    let timeline = Timeline::builder().exporter(exporter).start()?;
    // `set_global_default` rather than `init()`: no `log` bridge, so wgpu's own log records stay out of the trace.
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(timeline.layer()))?;

    let profiler = WgpuProfiler::new(&timeline, &setup.device, &setup.queue, WgpuProfilerSettings::default())?;
    println!("calibration: {:?}", profiler.calibration_path());
    let work = FrameWork::new(&setup.device);

    for frame in 0..FRAMES {
        let _frame = info_span!("frame", frame).entered();
        let commands = {
            let _record = info_span!("record").entered();
            let mut encoder = setup.device.create_command_encoder(&Default::default());
            work.record(&mut encoder, Some(&profiler), frame);
            encoder.finish()
        };
        {
            let _submit = info_span!("submit").entered();
            setup.queue.submit([commands]);
            profiler.end_frame()?;
        }
        {
            let _wait = info_span!("wait").entered();
            setup.wait()?;
        }
        std::thread::sleep(Duration::from_millis(4));
    }
    let stats = profiler.stats();
    let calibration = profiler.calibration();
    let timeline_stats = timeline.shutdown()?;
    println!(
        "wrote {path}: {} events ({} GPU scopes, {} lost, {} causality violations, {} failed calibration bursts; \
         profiler: {stats:?})",
        timeline_stats.events,
        timeline_stats.gpu_scopes,
        timeline_stats.gpu_lost_scopes,
        timeline_stats.gpu_causality_violations,
        timeline_stats.gpu_failed_calibrations,
    );
    match calibration {
        Some(c) => println!(
            "device clock vs CLOCK_MONOTONIC ({} bursts, {} samples): drift {:+.3} ppm, error bound ±{:.1} ns",
            c.stats.bursts, c.stats.samples_offered, c.stats.drift_ppm, c.stats.error_bound_ns,
        ),
        None => println!("the device clock was never calibrated (see the failed calibration bursts above)"),
    }
    println!("open it at https://ui.perfetto.dev (\"Open trace file\")");
    Ok(())
}

fn main() -> ExitCode {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "wgpu_frame.pftrace".to_owned());
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wgpu_frame: {e}");
            ExitCode::FAILURE
        }
    }
}
