//! STUB
use super::{CalibrationError, CalibrationSample, ClockDomain, Converted, FitOptions};

/// Configuration of a [`CalibrationHistory`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HistoryConfig {
    /// The fit.
    pub fit: FitOptions,
}

/// Statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HistoryStats {
    /// Knots.
    pub knots: usize,
}

/// The live piecewise-linear map.
#[derive(Clone, Debug)]
pub struct CalibrationHistory {
    _domain: ClockDomain,
}

impl CalibrationHistory {
    /// New.
    pub fn new(domain: ClockDomain, _config: HistoryConfig) -> Self {
        CalibrationHistory { _domain: domain }
    }
    /// Add a burst.
    pub fn add_burst(&mut self, _samples: &[CalibrationSample]) -> Result<(), CalibrationError> {
        Ok(())
    }
    /// Convert.
    pub fn convert(&mut self, _ticks: u64) -> Option<Converted> {
        None
    }
}
