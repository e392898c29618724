//! The collector's input log: everything the processing stage consumes, in the order it must consume it.
//!
//! The drain stage (the live side, `drain.rs`) produces these: chunks of raw records moved out of the
//! rings, the registrations that name what records refer to, calibration samples of every clock, what the
//! GPUs wrote back. The processing stage (`process/`) turns them into the timeline, and is a function of
//! this log alone: a raw capture (`capture.rs`) writes the same log to a file, and converting it later
//! replays it through the same processing.
//!
//! Order: within a drain pass, registrations come first (the drain stage reads the control channel after it
//! drained the rings, so a record's callsite, ring or GPU device always precedes it), then the rings'
//! chunks, then GPU inputs, then [`Input::PassEnd`].

use std::sync::Arc;

use crate::calibration::CalibrationSample;
use crate::codec::Record;
use crate::gpu::{DeviceLink, GpuDeviceInfo, GpuTicks};

/// What kind of call site a key names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CallsiteKind {
    /// A `tracing` span.
    Span,
    /// A `tracing` event.
    Event,
    /// A native macro: `scope!`, `instant!`, `counter!`, `frame_mark!`, `gpu_scope!`.
    Native,
}

/// A call site, described once: records name it by `key`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CallsiteDef {
    pub(crate) key: u64,
    pub(crate) kind: CallsiteKind,
    pub(crate) name: String,
    /// The `tracing` target (module path), empty for native call sites.
    pub(crate) target: String,
    /// The `tracing` level (1 = TRACE .. 5 = ERROR), 0 for native call sites.
    pub(crate) level: u8,
    pub(crate) file: String,
    pub(crate) line: u32,
    pub(crate) fields: Vec<String>,
}

impl CallsiteDef {
    pub(crate) fn tracing(meta: &'static tracing::Metadata<'static>) -> Self {
        use tracing::Level;
        let level = match *meta.level() {
            Level::TRACE => 1,
            Level::DEBUG => 2,
            Level::INFO => 3,
            Level::WARN => 4,
            Level::ERROR => 5,
        };
        CallsiteDef {
            key: crate::control::metadata_key(meta),
            kind: if meta.is_span() {
                CallsiteKind::Span
            } else {
                CallsiteKind::Event
            },
            name: meta.name().to_owned(),
            target: meta.target().to_owned(),
            level,
            file: meta.file().unwrap_or_default().to_owned(),
            line: meta.line().unwrap_or(0),
            fields: meta.fields().iter().map(|f| f.name().to_owned()).collect(),
        }
    }

    pub(crate) fn native(callsite: &'static crate::callsite::NativeCallsite) -> Self {
        let (file, line) = callsite.location();
        CallsiteDef {
            key: crate::control::callsite_key(callsite),
            kind: CallsiteKind::Native,
            name: callsite.name().to_owned(),
            target: String::new(),
            level: 0,
            file: file.to_owned(),
            line,
            fields: callsite.fields().iter().map(|&f| f.to_owned()).collect(),
        }
    }
}

/// Records moved out of one ring by one drain.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Chunk {
    pub(crate) ring: u32,
    /// The CPU tick read right after the drain: every record in the chunk is older (the base for
    /// [`restore_ticks`](crate::codec::restore_ticks)).
    pub(crate) now_ticks: u64,
    /// The ring's drop counter after the drain (a running total).
    pub(crate) dropped_total: u64,
    /// The ring's count of slices dropped whole after the drain (a running total; see
    /// [`TimelineStats::dropped_slices`](crate::TimelineStats::dropped_slices)).
    pub(crate) dropped_slices_total: u64,
    pub(crate) records: Vec<Record>,
}

/// One GPU timestamp pair read back: a scope's begin and end ticks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PairRead {
    pub(crate) pair: u32,
    pub(crate) generation: u32,
    pub(crate) begin: GpuTicks,
    pub(crate) end: GpuTicks,
}

