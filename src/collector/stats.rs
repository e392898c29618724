//! [`TimelineStats`]: the counters a running timeline keeps, and their shared, atomic form.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Counters of a running timeline. Every record is accounted for: the records the program's threads made
/// are `records + dropped_records`, and every slice they began is exported, dropped whole (its records are
/// among `dropped_records`) or cut short (`truncated_slices`, marked `tickline.truncated` in the trace). A
/// GPU scope is besides either never recorded for want of a free timestamp pair
/// ([`GpuDevice::starved_scopes`](crate::gpu::GpuDevice::starved_scopes), one record among
/// `dropped_records`), or recorded (`gpu_scopes`) and then exported or lost (`gpu_lost_scopes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TimelineStats {
    /// Records taken from the rings: the program's own (a ring that dropped records also puts a marker
    /// where they went missing, which is not counted here).
    pub records: u64,
    /// Records dropped because a ring was full (drop mode), or because their thread was making another record
    /// when they were made (a field's `Debug` that logs, a signal handler: lossless mode too). A slice is never
    /// half-dropped: a begin that could not leave room for its end is dropped with its end. Where records went
    /// missing the trace has an instant `tickline: records dropped` (field `records`: how many), and every
    /// slice open there carries
    /// `tickline.dropped_inside`.
    pub dropped_records: u64,
    /// Slices lost whole to full rings: a begin refused because its end would not have had room (or its
    /// span's creation record was dropped), and its end with it; a GPU scope whose begin record was refused
    /// (its GPU timestamps are then read and matched to nothing). Their records are among
    /// `dropped_records`. Every slice a program makes is exported, counted here, or truncated (a GPU scope may
    /// also be starved or lost: see above).
    pub dropped_slices: u64,
    /// Slices the trace had to end before their real end (the thread exited with them open, or the timeline
    /// shut down while they were open): ended at the last moment known, marked `tickline.truncated`. Async
    /// task lifetimes cut short count here too (a task still open at the end, or one whose close may have
    /// been dropped, which ends at its last poll), besides thread slices.
    pub truncated_slices: u64,
    /// Spans and events whose fields were cut or left out at a payload limit (marked
    /// `tickline.fields_truncated`).
    pub fields_truncated: u64,
    /// Converted events handed to the exporters: every slice's begin and end, instants (`tracing` events
    /// among them), counter values, tickline's own (its counters and markers, and facts about a track such as
    /// the CPU clock decision, which exporters show as instants) included. Not a count of `tracing` events.
    /// An exporter may write events of its own besides: the Perfetto exporter adds an instant on its
    /// `tickline clock` track for the trace's identity, for each clock snapshot, for each clock-exchange
    /// round and for its end (a timeline stopped), and nothing else.
    pub events: u64,
    /// Thread rings registered so far.
    pub threads: u64,
    /// Exits or scope ends with no matching open slice on their thread (dropped from the output).
    pub unmatched_ends: u64,
    /// Records naming a span the collector never learned about (shown as "unknown span").
    pub unknown_spans: u64,
    /// Records naming a call site that was never registered (shown as "unknown callsite").
    pub unknown_callsites: u64,
    /// Records the decoder could not frame (corrupt input; never expected from a live ring). Counted and
    /// skipped.
    pub framing_errors: u64,
    /// Timestamps held back to keep a track's time from going backwards across a recalibration.
    pub monotonic_clamps: u64,
    /// Drain passes that left the rings alone because the chunk budget was full (the processing stage
    /// was that far behind).
    pub budget_full_passes: u64,
    /// Exporter failures (each failed exporter is counted once and then skipped).
    pub export_failures: u64,
    /// 1 when the collector's drain stage runs at a real-time priority (it got `SCHED_FIFO`, which needs
    /// `CAP_SYS_NICE` or root), 0 when it competes with the program's threads at the default priority.
    pub drain_priority: u64,
    /// GPU scopes whose begin reached the collector.
    pub gpu_scopes: u64,
    /// GPU scopes never finished by the GPU within the loss bound (their commands were not submitted), or whose
    /// device was unknown. Their flows have no GPU end.
    pub gpu_lost_scopes: u64,
    /// GPU slices that converted to before the CPU recorded them: calibration failures (clamped for display).
    pub gpu_causality_violations: u64,
    /// GPU calibration bursts that failed or gave no usable sample.
    pub gpu_failed_calibrations: u64,
    /// GPU timestamp reads and recycles that failed, each call (retried on the next pass).
    pub gpu_read_failures: u64,
    /// Async task tracks written (see [`AsyncTasks`](crate::AsyncTasks)): spans shown with their lifetime
    /// and polls.
    pub async_tasks: u64,
    /// Polls written on async task tracks (each also a slice on the thread that polled it).
    pub async_polls: u64,
    /// Records no ring could take, counted where they were attempted (each event, span creation, enter or
    /// exit, scope begin or end once): made on the timeline's own collector thread (an exporter's or a GPU
    /// backend's `tracing` calls: recording them would feed the timeline its own output, and in lossless mode
    /// the collector would wait on itself), from a thread-local destructor that runs after tickline's own
    /// per-thread state is gone (a thread-local first used before the thread's first record), in a child
    /// made by `fork` (it has no collector; but not on the thread that forked if it had recorded before: see the
    /// crate docs' Caveats), or on a thread beyond the most rings a timeline numbers. Not among
    /// `dropped_records`: no ring has a place to mark them.
    pub unrecorded_records: u64,
}

