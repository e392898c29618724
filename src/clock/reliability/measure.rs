//! Measurement: one pass of the check, with threads pinned one per CPU. Reads the hints, then the three
//! measurements (rate, shift, monotonicity) into a [`TscReport`]; decides nothing.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::affinity;
use super::analyze::{analyze_sequence, enclosing_shift_ticks, proven_shift_ticks, rate_spread_ppm};
use super::options::{ProbeFaults, ProbePhase, ReliabilityOptions};
use super::report::{CpuRate, CpuShift, SkippedCpu, TscReport};
use crate::clock::{monotonic_raw_ns, TickSource};

/// One pass: the hints, then every measurement, within `deadline`.
pub(super) fn run_pass(options: &ReliabilityOptions, deadline: Instant) -> TscReport {
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
    report
}

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

    // 2. Shifts against the lowest tested CPU. Rounds wider than `max_probe_width_ns` were interrupted; with no
    //    rate to convert the width, none is discarded (the intersection stays sound, only less tight).
    let max_width_ticks = if report.rate_hz > 0.0 {
        (options.max_probe_width_ns as f64 * report.rate_hz / 1e9) as u64
    } else {
        u64::MAX
    };
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
            match measure_shift(base, cpu, options, max_width_ticks, deadline) {
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
    report.proven_shift_ticks = proven_shift_ticks(&report.shifts);
    let to_ns = |ticks: u64| {
        if report.rate_hz > 0.0 {
            ticks as f64 * 1e9 / report.rate_hz
        } else {
            f64::NAN
        }
    };
    report.max_shift_ns = to_ns(report.max_shift_ticks);
    report.proven_shift_ns = to_ns(report.proven_shift_ticks);

    // 3. The CAS-ordered monotonicity sequence on all tested CPUs at once.
    if !report.tested_cpus.is_empty() {
        if Instant::now() >= deadline {
            report
                .notes
                .push("time budget spent before the monotonicity sequence".to_string());
            return;
        }
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

/// A pinned thread's counter reads, with the test hooks' offset for its CPU.
#[derive(Clone, Copy)]
struct Probe<'a> {
    offset: i64,
    faults: &'a ProbeFaults,
}

impl<'a> Probe<'a> {
    fn on(cpu: usize, faults: &'a ProbeFaults) -> Self {
        Probe {
            offset: faults.offset_on(cpu),
            faults,
        }
    }

    #[inline(always)]
    fn ticks(self) -> u64 {
        ordered_ticks().wrapping_add_signed(self.offset)
    }
}

/// Rate of every CPU in `cpus`, measured in parallel by one pinned thread each; `Err` for a CPU that could
/// not be measured (pinning failed, no thread).
fn measure_rates(cpus: &[usize], options: &ReliabilityOptions) -> Vec<(usize, Result<CpuRate, String>)> {
    let interval = Duration::from_millis(options.rate_interval_ms.max(1));
    let samples = options.rate_bracket_samples.max(1);
    let faults = &options.faults;
    thread::scope(|scope| {
        let handles: Vec<_> = cpus
            .iter()
            .map(|&cpu| {
                let handle = thread::Builder::new()
                    .name(format!("tsc-rate-{cpu}"))
                    .spawn_scoped(scope, move || rate_on_cpu(cpu, interval, samples, faults));
                (cpu, handle)
            })
            .collect();
        handles
            .into_iter()
            .map(|(cpu, handle)| (cpu, join(handle, "rate")))
            .collect()
    })
}

fn rate_on_cpu(cpu: usize, interval: Duration, samples: u32, faults: &ProbeFaults) -> Result<CpuRate, String> {
    affinity::pin_current_thread(cpu)?;
    let probe = Probe::on(cpu, faults);
    let start = tightest_bracket(samples, probe, None);
    thread::sleep(interval);
    let end = tightest_bracket(samples, probe, Some(ProbePhase::Rate));
    Ok(rate_between(cpu, start, end))
}

/// One counter read between two reads of `CLOCK_MONOTONIC_RAW`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Bracket {
    /// The counter.
    pub(super) ticks: u64,
    /// The sum of the two reference reads (twice the bracket's midpoint, kept exact), in ns.
    pub(super) ref_sum_ns: u64,
    /// The bracket's width, in ns.
    pub(super) width_ns: u64,
}

/// The tightest of `samples` brackets; the first sample holds an injected preemption of `phase`, if one is due.
fn tightest_bracket(samples: u32, probe: Probe<'_>, phase: Option<ProbePhase>) -> Bracket {
    let mut best: Option<Bracket> = None;
    for i in 0..samples {
        let before = monotonic_raw_ns().0;
        if let (0, Some(phase)) = (i, phase) {
            probe.faults.maybe_preempt(phase);
        }
        let ticks = probe.ticks();
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
        ticks: probe.ticks(),
        ref_sum_ns: 2 * monotonic_raw_ns().0,
        width_ns: 0,
    })
}

