//! CUDA kernels and copies on two streams under `gpu_scope!`s inside `tracing` spans, on one timeline with the
//! CPU work, written to a Perfetto trace.
//!
//! ```text
//! cargo run --release --features cuda --example cuda_kernels [-- out.pftrace]
//! cargo run --release --features cupti --example cuda_kernels -- --cupti [out.pftrace]
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
use std::ffi::c_void;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use tickline::export::MemoryExporter;
use tickline::gpu::cuda::cudarc::driver::{result, sys, CudaContext, CudaStream, DevicePtr};
use tickline::gpu::cuda::{open, CudaGpu, CudaOptions};
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;
use tracing::info_span;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const FRAMES: u32 = 32;
/// Floats per buffer (4 MiB).
const LEN: u32 = 1 << 20;

/// `scale(x, n, a)`: `x[i] *= a` for `i < n`, one thread per element. `spin(ns)`: one thread busy for `ns`
/// nanoseconds of `%globaltimer` (stands in for a long kernel).
const KERNELS: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry scale(.param .u64 x, .param .u32 n, .param .f32 a)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [x];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [n];
    ld.param.f32 %f1, [a];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra SCALE_DONE;
    mul.wide.u32 %rd2, %r5, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.f32 %f2, [%rd3];
    mul.f32 %f3, %f2, %f1;
    st.global.f32 [%rd3], %f3;
SCALE_DONE:
    ret;
}

.visible .entry spin(.param .u64 ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
SPIN_LOOP:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra SPIN_LOOP;
    ret;
}
"#;

/// The example's kernels, loaded into the context.
struct Kernels {
    scale: sys::CUfunction,
    spin: sys::CUfunction,
}

impl Kernels {
    fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, Box<dyn Error>> {
        ctx.bind_to_thread()?;
        let ptx = std::ffi::CString::new(KERNELS)?;
        // SAFETY: a NUL-terminated PTX text that outlives the call, in the bound context. The module is never
        // unloaded (it lives as long as the process).
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }?;
        // SAFETY: the module was just loaded and is never unloaded.
        let scale = unsafe { result::module::get_function(module, c"scale".to_owned()) }?;
        // SAFETY: as above.
        let spin = unsafe { result::module::get_function(module, c"spin".to_owned()) }?;
        Ok(Kernels { scale, spin })
    }

    fn scale(&self, stream: &CudaStream, x: sys::CUdeviceptr, n: u32, a: f32) -> Result<(), Box<dyn Error>> {
        let (mut x, mut n, mut a) = (x, n, a);
        let mut params = [
            (&mut x as *mut sys::CUdeviceptr).cast::<c_void>(),
            (&mut n as *mut u32).cast::<c_void>(),
            (&mut a as *mut f32).cast::<c_void>(),
        ];
        // SAFETY: `scale` takes (f32 pointer, u32, f32), as `params` holds; `x` points to at least `n` floats of
        // a buffer allocated on `stream`, which outlives the kernel (the caller synchronises before freeing).
        unsafe {
            result::launch_kernel(
                self.scale,
                (n.div_ceil(256), 1, 1),
                (256, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }?;
        Ok(())
    }

    fn spin(&self, stream: &CudaStream, ns: u64) -> Result<(), Box<dyn Error>> {
        let mut ns = ns;
        let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
        // SAFETY: `spin` takes one u64, as `params` holds; it touches no memory.
        unsafe { result::launch_kernel(self.spin, (1, 1, 1), (1, 1, 1), 0, stream.cu_stream(), &mut params) }?;
        Ok(())
    }
}

fn run(ctx: Arc<CudaContext>, path: &str, cupti: bool) -> Result<(), Box<dyn Error>> {
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

    for frame in 0..FRAMES {
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
        capture::compare(&memory.snapshot(), cupti_stats, 4 * FRAMES as usize * 2)?;
    }
    Ok(())
}

/// The `--cupti` mode.
#[cfg(feature = "cupti")]
mod capture {
    use std::error::Error;
    use std::sync::Arc;

    use tickline::export::{EventKind, FieldValue, MemoryTrace, TrackKind};
    use tickline::gpu::cuda::cudarc::driver::CudaContext;
    use tickline::gpu::cupti::{CuptiCapture, CuptiOptions, CuptiStats};
    use tickline::Timeline;

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

    /// A GPU slice: its name, begin, end and stated uncertainty, and whether CUPTI captured it.
    struct Slice {
        name: String,
        begin: u64,
        end: u64,
        uncertainty: u64,
        captured: bool,
    }

    fn slices(trace: &MemoryTrace) -> Vec<Slice> {
        let mut open: std::collections::HashMap<_, Vec<Slice>> = std::collections::HashMap::new();
        let mut done = Vec::new();
        for e in &trace.events {
            let Some(track) = trace.track(e.track) else { continue };
            if !matches!(track.kind, TrackKind::GpuQueue { .. }) {
                continue;
            }
            let captured = track
                .parent
                .and_then(|p| trace.track(p))
                .is_some_and(|d| matches!(&d.kind, TrackKind::GpuDevice { name, .. } if name.ends_with("(CUPTI)")));
            match e.kind {
                EventKind::SliceBegin => {
                    let uncertainty = e
                        .fields
                        .iter()
                        .find_map(|(k, v)| match (k.as_str(), v) {
                            ("uncertainty_ns", FieldValue::U64(u)) => Some(*u),
                            _ => None,
                        })
                        .unwrap_or(0);
                    open.entry(e.track).or_default().push(Slice {
                        name: e.name.clone(),
                        begin: e.ts_ns,
                        end: 0,
                        uncertainty,
                        captured,
                    });
                }
                EventKind::SliceEnd => {
                    if let Some(mut s) = open.get_mut(&e.track).and_then(Vec::pop) {
                        s.end = e.ts_ns;
                        done.push(s);
                    }
                }
                _ => {}
            }
        }
        done
    }

    fn percentile(sorted: &[u64], p: f64) -> u64 {
        sorted
            .get(((sorted.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or(0)
    }

    /// Prints how many launches CUPTI brought back and how its kernels lie against the manual scopes.
    pub(super) fn compare(trace: &MemoryTrace, stats: CuptiStats, launched: usize) -> Result<(), Box<dyn Error>> {
        let all = slices(trace);
        let (captured, manual): (Vec<&Slice>, Vec<&Slice>) = all.iter().partition(|s| s.captured);
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
            beyond += usize::from(out > scope.uncertainty + kernel.uncertainty);
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
    let path = args.pop().unwrap_or_else(|| "cuda_kernels.pftrace".to_owned());
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            eprintln!("cuda_kernels: no CUDA device to run on: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(ctx, &path, cupti) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuda_kernels: {e}");
            ExitCode::FAILURE
        }
    }
}
