//! STUB
use crate::calibration::ClockCalibration;

/// Fast ticks->ns.
#[derive(Clone, Copy, Debug)]
pub struct FastConverter {
    cal: ClockCalibration,
}

impl FastConverter {
    /// Build.
    pub fn new(cal: &ClockCalibration) -> Self {
        FastConverter { cal: *cal }
    }
    /// Convert.
    #[inline]
    pub fn to_ns(&self, ticks: u64) -> u64 {
        self.cal.to_reference_ns(ticks)
    }
}
