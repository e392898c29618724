//! The TSC against a clock that does not depend on it, where the machine offers one.
//!
//! tickline calibrates the TSC against `CLOCK_MONOTONIC`. Where the kernel's clocksource is the TSC itself, or
//! a paravirtual clock that scales the guest's TSC (`kvm-clock`, `xen`, Hyper-V's TSC page), `CLOCK_MONOTONIC`
//! and `CLOCK_MONOTONIC_RAW` are computed from the TSC, so a calibration agreeing with them to 0.0005 ppm is
//! circular: it shows that the conversion is consistent, not that a TSC second is a second. A clock with its own
//! oscillator breaks the circle:
//!
//! - a PTP hardware clock (`/dev/ptpN`: a NIC's clock, `ptp_kvm`'s view of the host's clock), read with
//!   `clock_gettime(FD_TO_CLOCKID(fd))`;
//! - HPET or the ACPI PM timer, when it is the kernel's *current* clocksource (`CLOCK_MONOTONIC_RAW` then counts
//!   it). Listed but not current, neither can be read from user space without root (port I/O, a `/dev/hpet`
//!   mapping) or switching the system's clocksource, which changes every process's clock: tickline does not.
//!
//! [`check_independent_reference`] lists what the machine offers, says which clocks are independent, and
//! measures the TSC's rate against the first independent one it can read, next to its rate against
//! `CLOCK_MONOTONIC`: their difference is what the circular figure cannot show.

use std::fmt;
use std::time::{Duration, Instant};

use super::reliability::read_sysfs_line;
use super::{monotonic_ns, monotonic_raw_ns, TickSource};

/// A clock the machine offers that could serve as a reference for the TSC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReferenceClock {
    /// Its name: a clocksource (`tsc`, `kvm-clock`, `hpet`) or a PTP device (`/dev/ptp0 (ptp_kvm)`).
    pub name: String,
    /// `Some(true)` for its own oscillator, `Some(false)` when it counts or scales the TSC, `None` when unknown.
    pub independent_of_tsc: Option<bool>,
    /// What it is, in a few words.
    pub about: String,
    /// Why it cannot be read from this process; `None` when it can.
    pub unreadable: Option<String>,
}

/// The TSC's rate against an independent clock and against `CLOCK_MONOTONIC`, over the same interval.
#[derive(Clone, Debug, PartialEq)]
pub struct IndependentRate {
    /// The independent clock.
    pub reference: String,
    /// The interval, in ns of the independent clock.
    pub interval_ns: u64,
    /// TSC ticks per second of the independent clock.
    pub hz_vs_reference: f64,
    /// TSC ticks per second of `CLOCK_MONOTONIC`.
    pub hz_vs_monotonic: f64,
    /// How much longer a `CLOCK_MONOTONIC` second is than the independent clock's, in ppm: what a TSC
    /// calibrated against `CLOCK_MONOTONIC` gets wrong against that clock.
    pub monotonic_error_ppm: f64,
    /// Bound of the measurement error of `monotonic_error_ppm` from the brackets' widths, in ppm.
    pub uncertainty_ppm: f64,
}

/// What [`check_independent_reference`] found: the clocks on offer and, where one could be read, the
/// measurement; otherwise why not.
#[derive(Clone, Debug, PartialEq)]
pub struct IndependentCheck {
    /// The kernel's current clocksource.
    pub current_clocksource: Option<String>,
    /// Every clock considered: the kernel's clocksources, then the PTP devices.
    pub clocks: Vec<ReferenceClock>,
    /// The TSC against the first readable independent clock.
    pub measurement: Option<IndependentRate>,
    /// Why nothing was measured.
    pub skipped: Option<String>,
}

impl fmt::Display for IndependentCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "independent reference: clocks on offer (current clocksource: {})",
            self.current_clocksource.as_deref().unwrap_or("unknown")
        )?;
        for c in &self.clocks {
            let independence = match c.independent_of_tsc {
                Some(true) => "independent of the TSC",
                Some(false) => "depends on the TSC",
                None => "independence unknown",
            };
            write!(f, "  {}: {independence}; {}", c.name, c.about)?;
            if let Some(why) = &c.unreadable {
                write!(f, " (not readable: {why})")?;
            }
            writeln!(f)?;
        }
        match (&self.measurement, &self.skipped) {
            (Some(m), _) => write!(
                f,
                "  TSC vs {} over {:.1} s: {:.1} Hz; vs CLOCK_MONOTONIC: {:.1} Hz; CLOCK_MONOTONIC's second is \
                 {:+.4} ppm off the reference's (± {:.4} ppm)",
                m.reference,
                m.interval_ns as f64 / 1e9,
                m.hz_vs_reference,
                m.hz_vs_monotonic,
                m.monotonic_error_ppm,
                m.uncertainty_ppm
            ),
            (None, Some(why)) => write!(f, "  skipped: {why}"),
            (None, None) => write!(f, "  skipped"),
        }
    }
}

