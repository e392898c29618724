//! Pure analysis: numbers in, verdicts and decisions out; nothing here reads a clock or starts a thread.
//!
//! Each pass gets one [`Verdict`] per [`TscCheck`]. Only a measured *proof* fails a check: an empty shift
//! intersection, shift intervals that lie apart by more than the limit, a backward step in the CAS-ordered
//! sequence, a rate spread beyond limit + uncertainty, a counter that does not advance. What preemption
//! produces (unanswered handoffs, interrupted rounds, wide intervals, few loops) makes a check inconclusive,
//! which is no evidence against the counter. Across passes ([`Assessment`]), a measured check rejects the
//! counter only when two passes fail it; a pass that passes it outweighs one failure.

use super::options::ReliabilityOptions;
use super::report::{CheckVerdict, CpuShift, PassSummary, TscCheck, TscDecision, TscReport, Verdict};
use crate::clock::TickSource;

/// `a - b` as a signed difference, correct across wrap-around for differences within ±2^63.
pub(super) fn wrapping_diff(a: u64, b: u64) -> i64 {
    a.wrapping_sub(b) as i64
}

/// Width of the smallest range holding every measured shift interval and 0 (the base CPU): a bound on the shift
/// between any two of the CPUs. 0 with no measured interval.
pub(super) fn enclosing_shift_ticks(shifts: &[CpuShift]) -> u64 {
    let (mut lo, mut hi) = (0i128, 0i128);
    for s in shifts.iter().filter(|s| s.is_measured()) {
        // An empty interval's bounds are crossed; the range still spans both.
        lo = lo.min(i128::from(s.lo_ticks.min(s.hi_ticks)));
        hi = hi.max(i128::from(s.hi_ticks.max(s.lo_ticks)));
    }
    u64::try_from(hi - lo).unwrap_or(u64::MAX)
}

/// The shift the measured intervals prove between some two CPUs: each CPU's shift against the base lies in its
/// interval (the base's is `[0, 0]`), so two CPUs differ by at least the gap between their intervals. The
/// largest gap is `max(lo) - min(hi)` over the non-empty intervals, or 0 when they all overlap. Empty intervals
/// are left out: they are evidence of their own.
pub(super) fn proven_shift_ticks(shifts: &[CpuShift]) -> u64 {
    let (mut max_lo, mut min_hi) = (0i128, 0i128);
    for s in shifts.iter().filter(|s| s.is_measured() && !s.is_empty()) {
        max_lo = max_lo.max(i128::from(s.lo_ticks));
        min_hi = min_hi.min(i128::from(s.hi_ticks));
    }
    u64::try_from((max_lo - min_hi).max(0)).unwrap_or(u64::MAX)
}

/// What a CAS-ordered sequence of reads shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct SequenceStats {
    pub(super) reads: u64,
    pub(super) backward_steps: u64,
    pub(super) max_backward_ticks: u64,
    pub(super) full_loops: u64,
    pub(super) cpu_switches: u64,
}

/// Analyses `(counter, cpu index < cpus)` reads in sequence order: a backward step is a read lower than the one
/// before it, measured against the highest read so far; a full loop ends each time the sequence is back on the
/// CPU where the loop began after visiting all `cpus` CPUs (none with fewer than 2 CPUs).
pub(super) fn analyze_sequence(sequence: &[(u64, usize)], cpus: usize) -> SequenceStats {
    let mut stats = SequenceStats {
        reads: sequence.len() as u64,
        ..SequenceStats::default()
    };
    let Some(&(first_ticks, first_cpu)) = sequence.first() else {
        return stats;
    };
    let mut seen = vec![false; cpus];
    let mut seen_count = 0;
    mark(&mut seen, &mut seen_count, first_cpu);
    let mut loop_start = first_cpu;
    let (mut previous, mut highest, mut previous_cpu) = (first_ticks, first_ticks, first_cpu);
    for &(ticks, cpu) in &sequence[1..] {
        if ticks < previous {
            stats.backward_steps += 1;
        }
        if ticks < highest {
            stats.max_backward_ticks = stats.max_backward_ticks.max(highest - ticks);
        }
        highest = highest.max(ticks);
        previous = ticks;
        if cpu != previous_cpu {
            stats.cpu_switches += 1;
        }
        previous_cpu = cpu;
        mark(&mut seen, &mut seen_count, cpu);
        if cpus >= 2 && cpu == loop_start && seen_count == cpus {
            stats.full_loops += 1;
            seen.iter_mut().for_each(|s| *s = false);
            seen_count = 0;
            mark(&mut seen, &mut seen_count, cpu);
            loop_start = cpu;
        }
    }
    stats
}

