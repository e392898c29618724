//! The processing stage's output side: tracks, interned names and events assembled into [`Batch`]es, and
//! the exporters those batches go to.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use super::stats::{FirstExportError, SharedStats};
use crate::export::{
    Batch, EventKind, ExportError, Exporter, FieldValue, NameId, RecordingOrigin, TraceEvent, TraceField,
    TrackDescriptor, TrackId, TrackKind,
};

/// A track shared by threads (a counter): its events are ordered before they join the batch.
#[derive(Default)]
struct SharedTrackOrder {
    pending: Vec<TraceEvent>,
    last_ns: HashMap<TrackId, u64>,
}

struct ExporterSlot {
    exporter: Box<dyn Exporter>,
    failed: bool,
}

/// Calls an exporter, a panic in it caught and made its failure: a user's exporter that panics must not take
/// the collector, and with it the other exporters and every thread waiting on a lossless ring, down.
fn guarded(call: impl FnOnce() -> Result<(), ExportError>) -> Result<(), ExportError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)).unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic with no message".to_owned());
        Err(ExportError::Panicked(message))
    })
}

/// Tracks, names, the batch being built, and the exporters.
pub(crate) struct Output {
    pub(crate) batch: Batch,
    names: HashMap<Box<str>, NameId>,
    /// `names` by id (id `k` at `k - 1`).
    names_by_id: Vec<Box<str>>,
    next_track: u64,
    pid: u32,
    process_track: TrackId,
    value_name: NameId,
    counters: SharedTrackOrder,
    exporters: Vec<ExporterSlot>,
    /// Timestamps held back on counter tracks to keep them monotonic.
    pub(crate) monotonic_clamps: u64,
    /// String field values of exported batches, emptied, for the next ones: an `info!` message is a string,
    /// and a fresh allocation and its free for each cost the collector more than decoding the event.
    spare_strings: Vec<String>,
    /// Memory the spare strings hold (their capacities and their `String`s).
    spare_bytes: usize,
    /// Exporters' failures in `origin`, not counted in the stats yet.
    early_failures: Vec<ExportError>,
}

/// Most memory [`Output`] keeps in spare strings, and the largest capacity it keeps (longer ones are freed).
/// By bytes, not count: a pass under load exports tens of thousands of short messages (a 1 ms pass of
/// `info!` events on one thread is about 16,000), and every one the pool cannot take back costs a `malloc`
/// and a `free` in the next pass.
const SPARE_STRING_BYTES: usize = 4 << 20;
const SPARE_STRING_CAPACITY: usize = 256;

/// What a spare string costs the pool.
fn spare_cost(text: &String) -> usize {
    text.capacity() + std::mem::size_of::<String>()
}

impl Output {
    /// Tells each exporter where the events come from, then describes the process track.
    pub(crate) fn new(origin: &RecordingOrigin, mut exporters: Vec<Box<dyn Exporter>>) -> Self {
        let mut early_failures = Vec::new();
        for exporter in &mut exporters {
            early_failures.push(
                guarded(|| {
                    exporter.origin(origin);
                    Ok(())
                })
                .err(),
            );
        }
        let (pid, process_name) = (origin.pid, origin.process_name.clone());
        let mut out = Output {
            batch: Batch::default(),
            names: HashMap::new(),
            names_by_id: Vec::new(),
            next_track: 1,
            pid,
            process_track: TrackId(0),
            value_name: NameId(0),
            counters: SharedTrackOrder::default(),
            spare_strings: Vec::new(),
            spare_bytes: 0,
            exporters: exporters
                .into_iter()
                .map(|exporter| ExporterSlot {
                    exporter,
                    failed: false,
                })
                .collect(),
            early_failures: Vec::new(),
            monotonic_clamps: 0,
        };
        out.process_track = out.new_track(
            None,
            TrackKind::Process {
                pid,
                name: process_name,
            },
        );
        out.value_name = out.intern("value");
        for (slot, failure) in out.exporters.iter_mut().zip(early_failures) {
            if let Some(failure) = failure {
                slot.failed = true;
                out.early_failures.push(failure);
            }
        }
        out
    }

