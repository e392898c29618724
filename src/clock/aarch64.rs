//! aarch64: the generic timer's virtual counter.

use super::RawTicks;

/// Reads `cntvct_el0`. The `isb` keeps the read from being hoisted above earlier instructions.
#[inline(always)]
pub(super) fn read_hardware_ticks() -> RawTicks {
    let ticks: u64;
    // SAFETY: EL0 access to cntvct_el0 is enabled by Linux (CNTKCTL_EL1.EL0VCTEN) on every supported kernel;
    // the asm only reads a system register.
    unsafe { core::arch::asm!("isb", "mrs {t}, cntvct_el0", t = out(reg) ticks, options(nomem, nostack)) };
    RawTicks(ticks)
}

/// `cntfrq_el0`: the counter frequency the firmware programmed.
pub(super) fn hardware_nominal_hz() -> Option<u64> {
    let hz: u64;
    // SAFETY: cntfrq_el0 is readable at EL0 whenever cntvct_el0 is (see above); a pure register read.
    unsafe { core::arch::asm!("mrs {f}, cntfrq_el0", f = out(reg) hz, options(nomem, nostack)) };
    (hz != 0).then_some(hz)
}
