//! Raw capture: the collector's input log written to a `.tickline` file as it is drained, and read back to
//! be converted later with the whole calibration history.
//!
//! # Format (version 5)
//!
//! A file is the 16-byte magic `TICKLINE` + `\0\0\0\0` + version (`u32` little-endian, 4), then *frames*
//! until the end of the file:
//!
//! ```text
//! frame := type: u8 | length: u32 LE | payload: length bytes | check: u64 LE
//! ```
//!
//! The check folds three parts, the type byte, the 4 length bytes and the payload, with the step
//! `fold(h, w) = rotl((h ^ w) * 0x9e3779b97f4a7c15, 29)` (wrapping multiplication) into four lanes that start
//! as `0x6a09e667f3bcc908`, `0xbb67ae8584caa73b`, `0x3c6ef372fe94f82b`, `0xa54ff53a5f1d36f1`. Each part is
//! dealt out from lane 0: its `k`-th whole 8-byte little-endian word `w` as `lane[k % 4] = fold(lane[k % 4],
//! w)`, then its last 0 to 7 bytes, zero-padded to a word `w`, as the next step with `w ^ (count << 59)`.
//! The check is `fold(fold(fold(lane[0], lane[1]), lane[2]), lane[3])`. (Version 1, still read, folds every
//! word into lane 0 alone and is lane 0: one dependent multiply per word, a quarter of the speed.)
//!
//! Version 3 is version 2 whose records may carry a span close's `VALUES_FINAL` bit (see [`crate::codec`]),
//! which a version-2 reader would count as a framing error: a reader of version 2 refuses version 3 by its
//! number instead. Versions 1 and 2 still read (their closes never carry it). Version 4 is version 3 whose
//! span closes may carry the `MAY_BE_TASK` bit, refused by a version-3 reader the same way; versions 1 to 3
//! still read. Version 5 is version 4 whose native scope begins and ends carry a tag (`aux`), refused by a
//! version-4 reader the same way; versions 1 to 4 (untagged scopes, matched by callsite alone) still read.
//!
//! Integers are little-endian, strings are `u16` length + UTF-8 bytes, samples are
//! `(source ticks u64, reference ns u64, max deviation ns u64)`. Frame types and payloads:
//!
//! | type | frame | payload |
//! |---|---|---|
//! | 1 | process | pid u32, name str, tick source u8 (0 TSC, 1 ARM counter, 2 CLOCK_MONOTONIC), CPU clock valid bits u32, nominal ns per tick f64, recording id u128 (the timeline's [`RecordingOrigin::recording`](crate::export::RecordingOrigin::recording); absent in older captures, whose readers ignore it) |
//! | 2 | thread | ring u32, tid u32, name str |
//! | 3 | callsite | key u64, kind u8 (0 span, 1 event, 2 native), level u8, line u32, name str, target str, file str, field count u16, field names str... |
//! | 4 | chunk | ring u32, now ticks u64, dropped total u64, record count u32, records (16 bytes each: word 0, word 1) |
//! | 5 | thread end | ring u32 |
//! | 6 | CPU calibration | sample count u32, samples |
//! | 7 | GPU device | device u16, name str, api str, valid bits u32, nominal ns per tick f64, timestamp slots u32 |
//! | 8 | GPU queue | device u16, queue u16, name str |
//! | 9 | GPU calibration | device u16, at ns u64, failed u8, sample count u32, samples |
//! | 10 | GPU reads | device u16, read ns u64, count u32, (pair u32, generation u32, begin ticks u64, end ticks u64)... |
//! | 11 | GPU lost | device u16, pair u32, generation u32 |
//! | 12 | GPU read failed | device u16 |
//! | 13 | pass end | drain ns u64, drain ticks u64, buffered bytes u64, rings drained u8 (1: every ring was drained) |
//! | 14 | end | (empty): the capture was finished cleanly |
//! | 15 | CPU clock note | fallback u8, doubt u8, text str: the tick-source decision in words |
//! | 16 | host | machine id u64, machine id source u8 (0 boot id, 1 override, 2 host name), boot id str, host name str |
//! | 18 | GPU reset | device u16: the backend reported a reset of the device clock |
//! | 17 | host clocks | BOOTTIME, MONOTONIC, MONOTONIC_RAW, REALTIME ns u64 each, bracket ns u64: read together (at the start, with each write-out, at the end); then, where the kernel's time-sync state could be read, 1 u8, synchronized u8, estimated error ns u64, maximum error ns u64, status i32, clock state i32 (absent in older captures, whose readers ignore it) |
//! | 19 | slices dropped | ring u32, dropped slices total u64: after a chunk whose ring's count of slices dropped whole changed |
//!
//! The records inside chunks are the ring format of [`crate::codec`]. A reader stops at the first frame that
//! is cut short or fails its check, so a file cut at any byte (a killed process) converts up to its last
//! whole frame; unknown frame types are skipped (a newer minor addition).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::input::{CallsiteDef, CallsiteKind, Chunk, GpuInput, Input, LiveLink, PairRead};
use super::stats::SharedStats;
use crate::calibration::{CalibrationSample, ClockDomain};
use crate::clock::TickSource;
use crate::codec::Record;
use crate::gpu::{GpuDeviceInfo, GpuTicks};
use crate::sync::TraceUuid;
use crate::trace_file::TraceFile;

const MAGIC: &[u8; 12] = b"TICKLINE\0\0\0\0";
/// The format version this build writes (it also reads versions 1, whose check has one lane, and 2).
pub(crate) const VERSION: u32 = 5;
/// Write the buffer to the file once it holds this much.
const WRITE_OUT_BYTES: usize = 1 << 20;
/// Write the buffer out at least this often, so a killed process loses at most about this much.
const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// At most one pass end in this long while passes bring nothing (see the `PassEnd` frame's writing).
const IDLE_PASS_END_INTERVAL: Duration = Duration::from_millis(100);

