//! x86_64: the TSC.

use super::RawTicks;

/// Reads the TSC with `rdtsc`. Not serialising: a few ns, no system call.
#[inline(always)]
pub(super) fn read_hardware_ticks() -> RawTicks {
    // SAFETY: `rdtsc` is part of the x86_64 baseline, has no memory effects and cannot fault in user mode
    // unless the kernel set CR4.TSD, which Linux does only for seccomp-strict processes (and then every TSC
    // reader, including the vDSO, is unusable anyway).
    RawTicks(unsafe { core::arch::x86_64::_rdtsc() })
}

/// CPUID leaf 0x80000007 EDX bit 8: the TSC runs at a constant rate in all ACPI P-, C- and T-states.
pub(crate) fn cpuid_invariant_tsc() -> bool {
    // Leaf 0x80000000 reports the highest extended leaf, checked before asking for 0x80000007.
    let max_ext = core::arch::x86_64::__cpuid(0x8000_0000).eax;
    if max_ext < 0x8000_0007 {
        return false;
    }
    let leaf = core::arch::x86_64::__cpuid(0x8000_0007);
    leaf.edx & (1 << 8) != 0
}

/// The TSC's nominal frequency from CPUID leaf 0x15 (crystal ratio), where the CPU enumerates it.
/// Most AMD CPUs and most VMs do not: then `None` and the rate is measured.
pub(super) fn hardware_nominal_hz() -> Option<u64> {
    // Leaf 0 reports the highest standard leaf, checked before asking for leaf 0x15.
    let max_leaf = core::arch::x86_64::__cpuid(0).eax;
    if max_leaf < 0x15 {
        return None;
    }
    let leaf = core::arch::x86_64::__cpuid(0x15);
    let (denominator, numerator, crystal_hz) = (leaf.eax as u64, leaf.ebx as u64, leaf.ecx as u64);
    if denominator == 0 || numerator == 0 || crystal_hz == 0 {
        return None;
    }
    Some(crystal_hz * numerator / denominator)
}
