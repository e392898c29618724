//! [`TicklineError`]: what can go wrong while setting up or flushing a timeline.

use std::fmt;

use crate::calibration::CalibrationError;
use crate::export::ExportError;

/// Setup and flush errors. The hot path cannot fail: a full ring drops and counts, it never errors.
#[derive(Debug)]
#[non_exhaustive]
pub enum TicklineError {
    /// The CPU tick counter could not be calibrated against `CLOCK_MONOTONIC`.
    Calibration(CalibrationError),
    /// The collector thread could not be started.
    CollectorSpawn(std::io::Error),
    /// The collector thread is gone (it panicked or was shut down).
    CollectorGone,
    /// An exporter failed (disk full, file not writable, viewer disconnected). The timeline keeps running
    /// for the other exporters; this is the first failure.
    Export(ExportError),
    /// A GPU backend could not be set up (no driver, no device, no timestamps...).
    Gpu(crate::gpu::GpuError),
}

impl fmt::Display for TicklineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TicklineError::Calibration(e) => write!(f, "cannot calibrate the CPU clock: {e}"),
            TicklineError::CollectorSpawn(e) => write!(f, "cannot start tickline's collector thread: {e}"),
            TicklineError::CollectorGone => write!(f, "tickline's collector thread is no longer running"),
            TicklineError::Export(e) => write!(f, "{e}"),
            TicklineError::Gpu(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for TicklineError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TicklineError::Calibration(e) => Some(e),
            TicklineError::CollectorSpawn(e) => Some(e),
            TicklineError::Export(e) => Some(e),
            TicklineError::Gpu(e) => Some(e),
            TicklineError::CollectorGone => None,
        }
    }
}

impl From<CalibrationError> for TicklineError {
    fn from(e: CalibrationError) -> Self {
        TicklineError::Calibration(e)
    }
}

impl From<ExportError> for TicklineError {
    fn from(e: ExportError) -> Self {
        TicklineError::Export(e)
    }
}

impl From<crate::gpu::GpuError> for TicklineError {
    fn from(e: crate::gpu::GpuError) -> Self {
        TicklineError::Gpu(e)
    }
}
