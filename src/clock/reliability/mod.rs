//! Is the TSC safe to use as this process's clock? The wtmlib method: hints, then measured facts, each pass
//! judged so that a preempted probe is never taken for a broken counter.
//!
//! Hints come from the CPU and the kernel: the CPUID invariant-TSC flag (x86_64) and the kernel's clocksource
//! (the kernel drops a TSC it found unstable from `available_clocksource`). Facts are measured with threads
//! pinned, one CPU at a time, on the CPUs the process may run on:
//!
//! 1. **Rate**: on every CPU, the counter is read between two reads of `CLOCK_MONOTONIC_RAW` at the start and
//!    at the end of a short interval (the tightest of several brackets at each end). The counter must advance,
//!    and every CPU must tick at one rate: the spread across CPUs is reported in ppm. This pass also probes
//!    which CPUs can be pinned at all; the others are reported as skipped, with the reason.
//! 2. **Shift**: for each CPU against a base CPU, a thread on the base reads `base1`, hands off through an
//!    atomic to a thread on the CPU under test, which reads `current` and hands back, and the base reads
//!    `base2`. The shift of that CPU's counter against the base lies in `[current - base2, current - base1]`;
//!    intersecting these intervals over many rounds narrows it. A round wider than
//!    [`ReliabilityOptions::max_probe_width_ns`] was interrupted and is discarded. The smallest range holding all
//!    the intervals and 0 (the base) *bounds* the shift between any two CPUs; the largest gap between two
//!    intervals *proves* a shift. An empty intersection proves the counters inconsistent.
//! 3. **Monotonicity**: threads on every CPU read the counter in one global order enforced by a CAS on a shared
//!    sequence number (load the sequence, read the counter, CAS the sequence forward; only the winner keeps its
//!    read). The resulting sequence must never go backwards; "full loops" count how often it passed through
//!    every CPU and came back, so a pass with few cross-CPU hops is reported as inconclusive, not as a success.
//!
//! Every handoff between threads is bounded by a timeout and the whole check by a time budget: a starved or
//! unpinnable CPU ends a round or is skipped, never hangs or panics the check (container CPU masks with
//! offline or foreign CPUs, quanta#61, risingwave#10235).
//!
//! **Preemption is not evidence.** Each pass gives every check a [`Verdict`]: *fail* only on a measured proof
//! (an empty intersection, a shift proven above the limit, a backward step, a rate spread beyond limit plus
//! uncertainty, a counter that stands still), *inconclusive* for what a busy machine produces (unanswered or
//! interrupted handoffs, a wide bound around 0, too few loops). A measured check rejects the counter only when a
//! second pass fails it too; inconclusive checks are repeated while the budget lasts and, if they never
//! conclude, leave the TSC in use with a warning. Hints (no invariant TSC, the kernel dropped `tsc`) and a
//! machine where no CPU can be pinned decide at once.
//!
//! Files: `options.rs` (what to measure, limits, test hooks), `measure.rs` (one pass, the threads),
//! `analyze.rs` (pure: verdicts and the decision over passes), `report.rs` (the report, text and JSON),
//! `affinity.rs` (pinning).

mod affinity;
mod analyze;
mod measure;
mod options;
mod report;

use std::time::{Duration, Instant};

pub(crate) use analyze::Assessment;
pub(crate) use measure::read_sysfs_line;
pub use options::{InjectedPreemption, ProbeFaults, ProbePhase, ReliabilityOptions};
pub use report::{CheckVerdict, CpuRate, CpuShift, PassSummary, SkippedCpu, TscCheck, TscDecision, TscReport, Verdict};

