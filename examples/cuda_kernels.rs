//! CUDA kernels and copies on two streams under `gpu_scope!`s inside `tracing` spans, on one timeline with the
//! CPU work, written to a Perfetto trace.
//!
//! ```text
//! cargo run --release --features cuda --example cuda_kernels [-- out.pftrace]
//! cargo run --release --features cupti --example cuda_kernels -- --cupti [--frames N] [out.pftrace]
//! ```
//!
//! With `--cupti` (feature `cupti`) a [`CuptiCapture`](tickline::gpu::cupti::CuptiCapture) runs beside the
//! scopes: every kernel and copy also appears, without a scope, on the CUPTI device's stream tracks. The example
//! then prints how many of its launches CUPTI brought back, and how each captured `scale` and `spin` kernel
//! lies against the manual scope around the same launch (a scope's begin and end are kernels of their own just
//! before and after it, so the captured kernel must lie inside, up to both slices' stated uncertainties). If
//! CUPTI cannot start (no libcupti, another CUPTI client), it says why and the rest of the timeline runs on.
//!
//! The kernels are PTX text loaded by the driver (`cuModuleLoadData`): no CUDA toolkit or NVRTC is needed. On a
//! machine without a CUDA driver or device the example prints one line saying so and exits with status 1.

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use cuda_support::Kernels;
use tickline::export::MemoryExporter;
use tickline::gpu::cuda::cudarc::driver::{CudaContext, DevicePtr};
use tickline::gpu::cuda::{open, CudaGpu, CudaOptions};
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[path = "support/cuda.rs"]
mod cuda_support;
#[path = "support/slices.rs"]
mod slices;

/// Frames by default (`--frames N` for another count).
const FRAMES: u32 = 32;
/// Floats per buffer (4 MiB).
const LEN: u32 = 1 << 20;

fn run(ctx: Arc<CudaContext>, path: &str, cupti: bool, frames: u32) -> Result<(), Box<dyn Error>> {
    let backend = CudaGpu::new(&ctx, CudaOptions::default())?;
    let clock = backend.clock();
    println!(
        "device: {} (compute capability {}.{}, SM clock {} MHz); timing {:?}, resolution {} ns",
        ctx.name()?,
        clock.compute_capability.0,
        clock.compute_capability.1,
        clock.sm_clock_khz / 1000,
        backend.timing(),
        clock.resolution_ns
    );
    let exporter = PerfettoExporter::create(path)?;
    let memory = MemoryExporter::default();
    let timeline = Timeline::builder()
        .exporter(exporter)
        .exporter(memory.clone())
        .start()?;
    tracing_subscriber::registry().with(timeline.layer()).init();
    let capture = if cupti { capture::start(&timeline, &ctx) } else { None };
    let gpu = timeline.gpu(backend)?;
    let kernels = Kernels::load(&ctx)?;
    let streams = [ctx.new_stream()?, ctx.new_stream()?];
    let lanes = [gpu.queue("stream 0")?, gpu.queue("stream 1")?];
    let host: Vec<f32> = (0..LEN).map(|i| i as f32).collect();

    for frame in 0..frames {
        let _frame = info_span!("frame", frame).entered();
        let mut buffers = Vec::new();
        {
            let _record = info_span!("launch").entered();
            for (index, (stream, lane)) in streams.iter().zip(&lanes).enumerate() {
                let _work = tickline::gpu_scope!(lane, stream, "gpu work", frame = frame, stream = index);
                let buffer = {
                    let _upload = tickline::gpu_scope!(lane, stream, "upload", bytes = 4 * LEN);
                    stream.clone_htod(&host)?
                };
                {
                    let _scale = tickline::gpu_scope!(lane, stream, "scale");
                    let (x, _sync) = buffer.device_ptr(stream);
                    kernels.scale(stream, x, LEN, 0.5)?;
                }
                {
                    let _spin = tickline::gpu_scope!(lane, stream, "spin");
                    kernels.spin(stream, 200_000 * (index as u64 + 1))?;
                }
                let _download = tickline::gpu_scope!(lane, stream, "download");
                let mut back = vec![0f32; 16];
                stream.memcpy_dtoh(&buffer.slice(0..16), &mut back)?;
                buffers.push((buffer, back));
            }
        }
        {
            let _wait = info_span!("synchronize").entered();
            for stream in &streams {
                stream.synchronize()?;
            }
        }
        // The kernels ran: x[i] = i * 0.5.
        for (_, back) in &buffers {
            if back.iter().enumerate().any(|(i, &v)| v != i as f32 * 0.5) {
                return Err(format!("frame {frame}: scale kernel gave {back:?}").into());
            }
        }
        drop(buffers);
        std::thread::sleep(Duration::from_millis(2));
    }
    let failed = gpu.backend().failed_writes();
    let cupti_stats = capture.map(capture::stop);
    let stats = timeline.shutdown()?;
    let calibration = gpu.calibration();
    println!(
        "wrote {path}: {} events ({} GPU scopes, {} lost, {} causality violations, {} failed timestamp launches)",
        stats.events, stats.gpu_scopes, stats.gpu_lost_scopes, stats.gpu_causality_violations, failed
    );
    if let Some(c) = calibration {
        println!(
            "device clock vs CLOCK_MONOTONIC ({} bursts, {} samples): drift {:+.3} ppm, error bound ±{:.1} ns",
            c.stats.bursts,
            c.stats.samples_offered,
            c.latest.drift_ppm(),
            c.latest.error_bound_ns()
        );
    }
    if let Some(cupti_stats) = cupti_stats {
        // Per frame and stream: the upload, `scale`, `spin` and the download.
        capture::compare(&memory.snapshot(), cupti_stats, 4 * frames as usize * 2)?;
    }
    Ok(())
}

