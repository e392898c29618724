//! How well GPU scopes land on the CPU's time axis, measured on a real NVIDIA GPU.
//!
//! ```text
//! cargo run --release --features cuda --example cuda_accuracy -- [seconds=60] [trace.pftrace]
//! ```
//!
//! Every ~5 ms the example reads `CLOCK_MONOTONIC` (t0), launches a 20 µs spin kernel under a `gpu_scope!` on an
//! idle stream, waits for the stream and reads the clock again (t1). The GPU ran the kernel inside [t0, t1], so
//! its exported slice must lie there too, up to the `uncertainty_ns` the timeline states for it. Every 10th
//! window holds 8 back-to-back scoped kernels instead (the stream is busy while most of them are recorded).
//!
//! It prints, per kind of window and in all: how many slices lie inside their window, how far the others lie
//! outside (p50/p99/max), how many lie outside by more than their stated uncertainty, the launch latency seen
//! (`lead`: slice begin − t0) and the wait after the GPU finished (`tail`: t1 − slice end), and the stated
//! uncertainty. Then the collector's calibration once a second (drift, error bound, bursts), and the device
//! clock's rate against `CLOCK_MONOTONIC` over the whole run, measured independently from the tightest of 20
//! bracketed samples taken before the run and 20 after it. With CUDA-event timing the device ticks of those
//! samples are chained through every anchor of the run, so that rate carries the anchors' rounding too.
//!
//! The last line starts with `cuda_accuracy:` and holds the key numbers. The exit status is non-zero when a
//! slice lies outside its window by more than its stated uncertainty, or a scope was lost (not exported). On a
//! machine without a CUDA driver or device it prints `SKIP: cuda_accuracy: <reason>` to stderr and exits 0.
//! Give a trace path to also write the run as a Perfetto trace.

use std::error::Error;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_support::Kernels;
use tickline::calibration::CalibrationSample;
use tickline::clock::monotonic_ns;
use tickline::export::{MemoryExporter, MemoryTrace};
use tickline::gpu::cuda::cudarc::driver::CudaContext;
use tickline::gpu::cuda::{open, CudaGpu, CudaOptions, CudaTimingInUse};
use tickline::gpu::{GpuBackend, GpuError};
use tickline::Timeline;
use tickline_perfetto::PerfettoExporter;

#[path = "support/cuda.rs"]
mod cuda_support;
#[path = "support/slices.rs"]
mod slices;

/// Time from one window's start to the next's.
const PERIOD: Duration = Duration::from_millis(5);
/// How long each spin kernel runs.
const SPIN_NS: u64 = 20_000;
/// Every `BUSY_EVERY`-th window launches `BUSY_KERNELS` scoped kernels back to back.
const BUSY_EVERY: u64 = 10;
const BUSY_KERNELS: u64 = 8;
/// Bracketed samples taken before and after the run for the independent rate.
const RATE_SAMPLES: usize = 20;
const RATE_BUDGET: Duration = Duration::from_millis(50);
/// The calibration's first seconds, left out of the drift's range (the fit is still settling).
const SETTLE_S: f64 = 2.0;

struct Args {
    seconds: f64,
    trace: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let seconds = match args.next() {
        None => 60.0,
        Some(s) => match s.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => v,
            _ => return Err(format!("seconds must be a positive number, not {s:?}")),
        },
    };
    let trace = args.next();
    if let Some(extra) = args.next() {
        return Err(format!("unexpected argument {extra:?}"));
    }
    Ok(Args { seconds, trace })
}

/// A GPU slice of the exported trace: its window index, its index in a busy window, and its placement.
struct Slice {
    i: u64,
    sub: Option<u64>,
    begin: u64,
    end: u64,
    uncertainty: u64,
}

