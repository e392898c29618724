//! Is the TSC safe to use as this process's clock? The wtmlib method: hints, then measured facts.
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
//!    intersecting these intervals over many rounds narrows it. The width of the smallest range holding all
//!    the intervals and 0 (the base) bounds the shift between any two CPUs. An empty intersection proves the
//!    counters inconsistent.
//! 3. **Monotonicity**: threads on every CPU read the counter in one global order enforced by a CAS on a shared
//!    sequence number (load the sequence, read the counter, CAS the sequence forward; only the winner keeps its
//!    read). The resulting sequence must never go backwards; "full loops" count how often it passed through
//!    every CPU and came back, so a pass with few cross-CPU hops is reported as inconclusive, not as a success.
//!
//! Every handoff between threads is bounded by a timeout and the whole check by a time budget: a starved or
//! unpinnable CPU ends a round or is skipped, never hangs or panics the check (container CPU masks with
//! offline or foreign CPUs, quanta#61, risingwave#10235).

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::{monotonic_raw_ns, TickSource};

/// Options of [`check_tsc_reliability`]: how much to measure and the limits the decision applies.
///
/// The defaults finish in roughly 0.1 s on a 2-CPU machine; [`ReliabilityOptions::quick`] in a few ms.
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
    /// check to count as meaningful when more than one CPU is tested.
    pub min_full_loops: u64,
    /// Interval over which each CPU's tick rate is measured against `CLOCK_MONOTONIC_RAW`, in ms.
    pub rate_interval_ms: u64,
    /// Bracketed reads taken at each end of the rate interval; the tightest bracket is kept.
    pub rate_bracket_samples: u32,
    /// How long one thread waits for another at a handoff before giving the round up, in µs.
    pub handoff_timeout_us: u64,
    /// How long a thread waits for its peers to start and pin themselves, in ms.
    pub thread_start_timeout_ms: u64,
    /// Time budget of the whole check, in ms: CPUs not measured within it are reported, and the decision falls back.
    pub time_budget_ms: u64,
    /// The largest acceptable bound on the shift between any two CPUs' counters, in ns.
    ///
    /// 1 µs by default: healthy systems measure a bound of 50–500 ns (mostly the cross-core handoff latency the
    /// method cannot see below, more under a hypervisor), while unsynchronised TSCs are typically off by many
    /// µs to ms (per-socket reset, resume, a BIOS writing the TSC). 1 µs is also below the resolution at which a
    /// timeline of CPU and GPU activity is read, so a shift under it is harmless.
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
            max_shift_limit_ns: 1_000,
            max_rate_spread_ppm: 50.0,
            require_invariant_tsc: true,
            trust_kernel_clocksource: true,
        }
    }
}

impl ReliabilityOptions {
    /// Fewer rounds and reads and a 5 ms rate interval: a few ms on a small machine, for a quick look. The rate
    /// limit is wider (200 ppm) because a short interval measures the rate less precisely.
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
            ..ReliabilityOptions::default()
        }
    }
}

/// What to do with the TSC after [`check_tsc_reliability`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TscDecision {
    /// The hardware counter passed every check: record raw ticks.
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
    /// Rounds whose handoff completed and narrowed the interval.
    pub rounds: u64,
    /// Rounds given up because the other thread did not answer within the handoff timeout.
    pub timed_out_rounds: u64,
}