/// Marks `cpu` as visited in this loop, counting it the first time.
fn mark(seen: &mut [bool], seen_count: &mut usize, cpu: usize) {
    if let Some(slot) = seen.get_mut(cpu) {
        if !*slot {
            *slot = true;
            *seen_count += 1;
        }
    }
}

/// `(max - min) / mean` of the rates, in ppm; 0 for fewer than two.
pub(super) fn rate_spread_ppm(hz: &[f64]) -> f64 {
    if hz.len() < 2 {
        return 0.0;
    }
    let mean = hz.iter().sum::<f64>() / hz.len() as f64;
    let (min, max) = hz.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| {
        (lo.min(x), hi.max(x))
    });
    if mean > 0.0 {
        (max - min) / mean * 1e6
    } else {
        f64::INFINITY
    }
}

/// One pass's verdict for every check, from the report's hints and numbers.
pub(super) fn verdicts(report: &TscReport, options: &ReliabilityOptions) -> Vec<CheckVerdict> {
    let verdict = |check, verdict| CheckVerdict { check, verdict };
    let Some(source) = report.source else {
        return vec![verdict(
            TscCheck::Hints,
            Verdict::Fail("no hardware tick counter on this architecture (not x86_64/aarch64)".to_string()),
        )];
    };
    let mut out = vec![verdict(TscCheck::Hints, hints_verdict(report, options, source))];
    if report.cpus_tested == 0 {
        let why = report.skipped.first().map_or_else(
            || {
                report
                    .notes
                    .first()
                    .cloned()
                    .unwrap_or_else(|| "no CPU to test".to_string())
            },
            |s| format!("CPU {}: {}", s.cpu, s.reason),
        );
        out.push(verdict(
            TscCheck::Cpus,
            Verdict::Fail(format!("no CPU could be measured ({why})")),
        ));
        return out;
    }
    out.push(verdict(TscCheck::Cpus, Verdict::Pass));
    out.push(verdict(TscCheck::Rate, rate_verdict(report, options)));
    out.push(verdict(TscCheck::Shift, shift_verdict(report, options)));
    out.push(verdict(TscCheck::Monotonic, monotonic_verdict(report, options)));
    out
}

fn hints_verdict(report: &TscReport, options: &ReliabilityOptions, source: TickSource) -> Verdict {
    let mut reasons = Vec::new();
    if options.require_invariant_tsc && report.invariant_tsc == Some(false) {
        reasons.push("CPUID reports no invariant TSC".to_string());
    }
    if source == TickSource::Tsc && options.trust_kernel_clocksource && report.tsc_clocksource_available == Some(false)
    {
        reasons.push(format!(
            "the kernel does not list tsc among its clocksources (current: {}); it removes a TSC it found unstable",
            report.clocksource.as_deref().unwrap_or("unknown")
        ));
    }
    fail_or_pass(reasons)
}

fn rate_verdict(report: &TscReport, options: &ReliabilityOptions) -> Verdict {
    let stuck: Vec<String> = report
        .rates
        .iter()
        .filter(|r| !r.advances)
        .map(|r| format!("the counter does not advance on CPU {}", r.cpu))
        .collect();
    if !stuck.is_empty() {
        return fail_or_pass(stuck);
    }
    if report.rate_hz.is_nan() || report.rate_hz <= 0.0 {
        return Verdict::Inconclusive("the tick rate could not be measured".to_string());
    }
    if report.rate_spread_ppm > options.max_rate_spread_ppm + report.rate_uncertainty_ppm {
        return Verdict::Fail(format!(
            "rates differ by {:.0} ppm across CPUs (limit {} ppm + {:.1} ppm measurement uncertainty)",
            report.rate_spread_ppm, options.max_rate_spread_ppm, report.rate_uncertainty_ppm
        ));
    }
    Verdict::Pass
}

