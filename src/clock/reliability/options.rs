//! [`ReliabilityOptions`]: how much the check measures, the limits it applies, how often it retries; and the
//! fault hooks its tests inject ([`ProbeFaults`]).

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Options of [`check_tsc_reliability`](crate::check_tsc_reliability): how much to measure, the limits the
/// decision applies, and how often a pass is repeated before the evidence counts.
///
/// The defaults finish in roughly 0.1 s on a quiet 2-CPU machine; [`ReliabilityOptions::quick`] in a few ms,
/// [`ReliabilityOptions::up_front`] in about 1-2 ms (the check a process's first timeline waits for).
///
/// ```
/// let options = tickline::clock::ReliabilityOptions {
///     max_shift_limit_ns: 500,
///     ..tickline::clock::ReliabilityOptions::default()
/// };
/// assert_eq!(options.attempts, 3);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct ReliabilityOptions {
    /// CPUs to test instead of all the CPUs the process may run on (`sched_getaffinity`). Ids the process cannot
    /// pin a thread to (offline, outside its cpuset, 1024 or above) are reported as skipped, with the reason.
    pub cpus: Option<Vec<usize>>,
    /// Handoff rounds per CPU for the shift measurement (each round is a few hundred ns).
    pub shift_rounds: u32,
    /// Time limit of the shift measurement of one CPU, in ms.
    pub shift_time_limit_ms: u64,
    /// Counter reads per CPU in the CAS-ordered monotonicity sequence (the total is capped at 1,000,000).
    pub monotonic_reads_per_cpu: u64,
    /// Time limit of the monotonicity sequence, in ms.
    pub monotonic_time_limit_ms: u64,
    /// Full loops (the sequence passing through every tested CPU and returning) needed for the monotonicity
    /// check to count as meaningful when more than one CPU is tested. Fewer make the pass inconclusive, which is
    /// never a reason to fall back by itself.
    pub min_full_loops: u64,
    /// Interval over which each CPU's tick rate is measured against `CLOCK_MONOTONIC_RAW`, in ms.
    pub rate_interval_ms: u64,
    /// Bracketed reads taken at each end of the rate interval; the tightest bracket is kept.
    pub rate_bracket_samples: u32,
    /// How long one thread waits for another at a handoff before giving the round up, in µs.
    pub handoff_timeout_us: u64,
    /// How long a thread waits for its peers to start and pin themselves, in ms.
    pub thread_start_timeout_ms: u64,
    /// Time budget of the whole check (every pass), in ms: what was not measured within it is reported as
    /// inconclusive.
    pub time_budget_ms: u64,
    /// A shift round whose bracket (base read, handoff there and back, base read) took longer than this, in ns,
    /// was interrupted (preempted, descheduled, a hypervisor exit): it is discarded and counted in
    /// [`CpuShift::interrupted_rounds`](crate::CpuShift::interrupted_rounds), never used as evidence.
    ///
    /// 20 µs by default: an uninterrupted round trip between two cores takes 0.1-2 µs (more under a
    /// hypervisor), a preemption takes a scheduler tick or more (1-10 ms).
    pub max_probe_width_ns: u64,
    /// The largest acceptable shift between any two CPUs' counters, in ns.
    ///
    /// 1 µs by default: healthy systems measure a bound of 50–500 ns (mostly the cross-core handoff latency the
    /// method cannot see below, more under a hypervisor), while unsynchronised TSCs are typically off by many
    /// µs to ms (per-socket reset, resume, a BIOS writing the TSC). 1 µs is also below the resolution at which a
    /// timeline of CPU and GPU activity is read, so a shift under it is harmless.
    ///
    /// The check fails a pass only when the measured intervals *prove* a shift above this limit; a bound above
    /// it whose interval still holds a shift below it (slow handoffs) makes the pass inconclusive.
    pub max_shift_limit_ns: u64,
    /// The largest acceptable spread of the per-CPU tick rates, in ppm, on top of the measurement uncertainty.
    ///
    /// 50 ppm by default: the TSCs of one system share one clock, so honest spreads are measurement noise
    /// (a few ppm over the default interval); a real rate difference of 50 ppm would grow a 1 µs shift in 20 ms.
    pub max_rate_spread_ppm: f64,
    /// Fall back when CPUID says the TSC is not invariant (its rate may then change with power states, which a
    /// short check cannot see). On by default; some hypervisors hide the flag on a usable TSC.
    pub require_invariant_tsc: bool,
    /// Fall back when the kernel lists clocksources but `tsc` is not among them (x86_64 only): Linux removes a
    /// TSC its clocksource watchdog found unstable.
    pub trust_kernel_clocksource: bool,
    /// Passes at most, within [`ReliabilityOptions::time_budget_ms`]. A measured failure rejects the counter only
    /// once a second pass measures it again; an inconclusive pass is repeated when
    /// [`ReliabilityOptions::retry_inconclusive`] is set. 3 by default.
    pub attempts: u32,
    /// Repeat a pass that was inconclusive (load kept the probes from measuring), not only one that failed.
    pub retry_inconclusive: bool,
    /// Pause before a repeated pass, in ms: a burst of load may be over by then.
    pub retry_pause_ms: u64,
    /// Faults injected into the probes, for tests. Empty by default.
    #[doc(hidden)]
    pub faults: ProbeFaults,
}

