//! The live-sink hook: what a sink sees, in which order, and that every begin gets its end on the same sink.

use std::sync::{Arc, Mutex};

use tickline::export::{LiveSink, LiveSpanData, NativeCallsite};
use tickline::Timeline;
use tracing::span::{Attributes, Record};
use tracing::{Event, Metadata};
use tracing_subscriber::layer::SubscriberExt;

#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl LiveSink for Log {
    fn span_new(&self, attrs: &Attributes<'_>) -> Option<LiveSpanData> {
        self.push(format!("new {}", attrs.metadata().name()));
        Some(Box::new(attrs.metadata().name().to_uppercase()))
    }
    fn span_record(&self, meta: &'static Metadata<'static>, data: &mut Option<LiveSpanData>, _: &Record<'_>) {
        let kept = data.as_ref().and_then(|d| d.downcast_ref::<String>()).cloned();
        self.push(format!("record {} {kept:?}", meta.name()));
    }
    fn span_enter(&self, meta: &'static Metadata<'static>, data: Option<&LiveSpanData>) {
        let kept = data.and_then(|d| d.downcast_ref::<String>()).cloned();
        self.push(format!("enter {} {kept:?}", meta.name()));
    }
    fn span_exit(&self) {
        self.push("exit".into());
    }
    fn event(&self, event: &Event<'_>) {
        self.push(format!("event {}", event.metadata().level()));
    }
    fn scope_begin(&self, callsite: &'static NativeCallsite) {
        self.push(format!("begin {}", callsite.name()));
    }
    fn scope_end(&self, callsite: &'static NativeCallsite) {
        self.push(format!("end {}", callsite.name()));
    }
    fn instant(&self, callsite: &'static NativeCallsite) {
        self.push(format!("instant {}", callsite.name()));
    }
    fn frame_mark(&self, name: Option<&'static str>) {
        self.push(format!("frame {name:?}"));
    }
}

#[test]
fn a_live_sink_sees_spans_scopes_events_and_frames_in_order() {
    let _one_at_a_time = crate::exclusive();
    let log = Arc::new(Log::default());
    let timeline = Timeline::builder().live_sink(log.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("outer", n = tracing::field::Empty);
        span.record("n", 3);
        let _outer = span.enter();
        let _scope = tickline::scope!("inner");
        tracing::warn!("careful");
        tickline::instant!("point");
        tickline::frame_mark!();
        tickline::frame_mark!("physics");
    });
    assert_eq!(
        log.take(),
        [
            "new outer",
            "record outer Some(\"OUTER\")",
            "enter outer Some(\"OUTER\")",
            "begin inner",
            "event WARN",
            "instant point",
            "frame None",
            "frame Some(\"physics\")",
            "end inner",
            "exit",
        ]
    );
    let stats = timeline.shutdown().unwrap();
    assert_eq!(stats.dropped_records, 0);
}

#[test]
fn a_scope_open_when_its_timeline_stops_ends_on_the_sink_that_saw_it_begin() {
    let _one_at_a_time = crate::exclusive();
    let log = Arc::new(Log::default());
    let timeline = Timeline::builder().live_sink(log.clone()).start().unwrap();
    let scope = tickline::scope!("spanning");
    timeline.shutdown().unwrap();
    // A timeline without a sink is current now: new scopes reach no sink, the open one still ends.
    let plain = Timeline::builder().start().unwrap();
    drop(tickline::scope!("unseen"));
    drop(scope);
    assert_eq!(log.take(), ["begin spanning", "end spanning"]);
    plain.shutdown().unwrap();
}