fn shift_verdict(report: &TscReport, options: &ReliabilityOptions) -> Verdict {
    let base = report.base_cpu.map_or_else(|| "-".to_string(), |b| b.to_string());
    let limit = options.max_shift_limit_ns as f64;
    let inconsistent: Vec<String> = report
        .shifts
        .iter()
        .filter(|s| s.is_measured() && s.is_empty())
        .map(|s| {
            format!(
                "the TSCs of CPU {} and CPU {base} are inconsistent: the shift intervals do not intersect ({} > {} ticks)",
                s.cpu, s.lo_ticks, s.hi_ticks
            )
        })
        .collect();
    if !inconsistent.is_empty() {
        return fail_or_pass(inconsistent);
    }
    if report.proven_shift_ns.is_finite() && report.proven_shift_ns > limit {
        let intervals: Vec<String> = report
            .shifts
            .iter()
            .filter(|s| s.is_measured())
            .map(|s| format!("CPU {}: [{}, {}]", s.cpu, s.lo_ticks, s.hi_ticks))
            .collect();
        return Verdict::Fail(format!(
            "TSC shift between CPUs is at least {:.0} ns (limit {} ns; shift against CPU {base} in ticks: {})",
            report.proven_shift_ns,
            options.max_shift_limit_ns,
            intervals.join(", ")
        ));
    }
    let unmeasured: Vec<String> = report
        .shifts
        .iter()
        .filter(|s| !s.is_measured())
        .map(|s| {
            format!(
                "the TSC shift of CPU {} against CPU {base} could not be measured ({} handoffs timed out, {} interrupted)",
                s.cpu, s.timed_out_rounds, s.interrupted_rounds
            )
        })
        .collect();
    if !unmeasured.is_empty() {
        return Verdict::Inconclusive(unmeasured.join("; "));
    }
    if report.max_shift_ns.is_nan() {
        return Verdict::Inconclusive("the shift could not be converted to ns: no tick rate was measured".to_string());
    }
    if report.max_shift_ns > limit {
        return Verdict::Inconclusive(format!(
            "the TSC shift between CPUs is at most {:.0} ns, more than the {} ns limit, but at least only {:.0} ns: \
             the handoffs were too slow to tell",
            report.max_shift_ns, options.max_shift_limit_ns, report.proven_shift_ns
        ));
    }
    Verdict::Pass
}

fn monotonic_verdict(report: &TscReport, options: &ReliabilityOptions) -> Verdict {
    if report.backward_steps > 0 {
        return Verdict::Fail(format!(
            "TSC went backwards {} times (max {} ticks)",
            report.backward_steps, report.max_backward_ticks
        ));
    }
    if report.monotonic_reads == 0 {
        return Verdict::Inconclusive("the monotonicity check made no reads".to_string());
    }
    if report.cpus_tested > 1 && report.monotonic_full_loops < options.min_full_loops {
        return Verdict::Inconclusive(format!(
            "monotonicity check inconclusive: only {} full loops across CPUs (need {})",
            report.monotonic_full_loops, options.min_full_loops
        ));
    }
    Verdict::Pass
}

fn fail_or_pass(reasons: Vec<String>) -> Verdict {
    if reasons.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(reasons.join("; "))
    }
}

/// The checks measured by pinned threads: a failure needs a second pass to count.
const MEASURED: [TscCheck; 3] = [TscCheck::Rate, TscCheck::Shift, TscCheck::Monotonic];

/// The evidence of every pass so far, and the decision it supports.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Assessment {
    passes: Vec<PassSummary>,
}

/// What the passes so far support.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Outcome {
    /// Fall back only on a hint, on no measurable CPU, or on a measured failure that a second pass repeated.
    pub(crate) decision: TscDecision,
    /// No further pass can change the decision: it fell back, or every check passed.
    pub(crate) settled: bool,
    /// A check failed once and has neither been repeated nor refuted: a retry is owed even when inconclusive
    /// passes are not retried.
    pub(crate) needs_confirmation: bool,
    /// What the decision does not show: unconfirmed or refuted failures, checks that stayed inconclusive.
    pub(crate) warnings: Vec<String>,
}

