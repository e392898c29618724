//! The process's CPU tick-source decision: made once, cheaply, at the first timeline start; settled by the full
//! reliability check in the background; cached for every later start.
//!
//! # The window between the first start and the final decision
//!
//! The first [`TscDecider::decide`] starts a thread (`tickline-clock-check`, once per process) that runs the short
//! [`ReliabilityOptions::up_front`] check (2-3 ms on a quiet machine), then the full check, repeating passes
//! that load kept from concluding, and publishes the [`DecisionStage::Final`] decision (a new
//! [`TickSourceDecision::revision`]). The first `decide` waits for the up-front report at most its budget plus
//! 5 ms (20 ms, during which it measures the calibrator's rate baseline anyway) and returns a
//! [`DecisionStage::Provisional`] decision from it; on a machine too busy for the check's pinned threads to get
//! a CPU in that time it returns a provisional TSC without a report, with a warning saying so.
//!
//! A timeline keeps the tick source it started with for its whole life: the raw ticks in its rings carry no
//! source tag, and a switch under a running ring would leave some records unconvertible. So:
//!
//! - **Final agrees** (the usual case): nothing changes.
//! - **Final rejects the TSC a running timeline records with**: that timeline keeps recording the TSC and
//!   converts its records with the TSC's calibration, as before; its trace states the measured problem
//!   ([`TickSourceDecision::note_for_timeline`]). Only timelines started afterwards record `CLOCK_MONOTONIC`.
//!   A rejection needs a measured failure repeated on a retry (a shift proven above the limit, a backward step,
//!   a rate spread), so the note carries real numbers, never a preempted probe.
//! - **Final clears a TSC the up-front check rejected**: cannot happen, a rejection is final at once (it was
//!   confirmed on a retry before the start returned).
//!
//! A rejection is final at once and starts no background check: hints that rule the TSC out (no invariant TSC,
//! the kernel dropped it), a machine where no CPU can be pinned, an architecture without a counter, and a
//! measured failure the up-front check repeated on its own retry. A TSC the up-front check accepts (or could not
//! judge, under load) is provisional until the full check has run.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::calibrator::measure_rate_while;
use super::reliability::{run_check, Assessment, ReliabilityOptions, TscDecision, TscReport};
use super::{TickSource, TscCalibratorConfig};

/// How settled a [`TickSourceDecision`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecisionStage {
    /// From the hints and the short up-front check; the full check is still running in the background.
    Provisional,
    /// The full check has finished, or the hints, a confirmed failure or the source set by the application
    /// decided at once. It will not change for the rest of the process.
    Final,
}

impl DecisionStage {
    /// `"provisional"` or `"final"`.
    ///
    /// ```
    /// assert_eq!(tickline::clock::DecisionStage::Final.name(), "final");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            DecisionStage::Provisional => "provisional",
            DecisionStage::Final => "final",
        }
    }
}

/// The figures behind a [`TickSourceDecision`], for a trace's metadata and `tickline stats`. Numbers are the
/// last pass's unless said otherwise; `NaN` where nothing was measured (and two `NaN`s compare equal here, so
/// that a decision equals its clone).
#[derive(Clone, Copy, Debug)]
pub struct DecisionFigures {
    /// Passes of the reliability check so far (up-front and full).
    pub passes: u32,
    /// Time spent in those passes.
    pub check_time: Duration,
    /// CPUs measured.
    pub cpus_tested: usize,
    /// Bound on the shift between any two CPUs' counters, in ns.
    pub max_shift_ns: f64,
    /// Shift proven between some two CPUs' counters, in ns.
    pub proven_shift_ns: f64,
    /// The shift limit applied, in ns.
    pub shift_limit_ns: u64,
    /// Mean tick rate over the CPUs, in Hz (against `CLOCK_MONOTONIC_RAW`).
    pub rate_hz: f64,
    /// Spread of the per-CPU rates, in ppm.
    pub rate_spread_ppm: f64,
    /// Reads in the CAS-ordered monotonicity sequence.
    pub monotonic_reads: u64,
    /// Full loops of that sequence across every CPU.
    pub monotonic_full_loops: u64,
    /// Backward steps in that sequence.
    pub backward_steps: u64,
    /// Shift rounds discarded as interrupted (preempted), over every pass.
    pub interrupted_rounds: u64,
}