/// Lists the clocks this machine offers, and measures the TSC's rate against the first independent one this
/// process can read, over `interval` (the longer, the tighter: the brackets' widths over the interval bound
/// the error). Skips, saying why, where there is none, or no hardware counter.
///
/// ```
/// let check = tickline::clock::check_independent_reference(std::time::Duration::from_millis(20));
/// println!("{check}");
/// assert!(check.measurement.is_some() || check.skipped.is_some());
/// ```
pub fn check_independent_reference(interval: Duration) -> IndependentCheck {
    let current = read_sysfs_line("/sys/devices/system/clocksource/clocksource0/current_clocksource");
    let available = read_sysfs_line("/sys/devices/system/clocksource/clocksource0/available_clocksource")
        .map(|list| list.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .unwrap_or_default();
    let mut clocks: Vec<ReferenceClock> = available
        .iter()
        .map(|name| clocksource(name, current.as_deref() == Some(name.as_str())))
        .collect();
    let ptp = ptp_devices();
    clocks.extend(ptp.iter().map(|(clock, _)| clock.clone()));

    let mut check = IndependentCheck {
        current_clocksource: current.clone(),
        clocks,
        measurement: None,
        skipped: None,
    };
    if TickSource::hardware().is_none() {
        check.skipped = Some("no hardware tick counter on this architecture".to_string());
        return check;
    }
    // A PTP device of its own first (a NIC's clock), then an independent current clocksource, then the host's
    // clock through ptp_kvm.
    let readable_ptp = |kvm: bool| {
        ptp.iter()
            .find(|(c, path)| c.unreadable.is_none() && path.is_some() && c.name.contains("ptp_kvm") == kvm)
    };
    let independent_clocksource = check
        .clocks
        .iter()
        .find(|c| c.independent_of_tsc == Some(true) && c.unreadable.is_none() && !c.name.starts_with("/dev/"));
    if let Some((clock, Some(path))) = readable_ptp(false) {
        check.measurement = measure_ptp(&clock.name, path, interval)
            .map_err(|e| check.skipped = Some(e))
            .ok();
    } else if let Some(clock) = independent_clocksource {
        let name = format!("CLOCK_MONOTONIC_RAW (counts the {} clocksource)", clock.name);
        check.measurement = Some(measure_against(&name, || Some(monotonic_raw_ns().0), interval));
    } else if let Some((clock, Some(path))) = readable_ptp(true) {
        check.measurement = measure_ptp(&clock.name, path, interval)
            .map_err(|e| check.skipped = Some(e))
            .ok();
    } else {
        let mut why = String::from("no clock independent of the TSC is readable here:");
        if available.is_empty() {
            why.push_str(" the kernel lists no clocksources;");
        } else {
            why.push_str(&format!(" the clocksources are {};", available.join(", ")));
        }
        if check.clocks.iter().any(|c| c.independent_of_tsc == Some(true)) {
            why.push_str(" the independent ones are not the current clocksource (reading them needs root);");
        }
        if ptp.is_empty() {
            why.push_str(" no /dev/ptp* device (no PTP hardware clock; ptp_kvm not loaded)");
        } else {
            why.push_str(" no /dev/ptp* device can be opened");
        }
        check.skipped = Some(why);
    }
    check
}

/// What a clocksource is, and whether its clock depends on the TSC.
fn clocksource(name: &str, current: bool) -> ReferenceClock {
    let (independent, about) = match name {
        "tsc" | "tsc-early" => (Some(false), "the TSC itself"),
        "kvm-clock" | "xen" | "hyperv_clocksource_tsc_page" => (
            Some(false),
            "a paravirtual clock: the guest's TSC scaled with the hypervisor's parameters",
        ),
        "arch_sys_counter" => (
            Some(false),
            "the ARM generic timer, the counter tickline reads on aarch64",
        ),
        "hpet" => (Some(true), "the HPET, its own ~14.3 MHz oscillator"),
        "acpi_pm" => (Some(true), "the ACPI PM timer, its own 3.58 MHz oscillator"),
        "jiffies" | "refined-jiffies" => (None, "the timer tick count: too coarse to check a rate"),
        _ => (None, "unknown to tickline"),
    };
    let unreadable = match (independent, current) {
        (Some(true), false) => Some(
            "it is not the current clocksource; user space reads it only through CLOCK_MONOTONIC_RAW once it is, \
             and switching needs root and changes every process's clock"
                .to_string(),
        ),
        _ => None,
    };
    ReferenceClock {
        name: if current {
            format!("{name} (current)")
        } else {
            name.to_string()
        },
        independent_of_tsc: independent,
        about: about.to_string(),
        unreadable,
    }
}

/// The PTP devices under `/dev`, with the path of each that opens.
fn ptp_devices() -> Vec<(ReferenceClock, Option<String>)> {
    let Ok(entries) = std::fs::read_dir("/dev") else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("ptp") && n[3..].chars().all(|c| c.is_ascii_digit()) && n.len() > 3)
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let path = format!("/dev/{n}");
            let clock_name = read_sysfs_line(&format!("/sys/class/ptp/{n}/clock_name")).unwrap_or_default();
            let kvm = clock_name == "ptp_kvm";
            let unreadable = std::fs::File::open(&path)
                .err()
                .map(|e| format!("cannot open {path}: {e}"));
            let clock = ReferenceClock {
                name: format!(
                    "{path} ({})",
                    if clock_name.is_empty() { "unnamed" } else { &clock_name }
                ),
                // ptp_kvm reads the host's clock by hypercall: independent of the guest kernel's arithmetic, but the
                // host's clock usually counts the same crystal as the guest's TSC.
                independent_of_tsc: if kvm { None } else { Some(true) },
                about: if kvm {
                    "the host's clock through a KVM hypercall (usually the same crystal as the TSC, but disciplined \
                     by the host)"
                        .to_string()
                } else {
                    "a PTP hardware clock, its own oscillator".to_string()
                },
                unreadable: unreadable.clone(),
            };
            (clock, unreadable.is_none().then_some(path))
        })
        .collect()
}

