//! What a reliability check found: [`TscReport`] with every measured number, the verdict of each check in
//! each pass, and the decision; rendered as text (`Display`) and JSON.

use std::fmt;
use std::time::Duration;

use super::analyze::wrapping_diff;
use crate::clock::TickSource;

/// What to do with the TSC after [`check_tsc_reliability`](crate::check_tsc_reliability).
///
/// ```
/// let d = tickline::clock::TscDecision::FallBack { reason: "CPUID reports no invariant TSC".into() };
/// assert_eq!(d.to_string(), "fall back to clock_gettime: CPUID reports no invariant TSC");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TscDecision {
    /// No check failed on a retry: record raw ticks. Checks that load kept from concluding are listed in
    /// [`TscReport::warnings`].
    UseTsc,
    /// Do not trust the hardware counter: use `clock_gettime(CLOCK_MONOTONIC)` ([`TickSource::Monotonic`]).
    FallBack {
        /// Why, for a human, with the measured numbers; several reasons are joined with "; ".
        reason: String,
    },
}

impl fmt::Display for TscDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TscDecision::UseTsc => f.write_str("use the TSC"),
            TscDecision::FallBack { reason } => write!(f, "fall back to clock_gettime: {reason}"),
        }
    }
}

/// The checks a pass makes; each gets its own [`Verdict`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TscCheck {
    /// The CPU's and the kernel's word: CPUID invariant TSC, the kernel's clocksources, a counter to read at all.
    Hints,
    /// Whether any CPU could be pinned and measured.
    Cpus,
    /// Every CPU's counter advances, at one rate.
    Rate,
    /// The bound on the shift between CPUs' counters.
    Shift,
    /// The CAS-ordered sequence of reads across CPUs never goes backwards.
    Monotonic,
}

impl TscCheck {
    /// The name used in reports and JSON.
    ///
    /// ```
    /// assert_eq!(tickline::clock::TscCheck::Shift.name(), "shift");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            TscCheck::Hints => "hints",
            TscCheck::Cpus => "cpus",
            TscCheck::Rate => "rate",
            TscCheck::Shift => "shift",
            TscCheck::Monotonic => "monotonic",
        }
    }
}

/// One check's outcome in one pass.
///
/// Only [`Verdict::Fail`] is evidence against the counter, and the measured checks need it twice (on a retry)
/// to reject it. [`Verdict::Inconclusive`] is what a preempted or starved probe produces: no evidence either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The check passed.
    Pass,
    /// The measurement proves the counter unusable; why, with the numbers.
    Fail(String),
    /// The measurement could not tell (probes interrupted, too few loops, nothing measured in time); why.
    Inconclusive(String),
}

impl Verdict {
    /// `"pass"`, `"fail"` or `"inconclusive"`.
    ///
    /// ```
    /// assert_eq!(tickline::clock::Verdict::Pass.label(), "pass");
    /// ```
    pub fn label(&self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail(_) => "fail",
            Verdict::Inconclusive(_) => "inconclusive",
        }
    }

    /// The explanation of a failed or inconclusive check.
    pub fn detail(&self) -> Option<&str> {
        match self {
            Verdict::Pass => None,
            Verdict::Fail(s) | Verdict::Inconclusive(s) => Some(s),
        }
    }
}

/// One check's verdict in one pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckVerdict {
    /// The check.
    pub check: TscCheck,
    /// Its outcome.
    pub verdict: Verdict,
}

/// What one pass of the check concluded.
#[derive(Clone, Debug, PartialEq)]
pub struct PassSummary {
    /// 1 for the first pass.
    pub attempt: u32,
    /// How long the pass took.
    pub elapsed: Duration,
    /// Shift rounds discarded as interrupted in this pass, over all CPUs.
    pub interrupted_rounds: u64,
    /// Shift rounds given up in this pass because the other thread did not answer in time, over all CPUs.
    pub timed_out_rounds: u64,
    /// Each check's verdict.
    pub verdicts: Vec<CheckVerdict>,
}

/// A CPU the check could not measure, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkippedCpu {
    /// The CPU id.
    pub cpu: usize,
    /// Why it was skipped (pinning failed, id out of range, ...).
    pub reason: String,
}