impl CpuShift {
    fn unmeasured(cpu: usize) -> Self {
        CpuShift {
            cpu,
            lo_ticks: i64::MIN,
            hi_ticks: i64::MAX,
            rounds: 0,
            timed_out_rounds: 0,
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
    fn add_round(&mut self, base1: u64, current: u64, base2: u64) {
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

/// The result of [`check_tsc_reliability`]: the hints, every measured number, and the decision.
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
    /// Bound of the shift between any two tested CPUs' counters, in ticks (0 with one CPU).
    pub max_shift_ticks: u64,
    /// [`TscReport::max_shift_ticks`] in ns at the measured rate.
    pub max_shift_ns: f64,
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
    /// How long the check took.
    pub elapsed: Duration,
    /// Use the TSC, or fall back, and why.
    pub decision: TscDecision,
}

impl TscReport {
    /// Whether the decision is [`TscDecision::UseTsc`].
    pub fn is_reliable(&self) -> bool {
        self.decision == TscDecision::UseTsc
    }

    /// The report as JSON, for `tickline clock --json` and for logs. Non-finite numbers become `null`.
    pub fn to_json(&self) -> serde_json::Value {
        let (decision, reason) = match &self.decision {
            TscDecision::UseTsc => ("use_tsc", None),
            TscDecision::FallBack { reason } => ("fall_back", Some(reason.clone())),
        };
        let skipped: Vec<serde_json::Value> = self
            .skipped
            .iter()
            .map(|s| serde_json::json!({ "cpu": s.cpu, "reason": s.reason }))
            .collect();
        let shifts: Vec<serde_json::Value> = self
            .shifts
            .iter()
            .map(|s| {
                let measured = s.is_measured();
                serde_json::json!({
                    "cpu": s.cpu,
                    "lo_ticks": measured.then_some(s.lo_ticks),
                    "hi_ticks": measured.then_some(s.hi_ticks),
                    "rounds": s.rounds,
                    "timed_out_rounds": s.timed_out_rounds,
                    "empty": s.is_empty(),
                })
            })
            .collect();
        let rates: Vec<serde_json::Value> = self
            .rates
            .iter()
            .map(|r| {
                serde_json::json!({
                    "cpu": r.cpu,
                    "hz": r.hz,
                    "uncertainty_ppm": r.uncertainty_ppm,
                    "ticks": r.ticks,
                    "interval_ns": r.interval_ns,
                    "advances": r.advances,
                })
            })
            .collect();
        serde_json::json!({
            "source": self.source.map(|s| format!("{s:?}")),
            "invariant_tsc": self.invariant_tsc,
            "clocksource": self.clocksource,
            "tsc_clocksource_available": self.tsc_clocksource_available,
            "nominal_hz": self.nominal_hz,
            "cpus_allowed": self.cpus_allowed,
            "tested_cpus": self.tested_cpus,
            "cpus_tested": self.cpus_tested,
            "skipped": skipped,
            "notes": self.notes,
            "base_cpu": self.base_cpu,
            "shifts": shifts,
            "max_shift_ticks": self.max_shift_ticks,
            "max_shift_ns": self.max_shift_ns,
            "shift_consistent": self.shift_consistent,
            "monotonic": self.monotonic,
            "monotonic_reads": self.monotonic_reads,
            "monotonic_full_loops": self.monotonic_full_loops,
            "monotonic_cpu_switches": self.monotonic_cpu_switches,
            "backward_steps": self.backward_steps,
            "max_backward_ticks": self.max_backward_ticks,
            "rates": rates,
            "rate_hz": self.rate_hz,
            "rate_spread_ppm": self.rate_spread_ppm,
            "rate_uncertainty_ppm": self.rate_uncertainty_ppm,
            "elapsed_ms": self.elapsed.as_secs_f64() * 1e3,
            "decision": decision,
            "reason": reason,
            "reliable": self.is_reliable(),
        })
    }

    fn empty(source: Option<TickSource>) -> Self {
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
            decision: TscDecision::UseTsc,
        }
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
            "TSC reliability check: counter {source}, {} of {} allowed CPUs tested, {:.1} ms",
            self.cpus_tested,
            self.cpus_allowed.len(),
            self.elapsed.as_secs_f64() * 1e3
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
            "  shift:      at most {} ticks = {:.1} ns between any two CPUs (base CPU {base}{})",
            self.max_shift_ticks,
            self.max_shift_ns,
            if self.shift_consistent { "" } else { "; INCONSISTENT" }
        )?;
        for s in &self.shifts {
            if !s.is_measured() {
                writeln!(
                    f,
                    "              CPU {}: not measured ({} rounds timed out)",
                    s.cpu, s.timed_out_rounds
                )?;
            } else {
                writeln!(
                    f,
                    "              CPU {}: [{}, {}] ticks{} after {} rounds ({} timed out)",
                    s.cpu,
                    s.lo_ticks,
                    s.hi_ticks,
                    if s.is_empty() { " EMPTY" } else { "" },
                    s.rounds,
                    s.timed_out_rounds
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
        write!(f, "  decision:   {}", self.decision)
    }
}

/// Checks whether the hardware tick counter can serve as this process's clock, and reports the numbers.
///
/// Reads the hints (CPUID invariant TSC, kernel clocksource), then measures, with threads pinned to each CPU
/// the process may run on: every CPU's tick rate, the bound of the shift between CPUs, and a CAS-ordered
/// monotonicity sequence across CPUs (the wtmlib method). On aarch64 the same measurements
/// apply to `cntvct_el0`. On other architectures, and on operating systems without CPU affinity, it decides
/// [`TscDecision::FallBack`].
///
/// Never panics: CPUs that cannot be pinned are skipped with the reason, every wait is bounded, and the whole
/// check is bounded by [`ReliabilityOptions::time_budget_ms`].
///
/// ```
/// let report = tickline::check_tsc_reliability(&tickline::ReliabilityOptions::default());
/// println!("{report}");
/// if !report.is_reliable() {
///     // record with tickline::TickSource::Monotonic instead
/// }
/// assert_eq!(report.cpus_tested, report.tested_cpus.len());
/// ```
pub fn check_tsc_reliability(options: &ReliabilityOptions) -> TscReport {
    let started = Instant::now();
    let deadline = started + Duration::from_millis(options.time_budget_ms);
    let source = TickSource::hardware();
    let mut report = TscReport::empty(source);
    report.invariant_tsc = invariant_tsc_hint();
    report.clocksource = read_sysfs_line("/sys/devices/system/clocksource/clocksource0/current_clocksource");
    report.tsc_clocksource_available =
        read_sysfs_line("/sys/devices/system/clocksource/clocksource0/available_clocksource")
            .map(|list| list.split_whitespace().any(|name| name == "tsc"));
    report.nominal_hz = source.and_then(TickSource::nominal_hz);

    match affinity::allowed_cpus() {
        Ok(cpus) => report.cpus_allowed = cpus,
        Err(e) => report.notes.push(e),
    }

    if source.is_some() {
        measure(options, deadline, &mut report);
    }

    report.elapsed = started.elapsed();
    report.decision = decide(&report, options);
    report
}

// ---------------------------------------------------------------------------------------------------------------
// Measurement.

/// The three measurements, into `report`.
fn measure(options: &ReliabilityOptions, deadline: Instant, report: &mut TscReport) {
    let mut requested = options.cpus.clone().unwrap_or_else(|| report.cpus_allowed.clone());
    requested.sort_unstable();
    requested.dedup();
    let mut candidates = Vec::with_capacity(requested.len());
    for cpu in requested {
        if cpu >= affinity::MAX_PIN_CPU {
            report.skipped.push(SkippedCpu {
                cpu,
                reason: format!(
                    "CPU id {cpu} is beyond CPU_SETSIZE ({}); not tested",
                    affinity::MAX_PIN_CPU
                ),
            });
        } else {
            if options.cpus.is_some() && !report.cpus_allowed.is_empty() && !report.cpus_allowed.contains(&cpu) {
                report
                    .notes
                    .push(format!("CPU {cpu} is not in the process's allowed set; tried anyway"));
            }
            candidates.push(cpu);
        }
    }

    // 1. Rates, which also finds out which CPUs can be pinned.
    for (cpu, result) in measure_rates(&candidates, options) {
        match result {
            Ok(rate) => {
                report.tested_cpus.push(cpu);
                report.rates.push(rate);
            }
            Err(reason) => report.skipped.push(SkippedCpu { cpu, reason }),
        }
    }
    report.cpus_tested = report.tested_cpus.len();
    let hz: Vec<f64> = report.rates.iter().filter(|r| r.advances).map(|r| r.hz).collect();
    if !hz.is_empty() {
        report.rate_hz = hz.iter().sum::<f64>() / hz.len() as f64;
        report.rate_spread_ppm = rate_spread_ppm(&hz);
        report.rate_uncertainty_ppm = 2.0 * report.rates.iter().map(|r| r.uncertainty_ppm).fold(0.0, f64::max);
    }

    // 2. Shifts against the lowest tested CPU.
    report.base_cpu = report.tested_cpus.first().copied();
    if let Some(base) = report.base_cpu {
        for &cpu in &report.tested_cpus[1..] {
            if Instant::now() >= deadline {
                report
                    .notes
                    .push(format!("time budget spent before the shift of CPU {cpu} was measured"));
                report.shifts.push(CpuShift::unmeasured(cpu));
                continue;
            }
            match measure_shift(base, cpu, options, deadline) {
                Ok(shift) => report.shifts.push(shift),
                Err(reason) => {
                    report.notes.push(format!("shift of CPU {cpu}: {reason}"));
                    report.shifts.push(CpuShift::unmeasured(cpu));
                }
            }
        }
    }
    report.shift_consistent = report.shifts.iter().all(|s| !s.is_empty());
    report.max_shift_ticks = enclosing_shift_ticks(&report.shifts);
    report.max_shift_ns = if report.rate_hz > 0.0 {
        report.max_shift_ticks as f64 * 1e9 / report.rate_hz
    } else {
        f64::NAN
    };

    // 3. The CAS-ordered monotonicity sequence on all tested CPUs at once.
    if !report.tested_cpus.is_empty() {
        let (sequence, participants, notes) = measure_monotonic(&report.tested_cpus, options, deadline);
        report.notes.extend(notes);
        let stats = analyze_sequence(&sequence, participants);
        report.monotonic_reads = stats.reads;
        report.monotonic_full_loops = stats.full_loops;
        report.monotonic_cpu_switches = stats.cpu_switches;
        report.backward_steps = stats.backward_steps;
        report.max_backward_ticks = stats.max_backward_ticks;
        report.monotonic = stats.reads > 0 && stats.backward_steps == 0;
    }
}

/// Rate of every CPU in `cpus`, measured in parallel by one pinned thread each; `Err` for a CPU that could
/// not be measured (pinning failed, no thread).
fn measure_rates(cpus: &[usize], options: &ReliabilityOptions) -> Vec<(usize, Result<CpuRate, String>)> {
    let interval = Duration::from_millis(options.rate_interval_ms.max(1));
    let samples = options.rate_bracket_samples.max(1);
    thread::scope(|scope| {
        let handles: Vec<_> = cpus
            .iter()
            .map(|&cpu| {
                let handle = thread::Builder::new()
                    .name(format!("tsc-rate-{cpu}"))
                    .spawn_scoped(scope, move || rate_on_cpu(cpu, interval, samples));
                (cpu, handle)
            })
            .collect();
        handles
            .into_iter()
            .map(|(cpu, handle)| (cpu, join(handle, "rate")))
            .collect()
    })
}

fn rate_on_cpu(cpu: usize, interval: Duration, samples: u32) -> Result<CpuRate, String> {
    affinity::pin_current_thread(cpu)?;
    let start = tightest_bracket(samples);
    thread::sleep(interval);
    let end = tightest_bracket(samples);
    Ok(rate_between(cpu, start, end))
}

/// One counter read between two reads of `CLOCK_MONOTONIC_RAW`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bracket {
    /// The counter.
    ticks: u64,
    /// The sum of the two reference reads (twice the bracket's midpoint, kept exact), in ns.
    ref_sum_ns: u64,
    /// The bracket's width, in ns.
    width_ns: u64,
}

fn tightest_bracket(samples: u32) -> Bracket {
    let mut best: Option<Bracket> = None;
    for _ in 0..samples {
        let before = monotonic_raw_ns().0;
        let ticks = ordered_ticks();
        let after = monotonic_raw_ns().0;
        let b = Bracket {
            ticks,
            ref_sum_ns: before.wrapping_add(after),
            width_ns: after.saturating_sub(before),
        };
        if best.is_none_or(|best| b.width_ns < best.width_ns) {
            best = Some(b);
        }
    }
    best.unwrap_or(Bracket {
        ticks: ordered_ticks(),
        ref_sum_ns: 2 * monotonic_raw_ns().0,
        width_ns: 0,
    })
}

/// The rate between two brackets, with its error bound: each midpoint is off by at most half its bracket.
fn rate_between(cpu: usize, start: Bracket, end: Bracket) -> CpuRate {
    let ticks = end.ticks.wrapping_sub(start.ticks);
    let advances = end.ticks > start.ticks;
    let twice_ns = end.ref_sum_ns.saturating_sub(start.ref_sum_ns);
    let interval_ns = twice_ns / 2;
    let (hz, uncertainty_ppm) = if advances && twice_ns > 0 {
        let hz = ticks as f64 * 2e9 / twice_ns as f64;
        let error_ns = (start.width_ns + end.width_ns) as f64 / 2.0;
        (hz, error_ns * 2e6 / twice_ns as f64)
    } else {
        (0.0, f64::INFINITY)
    };
    CpuRate {
        cpu,
        hz,
        uncertainty_ppm,
        ticks: if advances { ticks } else { 0 },
        interval_ns,
        advances,
    }
}

/// Shared by the two threads of a shift measurement.
struct Handoff {
    /// Odd `2r + 1`: the base asks for round `r`; even `2r + 2`: answered (or cancelled by the base); `DONE`: stop.
    flag: AtomicU64,
    /// The counter as the tested CPU read it for the last round it answered.
    current: AtomicU64,
    /// `STARTING`, `READY` once the tested thread is pinned, `FAILED` if it could not be.
    peer: AtomicUsize,
}

const DONE: u64 = u64::MAX;
const STARTING: usize = 0;
const READY: usize = 1;
const FAILED: usize = 2;

/// Stores `DONE` when dropped, so the tested thread stops on every path out of the base thread.
struct StopOnDrop<'a>(&'a AtomicU64);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(DONE, Ordering::Release);
    }
}

