//! The hot-path half: a [`LiveSink`] that emits tickline's CPU spans and scopes as Tracy zones on the thread
//! that runs them, events and instants as Tracy messages, and frame marks.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_char;
use std::fmt::Write as _;
use std::sync::Mutex;

use tickline::export::{LiveSink, LiveSpanData, NativeCallsite};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Record};
use tracing::{Event, Level, Metadata};
use tracy_client::sys;

use crate::srcloc::{leak_c_string, Site, SourceLocations};

/// Longest zone text or message sent, in bytes (Tracy's limit is 64 KiB; long texts cost a copy per enter).
const MAX_TEXT: usize = 1024;

/// A span's fields as zone text, kept with the span.
struct SpanText {
    fields: Vec<(&'static str, String)>,
    text: String,
}

impl SpanText {
    fn render(&mut self) {
        self.text.clear();
        for (i, (name, value)) in self.fields.iter().enumerate() {
            if i > 0 {
                self.text.push_str(", ");
            }
            let _ = write!(self.text, "{name} = {value}");
        }
        truncate(&mut self.text);
    }
}

fn truncate(s: &mut String) {
    if s.len() > MAX_TEXT {
        let mut cut = MAX_TEXT;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
}

/// Collects field values as `(name, text)`.
struct Fields<'a>(&'a mut Vec<(&'static str, String)>);

impl Fields<'_> {
    fn set(&mut self, field: &Field, value: String) {
        match self.0.iter_mut().find(|(n, _)| *n == field.name()) {
            Some(existing) => existing.1 = value,
            None => self.0.push((field.name(), value)),
        }
    }
}

impl Visit for Fields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.set(field, value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.set(field, format!("{value:?}"));
    }
}

/// Formats an event as one line: its message, then its other fields.
struct Message<'a>(&'a mut String);

impl Visit for Message<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if !self.0.is_empty() {
            self.0.push_str(if field.name() == "message" { " " } else { ", " });
        }
        if field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        } else {
            let _ = write!(self.0, "{} = {value:?}", field.name());
        }
    }
}

thread_local! {
    /// The zones this thread opened and has not closed, innermost last.
    static ZONES: RefCell<Vec<sys::___tracy_c_zone_context>> = const { RefCell::new(Vec::new()) };
    /// Scratch text for messages.
    static TEXT: RefCell<String> = const { RefCell::new(String::new()) };
    /// Whether this thread's name was given to Tracy.
    static NAMED: Cell<bool> = const { Cell::new(false) };
}

/// Whether Tracy would keep what is emitted now: always, except in on-demand mode with no profiler
/// connected.
#[inline(always)]
pub(crate) fn capturing() -> bool {
    // SAFETY: `___tracy_connected` only reads an atomic flag of the running profiler (started with the
    // process: this crate does not use Tracy's manual lifetime).
    !cfg!(feature = "ondemand") || unsafe { sys::___tracy_connected() } != 0
}

/// Tracy's severity for a `tracing` level.
fn severity(level: &Level) -> i8 {
    let s = match *level {
        Level::TRACE => sys::TracyMessageSeverity_TracyMessageSeverityTrace,
        Level::DEBUG => sys::TracyMessageSeverity_TracyMessageSeverityDebug,
        Level::INFO => sys::TracyMessageSeverity_TracyMessageSeverityInfo,
        Level::WARN => sys::TracyMessageSeverity_TracyMessageSeverityWarning,
        Level::ERROR => sys::TracyMessageSeverity_TracyMessageSeverityError,
    };
    s as i8
}

/// The live sink. One per exporter; Tracy itself is one per process.
pub(crate) struct TracyLive {
    locations: SourceLocations,
    frames: Mutex<HashMap<&'static str, usize>>,
}

impl TracyLive {
    pub(crate) fn new() -> Self {
        TracyLive {
            locations: SourceLocations::new(),
            frames: Mutex::new(HashMap::new()),
        }
    }

    #[inline]
    fn metadata_location(&self, meta: &'static Metadata<'static>) -> *const sys::___tracy_source_location_data {
        let key = meta as *const Metadata<'static> as usize;
        self.locations.get(key, || Site {
            name: meta.name(),
            function: meta.module_path().unwrap_or(meta.target()),
            file: meta.file().unwrap_or(""),
            line: meta.line().unwrap_or(0),
        })
    }

    #[inline]
    fn callsite_location(&self, callsite: &'static NativeCallsite) -> *const sys::___tracy_source_location_data {
        let key = callsite as *const NativeCallsite as usize;
        self.locations.get(key, || {
            let (file, line) = callsite.location();
            Site {
                name: callsite.name(),
                function: "",
                file,
                line,
            }
        })
    }

    /// Opens a zone at `location` on this thread and pushes its context.
    #[inline]
    fn begin(&self, location: *const sys::___tracy_source_location_data, text: Option<&str>) {
        name_thread();
        // SAFETY: `location` is a leaked, never-freed source location with leaked NUL-terminated strings
        // (`SourceLocations` makes them), as Tracy requires for the whole process.
        let ctx = unsafe { sys::___tracy_emit_zone_begin(location, 1) };
        if let Some(text) = text.filter(|t| !t.is_empty()) {
            // SAFETY: `ctx` was just returned by `___tracy_emit_zone_begin` on this thread and is still open;
            // Tracy copies `text` (pointer and length of a live `&str`, at most MAX_TEXT + 3 bytes < 64 KiB).
            unsafe { sys::___tracy_emit_zone_text(ctx, text.as_ptr().cast(), text.len()) };
        }
        let _ = ZONES.try_with(|zones| zones.borrow_mut().push(ctx));
    }

