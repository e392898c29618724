//! Native CPU instrumentation for code that does not go through `tracing`: [`scope!`](macro@crate::scope),
//! [`instant!`](macro@crate::instant) and [`counter!`](macro@crate::counter).
//!
//! Each macro call site owns a `static` [`NativeCallsite`]; the hot path copies its key and a raw tick into the
//! thread's ring. Which timeline they record into: see [`scope!`](macro@crate::scope) (the one this thread
//! started, while it runs; otherwise the most recently started one still running). They cost a thread-local
//! and an atomic load when no timeline runs.
//!
//! A name is a constant `&'static str` (a literal or a `const`): it lives in the call site's `static`, read once
//! when the call site registers. A name known only at run time is a `tracing` span's field:
//! `info_span!("decode", file = %path)`.

use std::marker::PhantomData;

use crate::callsite::NativeCallsite;
use crate::live::LiveSink;
use crate::recorder::{self, Current};

/// An open native scope: the slice ends when this guard is dropped, on the thread that opened it.
///
/// Not `Send`: a scope begins and ends on one thread, or neither thread's nesting would hold. In async code
/// do not hold a scope across an `.await` (the task may resume on another worker); instrument the future
/// with a span instead, which tickline follows across threads:
///
/// ```
/// use tracing::Instrument;
/// # async fn fetch() {}
/// async fn handle() {
///     fetch().instrument(tracing::info_span!("fetch")).await;
/// }
/// # drop(handle());
/// ```
///
/// ```compile_fail
/// fn needs_send<T: Send>(_: T) {}
/// needs_send(tickline::scope!("x"));
/// ```
#[must_use = "the scope ends when this guard is dropped"]
pub struct ScopeGuard {
    callsite: &'static NativeCallsite,
    /// Whether the begin went into the ring (in drop mode a full ring refuses it, and then the end is
    /// dropped too: the slice is lost whole, and counted).
    recorded: bool,
    /// The tag its begin carried, which its end carries too.
    tag: u16,
    /// The timeline whose ring took the begin (0: none), so the end goes there even if another timeline
    /// started since.
    timeline: u64,
    /// The live sink that saw the begin, so the end goes to the same one.
    live: Option<&'static dyn LiveSink>,
    /// `!Send` and `!Sync`.
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for ScopeGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScopeGuard")
            .field("callsite", &self.callsite)
            .field("recorded", &self.recorded)
            .field("timeline", &self.timeline)
            .field("live_sink", &self.live.is_some())
            .finish()
    }
}

impl ScopeGuard {
    /// Opens a scope at `callsite`. Use [`scope!`](macro@crate::scope).
    #[doc(hidden)]
    #[inline(always)]
    pub fn enter(callsite: &'static NativeCallsite) -> Self {
        let (recorded, timeline, tag) = recorder::scope_begin(&Current, callsite);
        let live = recorder::current_live();
        if let Some(sink) = live {
            sink.scope_begin(callsite);
        }
        ScopeGuard {
            callsite,
            recorded,
            tag,
            timeline,
            live,
            _not_send: PhantomData,
        }
    }
}

impl Drop for ScopeGuard {
    #[inline(always)]
    fn drop(&mut self) {
        if let Some(sink) = self.live {
            sink.scope_end(self.callsite);
        }
        recorder::scope_end(&recorder::Began(self.timeline), self.callsite, self.recorded, self.tag);
    }
}

/// Records an instant at `callsite`. Use [`instant!`](macro@crate::instant).
#[doc(hidden)]
#[inline(always)]
pub fn record_instant(callsite: &'static NativeCallsite) {
    recorder::instant(&Current, callsite);
    if let Some(sink) = recorder::current_live() {
        sink.instant(callsite);
    }
}

/// Records a frame mark at `callsite` (an instant, and the live sink's frame mark). Use
/// [`frame_mark!`](macro@crate::frame_mark).
#[doc(hidden)]
#[inline]
pub fn record_frame_mark(callsite: &'static NativeCallsite, main: bool) {
    recorder::instant(&Current, callsite);
    if let Some(sink) = recorder::current_live() {
        sink.frame_mark((!main).then(|| callsite.name()));
    }
}

/// Records a counter value at `callsite`. Use [`counter!`](macro@crate::counter).
#[doc(hidden)]
#[inline(always)]
pub fn record_counter_value(callsite: &'static NativeCallsite, value: f64) {
    recorder::counter(&Current, callsite, value);
}

/// Opens a named CPU slice on this thread until the returned guard drops.
///
/// The name is a constant `&'static str` (a literal or a `const`), as for [`instant!`](macro@crate::instant)
/// and [`counter!`](macro@crate::counter): it lives in the call site's `static`. A name known only at run
/// time belongs in a `tracing` span's field: `info_span!("decode", file = %path)`.
///
/// # Which timeline
///
/// Native macros (`scope!`, [`instant!`](macro@crate::instant), [`counter!`](macro@crate::counter),
/// [`frame_mark!`](macro@crate::frame_mark)) have no subscriber to say which timeline they belong to. On a
/// thread that started a [`Timeline`](crate::Timeline) still running, they record into it (the latest it
/// started); on any other thread, into the most recently started timeline still running (when it stops, the one
/// started before it takes over). So parallel tests that each start a timeline get their own thread's scopes;
/// threads they spawn record into whichever timeline started last. A scope's end always goes to the timeline
/// its begin went to. `tracing` spans and events go to the timeline of the layer in their subscriber.
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
        static CALLSITE: $crate::export::NativeCallsite = $crate::export::NativeCallsite::new($name, file!(), line!());
        $crate::ScopeGuard::enter(&CALLSITE)
    }};
}

/// Records a named instant event on this thread (the name: a constant `&'static str`).
///
/// ```
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// tickline::instant!("frame presented");
/// timeline.flush().unwrap();
/// ```
#[macro_export]
macro_rules! instant {
    ($name:expr) => {{
        static CALLSITE: $crate::export::NativeCallsite = $crate::export::NativeCallsite::new($name, file!(), line!());
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
        static CALLSITE: $crate::export::NativeCallsite =
            $crate::export::NativeCallsite::new("frame", file!(), line!());
        $crate::__record_frame_mark(&CALLSITE, true)
    }};
    ($name:expr) => {{
        static CALLSITE: $crate::export::NativeCallsite = $crate::export::NativeCallsite::new($name, file!(), line!());
        $crate::__record_frame_mark(&CALLSITE, false)
    }};
}

/// Sets the named counter track (the name: a constant `&'static str`) to a value (anything that converts to
/// `f64` with `as`). One track per name: `counter!`s of one name at several call sites, on any threads, set the
/// same track.
///
/// ```
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// tickline::counter!("queue depth", 17);
/// timeline.flush().unwrap();
/// ```
#[macro_export]
macro_rules! counter {
    ($name:expr, $value:expr) => {{
        static CALLSITE: $crate::export::NativeCallsite = $crate::export::NativeCallsite::new($name, file!(), line!());
        $crate::__record_counter(&CALLSITE, ($value) as f64)
    }};
}
