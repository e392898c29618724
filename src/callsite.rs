//! [`NativeCallsite`]: what a native macro call site (`scope!`, `instant!`, `counter!`, `frame_mark!`,
//! `gpu_scope!`) records under. Each call site owns a `static` one; records carry its key, and the collector
//! learns the name and fields once, from a registration sent on the call site's first use in a timeline.

use std::sync::atomic::{AtomicU64, Ordering};

/// What a native call site records. Created by the macros; not constructed by hand.
#[derive(Debug)]
pub struct NativeCallsite {
    name: &'static str,
    fields: &'static [&'static str],
    file: &'static str,
    line: u32,
    /// The timeline this call site was last registered with (0: none yet). A call site used with several
    /// timelines registers again whenever it changes timeline.
    registered_with: AtomicU64,
}

impl NativeCallsite {
    /// A call site named `name` at `file:line`. Used by the macros in a `static`.
    #[doc(hidden)]
    pub const fn new(name: &'static str, file: &'static str, line: u32) -> Self {
        NativeCallsite::with_fields(name, &[], file, line)
    }

    /// A call site with named fields (a [`gpu_scope!`](macro@crate::gpu_scope) with fields).
    #[doc(hidden)]
    pub const fn with_fields(
        name: &'static str,
        fields: &'static [&'static str],
        file: &'static str,
        line: u32,
    ) -> Self {
        NativeCallsite {
            name,
            fields,
            file,
            line,
            registered_with: AtomicU64::new(0),
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

    /// Whether this call site's registration has been sent to timeline `timeline`.
    #[inline(always)]
    pub(crate) fn is_registered_with(&self, timeline: u64) -> bool {
        // Acquire: pairs with the Release store in `mark_registered`, so a thread that sees the mark also
        // sees (happens after) the registration message sent before it, which therefore reaches the
        // collector before this thread's records do.
        self.registered_with.load(Ordering::Acquire) == timeline
    }

    /// Notes that the registration was sent to `timeline`.
    pub(crate) fn mark_registered(&self, timeline: u64) {
        self.registered_with.store(timeline, Ordering::Release);
    }
}