/// `clock_gettime` on a dynamic clock (`FD_TO_CLOCKID`, linux/posix-timers.h): `((~fd) << 3) | CLOCKFD`.
fn fd_to_clockid(fd: libc::c_int) -> libc::clockid_t {
    const CLOCKFD: libc::clockid_t = 3;
    ((!fd) << 3) | CLOCKFD
}

fn measure_ptp(name: &str, path: &str, interval: Duration) -> Result<IndependentRate, String> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open {path}: {e}"))?;
    let clock = fd_to_clockid(file.as_raw_fd());
    let read = move || {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid, writable timespec; `clock` names the PTP device `file` keeps open for the whole
        // measurement (the closure runs only inside `measure_against`, before `file` drops).
        let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
        (rc == 0).then(|| {
            (ts.tv_sec as u64)
                .wrapping_mul(1_000_000_000)
                .wrapping_add(ts.tv_nsec as u64)
        })
    };
    if read().is_none() {
        return Err(format!(
            "clock_gettime on {path} failed: {}",
            std::io::Error::last_os_error()
        ));
    }
    let rate = measure_against(name, read, interval);
    drop(file);
    Ok(rate)
}

/// One reference read between two TSC reads; the tightest of a few is kept.
#[derive(Clone, Copy, Debug)]
struct Bracket {
    /// Twice the TSC midpoint (kept exact).
    ticks_sum: u128,
    /// The bracket's width, in ticks.
    width_ticks: u64,
    /// The reference.
    reference_ns: u64,
}

fn tightest(read: &impl Fn() -> Option<u64>, samples: usize) -> Option<Bracket> {
    let source = TickSource::hardware()?;
    (0..samples)
        .filter_map(|_| {
            let a = source.read().0;
            let r = read()?;
            let b = source.read().0;
            Some(Bracket {
                ticks_sum: u128::from(a) + u128::from(b),
                width_ticks: b.wrapping_sub(a),
                reference_ns: r,
            })
        })
        .min_by_key(|b| b.width_ticks)
}