mod frame {
    pub(super) const PROCESS: u8 = 1;
    pub(super) const THREAD: u8 = 2;
    pub(super) const CALLSITE: u8 = 3;
    pub(super) const CHUNK: u8 = 4;
    pub(super) const THREAD_END: u8 = 5;
    pub(super) const CPU_CALIBRATION: u8 = 6;
    pub(super) const GPU_DEVICE: u8 = 7;
    pub(super) const GPU_QUEUE: u8 = 8;
    pub(super) const GPU_CALIBRATION: u8 = 9;
    pub(super) const GPU_READS: u8 = 10;
    pub(super) const GPU_LOST: u8 = 11;
    pub(super) const GPU_READ_FAILED: u8 = 12;
    pub(super) const PASS_END: u8 = 13;
    pub(super) const END: u8 = 14;
    pub(super) const CPU_CLOCK_NOTE: u8 = 15;
    pub(super) const HOST: u8 = 16;
    pub(super) const HOST_CLOCKS: u8 = 17;
    pub(super) const GPU_RESET: u8 = 18;
    pub(super) const SLICES_DROPPED: u8 = 19;
}

/// A frame's check (see the module docs): each part's 8-byte little-endian words (its last, short one
/// zero-padded and tagged with its length) dealt out to `LANES` lanes and folded in with
/// `h = rotl((h ^ word) * K, 29)`. Every step is a bijection of its lane (and of the word), so a frame that
/// differs from the written one in any single word never passes; four independent lanes run four multiplies
/// at once (one lane, version 1, cost 11 ns per span recorded: a quarter of raw capture's collector time).
fn frame_check<const LANES: usize>(parts: &[&[u8]]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    const START: [u64; 4] = [
        0x6a09_e667_f3bc_c908,
        0xbb67_ae85_84ca_a73b,
        0x3c6e_f372_fe94_f82b,
        0xa54f_f53a_5f1d_36f1,
    ];
    let fold = |hash: u64, word: u64| ((hash ^ word).wrapping_mul(K)).rotate_left(29);
    let word_at = |bytes: &[u8]| u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
    let mut lanes = [0u64; LANES];
    lanes.copy_from_slice(&START[..LANES]);
    for part in parts {
        let mut blocks = part.chunks_exact(8 * LANES);
        for block in &mut blocks {
            for (lane, word) in lanes.iter_mut().zip(block.chunks_exact(8)) {
                *lane = fold(*lane, word_at(word));
            }
        }
        let mut words = blocks.remainder().chunks_exact(8);
        let mut lane = 0;
        for word in &mut words {
            lanes[lane] = fold(lanes[lane], word_at(word));
            lane += 1;
        }
        let tail = words.remainder();
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        lanes[lane] = fold(lanes[lane], u64::from_le_bytes(last) ^ ((tail.len() as u64) << 59));
    }
    lanes[1..].iter().fold(lanes[0], |hash, &lane| fold(hash, lane))
}

/// Writes the input log to a `.tickline` file. Failures are reported like an exporter's.
pub(crate) struct CaptureWriter {
    file: TraceFile,
    path: PathBuf,
    /// Whole frames not yet written to the file. A frame is built here in place (no copy between a frame
    /// buffer and a write buffer: a chunk's records are copied once, from the chunk).
    buf: Vec<u8>,
    /// The last durable write-out; `None` before the first, which the first pass end does (a process killed
    /// in its first flush interval leaves a capture that converts, not an empty file).
    last_flush: Option<Instant>,
    failed: bool,
    /// Each ring's count of slices dropped whole, as last written (a frame is written when it changes).
    slices_dropped: std::collections::HashMap<u32, u64>,
    /// A frame other than a pass end was written since the last pass end written.
    since_pass_end: bool,
    /// When the last pass end was written.
    last_pass_end: Instant,
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    let bytes = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    buf.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    buf.extend_from_slice(bytes);
}

fn put_samples(buf: &mut Vec<u8>, samples: &[CalibrationSample]) {
    buf.extend_from_slice(&(samples.len() as u32).to_le_bytes());
    for s in samples {
        buf.extend_from_slice(&s.source_ticks.to_le_bytes());
        buf.extend_from_slice(&s.reference_ns.to_le_bytes());
        buf.extend_from_slice(&s.max_deviation_ns.to_le_bytes());
    }
}

fn source_code(source: TickSource) -> u8 {
    match source {
        TickSource::Tsc => 0,
        TickSource::ArmVirtualCounter => 1,
        TickSource::Monotonic => 2,
    }
}

impl CaptureWriter {
    /// Creates (or truncates) the capture file at `path`.
    pub(crate) fn create(path: &Path) -> std::io::Result<Self> {
        let file = TraceFile::create(path)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot create raw capture {}: {e}", path.display())))?;
        let mut buf = Vec::with_capacity(WRITE_OUT_BYTES + (1 << 16));
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        Ok(CaptureWriter {
            file,
            path: path.to_owned(),
            buf,
            last_flush: None,
            failed: false,
            slices_dropped: std::collections::HashMap::new(),
            since_pass_end: true,
            last_pass_end: Instant::now(),
        })
    }

    /// A ring's count of slices dropped whole, when it changed: a chunk frame carries only its dropped records.
    fn write_slices_dropped(&mut self, ring: u32, total: u64) -> std::io::Result<()> {
        // A map: a program that starts threads all the time has a ring per thread.
        let known = self.slices_dropped.entry(ring).or_insert(0);
        if *known == total {
            return Ok(());
        }
        *known = total;
        self.emit(frame::SLICES_DROPPED, |b| {
            b.extend_from_slice(&ring.to_le_bytes());
            b.extend_from_slice(&total.to_le_bytes());
        })
    }

    fn emit(&mut self, kind: u8, payload: impl FnOnce(&mut Vec<u8>)) -> std::io::Result<()> {
        self.since_pass_end |= kind != frame::PASS_END;
        let start = self.buf.len();
        self.buf.push(kind);
        self.buf.extend_from_slice(&[0; 4]);
        payload(&mut self.buf);
        let len = ((self.buf.len() - start - 5) as u32).to_le_bytes();
        self.buf[start + 1..start + 5].copy_from_slice(&len);
        let check = frame_check::<4>(&[&[kind], &len, &self.buf[start + 5..]]);
        self.buf.extend_from_slice(&check.to_le_bytes());
        if self.buf.len() >= WRITE_OUT_BYTES {
            self.write_out()?;
        }
        Ok(())
    }

