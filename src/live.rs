//! [`LiveSink`]: an optional hook the hot path calls at the moment it records, for live viewers that must see
//! an event on the instrumented thread while it happens.
//!
//! tickline's own path records raw ticks and converts them later, on the collector thread. A live viewer
//! such as Tracy cannot take events that way: its public API stamps "now" on the calling thread, so a CPU
//! zone can only be emitted by the thread that runs it. A sink installed with
//! [`TimelineBuilder::live_sink`](crate::TimelineBuilder::live_sink) is called right after tickline records a
//! span enter, scope begin, event, instant or frame mark, and right before it records the matching exit or
//! end, on the same thread.
//!
//! Cost: without a sink the layer tests one field and a native scope loads one pointer (a predictable
//! branch each). With one, the layer looks the span up in the registry once per enter (its metadata and the
//! data the sink kept at creation) and calls the sink through one virtual call.
//!
//! A sink lives as long as the process: [`TimelineBuilder::start`](crate::TimelineBuilder::start) leaks one
//! reference to it, so a native scope that loaded it just before the timeline stopped can still call it
//! (one small allocation per timeline started with a sink).

use std::any::Any;
use std::sync::atomic::{AtomicPtr, Ordering};

use tracing::span::{Attributes, Record};
use tracing::{Event, Metadata};

use crate::callsite::NativeCallsite;

/// Data a sink keeps with a span from its creation to its close (its fields formatted, for example).
pub type LiveSpanData = Box<dyn Any + Send + Sync>;

/// Hooks called on the instrumented thread as tickline records, for live viewers that must see an event on
/// that thread while it happens (Tracy's API stamps "now" on the calling thread, so a CPU zone can only be
/// emitted by the thread that runs it). Installed with
/// [`TimelineBuilder::live_sink`](crate::TimelineBuilder::live_sink).
///
/// A sink is called right after tickline records a span enter, scope begin, event, instant or frame mark, and
/// right before it records the matching exit or end. Without a sink the layer tests one field and a native
/// scope loads one pointer; with one, the layer looks the span up in the registry once per enter (its
/// metadata and what the sink kept at creation) and makes one virtual call. A sink lives as long as the
/// process: starting a timeline leaks one reference to it, so a native scope that loaded it just before the
/// timeline stopped can still call it.
///
/// Every method is called on the hot path of the application: keep them short, never block, never panic.
/// Enters and exits (begins and ends) come in pairs per thread and nest like a stack, except that `tracing`
/// lets a program exit spans out of order; a sink that keeps a per-thread stack then closes the innermost
/// one. An exit on a thread that did not enter the span (possible through `Dispatch::exit`) is not passed
/// on: it would end that thread's innermost zone, an unrelated one. The entering thread's pair stays open, as
/// the span stays that thread's current span in `tracing`'s registry. A pair is always completed on the sink that saw its first half, even when the timeline stops between
/// the two.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
///
/// #[derive(Default)]
/// struct Count(AtomicU64);
/// impl tickline::export::LiveSink for Count {
///     fn span_enter(&self, _: &'static tracing::Metadata<'static>, _: Option<&tickline::export::LiveSpanData>) {}
///     fn span_exit(&self) {}
///     fn scope_begin(&self, _: &'static tickline::export::NativeCallsite) {
///         self.0.fetch_add(1, Ordering::Relaxed);
///     }
///     fn scope_end(&self, _: &'static tickline::export::NativeCallsite) {}
/// }
///
/// let count = Arc::new(Count::default());
/// let timeline = tickline::Timeline::builder().live_sink(count.clone()).start().unwrap();
/// drop(tickline::scope!("seen live"));
/// timeline.shutdown().unwrap();
/// assert_eq!(count.0.load(Ordering::Relaxed), 1);
/// ```
pub trait LiveSink: Send + Sync + 'static {
    /// This thread is about to record into the sink's timeline for the first time: called once per thread
    /// and timeline, before the time of the thread's first record is read, so per-thread set-up done here
    /// (naming the thread for the viewer, allocating its queues) is not counted inside its first span or
    /// scope.
    fn thread_started(&self) {}

    /// A span was created (`tracing`'s `new_span`). What it returns is kept with the span and handed to
    /// [`span_enter`](Self::span_enter) and [`span_record`](Self::span_record) until the span closes.
    fn span_new(&self, attrs: &Attributes<'_>) -> Option<LiveSpanData> {
        let _ = attrs;
        None
    }

    /// Fields of a span were recorded after its creation; `data` is what the sink keeps for it (it may
    /// replace or create it).
    fn span_record(&self, meta: &'static Metadata<'static>, data: &mut Option<LiveSpanData>, values: &Record<'_>) {
        let _ = (meta, data, values);
    }

    /// This thread entered a span.
    fn span_enter(&self, meta: &'static Metadata<'static>, data: Option<&LiveSpanData>);

    /// This thread exited the span it entered most recently (see the trait docs on order).
    fn span_exit(&self);

    /// A `tracing` event on this thread.
    fn event(&self, event: &Event<'_>) {
        let _ = event;
    }

    /// A native [`scope!`](macro@crate::scope) opened on this thread.
    fn scope_begin(&self, callsite: &'static NativeCallsite);

    /// The native scope this thread opened most recently closed.
    fn scope_end(&self, callsite: &'static NativeCallsite);

    /// An [`instant!`](macro@crate::instant) on this thread.
    fn instant(&self, callsite: &'static NativeCallsite) {
        let _ = callsite;
    }

    /// A [`frame_mark!`](macro@crate::frame_mark): the end of a frame of the main frame set (`None`) or of
    /// the named one.
    fn frame_mark(&self, name: Option<&'static str>) {
        let _ = name;
    }
}

/// The current timeline's sink, or null. Non-null values come from `Box::leak` in [`set_current`] and are
/// never freed.
static CURRENT: AtomicPtr<&'static dyn LiveSink> = AtomicPtr::new(std::ptr::null_mut());

/// Makes `sink` the one native macros call (`None`: no sink): the sink of the timeline that became current.
pub(crate) fn set_current(sink: Option<&'static dyn LiveSink>) {
    let installed = sink.map_or(std::ptr::null_mut(), |sink| Box::into_raw(Box::new(sink)));
    // Release: publishes the box written above; pairs with the Acquire in `current`.
    CURRENT.store(installed, Ordering::Release);
}

/// The sink native macros call now, if any: one load and a branch.
#[inline(always)]
pub(crate) fn current() -> Option<&'static dyn LiveSink> {
    // Acquire: pairs with the Release in `set_current`, so the box it points to is visible.
    let p = CURRENT.load(Ordering::Acquire);
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null values of CURRENT come from `Box::into_raw` in `set_current` and are never freed, so
    // the pointer is valid (and what it points to immutable) for the rest of the process.
    Some(*unsafe { &*p })
}

/// Keeps a sink alive for the rest of the process and returns a `'static` reference to it.
pub(crate) fn leak(sink: std::sync::Arc<dyn LiveSink>) -> &'static dyn LiveSink {
    let leaked: &'static std::sync::Arc<dyn LiveSink> = Box::leak(Box::new(sink));
    &**leaked
}
