//! The guards of wgpu-level scopes ([`WgpuScope`], [`WgpuOwningScope`]), what they record into
//! ([`WgpuRecorder`]), the [`wgpu_scope!`](macro@crate::wgpu_scope) macro, and the interning of run-time labels
//! into call sites.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::panic::Location;
use std::sync::Mutex;

use super::profiler::{Opened, WgpuProfiler};
use crate::callsite::NativeCallsite;

mod sealed {
    pub trait Sealed {}
    impl Sealed for wgpu::CommandEncoder {}
    impl Sealed for wgpu::ComputePass<'_> {}
    impl Sealed for wgpu::RenderPass<'_> {}
}

/// What a wgpu-level scope records into: a `wgpu::CommandEncoder`, `wgpu::ComputePass` or `wgpu::RenderPass`
/// (sealed: these three). wgpu-profiler's `ProfilerCommandRecorder`.
///
/// A timestamp written into an encoder needs `Features::TIMESTAMP_QUERY_INSIDE_ENCODERS`, one inside a pass
/// `Features::TIMESTAMP_QUERY_INSIDE_PASSES`; without them a scope there is not timed (counted in
/// [`WgpuProfilerStats::untimed_scopes`](super::WgpuProfilerStats::untimed_scopes)). Pass scopes
/// ([`WgpuProfiler::scoped_compute_pass`], [`WgpuProfiler::scoped_render_pass`]) need only `TIMESTAMP_QUERY`.
///
/// ```
/// use tickline::gpu::wgpu::WgpuRecorder;
/// fn timed_with<R: WgpuRecorder>() -> wgpu::Features {
///     R::TIMESTAMP_FEATURE
/// }
/// assert_eq!(timed_with::<wgpu::ComputePass<'static>>(), wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);
/// ```
pub trait WgpuRecorder: sealed::Sealed {
    /// The feature a timestamp written here needs.
    const TIMESTAMP_FEATURE: wgpu::Features;
    /// `write_timestamp` of the encoder or pass.
    #[doc(hidden)]
    fn write_timestamp(&mut self, query_set: &wgpu::QuerySet, index: u32);
    /// `push_debug_group` of the encoder or pass.
    #[doc(hidden)]
    fn push_debug_group(&mut self, label: &str);
    /// `pop_debug_group` of the encoder or pass.
    #[doc(hidden)]
    fn pop_debug_group(&mut self);
}

macro_rules! recorder {
    ($($ty:ty: $feature:ident),* $(,)?) => {$(
        impl WgpuRecorder for $ty {
            const TIMESTAMP_FEATURE: wgpu::Features = wgpu::Features::$feature;
            #[inline]
            fn write_timestamp(&mut self, query_set: &wgpu::QuerySet, index: u32) {
                <$ty>::write_timestamp(self, query_set, index)
            }
            #[inline]
            fn push_debug_group(&mut self, label: &str) {
                <$ty>::push_debug_group(self, label)
            }
            #[inline]
            fn pop_debug_group(&mut self) {
                <$ty>::pop_debug_group(self)
            }
        }
    )*};
}
recorder!(
    wgpu::CommandEncoder: TIMESTAMP_QUERY_INSIDE_ENCODERS,
    wgpu::ComputePass<'_>: TIMESTAMP_QUERY_INSIDE_PASSES,
    wgpu::RenderPass<'_>: TIMESTAMP_QUERY_INSIDE_PASSES,
);

/// An open wgpu-level scope on a borrowed encoder or pass: the end timestamp is written into it when this guard
/// drops. Dereferences to the encoder or pass, so the scope's own commands are recorded through it; nest with
/// [`scope`](Self::scope). Made by [`WgpuProfiler::scope`] or [`wgpu_scope!`](macro@crate::wgpu_scope).
///
/// Not `Send`: the scope's begin was recorded on this thread's timeline ring, and its end belongs on the same
/// thread (as with [`GpuScope`](crate::gpu::GpuScope)).
///
/// ```compile_fail,E0277
/// fn assert_send<T: Send>() {}
/// assert_send::<tickline::gpu::wgpu::WgpuScope<'static, wgpu::CommandEncoder>>();
/// ```
#[must_use = "the GPU scope ends when this guard is dropped"]
pub struct WgpuScope<'a, R: WgpuRecorder> {
    profiler: &'a WgpuProfiler,
    recorder: &'a mut R,
    opened: Opened,
    _not_send: PhantomData<*const ()>,
}

/// An open wgpu-level scope that owns its encoder or pass: a pass scope ([`WgpuProfiler::scoped_compute_pass`],
/// [`WgpuProfiler::scoped_render_pass`]), whose timestamps the pass itself writes at its boundaries, or
/// [`WgpuProfiler::owning_scope`]. The scope ends, and a pass with it, when this guard drops. Dereferences to
/// the pass or encoder; nest with [`scope`](Self::scope).
///
/// Not `Send`, like [`WgpuScope`].
///
/// ```compile_fail,E0277
/// fn assert_send<T: Send>() {}
/// assert_send::<tickline::gpu::wgpu::WgpuOwningScope<'static, wgpu::ComputePass<'static>>>();
/// ```
#[must_use = "the GPU scope ends when this guard is dropped"]
pub struct WgpuOwningScope<'a, R: WgpuRecorder> {
    profiler: &'a WgpuProfiler,
    opened: Opened,
    recorder: R,
    _not_send: PhantomData<*const ()>,
}

