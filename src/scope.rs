//! Native CPU instrumentation for code that does not go through `tracing`: [`scope!`](macro@crate::scope),
//! [`instant!`](macro@crate::instant) and [`counter!`](macro@crate::counter).
//!
//! Each macro call site owns a `static` [`Callsite`]; the hot path copies its address and a raw tick into the
//! thread's ring. They record into the most recently started [`crate::Timeline`] that is still running, and
//! cost one atomic load when none is.

use crate::live::{self, LiveSink};
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
pub struct ScopeGuard {
    callsite: &'static Callsite,
    /// The live sink that saw the begin, so the end goes to the same one.
    live: Option<&'static dyn LiveSink>,
}

impl std::fmt::Debug for ScopeGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopeGuard")
            .field("callsite", &self.callsite)
            .field("live_sink", &self.live.is_some())
            .finish()
    }
}

impl ScopeGuard {
    /// Opens a scope at `callsite`. Use [`scope!`](macro@crate::scope).
    #[doc(hidden)]
    #[inline(always)]
    pub fn enter(callsite: &'static Callsite) -> Self {
        record_now(&Current, Kind::ScopeBegin, callsite.addr());
        let live = live::current();
        if let Some(sink) = live {
            sink.scope_begin(callsite);
        }
        ScopeGuard { callsite, live }
    }
}

impl Drop for ScopeGuard {
    #[inline(always)]
    fn drop(&mut self) {
        if let Some(sink) = self.live {
            sink.scope_end(self.callsite);
        }
        record_now(&Current, Kind::ScopeEnd, self.callsite.addr());
    }
}

/// Records an instant at `callsite`. Use [`instant!`](macro@crate::instant).
#[doc(hidden)]
#[inline(always)]
pub fn record_instant(callsite: &'static Callsite) {
    record_now(&Current, Kind::Instant, callsite.addr());
    if let Some(sink) = live::current() {
        sink.instant(callsite);
    }
}

/// Records a frame mark at `callsite` (an instant, and the live sink's frame mark). Use
/// [`frame_mark!`](macro@crate::frame_mark).
#[doc(hidden)]
#[inline]
pub fn record_frame_mark(callsite: &'static Callsite, main: bool) {
    record_now(&Current, Kind::Instant, callsite.addr());
    if let Some(sink) = live::current() {
        sink.frame_mark((!main).then(|| callsite.name()));
    }
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

/// Marks the end of a frame: `frame_mark!()` for the main frame set, `frame_mark!("name")` for a named one.
///
/// Recorded as an instant named "frame" (or `name`) on this thread; a [`LiveSink`] such as the Tracy
/// exporter's shows it as a frame boundary.
///
/// ```
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// for _ in 0..3 {
///     // ... render ...
///     tickline::frame_mark!();
/// }
/// tickline::frame_mark!("physics tick");
/// timeline.flush().unwrap();
/// ```
#[macro_export]
macro_rules! frame_mark {
    () => {{
        static CALLSITE: $crate::Callsite = $crate::Callsite::new("frame", file!(), line!());
        $crate::__record_frame_mark(&CALLSITE, true)
    }};
    ($name:expr) => {{
        static CALLSITE: $crate::Callsite = $crate::Callsite::new($name, file!(), line!());
        $crate::__record_frame_mark(&CALLSITE, false)
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