    /// Failures from before the stats existed (in `origin`), counted now.
    fn note_early_failures(&mut self, stats: &SharedStats) {
        for e in self.early_failures.drain(..) {
            stats.export_failures.fetch_add(1, Ordering::Relaxed);
            stats.note_export_failure(FirstExportError::from_export_error(&e));
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    pub(crate) fn new_track(&mut self, parent: Option<TrackId>, kind: TrackKind) -> TrackId {
        let id = TrackId(self.next_track);
        self.next_track += 1;
        self.batch.new_tracks.push(TrackDescriptor { id, parent, kind });
        id
    }

    /// A counter track under the process track.
    pub(crate) fn new_counter_track(&mut self, name: &str, unit: &str) -> TrackId {
        let parent = Some(self.process_track);
        self.new_track(
            parent,
            TrackKind::Counter {
                name: name.to_owned(),
                unit: unit.to_owned(),
            },
        )
    }

    /// The process track (the root).
    pub(crate) fn process_track(&self) -> TrackId {
        self.process_track
    }

    /// The name of counter values ("value").
    pub(crate) fn value_name(&self) -> NameId {
        self.value_name
    }

    pub(crate) fn intern(&mut self, s: &str) -> NameId {
        if let Some(&id) = self.names.get(s) {
            return id;
        }
        let id = NameId(self.names.len() as u32 + 1);
        self.names.insert(s.into(), id);
        self.names_by_id.push(s.into());
        self.batch.new_names.push((id, s.to_owned()));
        id
    }

    /// The string of an interned name ("" for an id never handed out).
    pub(crate) fn name_of(&self, id: NameId) -> &str {
        (id.0 as usize)
            .checked_sub(1)
            .and_then(|k| self.names_by_id.get(k))
            .map_or("", |s| s)
    }

    /// Appends an event to the batch (`fields` are copied into the batch's arena).
    #[inline]
    pub(crate) fn push_event(
        &mut self,
        ts_ns: u64,
        track: TrackId,
        kind: EventKind,
        name: NameId,
        fields: &[TraceField],
    ) {
        let start = self.batch.fields.len() as u32;
        self.batch.fields.extend_from_slice(fields);
        self.push_event_with_fields_from(start, ts_ns, track, kind, name);
    }

    /// Appends an event whose fields the caller gives up (no copy of the values).
    #[inline]
    pub(crate) fn push_event_owned(
        &mut self,
        ts_ns: u64,
        track: TrackId,
        kind: EventKind,
        name: NameId,
        fields: &mut Vec<TraceField>,
    ) -> &mut TraceEvent {
        let start = self.batch.fields.len() as u32;
        if !fields.is_empty() {
            self.batch.fields.append(fields);
        }
        self.push_event_with_fields_from(start, ts_ns, track, kind, name)
    }

    /// Appends an event whose fields are the field arena's entries from `start` on.
    #[inline]
    pub(crate) fn push_event_with_fields_from(
        &mut self,
        start: u32,
        ts_ns: u64,
        track: TrackId,
        kind: EventKind,
        name: NameId,
    ) -> &mut TraceEvent {
        let end = self.batch.fields.len() as u32;
        self.batch.events.push(TraceEvent {
            ts_ns,
            track,
            kind,
            name,
            fields: start..end,
            flow_out: None,
            flow_in: None,
        });
        self.batch.events.last_mut().expect("just pushed")
    }

    /// Takes back the last event pushed, if it is number `index` of the batch: the event and its fields.
    pub(crate) fn take_last_event(&mut self, index: usize) -> Option<(TraceEvent, Vec<TraceField>)> {
        if index + 1 != self.batch.events.len() {
            return None;
        }
        let event = self.batch.events.pop()?;
        let fields = self.batch.fields.split_off(event.fields.start as usize);
        Some((event, fields))
    }

    /// Adds a fact about `track` (no event).
    pub(crate) fn push_metadata(&mut self, ts_ns: u64, track: TrackId, name: NameId, fields: &[TraceField]) {
        let start = self.batch.fields.len() as u32;
        self.batch.fields.extend_from_slice(fields);
        let end = self.batch.fields.len() as u32;
        self.batch.metadata.push(crate::export::TrackMetadata {
            track,
            ts_ns,
            name,
            fields: start..end,
        });
    }

    /// Appends a GPU slice event (a flow ends at its begin).
    pub(crate) fn push_gpu_event(
        &mut self,
        ts_ns: u64,
        track: TrackId,
        kind: EventKind,
        name: NameId,
        fields: &[TraceField],
        flow_in: Option<u64>,
    ) {
        self.push_event(ts_ns, track, kind, name, fields);
        self.batch.events.last_mut().expect("just pushed").flow_in = flow_in;
    }

    /// Queues a counter value; counter tracks are shared by threads, so their values are ordered per track
    /// before they join the batch ([`flush_counters`](Self::flush_counters)).
    pub(crate) fn push_counter(&mut self, track: TrackId, ts_ns: u64, name: NameId, value: f64) {
        self.counters.pending.push(TraceEvent {
            ts_ns,
            track,
            kind: EventKind::Counter(value),
            name,
            fields: 0..0,
            flow_out: None,
            flow_in: None,
        });
    }

    /// Moves queued counter values into the batch, in order and monotonic per track.
    pub(crate) fn flush_counters(&mut self) {
        let counters = &mut self.counters;
        counters.pending.sort_by_key(|e| e.ts_ns);
        for mut e in counters.pending.drain(..) {
            let last = counters.last_ns.entry(e.track).or_insert(0);
            if e.ts_ns < *last {
                e.ts_ns = *last;
                self.monotonic_clamps += 1;
            }
            *last = e.ts_ns;
            self.batch.events.push(e);
        }
    }

    /// Hands the batch to every exporter that has not failed, then empties it. An empty batch is handed over
    /// too when `always` (exporters that write on a clock get their chance).
    pub(crate) fn export(&mut self, stats: &SharedStats, always: bool) {
        self.flush_counters();
        if !self.early_failures.is_empty() {
            self.note_early_failures(stats);
        }
        if self.batch.is_empty() && !always {
            return;
        }
        // A fact about a track is shown as an event too (Perfetto writes an instant): counted with them.
        let events = self.batch.events.len() + self.batch.metadata.len();
        stats.events.fetch_add(events as u64, Ordering::Relaxed);
        for slot in &mut self.exporters {
            if slot.failed {
                continue;
            }
            let batch = &self.batch;
            if let Err(e) = guarded(|| slot.exporter.export(batch)) {
                record_failure(stats, slot, e);
            }
        }
        self.clear_batch();
    }

    /// Empties the batch, keeping its string values for [`string`](Self::string).
    pub(crate) fn clear_batch(&mut self) {
        for field in self.batch.fields.drain(..) {
            if let FieldValue::Str(mut text) = field.value {
                if text.capacity() <= SPARE_STRING_CAPACITY
                    && self.spare_bytes + spare_cost(&text) <= SPARE_STRING_BYTES
                {
                    text.clear();
                    self.spare_bytes += spare_cost(&text);
                    self.spare_strings.push(text);
                }
            }
        }
        self.batch.clear();
    }

    /// `text` as an owned string, in a reused allocation where one is spare.
    pub(crate) fn string(&mut self, text: &str) -> String {
        match self.spare_strings.pop() {
            Some(mut spare) => {
                self.spare_bytes -= spare_cost(&spare);
                spare.push_str(text);
                spare
            }
            None => text.to_owned(),
        }
    }

    /// Flushes (or, `finishing`, finishes) every exporter; the first failure so far, in words.
    pub(crate) fn flush_exporters(&mut self, stats: &SharedStats, finishing: bool) -> Result<(), String> {
        self.note_early_failures(stats);
        for slot in &mut self.exporters {
            if slot.failed {
                continue;
            }
            let exporter = &mut slot.exporter;
            let result = guarded(|| if finishing { exporter.finish() } else { exporter.flush() });
            if let Err(e) = result {
                record_failure(stats, slot, e);
            }
        }
        stats.first_export_failure()
    }
}

fn record_failure(stats: &SharedStats, slot: &mut ExporterSlot, e: ExportError) {
    slot.failed = true;
    stats.export_failures.fetch_add(1, Ordering::Relaxed);
    stats.note_export_failure(FirstExportError::from_export_error(&e));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch_of_strings(out: &mut Output, count: usize, text: &str) {
        for _ in 0..count {
            let value = FieldValue::Str(out.string(text));
            out.batch.fields.push(TraceField { name: NameId(1), value });
        }
    }

    #[test]
    fn a_pass_worth_of_messages_is_reused_by_the_next_and_the_spare_memory_stays_bounded() {
        let mut out = Output::new(&crate::export::RecordingOrigin::this_process(), Vec::new());
        // More short messages than a 1 ms pass of `info!` on one thread: all kept for the next batch.
        batch_of_strings(&mut out, 20_000, "event");
        out.clear_batch();
        assert_eq!(out.spare_strings.len(), 20_000);
        batch_of_strings(&mut out, 20_000, "event 2");
        assert!(out.spare_strings.is_empty());
        assert_eq!(out.spare_bytes, 0, "every reused string's cost given back");
        out.clear_batch();
        // Long values: the pool stops at its memory budget, the rest is freed.
        batch_of_strings(&mut out, 50_000, &"x".repeat(200));
        out.clear_batch();
        let held: usize = out.spare_strings.iter().map(spare_cost).sum();
        assert_eq!(held, out.spare_bytes);
        assert!(out.spare_bytes <= SPARE_STRING_BYTES, "{}", out.spare_bytes);
        assert!(out.spare_strings.len() < 50_000);
    }
}