/// The measured shift of one CPU's counter against the base CPU's: `counter(cpu) - counter(base)` lies in
/// `[lo_ticks, hi_ticks]`.
///
/// With no completed round the interval is unbounded (`i64::MIN..=i64::MAX`); when `lo_ticks > hi_ticks` the
/// intersection of the rounds' intervals was empty, which no pair of consistent counters can produce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuShift {
    /// The CPU under test.
    pub cpu: usize,
    /// Lower bound of the shift, in ticks.
    pub lo_ticks: i64,
    /// Upper bound of the shift, in ticks.
    pub hi_ticks: i64,
    /// Rounds whose handoff completed within [`ReliabilityOptions::max_probe_width_ns`] and narrowed the
    /// interval.
    ///
    /// [`ReliabilityOptions::max_probe_width_ns`]: crate::ReliabilityOptions::max_probe_width_ns
    pub rounds: u64,
    /// Rounds given up because the other thread did not answer within the handoff timeout.
    pub timed_out_rounds: u64,
    /// Rounds that completed but took longer than [`ReliabilityOptions::max_probe_width_ns`]: interrupted
    /// (preempted) and discarded.
    ///
    /// [`ReliabilityOptions::max_probe_width_ns`]: crate::ReliabilityOptions::max_probe_width_ns
    pub interrupted_rounds: u64,
}

impl CpuShift {
    pub(super) fn unmeasured(cpu: usize) -> Self {
        CpuShift {
            cpu,
            lo_ticks: i64::MIN,
            hi_ticks: i64::MAX,
            rounds: 0,
            timed_out_rounds: 0,
            interrupted_rounds: 0,
        }
    }

    /// Whether at least one round completed.
    pub fn is_measured(&self) -> bool {
        self.rounds > 0
    }

    /// Whether the rounds' intervals had no common point: the counters are inconsistent.
    pub fn is_empty(&self) -> bool {
        self.lo_ticks > self.hi_ticks
    }

    /// Intersects the interval with one round's: the base read `base1`, then this CPU read `current`, then the
    /// base read `base2`, so the shift lies in `[current - base2, current - base1]`.
    pub(super) fn add_round(&mut self, base1: u64, current: u64, base2: u64) {
        self.lo_ticks = self.lo_ticks.max(wrapping_diff(current, base2));
        self.hi_ticks = self.hi_ticks.min(wrapping_diff(current, base1));
        self.rounds += 1;
    }
}

/// One CPU's measured tick rate.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuRate {
    /// The CPU.
    pub cpu: usize,
    /// Ticks per second of `CLOCK_MONOTONIC_RAW`.
    pub hz: f64,
    /// Bound of the rate's measurement error from the two brackets' widths, in ppm.
    pub uncertainty_ppm: f64,
    /// Ticks counted over the interval.
    pub ticks: u64,
    /// The interval, in ns of `CLOCK_MONOTONIC_RAW`.
    pub interval_ns: u64,
    /// Whether the counter advanced over the interval.
    pub advances: bool,
}