    /// Writes the buffered frames to the file.
    fn write_out(&mut self) -> std::io::Result<()> {
        let result = self.file.write_all(&self.buf);
        self.buf.clear();
        result
    }

    /// Writes the buffered frames to the file and makes them durable: a process killed afterwards loses none.
    fn write_out_durably(&mut self) -> std::io::Result<()> {
        self.write_out().and_then(|()| self.file.flush())
    }

    /// The machine the capture is recorded on, and its clocks now (the first `host clocks` frame).
    pub(crate) fn write_host(&mut self, host: &crate::HostInfo) {
        let source = match host.machine_id_source {
            crate::MachineIdSource::BootId => 0u8,
            crate::MachineIdSource::Override => 1,
            crate::MachineIdSource::HostName => 2,
        };
        let result = self
            .emit(frame::HOST, |b| {
                b.extend_from_slice(&host.machine_id.0.to_le_bytes());
                b.push(source);
                put_str(b, &host.boot_id);
                put_str(b, &host.host_name);
            })
            .and_then(|()| self.write_clocks());
        if result.is_err() {
            self.failed = true;
        }
    }

    /// The host's clocks read together: Perfetto's clock snapshots of the converted trace.
    fn write_clocks(&mut self) -> std::io::Result<()> {
        let r = crate::read_real_clocks();
        // With the readings, the kernel's time-sync state: a converted trace states how far the recording
        // host's REALTIME could be trusted, which merging across hosts needs (readers before it stop at the
        // readings).
        let sync = crate::time_sync_state();
        self.emit(frame::HOST_CLOCKS, |b| {
            for v in [
                r.boottime_ns,
                r.monotonic_ns,
                r.monotonic_raw_ns,
                r.realtime_ns,
                r.bracket_ns,
            ] {
                b.extend_from_slice(&v.to_le_bytes());
            }
            if let Some(sync) = sync {
                b.push(1);
                b.push(u8::from(sync.synchronized));
                b.extend_from_slice(&sync.est_error_ns.to_le_bytes());
                b.extend_from_slice(&sync.max_error_ns.to_le_bytes());
                b.extend_from_slice(&sync.status.to_le_bytes());
                b.extend_from_slice(&sync.clock_state.to_le_bytes());
            }
        })
    }

    /// The process frame: who recorded, and the CPU clock the chunks' ticks are in.
    pub(crate) fn write_header(
        &mut self,
        pid: u32,
        name: &str,
        source: TickSource,
        domain: ClockDomain,
        recording: TraceUuid,
    ) {
        let result = self.emit(frame::PROCESS, |b| {
            b.extend_from_slice(&pid.to_le_bytes());
            put_str(b, name);
            b.push(source_code(source));
            b.extend_from_slice(&domain.valid_bits().to_le_bytes());
            b.extend_from_slice(&domain.nominal_ns_per_tick().to_le_bytes());
            b.extend_from_slice(&recording.0.to_le_bytes());
        });
        if result.is_err() {
            self.failed = true;
        }
    }

    fn fail(&mut self, stats: &SharedStats, e: std::io::Error) {
        self.failed = true;
        stats.export_failures.fetch_add(1, Ordering::Relaxed);
        stats.note_export_failure(super::stats::FirstExportError::Io(
            e.kind(),
            format!("writing raw capture {}: {e}", self.path.display()),
        ));
    }

    /// Writes one input (inputs that are not part of the log, flush and shutdown, are not written).
    pub(crate) fn write(&mut self, input: &Input, stats: &SharedStats) {
        if self.failed {
            return;
        }
        let result = match input {
            Input::Thread { ring, tid, name } => self.emit(frame::THREAD, |b| {
                b.extend_from_slice(&ring.to_le_bytes());
                b.extend_from_slice(&tid.to_le_bytes());
                put_str(b, name);
            }),
            Input::Callsite(def) => self.emit(frame::CALLSITE, |b| {
                b.extend_from_slice(&def.key.to_le_bytes());
                b.push(match def.kind {
                    CallsiteKind::Span => 0,
                    CallsiteKind::Event => 1,
                    CallsiteKind::Native => 2,
                });
                b.push(def.level);
                b.extend_from_slice(&def.line.to_le_bytes());
                put_str(b, &def.name);
                put_str(b, &def.target);
                put_str(b, &def.file);
                b.extend_from_slice(&(def.fields.len().min(u16::MAX as usize) as u16).to_le_bytes());
                for f in def.fields.iter().take(u16::MAX as usize) {
                    put_str(b, f);
                }
            }),
            Input::Chunk(chunk) => self
                .emit(frame::CHUNK, |b| {
                    b.extend_from_slice(&chunk.ring.to_le_bytes());
                    b.extend_from_slice(&chunk.now_ticks.to_le_bytes());
                    b.extend_from_slice(&chunk.dropped_total.to_le_bytes());
                    b.extend_from_slice(&(chunk.records.len() as u32).to_le_bytes());
                    let start = b.len();
                    b.resize(start + chunk.records.len() * 16, 0);
                    for (out, r) in b[start..].chunks_exact_mut(16).zip(&chunk.records) {
                        out[..8].copy_from_slice(&r.word0.to_le_bytes());
                        out[8..].copy_from_slice(&r.word1.to_le_bytes());
                    }
                })
                .and_then(|()| self.write_slices_dropped(chunk.ring, chunk.dropped_slices_total)),
            Input::ThreadEnd { ring } => {
                self.slices_dropped.remove(ring);
                self.emit(frame::THREAD_END, |b| b.extend_from_slice(&ring.to_le_bytes()))
            }
            Input::CpuCalibration(samples) => self.emit(frame::CPU_CALIBRATION, |b| put_samples(b, samples)),
            Input::CpuClockNote { fallback, doubt, text } => self.emit(frame::CPU_CLOCK_NOTE, |b| {
                b.push(*fallback as u8);
                b.push(*doubt as u8);
                put_str(b, text);
            }),
            Input::Gpu(gpu) => self.write_gpu(gpu),
            Input::PassEnd {
                drain_ns,
                drain_ticks,
                buffered_bytes,
                rings_drained,
            } => {
                // A pass that brought nothing since the last pass end written is left out, but for one every
                // IDLE_PASS_END_INTERVAL: an idle program's capture must not grow by a frame per pass (a
                // thousand a second). Converting sees fewer empty passes, which only delays what waits for one.
                let idle = !self.since_pass_end && self.last_pass_end.elapsed() < IDLE_PASS_END_INTERVAL;
                let result = if idle {
                    Ok(())
                } else {
                    self.last_pass_end = Instant::now();
                    let result = self.emit(frame::PASS_END, |b| {
                        b.extend_from_slice(&drain_ns.to_le_bytes());
                        b.extend_from_slice(&drain_ticks.to_le_bytes());
                        b.extend_from_slice(&buffered_bytes.to_le_bytes());
                        b.push(u8::from(*rings_drained));
                    });
                    self.since_pass_end = false;
                    result
                };
                if result.is_ok() && self.last_flush.is_none_or(|last| last.elapsed() >= FLUSH_INTERVAL) {
                    self.last_flush = Some(Instant::now());
                    self.write_clocks().and_then(|()| self.write_out_durably())
                } else {
                    result
                }
            }
            Input::Flush(_) | Input::Shutdown(_) => Ok(()),
        };
        if let Err(e) = result {
            self.fail(stats, e);
        }
    }

