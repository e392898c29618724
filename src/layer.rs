//! [`TicklineLayer`]: the `tracing_subscriber::Layer` that records spans and events into tickline.

use std::num::NonZeroU64;
use std::sync::Arc;

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as SpanValues};
use tracing::{Event, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

use crate::live::{LiveSink, LiveSpanData};
use crate::record::{FieldEncoder, Kind};
use crate::recorder::{record_group, record_now, record_span_new_bare, record_untimed, Shared, Target};

/// Records span enter/exit (one slice per enter/exit, on the entering thread), span fields (at creation and
/// on `record`) and events with their fields into a [`crate::Timeline`].
///
/// It composes like any layer: it leaves `enabled()` alone (overriding it would filter for every layer), so
/// narrow it with a per-layer filter, `.with_filter(..)`. Its hot path, `on_enter`/`on_exit`, writes one
/// 16-byte record (span id + raw tick) and looks nothing up; with a [`crate::LiveSink`] installed, an enter
/// also looks the span up in the registry once (which is why the layer needs a [`LookupSpan`] subscriber,
/// as every `tracing_subscriber::registry()` stack is).
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
#[derive(Clone)]
pub struct TicklineLayer {
    shared: Arc<Shared>,
    /// `shared.id`, kept here so a hook reads it without following the `Arc`; non-zero, so the recorder's
    /// "no timeline" check folds away.
    id: NonZeroU64,
    live: Option<&'static dyn LiveSink>,
}

impl TicklineLayer {
    pub(crate) fn new(shared: Arc<Shared>, live: Option<&'static dyn LiveSink>) -> Self {
        let id = NonZeroU64::new(shared.id).expect("timeline ids count up from 1");
        TicklineLayer { shared, id, live }
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

/// What a [`LiveSink`] keeps with a span, in the span's registry extensions.
struct LiveData(Option<LiveSpanData>);

impl std::fmt::Debug for TicklineLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TicklineLayer")
            .field("timeline", &self.id)
            .field("live_sink", &self.live.is_some())
            .finish()
    }
}

/// The address of a `'static` metadata: the collector turns it back into the reference.
#[inline(always)]
fn meta_addr(meta: &'static Metadata<'static>) -> u64 {
    (meta as *const Metadata<'static>).expose_provenance() as u64
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

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for TicklineLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if let Some(live) = self.live {
            if let (Some(data), Some(span)) = (live.span_new(attrs), ctx.span(id)) {
                span.extensions_mut().insert(LiveData(Some(data)));
            }
        }
        let meta = meta_addr(attrs.metadata());
        // The field set first: inlined, and empty for most spans, where it saves the call that checks values.
        if attrs.fields().is_empty() || attrs.values().is_empty() {
            return record_span_new_bare(self, id.into_u64(), meta);
        }
        record_group(self, Kind::SpanNew, false, id.into_u64(), meta, |buf| {
            attrs.record(&mut Encode(&mut FieldEncoder { buf }));
        });
    }

    fn on_record(&self, id: &Id, values: &SpanValues<'_>, ctx: Context<'_, S>) {
        record_group(self, Kind::SpanRecord, false, id.into_u64(), 0, |buf| {
            values.record(&mut Encode(&mut FieldEncoder { buf }));
        });
        if let (Some(live), Some(span)) = (self.live, ctx.span(id)) {
            let mut extensions = span.extensions_mut();
            match extensions.get_mut::<LiveData>() {
                Some(LiveData(data)) => live.span_record(span.metadata(), data, values),
                None => {
                    let mut data = None;
                    live.span_record(span.metadata(), &mut data, values);
                    extensions.insert(LiveData(data));
                }
            }
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = meta_addr(event.metadata());
        record_group(self, Kind::Event, true, meta, meta, |buf| {
            event.record(&mut Encode(&mut FieldEncoder { buf }));
        });
        if let Some(live) = self.live {
            live.event(event);
        }
    }

    #[inline]
    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        record_now(self, Kind::SpanEnter, id.into_u64());
        if let Some(live) = self.live {
            live_enter(live, id, &ctx);
        }
    }

    #[inline]
    fn on_exit(&self, id: &Id, _ctx: Context<'_, S>) {
        if let Some(live) = self.live {
            live.span_exit();
        }
        record_now(self, Kind::SpanExit, id.into_u64());
    }

    fn on_close(&self, id: Id, _ctx: Context<'_, S>) {
        record_untimed(self, Kind::SpanClose, id.into_u64());
    }
}

/// Calls the sink for an enter: the span's metadata and what the sink kept with it.
fn live_enter<S: Subscriber + for<'a> LookupSpan<'a>>(live: &dyn LiveSink, id: &Id, ctx: &Context<'_, S>) {
    let Some(span) = ctx.span(id) else { return };
    let extensions = span.extensions();
    let data = extensions.get::<LiveData>().and_then(|d| d.0.as_ref());
    live.span_enter(span.metadata(), data);
}
