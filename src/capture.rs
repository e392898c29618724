//! Raw capture files (`.tickline`): the cheapest recording, converted later.
//!
//! A timeline started with [`TimelineBuilder::raw_capture`](crate::TimelineBuilder::raw_capture) writes the
//! records it drains, as they are, with the calibration samples of every clock and the tables that name
//! threads and call sites; without exporters it converts nothing while the program runs.
//! [`convert`] turns the file into a timeline afterwards, through the same processing the live path uses,
//! with one difference: the CPU clock's whole calibration history is known, so every CPU timestamp is
//! placed between calibration points on both sides. `tickline convert run.tickline -o run.pftrace` does
//! this from the command line.
//!
//! The format is versioned and documented in the source (`collector/capture.rs`). A file cut at any byte
//! (a killed process) converts up to its last whole frame, and a corrupt one up to the corruption.
//!
//! ```
//! # let dir = std::env::temp_dir().join(format!("tickline-capture-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("run.tickline");
//! let timeline = tickline::Timeline::builder().raw_capture(&path).start().unwrap();
//! {
//!     let _s = tickline::scope!("work");
//! }
//! timeline.shutdown().unwrap();
//!
//! let memory = tickline::export::MemoryExporter::default();
//! let summary = tickline::capture::convert(&path, memory.clone()).unwrap();
//! assert!(summary.complete);
//! assert_eq!(memory.snapshot().slice_count("work"), 1);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```

use std::path::Path;
use std::sync::Arc;

use crate::calibration::CalibrationHistory;
use crate::clock::TscCalibratorConfig;
use crate::collector::capture::{open, Frame};
use crate::collector::input::{GpuInput, Input};
use crate::collector::output::Output;
use crate::collector::stats::SharedStats;
use crate::collector::{CpuTime, Processor};
use crate::export::{Batch, EventKind, ExportError, Exporter, RecordingOrigin};
use crate::gpu::GpuCalibrationConfig;
use crate::sync::TraceUuid;
use crate::TimelineStats;

pub use crate::collector::capture::CaptureError;

/// What a raw capture holds, and what converting it gave.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct CaptureSummary {
    /// The recording process's id and name.
    pub pid: u32,
    /// The recording process's name.
    pub process_name: String,
    /// The CPU tick source the records were taken with (`"Tsc"`, `"ArmVirtualCounter"`, `"Monotonic"`).
    pub tick_source: String,
    /// Threads that recorded.
    pub threads: u64,
    /// Call sites registered.
    pub callsites: u64,
    /// Records of the program's in the file: the markers a ring puts where it dropped records are not
    /// counted, so `records + dropped_records` is what the program made (as in [`TimelineStats`]; a capture
    /// cut short holds fewer).
    pub records: u64,
    /// Records the rings dropped while recording (drop mode, ring full).
    pub dropped_records: u64,
    /// Slices the rings dropped whole while recording (their records are among `dropped_records`; see
    /// [`TimelineStats::dropped_slices`]). Captures written before this count was recorded read 0.
    pub dropped_slices: u64,
    /// CPU calibration bursts, and the CPU clock's drift and error bound over the whole capture.
    pub cpu_calibration_bursts: u64,
    /// The CPU clock's rate error against CLOCK_MONOTONIC over the whole capture, in ppm.
    pub cpu_drift_ppm: f64,
    /// The final CPU fit's error bound, in ns.
    pub cpu_error_bound_ns: f64,
    /// What the process's tick-source decision said about the CPU clock (the last note in the capture):
    /// `(fell back to CLOCK_MONOTONIC, the TSC is in doubt, the decision in words)`.
    pub cpu_clock_note: Option<(bool, bool, String)>,
    /// GPU devices, and their calibration bursts.
    pub gpu_devices: u64,
    /// GPU calibration bursts in all.
    pub gpu_calibration_bursts: u64,
    /// Each GPU device's clock over the whole capture, in the order the devices were added.
    pub gpu_clocks: Vec<CaptureGpuClock>,
    /// Whether the capture ended cleanly (its writer finished it). A capture cut short still converts up to
    /// its last whole frame.
    pub complete: bool,
    /// Why reading stopped early, if it did (cut or corrupt).
    pub stopped_early: Option<String>,
    /// Slices and events the conversion produced.
    pub slices: u64,
    /// Instant events the conversion produced, the facts about tracks (such as the CPU clock decision) that
    /// exporters show as instants included: a Perfetto file of the conversion holds these and the
    /// exporter's own (its identity, clock snapshots, exchange rounds and its end marker; see [`TimelineStats::events`]).
    pub instants: u64,
    /// The conversion's counters (truncated slices, unknown spans...).
    pub stats: TimelineStats,
}

