//! GPU work on the CPU's timeline with Vulkan: a few dozen frames of buffer fills and copies recorded under
//! nested `gpu_scope!`s inside `tracing` spans, written to a Perfetto trace.
//!
//! `cargo run --release --features vulkan --example vulkan_compute [-- path/to/trace.pftrace]`
//!
//! Runs on any Vulkan device with a compute queue that writes timestamps (Mesa's lavapipe will do:
//! `apt-get install mesa-vulkan-drivers libvulkan1`). It enables `hostQueryReset` and a calibrated-timestamps
//! extension when the device offers them, and prints the device clock's calibration at the end. Without a
//! Vulkan driver it says so and exits with status 1.

#[path = "support/vulkan.rs"]
mod vulkan_support;

use std::error::Error;
use std::process::ExitCode;
use std::time::Duration;

use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use vulkan_support::{Vulkan, Wants, Work, SIZE};

const FRAMES: u32 = 48;

fn run(path: &str) -> Result<(), Box<dyn Error>> {
    let d = Vulkan::new(Wants::OFFERED)?;
    println!(
        "device: {} (queue family {}); hostQueryReset {}; calibration extension {:?}",
        d.name, d.family, d.options.host_query_reset, d.options.calibrated_timestamps
    );
    let exporter = PerfettoExporter::create(path)?;
    let timeline = Timeline::builder().exporter(exporter).start()?;
    tracing_subscriber::registry().with(timeline.layer()).init();

    // SAFETY: the backend is dropped (with `gpu` and `queue` below) before `d`, after the last fence wait; every
    // submission to the queue goes through `VulkanGpu::submit`; scopes are recorded outside render passes into a
    // command buffer of `d.family`, each recording submitted once and waited for; `d.options` is what the device
    // was created with.
    let backend = unsafe { d.backend(d.options.clone())? };
    println!("calibration: {:?}", backend.calibration_path());
    let gpu = timeline.gpu(backend)?;
    let queue = gpu.queue("compute")?;
    let work = Work::new(&d, SIZE)?;

    for frame in 0..FRAMES {
        let _frame = info_span!("frame", frame).entered();
        {
            let _record = info_span!("record", bytes = 3 * SIZE).entered();
            work.begin()?;
            let _gpu_frame = tickline::gpu_scope!(queue, &work.commands, "gpu frame", frame = frame);
            {
                let _fill = tickline::gpu_scope!(queue, &work.commands, "fill", bytes = SIZE);
                work.fill(frame);
            }
            {
                let _copy = tickline::gpu_scope!(queue, &work.commands, "copy");
                work.copy(0);
                let _back = tickline::gpu_scope!(queue, &work.commands, "copy back");
                work.copy(1);
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
    // The collector's own calibration of the device clock, as of its last burst (the shutdown takes one).
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
            "device clock vs CLOCK_MONOTONIC ({} bursts, {} samples): drift {:+.3} ppm, error bound ±{:.1} ns, \
             max deviation of the samples used {} ns",
            c.stats.bursts,
            c.stats.samples_offered,
            c.stats.drift_ppm,
            c.stats.error_bound_ns,
            c.stats.max_deviation_ns
        ),
        None => println!("the device clock was never calibrated (see the failed calibration bursts above)"),
    }
    println!("open it at https://ui.perfetto.dev (\"Open trace file\")");
    Ok(())
}

fn main() -> ExitCode {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "vulkan_compute.pftrace".to_owned());
    match run(&path) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vulkan_compute: {e}");
            ExitCode::FAILURE
        }
    }
}
