//! Tracy source locations for `'static` call sites, made once and found again without a lock.
//!
//! Tracy identifies a zone's call site by the address of a `___tracy_source_location_data` that must stay
//! valid for the whole process (the server asks for its strings later, by address). tickline's call sites
//! (`tracing`'s `&'static Metadata`, a native `&'static NativeCallsite`) are `'static` too, so each one gets a
//! leaked source location with leaked NUL-terminated strings, made the first time the call site is seen.
//!
//! The hot path finds it again in an insert-only open-addressing table keyed by the call site's address:
//! one multiply and one or two atomic loads, no lock. Inserts take a mutex; when the table is three quarters
//! full further call sites go to a locked map (a program with more than 3072 distinct call sites pays a lock
//! for the rest).

use std::collections::HashMap;
use std::ffi::{c_char, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use tracy_client::sys::___tracy_source_location_data as SourceLocation;

/// Slots in the lock-free table (a power of two).
const SLOTS: usize = 4096;
/// Longest probe sequence before a lookup gives up on the table.
const MAX_PROBE: usize = 16;

struct Slot {
    /// The call site's address; 0 while empty.
    key: AtomicUsize,
    /// The leaked source location's address.
    value: AtomicUsize,
}

/// Call-site address → leaked Tracy source location (stored as addresses: the raw pointers inside a source
/// location are not `Send`, but the data is immutable and `'static`).
pub(crate) struct SourceLocations {
    slots: Box<[Slot]>,
    /// Inserts, and call sites beyond the table.
    slow: Mutex<(usize, HashMap<usize, usize>)>,
}

/// What a source location is made of.
pub(crate) struct Site<'a> {
    pub(crate) name: &'a str,
    pub(crate) function: &'a str,
    pub(crate) file: &'a str,
    pub(crate) line: u32,
}

#[inline(always)]
fn slot_of(key: usize) -> usize {
    // Fibonacci hashing: call-site addresses are 8- or 16-byte aligned, so the low bits carry little.
    (key.wrapping_mul(0x9e37_79b9_7f4a_7c15_u64 as usize) >> (usize::BITS - SLOTS.trailing_zeros())) & (SLOTS - 1)
}

/// Leaks `s` as a NUL-terminated string (interior NULs are cut off: Tracy reads up to the first).
pub(crate) fn leak_c_string(s: &str) -> *const c_char {
    let cut = s.find('\0').map_or(s, |i| &s[..i]);
    let c = CString::new(cut).expect("no interior NUL after the cut");
    Box::leak(c.into_boxed_c_str()).as_ptr()
}

impl SourceLocations {
    pub(crate) fn new() -> Self {
        SourceLocations {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    key: AtomicUsize::new(0),
                    value: AtomicUsize::new(0),
                })
                .collect(),
            slow: Mutex::new((0, HashMap::new())),
        }
    }

    /// The source location of call site `key`, made with `make` the first time.
    #[inline]
    pub(crate) fn get(&self, key: usize, make: impl FnOnce() -> Site<'static>) -> *const SourceLocation {
        let mut i = slot_of(key);
        for _ in 0..MAX_PROBE {
            let slot = &self.slots[i];
            // Acquire: pairs with the Release store of `key` in `insert`, which follows the store of `value`.
            let k = slot.key.load(Ordering::Acquire);
            if k == key {
                return slot.value.load(Ordering::Relaxed) as *const SourceLocation;
            }
            if k == 0 {
                break;
            }
            i = (i + 1) & (SLOTS - 1);
        }
        self.insert(key, make)
    }

    #[cold]
    fn insert(&self, key: usize, make: impl FnOnce() -> Site<'static>) -> *const SourceLocation {
        let mut slow = self.slow.lock().unwrap_or_else(|e| e.into_inner());
        let (used, overflow) = &mut *slow;
        if let Some(&value) = overflow.get(&key) {
            return value as *const SourceLocation;
        }
        // Another thread may have inserted it into the table since this one looked.
        let mut i = slot_of(key);
        let mut free = None;
        for _ in 0..MAX_PROBE {
            let k = self.slots[i].key.load(Ordering::Relaxed);
            if k == key {
                return self.slots[i].value.load(Ordering::Relaxed) as *const SourceLocation;
            }
            if k == 0 {
                free = Some(i);
                break;
            }
            i = (i + 1) & (SLOTS - 1);
        }
        let site = make();
        let location: &'static SourceLocation = Box::leak(Box::new(SourceLocation {
            name: leak_c_string(site.name),
            function: leak_c_string(site.function),
            file: leak_c_string(site.file),
            line: site.line,
            color: 0,
        }));
        let value = location as *const SourceLocation as usize;
        match free.filter(|_| *used < SLOTS / 4 * 3) {
            Some(i) => {
                *used += 1;
                self.slots[i].value.store(value, Ordering::Relaxed);
                // Release: publishes `value` (stored above) with the key; pairs with the Acquire in `get`.
                self.slots[i].key.store(key, Ordering::Release);
            }
            None => {
                overflow.insert(key, value);
            }
        }
        value as *const SourceLocation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name_of(loc: *const SourceLocation) -> String {
        // SAFETY: `loc` comes from `SourceLocations::get`, which returns leaked, never-freed source locations
        // whose `name` is a leaked NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr((*loc).name) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_call_site_gets_one_location_and_keeps_it() {
        let locs = SourceLocations::new();
        let site = |name: &'static str| {
            move || Site {
                name,
                function: "f",
                file: "file.rs",
                line: 7,
            }
        };
        let a = locs.get(0x1000, site("a"));
        let b = locs.get(0x2000, site("b"));
        assert_ne!(a, b);
        assert_eq!(locs.get(0x1000, || unreachable!("made once")), a);
        assert_eq!(name_of(a), "a");
        assert_eq!(name_of(b), "b");
    }

    #[test]
    fn more_call_sites_than_slots_still_resolve() {
        let locs = SourceLocations::new();
        let keys: Vec<usize> = (1..=SLOTS + 100).map(|i| i * 16).collect();
        let first: Vec<_> = keys
            .iter()
            .map(|&k| {
                locs.get(k, || Site {
                    name: "n",
                    function: "",
                    file: "",
                    line: 0,
                })
            })
            .collect();
        for (k, loc) in keys.iter().zip(&first) {
            assert_eq!(locs.get(*k, || unreachable!("made once")), *loc);
        }
    }

    #[test]
    fn interior_nul_is_cut() {
        let p = leak_c_string("ab\0cd");
        // SAFETY: `leak_c_string` returns a leaked NUL-terminated string.
        assert_eq!(unsafe { std::ffi::CStr::from_ptr(p) }.to_str().unwrap(), "ab");
    }
}
