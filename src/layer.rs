//! [`TicklineLayer`]: the `tracing_subscriber::Layer` that records spans and events into tickline.

use std::cell::RefCell;
use std::num::NonZeroU64;
use std::sync::Arc;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as SpanValues};
use tracing::subscriber::Interest;
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::{ExtensionsMut, LookupSpan};

use crate::codec::{FieldEncoder, Parent};
use crate::control::{metadata_key, Control};
use crate::live::{LiveSink, LiveSpanData};
use crate::recorder::{self, Shared, Target};
use crate::span_table::SpanTable;

/// Records span enter/exit (one slice per enter/exit, on the entering thread), span fields (at creation and
/// on `record`) and events with their fields into a [`crate::Timeline`].
///
/// It composes like any layer: it leaves `enabled()` alone (overriding it would filter for every layer), so
/// narrow it with a per-layer filter, `.with_filter(..)`. Its hot path, `on_enter`/`on_exit`, looks the span
/// up in a lock-free table of its own (a few loads) and writes one 16-byte record; with a
/// [`crate::LiveSink`] installed, an enter also looks the span up in the registry (which is why the layer
/// needs a [`LookupSpan`] subscriber, as every `tracing_subscriber::registry()` stack is).
///
/// # Span identity
///
/// `tracing`'s registry reuses a span's id once the span has closed (under load, within microseconds).
/// tickline gives every span a serial of its own at creation, unique for the life of the timeline, so a
/// slice always carries its own span's name and fields, whichever thread enters it and whenever the
/// collector gets to it. Span ids of different subscribers are different spans: use one layer per
/// subscriber (`timeline.layer()` or a clone; each clone keeps its own id table).
///
/// # Fields
///
/// A slice shows the values its span had when the slice ended: values recorded with `Span::record` during
/// an enter appear on that enter's slice (values recorded on another thread count by their timestamp). A
/// span's or event's fields are limited to [`MAX_PAYLOAD_BYTES`](crate::MAX_PAYLOAD_BYTES) bytes in all
/// (less in a ring smaller than 8 Ki records) and each string or `Debug` value to
/// [`MAX_FIELD_BYTES`](crate::MAX_FIELD_BYTES) bytes; a value beyond that is cut (and "…" appended), the
/// string or `Debug` value that reaches the payload limit is cut to fit it and the fields after it are left
/// out, and the slice or event carries `tickline.fields_truncated` = how many values were cut or left out
/// (for a span: at its creation and in its `record`s, so a field cut twice counts twice; a slice released
/// after a later `record` was processed counts that one's too).
///
/// ```
/// use tracing_subscriber::layer::SubscriberExt;
/// let timeline = tickline::Timeline::builder().start().unwrap();
/// let subscriber = tracing_subscriber::registry().with(timeline.layer());
/// tracing::subscriber::with_default(subscriber, || {
///     let _span = tracing::info_span!("work", items = 3).entered();
///     tracing::info!(answer = 42, "done");
/// });
/// timeline.flush().unwrap();
/// ```
pub struct TicklineLayer {
    shared: Arc<Shared>,
    /// `shared.id`, kept here so a hook reads it without following the `Arc`; non-zero, so the recorder's
    /// "no timeline" check folds away.
    id: NonZeroU64,
    live: Option<&'static dyn LiveSink>,
    /// Registry id -> tickline serial for this layer's subscriber.
    spans: Box<SpanTable>,
}

impl TicklineLayer {
    pub(crate) fn new(shared: Arc<Shared>, live: Option<&'static dyn LiveSink>) -> Self {
        let id = NonZeroU64::new(shared.id).expect("timeline ids count up from 1");
        TicklineLayer {
            shared,
            id,
            live,
            spans: Box::default(),
        }
    }

    #[inline(always)]
    fn serial(&self, id: &Id) -> Option<u64> {
        self.spans.get(id.into_u64())
    }
}

impl Target for TicklineLayer {
    #[inline(always)]
    fn id(&self) -> u64 {
        self.id.get()
    }
    fn shared(&self) -> Option<Arc<Shared>> {
        Some(self.shared.clone())
    }
}

/// A clone is a layer for another subscriber: same timeline, its own span id table (span ids of two
/// subscribers are unrelated).
impl Clone for TicklineLayer {
    fn clone(&self) -> Self {
        TicklineLayer::new(self.shared.clone(), self.live)
    }
}