impl Assessment {
    /// Adds one pass's verdicts.
    pub(crate) fn add(&mut self, pass: PassSummary) {
        self.passes.push(pass);
    }

    /// Every pass so far, first first.
    pub(crate) fn passes(&self) -> &[PassSummary] {
        &self.passes
    }

    /// The decision the passes so far support.
    pub(crate) fn outcome(&self) -> Outcome {
        let n = self.passes.len();
        let mut reasons = Vec::new();
        let mut warnings = Vec::new();
        let mut settled = true;
        let mut needs_confirmation = false;
        if n == 0 {
            return Outcome {
                decision: TscDecision::UseTsc,
                settled: false,
                needs_confirmation: false,
                warnings: vec!["the TSC has not been checked yet".to_string()],
            };
        }
        // Hints and pinning do not change from pass to pass: the latest pass says.
        for check in [TscCheck::Hints, TscCheck::Cpus] {
            if let Some(Verdict::Fail(reason)) = self.latest(check) {
                reasons.push(reason.clone());
            }
        }
        if !reasons.is_empty() {
            return Outcome {
                decision: TscDecision::FallBack {
                    reason: reasons.join("; "),
                },
                settled: true,
                needs_confirmation: false,
                warnings,
            };
        }
        for check in MEASURED {
            let verdicts: Vec<(u32, &Verdict)> = self
                .passes
                .iter()
                .filter_map(|p| {
                    p.verdicts
                        .iter()
                        .find(|v| v.check == check)
                        .map(|v| (p.attempt, &v.verdict))
                })
                .collect();
            let fails: Vec<(u32, &str)> = verdicts
                .iter()
                .filter_map(|&(a, v)| match v {
                    Verdict::Fail(reason) => Some((a, reason.as_str())),
                    _ => None,
                })
                .collect();
            let passed: Vec<u32> = verdicts
                .iter()
                .filter(|(_, v)| **v == Verdict::Pass)
                .map(|&(a, _)| a)
                .collect();
            if let [.., (_, latest)] = fails[..] {
                if fails.len() >= 2 {
                    reasons.push(format!("{latest} (measured in {} of {n} passes)", fails.len()));
                    continue;
                }
            }
            match (fails.first(), passed.first()) {
                (Some(&(failed_in, reason)), Some(&passed_in)) => warnings.push(format!(
                    "pass {failed_in} measured: {reason}; not confirmed: pass {passed_in} passed the {} check",
                    check.name()
                )),
                (Some(&(failed_in, reason)), None) => {
                    settled = false;
                    needs_confirmation = true;
                    warnings.push(format!(
                        "not confirmed by a retry yet: pass {failed_in} measured: {reason}"
                    ));
                }
                (None, Some(_)) => {}
                (None, None) => {
                    settled = false;
                    let latest = verdicts
                        .iter()
                        .rev()
                        .find_map(|(_, v)| v.detail())
                        .unwrap_or("not measured");
                    warnings.push(format!(
                        "the {} check was inconclusive in {} pass(es): {latest}",
                        check.name(),
                        verdicts.len().max(1)
                    ));
                }
            }
        }
        if reasons.is_empty() {
            Outcome {
                decision: TscDecision::UseTsc,
                settled,
                needs_confirmation,
                warnings,
            }
        } else {
            Outcome {
                decision: TscDecision::FallBack {
                    reason: reasons.join("; "),
                },
                settled: true,
                needs_confirmation: false,
                warnings,
            }
        }
    }

