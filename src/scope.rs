//! Native CPU instrumentation for code that does not go through `tracing`: [`scope!`](macro@crate::scope),
//! [`instant!`](macro@crate::instant) and [`counter!`](macro@crate::counter).
//!
//! Each macro call site owns a `static` [`Callsite`]; the hot path copies its address and a raw tick into the
//! thread's ring. They record into the most recently started [`crate::Timeline`] that is still running, and
//! cost one atomic load when none is.

use crate::record::Kind;
use crate::recorder::{record_counter, record_now, Current};

/// What a native call site records. Created by the macros; not constructed by hand.
#[derive(Debug)]
pub struct Callsite {
    name: &'static str,
    fields: &'static [&'static str],
    file: &'static str,
    line: u32,
}

impl Callsite {
    /// A call site named `name` at `file:line`. Used by the macros in a `static`.
    #[doc(hidden)]
    pub const fn new(name: &'static str, file: &'static str, line: u32) -> Self {
        Callsite {
            name,
            fields: &[],
            file,
            line,
        }
    }

    /// A call site with named fields (a [`gpu_scope!`](macro@crate::gpu_scope) with fields).
    #[doc(hidden)]
    pub const fn with_fields(
        name: &'static str,
        fields: &'static [&'static str],
        file: &'static str,
        line: u32,
    ) -> Self {
        Callsite {
            name,
            fields,
            file,
            line,
        }
    }

    /// The names of the fields the call site records, in order.
    pub fn fields(&self) -> &'static [&'static str] {
        self.fields
    }

    /// The name given to the macro.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Where the macro was called.
    pub fn location(&self) -> (&'static str, u32) {
        (self.file, self.line)
    }

    #[inline(always)]
    pub(crate) fn addr(&'static self) -> u64 {
        (self as *const Callsite).expose_provenance() as u64
    }
}

/// An open native scope: the slice ends when this guard is dropped.
#[must_use = "the scope ends when this guard is dropped"]
#[derive(Debug)]
pub struct ScopeGuard {
    callsite: &'static Callsite,
}

impl ScopeGuard {
    /// Opens a scope at `callsite`. Use [`scope!`](macro@crate::scope).
    #[doc(hidden)]
    #[inline(always)]
    pub fn enter(callsite: &'static Callsite) -> Self {
        record_now(&Current, Kind::ScopeBegin, callsite.addr());
        ScopeGuard { callsite }
    }
}

impl Drop for ScopeGuard {
    #[inline(always)]
    fn drop(&mut self) {
        record_now(&Current, Kind::ScopeEnd, self.callsite.addr());
    }
}

/// Records an instant at `callsite`. Use [`instant!`](macro@crate::instant).
#[doc(hidden)]
#[inline(always)]
pub fn record_instant(callsite: &'static Callsite) {
    record_now(&Current, Kind::Instant, callsite.addr());
}

/// Records a counter value at `callsite`. Use [`counter!`](macro@crate::counter).
#[doc(hidden)]
#[inline(always)]
pub fn record_counter_value(callsite: &'static Callsite, value: f64) {
    record_counter(&Current, callsite.addr(), value);
}

/// Opens a named CPU slice on this thread until the returned guard drops.
///
/// ```
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// {
///     let _scope = tickline::scope!("decode");
///     // ... work ...
/// }
/// timeline.flush().unwrap();
/// ```
#[macro_export]
macro_rules! scope {
    ($name:expr) => {{
        static CALLSITE: $crate::Callsite = $crate::Callsite::new($name, file!(), line!());
        $crate::ScopeGuard::enter(&CALLSITE)
    }};
}

/// Records a named instant event on this thread.
///
/// ```
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// tickline::instant!("frame presented");
/// timeline.flush().unwrap();
/// ```
#[macro_export]
macro_rules! instant {
    ($name:expr) => {{
        static CALLSITE: $crate::Callsite = $crate::Callsite::new($name, file!(), line!());
        $crate::__record_instant(&CALLSITE)
    }};
}

/// Sets the named counter track to a value (anything that converts to `f64` with `as`).
///
/// ```
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// tickline::counter!("queue depth", 17);
/// timeline.flush().unwrap();
/// ```
#[macro_export]
macro_rules! counter {
    ($name:expr, $value:expr) => {{
        static CALLSITE: $crate::Callsite = $crate::Callsite::new($name, file!(), line!());
        $crate::__record_counter(&CALLSITE, ($value) as f64)
    }};
}