/// One GPU device's clock in a capture: its calibration over the whole recording.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct CaptureGpuClock {
    /// The device's name, as its driver reported it.
    pub name: String,
    /// The API ("Vulkan", "CUDA", "simulated"...).
    pub api: String,
    /// Calibration bursts taken (failed ones included).
    pub bursts: u64,
    /// The device clock's rate error against CLOCK_MONOTONIC, in ppm (`NaN` when never calibrated).
    pub drift_ppm: f64,
    /// The last fit's error bound, in ns (`NaN` when never calibrated).
    pub error_bound_ns: f64,
}

/// Whether `first_bytes` (a file's first 8 bytes or more) start a raw capture rather than, say, a Perfetto
/// trace.
///
/// ```
/// assert!(tickline::capture::is_capture(b"TICKLINE\0\0\0\0\x01\0\0\0"));
/// assert!(!tickline::capture::is_capture(b"\x0a\x10"));
/// ```
pub fn is_capture(first_bytes: &[u8]) -> bool {
    first_bytes.starts_with(b"TICKLINE")
}

/// Converts the raw capture at `path` into `exporter` (a Perfetto file, memory...) and returns what it held.
pub fn convert(path: impl AsRef<Path>, exporter: impl Exporter + 'static) -> Result<CaptureSummary, CaptureError> {
    run(path.as_ref(), Box::new(exporter))
}

/// Reads and converts the raw capture at `path` without keeping the result: what it holds and its counts.
pub fn summarize(path: impl AsRef<Path>) -> Result<CaptureSummary, CaptureError> {
    run(path.as_ref(), Box::new(Discard))
}

/// An exporter that keeps nothing.
struct Discard;

impl Exporter for Discard {
    fn export(&mut self, _: &Batch) -> Result<(), ExportError> {
        Ok(())
    }
    fn flush(&mut self) -> Result<(), ExportError> {
        Ok(())
    }
}

/// Counts slices and instants on their way to the real exporter.
struct Counting {
    inner: Box<dyn Exporter>,
    counts: Arc<std::sync::Mutex<(u64, u64)>>,
}

impl Exporter for Counting {
    fn origin(&mut self, origin: &RecordingOrigin) {
        self.inner.origin(origin);
    }
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        let slices = batch.events.iter().filter(|e| e.kind == EventKind::SliceBegin).count() as u64;
        let instants =
            (batch.events.iter().filter(|e| e.kind == EventKind::Instant).count() + batch.metadata.len()) as u64;
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        counts.0 += slices;
        counts.1 += instants;
        drop(counts);
        self.inner.export(batch)
    }
    fn flush(&mut self) -> Result<(), ExportError> {
        self.inner.flush()
    }
    fn finish(&mut self) -> Result<(), ExportError> {
        self.inner.finish()
    }
}

