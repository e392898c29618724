//! What the recording side tells a timeline's collector, over the timeline's control channel: new thread
//! rings, callsite registrations, flush and shutdown requests. (GPU devices and queues come on a channel of
//! their own, `gpu::GpuControl`, so this bottom layer knows nothing of GPUs.)
//!
//! Messages are sent before any record that needs them is pushed, and the collector reads the channel
//! after it drains the rings, so every record's registrations reach the collector ahead of it.

use crossbeam_channel::Sender;
use tracing::Metadata;

use crate::callsite::NativeCallsite;
use crate::codec::Record;
use crate::ring::Consumer;

/// A reply to a flush or shutdown: `Err` carries the first export failure, in words.
pub(crate) type Reply = Sender<Result<(), String>>;

/// What the collector is told over its control channel.
pub(crate) enum Control {
    /// A thread recorded its first record into this timeline: its ring, with the ring's number (the top bits
    /// of the span serials it hands out). With `continues`, a larger ring that takes over from the thread's
    /// ring of the same number, which it has just closed (its records come first).
    NewRing {
        consumer: Consumer<Record>,
        ring: u32,
        tid: u32,
        name: String,
        continues: bool,
    },
    /// A `tracing` callsite (span or event) that records may name by its key.
    TracingCallsite(&'static Metadata<'static>),
    /// A native callsite (`scope!`, `instant!`, `counter!`, `gpu_scope!`) that records may name by its key.
    NativeCallsite(&'static NativeCallsite),
    /// Drain everything recorded before this message, export, flush, then answer.
    Flush(Reply),
    /// Drain everything, finish the exporters, answer and exit.
    Shutdown(Reply),
}

/// The key a record names a `tracing` callsite by: its metadata's address. Never dereferenced by the
/// collector, which looks keys up among the callsites registered with it.
#[inline(always)]
pub(crate) fn metadata_key(meta: &'static Metadata<'static>) -> u64 {
    (meta as *const Metadata<'static>).addr() as u64
}

/// The key a record names a native callsite by: its address (see [`metadata_key`]).
#[inline(always)]
pub(crate) fn callsite_key(callsite: &'static NativeCallsite) -> u64 {
    (callsite as *const NativeCallsite).addr() as u64
}