/// The shift of `cpu`'s counter against `base`'s, from rounds of handoffs between two pinned threads.
fn measure_shift(base: usize, cpu: usize, options: &ReliabilityOptions, deadline: Instant) -> Result<CpuShift, String> {
    let handoff = Handoff {
        flag: AtomicU64::new(0),
        current: AtomicU64::new(0),
        peer: AtomicUsize::new(STARTING),
    };
    let start_timeout = Duration::from_millis(options.thread_start_timeout_ms);
    let limit = Duration::from_millis(options.shift_time_limit_ms);
    // The tested thread gives up by itself only if the base thread never tells it to stop.
    let give_up = Instant::now() + limit + 2 * start_timeout + Duration::from_secs(1);
    thread::scope(|scope| {
        let h = &handoff;
        let tested = thread::Builder::new()
            .name(format!("tsc-shift-{cpu}"))
            .spawn_scoped(scope, move || shift_tested_side(h, cpu, give_up));
        let based = thread::Builder::new()
            .name(format!("tsc-shift-base-{base}"))
            .spawn_scoped(scope, move || shift_base_side(h, base, cpu, options, deadline));
        let base_result = join(based, "shift base");
        handoff.flag.store(DONE, Ordering::Release);
        let tested_result = join(tested, "shift");
        tested_result?;
        base_result
    })
}

