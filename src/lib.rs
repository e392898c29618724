//! tickline: one timeline of what your CPU threads and your GPUs did.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![doc(test(attr(deny(warnings))))]

pub mod calibration;
mod clock;
mod collector;
mod error;
mod export;
mod layer;
mod record;
mod recorder;
mod ring;
mod scope;

pub use calibration::{
    CalibrationError, CalibrationHistory, CalibrationSample, ClockCalibration, ClockDomain, Converted, FitOptions,
    FitStrategy, HistoryConfig, HistoryStats,
};
pub use clock::{
    bracketed_sample, check_tsc_reliability, monotonic_ns, monotonic_raw_ns, read_ticks, CpuRate, CpuShift,
    FastConverter, Nanos, RawTicks, ReliabilityOptions, SkippedCpu, TickSource, TscCalibrator, TscCalibratorConfig,
    TscDecision, TscReport,
};
#[doc(hidden)]
pub use collector::bench_support;
pub use collector::{Timeline, TimelineBuilder, TimelineStats};
pub use error::TicklineError;
pub use export::{
    Batch, Event, EventKind, ExportError, Exporter, Field, FieldValue, MemoryExporter, MemoryTrace, NameId,
    RecordedEvent, TrackDescriptor, TrackId, TrackKind,
};
pub use layer::TicklineLayer;
#[doc(hidden)]
pub use scope::{record_counter_value as __record_counter, record_instant as __record_instant};
pub use scope::{Callsite, ScopeGuard};