    fn write_gpu(&mut self, gpu: &GpuInput) -> std::io::Result<()> {
        match gpu {
            GpuInput::Device { device, info, .. } => self.emit(frame::GPU_DEVICE, |b| {
                b.extend_from_slice(&device.to_le_bytes());
                put_str(b, &info.name);
                put_str(b, info.api);
                b.extend_from_slice(&info.clock.valid_bits().to_le_bytes());
                b.extend_from_slice(&info.clock.nominal_ns_per_tick().to_le_bytes());
                b.extend_from_slice(&info.timestamp_slots.to_le_bytes());
            }),
            GpuInput::Queue { device, queue, name } => self.emit(frame::GPU_QUEUE, |b| {
                b.extend_from_slice(&device.to_le_bytes());
                b.extend_from_slice(&queue.to_le_bytes());
                put_str(b, name);
            }),
            GpuInput::Calibration {
                device,
                at_ns,
                samples,
                failed,
            } => self.emit(frame::GPU_CALIBRATION, |b| {
                b.extend_from_slice(&device.to_le_bytes());
                b.extend_from_slice(&at_ns.to_le_bytes());
                b.push(*failed as u8);
                put_samples(b, samples);
            }),
            GpuInput::Reads { device, read_ns, reads } => self.emit(frame::GPU_READS, |b| {
                b.extend_from_slice(&device.to_le_bytes());
                b.extend_from_slice(&read_ns.to_le_bytes());
                b.extend_from_slice(&(reads.len() as u32).to_le_bytes());
                for r in reads {
                    b.extend_from_slice(&r.pair.to_le_bytes());
                    b.extend_from_slice(&r.generation.to_le_bytes());
                    b.extend_from_slice(&r.begin.0.to_le_bytes());
                    b.extend_from_slice(&r.end.0.to_le_bytes());
                }
            }),
            GpuInput::Lost {
                device,
                pair,
                generation,
            } => self.emit(frame::GPU_LOST, |b| {
                b.extend_from_slice(&device.to_le_bytes());
                b.extend_from_slice(&pair.to_le_bytes());
                b.extend_from_slice(&generation.to_le_bytes());
            }),
            GpuInput::ReadFailed { device } => {
                self.emit(frame::GPU_READ_FAILED, |b| b.extend_from_slice(&device.to_le_bytes()))
            }
            GpuInput::Reset { device } => self.emit(frame::GPU_RESET, |b| b.extend_from_slice(&device.to_le_bytes())),
        }
    }

    /// Makes everything written so far durable.
    pub(crate) fn flush(&mut self, stats: &SharedStats) -> Result<(), String> {
        if !self.failed {
            self.last_flush = Some(Instant::now());
            if let Err(e) = self.write_out_durably() {
                self.fail(stats, e);
            }
        }
        stats.first_export_failure()
    }

    /// Writes the end frame and flushes.
    pub(crate) fn finish(&mut self, stats: &SharedStats) -> Result<(), String> {
        if !self.failed {
            if let Err(e) = self.write_clocks().and_then(|()| self.emit(frame::END, |_| {})) {
                self.fail(stats, e);
            }
        }
        self.flush(stats)
    }
}

impl Drop for CaptureWriter {
    /// Frames still buffered go to the file (what `BufWriter` would do): a writer dropped without `finish`
    /// (a collector thread that panicked) still leaves every whole frame it built.
    fn drop(&mut self) {
        if !self.failed {
            let _ = self.write_out_durably();
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Reading.

/// Why a raw capture could not be read or converted.
#[derive(Debug)]
#[non_exhaustive]
pub enum CaptureError {
    /// The file could not be opened or read.
    Io(std::io::Error),
    /// Not a tickline raw capture (no magic), or a version this build does not read.
    Format {
        /// What is wrong, in words.
        detail: String,
    },
    /// The exporter the capture was converted into failed.
    Export(crate::export::ExportError),
}

impl std::fmt::Display for CaptureError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CaptureError::Io(e) => write!(f, "reading the raw capture: {e}"),
            CaptureError::Format { detail } => write!(f, "not a readable tickline raw capture: {detail}"),
            CaptureError::Export(e) => write!(f, "converting the raw capture: {e}"),
        }
    }
}

impl std::error::Error for CaptureError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CaptureError::Io(e) => Some(e),
            CaptureError::Export(e) => Some(e),
            CaptureError::Format { .. } => None,
        }
    }
}

/// The process frame of a capture.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CaptureHeader {
    pub(crate) pid: u32,
    pub(crate) process_name: String,
    pub(crate) source: TickSource,
    pub(crate) cpu_domain: ClockDomain,
    /// The recording's id (`None` in captures written before it was kept).
    pub(crate) recording: Option<TraceUuid>,
}

/// A cursor over a frame's payload; every read checks the length (a corrupt payload yields `None`).
struct Payload<'a>(&'a [u8]);

