//! tickline: one timeline of what your CPU threads and your GPUs did.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]
#![doc(test(attr(deny(warnings))))]

pub mod calibration;
mod clock;

pub use calibration::{
    CalibrationError, CalibrationHistory, CalibrationSample, ClockCalibration, ClockDomain, Converted, FitOptions,
    FitStrategy, HistoryConfig, HistoryStats,
};
pub use clock::{
    bracketed_sample, check_tsc_reliability, monotonic_ns, monotonic_raw_ns, read_ticks, FastConverter, Nanos,
    RawTicks, ReliabilityOptions, TickSource, TscCalibrator, TscCalibratorConfig, TscDecision, TscReport,
};