impl PartialEq for DecisionFigures {
    fn eq(&self, other: &Self) -> bool {
        let same = |a: f64, b: f64| a.to_bits() == b.to_bits();
        self.passes == other.passes
            && self.check_time == other.check_time
            && self.cpus_tested == other.cpus_tested
            && same(self.max_shift_ns, other.max_shift_ns)
            && same(self.proven_shift_ns, other.proven_shift_ns)
            && self.shift_limit_ns == other.shift_limit_ns
            && same(self.rate_hz, other.rate_hz)
            && same(self.rate_spread_ppm, other.rate_spread_ppm)
            && self.monotonic_reads == other.monotonic_reads
            && self.monotonic_full_loops == other.monotonic_full_loops
            && self.backward_steps == other.backward_steps
            && self.interrupted_rounds == other.interrupted_rounds
    }
}

impl DecisionFigures {
    fn none() -> Self {
        DecisionFigures {
            passes: 0,
            check_time: Duration::ZERO,
            cpus_tested: 0,
            max_shift_ns: f64::NAN,
            proven_shift_ns: f64::NAN,
            shift_limit_ns: 0,
            rate_hz: f64::NAN,
            rate_spread_ppm: f64::NAN,
            monotonic_reads: 0,
            monotonic_full_loops: 0,
            backward_steps: 0,
            interrupted_rounds: 0,
        }
    }

    fn from_report(report: &TscReport, shift_limit_ns: u64) -> Self {
        DecisionFigures {
            passes: report.passes.len() as u32,
            check_time: report.passes_time(),
            cpus_tested: report.cpus_tested,
            max_shift_ns: report.max_shift_ns,
            proven_shift_ns: report.proven_shift_ns,
            shift_limit_ns,
            rate_hz: if report.rate_hz > 0.0 { report.rate_hz } else { f64::NAN },
            rate_spread_ppm: report.rate_spread_ppm,
            monotonic_reads: report.monotonic_reads,
            monotonic_full_loops: report.monotonic_full_loops,
            backward_steps: report.backward_steps,
            interrupted_rounds: report.passes.iter().map(|p| p.interrupted_rounds).sum(),
        }
    }
}

/// Which CPU tick source this process's timelines record with, why, how settled that is, and the measured
/// figures: what a trace states on its process track, what `tickline stats` and `tickline clock` print.
///
/// ```
/// let decision = tickline::clock::TscDecider::process().decide();
/// println!("{decision}");
/// if let Some(reason) = &decision.fallback_reason {
///     eprintln!("tickline records CLOCK_MONOTONIC: {reason}");
/// }
/// assert_eq!(decision.is_fallback(), decision.fallback_reason.is_some());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TickSourceDecision {
    /// The counter timelines started now record with.
    pub source: TickSource,
    /// The hardware counter that was checked; `None` where the architecture has none tickline reads.
    pub hardware: Option<TickSource>,
    /// Why the hardware counter is not used, for a human, with the measured numbers; `None` when it is used or
    /// when the application set the source.
    pub fallback_reason: Option<String>,
    /// Provisional (the full check is still running) or final.
    pub stage: DecisionStage,
    /// The application set the source ([`TimelineBuilder::tick_source`](crate::TimelineBuilder::tick_source)):
    /// nothing was checked.
    pub forced: bool,
    /// What did not change the decision but should be known: checks that load kept inconclusive, a failure
    /// no retry confirmed, the full check not starting.
    pub warnings: Vec<String>,
    /// The measured figures.
    pub figures: DecisionFigures,
    /// 0 for the first decision of the process; each change (provisional to final) adds 1.
    pub revision: u64,
    report: Option<Arc<TscReport>>,
}

