//! GPU work on the CPU's timeline with wgpu-hal: a few dozen frames of buffer clears and copies recorded on a
//! hal Vulkan command encoder under nested `gpu_scope!`s inside `tracing` spans, written to a Perfetto trace.
//!
//! `cargo run --release --features wgpu --example wgpu_compute [-- path/to/trace.pftrace]`
//!
//! Runs on any Vulkan device hal exposes with `TIMESTAMP_QUERY` (Mesa's lavapipe will do). The device is opened
//! with `tickline::gpu::wgpu::open_device`, which adds a calibrated-timestamps extension and
//! `hostQueryReset` when offered. Without a Vulkan driver it says so and exits with status 1.

#[path = "support/wgpu.rs"]
mod wgpu_support;

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use tickline::gpu::wgpu::WgpuGpu;
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use wgpu_support::{HalDevice, HalWork, SIZE};

const FRAMES: u32 = 48;

fn run(path: &str) -> Result<(), Box<dyn Error>> {
    let hal = HalDevice::new()?;
    println!(
        "device: {}; hostQueryReset {}; calibration extension {:?}",
        hal.name, hal.options.host_query_reset, hal.options.calibrated_timestamps
    );
    let exporter = PerfettoExporter::create(path)?;
    let timeline = Timeline::builder().exporter(exporter).start()?;
    tracing_subscriber::registry().with(timeline.layer()).init();

    // SAFETY: the hal device and queue outlive the backend (it is dropped with `gpu` and `queue` below, before
    // `hal`); every submit goes through `WgpuGpu::submit`; scopes record into the encoder while it encodes
    // (no render passes), each recording is submitted once and waited for.
    let backend = unsafe { WgpuGpu::new(&hal.device, &hal.queue, hal.options.clone())? };
    println!("calibration: {:?}", backend.vulkan().calibration_path());
    let gpu = timeline.gpu(backend)?;
    let queue = gpu.queue("hal queue")?;
    let mut work = HalWork::new(&hal)?;

    for frame in 0..FRAMES {
        let _frame = info_span!("frame", frame).entered();
        {
            let _record = info_span!("record", bytes = 3 * SIZE).entered();
            let commands = work.begin()?;
            let _gpu_frame = tickline::gpu_scope!(queue, &commands, "gpu frame", frame = frame);
            {
                let _clear = tickline::gpu_scope!(queue, &commands, "clear", bytes = SIZE);
                work.fill();
            }
            {
                let _copy = tickline::gpu_scope!(queue, &commands, "copy");
                work.copy(false);
                let _back = tickline::gpu_scope!(queue, &commands, "copy back");
                work.copy(true);
            }
        }
        {
            let _submit = info_span!("submit and wait").entered();
            work.submit_and_wait(gpu.backend())?;
        }
        std::thread::sleep(Duration::from_millis(4));
    }
    let starved = gpu.starved_scopes();
    drop(work);
    let stats = timeline.shutdown()?;
    let calibration = gpu.calibration();
    drop(queue);
    drop(gpu);

    println!(
        "wrote {path}: {} events ({} GPU scopes, {} lost, {} causality violations, {} starved, {} failed \
         calibration bursts)",
        stats.events,
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        stats.gpu_causality_violations,
        starved,
        stats.gpu_failed_calibrations
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
        .unwrap_or_else(|| "wgpu_compute.pftrace".to_owned());
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("wgpu_compute: {e}");
            ExitCode::FAILURE
        }
    }
}