impl<'a, R: WgpuRecorder> WgpuScope<'a, R> {
    pub(super) fn new(profiler: &'a WgpuProfiler, recorder: &'a mut R, opened: Opened) -> Self {
        WgpuScope {
            profiler,
            recorder,
            opened,
            _not_send: PhantomData,
        }
    }
}

impl<'a, R: WgpuRecorder> WgpuOwningScope<'a, R> {
    pub(super) fn new(profiler: &'a WgpuProfiler, recorder: R, opened: Opened) -> Self {
        WgpuOwningScope {
            profiler,
            opened,
            recorder,
            _not_send: PhantomData,
        }
    }
}

impl<R: WgpuRecorder> Drop for WgpuScope<'_, R> {
    #[inline]
    fn drop(&mut self) {
        self.profiler.close(&self.opened, &mut *self.recorder);
    }
}

impl<R: WgpuRecorder> Drop for WgpuOwningScope<'_, R> {
    #[inline]
    fn drop(&mut self) {
        // The pass (if any) ends right after, when `recorder` drops: its end timestamp is written then.
        self.profiler.close(&self.opened, &mut self.recorder);
    }
}

/// What both guards offer: nesting, pass scopes on encoders, access to the encoder or pass.
macro_rules! guard_methods {
    ($guard:ident) => {
        impl<'a, R: WgpuRecorder> $guard<'a, R> {
            /// Opens a scope nested in this one, on the same encoder or pass.
            #[track_caller]
            #[inline]
            pub fn scope(&mut self, label: impl AsRef<str>) -> WgpuScope<'_, R> {
                let profiler = self.profiler;
                profiler.scope(label, &mut **self)
            }
        }

        impl<'a> $guard<'a, wgpu::CommandEncoder> {
            /// A compute pass timed by its own boundary timestamps, nested in this scope: see
            /// [`WgpuProfiler::scoped_compute_pass`].
            #[track_caller]
            pub fn scoped_compute_pass(
                &mut self,
                label: impl AsRef<str>,
            ) -> WgpuOwningScope<'_, wgpu::ComputePass<'_>> {
                let profiler = self.profiler;
                profiler.scoped_compute_pass(label, &mut **self)
            }

            /// A render pass timed by its own boundary timestamps, nested in this scope: see
            /// [`WgpuProfiler::scoped_render_pass`].
            #[track_caller]
            pub fn scoped_render_pass(
                &mut self,
                label: impl AsRef<str>,
                descriptor: wgpu::RenderPassDescriptor<'_>,
            ) -> WgpuOwningScope<'_, wgpu::RenderPass<'_>> {
                let profiler = self.profiler;
                profiler.scoped_render_pass(label, &mut **self, descriptor)
            }
        }

        impl<R: WgpuRecorder> Deref for $guard<'_, R> {
            type Target = R;
            #[inline]
            fn deref(&self) -> &R {
                &self.recorder
            }
        }

        impl<R: WgpuRecorder> DerefMut for $guard<'_, R> {
            #[inline]
            fn deref_mut(&mut self) -> &mut R {
                &mut self.recorder
            }
        }

        impl<R: WgpuRecorder> std::fmt::Debug for $guard<'_, R> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($guard))
                    .field("opened", &self.opened)
                    .finish_non_exhaustive()
            }
        }
    };
}
guard_methods!(WgpuScope);
guard_methods!(WgpuOwningScope);

/// Opens a wgpu-level GPU scope on an encoder or pass, with a call site fixed at compile time and optional
/// fields (as [`gpu_scope!`](macro@crate::gpu_scope)): `wgpu_scope!(profiler, &mut encoder_or_pass, "name",
/// field = value, ...)`. Returns a [`WgpuScope`] guard that dereferences to the encoder or pass and writes the
/// end timestamp when dropped.
///
/// The cheapest way to open a scope: [`WgpuProfiler::scope`] takes a run-time label (wgpu-profiler's
/// signature) and looks its call site up in a per-thread table.
///
/// ```no_run
/// # #[allow(dead_code)]
/// # fn demo(profiler: &tickline::gpu::wgpu::WgpuProfiler, device: &wgpu::Device, frame: u64) {
/// let mut encoder = device.create_command_encoder(&Default::default());
/// {
///     let mut upload = tickline::wgpu_scope!(profiler, &mut encoder, "upload", frame = frame);
///     // ... upload.copy_buffer_to_buffer(..) ...
///     let _inner = tickline::wgpu_scope!(profiler, &mut *upload, "inner");
/// }
/// profiler.resolve_queries(&mut encoder);
/// # }
/// ```
#[macro_export]
macro_rules! wgpu_scope {
    ($profiler:expr, $recorder:expr, $name:expr $(,)?) => {{
        static CALLSITE: $crate::export::NativeCallsite = $crate::export::NativeCallsite::new($name, file!(), line!());
        $crate::gpu::wgpu::WgpuProfiler::scope_at(&$profiler, &CALLSITE, None, $recorder)
    }};
    ($profiler:expr, $recorder:expr, $name:expr, $($field:ident = $value:expr),+ $(,)?) => {{
        static CALLSITE: $crate::export::NativeCallsite =
            $crate::export::NativeCallsite::with_fields($name, &[$(stringify!($field)),+], file!(), line!());
        $crate::gpu::wgpu::WgpuProfiler::scope_at(
            &$profiler,
            &CALLSITE,
            $crate::__gpu_field_encoder!($($value),+),
            $recorder,
        )
    }};
}