impl<'a> Payload<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }
    fn f64(&mut self) -> Option<f64> {
        self.u64().map(f64::from_bits)
    }
    fn str(&mut self) -> Option<String> {
        let len = self.u16()? as usize;
        self.take(len).map(|b| String::from_utf8_lossy(b).into_owned())
    }
    fn samples(&mut self) -> Option<Vec<CalibrationSample>> {
        let n = self.u32()? as usize;
        // Each sample is 24 bytes: a count beyond what is left is corrupt (and must not allocate).
        if n > self.0.len() / 24 {
            return None;
        }
        (0..n)
            .map(|_| {
                Some(CalibrationSample {
                    source_ticks: self.u64()?,
                    reference_ns: self.u64()?,
                    max_deviation_ns: self.u64()?,
                })
            })
            .collect()
    }
}

/// One frame read back.
#[derive(Debug)]
pub(crate) enum Frame {
    Header(CaptureHeader),
    Host(crate::HostInfo),
    /// The host's clocks, and its time-sync state when the capture has it.
    HostClocks(crate::ClockReadings, Option<crate::TimeSyncState>),
    Input(Input),
    /// A ring's count of slices dropped whole, so far.
    SlicesDropped {
        ring: u32,
        total: u64,
    },
    End,
}

/// Reads the frames of a capture. Never panics on any input: a frame that is cut short, fails its check or
/// does not parse ends the reading (see [`CaptureReader::stopped`]).
pub(crate) struct CaptureReader<R: Read> {
    input: R,
    /// The file's format version (1 to 4; 1 has the one-lane frame check).
    version: u32,
    buf: Vec<u8>,
    /// Why reading stopped early, if it did.
    stopped: Option<String>,
    done: bool,
}

/// API names are `&'static str` in [`GpuDeviceInfo`]; a capture's are mapped back to the known ones, and
/// others kept for the rest of the process (a handful per capture at most).
fn static_api(api: String) -> &'static str {
    match api.as_str() {
        "Vulkan" => "Vulkan",
        "CUDA" => "CUDA",
        "simulated" => "simulated",
        "wgpu" => "wgpu",
        _ => Box::leak(api.into_boxed_str()),
    }
}