impl Default for ReliabilityOptions {
    fn default() -> Self {
        ReliabilityOptions {
            cpus: None,
            shift_rounds: 5_000,
            shift_time_limit_ms: 50,
            monotonic_reads_per_cpu: 100_000,
            monotonic_time_limit_ms: 200,
            min_full_loops: 100,
            rate_interval_ms: 20,
            rate_bracket_samples: 32,
            handoff_timeout_us: 1_000,
            thread_start_timeout_ms: 200,
            time_budget_ms: 3_000,
            max_probe_width_ns: 20_000,
            max_shift_limit_ns: 1_000,
            max_rate_spread_ppm: 50.0,
            require_invariant_tsc: true,
            trust_kernel_clocksource: true,
            attempts: 3,
            retry_inconclusive: true,
            retry_pause_ms: 50,
            faults: ProbeFaults::default(),
        }
    }
}

impl ReliabilityOptions {
    /// Fewer rounds and reads and a 5 ms rate interval: a few ms on a small machine, for a quick look. The rate
    /// limit is wider (200 ppm) because a short interval measures the rate less precisely.
    ///
    /// ```
    /// let report = tickline::clock::check_tsc_reliability(&tickline::clock::ReliabilityOptions::quick());
    /// assert!(report.passes.len() <= 2);
    /// ```
    pub fn quick() -> Self {
        ReliabilityOptions {
            shift_rounds: 300,
            shift_time_limit_ms: 10,
            monotonic_reads_per_cpu: 5_000,
            monotonic_time_limit_ms: 30,
            min_full_loops: 20,
            rate_interval_ms: 5,
            rate_bracket_samples: 16,
            max_rate_spread_ppm: 200.0,
            attempts: 2,
            retry_pause_ms: 5,
            ..ReliabilityOptions::default()
        }
    }

    /// The short check a process's first timeline start waits for: one pass of a millisecond or two, repeated
    /// only to confirm a measured failure, never because load made it inconclusive (the full check in the
    /// background does that). A 1 ms rate interval measures the rate to some 50 ppm, hence the 500 ppm limit.
    ///
    /// ```
    /// let options = tickline::clock::ReliabilityOptions::up_front();
    /// assert!(!options.retry_inconclusive);
    /// ```
    pub fn up_front() -> Self {
        ReliabilityOptions {
            shift_rounds: 200,
            shift_time_limit_ms: 2,
            monotonic_reads_per_cpu: 2_000,
            monotonic_time_limit_ms: 2,
            min_full_loops: 20,
            rate_interval_ms: 1,
            rate_bracket_samples: 8,
            handoff_timeout_us: 200,
            thread_start_timeout_ms: 5,
            time_budget_ms: 15,
            max_rate_spread_ppm: 500.0,
            attempts: 2,
            retry_inconclusive: false,
            retry_pause_ms: 0,
            ..ReliabilityOptions::default()
        }
    }
}