    fn latest(&self, check: TscCheck) -> Option<&Verdict> {
        self.passes
            .iter()
            .rev()
            .find_map(|p| p.verdicts.iter().find(|v| v.check == check))
            .map(|v| &v.verdict)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::reliability::report::{CpuRate, SkippedCpu};

    fn shift_of(rounds: &[(u64, u64, u64)]) -> CpuShift {
        let mut shift = CpuShift::unmeasured(1);
        for &(base1, current, base2) in rounds {
            shift.add_round(base1, current, base2);
        }
        shift
    }

    #[test]
    fn intersection_narrows_to_the_true_shift() {
        // True shift +100: the tested CPU reads base-time + 100. Each round the base brackets the read.
        let rounds = [(1_000, 1_150, 1_200), (2_000, 2_110, 2_300), (3_000, 3_180, 3_090)];
        let shift = shift_of(&rounds);
        // Intervals [-50, 150], [-190, 110], [90, 180] -> [90, 110].
        assert_eq!((shift.lo_ticks, shift.hi_ticks), (90, 110));
        assert!(shift.is_measured() && !shift.is_empty());
        assert_eq!(shift.rounds, 3);
        assert_eq!(enclosing_shift_ticks(std::slice::from_ref(&shift)), 110);
        // [90, 110] lies 90 ticks from the base's 0: that much is proven.
        assert_eq!(proven_shift_ticks(std::slice::from_ref(&shift)), 90);

        // A negative shift on another CPU widens the bound to span both, with 0 in between.
        let mut other = shift_of(&[(5_000, 4_950, 5_020)]); // [-70, -50]
        other.cpu = 2;
        assert_eq!(enclosing_shift_ticks(&[shift.clone(), other.clone()]), 180);
        // Between CPU 1 [90, 110] and CPU 2 [-70, -50]: at least 90 - (-50) = 140.
        assert_eq!(proven_shift_ticks(&[shift, other]), 140);
    }

    #[test]
    fn a_wide_interval_around_zero_proves_nothing() {
        // One round preempted for 12 ms (3e7 ticks at 2.5 GHz): the old check read its width as a 12 ms shift.
        let wide = shift_of(&[(0, 5_000_000, 30_000_000)]);
        assert_eq!(enclosing_shift_ticks(std::slice::from_ref(&wide)), 30_000_000);
        assert_eq!(proven_shift_ticks(&[wide]), 0);
    }

    #[test]
    fn intersection_across_wraparound() {
        let shift = shift_of(&[(u64::MAX - 10, 5, 20)]);
        // current - base2 = -15, current - base1 = 16.
        assert_eq!((shift.lo_ticks, shift.hi_ticks), (-15, 16));
    }

    #[test]
    fn disjoint_intervals_are_empty() {
        // [0, 10] then [20, 30]: no common shift, the counters are inconsistent.
        let shift = shift_of(&[(100, 110, 110), (200, 230, 210)]);
        assert!(shift.is_empty(), "{shift:?}");
        assert_eq!(enclosing_shift_ticks(std::slice::from_ref(&shift)), 20);
        assert_eq!(
            proven_shift_ticks(&[shift]),
            0,
            "empty intervals are evidence of their own"
        );
        // The base going backwards between its own two reads empties the interval by itself.
        assert!(shift_of(&[(500, 400, 300)]).is_empty());
    }

    #[test]
    fn unmeasured_shift_is_ignored_by_the_bounds() {
        assert_eq!(enclosing_shift_ticks(&[CpuShift::unmeasured(3)]), 0);
        assert_eq!(proven_shift_ticks(&[CpuShift::unmeasured(3)]), 0);
        assert_eq!(enclosing_shift_ticks(&[]), 0);
        assert!(!CpuShift::unmeasured(3).is_empty());
    }

    #[test]
    fn sequence_loops_and_switches() {
        let seq: Vec<(u64, usize)> = (0..10).map(|i| (100 + i as u64, i % 2)).collect();
        let stats = analyze_sequence(&seq, 2);
        assert_eq!(stats.reads, 10);
        assert_eq!(stats.backward_steps, 0);
        assert_eq!(stats.max_backward_ticks, 0);
        assert_eq!(stats.cpu_switches, 9);
        // 0 1 0 | 1 0 | 1 0 | 1 0 | 1: back on CPU 0 after visiting both, four times.
        assert_eq!(stats.full_loops, 4);

        // Three CPUs: 0 0 1 1 2 0 closes one loop, 2 1 0 a second.
        let seq = [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2), (6, 0), (7, 2), (8, 1), (9, 0)];
        let stats = analyze_sequence(&seq, 3);
        assert_eq!(stats.full_loops, 2);
        assert_eq!(stats.cpu_switches, 6);

        // One CPU: no loops by definition.
        assert_eq!(analyze_sequence(&[(1, 0), (2, 0)], 1).full_loops, 0);
        assert_eq!(analyze_sequence(&[], 2), SequenceStats::default());
    }

