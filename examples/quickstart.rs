//! tickline in one screen: a small multi-threaded "app" recorded through `tracing` and native scopes, with a
//! render thread whose GPU work lands on the same timeline, written to a Perfetto trace.
//!
//! The GPU is tickline's simulated GPU (a device clock 40 ms off the host's, 120 ppm fast and wandering,
//! read with 1 µs jitter), so the trace shows GPU tracks on any machine; the GPU slices are placed on the CPU's
//! time axis by the same live calibration a real device gets, each with its `uncertainty_ns`. Built with
//! `--features vulkan`, it records real buffer fills and copies on the first Vulkan device with a compute
//! queue that writes timestamps instead, when there is one. It prints which GPU it used.
//!
//! `cargo run --release --example quickstart [-- path/to/trace.pftrace [path/to/run.tickline]]`
//!
//! With a second path it also writes a raw capture of the same run, for `tickline convert run.tickline -o
//! converted.pftrace` (the same trace, converted afterwards with the whole calibration history).

#[cfg(feature = "vulkan")]
#[path = "support/vulkan.rs"]
mod vulkan_support;

#[path = "support/workload.rs"]
mod workload;

use std::error::Error;
use std::time::Duration;

use tickline::gpu::sim::{SimGpu, SimGpuConfig};
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::{info, info_span};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

fn worker(id: usize, jobs: usize) {
    for job in 0..jobs {
        workload::job(id, job);
    }
}

/// Frames the render thread records.
const FRAMES: u32 = 30;

/// The Vulkan device the render thread uses, when built with the `vulkan` feature and one opens.
#[cfg(feature = "vulkan")]
type Vulkan = vulkan_support::Vulkan;
/// Without the `vulkan` feature there is never one.
#[cfg(not(feature = "vulkan"))]
enum Vulkan {}

fn open_vulkan() -> Option<Vulkan> {
    #[cfg(feature = "vulkan")]
    match vulkan_support::Vulkan::new(vulkan_support::Wants::OFFERED) {
        Ok(device) => return Some(device),
        Err(e) => println!("no Vulkan device ({e}): the GPU is simulated"),
    }
    None
}

/// The render thread: GPU frames on Vulkan when a device is open, else on the simulated GPU.
fn render(timeline: &Timeline, vulkan: Option<&Vulkan>) -> Result<(), Box<dyn Error>> {
    match vulkan {
        Some(device) => render_vulkan(timeline, device),
        None => render_simulated(timeline),
    }
}

#[cfg(not(feature = "vulkan"))]
fn render_vulkan(_: &Timeline, device: &Vulkan) -> Result<(), Box<dyn Error>> {
    match *device {}
}

/// Each frame: an upload, then a frame scope holding a fill ("shadow pass") and a copy ("lighting"), recorded
/// into one command buffer, submitted and waited for.
#[cfg(feature = "vulkan")]
fn render_vulkan(timeline: &Timeline, d: &Vulkan) -> Result<(), Box<dyn Error>> {
    use vulkan_support::{Work, SIZE};

    // SAFETY: the backend is dropped before `d`: `main` keeps the device open until the timeline (whose collector
    // holds the backend) has shut down, after the last fence wait. Every submission to the queue goes through
    // `VulkanGpu::submit`; scopes are recorded outside render passes into a command buffer of `d.family`, each
    // recording submitted once and waited for; `d.options` is what the device was created with.
    let backend = unsafe { d.backend(d.options.clone())? };
    let gpu = timeline.gpu(backend)?;
    println!("GPU: {} (Vulkan, queue family {})", d.name, d.family);
    let queue = gpu.queue("compute queue")?;
    let work = Work::new(d, SIZE)?;
    for frame in 0..FRAMES {
        let _frame_span = info_span!("render frame", frame).entered();
        work.begin()?;
        {
            let _upload = tickline::gpu_scope!(queue, &work.commands, "upload", bytes = SIZE);
            work.copy(1);
        }
        {
            let _frame = tickline::gpu_scope!(queue, &work.commands, "frame", index = frame);
            {
                let _shadows = tickline::gpu_scope!(queue, &work.commands, "shadow pass");
                work.fill(frame);
            }
            let _lighting = tickline::gpu_scope!(queue, &work.commands, "lighting");
            work.copy(0);
        }
        let _wait = info_span!("wait for GPU").entered();
        work.submit_and_wait(gpu.backend())?;
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Records each frame's GPU work under nested GPU scopes inside a `tracing` span, on a graphics queue and a
/// transfer queue that run concurrently, and waits for the frame before the next.
fn render_simulated(timeline: &Timeline) -> Result<(), Box<dyn Error>> {
    let config = SimGpuConfig {
        hardware_queues: 2,
        ..Default::default()
    };
    let gpu = timeline.gpu(SimGpu::new(config)?)?;
    println!("GPU: {} ({})", gpu.info().name, gpu.info().api);
    let graphics = gpu.queue("graphics")?;
    let transfer = gpu.queue("transfer")?;
    for frame in 0..FRAMES {
        workload::simulated_frame(gpu.backend(), &graphics, &transfer, frame);
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "quickstart.pftrace".to_owned());
    let raw_capture = std::env::args().nth(2);
    let exporter = match PerfettoExporter::create(&path) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("quickstart: cannot write the trace: {e}");
            std::process::exit(1);
        }
    };
    let mut builder = Timeline::builder().exporter(exporter);
    if let Some(raw) = &raw_capture {
        builder = builder.raw_capture(raw);
    }
    let timeline = match builder.start() {
        Ok(t) => t,
        Err(e) => {
            eprintln!("quickstart: cannot start tickline: {e}");
            std::process::exit(1);
        }
    };
    tracing_subscriber::registry().with(timeline.layer()).init();
    // Opened before the timeline's GPU device and closed at the end of `main`, after the timeline has shut down
    // and released the backend.
    let vulkan = open_vulkan();

    {
        let _app = info_span!("app", workers = 4).entered();
        info!("starting {} workers", 4);
        std::thread::scope(|s| {
            std::thread::Builder::new()
                .name("render".into())
                .spawn_scoped(s, || {
                    if let Err(e) = render(&timeline, vulkan.as_ref()) {
                        eprintln!("quickstart: no GPU timeline: {e}");
                    }
                })
                .expect("spawn render thread");
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
        "wrote {path}: {} events from {} threads ({} records, {} dropped), {} GPU scopes ({} lost, {} causality \
         violations)",
        stats.events,
        stats.threads,
        stats.records,
        stats.dropped_records,
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        stats.gpu_causality_violations
    );
    if let Some(raw) = &raw_capture {
        println!("wrote {raw}: the raw capture of the same run (`tickline convert {raw} -o converted.pftrace`)");
    }
    println!("open it at https://ui.perfetto.dev (\"Open trace file\")");
    // `vulkan` closes here, after the timeline's shutdown above released the backend.
}