impl TickSourceDecision {
    /// The decision for a source the application set: final, nothing checked, no reason.
    ///
    /// ```
    /// let d = tickline::clock::TickSourceDecision::forced(tickline::clock::TickSource::Monotonic);
    /// assert!(d.forced && d.fallback_reason.is_none());
    /// assert_eq!(d.summary(), "CLOCK_MONOTONIC (set by the application; not checked)");
    /// ```
    pub fn forced(source: TickSource) -> Self {
        TickSourceDecision {
            source,
            hardware: TickSource::hardware(),
            fallback_reason: None,
            stage: DecisionStage::Final,
            forced: true,
            warnings: Vec::new(),
            figures: DecisionFigures::none(),
            revision: 0,
            report: None,
        }
    }

    fn without_hardware() -> Self {
        TickSourceDecision {
            source: TickSource::Monotonic,
            hardware: None,
            fallback_reason: Some("no hardware tick counter on this architecture (not x86_64/aarch64)".to_string()),
            stage: DecisionStage::Final,
            forced: false,
            warnings: Vec::new(),
            figures: DecisionFigures::none(),
            revision: 0,
            report: None,
        }
    }

    /// Provisional, the hardware counter, before any check reported: the first start stopped waiting for the
    /// up-front check after `waited`.
    fn not_checked_yet(hardware: TickSource, waited: Duration) -> Self {
        TickSourceDecision {
            source: hardware,
            hardware: Some(hardware),
            fallback_reason: None,
            stage: DecisionStage::Provisional,
            forced: false,
            warnings: vec![format!(
                "the up-front check had not reported after {} ms (the machine is busy): the {} is used until the \
                 full check, running in the background, decides",
                waited.as_millis(),
                source_name(hardware)
            )],
            figures: DecisionFigures::none(),
            revision: 0,
            report: None,
        }
    }

    fn from_check(hardware: TickSource, report: TscReport, stage: DecisionStage, shift_limit_ns: u64) -> Self {
        let (source, fallback_reason) = match &report.decision {
            TscDecision::UseTsc => (hardware, None),
            TscDecision::FallBack { reason } => (TickSource::Monotonic, Some(reason.clone())),
        };
        TickSourceDecision {
            source,
            hardware: Some(hardware),
            fallback_reason,
            stage,
            forced: false,
            warnings: report.warnings.clone(),
            figures: DecisionFigures::from_report(&report, shift_limit_ns),
            revision: 0,
            report: Some(Arc::new(report)),
        }
    }

    /// Whether timelines record `CLOCK_MONOTONIC` because the hardware counter was rejected (or is missing).
    pub fn is_fallback(&self) -> bool {
        self.fallback_reason.is_some()
    }

    /// Whether the decision will not change any more.
    pub fn is_final(&self) -> bool {
        self.stage == DecisionStage::Final
    }

    /// The report of the last check behind the decision, every pass's verdicts included; `None` when nothing
    /// was checked.
    pub fn report(&self) -> Option<&TscReport> {
        self.report.as_deref()
    }

    /// One line: the source, the stage and, on a fallback, the reason. For a process-track annotation and the
    /// `tickline stats` line.
    ///
    /// ```
    /// let d = tickline::clock::TscDecider::process().decide();
    /// assert!(d.summary().starts_with(tickline::clock::source_name(d.source)));
    /// ```
    pub fn summary(&self) -> String {
        let name = source_name(self.source);
        if self.forced {
            return format!("{name} (set by the application; not checked)");
        }
        match &self.fallback_reason {
            Some(reason) if self.hardware.is_some() => format!(
                "{name} ({}): the {} was rejected: {reason}",
                self.stage.name(),
                self.hardware.map_or("counter", source_name)
            ),
            Some(reason) => format!("{name} ({}): {reason}", self.stage.name()),
            None if self.warnings.is_empty() => format!("{name} ({})", self.stage.name()),
            None => format!("{name} ({}; {} warning(s))", self.stage.name(), self.warnings.len()),
        }
    }