/// Rate in ticks per reference second between two brackets, and its error bound in ppm.
fn rate(start: Bracket, end: Bracket) -> Option<(f64, f64, u64)> {
    let ns = end.reference_ns.checked_sub(start.reference_ns).filter(|&ns| ns > 0)?;
    let twice_ticks = end.ticks_sum.checked_sub(start.ticks_sum)? as f64;
    let hz = twice_ticks / 2.0 * 1e9 / ns as f64;
    let error_ticks = (start.width_ticks + end.width_ticks) as f64 / 2.0;
    Some((hz, error_ticks * 2e6 / twice_ticks, ns))
}

/// The TSC's rate against `read` and against `CLOCK_MONOTONIC`, measured over the same `interval`.
fn measure_against(name: &str, read: impl Fn() -> Option<u64>, interval: Duration) -> IndependentRate {
    let mono = || Some(monotonic_ns().0);
    let samples = 64;
    let start_ref = tightest(&read, samples);
    let start_mono = tightest(&mono, samples);
    let until = Instant::now() + interval;
    while Instant::now() < until {
        std::thread::sleep(until.saturating_duration_since(Instant::now()));
    }
    let end_ref = tightest(&read, samples);
    let end_mono = tightest(&mono, samples);
    let vs_ref = start_ref.zip(end_ref).and_then(|(a, b)| rate(a, b));
    let vs_mono = start_mono.zip(end_mono).and_then(|(a, b)| rate(a, b));
    match (vs_ref, vs_mono) {
        (Some((hz_ref, u_ref, ns)), Some((hz_mono, u_mono, _))) => IndependentRate {
            reference: name.to_string(),
            interval_ns: ns,
            hz_vs_reference: hz_ref,
            hz_vs_monotonic: hz_mono,
            // hz = ticks per second of that clock: a longer MONOTONIC second holds more ticks.
            monotonic_error_ppm: (hz_mono / hz_ref - 1.0) * 1e6,
            uncertainty_ppm: u_ref + u_mono,
        },
        _ => IndependentRate {
            reference: name.to_string(),
            interval_ns: 0,
            hz_vs_reference: f64::NAN,
            hz_vs_monotonic: f64::NAN,
            monotonic_error_ppm: f64::NAN,
            uncertainty_ppm: f64::INFINITY,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocksources_are_classified() {
        assert_eq!(clocksource("tsc", true).independent_of_tsc, Some(false));
        assert_eq!(clocksource("tsc", true).name, "tsc (current)");
        assert_eq!(clocksource("kvm-clock", false).independent_of_tsc, Some(false));
        let hpet = clocksource("hpet", false);
        assert_eq!(hpet.independent_of_tsc, Some(true));
        assert!(hpet
            .unreadable
            .as_deref()
            .unwrap_or("")
            .contains("not the current clocksource"));
        assert_eq!(clocksource("acpi_pm", true).unreadable, None);
        assert_eq!(clocksource("something-new", false).independent_of_tsc, None);
    }

    #[test]
    fn fd_to_clockid_matches_the_kernel_macro() {
        // linux/posix-timers.h: #define FD_TO_CLOCKID(fd) ((~(clockid_t) (fd) << 3) | CLOCKFD), CLOCKFD 3.
        assert_eq!(fd_to_clockid(3), -29);
        assert_eq!(fd_to_clockid(0), -5);
    }

    #[test]
    fn the_measurement_math_agrees_with_itself() {
        // CLOCK_MONOTONIC against itself: the same clock, so the "error" is 0 within the stated bound.
        if TickSource::hardware().is_none() {
            eprintln!("skipped: no hardware tick counter");
            return;
        }
        let m = measure_against("CLOCK_MONOTONIC", || Some(monotonic_ns().0), Duration::from_millis(30));
        println!("{m:?}");
        assert!(m.hz_vs_reference > 1e6, "{m:?}");
        assert!(m.monotonic_error_ppm.abs() <= m.uncertainty_ppm + 1e-6, "{m:?}");
    }

    #[test]
    fn the_check_measures_or_says_why_not() {
        let check = check_independent_reference(Duration::from_millis(10));
        println!("{check}");
        assert!(check.measurement.is_some() ^ check.skipped.is_some(), "{check:?}");
        let text = check.to_string();
        assert!(text.starts_with("independent reference:"), "{text}");
        if let Some(current) = &check.current_clocksource {
            assert!(
                check.clocks.iter().any(|c| c.name == format!("{current} (current)")),
                "{check:?}"
            );
        }
    }
}
