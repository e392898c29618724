//! The live-sink hook: what a sink sees, in which order, and that every begin gets its end on the same sink.

use std::sync::{Arc, Mutex};

use tickline::export::{LiveSink, LiveSpanData, NativeCallsite};
use tickline::Timeline;
use tracing::span::{Attributes, Record};
use tracing::{Event, Metadata};
use tracing_subscriber::layer::SubscriberExt;

#[derive(Default)]
struct Log {
    lines: Mutex<Vec<String>>,
    /// Put before what the sink keeps with a span (to tell two sinks' data apart).
    tag: &'static str,
}

impl Log {
    fn tagged(tag: &'static str) -> Self {
        Log {
            lines: Mutex::default(),
            tag,
        }
    }
    fn push(&self, s: String) {
        self.lines.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.lines.lock().unwrap())
    }
    /// What the sink saw, leaving out which threads started.
    fn take_records(&self) -> Vec<String> {
        self.take().into_iter().filter(|l| !l.starts_with("thread ")).collect()
    }
}

impl LiveSink for Log {
    fn thread_started(&self) {
        self.push(format!("thread {}", std::thread::current().name().unwrap_or("?")));
    }
    fn span_new(&self, attrs: &Attributes<'_>) -> Option<LiveSpanData> {
        self.push(format!("new {}", attrs.metadata().name()));
        Some(Box::new(format!(
            "{}{}",
            self.tag,
            attrs.metadata().name().to_uppercase()
        )))
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
        log.take_records(),
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
    assert_eq!(log.take_records(), ["begin spanning", "end spanning"]);
    plain.shutdown().unwrap();
}

#[test]
fn two_timelines_with_sinks_on_one_subscriber_each_keep_their_own_span_data() {
    // A registry keeps one extension value per type: the second layer's must not replace (or, as
    // `tracing-subscriber` asserts, panic on) the first's.
    let _one_at_a_time = crate::exclusive();
    let (a, b) = (Arc::new(Log::tagged("a:")), Arc::new(Log::tagged("b:")));
    let first = Timeline::builder().live_sink(a.clone()).start().unwrap();
    let second = Timeline::builder().live_sink(b.clone()).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(first.layer()).with(second.layer());
    tracing::subscriber::with_default(subscriber, || {
        let span = tracing::info_span!("job", n = 1, late = tracing::field::Empty);
        span.record("late", 2);
        span.in_scope(|| {});
    });
    for (log, tag) in [(&a, "a:"), (&b, "b:")] {
        assert_eq!(
            log.take_records(),
            [
                "new job".to_string(),
                format!("record job Some(\"{tag}JOB\")"),
                format!("enter job Some(\"{tag}JOB\")"),
                "exit".to_string(),
            ]
        );
    }
    second.shutdown().unwrap();
    first.shutdown().unwrap();
}

#[test]
fn an_exit_on_another_thread_than_the_enter_ends_nothing_on_that_thread() {
    // Only `Dispatch::exit` can do this (tracing's guards are not `Send`); passed on, it would end the exiting
    // thread's own innermost zone, an unrelated span.
    let _one_at_a_time = crate::exclusive();
    let log = Arc::new(Log::default());
    let timeline = Timeline::builder().live_sink(log.clone()).start().unwrap();
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(timeline.layer()));
    let crossed = tracing::dispatcher::with_default(&dispatch, || {
        let span = tracing::info_span!("crossed");
        tracing::dispatcher::get_default(|d| d.enter(&span.id().unwrap()));
        span
    });
    let on_b = dispatch.clone();
    std::thread::spawn(move || {
        tracing::dispatcher::with_default(&on_b, || {
            let _outer = tracing::info_span!("b_outer").entered();
            tracing::dispatcher::get_default(|d| d.exit(&crossed.id().unwrap()));
        });
    })
    .join()
    .unwrap();
    assert_eq!(
        log.take_records(),
        [
            "new crossed",
            "enter crossed Some(\"CROSSED\")",
            "new b_outer",
            "enter b_outer Some(\"B_OUTER\")",
            "exit"
        ],
        "one exit on the second thread: its own span's"
    );
    drop(dispatch);
    timeline.shutdown().unwrap();
}

#[test]
fn a_sink_hears_of_each_thread_once_before_its_first_record() {
    // Before the first record's time is read: Tracy names the thread there, a system call that would
    // otherwise sit inside the thread's first zone.
    let _one_at_a_time = crate::exclusive();
    let log = Arc::new(Log::default());
    let timeline = Timeline::builder().live_sink(log.clone()).start().unwrap();
    for name in ["w1", "w2"] {
        std::thread::Builder::new()
            .name(name.into())
            .spawn(|| {
                drop(tickline::scope!("first"));
                drop(tickline::scope!("second"));
            })
            .unwrap()
            .join()
            .unwrap();
    }
    let lines = log.take();
    timeline.shutdown().unwrap();
    assert_eq!(
        lines,
        [
            "thread w1",
            "begin first",
            "end first",
            "begin second",
            "end second",
            "thread w2",
            "begin first",
            "end first",
            "begin second",
            "end second"
        ]
    );
}