    /// The measured figures in one line, e.g. `shift between CPUs at most 210 ns, at least 0 ns (limit 1000 ns);
    /// ...`; `None` when nothing was measured.
    pub fn figures_line(&self) -> Option<String> {
        let f = &self.figures;
        if f.passes == 0 {
            return None;
        }
        let mut line = format!(
            "{} CPU(s); shift between CPUs at most {:.0} ns, at least {:.0} ns (limit {} ns); rate {:.0} Hz, \
             spread {:.2} ppm across CPUs; {} backward steps in {} CAS-ordered reads ({} full loops)",
            f.cpus_tested,
            f.max_shift_ns,
            f.proven_shift_ns,
            f.shift_limit_ns,
            f.rate_hz,
            f.rate_spread_ppm,
            f.backward_steps,
            f.monotonic_reads,
            f.monotonic_full_loops
        );
        if f.interrupted_rounds > 0 {
            line.push_str(&format!(
                "; {} interrupted shift rounds discarded",
                f.interrupted_rounds
            ));
        }
        Some(line)
    }

    /// What a timeline that records with `in_use` (the source it started with) must state in its trace, given
    /// this (newer) decision: `Some` when the decision changed under it, `None` when it agrees.
    ///
    /// ```
    /// # use tickline::clock::{TickSource, TickSourceDecision};
    /// let d = TickSourceDecision::forced(TickSource::Monotonic);
    /// assert_eq!(d.note_for_timeline(TickSource::Monotonic), None);
    /// ```
    pub fn note_for_timeline(&self, in_use: TickSource) -> Option<String> {
        if self.forced || in_use == self.source {
            return None;
        }
        let in_use_name = source_name(in_use);
        match &self.fallback_reason {
            Some(reason) => Some(format!(
                "the full clock check rejected the {in_use_name} after this timeline started: {reason}. This \
                 timeline keeps recording the {in_use_name} (a running ring never switches source), so its times \
                 on different CPUs may disagree by that much; timelines started from now on record {}",
                source_name(self.source)
            )),
            None => Some(format!(
                "the full clock check cleared the {} after this timeline started with {in_use_name}; this timeline \
                 keeps {in_use_name}, timelines started from now on record the {}",
                source_name(self.source),
                source_name(self.source)
            )),
        }
    }
}

impl fmt::Display for TickSourceDecision {
    /// Several lines: the summary, the figures, each warning. The full report is [`TickSourceDecision::report`].
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CPU tick source: {}", self.summary())?;
        if self.figures.passes > 0 {
            write!(
                f,
                "\n  checked:  {} pass(es), {:.1} ms in all",
                self.figures.passes,
                self.figures.check_time.as_secs_f64() * 1e3
            )?;
        }
        if let Some(line) = self.figures_line() {
            write!(f, "\n  measured: {line}")?;
        }
        for w in &self.warnings {
            write!(f, "\n  warning:  {w}")?;
        }
        Ok(())
    }
}

/// A tick source's name for humans: `TSC`, `cntvct_el0` or `CLOCK_MONOTONIC`.
///
/// ```
/// assert_eq!(tickline::clock::source_name(tickline::clock::TickSource::Tsc), "TSC");
/// ```
pub fn source_name(source: TickSource) -> &'static str {
    match source {
        TickSource::Tsc => "TSC",
        TickSource::ArmVirtualCounter => "cntvct_el0",
        TickSource::Monotonic => "CLOCK_MONOTONIC",
    }
}