/// The slices on the GPU queue tracks (every lane) of `trace`.
fn gpu_slices(trace: &MemoryTrace) -> Result<Vec<Slice>, String> {
    slices::queue_slices(trace)?
        .into_iter()
        .map(|s| match (s.u64("i"), s.u64("uncertainty_ns")) {
            (Some(i), Some(uncertainty)) => Ok(Slice {
                i,
                sub: s.u64("sub"),
                begin: s.begin,
                end: s.end,
                uncertainty,
            }),
            _ => Err(format!(
                "GPU slice {:?} at {} ns lacks `i` or `uncertainty_ns`",
                s.name, s.begin
            )),
        })
        .collect()
}

/// `sorted[p]`, nearest rank.
fn percentile<T: Copy>(sorted: &[T], p: f64) -> T {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// One slice against its window [t0, t1].
struct Placement {
    /// ns the slice lies outside the window (0 inside).
    outside: u64,
    /// begin − t0: launch latency (negative: begins before the window).
    lead: i64,
    /// t1 − end: from the GPU's end to the host seeing it (negative: ends after the window).
    tail: i64,
    /// The stated `uncertainty_ns`.
    uncertainty: u64,
}

impl Placement {
    fn new(s: &Slice, (t0, t1): (u64, u64)) -> Placement {
        Placement {
            outside: t0.saturating_sub(s.begin).max(s.end.saturating_sub(t1)),
            lead: s.begin as i64 - t0 as i64,
            tail: t1 as i64 - s.end as i64,
            uncertainty: s.uncertainty,
        }
    }

    fn beyond_uncertainty(&self) -> bool {
        self.outside > self.uncertainty
    }
}

/// Placement figures of a set of slices.
struct Summary {
    slices: usize,
    inside: usize,
    beyond: usize,
    outside: [u64; 3],
    /// min, p50, p99: the smallest lead and tail bound the calibration's bias (the truth of both is >= 0).
    lead: [i64; 3],
    tail: [i64; 3],
    uncertainty: [u64; 2],
}

impl Summary {
    fn of<'a>(placements: impl Iterator<Item = &'a Placement>) -> Option<Summary> {
        let placements: Vec<&Placement> = placements.collect();
        if placements.is_empty() {
            return None;
        }
        let sorted_u = |f: fn(&Placement) -> u64| {
            let mut v: Vec<u64> = placements.iter().map(|p| f(p)).collect();
            v.sort_unstable();
            v
        };
        let sorted_i = |f: fn(&Placement) -> i64| {
            let mut v: Vec<i64> = placements.iter().map(|p| f(p)).collect();
            v.sort_unstable();
            v
        };
        let (outside, lead, tail) = (sorted_u(|p| p.outside), sorted_i(|p| p.lead), sorted_i(|p| p.tail));
        let uncertainty = sorted_u(|p| p.uncertainty);
        Some(Summary {
            slices: placements.len(),
            inside: placements.iter().filter(|p| p.outside == 0).count(),
            beyond: placements.iter().filter(|p| p.beyond_uncertainty()).count(),
            outside: [
                percentile(&outside, 0.5),
                percentile(&outside, 0.99),
                outside[outside.len() - 1],
            ],
            lead: [lead[0], percentile(&lead, 0.5), percentile(&lead, 0.99)],
            tail: [tail[0], percentile(&tail, 0.5), percentile(&tail, 0.99)],
            uncertainty: [percentile(&uncertainty, 0.5), percentile(&uncertainty, 0.99)],
        })
    }

    fn print(&self, label: &str) {
        println!(
            "{label}: {} slices, {} inside their window; outside by p50/p99/max {}/{}/{} ns, {} beyond their stated \
             uncertainty; lead min/p50/p99 {}/{}/{} ns; tail min/p50/p99 {}/{}/{} ns; stated uncertainty p50/p99 {}/{} ns",
            self.slices,
            self.inside,
            self.outside[0],
            self.outside[1],
            self.outside[2],
            self.beyond,
            self.lead[0],
            self.lead[1],
            self.lead[2],
            self.tail[0],
            self.tail[1],
            self.tail[2],
            self.uncertainty[0],
            self.uncertainty[1],
        );
    }
}