/// Which measurement a [`ProbeFaults`] preemption hits.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbePhase {
    /// Inside the end bracket of a CPU's rate measurement.
    Rate,
    /// Inside a shift round's bracket, on the base CPU, after asking the tested CPU for its reading.
    Shift,
    /// On a thread of the CAS-ordered sequence, right after it won a read.
    Monotonic,
}

/// A preemption injected into probes: the probing thread sleeps for `delay` inside the probe. Clones share the
/// count, so "the first probe" means the first across every pass and every clone of the options.
#[doc(hidden)]
#[derive(Clone)]
pub struct InjectedPreemption {
    /// The measurement whose probe is delayed.
    pub phase: ProbePhase,
    /// How long the probe is held.
    pub delay: Duration,
    remaining: Arc<AtomicU32>,
}

impl InjectedPreemption {
    /// Delays the next `count` probes of `phase` by `delay`.
    pub fn new(phase: ProbePhase, delay: Duration, count: u32) -> Self {
        InjectedPreemption {
            phase,
            delay,
            remaining: Arc::new(AtomicU32::new(count)),
        }
    }

    /// Injections not used yet.
    pub fn remaining(&self) -> u32 {
        // Relaxed: a counter read for a test's report, ordered with nothing else.
        self.remaining.load(Ordering::Relaxed)
    }

    /// Takes one injection if `phase` matches and one is left.
    pub(super) fn take(&self, phase: ProbePhase) -> bool {
        phase == self.phase
            // Relaxed: only the count matters, no other memory is published through it.
            && self
                .remaining
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok()
    }
}

impl fmt::Debug for InjectedPreemption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InjectedPreemption")
            .field("phase", &self.phase)
            .field("delay", &self.delay)
            .field("remaining", &self.remaining())
            .finish()
    }
}

impl PartialEq for InjectedPreemption {
    fn eq(&self, other: &Self) -> bool {
        self.phase == other.phase && self.delay == other.delay && Arc::ptr_eq(&self.remaining, &other.remaining)
    }
}

/// Faults the reliability check's tests inject into its probes: a preempted probe, a shifted counter. Not for
/// production use; empty by default.
///
/// ```
/// # use std::time::Duration;
/// use tickline::clock::{InjectedPreemption, ProbeFaults, ProbePhase, ReliabilityOptions};
/// let options = ReliabilityOptions {
///     faults: ProbeFaults {
///         preempt: Some(InjectedPreemption::new(ProbePhase::Shift, Duration::from_millis(12), 1)),
///         shifted_cpu: None,
///     },
///     ..ReliabilityOptions::quick()
/// };
/// # let _ = options;
/// ```
#[doc(hidden)]
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProbeFaults {
    /// Delays probes, as a preemption would.
    pub preempt: Option<InjectedPreemption>,
    /// `(cpu, ticks)`: every counter read the check takes on `cpu` is off by `ticks`, as an unsynchronised TSC
    /// would be.
    pub shifted_cpu: Option<(usize, i64)>,
}

impl ProbeFaults {
    /// The offset added to reads on `cpu`.
    pub(super) fn offset_on(&self, cpu: usize) -> i64 {
        match self.shifted_cpu {
            Some((shifted, ticks)) if shifted == cpu => ticks,
            _ => 0,
        }
    }

    /// Sleeps for the injected delay if a preemption of `phase` is due.
    pub(super) fn maybe_preempt(&self, phase: ProbePhase) {
        if let Some(p) = &self.preempt {
            if p.take(phase) {
                std::thread::sleep(p.delay);
            }
        }
    }
}