/// How a [`TscDecider`] checks.
#[derive(Clone, Debug, PartialEq)]
pub struct DeciderOptions {
    /// The check the first [`TscDecider::decide`] waits for ([`ReliabilityOptions::up_front`]).
    pub up_front: ReliabilityOptions,
    /// The check that settles the decision afterwards: [`ReliabilityOptions::default`] with 5 attempts in a 5 s
    /// budget, so that a busy machine gets several chances to conclude.
    pub full: ReliabilityOptions,
    /// Run the full check on a background thread (the default); `false` runs it inside the first `decide`,
    /// which then returns the final decision (for tools that want it at once, and tests).
    pub background: bool,
}

impl Default for DeciderOptions {
    fn default() -> Self {
        DeciderOptions {
            up_front: ReliabilityOptions::up_front(),
            full: ReliabilityOptions {
                attempts: 5,
                time_budget_ms: 5_000,
                ..ReliabilityOptions::default()
            },
            background: true,
        }
    }
}

/// Makes the tick-source decision once and caches it: the first [`TscDecider::decide`] runs the short up-front
/// check and starts the full one in the background; every later call returns the cached decision (a lock and a
/// clone, no check). [`TscDecider::process`] is the process's own, the one timelines and `tickline clock` use.
///
/// ```
/// use std::time::Duration;
/// let decider = tickline::clock::TscDecider::process();
/// let first = decider.decide();
/// let settled = decider.wait_final(Duration::from_secs(10));
/// assert!(settled.revision >= first.revision);
/// if let Some(note) = settled.note_for_timeline(first.source) {
///     println!("a timeline started with {:?} must say: {note}", first.source);
/// }
/// ```
#[derive(Clone)]
pub struct TscDecider {
    inner: Arc<Inner>,
}

struct Inner {
    options: DeciderOptions,
    state: Mutex<State>,
    changed: Condvar,
    revision: AtomicU64,
}

struct State {
    decision: Option<TickSourceDecision>,
    assessment: Assessment,
}

impl fmt::Debug for TscDecider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TscDecider")
            .field("options", &self.inner.options)
            .field("decision", &self.current())
            .finish()
    }
}

impl TscDecider {
    /// A decider of its own, with its own cache (tests, tools). Timelines use [`TscDecider::process`].
    ///
    /// ```
    /// let decider = tickline::clock::TscDecider::new(tickline::clock::DeciderOptions {
    ///     background: false,
    ///     ..tickline::clock::DeciderOptions::default()
    /// });
    /// assert!(decider.decide().is_final());
    /// ```
    pub fn new(options: DeciderOptions) -> Self {
        TscDecider {
            inner: Arc::new(Inner {
                options,
                state: Mutex::new(State {
                    decision: None,
                    assessment: Assessment::default(),
                }),
                changed: Condvar::new(),
                revision: AtomicU64::new(0),
            }),
        }
    }

