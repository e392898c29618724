//! The processing stage's span table: every span by its serial, with its name, parent and the history of
//! its field values, so that a slice can carry the values its span had when the slice ended.

use std::collections::HashMap;

use crate::export::{Field, NameId};

/// Hashes u64 keys (serials, callsite keys) with one multiply: the collector looks one up per record, and
/// SipHash's DoS resistance buys nothing for keys the process made itself.
#[derive(Clone, Copy, Default)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, key: u64) {
        // A folded 64x64->128 multiply spreads the key over both halves: keys are addresses (16-byte
        // aligned) and serials (counters), and the table indexes with the low bits and tags with the high.
        let product = u128::from(self.0 ^ key) * 0x9e37_79b9_7f4a_7c15;
        self.0 = (product as u64) ^ ((product >> 64) as u64);
    }
}

pub(crate) type IdMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<IdHasher>>;

/// Most field updates kept per span before the oldest are folded into its base values.
const MAX_UPDATES: usize = 64;

/// One span, from its creation record to a little after its close.
pub(crate) struct SpanState {
    pub(crate) name: NameId,
    /// The callsite key (field names come from the callsite).
    pub(crate) callsite: u64,
    /// Creation time (reference ns).
    #[allow(dead_code, reason = "a span's lifetime, for async task tracks")]
    pub(crate) created_ns: u64,
    /// The explicit or inferred parent span's serial.
    #[allow(dead_code, reason = "nesting of async task tracks")]
    pub(crate) parent: Option<u64>,
    /// Values as of creation, and of every update folded in.
    base: Vec<Field>,
    /// Later updates `(reference ns, field)`, oldest first.
    updates: Vec<(u64, Field)>,
    /// Slices of this span open on some thread track.
    pub(crate) open_slices: u32,
    /// Begins of this span's slices held for their values (see `process.rs`): the span must outlive them.
    pub(crate) held_begins: u32,
    /// Enters seen, and the first thread track that entered it (issue: async tracks).
    pub(crate) enters: u32,
    /// The pass in which its close was processed.
    pub(crate) closed_in: Option<u64>,
    /// When it closed (reference ns).
    pub(crate) closed_ns: Option<u64>,
    /// Fields cut or left out at creation or in updates (the marker's value).
    pub(crate) fields_truncated: u64,
}

impl SpanState {
    pub(crate) fn new(name: NameId, callsite: u64, created_ns: u64, parent: Option<u64>, fields: Vec<Field>) -> Self {
        SpanState {
            name,
            callsite,
            created_ns,
            parent,
            base: fields,
            updates: Vec::new(),
            open_slices: 0,
            held_begins: 0,
            enters: 0,
            closed_in: None,
            closed_ns: None,
            fields_truncated: 0,
        }
    }

    /// Records new values at `ts_ns` (updates from several threads may arrive out of time order).
    pub(crate) fn update(&mut self, ts_ns: u64, fields: impl IntoIterator<Item = Field>) {
        for field in fields {
            let pos = self.updates.partition_point(|(ts, _)| *ts <= ts_ns);
            self.updates.insert(pos, (ts_ns, field));
        }
        if self.updates.len() > MAX_UPDATES {
            // Fold the oldest half: slices that end before them were released long ago (a slice is held at
            // most the hold limit).
            let fold: Vec<(u64, Field)> = self.updates.drain(..MAX_UPDATES / 2).collect();
            for (_, field) in fold {
                set_field(&mut self.base, field);
            }
        }
    }

    /// The span's values at `ts_ns`: its creation values with every update at or before `ts_ns` applied.
    pub(crate) fn values_at(&self, ts_ns: u64, out: &mut Vec<Field>) {
        out.clear();
        out.extend_from_slice(&self.base);
        for (ts, field) in &self.updates {
            if *ts > ts_ns {
                break;
            }
            set_field(out, field.clone());
        }
    }
}

/// Sets `field` in `fields`, replacing the value of a field of the same name.
pub(crate) fn set_field(fields: &mut Vec<Field>, field: Field) {
    match fields.iter_mut().find(|f| f.name == field.name) {
        Some(existing) => existing.value = field.value,
        None => fields.push(field),
    }
}

/// Every live span, by serial.
#[derive(Default)]
pub(crate) struct Spans {
    spans: IdMap<SpanState>,
    /// Spans closed, with the pass their close was processed in: forgotten a few passes later.
    closed: Vec<(u64, u64)>,
}

/// Passes a closed span is kept (its last exits may still be on rings processed later).
const KEEP_CLOSED_PASSES: u64 = 2;

impl Spans {
    pub(crate) fn get(&self, serial: u64) -> Option<&SpanState> {
        self.spans.get(&serial)
    }

    pub(crate) fn get_mut(&mut self, serial: u64) -> Option<&mut SpanState> {
        self.spans.get_mut(&serial)
    }

    pub(crate) fn insert(&mut self, serial: u64, span: SpanState) {
        self.spans.insert(serial, span);
    }

    /// Notes span `serial`'s close, processed in pass `pass`.
    pub(crate) fn close(&mut self, serial: u64, pass: u64, ts_ns: u64) {
        if let Some(span) = self.spans.get_mut(&serial) {
            span.closed_in = Some(pass);
            span.closed_ns = Some(ts_ns);
            self.closed.push((serial, pass));
        }
    }

    /// Forgets spans closed a few passes ago that no open slice refers to.
    pub(crate) fn sweep(&mut self, pass: u64) {
        let spans = &mut self.spans;
        self.closed.retain(|&(serial, closed)| {
            if pass < closed + KEEP_CLOSED_PASSES {
                return true;
            }
            match spans.get(&serial) {
                Some(span) if span.open_slices > 0 || span.held_begins > 0 => true,
                Some(_) => {
                    spans.remove(&serial);
                    false
                }
                None => false,
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::FieldValue;

    fn field(name: u32, v: i64) -> Field {
        Field {
            name: NameId(name),
            value: FieldValue::I64(v),
        }
    }

    #[test]
    fn values_at_a_time_apply_only_earlier_updates_in_time_order() {
        let mut span = SpanState::new(NameId(1), 0, 100, None, vec![field(1, 0)]);
        span.update(300, [field(1, 3)]);
        span.update(200, [field(1, 2), field(2, 20)]);
        let mut out = Vec::new();
        span.values_at(150, &mut out);
        assert_eq!(out, [field(1, 0)]);
        span.values_at(250, &mut out);
        assert_eq!(out, [field(1, 2), field(2, 20)]);
        span.values_at(300, &mut out);
        assert_eq!(out, [field(1, 3), field(2, 20)]);
    }

    #[test]
    fn closed_spans_are_forgotten_once_no_slice_needs_them() {
        let mut spans = Spans::default();
        spans.insert(7, SpanState::new(NameId(1), 0, 0, None, Vec::new()));
        spans.get_mut(7).unwrap().open_slices = 1;
        spans.close(7, 10, 5);
        spans.sweep(20);
        assert!(spans.get(7).is_some(), "an open slice still refers to it");
        spans.get_mut(7).unwrap().open_slices = 0;
        spans.sweep(21);
        assert!(spans.get(7).is_none());
    }
}