fn shift_tested_side(h: &Handoff, cpu: usize, give_up: Instant) -> Result<(), String> {
    if let Err(e) = affinity::pin_current_thread(cpu) {
        h.peer.store(FAILED, Ordering::Release);
        return Err(e);
    }
    h.peer.store(READY, Ordering::Release);
    let mut answered = 0u64;
    let mut spins = 0u32;
    loop {
        let flag = h.flag.load(Ordering::Acquire);
        if flag == DONE {
            return Ok(());
        }
        if flag & 1 == 1 && flag != answered {
            let current = ordered_ticks();
            h.current.store(current, Ordering::Relaxed);
            // Release: the base, seeing `flag + 1`, sees `current`. Fails if the base gave the round up.
            let _ = h
                .flag
                .compare_exchange(flag, flag + 1, Ordering::AcqRel, Ordering::Relaxed);
            answered = flag;
            continue;
        }
        spins = spins.wrapping_add(1);
        if spins & 1023 == 0 && Instant::now() >= give_up {
            return Err("the base thread never finished".to_string());
        }
        std::hint::spin_loop();
    }
}

fn shift_base_side(
    h: &Handoff,
    base: usize,
    cpu: usize,
    options: &ReliabilityOptions,
    deadline: Instant,
) -> Result<CpuShift, String> {
    let _stop = StopOnDrop(&h.flag);
    affinity::pin_current_thread(base).map_err(|e| format!("base CPU {base}: {e}"))?;
    let start_timeout = Duration::from_millis(options.thread_start_timeout_ms);
    if !spin_until(start_timeout, || h.peer.load(Ordering::Acquire) != STARTING) {
        return Err(format!(
            "the thread for CPU {cpu} did not start within {start_timeout:?}"
        ));
    }
    if h.peer.load(Ordering::Acquire) != READY {
        return Err(format!("the thread for CPU {cpu} could not be pinned"));
    }
    let phase_end = deadline.min(Instant::now() + Duration::from_millis(options.shift_time_limit_ms));
    let timeout = Duration::from_micros(options.handoff_timeout_us.max(1));
    let mut shift = CpuShift::unmeasured(cpu);
    for round in 0..u64::from(options.shift_rounds) {
        if Instant::now() >= phase_end {
            break;
        }
        let ask = 2 * round + 1;
        let base1 = ordered_ticks();
        h.flag.store(ask, Ordering::Release);
        let answered = spin_until(timeout, || h.flag.load(Ordering::Acquire) == ask + 1)
            // Give the round up, unless the answer arrived meanwhile (then the CAS fails on `ask + 1`).
            || h.flag.compare_exchange(ask, ask + 1, Ordering::AcqRel, Ordering::Acquire) == Err(ask + 1);
        let base2 = ordered_ticks();
        if !answered {
            shift.timed_out_rounds += 1;
            continue;
        }
        let current = h.current.load(Ordering::Relaxed);
        shift.add_round(base1, current, base2);
        if shift.is_empty() {
            break;
        }
    }
    Ok(shift)
}

/// Upper bound of the CAS-ordered sequence's length, whatever the options ask (memory: 16 bytes a read).
const MONOTONIC_MAX_READS: u64 = 1_000_000;

/// Runs the CAS-ordered sequence on `cpus`; returns `(counter value, index of the CPU in cpus)` in sequence
/// order, the number of threads that took part, and notes.
fn measure_monotonic(
    cpus: &[usize],
    options: &ReliabilityOptions,
    deadline: Instant,
) -> (Vec<(u64, usize)>, usize, Vec<String>) {
    let n = cpus.len();
    let total = options
        .monotonic_reads_per_cpu
        .saturating_mul(n as u64)
        .clamp(1, MONOTONIC_MAX_READS);
    let seq = AtomicU64::new(0);
    let arrived = AtomicUsize::new(0);
    let start_timeout = Duration::from_millis(options.thread_start_timeout_ms);
    let stop = deadline.min(Instant::now() + start_timeout + Duration::from_millis(options.monotonic_time_limit_ms));
    let mut notes = Vec::new();
    let per_thread: Vec<Result<Vec<(u64, u64)>, String>> = thread::scope(|scope| {
        let (seq, arrived) = (&seq, &arrived);
        let handles: Vec<_> = cpus
            .iter()
            .map(|&cpu| {
                thread::Builder::new()
                    .name(format!("tsc-order-{cpu}"))
                    .spawn_scoped(scope, move || {
                        let pinned = affinity::pin_current_thread(cpu);
                        arrived.fetch_add(1, Ordering::AcqRel);
                        pinned?;
                        // Start together, so that the sequence interleaves from the first read.
                        spin_until(start_timeout, || arrived.load(Ordering::Acquire) >= n);
                        Ok(cas_ordered_reads(seq, total, n > 1, stop))
                    })
            })
            .collect();
        handles.into_iter().map(|h| join(h, "monotonicity")).collect()
    });

    let len = seq.load(Ordering::Acquire).min(total) as usize;
    let mut sequence = vec![(0u64, usize::MAX); len];
    let mut participants = 0;
    for (index, (cpu, result)) in cpus.iter().zip(per_thread).enumerate() {
        match result {
            Ok(reads) => {
                participants += 1;
                for (position, ticks) in reads {
                    if let Some(slot) = sequence.get_mut(position as usize) {
                        *slot = (ticks, index);
                    }
                }
            }
            Err(e) => notes.push(format!("CPU {cpu} took no part in the monotonicity check: {e}")),
        }
    }
    // Every position below `len` was won by exactly one thread; stop at a hole anyway.
    let filled = sequence
        .iter()
        .position(|&(_, index)| index == usize::MAX)
        .unwrap_or(len);
    if filled < len {
        notes.push(format!("monotonicity sequence incomplete: {filled} of {len} reads"));
    }
    sequence.truncate(filled);
    (sequence, participants, notes)
}