thread_local! {
    /// The spans this thread entered through layers with a live sink, innermost last: `(timeline, span id)`.
    /// `tracing` lets a program exit a span on another thread than the one that entered it (`Dispatch::exit`);
    /// a sink's begins and ends pair per thread, so such an exit must not end this thread's innermost zone.
    static LIVE_ENTERED: RefCell<Vec<(u64, u64)>> = const { RefCell::new(Vec::new()) };
}

/// What [`LiveSink`]s keep with a span, in the span's registry extensions: one entry per timeline whose layer
/// has a sink (a registry's extensions hold one value per type, and two timelines' layers may share a
/// subscriber).
#[derive(Default)]
struct LiveData(Vec<(u64, Option<LiveSpanData>)>);

impl LiveData {
    fn of(&self, timeline: u64) -> Option<&LiveSpanData> {
        self.0
            .iter()
            .find(|(id, _)| *id == timeline)
            .and_then(|(_, data)| data.as_ref())
    }

    /// `timeline`'s entry in a span's extensions, made (empty) if the span has none yet.
    fn of_mut<'a>(extensions: &'a mut ExtensionsMut<'_>, timeline: u64) -> &'a mut Option<LiveSpanData> {
        if extensions.get_mut::<LiveData>().is_none() {
            extensions.insert(LiveData::default());
        }
        let kept = &mut extensions.get_mut::<LiveData>().expect("inserted above").0;
        let at = match kept.iter().position(|(id, _)| *id == timeline) {
            Some(at) => at,
            None => {
                kept.push((timeline, None));
                kept.len() - 1
            }
        };
        &mut kept[at].1
    }
}

impl std::fmt::Debug for TicklineLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicklineLayer")
            .field("timeline", &self.id)
            .field("live_sink", &self.live.is_some())
            .finish()
    }
}

struct Encode<'a, 'b>(&'a mut FieldEncoder<'b>);

fn index(field: &Field) -> u8 {
    // tracing allows at most 32 fields per callsite.
    field.index() as u8
}

impl Visit for Encode<'_, '_> {
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.i64(index(field), value);
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.u64(index(field), value);
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.f64(index(field), value);
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.bool(index(field), value);
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.str(index(field), value);
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.debug(index(field), value);
    }
}

impl TicklineLayer {
    /// An event's parent.
    fn parent(&self, is_root: bool, explicit: Option<&Id>) -> Parent {
        match explicit {
            Some(id) => self.serial(id).map_or(Parent::Root, Parent::Explicit),
            None if is_root => Parent::Root,
            None => Parent::Contextual,
        }
    }