/// The first export failure, kept to be handed back to the application as the error it was (an exporter's
/// own `ExportError::Other` stays `Other`; an I/O error keeps its kind and message, with no prefix twice).
#[derive(Clone, Debug)]
pub(crate) enum FirstExportError {
    Io(std::io::ErrorKind, String),
    Other(String),
    Panicked(String),
}

impl FirstExportError {
    pub(crate) fn from_export_error(e: &crate::export::ExportError) -> Self {
        match e {
            crate::export::ExportError::Io(io) => FirstExportError::Io(io.kind(), io.to_string()),
            crate::export::ExportError::Other(message) => FirstExportError::Other(message.clone()),
            crate::export::ExportError::Panicked(message) => FirstExportError::Panicked(message.clone()),
        }
    }

    pub(crate) fn to_export_error(&self) -> crate::export::ExportError {
        match self {
            FirstExportError::Io(kind, message) => {
                crate::export::ExportError::Io(std::io::Error::new(*kind, message.clone()))
            }
            FirstExportError::Other(message) => crate::export::ExportError::Other(message.clone()),
            FirstExportError::Panicked(message) => crate::export::ExportError::Panicked(message.clone()),
        }
    }
}

impl SharedStats {
    /// Keeps `e` if it is the first export failure.
    pub(crate) fn note_export_failure(&self, e: FirstExportError) {
        let mut first = self.first_export_error.lock().unwrap_or_else(|e| e.into_inner());
        if first.is_none() {
            *first = Some(e);
        }
    }

    /// The first export failure, if any.
    pub(crate) fn first_export_error(&self) -> Option<FirstExportError> {
        self.first_export_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The first export failure, in words, if any.
    pub(crate) fn first_export_failure(&self) -> Result<(), String> {
        match self.first_export_error() {
            Some(e) => Err(e.to_export_error().to_string()),
            None => Ok(()),
        }
    }
}

macro_rules! shared_stats {
    ($($field:ident),* $(,)?) => {
        /// [`TimelineStats`] as atomics, written by the collector's threads and read by the handle.
        #[derive(Default)]
        pub(crate) struct SharedStats {
            $(pub(crate) $field: AtomicU64,)*
            /// Gap markers processed: records the drain took (`records`) that the program did not make.
            pub(crate) gap_markers: AtomicU64,
            /// The same, counted by the rings' producers as the drain takes their records: known without a
            /// processing stage (a raw capture alone) and as soon as `records` counts them.
            pub(crate) markers_drained: AtomicU64,
            first_export_error: Mutex<Option<FirstExportError>>,
        }

        impl SharedStats {
            pub(crate) fn snapshot(&self) -> TimelineStats {
                let mut stats = TimelineStats {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                    // Kept by the recording side (`Timeline::stats` fills it in).
                    unrecorded_records: 0,
                };
                // Converting a capture has no drain stage, and the processing stage may lag the drain: the
                // larger count is the one that matches `records`.
                let markers = self.gap_markers.load(Ordering::Relaxed).max(self.markers_drained.load(Ordering::Relaxed));
                stats.records = stats.records.saturating_sub(markers);
                stats
            }
        }
    };
}

shared_stats!(
    records,
    dropped_records,
    dropped_slices,
    truncated_slices,
    fields_truncated,
    events,
    threads,
    unmatched_ends,
    unknown_spans,
    unknown_callsites,
    framing_errors,
    monotonic_clamps,
    budget_full_passes,
    export_failures,
    drain_priority,
    gpu_scopes,
    gpu_lost_scopes,
    gpu_causality_violations,
    gpu_failed_calibrations,
    gpu_read_failures,
    async_tasks,
    async_polls,
);