/// The live device behind a [`GpuInput::Device`], so the processing stage can ask it for calibration
/// bursts and publish the fit to [`GpuDevice::calibration`](crate::gpu::GpuDevice::calibration). Absent when a
/// raw capture is converted. Not part of what the input says (equal whatever it holds).
#[derive(Clone, Default)]
pub(crate) struct LiveLink(pub(crate) Option<Arc<dyn DeviceLink>>);

impl std::fmt::Debug for LiveLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "LiveLink(live)"
        } else {
            "LiveLink(none)"
        })
    }
}

impl PartialEq for LiveLink {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// What the live side learned from a GPU device.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum GpuInput {
    Device {
        device: u16,
        info: GpuDeviceInfo,
        link: LiveLink,
    },
    Queue {
        device: u16,
        queue: u16,
        name: String,
    },
    /// A calibration burst taken at `at_ns` (reference ns): what it got (maybe nothing) and whether the
    /// backend reported an error.
    Calibration {
        device: u16,
        at_ns: u64,
        samples: Vec<CalibrationSample>,
        failed: bool,
    },
    /// Pairs read back at `read_ns` (reference ns); their slots were released right after.
    Reads {
        device: u16,
        read_ns: u64,
        reads: Vec<PairRead>,
    },
    /// A scope's pair was never written within the loss bound: the scope is lost, the pair retired.
    Lost {
        device: u16,
        pair: u32,
        generation: u32,
    },
    /// Reading a device's timestamps failed.
    ReadFailed {
        device: u16,
    },
    /// The backend reported a reset of the device clock (a new epoch): calibration starts a new segment.
    Reset {
        device: u16,
    },
}

/// One entry of the input log.
#[derive(Debug)]
pub(crate) enum Input {
    /// A thread's ring joined (its records come in chunks tagged with `ring`).
    Thread {
        ring: u32,
        tid: u32,
        name: String,
    },
    Callsite(CallsiteDef),
    Chunk(Chunk),
    /// A thread's ring closed and was drained to its end.
    ThreadEnd {
        ring: u32,
    },
    /// A burst of CPU calibration samples (ticks of the timeline's tick source against CLOCK_MONOTONIC).
    CpuCalibration(Vec<CalibrationSample>),
    /// What the process's tick-source decision says about this timeline's CPU clock: at start, and again when
    /// the background check changes its mind. `fallback`: the timeline records CLOCK_MONOTONIC instead of the
    /// hardware counter; `doubt`: the hardware counter in use was found unreliable after the start.
    CpuClockNote {
        fallback: bool,
        doubt: bool,
        text: String,
    },
    Gpu(GpuInput),
    /// A drain pass ended; `drain_ns` (reference ns; `drain_ticks` in CPU ticks) is when it started, before it
    /// read any ring: every slice still open in its chunks was open then. `buffered_bytes`: chunk
    /// memory in flight towards the processing stage at its end. `rings_drained`: every ring was drained
    /// to its end in this pass (false when the chunk budget was full or draining was paused). Only such
    /// passes count towards deciding that a record that should have come (a span's announcement, a GPU
    /// scope's begin) was dropped, and towards what waits for other threads' records (a slice's values, a
    /// closed span's late records): the others could not have brought them.
    PassEnd {
        drain_ns: u64,
        drain_ticks: u64,
        buffered_bytes: u64,
        rings_drained: bool,
    },
    /// Live only: export and flush everything so far, then answer.
    Flush(crate::control::Reply),
    /// Live only: finish (open slices end now, exporters finish), answer, stop.
    Shutdown(crate::control::Reply),
}

impl Input {
    /// Bytes of chunk memory this input holds (what the drain stage's budget counts).
    pub(crate) fn buffered_bytes(&self) -> usize {
        match self {
            Input::Chunk(chunk) => chunk.records.len() * std::mem::size_of::<Record>(),
            _ => 0,
        }
    }
}
