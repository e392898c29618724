//! The CPU clock: reading the raw tick counter, the reference clock, and deciding whether the TSC is usable.
//!
//! Reading a tick does no conversion: [`read_ticks`] returns the raw counter as [`RawTicks`]. Turning ticks
//! into nanoseconds is the calibration's job ([`crate::calibration`]), done later, off the hot path.
//!
//! Which counter a timeline reads is decided once per process ([`TscDecider`], `decision.rs`) from the
//! reliability check (`reliability/`); `independent.rs` checks the TSC against a clock that does not depend on
//! it, where the machine has one.

#[cfg(target_arch = "aarch64")]
mod aarch64;
mod calibrator;
mod decision;
mod fast;
mod independent;
mod reliability;
#[cfg(target_arch = "x86_64")]
mod x86_64;

pub use calibrator::{TscCalibrator, TscCalibratorConfig};
pub use decision::{source_name, DeciderOptions, DecisionFigures, DecisionStage, TickSourceDecision, TscDecider};
pub use fast::FastConverter;
pub use independent::{check_independent_reference, IndependentCheck, IndependentRate, ReferenceClock};
pub use reliability::{
    check_tsc_reliability, CheckVerdict, CpuRate, CpuShift, PassSummary, ReliabilityOptions, SkippedCpu, TscCheck,
    TscDecision, TscReport, Verdict,
};
// Fault injection for the check's own tests (a preempted probe, a shifted CPU).
#[doc(hidden)]
pub use reliability::{InjectedPreemption, ProbeFaults, ProbePhase};

/// A raw reading of the CPU tick counter (TSC, `cntvct_el0` or, as a fallback, `CLOCK_MONOTONIC` ns).
///
/// The unit depends on the [`TickSource`]; only a calibration turns it into nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct RawTicks(pub u64);

/// Nanoseconds of the reference clock, `CLOCK_MONOTONIC`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(transparent)]
pub struct Nanos(pub u64);

/// Which counter a [`RawTicks`] value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TickSource {
    /// The x86_64 time-stamp counter, read with `rdtsc`.
    Tsc,
    /// The aarch64 virtual counter `cntvct_el0`, ticking at `cntfrq_el0` Hz.
    ArmVirtualCounter,
    /// `clock_gettime(CLOCK_MONOTONIC)` in nanoseconds: used where no usable hardware counter exists.
    Monotonic,
}

impl TickSource {
    /// The hardware counter of this architecture, if it has one tickline can read.
    pub const fn hardware() -> Option<TickSource> {
        if cfg!(target_arch = "x86_64") {
            Some(TickSource::Tsc)
        } else if cfg!(target_arch = "aarch64") {
            Some(TickSource::ArmVirtualCounter)
        } else {
            None
        }
    }

    /// Reads this source's counter now. No conversion, no system call for the hardware counters.
    ///
    /// ```
    /// use tickline::clock::TickSource;
    /// let a = TickSource::Monotonic.read();
    /// let b = TickSource::Monotonic.read();
    /// assert!(b >= a);
    /// ```
    #[inline(always)]
    pub fn read(self) -> RawTicks {
        match self {
            TickSource::Tsc | TickSource::ArmVirtualCounter => read_hardware_ticks(),
            TickSource::Monotonic => RawTicks(monotonic_ns().0),
        }
    }

    /// The counter's nominal frequency where the hardware states it (`cntfrq_el0`; CPUID leaf 0x15 on x86),
    /// `1e9` for [`TickSource::Monotonic`], `None` where it must be measured.
    pub fn nominal_hz(self) -> Option<u64> {
        match self {
            TickSource::Monotonic => Some(1_000_000_000),
            TickSource::Tsc | TickSource::ArmVirtualCounter => hardware_nominal_hz(),
        }
    }
}

/// Reads the hardware tick counter (TSC or `cntvct_el0`); on other architectures, `CLOCK_MONOTONIC` ns.
///
/// ```
/// let t = tickline::clock::read_ticks();
/// assert!(tickline::clock::read_ticks() >= t || cfg!(not(any(target_arch = "x86_64", target_arch = "aarch64"))));
/// ```
#[inline(always)]
pub fn read_ticks() -> RawTicks {
    read_hardware_ticks()
}

#[cfg(target_arch = "x86_64")]
use x86_64::{hardware_nominal_hz, read_hardware_ticks};

#[cfg(target_arch = "aarch64")]
use aarch64::{hardware_nominal_hz, read_hardware_ticks};

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[inline(always)]
fn read_hardware_ticks() -> RawTicks {
    RawTicks(monotonic_ns().0)
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn hardware_nominal_hz() -> Option<u64> {
    Some(1_000_000_000)
}

fn clock_gettime_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC(_RAW) exist on every Linux since 2.6.28,
    // and on failure the call leaves `ts` zeroed, which we report as 0 rather than reading garbage.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    debug_assert_eq!(rc, 0, "clock_gettime failed");
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// `d` in whole ns, `u64::MAX` for a duration beyond it (a setting of `Duration::MAX` means "never", not a
/// wrapped-around few seconds).
pub(crate) fn saturating_ns(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: tickline's reference clock.
#[inline]
pub fn monotonic_ns() -> Nanos {
    Nanos(clock_gettime_ns(libc::CLOCK_MONOTONIC))
}

/// `CLOCK_MONOTONIC_RAW` now, in nanoseconds: the reference clock without NTP's frequency slewing.
#[inline]
pub fn monotonic_raw_ns() -> Nanos {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        Nanos(clock_gettime_ns(libc::CLOCK_MONOTONIC_RAW))
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        monotonic_ns()
    }
}

/// One bracketed read of `source` against the reference clock: read the reference, read the source, read the
/// reference again. The reference value is the bracket's midpoint and the deviation half its width, as
/// `VK_EXT_calibrated_timestamps` defines `maxDeviation`.
///
/// ```
/// let s = tickline::clock::bracketed_sample(tickline::clock::TickSource::Monotonic, tickline::clock::monotonic_ns);
/// assert!(s.max_deviation_ns < 1_000_000);
/// ```
#[inline]
pub fn bracketed_sample(source: TickSource, reference: fn() -> Nanos) -> crate::calibration::CalibrationSample {
    let before = reference().0;
    let ticks = source.read().0;
    let after = reference().0;
    crate::calibration::CalibrationSample::from_bracket(ticks, before, after)
}