impl<R: Read> CaptureReader<R> {
    /// Checks the magic and version.
    pub(crate) fn new(mut input: R) -> Result<Self, CaptureError> {
        let mut magic = [0u8; 16];
        input.read_exact(&mut magic).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => CaptureError::Format {
                detail: "the file is shorter than the 16-byte header".into(),
            },
            _ => CaptureError::Io(e),
        })?;
        if &magic[..12] != MAGIC {
            return Err(CaptureError::Format {
                detail: "no TICKLINE magic at the start".into(),
            });
        }
        let version = u32::from_le_bytes(magic[12..].try_into().expect("4 bytes"));
        if !(1..=VERSION).contains(&version) {
            return Err(CaptureError::Format {
                detail: format!("format version {version}; this build reads versions 1 to {VERSION}"),
            });
        }
        Ok(CaptureReader {
            input,
            version,
            buf: Vec::new(),
            stopped: None,
            done: false,
        })
    }

    /// Why reading stopped before a clean end, if it did (a cut or corrupt file).
    pub(crate) fn stopped(&self) -> Option<&str> {
        self.stopped.as_deref()
    }

    fn stop(&mut self, why: String) -> Option<Frame> {
        self.stopped = Some(why);
        self.done = true;
        None
    }

    fn read_frame(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut head = [0u8; 5];
        match read_full(&mut self.input, &mut head) {
            Ok(0) => {
                self.done = true;
                return None;
            }
            Ok(5) => {}
            Ok(_) => {
                self.stop("the file ends inside a frame header".into());
                return None;
            }
            Err(e) => {
                self.stop(format!("read error: {e}"));
                return None;
            }
        }
        let len = u32::from_le_bytes(head[1..].try_into().expect("4 bytes")) as usize;
        // Read in steps, so a corrupt length cannot make us allocate gigabytes up front.
        self.buf.clear();
        let mut left = len + 8;
        let mut step = [0u8; 1 << 16];
        while left > 0 {
            let n = left.min(step.len());
            match read_full(&mut self.input, &mut step[..n]) {
                Ok(got) if got == n => {
                    self.buf.extend_from_slice(&step[..n]);
                    left -= n;
                }
                Ok(_) => {
                    self.stop("the file ends inside a frame (a cut capture)".into());
                    return None;
                }
                Err(e) => {
                    self.stop(format!("read error: {e}"));
                    return None;
                }
            }
        }
        let check = u64::from_le_bytes(self.buf[len..].try_into().expect("8 bytes"));
        self.buf.truncate(len);
        let parts: [&[u8]; 3] = [&head[..1], &head[1..], &self.buf];
        let computed = if self.version == 1 {
            frame_check::<1>(&parts)
        } else {
            frame_check::<4>(&parts)
        };
        if computed != check {
            self.stop("a frame fails its check (a corrupt capture)".into());
            return None;
        }
        Some((head[0], std::mem::take(&mut self.buf)))
    }

    fn parse(kind: u8, payload: &[u8]) -> Option<Option<Frame>> {
        let mut p = Payload(payload);
        let frame = match kind {
            frame::PROCESS => {
                let pid = p.u32()?;
                let process_name = p.str()?;
                let source = match p.u8()? {
                    0 => TickSource::Tsc,
                    1 => TickSource::ArmVirtualCounter,
                    2 => TickSource::Monotonic,
                    _ => return None,
                };
                let cpu_domain = ClockDomain::new(p.u32()?, p.f64()?).ok()?;
                let recording = p
                    .take(16)
                    .map(|b| TraceUuid(u128::from_le_bytes(b.try_into().expect("16 bytes"))));
                Frame::Header(CaptureHeader {
                    pid,
                    process_name,
                    source,
                    cpu_domain,
                    recording,
                })
            }
            frame::THREAD => Frame::Input(Input::Thread {
                ring: p.u32()?,
                tid: p.u32()?,
                name: p.str()?,
            }),
            frame::CALLSITE => {
                let key = p.u64()?;
                let kind = match p.u8()? {
                    0 => CallsiteKind::Span,
                    1 => CallsiteKind::Event,
                    2 => CallsiteKind::Native,
                    _ => return None,
                };
                let level = p.u8()?;
                let line = p.u32()?;
                let name = p.str()?;
                let target = p.str()?;
                let file = p.str()?;
                let n = p.u16()?;
                let fields = (0..n).map(|_| p.str()).collect::<Option<Vec<_>>>()?;
                Frame::Input(Input::Callsite(CallsiteDef {
                    key,
                    kind,
                    name,
                    target,
                    level,
                    file,
                    line,
                    fields,
                }))
            }
            frame::CHUNK => {
                let ring = p.u32()?;
                let now_ticks = p.u64()?;
                let dropped_total = p.u64()?;
                let n = p.u32()? as usize;
                if n != p.0.len() / 16 || p.0.len() % 16 != 0 {
                    return None;
                }
                let records = (0..n)
                    .map(|_| {
                        Some(Record {
                            word0: p.u64()?,
                            word1: p.u64()?,
                        })
                    })
                    .collect::<Option<Vec<_>>>()?;
                Frame::Input(Input::Chunk(Chunk {
                    ring,
                    now_ticks,
                    dropped_total,
                    // In a frame of its own (type 19).
                    dropped_slices_total: 0,
                    records,
                }))
            }
            frame::THREAD_END => Frame::Input(Input::ThreadEnd { ring: p.u32()? }),
            frame::CPU_CALIBRATION => Frame::Input(Input::CpuCalibration(p.samples()?)),
            frame::CPU_CLOCK_NOTE => Frame::Input(Input::CpuClockNote {
                fallback: p.u8()? != 0,
                doubt: p.u8()? != 0,
                text: p.str()?,
            }),
            frame::GPU_DEVICE => {
                let device = p.u16()?;
                let name = p.str()?;
                let api = static_api(p.str()?);
                let clock = ClockDomain::new(p.u32()?, p.f64()?).ok()?;
                let timestamp_slots = p.u32()?;
                Frame::Input(Input::Gpu(GpuInput::Device {
                    device,
                    info: GpuDeviceInfo {
                        name,
                        api,
                        clock,
                        timestamp_slots,
                    },
                    link: LiveLink(None),
                }))
            }
            frame::GPU_QUEUE => Frame::Input(Input::Gpu(GpuInput::Queue {
                device: p.u16()?,
                queue: p.u16()?,
                name: p.str()?,
            })),
            frame::GPU_CALIBRATION => Frame::Input(Input::Gpu(GpuInput::Calibration {
                device: p.u16()?,
                at_ns: p.u64()?,
                failed: p.u8()? != 0,
                samples: p.samples()?,
            })),
            frame::GPU_READS => {
                let device = p.u16()?;
                let read_ns = p.u64()?;
                let n = p.u32()? as usize;
                if n > p.0.len() / 24 {
                    return None;
                }
                let reads = (0..n)
                    .map(|_| {
                        Some(PairRead {
                            pair: p.u32()?,
                            generation: p.u32()?,
                            begin: GpuTicks(p.u64()?),
                            end: GpuTicks(p.u64()?),
                        })
                    })
                    .collect::<Option<Vec<_>>>()?;
                Frame::Input(Input::Gpu(GpuInput::Reads { device, read_ns, reads }))
            }
            frame::GPU_LOST => Frame::Input(Input::Gpu(GpuInput::Lost {
                device: p.u16()?,
                pair: p.u32()?,
                generation: p.u32()?,
            })),
            frame::GPU_READ_FAILED => Frame::Input(Input::Gpu(GpuInput::ReadFailed { device: p.u16()? })),
            frame::GPU_RESET => Frame::Input(Input::Gpu(GpuInput::Reset { device: p.u16()? })),
            frame::PASS_END => Frame::Input(Input::PassEnd {
                drain_ns: p.u64()?,
                drain_ticks: p.u64()?,
                buffered_bytes: p.u64()?,
                rings_drained: p.u8()? != 0,
            }),
            frame::HOST => {
                let machine_id = crate::MachineId(p.u64()?);
                let machine_id_source = match p.u8()? {
                    0 => crate::MachineIdSource::BootId,
                    1 => crate::MachineIdSource::Override,
                    2 => crate::MachineIdSource::HostName,
                    _ => return None,
                };
                Frame::Host(crate::HostInfo {
                    machine_id,
                    machine_id_source,
                    boot_id: p.str()?,
                    host_name: p.str()?,
                })
            }
            frame::HOST_CLOCKS => {
                let readings = crate::ClockReadings {
                    boottime_ns: p.u64()?,
                    monotonic_ns: p.u64()?,
                    monotonic_raw_ns: p.u64()?,
                    realtime_ns: p.u64()?,
                    bracket_ns: p.u64()?,
                };
                // Absent in captures from before it, and where the writer could not read it.
                let sync = match p.u8() {
                    Some(1) => Some(crate::TimeSyncState {
                        synchronized: p.u8()? != 0,
                        est_error_ns: p.u64()?,
                        max_error_ns: p.u64()?,
                        status: p.u32()? as i32,
                        clock_state: p.u32()? as i32,
                    }),
                    _ => None,
                };
                Frame::HostClocks(readings, sync)
            }
            frame::SLICES_DROPPED => Frame::SlicesDropped {
                ring: p.u32()?,
                total: p.u64()?,
            },
            frame::END => Frame::End,
            // A frame type this version does not know: skipped.
            _ => return Some(None),
        };
        Some(Some(frame))
    }
}

impl<R: Read> Iterator for CaptureReader<R> {
    type Item = Frame;

    fn next(&mut self) -> Option<Frame> {
        loop {
            if self.done {
                return None;
            }
            let (kind, payload) = self.read_frame()?;
            match Self::parse(kind, &payload) {
                Some(Some(Frame::End)) => {
                    self.done = true;
                    return Some(Frame::End);
                }
                Some(Some(frame)) => return Some(frame),
                Some(None) => continue,
                None => return self.stop(format!("frame of type {kind} does not parse (a corrupt capture)")),
            }
        }
    }
}

