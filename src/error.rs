//! The crate's errors: [`TicklineError`] (what can go wrong while setting up or flushing a timeline) and
//! [`GpuError`] (a GPU backend's, re-exported as `tickline::gpu::GpuError`). Defined low in the house, so
//! every module can return them without depending on the timeline or the GPU layer.

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
    Gpu(GpuError),
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

impl From<GpuError> for TicklineError {
    fn from(e: GpuError) -> Self {
        TicklineError::Gpu(e)
    }
}

/// Why a GPU backend could not be set up or used. Setup errors are typed; the hot path never fails (a scope
/// that finds no free timestamp pair is counted as dropped).
#[derive(Debug)]
#[non_exhaustive]
pub enum GpuError {
    /// The API's loader or driver library is not installed (`libvulkan.so.1`, `libcuda.so`).
    NoLoader {
        /// Which library, and what the system said.
        detail: String,
    },
    /// The loader is there but no usable device is.
    NoDevice {
        /// What was looked for.
        detail: String,
    },
    /// The device or queue cannot write timestamps (Vulkan: `timestampValidBits == 0` on the queue family).
    NoTimestamps {
        /// Which queue or device.
        detail: String,
    },
    /// An API call failed.
    Api {
        /// The call.
        call: &'static str,
        /// The API's result, in words.
        detail: String,
    },
    /// The arguments do not fit the backend (too many queues, a zero-sized pool...).
    Invalid {
        /// What is wrong.
        detail: String,
    },
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuError::NoLoader { detail } => write!(f, "GPU API library not available: {detail}"),
            GpuError::NoDevice { detail } => write!(f, "no usable GPU device: {detail}"),
            GpuError::NoTimestamps { detail } => write!(f, "GPU timestamps not supported: {detail}"),
            GpuError::Api { call, detail } => write!(f, "GPU API call {call} failed: {detail}"),
            GpuError::Invalid { detail } => write!(f, "invalid GPU setup: {detail}"),
        }
    }
}

impl std::error::Error for GpuError {}