/// One thread's part of the sequence: load the sequence number, read the counter, CAS the number forward; the
/// winner keeps `(position, counter)`. The read lies between the load and the CAS, and the load saw the previous
/// winner's CAS, which followed its read: so the kept reads are in real-time order.
fn cas_ordered_reads(seq: &AtomicU64, total: u64, take_turns: bool, stop: Instant) -> Vec<(u64, u64)> {
    let mut reads = Vec::new();
    let mut iterations = 0u32;
    loop {
        let position = seq.load(Ordering::Acquire);
        if position >= total {
            break;
        }
        iterations = iterations.wrapping_add(1);
        if iterations & 255 == 0 && Instant::now() >= stop {
            break;
        }
        let ticks = ordered_ticks();
        if seq
            .compare_exchange(position, position + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            reads.push((position, ticks));
            if take_turns {
                // Leave the next read to another CPU for a moment, so the sequence hops between CPUs (the
                // comparisons that matter) instead of one CPU winning runs of reads on a hot cache line.
                spin_while_bounded(256, || seq.load(Ordering::Relaxed) == position + 1);
            }
        }
    }
    reads
}

fn join<T>(handle: std::io::Result<thread::ScopedJoinHandle<'_, Result<T, String>>>, what: &str) -> Result<T, String> {
    match handle {
        Ok(handle) => handle
            .join()
            .unwrap_or_else(|_| Err(format!("the {what} thread panicked"))),
        Err(e) => Err(format!("could not start the {what} thread: {e}")),
    }
}

/// Spins until `done()`, or `timeout` passes (then `false`). The clock is read only after a first burst of
/// spins, so a quick answer is seen without the cost of a clock read.
fn spin_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let mut give_up: Option<Instant> = None;
    let mut spins = 0u32;
    loop {
        if done() {
            return true;
        }
        spins = spins.wrapping_add(1);
        if spins & 63 == 0 {
            let now = Instant::now();
            match give_up {
                None => give_up = Some(now + timeout),
                Some(t) if now >= t => return false,
                Some(_) => {}
            }
        }
        std::hint::spin_loop();
    }
}

fn spin_while_bounded(max_spins: u32, mut waiting: impl FnMut() -> bool) {
    for _ in 0..max_spins {
        if !waiting() {
            return;
        }
        std::hint::spin_loop();
    }
}

/// Reads the counter, ordered with the surrounding memory accesses: not before earlier loads complete, and
/// before later instructions start (`rdtsc` alone may execute out of order).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn ordered_ticks() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: `lfence` (SSE2) and `rdtsc` are x86_64 baseline; they touch no memory and only write eax/edx,
    // declared as outputs. No `nomem`: the asm is a compiler barrier, so atomics are not moved across it.
    unsafe {
        core::arch::asm!("lfence", "rdtsc", "lfence", out("eax") lo, out("edx") hi, options(nostack, preserves_flags));
    }
    (u64::from(hi) << 32) | u64::from(lo)
}