/// Checks whether the hardware tick counter can serve as this process's clock, and reports the numbers.
///
/// Reads the hints (CPUID invariant TSC, kernel clocksource), then measures, with threads pinned to each CPU
/// the process may run on: every CPU's tick rate, the bound of the shift between CPUs, and a CAS-ordered
/// monotonicity sequence across CPUs (the wtmlib method). Repeats the pass (up to
/// [`ReliabilityOptions::attempts`]) until every check passed or a failure was measured twice. On aarch64 the
/// same measurements apply to `cntvct_el0`. On other architectures, and on operating systems without CPU
/// affinity, it decides [`TscDecision::FallBack`].
///
/// This runs the check afresh each call. A timeline does not: it takes the process's cached decision from
/// [`TscDecider::process`](crate::TscDecider::process).
///
/// Never panics: CPUs that cannot be pinned are skipped with the reason, every wait is bounded, and the whole
/// check is bounded by [`ReliabilityOptions::time_budget_ms`] (plus at most one rate interval).
///
/// ```
/// let report = tickline::clock::check_tsc_reliability(&tickline::clock::ReliabilityOptions::default());
/// println!("{report}");
/// if !report.is_reliable() {
///     // record with tickline::clock::TickSource::Monotonic instead
/// }
/// assert_eq!(report.cpus_tested, report.tested_cpus.len());
/// ```
pub fn check_tsc_reliability(options: &ReliabilityOptions) -> TscReport {
    run_check(options, &mut Assessment::default())
}