    #[test]
    fn sequence_backward_steps() {
        let seq = [(100, 0), (200, 1), (150, 0), (180, 1), (300, 0), (290, 1)];
        let stats = analyze_sequence(&seq, 2);
        assert_eq!(stats.backward_steps, 2);
        // 150 fell 50 below 200; 180 is still 20 below 200; 290 fell 10 below 300.
        assert_eq!(stats.max_backward_ticks, 50);
        // Equal reads are not backward.
        assert_eq!(analyze_sequence(&[(5, 0), (5, 1)], 2).backward_steps, 0);
    }

    #[test]
    fn spread_math() {
        assert_eq!(rate_spread_ppm(&[3e9]), 0.0);
        let spread = rate_spread_ppm(&[3e9, 3e9 * (1.0 + 300e-6)]);
        assert!((spread - 300.0).abs() < 0.1, "{spread}");
    }

    /// A report of a healthy two-CPU x86_64 machine at 3 GHz, to break one fact at a time.
    fn healthy() -> TscReport {
        let mut r = TscReport::empty(Some(TickSource::Tsc));
        r.invariant_tsc = Some(true);
        r.clocksource = Some("tsc".into());
        r.tsc_clocksource_available = Some(true);
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
            interrupted_rounds: 0,
        }];
        r.max_shift_ticks = 300;
        r.max_shift_ns = 100.0;
        r.monotonic = true;
        r.monotonic_reads = 100_000;
        r.monotonic_full_loops = 40_000;
        r.monotonic_cpu_switches = 80_000;
        let rate = |cpu| CpuRate {
            cpu,
            hz: 3e9,
            uncertainty_ppm: 1.0,
            ticks: 60_000_000,
            interval_ns: 20_000_000,
            advances: true,
        };
        r.rates = vec![rate(0), rate(1)];
        r.rate_hz = 3e9;
        r.rate_spread_ppm = 0.5;
        r.rate_uncertainty_ppm = 2.0;
        r
    }

    fn verdict_of(report: &TscReport, check: TscCheck) -> Verdict {
        verdicts(report, &ReliabilityOptions::default())
            .into_iter()
            .find(|v| v.check == check)
            .map(|v| v.verdict)
            .unwrap_or_else(|| panic!("no {check:?} verdict"))
    }

    fn fail_reason(report: &TscReport, check: TscCheck) -> String {
        match verdict_of(report, check) {
            Verdict::Fail(reason) => reason,
            other => panic!("{check:?} did not fail: {other:?}"),
        }
    }

    fn inconclusive(report: &TscReport, check: TscCheck) -> String {
        match verdict_of(report, check) {
            Verdict::Inconclusive(why) => why,
            other => panic!("{check:?} not inconclusive: {other:?}"),
        }
    }

    #[test]
    fn healthy_passes_every_check() {
        let v = verdicts(&healthy(), &ReliabilityOptions::default());
        assert_eq!(v.len(), 5);
        assert!(v.iter().all(|v| v.verdict == Verdict::Pass), "{v:?}");
        // Hints that are merely unknown are no reason to fall back.
        let mut r = healthy();
        r.invariant_tsc = None;
        r.clocksource = None;
        r.tsc_clocksource_available = None;
        assert_eq!(verdict_of(&r, TscCheck::Hints), Verdict::Pass);
        // Another current clocksource is fine while tsc is still offered.
        r.clocksource = Some("kvm-clock".into());
        r.tsc_clocksource_available = Some(true);
        assert_eq!(verdict_of(&r, TscCheck::Hints), Verdict::Pass);
    }

    #[test]
    fn proofs_fail_their_check() {
        // Intervals 36,000 ticks = 12 µs away from 0: a proven shift.
        let mut r = healthy();
        r.shifts[0].lo_ticks = 36_000;
        r.shifts[0].hi_ticks = 36_300;
        r.proven_shift_ticks = 36_000;
        r.proven_shift_ns = 12_000.0;
        r.max_shift_ticks = 36_300;
        r.max_shift_ns = 12_100.0;
        let reason = fail_reason(&r, TscCheck::Shift);
        assert!(
            reason.contains("TSC shift between CPUs is at least 12000 ns (limit 1000 ns; shift against CPU 0 in ticks: CPU 1: [36000, 36300])"),
            "{reason}"
        );

        let mut r = healthy();
        r.shifts[0].lo_ticks = 20;
        r.shifts[0].hi_ticks = 10;
        assert!(fail_reason(&r, TscCheck::Shift).contains("do not intersect (20 > 10 ticks)"));

        let mut r = healthy();
        r.backward_steps = 3;
        r.max_backward_ticks = 500;
        r.monotonic = false;
        assert_eq!(
            fail_reason(&r, TscCheck::Monotonic),
            "TSC went backwards 3 times (max 500 ticks)"
        );

        let mut r = healthy();
        r.rate_spread_ppm = 300.0;
        assert!(fail_reason(&r, TscCheck::Rate).contains("rates differ by 300 ppm across CPUs"));
        // A spread within the measurement uncertainty is not evidence.
        r.rate_uncertainty_ppm = 400.0;
        assert_eq!(verdict_of(&r, TscCheck::Rate), Verdict::Pass);

        let mut r = healthy();
        r.rates[1].advances = false;
        assert_eq!(fail_reason(&r, TscCheck::Rate), "the counter does not advance on CPU 1");
    }

    #[test]
    fn what_preemption_produces_is_inconclusive() {
        // The 12 ms "shift" of the issue: one interrupted-wide interval around 0.
        let mut r = healthy();
        r.shifts[0].lo_ticks = -6_000_000;
        r.shifts[0].hi_ticks = 30_000_000;
        r.max_shift_ticks = 36_000_000;
        r.max_shift_ns = 12_000_000.0;
        assert!(inconclusive(&r, TscCheck::Shift).contains("at most 12000000 ns"));

        // "4 handoffs timed out": no round at all.
        let mut r = healthy();
        r.shifts[0] = CpuShift {
            timed_out_rounds: 4,
            interrupted_rounds: 2,
            ..CpuShift::unmeasured(1)
        };
        assert!(
            inconclusive(&r, TscCheck::Shift).contains("could not be measured (4 handoffs timed out, 2 interrupted)")
        );

        // "only 5 full loops".
        let mut r = healthy();
        r.monotonic_full_loops = 5;
        assert!(inconclusive(&r, TscCheck::Monotonic).contains("only 5 full loops across CPUs (need 100)"));

        let mut r = healthy();
        r.monotonic_reads = 0;
        assert!(inconclusive(&r, TscCheck::Monotonic).contains("no reads"));

        let mut r = healthy();
        r.rate_hz = 0.0;
        assert!(inconclusive(&r, TscCheck::Rate).contains("rate could not be measured"));
    }

    #[test]
    fn hints_and_cpus_fail_for_good() {
        let mut r = healthy();
        r.invariant_tsc = Some(false);
        assert_eq!(fail_reason(&r, TscCheck::Hints), "CPUID reports no invariant TSC");
        let lenient = ReliabilityOptions {
            require_invariant_tsc: false,
            ..ReliabilityOptions::default()
        };
        assert!(verdicts(&r, &lenient).iter().all(|v| v.verdict == Verdict::Pass));

        let mut r = healthy();
        r.tsc_clocksource_available = Some(false);
        r.clocksource = Some("hpet".into());
        assert!(fail_reason(&r, TscCheck::Hints).contains("does not list tsc among its clocksources (current: hpet)"));
        // The TSC hint does not apply to the ARM counter.
        r.source = Some(TickSource::ArmVirtualCounter);
        assert_eq!(verdict_of(&r, TscCheck::Hints), Verdict::Pass);

        let mut r = healthy();
        r.tested_cpus.clear();
        r.cpus_tested = 0;
        r.skipped = vec![SkippedCpu {
            cpu: 7,
            reason: "sched_setaffinity(CPU 7) failed: Invalid argument".into(),
        }];
        assert!(fail_reason(&r, TscCheck::Cpus).contains("no CPU could be measured (CPU 7: sched_setaffinity"));

        let r = TscReport::empty(None);
        assert_eq!(
            fail_reason(&r, TscCheck::Hints),
            "no hardware tick counter on this architecture (not x86_64/aarch64)"
        );
    }

    fn pass(attempt: u32, verdicts: &[(TscCheck, Verdict)]) -> PassSummary {
        PassSummary {
            attempt,
            elapsed: Duration::from_millis(1),
            interrupted_rounds: 0,
            timed_out_rounds: 0,
            verdicts: verdicts
                .iter()
                .map(|(check, verdict)| CheckVerdict {
                    check: *check,
                    verdict: verdict.clone(),
                })
                .collect(),
        }
    }

    fn all(shift: Verdict, monotonic: Verdict) -> Vec<(TscCheck, Verdict)> {
        vec![
            (TscCheck::Hints, Verdict::Pass),
            (TscCheck::Cpus, Verdict::Pass),
            (TscCheck::Rate, Verdict::Pass),
            (TscCheck::Shift, shift),
            (TscCheck::Monotonic, monotonic),
        ]
    }

    #[test]
    fn a_failure_needs_a_second_pass() {
        let shifted = Verdict::Fail("TSC shift between CPUs is at least 5000 ns".into());
        let mut a = Assessment::default();
        assert!(!a.outcome().settled);
        a.add(pass(1, &all(shifted.clone(), Verdict::Pass)));
        let o = a.outcome();
        assert_eq!(o.decision, TscDecision::UseTsc);
        assert!(!o.settled && o.needs_confirmation, "{o:?}");
        assert!(
            o.warnings[0].contains("not confirmed by a retry yet: pass 1 measured: TSC shift"),
            "{o:?}"
        );

        // Inconclusive retries leave it unconfirmed: still the TSC.
        a.add(pass(2, &all(Verdict::Inconclusive("slow".into()), Verdict::Pass)));
        assert_eq!(a.outcome().decision, TscDecision::UseTsc);
        assert!(a.outcome().needs_confirmation);

        // Measured again: rejected, settled.
        a.add(pass(3, &all(shifted.clone(), Verdict::Pass)));
        let o = a.outcome();
        assert!(o.settled && !o.needs_confirmation);
        assert_eq!(
            o.decision,
            TscDecision::FallBack {
                reason: "TSC shift between CPUs is at least 5000 ns (measured in 2 of 3 passes)".into()
            }
        );
    }

    #[test]
    fn a_passing_retry_refutes_one_failure() {
        let mut a = Assessment::default();
        a.add(pass(
            1,
            &all(
                Verdict::Pass,
                Verdict::Fail("TSC went backwards 1 times (max 9 ticks)".into()),
            ),
        ));
        a.add(pass(2, &all(Verdict::Pass, Verdict::Pass)));
        let o = a.outcome();
        assert_eq!(o.decision, TscDecision::UseTsc);
        assert!(o.settled, "{o:?}");
        assert_eq!(
            o.warnings,
            vec!["pass 1 measured: TSC went backwards 1 times (max 9 ticks); not confirmed: pass 2 passed the monotonic check"]
        );
    }

    #[test]
    fn inconclusive_passes_keep_the_tsc_and_say_so() {
        let mut a = Assessment::default();
        for attempt in 1..=3 {
            a.add(pass(
                attempt,
                &all(
                    Verdict::Inconclusive("the TSC shift of CPU 1 against CPU 0 could not be measured".into()),
                    Verdict::Inconclusive("only 5 full loops".into()),
                ),
            ));
        }
        let o = a.outcome();
        assert_eq!(o.decision, TscDecision::UseTsc);
        assert!(!o.settled && !o.needs_confirmation);
        assert_eq!(o.warnings.len(), 2);
        assert!(
            o.warnings[0].starts_with("the shift check was inconclusive in 3 pass(es)"),
            "{o:?}"
        );
        assert!(o.warnings[1].contains("only 5 full loops"), "{o:?}");
    }

    #[test]
    fn hints_settle_at_once() {
        let mut a = Assessment::default();
        let mut verdicts = all(Verdict::Pass, Verdict::Pass);
        verdicts[0].1 = Verdict::Fail("CPUID reports no invariant TSC".into());
        a.add(pass(1, &verdicts));
        let o = a.outcome();
        assert!(o.settled);
        assert_eq!(
            o.decision,
            TscDecision::FallBack {
                reason: "CPUID reports no invariant TSC".into()
            }
        );
    }
}