/// Reads until `buf` is full or the input ends; returns how many bytes were read.
fn read_full(input: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match input.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Opens a capture file for reading.
pub(crate) fn open(path: &Path) -> Result<CaptureReader<std::io::BufReader<File>>, CaptureError> {
    let file = File::open(path).map_err(|e| {
        CaptureError::Io(std::io::Error::new(
            e.kind(),
            format!("cannot open {}: {e}", path.display()),
        ))
    })?;
    CaptureReader::new(std::io::BufReader::with_capacity(1 << 20, file))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::{Kind, Record};

    fn sample(k: u64) -> CalibrationSample {
        CalibrationSample {
            source_ticks: k,
            reference_ns: 2 * k,
            max_deviation_ns: 3,
        }
    }

    /// One input of every kind that a capture holds.
    fn inputs() -> Vec<Input> {
        vec![
            Input::Thread {
                ring: 1,
                tid: 42,
                name: "worker".into(),
            },
            Input::Callsite(CallsiteDef {
                key: 0x1000,
                kind: CallsiteKind::Span,
                name: "job".into(),
                target: "app::jobs".into(),
                level: 3,
                file: "src/jobs.rs".into(),
                line: 7,
                fields: vec!["id".into(), "kind".into()],
            }),
            Input::Chunk(Chunk {
                ring: 1,
                now_ticks: 1234,
                dropped_total: 5,
                dropped_slices_total: 2,
                records: vec![
                    Record::timed(Kind::SpanEnter, 9, 1),
                    Record::timed(Kind::SpanExit, 10, 1),
                ],
            }),
            // The same count of dropped slices: no frame of its own this time.
            Input::Chunk(Chunk {
                ring: 1,
                now_ticks: 1240,
                dropped_total: 5,
                dropped_slices_total: 2,
                records: vec![Record::timed(Kind::Instant, 11, 3)],
            }),
            Input::CpuCalibration(vec![sample(1), sample(2)]),
            Input::CpuClockNote {
                fallback: true,
                doubt: false,
                text: "CLOCK_MONOTONIC: the TSC ...".into(),
            },
            Input::Gpu(GpuInput::Device {
                device: 3,
                info: GpuDeviceInfo {
                    name: "gpu".into(),
                    api: "Vulkan",
                    clock: ClockDomain::new(36, 1.25).unwrap(),
                    timestamp_slots: 64,
                },
                link: LiveLink(None),
            }),
            Input::Gpu(GpuInput::Queue {
                device: 3,
                queue: 1,
                name: "compute".into(),
            }),
            Input::Gpu(GpuInput::Calibration {
                device: 3,
                at_ns: 77,
                samples: vec![sample(5)],
                failed: true,
            }),
            Input::Gpu(GpuInput::Reads {
                device: 3,
                read_ns: 88,
                reads: vec![PairRead {
                    pair: 4,
                    generation: 2,
                    begin: GpuTicks(100),
                    end: GpuTicks(200),
                }],
            }),
            Input::Gpu(GpuInput::Lost {
                device: 3,
                pair: 5,
                generation: 1,
            }),
            Input::Gpu(GpuInput::ReadFailed { device: 3 }),
            Input::Gpu(GpuInput::Reset { device: 3 }),
            Input::ThreadEnd { ring: 1 },
            Input::PassEnd {
                drain_ns: 11,
                drain_ticks: 22,
                buffered_bytes: 33,
                rings_drained: true,
            },
        ]
    }

    fn host() -> crate::HostInfo {
        crate::HostInfo {
            machine_id: crate::MachineId(0x1234_5678_9abc_def0),
            machine_id_source: crate::MachineIdSource::Override,
            boot_id: "boot".into(),
            host_name: "render-farm-7".into(),
        }
    }

    fn write_capture(dir: &Path) -> PathBuf {
        let path = dir.join(format!("frames-{}.tickline", std::process::id()));
        let stats = SharedStats::default();
        let mut writer = CaptureWriter::create(&path).unwrap();
        writer.write_header(
            7,
            "app",
            TickSource::Tsc,
            ClockDomain::new(64, 0.4).unwrap(),
            TraceUuid(0x1234),
        );
        writer.write_host(&host());
        for input in inputs() {
            writer.write(&input, &stats);
        }
        writer.finish(&stats).unwrap();
        path
    }

    #[test]
    fn every_input_round_trips_through_a_capture_file() {
        let path = write_capture(&std::env::temp_dir());
        let frames: Vec<Frame> = open(&path).unwrap().collect();
        std::fs::remove_file(&path).ok();
        let Frame::Header(header) = &frames[0] else {
            panic!("{:?}", frames[0])
        };
        assert_eq!(
            (
                header.pid,
                header.process_name.as_str(),
                header.source,
                header.recording
            ),
            (7, "app", TickSource::Tsc, Some(TraceUuid(0x1234)))
        );
        // The host and its clocks (read when the capture starts, at the first pass end, which is written out at
        // once, and when it ends).
        assert!(matches!(&frames[1], Frame::Host(h) if *h == host()), "{:?}", frames[1]);
        let clocks: Vec<crate::ClockReadings> = frames
            .iter()
            .filter_map(|f| match f {
                Frame::HostClocks(r, _) => Some(*r),
                _ => None,
            })
            .collect();
        assert_eq!(clocks.len(), 3, "{frames:?}");
        assert!(
            clocks[0].monotonic_ns <= clocks[1].monotonic_ns
                && clocks[0].boottime_ns + clocks[0].bracket_ns >= clocks[0].monotonic_ns,
            "{clocks:?}"
        );
        assert!(
            matches!(frames[2], Frame::HostClocks(..)) && matches!(frames[frames.len() - 2], Frame::HostClocks(..))
        );
        let read: Vec<String> = frames[3..frames.len() - 2]
            .iter()
            .filter_map(|f| match f {
                Frame::Input(input) => Some(format!("{input:?}")),
                Frame::SlicesDropped { ring, total } => Some(format!("ring {ring}: {total} slices dropped")),
                // The first pass end's reading, written out at once with it.
                Frame::HostClocks(..) => None,
                other => panic!("{other:?}"),
            })
            .collect();
        // A chunk's count of dropped slices comes back in a frame of its own, when it changed.
        let mut last_slices = 0;
        let written: Vec<String> = inputs()
            .into_iter()
            .flat_map(|input| match input {
                Input::Chunk(mut chunk) => {
                    let total = std::mem::take(&mut chunk.dropped_slices_total);
                    let mut out = vec![format!("{:?}", Input::Chunk(chunk.clone()))];
                    if total != last_slices {
                        out.push(format!("ring {}: {total} slices dropped", chunk.ring));
                        last_slices = total;
                    }
                    out
                }
                other => vec![format!("{other:?}")],
            })
            .collect();
        assert_eq!(read, written);
        assert!(matches!(frames.last(), Some(Frame::End)));
    }

    /// Captures written by earlier builds (version 1: the same frames with a one-lane check; version 2: the
    /// same frames and check, no close marked `VALUES_FINAL`) still read, and a version-1 check is not accepted
    /// in a later version's file (nor the other way round).
    #[test]
    fn version_1_and_2_captures_still_read() {
        let path = write_capture(&std::env::temp_dir());
        let v2 = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).ok();
        // The same frames, re-checked as version 1.
        let mut v1 = v2[..16].to_vec();
        v1[12..16].copy_from_slice(&1u32.to_le_bytes());
        let mut at = 16;
        let mut frames = 0;
        while at < v2.len() {
            let len = u32::from_le_bytes(v2[at + 1..at + 5].try_into().unwrap()) as usize;
            let (head, payload) = (&v2[at..at + 5], &v2[at + 5..at + 5 + len]);
            assert_eq!(
                frame_check::<4>(&[&head[..1], &head[1..], payload]).to_le_bytes(),
                v2[at + 5 + len..at + 13 + len],
                "frame {frames} of the written file"
            );
            v1.extend_from_slice(&v2[at..at + 5 + len]);
            v1.extend_from_slice(&frame_check::<1>(&[&head[..1], &head[1..], payload]).to_le_bytes());
            at += 13 + len;
            frames += 1;
        }
        assert!(frames > inputs().len(), "{frames} frames");
        let read = |bytes: &[u8]| {
            let mut reader = CaptureReader::new(bytes).unwrap();
            let frames: Vec<String> = std::iter::from_fn(|| reader.next()).map(|f| format!("{f:?}")).collect();
            (frames, reader.stopped().map(str::to_owned))
        };
        let (from_v1, stopped) = read(&v1);
        assert_eq!(stopped, None);
        assert_eq!(from_v1, read(&v2).0);
        assert_eq!(from_v1.len(), frames);
        // The written file (this build's version) relabelled versions 2 to 4: the same frames.
        assert_eq!(VERSION, 5);
        for older in [2u32, 3, 4] {
            let mut labelled = v2.clone();
            labelled[12..16].copy_from_slice(&older.to_le_bytes());
            assert_eq!(read(&labelled), (from_v1.clone(), None));
        }
        // The version says which check a frame carries: a mismatch is a corrupt frame, found at once.
        let mut mixed = v1.clone();
        mixed[12..16].copy_from_slice(&VERSION.to_le_bytes());
        let (from_mixed, stopped) = read(&mixed);
        assert!(
            from_mixed.is_empty() && stopped.as_deref().is_some_and(|s| s.contains("check")),
            "{stopped:?}"
        );
    }

    /// An idle program's capture does not grow by a pass end per pass: passes that bring nothing are left out
    /// but for one every `IDLE_PASS_END_INTERVAL`; a pass after anything else is written.
    #[test]
    fn idle_passes_are_not_written_one_by_one() {
        let dir = std::env::temp_dir();
        let path = dir.join(format!("idle-{}.tickline", std::process::id()));
        let stats = SharedStats::default();
        let mut writer = CaptureWriter::create(&path).unwrap();
        let pass = |ns: u64| Input::PassEnd {
            drain_ns: ns,
            drain_ticks: ns,
            buffered_bytes: 0,
            rings_drained: true,
        };
        writer.write(&Input::CpuCalibration(Vec::new()), &stats);
        for k in 0..1_000 {
            writer.write(&pass(k), &stats);
        }
        writer.write(&Input::ThreadEnd { ring: 3 }, &stats);
        writer.write(&pass(2_000), &stats);
        writer.finish(&stats).unwrap();
        let frames: Vec<Frame> = CaptureReader::new(std::fs::File::open(&path).unwrap())
            .unwrap()
            .collect();
        std::fs::remove_file(&path).ok();
        let pass_ends = frames
            .iter()
            .filter(|f| matches!(f, Frame::Input(Input::PassEnd { .. })))
            .count();
        // The first after the calibration, the one after the thread end, and (a slow machine) a few idle ones.
        assert!((2..=10).contains(&pass_ends), "{pass_ends} pass ends written");
        assert!(
            frames
                .iter()
                .any(|f| matches!(f, Frame::Input(Input::PassEnd { drain_ns: 2_000, .. }))),
            "the pass after the thread end is written"
        );
    }

    #[test]
    fn a_file_that_is_not_a_capture_is_a_clear_error() {
        let err = CaptureReader::new(&b"PERFETTO"[..]).err().unwrap();
        assert!(matches!(err, CaptureError::Format { .. }), "{err}");
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&99u32.to_le_bytes());
        let err = CaptureReader::new(&header[..]).err().unwrap();
        assert!(err.to_string().contains("version 99"), "{err}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 1024 }))]

        /// Whatever follows the header, reading never panics, allocates no more than the input, and ends.
        #[test]
        fn random_bytes_after_the_header_never_panic(body in prop::collection::vec(any::<u8>(), 0..512), flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..8)) {
            let mut bytes = MAGIC.to_vec();
            bytes.extend_from_slice(&VERSION.to_le_bytes());
            bytes.extend_from_slice(&body);
            for (at, xor) in flips {
                if !body.is_empty() {
                    bytes[16 + at % body.len()] ^= xor;
                }
            }
            let reader = CaptureReader::new(&bytes[..]).unwrap();
            prop_assert!(reader.count() <= bytes.len());
        }

        /// A real capture with one byte changed anywhere reads up to the damage, never past it wrongly.
        #[test]
        fn a_corrupt_byte_stops_reading_cleanly(at in 16usize..2000, xor in 1u8..=255) {
            let dir = std::env::temp_dir().join(format!("tickline-capture-prop-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = write_capture(&dir);
            let mut bytes = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).ok();
            let at = at % bytes.len();
            bytes[at] ^= xor;
            if at >= 16 {
                let frames: Vec<Frame> = CaptureReader::new(&bytes[..]).unwrap().collect();
                prop_assert!(frames.len() <= inputs().len() + 6);
            }
        }
    }
}