/// The call site of scopes whose label did not fit in the label table: the label is recorded as a field.
pub(super) static OVERFLOW: NativeCallsite =
    NativeCallsite::with_fields("wgpu scope (label table full)", &["label"], file!(), line!());

/// Most distinct `(label, call site)` pairs interned per process (each is a leaked [`NativeCallsite`] of a few dozen
/// bytes plus its label); past it, scopes record their label as a field of [`OVERFLOW`].
const MAX_LABELS: usize = 4096;
/// Most labels a thread caches per call site: a call site with labels made at run time (`format!("pass
/// {i}")`) looks the rest up in the process table.
const CACHED_PER_SITE: usize = 16;

/// Hashes a call site's address: one multiply (the addresses are distinct and aligned).
#[derive(Default)]
struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    fn write_usize(&mut self, n: usize) {
        // Fibonacci hashing (Knuth, TAOCP 6.4): spreads aligned addresses over the high bits HashMap uses.
        self.0 = (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type Sites = HashMap<usize, Vec<(Box<str>, &'static NativeCallsite)>, BuildHasherDefault<AddressHasher>>;

thread_local! {
    static CACHE: RefCell<Sites> = RefCell::new(Sites::default());
}

static TABLE: Mutex<(usize, Option<Sites>)> = Mutex::new((0, None));

/// The call site for scopes labelled `label` at `location`: made once per process for each pair, then found in
/// this thread's cache (a hash of the location's address and a string compare). `None` once the process table
/// holds [`MAX_LABELS`] of them.
pub(super) fn callsite(label: &str, location: &'static Location<'static>) -> Option<&'static NativeCallsite> {
    let site = location as *const Location<'static> as usize;
    let cached = CACHE.try_with(|cache| {
        let cache = cache.borrow();
        cache
            .get(&site)
            .and_then(|labels| labels.iter().find(|(l, _)| **l == *label))
            .map(|&(_, c)| c)
    });
    if let Ok(Some(callsite)) = cached {
        return Some(callsite);
    }
    let callsite = intern(label, site, location)?;
    let _ = CACHE.try_with(|cache| {
        let mut cache = cache.borrow_mut();
        let labels = cache.entry(site).or_default();
        if labels.len() < CACHED_PER_SITE {
            labels.push((label.into(), callsite));
        }
    });
    Some(callsite)
}

#[cold]
fn intern(label: &str, site: usize, location: &'static Location<'static>) -> Option<&'static NativeCallsite> {
    let mut table = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let (count, sites) = &mut *table;
    let labels = sites.get_or_insert_with(Sites::default).entry(site).or_default();
    if let Some(&(_, callsite)) = labels.iter().find(|(l, _)| **l == *label) {
        return Some(callsite);
    }
    if *count >= MAX_LABELS {
        return None;
    }
    *count += 1;
    // Leaked on purpose: the collector resolves a scope's name through its call site's address at any later
    // time, so call sites live as long as the process (as `static`s do); MAX_LABELS bounds the leak.
    let name: &'static str = Box::leak(label.into());
    let callsite: &'static NativeCallsite =
        Box::leak(Box::new(NativeCallsite::new(name, location.file(), location.line())));
    labels.push((name.into(), callsite));
    Some(callsite)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn here() -> &'static Location<'static> {
        Location::caller()
    }

    #[test]
    fn a_label_at_a_location_is_interned_once() {
        let (a, b) = (here(), here());
        let first = callsite("interned once", a).unwrap();
        assert!(std::ptr::eq(first, callsite("interned once", a).unwrap()));
        assert_eq!(first.name(), "interned once");
        let other_site = callsite("interned once", b).unwrap();
        assert!(
            !std::ptr::eq(first, other_site),
            "another location is another call site"
        );
        let other_label = callsite(&format!("interned {}", "twice"), a).unwrap();
        assert_eq!(other_label.name(), "interned twice");
        // Another thread finds the same call site through the process table.
        let from_thread =
            std::thread::spawn(move || callsite("interned once", a).unwrap() as *const NativeCallsite as usize)
                .join()
                .unwrap();
        assert_eq!(from_thread, first as *const NativeCallsite as usize);
    }
}