/// The result of [`check_tsc_reliability`](crate::check_tsc_reliability): the hints, every number the last pass
/// measured, each pass's verdicts, and the decision over all passes.
///
/// ```
/// let report = tickline::clock::check_tsc_reliability(&tickline::clock::ReliabilityOptions::quick());
/// assert_eq!(report.passes.last().map(|p| p.attempt), Some(report.passes.len() as u32));
/// println!("{report}");
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TscReport {
    /// The hardware counter checked (`None` where the architecture has none tickline reads).
    pub source: Option<TickSource>,
    /// CPUID's invariant-TSC flag (leaf 0x8000_0007 EDX bit 8); `None` off x86_64.
    pub invariant_tsc: Option<bool>,
    /// The kernel's current clocksource (`/sys/devices/system/clocksource/clocksource0/current_clocksource`).
    pub clocksource: Option<String>,
    /// Whether `tsc` is among the kernel's available clocksources; `None` where the file cannot be read.
    pub tsc_clocksource_available: Option<bool>,
    /// The counter's nominal rate where the hardware states it, in Hz.
    pub nominal_hz: Option<u64>,
    /// CPUs the process may run on (`sched_getaffinity`), ascending; empty if that could not be read.
    pub cpus_allowed: Vec<usize>,
    /// The CPUs measured, ascending.
    pub tested_cpus: Vec<usize>,
    /// How many CPUs were measured.
    pub cpus_tested: usize,
    /// CPUs that could not be measured, with the reason.
    pub skipped: Vec<SkippedCpu>,
    /// Remarks about the run (the affinity call failing, a CPU outside the allowed set, ...).
    pub notes: Vec<String>,
    /// The CPU the shifts are measured against (the lowest tested CPU).
    pub base_cpu: Option<usize>,
    /// The shift interval of every tested CPU but the base.
    pub shifts: Vec<CpuShift>,
    /// Bound of the shift between any two tested CPUs' counters, in ticks (0 with one CPU): the width of the
    /// smallest range holding every measured interval and 0. A wide bound is not a shift: see
    /// [`TscReport::proven_shift_ticks`].
    pub max_shift_ticks: u64,
    /// [`TscReport::max_shift_ticks`] in ns at the measured rate.
    pub max_shift_ns: f64,
    /// The shift the intervals prove between some two tested CPUs, in ticks: the largest gap between two of
    /// the intervals (0 included, for the base). 0 when every interval overlaps every other.
    pub proven_shift_ticks: u64,
    /// [`TscReport::proven_shift_ticks`] in ns at the measured rate.
    pub proven_shift_ns: f64,
    /// Whether every shift interval was non-empty.
    pub shift_consistent: bool,
    /// Whether the CAS-ordered sequence of reads (of which there was at least one) never went backwards.
    pub monotonic: bool,
    /// Reads in the CAS-ordered sequence.
    pub monotonic_reads: u64,
    /// Times the sequence passed through every tested CPU and returned to where the loop began.
    pub monotonic_full_loops: u64,
    /// Consecutive reads in the sequence taken on different CPUs.
    pub monotonic_cpu_switches: u64,
    /// Reads in the sequence lower than the read before them.
    pub backward_steps: u64,
    /// The largest amount by which a read fell below an earlier one in the sequence, in ticks.
    pub max_backward_ticks: u64,
    /// The tick rate of every tested CPU.
    pub rates: Vec<CpuRate>,
    /// The mean of the per-CPU rates, in Hz (0 when none was measured).
    pub rate_hz: f64,
    /// `(max - min) / mean` of the per-CPU rates, in ppm.
    pub rate_spread_ppm: f64,
    /// Bound of the spread's measurement error (twice the largest per-CPU uncertainty), in ppm.
    pub rate_uncertainty_ppm: f64,
    /// How long this run of the check took: the passes it ran and the pauses between them. Passes in
    /// [`passes`](Self::passes) from an earlier check of the same process (a quick check when the first
    /// timeline started, then the full one) are not in it; the report's text gives the passes' time in all.
    pub elapsed: Duration,
    /// Every pass's verdicts, first pass first; the numbers above are the last pass's.
    pub passes: Vec<PassSummary>,
    /// What did not reject the counter but should be known: a failure no retry confirmed, checks that stayed
    /// inconclusive (load), passes that contradicted each other.
    pub warnings: Vec<String>,
    /// Use the TSC, or fall back, and why: over all passes.
    pub decision: TscDecision,
}

impl TscReport {
    /// Whether the decision is [`TscDecision::UseTsc`].
    pub fn is_reliable(&self) -> bool {
        self.decision == TscDecision::UseTsc
    }

    /// The time every pass in [`passes`](Self::passes) took, earlier checks' passes included.
    pub fn passes_time(&self) -> Duration {
        self.passes.iter().map(|p| p.elapsed).sum()
    }

    /// A report with the source set and nothing measured yet.
    pub(super) fn empty(source: Option<TickSource>) -> Self {
        TscReport {
            source,
            invariant_tsc: None,
            clocksource: None,
            tsc_clocksource_available: None,
            nominal_hz: None,
            cpus_allowed: Vec::new(),
            tested_cpus: Vec::new(),
            cpus_tested: 0,
            skipped: Vec::new(),
            notes: Vec::new(),
            base_cpu: None,
            shifts: Vec::new(),
            max_shift_ticks: 0,
            max_shift_ns: 0.0,
            proven_shift_ticks: 0,
            proven_shift_ns: 0.0,
            shift_consistent: true,
            monotonic: false,
            monotonic_reads: 0,
            monotonic_full_loops: 0,
            monotonic_cpu_switches: 0,
            backward_steps: 0,
            max_backward_ticks: 0,
            rates: Vec::new(),
            rate_hz: 0.0,
            rate_spread_ppm: 0.0,
            rate_uncertainty_ppm: 0.0,
            elapsed: Duration::ZERO,
            passes: Vec::new(),
            warnings: Vec::new(),
            decision: TscDecision::UseTsc,
        }
    }