fn run(path: &Path, exporter: Box<dyn Exporter>) -> Result<CaptureSummary, CaptureError> {
    let mut summary = CaptureSummary::default();
    // First pass: the header and the CPU clock's whole history.
    let mut reader = open(path)?;
    let Some(Frame::Header(header)) = reader.next() else {
        return Err(CaptureError::Format {
            detail: "the capture has no process frame".into(),
        });
    };
    let mut cpu = CalibrationHistory::new(header.cpu_domain, TscCalibratorConfig::default().history);
    let mut gpus: Vec<(u16, CalibrationHistory)> = Vec::new();
    // A capture without a host frame (none is written before it) is taken to come from this machine.
    let mut host = None;
    let mut clocks = Vec::new();
    let mut clock_sync = Vec::new();
    for frame in reader.by_ref() {
        match frame {
            Frame::Host(h) => host = Some(h),
            Frame::HostClocks(readings, sync) => {
                clocks.push(readings);
                clock_sync.push(sync);
            }
            Frame::Input(Input::CpuCalibration(samples)) => {
                summary.cpu_calibration_bursts += 1;
                let _ = cpu.add_burst(&samples);
            }
            Frame::Input(Input::Thread { .. }) => summary.threads += 1,
            Frame::Input(Input::Callsite(_)) => summary.callsites += 1,
            Frame::Input(Input::CpuClockNote { fallback, doubt, text }) => {
                summary.cpu_clock_note = Some((fallback, doubt, text));
            }
            Frame::Input(Input::Gpu(GpuInput::Device { device, info, .. })) => {
                summary.gpu_devices += 1;
                gpus.push((
                    device,
                    CalibrationHistory::new(info.clock, GpuCalibrationConfig::default().history),
                ));
                summary.gpu_clocks.push(CaptureGpuClock {
                    name: info.name,
                    api: info.api.to_string(),
                    drift_ppm: f64::NAN,
                    error_bound_ns: f64::NAN,
                    ..CaptureGpuClock::default()
                });
            }
            Frame::Input(Input::Gpu(GpuInput::Calibration { device, samples, .. })) => {
                summary.gpu_calibration_bursts += 1;
                if let Some(k) = gpus.iter().position(|(d, _)| *d == device) {
                    summary.gpu_clocks[k].bursts += 1;
                    let _ = gpus[k].1.add_burst(&samples);
                }
            }
            Frame::End => summary.complete = true,
            _ => {}
        }
    }
    summary.stopped_early = reader.stopped().map(str::to_owned);
    summary.pid = header.pid;
    summary.process_name = header.process_name.clone();
    summary.tick_source = format!("{:?}", header.source);
    if let Some(fit) = cpu.latest() {
        summary.cpu_drift_ppm = fit.drift_ppm();
        summary.cpu_error_bound_ns = fit.error_bound_ns();
    }
    for (k, (_, history)) in gpus.iter().enumerate() {
        if let Some(fit) = history.latest() {
            summary.gpu_clocks[k].drift_ppm = fit.drift_ppm();
            summary.gpu_clocks[k].error_bound_ns = fit.error_bound_ns();
        }
    }

    // Second pass: the same processing as live.
    let counts = Arc::new(std::sync::Mutex::new((0, 0)));
    let counting = Counting {
        inner: exporter,
        counts: counts.clone(),
    };
    let stats = Arc::new(SharedStats::default());
    let host = host.unwrap_or_else(|| crate::HostInfo::current().clone());
    // A capture from before recordings had ids: one derived from who recorded it and when, so that converting
    // it twice still gives the same trace.
    let recording = header.recording.unwrap_or_else(|| {
        let first = clocks.first().copied().unwrap_or_default();
        TraceUuid::derived_from(&[
            host.machine_id.0,
            u64::from(header.pid),
            first.boottime_ns,
            first.realtime_ns,
        ])
    });
    let origin = RecordingOrigin {
        host,
        pid: header.pid,
        process_name: header.process_name.clone(),
        clocks,
        clock_sync,
        replay: true,
        recording,
        finished: summary.complete && summary.stopped_early.is_none(),
    };
    let out = Output::new(&origin, vec![Box::new(counting)]);
    let mut processor = Processor::new(out, GpuCalibrationConfig::default(), None, stats.clone());
    processor.set_cpu_clock(CpuTime::Complete { history: cpu });
    let mut records = 0u64;
    let mut dropped = std::collections::HashMap::new();
    let mut slices_dropped = std::collections::HashMap::new();
    for frame in open(path)? {
        match frame {
            Frame::Input(input) => {
                if let Input::Chunk(chunk) = &input {
                    records += chunk.records.len() as u64;
                    dropped.insert(chunk.ring, chunk.dropped_total);
                }
                processor.input(input);
            }
            Frame::SlicesDropped { ring, total } => {
                slices_dropped.insert(ring, total);
            }
            _ => {}
        }
    }
    let (tx, rx) = crossbeam_channel::bounded(1);
    processor.input(Input::Shutdown(tx));
    let result = rx.recv().unwrap_or(Ok(()));
    summary.dropped_records = dropped.values().sum();
    summary.dropped_slices = slices_dropped.values().sum();
    // As live, the snapshot leaves out the markers the rings put where they dropped records.
    stats.records.store(records, std::sync::atomic::Ordering::Relaxed);
    let mut s = stats.snapshot();
    summary.records = s.records;
    s.dropped_records = summary.dropped_records;
    s.dropped_slices = summary.dropped_slices;
    s.threads = summary.threads;
    summary.stats = s;
    let (slices, instants) = *counts.lock().unwrap_or_else(|e| e.into_inner());
    summary.slices = slices;
    summary.instants = instants;
    if let Err(message) = result {
        // The exporter's own error, as it was (an I/O error keeps its kind).
        let error = stats
            .first_export_error()
            .map_or(ExportError::Other(message), |first| first.to_export_error());
        return Err(CaptureError::Export(error));
    }
    Ok(summary)
}
