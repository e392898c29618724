//! STUB
/// Config.
#[derive(Clone, Debug, Default)]
pub struct TscCalibratorConfig {}
/// Calibrator.
#[derive(Debug)]
pub struct TscCalibrator {}