    /// The process's decider, with [`DeciderOptions::default`].
    pub fn process() -> &'static TscDecider {
        static PROCESS: OnceLock<TscDecider> = OnceLock::new();
        PROCESS.get_or_init(|| TscDecider::new(DeciderOptions::default()))
    }

    /// The decision for a timeline starting now. The first call checks (the up-front check, 2-3 ms on a quiet
    /// machine; callers racing it wait for it) and starts the full check; later calls return the cached decision.
    ///
    /// When the hardware counter is used, the first call also takes 20 ms: it measures the counter's rate over
    /// the calibrator's startup baseline while the up-front check runs, so that the first
    /// [`TscCalibrator`](crate::TscCalibrator) of the process (a timeline's) starts from that rate instead of
    /// sleeping for it afterwards.
    pub fn decide(&self) -> TickSourceDecision {
        let mut state = self.inner.lock();
        if let Some(decision) = &state.decision {
            return decision.clone();
        }
        let Some(hardware) = TickSource::hardware() else {
            let decision = TickSourceDecision::without_hardware();
            state.decision = Some(decision.clone());
            self.inner.changed.notify_all();
            return decision;
        };
        let baseline = TscCalibratorConfig::default().startup_baseline;
        let wanted = |report: &Option<TscReport>| report.as_ref().is_none_or(|r| r.decision == TscDecision::UseTsc);
        if self.inner.options.background {
            // The check's own thread runs the up-front check, then the full one. This thread waits for the
            // up-front report only as long as its budget (plus slack): on a machine so busy that the check's
            // pinned threads do not get a CPU in time, the start goes on with the TSC, provisionally.
            let (tx, rx) = mpsc::sync_channel(1);
            let inner = self.inner.clone();
            let spawned = std::thread::Builder::new()
                .name("tickline-clock-check".into())
                .spawn(move || inner.check_in_background(hardware, tx));
            if spawned.is_ok() {
                let wait = Duration::from_millis(self.inner.options.up_front.time_budget_ms) + UP_FRONT_SLACK;
                // The first calibrator's rate baseline (20 ms) is measured meanwhile, so the first timeline start
                // waits for the longer of the two, not for both.
                let report = measure_rate_while(hardware, baseline, || rx.recv_timeout(wait).ok(), wanted);
                let decision = match report {
                    Some(report) => self.inner.up_front_decision(hardware, report),
                    None => TickSourceDecision::not_checked_yet(hardware, wait),
                };
                state.decision = Some(decision.clone());
                self.inner.changed.notify_all();
                return decision;
            }
        }
        // No background thread (asked for, or it could not start): both checks here.
        let options = &self.inner.options.up_front;
        let assessment = &mut state.assessment;
        let report = measure_rate_while(hardware, baseline, || Some(run_check(options, assessment)), wanted)
            .expect("run inline");
        let decision = self.inner.up_front_decision(hardware, report);
        state.decision = Some(decision.clone());
        self.inner.changed.notify_all();
        if decision.is_final() {
            return decision;
        }
        drop(state);
        self.inner.finish();
        self.current().unwrap_or(decision)
    }

    /// The decision so far, without checking anything: `None` before the first [`TscDecider::decide`].
    pub fn current(&self) -> Option<TickSourceDecision> {
        self.inner.lock().decision.clone()
    }

    /// Counts decision changes: a collector compares it with the revision its timeline started with, each poll,
    /// at the cost of one atomic load, and looks at [`TscDecider::current`] only when it moved.
    pub fn revision(&self) -> u64 {
        // Acquire: pairs with the Release in `Inner::publish`, so a reader that sees the new revision finds the
        // new decision under the lock (the lock orders it anyway; this keeps the counter honest on its own).
        self.inner.revision.load(Ordering::Acquire)
    }

    /// Decides if nothing was decided yet, then waits at most `timeout` for the decision to become final, and
    /// returns the decision as it then stands (still provisional if the timeout passed first).
    pub fn wait_final(&self, timeout: Duration) -> TickSourceDecision {
        let mut decision = self.decide();
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        loop {
            if let Some(d) = &state.decision {
                decision = d.clone();
                if d.is_final() {
                    return decision;
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return decision;
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }
}

/// How much longer than the up-front check's own budget a first start waits for it.
const UP_FRONT_SLACK: Duration = Duration::from_millis(5);

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves a consistent state (every write is one assignment).
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The decision from the up-front report: a rejection it confirmed on its retry is final; anything else
    /// waits for the full check, which measures longer (a 20 ms rate interval, 25x the rounds and reads).
    fn up_front_decision(&self, hardware: TickSource, report: TscReport) -> TickSourceDecision {
        let stage = match report.decision {
            TscDecision::FallBack { .. } => DecisionStage::Final,
            TscDecision::UseTsc => DecisionStage::Provisional,
        };
        TickSourceDecision::from_check(hardware, report, stage, self.options.up_front.max_shift_limit_ns)
    }

    /// The check's thread: the up-front check (its report to `up_front`, where the first start may still be
    /// waiting), then, unless that settled it, the full check; publishes the final decision.
    fn check_in_background(&self, hardware: TickSource, up_front: mpsc::SyncSender<TscReport>) {
        let mut assessment = Assessment::default();
        let report = run_check(&self.options.up_front, &mut assessment);
        // An error: the first start stopped waiting. The report still counts below.
        let _ = up_front.send(report.clone());
        let report = if report.decision == TscDecision::UseTsc {
            run_check(&self.options.full, &mut assessment)
        } else {
            report
        };
        self.publish(
            TickSourceDecision::from_check(
                hardware,
                report,
                DecisionStage::Final,
                self.options.full.max_shift_limit_ns,
            ),
            assessment,
        );
    }

    /// Runs the full check on top of the up-front passes in `State::assessment` and publishes the final
    /// decision (the decider without a background thread).
    fn finish(&self) {
        let mut assessment = self.lock().assessment.clone();
        let Some(hardware) = TickSource::hardware() else {
            return;
        };
        let options = &self.options.full;
        let report = run_check(options, &mut assessment);
        self.publish(
            TickSourceDecision::from_check(hardware, report, DecisionStage::Final, options.max_shift_limit_ns),
            assessment,
        );
    }

    /// Makes `decision` (final) the process's, with a new revision, unless a final decision is already there (the
    /// first start took a confirmed rejection from the up-front report itself).
    fn publish(&self, mut decision: TickSourceDecision, assessment: Assessment) {
        let mut state = self.lock();
        state.assessment = assessment;
        if state.decision.as_ref().is_some_and(TickSourceDecision::is_final) {
            return;
        }
        // Release: pairs with the Acquire in `TscDecider::revision`.
        decision.revision = self.revision.fetch_add(1, Ordering::Release) + 1;
        state.decision = Some(decision);
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::reliability::tests::{two_cpus, SERIAL};
    use crate::clock::reliability::{InjectedPreemption, ProbeFaults, ProbePhase};

    /// A decider with the default up-front check and, to keep the tests short, the quick check (3 attempts) as
    /// its full check.
    fn decider(faults: ProbeFaults, background: bool) -> TscDecider {
        TscDecider::new(DeciderOptions {
            up_front: ReliabilityOptions {
                faults: faults.clone(),
                ..ReliabilityOptions::up_front()
            },
            full: ReliabilityOptions {
                faults,
                attempts: 3,
                ..ReliabilityOptions::quick()
            },
            background,
        })
    }

    #[test]
    fn the_decision_is_cached() {
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let decider = decider(ProbeFaults::default(), true);
        assert!(decider.current().is_none());
        let first = decider.decide();
        println!("{first}");
        let started = Instant::now();
        let again = decider.decide();
        let cached = started.elapsed();
        // The same decision (or the final one, if the background check was that quick).
        assert!(
            again == first || again.revision > first.revision,
            "{first:?}\n{again:?}"
        );
        assert!(cached < Duration::from_millis(5), "a cached decision took {cached:?}");
        let settled = decider.wait_final(Duration::from_secs(20));
        println!("{settled}");
        assert!(settled.is_final(), "{settled:?}");
        assert_eq!(decider.revision(), settled.revision);
        assert_eq!(decider.decide(), settled);
        if let Some(hardware) = TickSource::hardware() {
            let report = settled.report().expect("checked");
            assert_eq!(settled.figures.passes as usize, report.passes.len());
            if first.stage == DecisionStage::Provisional {
                assert_eq!(settled.revision, 1);
                assert!(report.passes.len() >= 2, "up-front and full passes: {report}");
            }
            if settled.source == hardware {
                assert!(settled.fallback_reason.is_none());
                assert!(settled.note_for_timeline(hardware).is_none());
            }
        }
    }

    #[test]
    fn an_injected_preemption_keeps_the_tsc_for_the_timeline_and_after() {
        // The up-front check's first shift round is held 12 ms, more than its whole budget: the old start-up
        // check read such a round as a 12 ms shift. The decision must stay the TSC, provisional and final.
        if two_cpus().is_none() {
            return;
        }
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let preempt = InjectedPreemption::new(ProbePhase::Shift, Duration::from_millis(12), 1);
        let decider = decider(
            ProbeFaults {
                preempt: Some(preempt.clone()),
                shifted_cpu: None,
            },
            true,
        );
        let first = decider.decide();
        println!("{first}");
        assert_eq!(Some(first.source), TickSource::hardware(), "{first}");
        let settled = decider.wait_final(Duration::from_secs(20));
        println!("{settled}");
        assert_eq!(preempt.remaining(), 0, "the preemption was injected");
        // The held round was interrupted (or, under load, given up): in whichever pass ran the first shift round.
        let report = settled.report().expect("checked");
        assert!(
            report
                .passes
                .iter()
                .any(|p| p.interrupted_rounds + p.timed_out_rounds >= 1),
            "{report}"
        );
        assert!(settled.is_final());
        assert_eq!(Some(settled.source), TickSource::hardware(), "{settled}");
        assert_eq!(settled.note_for_timeline(first.source), None);
    }

    #[test]
    fn a_shifted_tsc_falls_back_loudly() {
        // A truly unusable TSC: CPU b reads 200 µs ahead. It must fall back, final, before the start returns (the
        // up-front check confirms it on its own retry), with a reason a human can read.
        let Some((_, b)) = two_cpus() else { return };
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let decider = decider(
            ProbeFaults {
                preempt: None,
                shifted_cpu: Some((b, 520_000)),
            },
            true,
        );
        let decision = decider.wait_final(Duration::from_secs(20));
        println!("{decision}");
        assert!(decision.is_final());
        assert_eq!(decision.source, TickSource::Monotonic);
        let reason = decision.fallback_reason.as_deref().expect("a reason");
        assert!(
            reason.contains("TSC shift between CPUs is at least") || reason.contains("went backwards"),
            "{reason}"
        );
        assert!(
            decision.summary().contains("the TSC was rejected: "),
            "{}",
            decision.summary()
        );
        assert!(
            decision
                .to_string()
                .starts_with("CPU tick source: CLOCK_MONOTONIC (final)"),
            "{decision}"
        );
        assert!(decision.is_fallback());
        // A timeline that had started with the TSC would have to say so in its trace.
        let note = decision.note_for_timeline(TickSource::Tsc).expect("a note");
        assert!(
            note.contains("keeps recording the TSC") && note.contains(reason),
            "{note}"
        );
    }

    #[test]
    fn a_synchronous_decider_returns_the_final_decision() {
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let decider = decider(ProbeFaults::default(), false);
        let decision = decider.decide();
        assert!(decision.is_final(), "{decision:?}");
        assert_eq!(decider.decide(), decision);
    }

    #[test]
    fn notes_for_a_running_timeline() {
        let mut d = TickSourceDecision::forced(TickSource::Tsc);
        d.forced = false;
        d.hardware = Some(TickSource::Tsc);
        assert_eq!(d.note_for_timeline(TickSource::Tsc), None);
        let note = d
            .note_for_timeline(TickSource::Monotonic)
            .expect("cleared after the start");
        assert!(note.contains("cleared the TSC"), "{note}");
        d.source = TickSource::Monotonic;
        d.fallback_reason = Some("TSC went backwards 3 times (max 500 ticks) (measured in 2 of 2 passes)".into());
        let note = d.note_for_timeline(TickSource::Tsc).expect("rejected after the start");
        assert!(
            note.starts_with("the full clock check rejected the TSC after this timeline started: TSC went backwards"),
            "{note}"
        );
        assert_eq!(
            d.summary(),
            "CLOCK_MONOTONIC (final): the TSC was rejected: TSC went backwards 3 times (max 500 ticks) (measured in 2 of 2 passes)"
        );
        assert_eq!(d.figures_line(), None);
        assert!(d.is_final());
        assert!(!d.figures.rate_hz.is_finite() || d.figures.rate_hz == 0.0);
    }
}