    /// Shift rounds discarded as interrupted in the last pass, over all CPUs.
    pub fn interrupted_rounds(&self) -> u64 {
        self.shifts.iter().map(|s| s.interrupted_rounds).sum()
    }

    /// Shift rounds given up (no answer in time) in the last pass, over all CPUs.
    pub fn timed_out_rounds(&self) -> u64 {
        self.shifts.iter().map(|s| s.timed_out_rounds).sum()
    }
}

impl fmt::Display for PassSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pass {} ({:.1} ms):", self.attempt, self.elapsed.as_secs_f64() * 1e3)?;
        for v in &self.verdicts {
            match v.verdict.detail() {
                None => write!(f, " {} {};", v.check.name(), v.verdict.label())?,
                Some(detail) => write!(f, " {} {} ({detail});", v.check.name(), v.verdict.label())?,
            }
        }
        if self.interrupted_rounds > 0 {
            write!(f, " {} interrupted shift rounds discarded", self.interrupted_rounds)?;
        }
        Ok(())
    }
}

impl fmt::Display for TscReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes_no = |b: Option<bool>| match b {
            Some(true) => "yes",
            Some(false) => "no",
            None => "unknown",
        };
        let source = match self.source {
            Some(TickSource::Tsc) => "TSC",
            Some(TickSource::ArmVirtualCounter) => "cntvct_el0",
            Some(TickSource::Monotonic) => "CLOCK_MONOTONIC",
            None => "none",
        };
        writeln!(
            f,
            "TSC reliability check: counter {source}, {} of {} allowed CPUs tested, {} pass(es), {:.1} ms in all",
            self.cpus_tested,
            self.cpus_allowed.len(),
            self.passes.len(),
            self.passes_time().as_secs_f64() * 1e3
        )?;
        writeln!(
            f,
            "  hints:      CPUID invariant TSC: {}; clocksource: {} (tsc available: {})",
            yes_no(self.invariant_tsc),
            self.clocksource.as_deref().unwrap_or("unknown"),
            yes_no(self.tsc_clocksource_available)
        )?;
        writeln!(
            f,
            "  CPUs:       allowed {}; tested {}",
            cpu_list(&self.cpus_allowed),
            cpu_list(&self.tested_cpus)
        )?;
        for s in &self.skipped {
            writeln!(f, "              skipped CPU {}: {}", s.cpu, s.reason)?;
        }
        for note in &self.notes {
            writeln!(f, "              note: {note}")?;
        }
        let base = self.base_cpu.map_or_else(|| "-".to_string(), |b| b.to_string());
        writeln!(
            f,
            "  shift:      at most {} ticks = {:.1} ns, at least {} ticks = {:.1} ns between two CPUs (base CPU {base}{})",
            self.max_shift_ticks,
            self.max_shift_ns,
            self.proven_shift_ticks,
            self.proven_shift_ns,
            if self.shift_consistent { "" } else { "; INCONSISTENT" }
        )?;
        for s in &self.shifts {
            if !s.is_measured() {
                writeln!(
                    f,
                    "              CPU {}: not measured ({} rounds timed out, {} interrupted)",
                    s.cpu, s.timed_out_rounds, s.interrupted_rounds
                )?;
            } else {
                writeln!(
                    f,
                    "              CPU {}: [{}, {}] ticks{} after {} rounds ({} timed out, {} interrupted)",
                    s.cpu,
                    s.lo_ticks,
                    s.hi_ticks,
                    if s.is_empty() { " EMPTY" } else { "" },
                    s.rounds,
                    s.timed_out_rounds,
                    s.interrupted_rounds
                )?;
            }
        }
        writeln!(
            f,
            "  monotonic:  {}: {} reads, {} full loops, {} CPU switches, {} backward steps (max {} ticks)",
            if self.monotonic { "yes" } else { "NO" },
            self.monotonic_reads,
            self.monotonic_full_loops,
            self.monotonic_cpu_switches,
            self.backward_steps,
            self.max_backward_ticks
        )?;
        writeln!(
            f,
            "  rate:       {:.0} Hz mean, spread {:.2} ppm (uncertainty {:.2} ppm){}",
            self.rate_hz,
            self.rate_spread_ppm,
            self.rate_uncertainty_ppm,
            self.nominal_hz
                .map_or_else(String::new, |hz| format!(", nominal {hz} Hz"))
        )?;
        for r in &self.rates {
            writeln!(
                f,
                "              CPU {}: {:.0} Hz ± {:.2} ppm{}",
                r.cpu,
                r.hz,
                r.uncertainty_ppm,
                if r.advances { "" } else { " (does not advance)" }
            )?;
        }
        for p in &self.passes {
            writeln!(f, "  {p}")?;
        }
        for w in &self.warnings {
            writeln!(f, "  warning:    {w}")?;
        }
        write!(f, "  decision:   {}", self.decision)
    }
}