/// The rate between two brackets, with its error bound: each midpoint is off by at most half its bracket.
pub(super) fn rate_between(cpu: usize, start: Bracket, end: Bracket) -> CpuRate {
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
        // Release: pairs with the tested thread's Acquire load of `flag`; nothing else to publish but the stop.
        self.0.store(DONE, Ordering::Release);
    }
}

/// The shift of `cpu`'s counter against `base`'s, from rounds of handoffs between two pinned threads. Rounds
/// whose bracket is wider than `max_width_ticks` are counted as interrupted and left out.
pub(super) fn measure_shift(
    base: usize,
    cpu: usize,
    options: &ReliabilityOptions,
    max_width_ticks: u64,
    deadline: Instant,
) -> Result<CpuShift, String> {
    let handoff = Handoff {
        flag: AtomicU64::new(0),
        current: AtomicU64::new(0),
        peer: AtomicUsize::new(STARTING),
    };
    let start_timeout = Duration::from_millis(options.thread_start_timeout_ms);
    let limit = Duration::from_millis(options.shift_time_limit_ms);
    // The tested thread gives up by itself only if the base thread never tells it to stop.
    let give_up = Instant::now() + limit + 2 * start_timeout + Duration::from_secs(1);
    let faults = &options.faults;
    thread::scope(|scope| {
        let h = &handoff;
        let tested = thread::Builder::new()
            .name(format!("tsc-shift-{cpu}"))
            .spawn_scoped(scope, move || shift_tested_side(h, cpu, give_up, faults));
        let based = thread::Builder::new()
            .name(format!("tsc-shift-base-{base}"))
            .spawn_scoped(scope, move || {
                shift_base_side(h, base, cpu, options, max_width_ticks, deadline)
            });
        let base_result = join(based, "shift base");
        // Release: pairs with the tested thread's Acquire load of `flag` (in case the base thread never started).
        handoff.flag.store(DONE, Ordering::Release);
        let tested_result = join(tested, "shift");
        tested_result?;
        base_result
    })
}