/// Reads `cntvct_el0` ordered with the surrounding accesses: `dsb ish` waits for earlier loads and stores to
/// complete, the `isb`s keep the read from being executed early or late relative to its neighbours.
#[cfg(target_arch = "aarch64")]
#[inline(always)]
fn ordered_ticks() -> u64 {
    let ticks: u64;
    // SAFETY: Linux enables EL0 reads of cntvct_el0 (see `aarch64::read_hardware_ticks`); `dsb`, `isb` and `mrs`
    // touch no memory. No `nomem`: the asm is a compiler barrier, so atomics are not moved across it.
    unsafe {
        core::arch::asm!(
            "dsb ish",
            "isb",
            "mrs {t}, cntvct_el0",
            "isb",
            t = out(reg) ticks,
            options(nostack, preserves_flags)
        );
    }
    ticks
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[inline(always)]
fn ordered_ticks() -> u64 {
    std::sync::atomic::fence(Ordering::SeqCst);
    let ticks = super::read_ticks().0;
    std::sync::atomic::fence(Ordering::SeqCst);
    ticks
}

fn invariant_tsc_hint() -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        Some(super::x86_64::cpuid_invariant_tsc())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

fn read_sysfs_line(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.trim();
    (!line.is_empty()).then(|| line.to_string())
}

/// CPU affinity: the allowed set and pinning the calling thread.
#[cfg(target_os = "linux")]
mod affinity {
    use std::io;
    use std::mem::size_of;

    /// CPUs at or above this id cannot be named in a `cpu_set_t` and are not tested.
    pub(super) const MAX_PIN_CPU: usize = libc::CPU_SETSIZE as usize;

    /// Largest mask asked for: 2^18 CPUs, far beyond any kernel's `NR_CPUS`.
    const MAX_MASK_WORDS: usize = (1 << 18) / libc::c_ulong::BITS as usize;

    /// The CPUs the calling thread may run on, ascending. Grows the mask while the kernel answers EINVAL
    /// (it does when the mask is shorter than its CPU count), so CPU ids beyond 1024 are listed too.
    pub(super) fn allowed_cpus() -> Result<Vec<usize>, String> {
        let word_bits = libc::c_ulong::BITS as usize;
        let mut words = size_of::<libc::cpu_set_t>() / size_of::<libc::c_ulong>();
        loop {
            let mut mask: Vec<libc::c_ulong> = vec![0; words];
            let bytes = words * size_of::<libc::c_ulong>();
            // SAFETY: `mask` is a live, writable, c_ulong-aligned buffer of exactly `bytes` bytes, at least the
            // size of a cpu_set_t; the kernel writes at most `bytes` bytes (glibc zeroes the rest of the buffer).
            let rc = unsafe { libc::sched_getaffinity(0, bytes, mask.as_mut_ptr().cast::<libc::cpu_set_t>()) };
            if rc == 0 {
                let mut cpus = Vec::new();
                for (w, &word) in mask.iter().enumerate() {
                    for bit in 0..word_bits {
                        if word & (1 << bit) != 0 {
                            cpus.push(w * word_bits + bit);
                        }
                    }
                }
                return Ok(cpus);
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINVAL) && words < MAX_MASK_WORDS {
                words *= 2;
                continue;
            }
            return Err(format!("sched_getaffinity failed: {err}"));
        }
    }

    /// Pins the calling thread to `cpu` and checks that it now runs there.
    pub(super) fn pin_current_thread(cpu: usize) -> Result<(), String> {
        if cpu >= MAX_PIN_CPU {
            return Err(format!("CPU id {cpu} is beyond CPU_SETSIZE ({MAX_PIN_CPU})"));
        }
        // SAFETY: cpu_set_t is a plain array of integers; all-zero is a valid, empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu < CPU_SETSIZE` (checked above), so the bit CPU_SET writes lies inside `set`.
        unsafe { libc::CPU_SET(cpu, &mut set) };
        // SAFETY: pid 0 is the calling thread; `set` is an initialised cpu_set_t and the size passed is its size.
        let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
        if rc != 0 {
            return Err(format!(
                "sched_setaffinity(CPU {cpu}) failed: {}",
                io::Error::last_os_error()
            ));
        }
        // SAFETY: sched_getcpu takes no arguments and has no preconditions; it returns -1 on failure.
        let now = unsafe { libc::sched_getcpu() };
        if now >= 0 && now as usize != cpu {
            return Err(format!("pinned to CPU {cpu} but running on CPU {now}"));
        }
        Ok(())
    }
}

/// No CPU affinity off Linux: nothing can be pinned, so nothing is measured and the decision falls back.
#[cfg(not(target_os = "linux"))]
mod affinity {
    pub(super) const MAX_PIN_CPU: usize = 1024;

    pub(super) fn allowed_cpus() -> Result<Vec<usize>, String> {
        Err("CPU affinity is not available on this OS".to_string())
    }

    pub(super) fn pin_current_thread(_cpu: usize) -> Result<(), String> {
        Err("CPU affinity is not available on this OS".to_string())
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Pure analysis.

/// `a - b` as a signed difference, correct across wrap-around for differences within ±2^63.
fn wrapping_diff(a: u64, b: u64) -> i64 {
    a.wrapping_sub(b) as i64
}

/// Width of the smallest range holding every measured shift interval and 0 (the base CPU): a bound on the shift
/// between any two of the CPUs. 0 with no measured interval.
fn enclosing_shift_ticks(shifts: &[CpuShift]) -> u64 {
    let (mut lo, mut hi) = (0i128, 0i128);
    for s in shifts.iter().filter(|s| s.is_measured()) {
        // An empty interval's bounds are crossed; the range still spans both.
        lo = lo.min(i128::from(s.lo_ticks.min(s.hi_ticks)));
        hi = hi.max(i128::from(s.hi_ticks.max(s.lo_ticks)));
    }
    u64::try_from(hi - lo).unwrap_or(u64::MAX)
}

/// What a CAS-ordered sequence of reads shows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct SequenceStats {
    reads: u64,
    backward_steps: u64,
    max_backward_ticks: u64,
    full_loops: u64,
    cpu_switches: u64,
}

/// Analyses `(counter, cpu index < cpus)` reads in sequence order: a backward step is a read lower than the one
/// before it, measured against the highest read so far; a full loop ends each time the sequence is back on the
/// CPU where the loop began after visiting all `cpus` CPUs (none with fewer than 2 CPUs).
fn analyze_sequence(sequence: &[(u64, usize)], cpus: usize) -> SequenceStats {
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
fn rate_spread_ppm(hz: &[f64]) -> f64 {
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

/// The decision from the report's hints and numbers: every reason to fall back, joined, or [`TscDecision::UseTsc`].
fn decide(report: &TscReport, options: &ReliabilityOptions) -> TscDecision {
    let Some(source) = report.source else {
        return TscDecision::FallBack {
            reason: "no hardware tick counter on this architecture (not x86_64/aarch64)".to_string(),
        };
    };
    let mut reasons: Vec<String> = Vec::new();
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
        reasons.push(format!("no CPU could be measured ({why})"));
        return fall_back_or_use(reasons);
    }

    // Rates.
    for r in report.rates.iter().filter(|r| !r.advances) {
        reasons.push(format!("the counter does not advance on CPU {}", r.cpu));
    }
    if report.rate_hz.is_nan() || report.rate_hz <= 0.0 {
        reasons.push("the tick rate could not be measured".to_string());
    } else if report.rate_spread_ppm > options.max_rate_spread_ppm + report.rate_uncertainty_ppm {
        reasons.push(format!(
            "rates differ by {:.0} ppm across CPUs (limit {} ppm + {:.1} ppm measurement uncertainty)",
            report.rate_spread_ppm, options.max_rate_spread_ppm, report.rate_uncertainty_ppm
        ));
    }

    // Shifts.
    let base = report.base_cpu.map_or_else(|| "-".to_string(), |b| b.to_string());
    for s in &report.shifts {
        if !s.is_measured() {
            reasons.push(format!(
                "the TSC shift of CPU {} against CPU {base} could not be measured ({} handoffs timed out)",
                s.cpu, s.timed_out_rounds
            ));
        } else if s.is_empty() {
            reasons.push(format!(
                "the TSCs of CPU {} and CPU {base} are inconsistent: the shift intervals do not intersect ({} > {} ticks)",
                s.cpu, s.lo_ticks, s.hi_ticks
            ));
        }
    }
    if report.max_shift_ns.is_finite() && report.max_shift_ns > options.max_shift_limit_ns as f64 {
        reasons.push(format!(
            "TSC shift between CPUs is {:.0} ns (limit {} ns)",
            report.max_shift_ns, options.max_shift_limit_ns
        ));
    }

    // Monotonicity.
    if report.backward_steps > 0 {
        reasons.push(format!(
            "TSC went backwards {} times (max {} ticks)",
            report.backward_steps, report.max_backward_ticks
        ));
    }
    if report.monotonic_reads == 0 {
        reasons.push("the monotonicity check made no reads".to_string());
    } else if report.cpus_tested > 1 && report.monotonic_full_loops < options.min_full_loops {
        reasons.push(format!(
            "monotonicity check inconclusive: only {} full loops across CPUs (need {})",
            report.monotonic_full_loops, options.min_full_loops
        ));
    }
    fall_back_or_use(reasons)
}

fn fall_back_or_use(reasons: Vec<String>) -> TscDecision {
    if reasons.is_empty() {
        TscDecision::UseTsc
    } else {
        TscDecision::FallBack {
            reason: reasons.join("; "),
        }
    }
}

/// `0-3,6,8-9` from ascending CPU ids.
fn cpu_list(cpus: &[usize]) -> String {
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
    use std::sync::Mutex;

    /// The checks pin spinning threads to every CPU: run one at a time, or they measure each other.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn run(options: &ReliabilityOptions) -> TscReport {
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        check_tsc_reliability(options)
    }

    #[test]
    fn check_runs_and_reports_finite_numbers() {
        // Where the kernel itself clocks with an invariant TSC (this machine), the check must agree; a loaded
        // 2-vCPU VM can fail one pass on noise, so allow a retry before calling it a failure.
        let mut last = None;
        for _ in 0..3 {
            let report = run(&ReliabilityOptions::default());
            println!("{report}\n{}", report.to_json());
            if TickSource::hardware().is_none() {
                assert!(!report.is_reliable());
                return;
            }
            assert_eq!(report.cpus_tested, report.tested_cpus.len());
            assert!(report.cpus_tested >= 1, "{report}");
            assert!(report.rate_hz.is_finite() && report.rate_hz > 1e6, "{report}");
            assert!(report.max_shift_ns.is_finite(), "{report}");
            assert!(report.rate_spread_ppm.is_finite(), "{report}");
            assert!(report.monotonic_reads > 0, "{report}");
            // Typically under 0.1 s here, 0.5 s with both CPUs saturated; the phase time limits bound it anyway.
            assert!(
                report.elapsed < Duration::from_secs(2),
                "default check too slow: {report}"
            );
            assert_eq!(report.to_json()["cpus_tested"], report.cpus_tested);
            if report.cpus_tested == 1 {
                assert_eq!(report.max_shift_ticks, 0);
            }
            let kernel_trusts_tsc = report.clocksource.as_deref() == Some("tsc") && report.invariant_tsc == Some(true);
            if !kernel_trusts_tsc || report.is_reliable() {
                return;
            }
            last = Some(report);
        }
        panic!(
            "the kernel clocks with the TSC but the check falls back: {}",
            last.unwrap()
        );
    }

    #[test]
    fn quick_check_is_fast() {
        let report = run(&ReliabilityOptions::quick());
        println!("{report}");
        assert!(report.elapsed < Duration::from_millis(500), "{report}");
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
    }

    #[test]
    fn handoff_timeouts_keep_the_intervals_consistent() {
        // Both threads on one CPU: the tested thread runs only when the spinning base is preempted, so most
        // rounds time out and some answers arrive after the base gave the round up. Stale answers must never
        // be paired with a later round: the intervals still intersect (the shift of a CPU against itself is 0).
        let Some(&cpu) = affinity::allowed_cpus().unwrap_or_default().first() else {
            return;
        };
        if TickSource::hardware().is_none() {
            return;
        }
        let options = ReliabilityOptions {
            shift_rounds: u32::MAX,
            shift_time_limit_ms: 40,
            handoff_timeout_us: 1,
            ..ReliabilityOptions::quick()
        };
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let deadline = Instant::now() + Duration::from_secs(2);
        let shift = measure_shift(cpu, cpu, &options, deadline).expect("pinning to an allowed CPU");
        println!("{shift:?}");
        assert!(shift.timed_out_rounds > 0, "{shift:?}");
        assert!(!shift.is_empty(), "{shift:?}");
        if shift.is_measured() {
            assert!(shift.lo_ticks <= 0 && shift.hi_ticks >= 0, "{shift:?}");
        }
    }

    #[test]
    fn cas_order_holds_for_two_threads_on_one_cpu() {
        let Some(&cpu) = affinity::allowed_cpus().unwrap_or_default().first() else {
            return;
        };
        if TickSource::hardware().is_none() {
            return;
        }
        let options = ReliabilityOptions {
            monotonic_reads_per_cpu: 2_000,
            ..ReliabilityOptions::quick()
        };
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (sequence, participants, notes) =
            measure_monotonic(&[cpu, cpu], &options, Instant::now() + Duration::from_secs(2));
        assert_eq!(participants, 2, "{notes:?}");
        assert!(!sequence.is_empty());
        let stats = analyze_sequence(&sequence, participants);
        assert_eq!(stats.backward_steps, 0, "{stats:?}");
    }

    #[test]
    fn spin_until_gives_up() {
        let started = Instant::now();
        assert!(!spin_until(Duration::from_millis(2), || false));
        assert!(started.elapsed() >= Duration::from_millis(2));
        assert!(spin_until(Duration::from_secs(60), || true));
    }

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

        // A negative shift on another CPU widens the bound to span both, with 0 in between.
        let mut other = shift_of(&[(5_000, 4_950, 5_020)]); // [-70, -50]
        other.cpu = 2;
        assert_eq!(enclosing_shift_ticks(&[shift, other]), 180);
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
        assert_eq!(enclosing_shift_ticks(&[shift]), 20);
        // The base going backwards between its own two reads empties the interval by itself.
        assert!(shift_of(&[(500, 400, 300)]).is_empty());
    }

    #[test]
    fn unmeasured_shift_is_ignored_by_the_bound() {
        assert_eq!(enclosing_shift_ticks(&[CpuShift::unmeasured(3)]), 0);
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
    fn spread_and_rate_math() {
        assert_eq!(rate_spread_ppm(&[3e9]), 0.0);
        let spread = rate_spread_ppm(&[3e9, 3e9 * (1.0 + 300e-6)]);
        assert!((spread - 300.0).abs() < 0.1, "{spread}");

        let start = Bracket {
            ticks: 1_000,
            ref_sum_ns: 2 * 10_000,
            width_ns: 20,
        };
        let end = Bracket {
            ticks: 1_000 + 30_000_000,
            ref_sum_ns: 2 * (10_000 + 10_000_000),
            width_ns: 40,
        };
        let rate = rate_between(0, start, end);
        assert!((rate.hz - 3e9).abs() < 1.0, "{rate:?}");
        assert_eq!(rate.interval_ns, 10_000_000);
        assert!((rate.uncertainty_ppm - 3.0).abs() < 1e-9, "{rate:?}");
        assert!(rate.advances);
        let stuck = rate_between(0, start, Bracket { ticks: 1_000, ..end });
        assert!(!stuck.advances);
    }

    #[test]
    fn cpu_lists_are_compact() {
        assert_eq!(cpu_list(&[0, 1, 2, 3, 6, 8, 9]), "0-3,6,8-9");
        assert_eq!(cpu_list(&[5]), "5");
        assert_eq!(cpu_list(&[]), "none");
    }

    /// A report of a healthy two-CPU x86_64 machine, to break one fact at a time.
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

    fn reason(report: &TscReport) -> String {
        match decide(report, &ReliabilityOptions::default()) {
            TscDecision::FallBack { reason } => reason,
            TscDecision::UseTsc => String::new(),
        }
    }

    #[test]
    fn decision_uses_the_tsc_when_all_is_well() {
        assert_eq!(decide(&healthy(), &ReliabilityOptions::default()), TscDecision::UseTsc);
        let mut r = healthy();
        r.decision = decide(&r, &ReliabilityOptions::default());
        assert!(r.is_reliable());
        // Hints that are merely unknown are no reason to fall back.
        r.invariant_tsc = None;
        r.clocksource = None;
        r.tsc_clocksource_available = None;
        assert_eq!(reason(&r), "");
        // Another current clocksource is fine while tsc is still offered.
        r.clocksource = Some("kvm-clock".into());
        r.tsc_clocksource_available = Some(true);
        assert_eq!(reason(&r), "");
    }

    #[test]
    fn decision_falls_back_for_each_reason() {
        let mut r = healthy();
        r.max_shift_ticks = 36_000;
        r.max_shift_ns = 12_000.0;
        assert!(
            reason(&r).contains("TSC shift between CPUs is 12000 ns (limit 1000 ns)"),
            "{}",
            reason(&r)
        );

        let mut r = healthy();
        r.shifts[0] = CpuShift {
            cpu: 1,
            lo_ticks: 20,
            hi_ticks: 10,
            rounds: 5,
            timed_out_rounds: 0,
        };
        assert!(reason(&r).contains("do not intersect"), "{}", reason(&r));

        let mut r = healthy();
        r.shifts[0] = CpuShift {
            timed_out_rounds: 7,
            ..CpuShift::unmeasured(1)
        };
        assert!(
            reason(&r).contains("could not be measured (7 handoffs timed out)"),
            "{}",
            reason(&r)
        );

        let mut r = healthy();
        r.backward_steps = 3;
        r.max_backward_ticks = 500;
        r.monotonic = false;
        assert!(
            reason(&r).contains("TSC went backwards 3 times (max 500 ticks)"),
            "{}",
            reason(&r)
        );

        let mut r = healthy();
        r.monotonic_full_loops = 12;
        assert!(
            reason(&r).contains("only 12 full loops across CPUs (need 100)"),
            "{}",
            reason(&r)
        );

        let mut r = healthy();
        r.monotonic_reads = 0;
        assert!(reason(&r).contains("no reads"), "{}", reason(&r));

        let mut r = healthy();
        r.rate_spread_ppm = 300.0;
        assert!(
            reason(&r).contains("rates differ by 300 ppm across CPUs"),
            "{}",
            reason(&r)
        );
        // A spread within the measurement uncertainty is not evidence.
        r.rate_uncertainty_ppm = 400.0;
        assert_eq!(reason(&r), "");

        let mut r = healthy();
        r.rates[1].advances = false;
        assert!(reason(&r).contains("does not advance on CPU 1"), "{}", reason(&r));

        let mut r = healthy();
        r.rate_hz = 0.0;
        assert!(reason(&r).contains("rate could not be measured"), "{}", reason(&r));

        let mut r = healthy();
        r.invariant_tsc = Some(false);
        assert_eq!(reason(&r), "CPUID reports no invariant TSC");
        let lenient = ReliabilityOptions {
            require_invariant_tsc: false,
            ..ReliabilityOptions::default()
        };
        assert_eq!(decide(&r, &lenient), TscDecision::UseTsc);

        let mut r = healthy();
        r.tsc_clocksource_available = Some(false);
        r.clocksource = Some("hpet".into());
        assert!(
            reason(&r).contains("does not list tsc among its clocksources (current: hpet)"),
            "{}",
            reason(&r)
        );
        // The TSC hint does not apply to the ARM counter.
        r.source = Some(TickSource::ArmVirtualCounter);
        assert_eq!(reason(&r), "");

        let mut r = healthy();
        r.tested_cpus.clear();
        r.cpus_tested = 0;
        r.skipped = vec![SkippedCpu {
            cpu: 7,
            reason: "sched_setaffinity(CPU 7) failed: Invalid argument".into(),
        }];
        assert!(
            reason(&r).contains("no CPU could be measured (CPU 7: sched_setaffinity"),
            "{}",
            reason(&r)
        );

        let r = TscReport::empty(None);
        assert_eq!(
            reason(&r),
            "no hardware tick counter on this architecture (not x86_64/aarch64)"
        );

        // Several reasons are all given.
        let mut r = healthy();
        r.invariant_tsc = Some(false);
        r.backward_steps = 1;
        r.max_backward_ticks = 9;
        assert_eq!(
            reason(&r),
            "CPUID reports no invariant TSC; TSC went backwards 1 times (max 9 ticks)"
        );
    }

    #[test]
    fn report_renders_as_text_and_json() {
        let mut r = healthy();
        r.skipped.push(SkippedCpu {
            cpu: 4000,
            reason: "beyond CPU_SETSIZE".into(),
        });
        r.decision = TscDecision::FallBack {
            reason: "because".into(),
        };
        let text = r.to_string();
        assert!(text.contains("CPU 1: [-100, 200] ticks"), "{text}");
        assert!(text.contains("skipped CPU 4000"), "{text}");
        assert!(text.contains("fall back to clock_gettime: because"), "{text}");
        let json = r.to_json();
        assert_eq!(json["decision"], "fall_back");
        assert_eq!(json["reason"], "because");
        assert_eq!(json["shifts"][0]["lo_ticks"], -100);
        assert_eq!(json["rates"][1]["cpu"], 1);
        assert_eq!(json["reliable"], false);
        // Unmeasured intervals and NaN become null rather than sentinel numbers.
        r.shifts[0] = CpuShift::unmeasured(1);
        r.max_shift_ns = f64::NAN;
        let json = r.to_json();
        assert!(json["shifts"][0]["lo_ticks"].is_null());
        assert!(json["max_shift_ns"].is_null());
    }
}