/// `0-3,6,8-9` from ascending CPU ids.
pub(super) fn cpu_list(cpus: &[usize]) -> String {
    if cpus.is_empty() {
        return "none".to_string();
    }
    let mut parts = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_compact() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(cpu_list(&[5]), "5");
        assert_eq!(cpu_list(&[]), "none");
    }

    #[test]
    fn shift_rounds_intersect() {
        let mut shift = CpuShift::unmeasured(1);
        assert!(!shift.is_measured() && !shift.is_empty());
        shift.add_round(1_000, 1_150, 1_200);
        shift.add_round(2_000, 2_110, 2_300);
        assert_eq!((shift.lo_ticks, shift.hi_ticks, shift.rounds), (-50, 110, 2));
    }

    #[test]
    fn report_renders_as_text_and_json() {
        let mut r = TscReport::empty(Some(TickSource::Tsc));
        r.cpus_allowed = vec![0, 1];
        r.tested_cpus = vec![0, 1];
        r.cpus_tested = 2;
        r.base_cpu = Some(0);
        r.shifts = vec![CpuShift {
            cpu: 1,
            lo_ticks: -100,
            hi_ticks: 200,
            rounds: 2000,
            timed_out_rounds: 0,
            interrupted_rounds: 3,
        }];
        r.rates = vec![CpuRate {
            cpu: 1,
            hz: 3e9,
            uncertainty_ppm: 1.0,
            ticks: 60_000_000,
            interval_ns: 20_000_000,
            advances: true,
        }];
        r.skipped.push(SkippedCpu {
            cpu: 4000,
            reason: "beyond CPU_SETSIZE".into(),
        });
        r.passes = vec![PassSummary {
            attempt: 1,
            elapsed: Duration::from_millis(3),
            interrupted_rounds: 3,
            timed_out_rounds: 0,
            verdicts: vec![
                CheckVerdict {
                    check: TscCheck::Shift,
                    verdict: Verdict::Inconclusive("too slow".into()),
                },
                CheckVerdict {
                    check: TscCheck::Rate,
                    verdict: Verdict::Pass,
                },
            ],
        }];
        r.warnings = vec!["the shift stayed inconclusive".into()];
        r.decision = TscDecision::FallBack {
            reason: "because".into(),
        };
        let text = r.to_string();
        assert!(
            text.contains("CPU 1: [-100, 200] ticks after 2000 rounds (0 timed out, 3 interrupted)"),
            "{text}"
        );
        assert!(text.contains("skipped CPU 4000"), "{text}");
        assert!(
            text.contains("pass 1 (3.0 ms): shift inconclusive (too slow); rate pass;"),
            "{text}"
        );
        assert!(text.contains("warning:    the shift stayed inconclusive"), "{text}");
        assert!(text.contains("fall back to clock_gettime: because"), "{text}");
        assert!(!r.is_reliable());
        assert_eq!(r.interrupted_rounds(), 3);
        r.shifts[0] = CpuShift::unmeasured(1);
        assert_eq!(r.interrupted_rounds(), 0);
    }

    #[test]
    fn the_reports_time_is_every_passes_time_as_the_decision_says() {
        // A quick check when the first timeline started (22 ms), the full one later (361 ms, this run).
        let mut r = TscReport::empty(Some(TickSource::Tsc));
        r.passes = [22, 361]
            .iter()
            .enumerate()
            .map(|(k, &ms)| PassSummary {
                attempt: k as u32 + 1,
                elapsed: Duration::from_millis(ms),
                interrupted_rounds: 0,
                timed_out_rounds: 0,
                verdicts: Vec::new(),
            })
            .collect();
        r.elapsed = Duration::from_millis(361);
        let text = r.to_string();
        assert!(text.contains("2 pass(es), 383.0 ms in all"), "{text}");
        assert_eq!(r.passes_time(), Duration::from_millis(383), "the decision's check time");
    }
}
