//! CPU affinity: the CPUs the process may run on, and pinning the calling thread to one of them.
//!
//! Off Linux nothing can be pinned, so nothing is measured and the check falls back.

#[cfg(target_os = "linux")]
pub(super) use linux::{allowed_cpus, pin_current_thread, MAX_PIN_CPU};
#[cfg(not(target_os = "linux"))]
pub(super) use other::{allowed_cpus, pin_current_thread, MAX_PIN_CPU};

#[cfg(target_os = "linux")]
mod linux {
    use std::io;
    use std::mem::size_of;

    /// CPUs at or above this id cannot be named in a `cpu_set_t` and are not tested.
    pub(crate) const MAX_PIN_CPU: usize = libc::CPU_SETSIZE as usize;

    /// Largest mask asked for: 2^18 CPUs, far beyond any kernel's `NR_CPUS`.
    const MAX_MASK_WORDS: usize = (1 << 18) / libc::c_ulong::BITS as usize;

    /// The CPUs the calling thread may run on, ascending. Grows the mask while the kernel answers EINVAL
    /// (it does when the mask is shorter than its CPU count), so CPU ids beyond 1024 are listed too.
    pub(crate) fn allowed_cpus() -> Result<Vec<usize>, String> {
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
    pub(crate) fn pin_current_thread(cpu: usize) -> Result<(), String> {
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

#[cfg(not(target_os = "linux"))]
mod other {
    pub(crate) const MAX_PIN_CPU: usize = 1024;

    pub(crate) fn allowed_cpus() -> Result<Vec<usize>, String> {
        Err("CPU affinity is not available on this OS".to_string())
    }

    pub(crate) fn pin_current_thread(_cpu: usize) -> Result<(), String> {
        Err("CPU affinity is not available on this OS".to_string())
    }
}