/// The `--cupti` mode.
#[cfg(feature = "cupti")]
mod capture {
    use std::error::Error;
    use std::sync::Arc;

    use tickline::export::MemoryTrace;
    use tickline::gpu::cuda::cudarc::driver::CudaContext;
    use tickline::gpu::cupti::{CuptiCapture, CuptiOptions, CuptiStats};
    use tickline::Timeline;

    use super::slices::{queue_slices, QueueSlice};

    pub(super) fn start(timeline: &Timeline, ctx: &Arc<CudaContext>) -> Option<CuptiCapture> {
        match CuptiCapture::start(timeline, ctx, CuptiOptions::default()) {
            Ok(capture) => {
                let (library, version) = capture.library();
                println!("CUPTI {version} from {}", library.display());
                Some(capture)
            }
            Err(e) => {
                println!("CUPTI capture not running ({e}); the scopes are recorded without it");
                None
            }
        }
    }

    pub(super) fn stop(capture: CuptiCapture) -> CuptiStats {
        capture.stop()
    }

    fn percentile(sorted: &[u64], p: f64) -> u64 {
        sorted
            .get(((sorted.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Prints how many launches CUPTI brought back and how its kernels lie against the manual scopes.
    pub(super) fn compare(trace: &MemoryTrace, stats: CuptiStats, launched: usize) -> Result<(), Box<dyn Error>> {
        let all = queue_slices(trace)?;
        let (captured, manual): (Vec<&QueueSlice>, Vec<&QueueSlice>) =
            all.iter().partition(|s| s.device.ends_with("(CUPTI)"));
        println!(
            "CUPTI: {} of {launched} launches captured as slices; {stats:?}",
            captured.len()
        );
        let mut outside = Vec::new();
        let mut beyond = 0;
        let mut unmatched = 0;
        for kernel in captured.iter().filter(|s| s.name == "scale" || s.name == "spin") {
            // The manual scope of the same name whose span overlaps the kernel the most is its launch's.
            let scope = manual
                .iter()
                .filter(|m| m.name == kernel.name)
                .max_by_key(|m| m.end.min(kernel.end).saturating_sub(m.begin.max(kernel.begin)));
            let Some(scope) = scope.filter(|m| m.end >= kernel.begin && m.begin <= kernel.end) else {
                unmatched += 1;
                continue;
            };
            let out = scope
                .begin
                .saturating_sub(kernel.begin)
                .max(kernel.end.saturating_sub(scope.end));
            let uncertainty = |s: &QueueSlice| s.u64("uncertainty_ns").unwrap_or(0);
            beyond += usize::from(out > uncertainty(scope) + uncertainty(kernel));
            outside.push(out);
        }
        outside.sort_unstable();
        println!(
            "CUPTI kernels against their manual scopes: {} matched, {unmatched} unmatched; outside the scope by \
             p50/p99/max {}/{}/{} ns; {beyond} beyond both stated uncertainties",
            outside.len(),
            percentile(&outside, 0.5),
            percentile(&outside, 0.99),
            outside.last().copied().unwrap_or(0),
        );
        if captured.len() != launched || unmatched > 0 || beyond > 0 {
            return Err(format!(
                "CUPTI: {} of {launched} launches captured, {unmatched} kernels without their scope, {beyond} beyond \
                 their uncertainty",
                captured.len()
            )
            .into());
        }
        Ok(())
    }
}

/// The `--cupti` mode needs the `cupti` feature.
#[cfg(not(feature = "cupti"))]
mod capture {
    use std::error::Error;
    use std::sync::Arc;

    use tickline::export::MemoryTrace;
    use tickline::gpu::cuda::cudarc::driver::CudaContext;
    use tickline::Timeline;

    pub(super) enum Never {}

    pub(super) fn start(_: &Timeline, _: &Arc<CudaContext>) -> Option<Never> {
        println!("--cupti needs the `cupti` feature (cargo run --features cupti ...); running without it");
        None
    }

    pub(super) fn stop(never: Never) -> Never {
        never
    }

    pub(super) fn compare(_: &MemoryTrace, never: Never, _: usize) -> Result<(), Box<dyn Error>> {
        match never {}
    }
}

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let cupti = args.iter().any(|a| a == "--cupti");
    args.retain(|a| a != "--cupti");
    let mut frames = FRAMES;
    if let Some(at) = args.iter().position(|a| a == "--frames") {
        match args.get(at + 1).and_then(|n| n.parse().ok()) {
            Some(n) => frames = n,
            None => {
                eprintln!("cuda_kernels: --frames takes a number of frames");
                return ExitCode::FAILURE;
            }
        }
        args.drain(at..at + 2);
    }
    let path = args.pop().unwrap_or_else(|| "cuda_kernels.pftrace".to_owned());
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("cuda_kernels: no CUDA device to run on: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(ctx, &path, cupti, frames) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_kernels: {e}");
            ExitCode::FAILURE
        }
    }
}
