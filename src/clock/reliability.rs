//! STUB
/// Options.
#[derive(Clone, Debug, Default)]
pub struct ReliabilityOptions {}
/// Decision.
#[derive(Clone, Debug, PartialEq)]
pub enum TscDecision {
    /// Use it.
    UseTsc,
    /// Fall back.
    FallBack {
        /// Why.
        reason: String,
    },
}
/// Report.
#[derive(Clone, Debug)]
pub struct TscReport {
    /// Decision.
    pub decision: TscDecision,
}
/// Check.
pub fn check_tsc_reliability(_options: &ReliabilityOptions) -> TscReport {
    TscReport {
        decision: TscDecision::UseTsc,
    }
}