/// The collector's calibration as read once a second.
struct CalibrationPoint {
    elapsed_s: f64,
    drift_ppm: f64,
    error_bound_ns: f64,
    bursts: u64,
}

/// The sample with the narrowest bracket.
fn tightest(samples: &[CalibrationSample]) -> Option<CalibrationSample> {
    samples.iter().copied().min_by_key(|s| s.max_deviation_ns)
}

/// The device clock's rate against `CLOCK_MONOTONIC` between two samples, in ppm (positive: the device runs
/// fast), and its uncertainty: both brackets' half-widths plus the timer's resolution (half of it per read).
fn rate_ppm(a: &CalibrationSample, b: &CalibrationSample, ns_per_tick: f64, resolution_ns: u64) -> (f64, f64) {
    let host = b.reference_ns as f64 - a.reference_ns as f64;
    let device = b.source_ticks.wrapping_sub(a.source_ticks) as f64 * ns_per_tick;
    let slack = (a.max_deviation_ns + b.max_deviation_ns + resolution_ns) as f64;
    ((device - host) / host * 1e6, slack / host * 1e6)
}

/// Runs the measurement; `Ok(true)` when every check passed.
fn run(ctx: Arc<CudaContext>, args: &Args) -> Result<bool, Box<dyn Error>> {
    let backend = CudaGpu::new(&ctx, CudaOptions::default()).map_err(|e| format!("CudaGpu::new: {e}"))?;
    let info = backend.info();
    let clock = backend.clock();
    println!("device: {} ({})", info.name, info.api);
    println!("timing: {:?}", backend.timing());
    let timing = match backend.timing() {
        CudaTimingInUse::GlobalTimer => "%globaltimer",
        CudaTimingInUse::Events { .. } => "CUDA events",
    };
    println!(
        "clock: resolution {} ns, SM clock {} MHz, compute capability {}.{} ({clock:?})",
        clock.resolution_ns,
        clock.sm_clock_khz / 1000,
        clock.compute_capability.0,
        clock.compute_capability.1
    );

    // The independent rate's first end, before the backend moves into the timeline.
    let mut first_samples = Vec::new();
    backend
        .calibrate(RATE_SAMPLES, RATE_BUDGET, &mut first_samples)
        .map_err(|e| format!("calibrating before the run: {e}"))?;
    let first = tightest(&first_samples);

    let memory = MemoryExporter::default();
    let mut builder = Timeline::builder().exporter(memory.clone());
    if let Some(path) = &args.trace {
        builder = builder.exporter(PerfettoExporter::create(path)?);
    }
    let timeline = builder.start()?;
    let gpu = timeline.gpu(backend)?;
    let lane = gpu.queue("stream")?;
    let stream = ctx.new_stream().map_err(|e| format!("creating a stream: {e}"))?;
    let kernels = Kernels::load(&ctx)?;
    // One unscoped launch first, so lazy module loading falls outside every window.
    kernels.spin(&stream, SPIN_NS)?;
    stream.synchronize().map_err(|e| format!("warm-up synchronize: {e}"))?;

    let duration = Duration::from_secs_f64(args.seconds);
    let mut windows: Vec<(u64, u64)> = Vec::new();
    let mut series: Vec<CalibrationPoint> = Vec::new();
    let mut scopes = 0u64;
    let started = Instant::now();
    let mut next_window = started;
    let mut next_report = started + Duration::from_secs(1);
    while started.elapsed() < duration {
        let i = windows.len() as u64;
        let t0 = monotonic_ns().0;
        if i % BUSY_EVERY == BUSY_EVERY - 1 {
            for sub in 0..BUSY_KERNELS {
                let _scope = tickline::gpu_scope!(lane, &stream, "spin (busy)", i = i, sub = sub);
                kernels.spin(&stream, SPIN_NS)?;
            }
            scopes += BUSY_KERNELS;
        } else {
            let _scope = tickline::gpu_scope!(lane, &stream, "spin", i = i);
            kernels.spin(&stream, SPIN_NS)?;
            scopes += 1;
        }
        stream
            .synchronize()
            .map_err(|e| format!("synchronize (window {i}): {e}"))?;
        let t1 = monotonic_ns().0;
        windows.push((t0, t1));

        let now = Instant::now();
        if now >= next_report {
            next_report += Duration::from_secs(1);
            if let Some(report) = gpu.calibration() {
                series.push(CalibrationPoint {
                    elapsed_s: (now - started).as_secs_f64(),
                    drift_ppm: report.latest.drift_ppm(),
                    error_bound_ns: report.latest.error_bound_ns(),
                    bursts: report.stats.bursts,
                });
            }
        }
        next_window += PERIOD;
        match next_window.checked_duration_since(Instant::now()) {
            Some(wait) => std::thread::sleep(wait),
            None => next_window = Instant::now(), // fell behind: no catch-up burst
        }
    }
    let run_s = started.elapsed().as_secs_f64();

    let failed_writes = gpu.backend().failed_writes();
    let starved = gpu.starved_scopes();
    let stats = timeline.shutdown()?;
    // The collector is gone: the backend's private stream is ours alone again.
    let mut last_samples = Vec::new();
    gpu.backend()
        .calibrate(RATE_SAMPLES, RATE_BUDGET, &mut last_samples)
        .map_err(|e| format!("calibrating after the run: {e}"))?;
    let last = tightest(&last_samples);

    println!(
        "{} windows in {run_s:.1} s, {scopes} scopes recorded; timeline: {} GPU scopes, {} lost, {} causality \
         violations; {failed_writes} failed timestamp launches, {starved} scopes without a free timestamp pair",
        windows.len(),
        stats.gpu_scopes,
        stats.gpu_lost_scopes,
        stats.gpu_causality_violations,
    );

    let slices = gpu_slices(&memory.snapshot())?;
    let mut placements = Vec::with_capacity(slices.len());
    let mut kinds = Vec::with_capacity(slices.len());
    let mut unmatched = 0usize;
    for s in &slices {
        match windows.get(s.i as usize) {
            Some(&window) => {
                placements.push(Placement::new(s, window));
                kinds.push(s.sub.is_some());
            }
            None => unmatched += 1,
        }
    }
    let all = Summary::of(placements.iter());
    if let Some(all) = &all {
        all.print("all");
    }
    let kind = |busy: bool| {
        placements
            .iter()
            .zip(&kinds)
            .filter(move |(_, &b)| b == busy)
            .map(|(p, _)| p)
    };
    if let Some(idle) = Summary::of(kind(false)) {
        idle.print("idle stream");
    }
    if let Some(busy) = Summary::of(kind(true)) {
        busy.print("busy stream");
    }
    if unmatched > 0 {
        println!("{unmatched} slices name a window that was never opened");
    }

    println!("collector calibration, once a second:");
    for p in &series {
        println!(
            "  {:7.1} s  drift {:+10.4} ppm  error bound {:9.1} ns  bursts {}",
            p.elapsed_s, p.drift_ppm, p.error_bound_ns, p.bursts
        );
    }
    let settled: Vec<f64> = series
        .iter()
        .filter(|p| p.elapsed_s >= SETTLE_S)
        .map(|p| p.drift_ppm)
        .collect();
    let drift_range = settled.iter().fold(None, |r: Option<(f64, f64)>, &d| {
        Some(r.map_or((d, d), |(lo, hi)| (lo.min(d), hi.max(d))))
    });
    match (series.first(), series.last()) {
        (Some(a), Some(b)) => println!(
            "drift over the run: first {:+.4} ppm, last {:+.4} ppm, change {:+.4} ppm; after {SETTLE_S} s: {}",
            a.drift_ppm,
            b.drift_ppm,
            b.drift_ppm - a.drift_ppm,
            match drift_range {
                Some((lo, hi)) => format!("min {lo:+.4} ppm, max {hi:+.4} ppm, spread {:.4} ppm", hi - lo),
                None => "no reading".to_owned(),
            }
        ),
        _ => println!("drift over the run: the collector published no calibration"),
    }

    let rate = match (first, last) {
        (Some(a), Some(b)) => {
            let (ppm, pm) = rate_ppm(&a, &b, info.clock.nominal_ns_per_tick(), clock.resolution_ns);
            println!(
                "device clock rate against CLOCK_MONOTONIC over {:.1} s (tightest of {} and {} bracketed samples, \
                 ±{} ns and ±{} ns): {ppm:+.4} ± {pm:.4} ppm; the collector's last drift {}",
                (b.reference_ns as f64 - a.reference_ns as f64) / 1e9,
                first_samples.len(),
                last_samples.len(),
                a.max_deviation_ns,
                b.max_deviation_ns,
                series
                    .last()
                    .map_or("n/a".to_owned(), |p| format!("{:+.4} ppm", p.drift_ppm)),
            );
            Some((ppm, pm))
        }
        _ => {
            println!(
                "device clock rate against CLOCK_MONOTONIC: no sample ({} before the run, {} after)",
                first_samples.len(),
                last_samples.len()
            );
            None
        }
    };

    // Verdict: every scope exported, and none outside its window by more than it says.
    let beyond = all.as_ref().map_or(0, |a| a.beyond);
    let missing = scopes.saturating_sub(placements.len() as u64);
    let mut failures = Vec::new();
    if beyond > 0 {
        failures.push(format!(
            "{beyond} slices outside their window by more than their stated uncertainty"
        ));
    }
    if stats.gpu_lost_scopes > 0 || missing > 0 || unmatched > 0 {
        failures.push(format!(
            "{} lost, {missing} of {scopes} scopes missing, {unmatched} unmatched",
            stats.gpu_lost_scopes
        ));
    }
    let verdict = if failures.is_empty() {
        "PASS".to_owned()
    } else {
        format!("FAIL ({})", failures.join("; "))
    };
    let (inside, outside) = all.as_ref().map_or((0, [0; 3]), |a| (a.inside, a.outside));
    let uncertainty = all.as_ref().map_or([0; 2], |a| a.uncertainty);
    println!(
        "cuda_accuracy: {} ({}), {run_s:.0} s: {}/{scopes} slices, {inside} inside, outside p50/p99/max \
         {}/{}/{} ns, {beyond} beyond uncertainty (p50/p99 {}/{} ns), {} lost, {} causality violations, drift \
         after {SETTLE_S} s {}, rate {}: {verdict}",
        info.name,
        timing,
        placements.len(),
        outside[0],
        outside[1],
        outside[2],
        uncertainty[0],
        uncertainty[1],
        stats.gpu_lost_scopes,
        stats.gpu_causality_violations,
        drift_range.map_or("n/a".to_owned(), |(lo, hi)| format!("{lo:+.3}..{hi:+.3} ppm")),
        rate.map_or("n/a".to_owned(), |(ppm, pm)| format!("{ppm:+.3} ± {pm:.3} ppm")),
    );
    Ok(failures.is_empty())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(e) => {
            eprintln!("cuda_accuracy: {e}\nusage: cuda_accuracy [seconds=60] [trace.pftrace]");
            return ExitCode::from(2);
        }
    };
    let ctx = match open(0) {
        Ok(ctx) => ctx,
        Err(e @ (GpuError::NoLoader { .. } | GpuError::NoDevice { .. })) => {
            eprintln!("SKIP: cuda_accuracy: {e}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("cuda_accuracy: cannot open CUDA device 0: {e}");
            return ExitCode::FAILURE;
        }
    };
    match run(ctx, &args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cuda_accuracy: {e}");
            ExitCode::FAILURE
        }
    }
}