    /// A new span's parent: an explicit one is noted in the span table, since a span holding children may hold
    /// async tasks (its close is then timed).
    fn span_parent(&self, is_root: bool, explicit: Option<&Id>) -> Parent {
        match explicit {
            Some(id) => self
                .spans
                .get_parenting(id.into_u64())
                .map_or(Parent::Root, Parent::Explicit),
            None => self.parent(is_root, None),
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for TicklineLayer {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        // The collector learns the callsite before any record names it (this runs before the callsite's
        // first span or event). A stopped timeline's collector is gone: nothing to tell.
        let _ = self.shared.control.send(Control::TracingCallsite(metadata));
        Interest::always()
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if let Some(live) = self.live {
            if let (Some(data), Some(span)) = (live.span_new(attrs), ctx.span(id)) {
                *LiveData::of_mut(&mut span.extensions_mut(), self.id.get()) = Some(data);
            }
        }
        let callsite = metadata_key(attrs.metadata());
        // Most spans: no field values (the field set first: inlined, and empty for most spans, where it saves
        // the call that checks values), the contextual parent. One record.
        let bare = (attrs.fields().is_empty() || attrs.values().is_empty()) && attrs.is_contextual();
        let serial = if bare {
            recorder::span_new_bare(self, callsite)
        } else {
            let parent = self.span_parent(attrs.is_root(), attrs.parent());
            let encode = (!attrs.fields().is_empty() && !attrs.values().is_empty())
                .then_some(|encoder: &mut FieldEncoder<'_>| attrs.record(&mut Encode(encoder)));
            recorder::span_new(self, self.shared.max_payload_bytes, callsite, parent, encode)
        };
        if let Some(serial) = serial {
            self.spans.insert(id.into_u64(), serial);
        }
    }

    fn on_record(&self, id: &Id, values: &SpanValues<'_>, ctx: Context<'_, S>) {
        // Marks the span: its values may now differ from its creation's (see `SpanTable`).
        if let Some(serial) = self.spans.get_recording(id.into_u64()) {
            recorder::span_record(self, self.shared.max_payload_bytes, serial, |encoder| {
                values.record(&mut Encode(encoder))
            });
        }
        if let (Some(live), Some(span)) = (self.live, ctx.span(id)) {
            let mut extensions = span.extensions_mut();
            live.span_record(
                span.metadata(),
                LiveData::of_mut(&mut extensions, self.id.get()),
                values,
            );
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let callsite = metadata_key(event.metadata());
        let parent = self.parent(event.is_root(), event.parent());
        recorder::event(self, self.shared.max_payload_bytes, callsite, parent, |encoder| {
            event.record(&mut Encode(encoder))
        });
        if let Some(live) = self.live {
            live.event(event);
        }
    }

    #[inline]
    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(serial) = self.spans.get_entering(id.into_u64()) {
            recorder::span_enter(self, serial);
        }
        if let Some(live) = self.live {
            let _ = LIVE_ENTERED.try_with(|entered| entered.borrow_mut().push((self.id.get(), id.into_u64())));
            live_enter(live, self.id.get(), id, &ctx);
        }
    }

    #[inline]
    fn on_exit(&self, id: &Id, _ctx: Context<'_, S>) {
        if let Some(live) = self.live {
            let key = (self.id.get(), id.into_u64());
            let entered_here = LIVE_ENTERED
                .try_with(|entered| {
                    let mut entered = entered.borrow_mut();
                    let at = entered.iter().rposition(|&e| e == key);
                    at.map(|at| entered.remove(at)).is_some()
                })
                .unwrap_or(true);
            if entered_here {
                live.span_exit();
            }
        }
        if let Some(serial) = self.serial(id) {
            recorder::span_exit(self, serial);
        }
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        if let Some(closing) = self.spans.remove(id.into_u64()) {
            recorder::span_close(self, closing.serial, !closing.recorded, closing.may_be_task);
        }
    }
}

/// Calls the sink for an enter: the span's metadata and what the sink kept with it.
fn live_enter<S: Subscriber + for<'a> LookupSpan<'a>>(
    live: &dyn LiveSink,
    timeline: u64,
    id: &Id,
    ctx: &Context<'_, S>,
) {
    let Some(span) = ctx.span(id) else { return };
    let extensions = span.extensions();
    let data = extensions.get::<LiveData>().and_then(|d| d.of(timeline));
    live.span_enter(span.metadata(), data);
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use crate::codec::{Decoder, Item};
    use crate::collector::capture::{open, Frame};
    use crate::collector::input::Input;

    /// A span's close says whether a `record` reached it, from any thread: the collector lets the slices of a
    /// span whose close says "values final" go out without waiting for values recorded elsewhere, so a close
    /// that said so wrongly would cost a slice its values. Read back from a raw capture: each close's flag.
    #[test]
    fn a_close_says_values_final_only_when_no_record_reached_the_span() {
        let path = std::env::temp_dir().join(format!("tickline-values-final-{}.tickline", std::process::id()));
        let timeline = crate::Timeline::builder().raw_capture(&path).start().unwrap();
        let subscriber = std::sync::Arc::new(tracing_subscriber::registry().with(timeline.layer()));
        tracing::subscriber::with_default(subscriber.clone(), || {
            // Serial 1: never recorded.
            drop(tracing::info_span!("plain", x = 1).entered());
            // Serial 2: recorded on this thread.
            let span = tracing::info_span!("here", x = tracing::field::Empty);
            span.record("x", 2);
            drop(span.entered());
            // Serial 3: recorded on another thread, which lets go of it first (the close is this thread's).
            let span = tracing::info_span!("elsewhere", x = 1);
            let entered = span.clone().entered();
            std::thread::scope(|s| {
                s.spawn(|| {
                    tracing::subscriber::with_default(subscriber.clone(), || {
                        let span = span.clone();
                        span.record("x", 3);
                    })
                });
            });
            drop(span);
            drop(entered);
            // Serial 4: field-less, never recorded.
            drop(tracing::info_span!("bare").entered());
        });
        timeline.shutdown().unwrap();
        let mut closes = Vec::new();
        for frame in open(&path).unwrap() {
            if let Frame::Input(Input::Chunk(chunk)) = frame {
                for item in Decoder::new(&chunk.records).flatten() {
                    if let Item::SpanClose {
                        serial, values_final, ..
                    } = item
                    {
                        closes.push((serial & ((1 << 40) - 1), values_final));
                    }
                }
            }
        }
        std::fs::remove_file(&path).ok();
        closes.sort_unstable();
        assert_eq!(closes, [(1, true), (2, false), (3, false), (4, true)]);
    }
}