fn shift_tested_side(h: &Handoff, cpu: usize, give_up: Instant, faults: &ProbeFaults) -> Result<(), String> {
    if let Err(e) = affinity::pin_current_thread(cpu) {
        // Release: pairs with the base's Acquire load of `peer`.
        h.peer.store(FAILED, Ordering::Release);
        return Err(e);
    }
    let probe = Probe::on(cpu, faults);
    // Release: pairs with the base's Acquire load of `peer`.
    h.peer.store(READY, Ordering::Release);
    let mut answered = 0u64;
    let mut spins = 0u32;
    loop {
        let flag = h.flag.load(Ordering::Acquire);
        if flag == DONE {
            return Ok(());
        }
        if flag & 1 == 1 && flag != answered {
            let current = probe.ticks();
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
    max_width_ticks: u64,
    deadline: Instant,
) -> Result<CpuShift, String> {
    let _stop = StopOnDrop(&h.flag);
    affinity::pin_current_thread(base).map_err(|e| format!("base CPU {base}: {e}"))?;
    let probe = Probe::on(base, &options.faults);
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
        let base1 = probe.ticks();
        // Release: pairs with the tested thread's Acquire load of `flag`.
        h.flag.store(ask, Ordering::Release);
        options.faults.maybe_preempt(ProbePhase::Shift);
        let answered = spin_until(timeout, || h.flag.load(Ordering::Acquire) == ask + 1)
            // Give the round up, unless the answer arrived meanwhile (then the CAS fails on `ask + 1`).
            || h.flag.compare_exchange(ask, ask + 1, Ordering::AcqRel, Ordering::Acquire) == Err(ask + 1);
        let base2 = probe.ticks();
        if !answered {
            shift.timed_out_rounds += 1;
            continue;
        }
        if base2.wrapping_sub(base1) > max_width_ticks {
            // Preempted or descheduled somewhere in the round: the interval is only as wide as the interruption,
            // and says nothing about the shift. Leave it out (an interval never widens the intersection, but a
            // CPU measured only by such rounds would report a bound of milliseconds).
            shift.interrupted_rounds += 1;
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
pub(super) fn measure_monotonic(
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
    let faults = &options.faults;
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
                        Ok(cas_ordered_reads(seq, total, n > 1, stop, Probe::on(cpu, faults)))
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
/// winner's CAS, which followed its read: so the kept reads are in real-time order. A thread preempted between
/// its read and its CAS loses the CAS (another thread moved the number on) and its read is dropped, so
/// preemption can thin the sequence but never put a stale read into it.
fn cas_ordered_reads(
    seq: &AtomicU64,
    total: u64,
    take_turns: bool,
    stop: Instant,
    probe: Probe<'_>,
) -> Vec<(u64, u64)> {
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
        let ticks = probe.ticks();
        if seq
            .compare_exchange(position, position + 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            reads.push((position, ticks));
            probe.faults.maybe_preempt(ProbePhase::Monotonic);
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
pub(super) fn spin_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
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
    // SeqCst fences: the read must not move across the surrounding atomics in either direction, which is what
    // the lfence/dsb+isb pairs give on the two architectures above.
    std::sync::atomic::fence(Ordering::SeqCst);
    let ticks = crate::clock::read_ticks().0;
    std::sync::atomic::fence(Ordering::SeqCst);
    ticks
}

fn invariant_tsc_hint() -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        Some(crate::clock::x86_64::cpuid_invariant_tsc())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

pub(crate) fn read_sysfs_line(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.trim();
    (!line.is_empty()).then(|| line.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::reliability::analyze::SequenceStats;
    use crate::clock::reliability::tests::SERIAL;

    #[test]
    fn handoff_timeouts_keep_the_intervals_consistent() {
        // Both threads on one CPU: the tested thread runs only when the spinning base is preempted, so most
        // rounds time out and some answers arrive after the base gave the round up. Stale answers must never
        // be paired with a later round: the intervals still intersect (the shift of a CPU against itself is 0).
        let Some(cpu) = first_cpu_with_hardware_ticks() else {
            return;
        };
        let options = ReliabilityOptions {
            shift_rounds: u32::MAX,
            shift_time_limit_ms: 40,
            handoff_timeout_us: 1,
            ..ReliabilityOptions::quick()
        };
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let deadline = Instant::now() + Duration::from_secs(2);
        // No width limit: every answered round counts, the late ones included.
        let shift = measure_shift(cpu, cpu, &options, u64::MAX, deadline).expect("pinning to an allowed CPU");
        println!("{shift:?}");
        assert!(shift.timed_out_rounds > 0, "{shift:?}");
        assert!(!shift.is_empty(), "{shift:?}");
        if shift.is_measured() {
            assert!(shift.lo_ticks <= 0 && shift.hi_ticks >= 0, "{shift:?}");
        }
    }

    /// The first CPU this thread may run on, or `None` (with a printed reason) where the test cannot run: no
    /// CPU affinity, or no hardware tick counter.
    fn first_cpu_with_hardware_ticks() -> Option<usize> {
        let Some(&cpu) = affinity::allowed_cpus().unwrap_or_default().first() else {
            eprintln!("skipped: no CPU affinity here");
            return None;
        };
        if TickSource::hardware().is_none() {
            eprintln!("skipped: no hardware tick counter");
            return None;
        }
        Some(cpu)
    }

    #[test]
    fn a_preempted_round_is_discarded() {
        let Some(cpu) = first_cpu_with_hardware_ticks() else {
            return;
        };
        // Both threads on one CPU, the base sleeping 3 ms inside the first round: the tested thread answers
        // meanwhile, and the round comes back 3 ms wide. With a 20 µs width limit (~1e5 ticks at any
        // plausible rate, far below 3 ms) it must be counted as interrupted, never intersected.
        let options = ReliabilityOptions {
            shift_rounds: 1,
            handoff_timeout_us: 50_000,
            faults: ProbeFaults {
                preempt: Some(super::super::options::InjectedPreemption::new(
                    ProbePhase::Shift,
                    Duration::from_millis(3),
                    1,
                )),
                shifted_cpu: None,
            },
            ..ReliabilityOptions::quick()
        };
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let deadline = Instant::now() + Duration::from_secs(2);
        let shift = measure_shift(cpu, cpu, &options, 100_000, deadline).expect("pinning to an allowed CPU");
        assert_eq!((shift.rounds, shift.interrupted_rounds), (0, 1), "{shift:?}");
        assert!(!shift.is_measured());
    }

    #[test]
    fn cas_order_holds_for_two_threads_on_one_cpu() {
        let Some(cpu) = first_cpu_with_hardware_ticks() else {
            return;
        };
        let options = ReliabilityOptions {
            monotonic_reads_per_cpu: 2_000,
            ..ReliabilityOptions::quick()
        };
        let _guard = SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (sequence, participants, notes) =
            measure_monotonic(&[cpu, cpu], &options, Instant::now() + Duration::from_secs(2));
        assert_eq!(participants, 2, "{notes:?}");
        assert!(!sequence.is_empty());
        let stats: SequenceStats = analyze_sequence(&sequence, participants);
        assert_eq!(stats.backward_steps, 0, "{stats:?}");
    }

    #[test]
    fn spin_until_gives_up() {
        let started = Instant::now();
        assert!(!spin_until(Duration::from_millis(2), || false));
        assert!(started.elapsed() >= Duration::from_millis(2));
        assert!(spin_until(Duration::from_secs(60), || true));
    }

    #[test]
    fn rate_math() {
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
    fn a_shifted_cpu_reads_shifted() {
        let faults = ProbeFaults {
            preempt: None,
            shifted_cpu: Some((3, 1_000_000)),
        };
        let shifted = Probe::on(3, &faults).ticks();
        let plain = Probe::on(2, &faults).ticks();
        assert!(shifted.wrapping_sub(plain) as i64 > 900_000, "{shifted} vs {plain}");
    }
}