    /// Closes this thread's innermost open zone.
    #[inline]
    fn end(&self) {
        let ctx = ZONES.try_with(|zones| zones.borrow_mut().pop()).ok().flatten();
        if let Some(ctx) = ctx {
            // SAFETY: `ctx` was returned by `___tracy_emit_zone_begin` on this thread (each thread's stack only
            // holds its own zones) and is closed once: it was just popped.
            unsafe { sys::___tracy_emit_zone_end(ctx) };
        }
    }

    fn message(&self, severity: i8, text: &str) {
        name_thread();
        // SAFETY: Tracy copies `text` (pointer and length of a live `&str`, cut below 64 KiB); the callstack
        // depth 0 collects none.
        unsafe { sys::___tracy_emit_logString(severity, 0, 0, text.len(), text.as_ptr().cast()) };
    }
}

/// Gives Tracy this thread's full name once (Tracy would otherwise read the kernel's 15-byte copy).
#[inline]
fn name_thread() {
    if NAMED.try_with(Cell::get).unwrap_or(true) {
        return;
    }
    let _ = NAMED.try_with(|n| n.set(true));
    if let Some(name) = std::thread::current().name() {
        let name = leak_c_string(name);
        // SAFETY: called on the thread being named, with a leaked NUL-terminated string (Tracy keeps the
        // pointer it is given).
        unsafe { sys::___tracy_set_thread_name(name) };
    }
}

impl LiveSink for TracyLive {
    fn thread_started(&self) {
        // Naming the thread costs Tracy a system call and its per-thread allocator's set-up (8-37 us seen):
        // here it is not counted inside the thread's first zone.
        name_thread();
    }

    fn span_new(&self, attrs: &Attributes<'_>) -> Option<LiveSpanData> {
        // Make the source location now, off the enter path.
        self.metadata_location(attrs.metadata());
        if attrs.values().is_empty() || !capturing() {
            return None;
        }
        let mut text = SpanText {
            fields: Vec::new(),
            text: String::new(),
        };
        attrs.record(&mut Fields(&mut text.fields));
        text.render();
        Some(Box::new(text))
    }

    fn span_record(&self, _meta: &'static Metadata<'static>, data: &mut Option<LiveSpanData>, values: &Record<'_>) {
        if !capturing() {
            return;
        }
        let data = data.get_or_insert_with(|| {
            Box::new(SpanText {
                fields: Vec::new(),
                text: String::new(),
            })
        });
        if let Some(text) = data.downcast_mut::<SpanText>() {
            values.record(&mut Fields(&mut text.fields));
            text.render();
        }
    }

    #[inline]
    fn span_enter(&self, meta: &'static Metadata<'static>, data: Option<&LiveSpanData>) {
        let text = data.and_then(|d| d.downcast_ref::<SpanText>()).map(|t| t.text.as_str());
        self.begin(self.metadata_location(meta), text);
    }

    #[inline]
    fn span_exit(&self) {
        self.end();
    }

    fn event(&self, event: &Event<'_>) {
        if !capturing() {
            return;
        }
        let _ = TEXT.try_with(|text| {
            let Ok(mut text) = text.try_borrow_mut() else { return };
            text.clear();
            event.record(&mut Message(&mut text));
            if text.is_empty() {
                text.push_str(event.metadata().name());
            }
            truncate(&mut text);
            self.message(severity(event.metadata().level()), &text);
        });
    }

    #[inline]
    fn scope_begin(&self, callsite: &'static NativeCallsite) {
        self.begin(self.callsite_location(callsite), None);
    }

    #[inline]
    fn scope_end(&self, _callsite: &'static NativeCallsite) {
        self.end();
    }

    fn instant(&self, callsite: &'static NativeCallsite) {
        if !capturing() {
            return;
        }
        let location = self.callsite_location(callsite);
        name_thread();
        // SAFETY: `location` is leaked and never freed (see `begin`); its `name` is a leaked NUL-terminated
        // string, so Tracy may keep the pointer (a literal message) for the whole process.
        unsafe {
            let name = (*location).name;
            sys::___tracy_emit_logStringL(severity(&Level::INFO), 0, 0, name);
        }
    }

    fn frame_mark(&self, name: Option<&'static str>) {
        let name: *const c_char = match name {
            None => std::ptr::null(),
            Some(name) => {
                let mut frames = self.frames.lock().unwrap_or_else(|e| e.into_inner());
                *frames.entry(name).or_insert_with(|| leak_c_string(name) as usize) as *const c_char
            }
        };
        // SAFETY: `name` is null (the main frame set) or a leaked NUL-terminated string that Tracy may keep
        // for the whole process.
        unsafe { sys::___tracy_emit_frame_mark(name) };
    }
}