/// Runs passes with `options`, adding each to `assessment` (which may hold earlier passes, from an earlier
/// check of the same process), until the assessment is settled, the attempts or the budget are spent, or (with
/// `retry_inconclusive` off) no failure awaits confirmation. Returns the last pass's report with every pass's
/// verdicts and the decision over all of them.
pub(crate) fn run_check(options: &ReliabilityOptions, assessment: &mut Assessment) -> TscReport {
    let started = Instant::now();
    let deadline = started + Duration::from_millis(options.time_budget_ms);
    let mut attempts = 0;
    let mut report = loop {
        attempts += 1;
        let pass_started = Instant::now();
        let report = measure::run_pass(options, deadline);
        assessment.add(PassSummary {
            attempt: assessment.passes().len() as u32 + 1,
            elapsed: pass_started.elapsed(),
            interrupted_rounds: report.interrupted_rounds(),
            timed_out_rounds: report.timed_out_rounds(),
            verdicts: analyze::verdicts(&report, options),
        });
        let outcome = assessment.outcome();
        let wants_retry = outcome.needs_confirmation || options.retry_inconclusive;
        if outcome.settled || !wants_retry || attempts >= options.attempts.max(1) {
            break report;
        }
        let pause = Duration::from_millis(options.retry_pause_ms);
        if Instant::now() + pause >= deadline {
            break report;
        }
        std::thread::sleep(pause);
    };
    let outcome = assessment.outcome();
    report.elapsed = started.elapsed();
    report.passes = assessment.passes().to_vec();
    report.warnings = outcome.warnings;
    report.decision = outcome.decision;
    report
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;
    use crate::clock::TickSource;

    /// The checks pin spinning threads to every CPU: run one at a time, or they measure each other.
    pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

    fn run(options: &ReliabilityOptions) -> TscReport {
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        check_tsc_reliability(options)
    }

    /// Two CPUs this process may pin to, or `None` (the test then skips, saying why).
    pub(crate) fn two_cpus() -> Option<(usize, usize)> {
        if TickSource::hardware().is_none() {
            eprintln!("skipped: no hardware tick counter on this architecture");
            return None;
        }
        match affinity::allowed_cpus().unwrap_or_default()[..] {
            [a, b, ..] => Some((a, b)),
            _ => {
                eprintln!("skipped: needs two CPUs to pin to");
                None
            }
        }
    }

    #[test]
    fn check_runs_and_reports_finite_numbers() {
        // Where the kernel itself clocks with an invariant TSC (this machine), the check must agree.
        let report = run(&ReliabilityOptions::default());
        println!("{report}");
        if TickSource::hardware().is_none() {
            assert!(!report.is_reliable());
            return;
        }
        assert_eq!(report.cpus_tested, report.tested_cpus.len());
        assert!(report.cpus_tested >= 1, "{report}");
        assert!(report.rate_hz.is_finite() && report.rate_hz > 1e6, "{report}");
        assert!(report.max_shift_ns.is_finite(), "{report}");
        assert!(report.proven_shift_ns <= report.max_shift_ns, "{report}");
        assert!(report.rate_spread_ppm.is_finite(), "{report}");
        assert!(!report.passes.is_empty() && report.passes.len() <= 3, "{report}");
        // Typically under 0.1 s here, more with both CPUs saturated; the budget bounds it anyway.
        assert!(
            report.elapsed < Duration::from_secs(4),
            "default check too slow: {report}"
        );
        if report.cpus_tested == 1 {
            assert_eq!(report.max_shift_ticks, 0);
        }
        let kernel_trusts_tsc = report.clocksource.as_deref() == Some("tsc") && report.invariant_tsc == Some(true);
        assert!(
            !kernel_trusts_tsc || report.is_reliable(),
            "the kernel clocks with the TSC but the check falls back: {report}"
        );
    }

    #[test]
    fn quick_check_is_fast() {
        let report = run(&ReliabilityOptions::quick());
        println!("{report}");
        assert!(report.elapsed < Duration::from_millis(500), "{report}");
    }

    #[test]
    fn up_front_check_is_one_short_pass() {
        let report = run(&ReliabilityOptions::up_front());
        println!("{report}");
        // One pass, or two when the first measured a failure that needed confirming.
        assert!(report.passes.len() <= 2, "{report}");
        assert!(report.elapsed < Duration::from_millis(200), "{report}");
    }

    #[test]
    fn unpinnable_cpus_are_skipped_without_panic() {
        let allowed = affinity::allowed_cpus().unwrap_or_default();
        let mut cpus: Vec<usize> = allowed.iter().copied().take(2).collect();
        cpus.extend([1000, 4000]);
        let options = ReliabilityOptions {
            cpus: Some(cpus.clone()),
            ..ReliabilityOptions::quick()
        };
        let report = run(&options);
        println!("{report}");
        let skipped: Vec<usize> = report.skipped.iter().map(|s| s.cpu).collect();
        assert!(skipped.contains(&4000), "{report}");
        for cpu in cpus {
            assert!(
                report.tested_cpus.contains(&cpu) ^ skipped.contains(&cpu),
                "CPU {cpu} neither tested nor skipped: {report}"
            );
        }
        // Far beyond this machine: the kernel refuses the pin.
        if !allowed.contains(&1000) && allowed.len() < 1000 && TickSource::hardware().is_some() {
            assert!(skipped.contains(&1000), "{report}");
        }
        assert_eq!(report.shifts.len(), report.cpus_tested.saturating_sub(1));
    }

    #[test]
    fn only_unpinnable_cpus_fall_back() {
        let options = ReliabilityOptions {
            cpus: Some(vec![4000, 5000]),
            ..ReliabilityOptions::quick()
        };
        let report = run(&options);
        assert_eq!(report.cpus_tested, 0);
        if TickSource::hardware().is_some() {
            assert_eq!(report.skipped.len(), 2);
        }
        // Settled at once: pinning does not get better on a retry.
        assert_eq!(report.passes.len(), 1, "{report}");
        match &report.decision {
            TscDecision::FallBack { reason } => assert!(
                reason.contains("no CPU could be measured") || reason.contains("architecture"),
                "{reason}"
            ),
            TscDecision::UseTsc => panic!("no CPU measured, yet UseTsc: {report}"),
        }
        let _ = report.to_string();
    }

    #[test]
    fn single_cpu_has_zero_shift() {
        let Some(&cpu) = affinity::allowed_cpus().unwrap_or_default().first() else {
            eprintln!("skipped: no CPU affinity here");
            return;
        };
        let options = ReliabilityOptions {
            cpus: Some(vec![cpu]),
            ..ReliabilityOptions::quick()
        };
        let report = run(&options);
        if TickSource::hardware().is_none() {
            return;
        }
        assert_eq!(report.cpus_tested, 1, "{report}");
        assert_eq!(report.max_shift_ticks, 0);
        assert!(report.shifts.is_empty());
        assert_eq!(report.monotonic_full_loops, 0);
        assert!(report.monotonic_reads > 0);
        assert!(report.is_reliable(), "{report}");
    }

    #[test]
    fn an_injected_preemption_keeps_the_tsc() {
        // The issue's failure: a probe preempted for milliseconds in a short shift phase. The 12 ms sleep in
        // the first shift round outlasts the phase's 10 ms limit, so that one round is all the pass gets; the
        // check before issue 14 read its width as a 12 ms shift and fell back.
        let Some((a, b)) = two_cpus() else { return };
        let preempt = InjectedPreemption::new(ProbePhase::Shift, Duration::from_millis(12), 1);
        let options = ReliabilityOptions {
            cpus: Some(vec![a, b]),
            faults: ProbeFaults {
                preempt: Some(preempt.clone()),
                shifted_cpu: None,
            },
            ..ReliabilityOptions::quick()
        };
        let report = run(&options);
        println!("{report}");
        assert_eq!(preempt.remaining(), 0, "the preemption was injected");
        // The held round comes back 12 ms wide (interrupted), or, when load kept the tested thread from
        // answering meanwhile, is given up (timed out); either way it is not evidence.
        let first = &report.passes[0];
        assert!(first.interrupted_rounds + first.timed_out_rounds >= 1, "{report}");
        assert!(
            report.is_reliable(),
            "an injected preemption made the check fall back: {report}"
        );
        assert!(!report.decision.to_string().contains("shift"), "{report}");
    }

    #[test]
    fn an_injected_stall_of_the_sequence_keeps_the_tsc() {
        // One thread of the CAS-ordered sequence stalls 40 ms after a read, longer than the quick check's 30 ms
        // sequence: the sequence loops only until then, too few loops to conclude, which is no reason to fall back.
        let Some((a, b)) = two_cpus() else { return };
        let options = ReliabilityOptions {
            cpus: Some(vec![a, b]),
            faults: ProbeFaults {
                preempt: Some(InjectedPreemption::new(
                    ProbePhase::Monotonic,
                    Duration::from_millis(40),
                    1,
                )),
                shifted_cpu: None,
            },
            ..ReliabilityOptions::quick()
        };
        let report = run(&options);
        println!("{report}");
        assert!(report.is_reliable(), "{report}");
    }

    #[test]
    fn a_shifted_tsc_falls_back_with_its_reason() {
        // CPU b's counter reads 100 µs ahead of CPU a's (at any rate from 1 to 10 GHz that is 1e5..1e6 ticks;
        // 2.6e5 here): a truly unusable TSC. The check must fall back, and say why, in words and numbers.
        let Some((a, b)) = two_cpus() else { return };
        let rate_hz = crate::clock::TickSource::hardware()
            .and_then(TickSource::nominal_hz)
            .unwrap_or(2_600_000_000) as f64;
        let options = ReliabilityOptions {
            cpus: Some(vec![a, b]),
            faults: ProbeFaults {
                preempt: None,
                shifted_cpu: Some((b, (100e-6 * rate_hz) as i64)),
            },
            ..ReliabilityOptions::quick()
        };
        let report = run(&options);
        println!("{report}");
        let TscDecision::FallBack { reason } = &report.decision else {
            panic!("a shifted TSC was accepted: {report}");
        };
        assert!(
            reason.contains("TSC shift between CPUs is at least") || reason.contains("went backwards"),
            "{reason}"
        );
        assert!(reason.contains("measured in 2 of 2 passes"), "{reason}");
        // The numbers: the report's intervals are the last pass's, whose handoffs may all time out on a loaded
        // machine; then an earlier pass's failed shift check states the proven shift.
        let shift_failed_with_numbers = report.passes.iter().flat_map(|p| &p.verdicts).any(|v| {
            v.check == TscCheck::Shift
                && matches!(&v.verdict, Verdict::Fail(why) if why.contains("TSC shift between CPUs is at least"))
        });
        assert!(
            report.proven_shift_ns > 10_000.0 || shift_failed_with_numbers,
            "{report}"
        );
    }
}
