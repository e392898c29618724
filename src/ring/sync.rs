//! The ring's synchronization primitives, picked by `cfg(loom)`.
//!
//! Every atomic, every slot cell, the `Arc` and the spin hints the ring uses come from this module, so
//! that under `RUSTFLAGS="--cfg loom"` loom sees each of them and explores every interleaving and
//! every value a load may legally return. Only the ring switches to loom types; the rest of the crate
//! stays on `std` under `cfg(loom)`.
//!
//! Loom's `loom::cell::UnsafeCell` is accessed through closures (`with` / `with_mut`) so that loom
//! can track each access. The non-loom [`UnsafeCell`] below has the same closure API, so the ring's
//! code is the same under both configurations, except `Consumer::read_run`: it hands out slots as a
//! `[T]` slice, which loom's (non-transparent) cells cannot be, so its loom build reads each slot
//! through a tracked guard instead.

#[cfg(loom)]
pub(crate) use loom::{
    cell::UnsafeCell,
    hint::spin_loop,
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    sync::Arc,
    thread::yield_now,
};

#[cfg(not(loom))]
pub(crate) use core::{
    hint::spin_loop,
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
};
#[cfg(not(loom))]
pub(crate) use std::{sync::Arc, thread::yield_now};

/// [`core::cell::UnsafeCell`] with loom's closure-based access API.
///
/// `repr(transparent)`: a `[UnsafeCell<MaybeUninit<T>>]` has the layout of a `[T]`, which the ring
/// relies on to hand out contiguous slices of slots (see `Shared::slots_as_slice` in `ring/mod.rs`).
#[cfg(not(loom))]
#[repr(transparent)]
#[derive(Debug)]
pub(crate) struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    /// Wraps `value`.
    #[inline(always)]
    pub(crate) const fn new(value: T) -> Self {
        Self(core::cell::UnsafeCell::new(value))
    }

    /// Calls `f` with a pointer through which the value may be read (loom: an immutable access).
    #[inline(always)]
    #[allow(dead_code, reason = "API parity with loom's cell; the ring reads slots as slices")]
    pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Calls `f` with a pointer through which the value may be written (loom: a mutable access).
    #[inline(always)]
    pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}
