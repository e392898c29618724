//! The record stream's one format: the 16-byte records the hot path writes into its ring, the encoders it
//! uses, and the decoder the collector reads them back with. Encoder and decoder live here together and are
//! tested together, torn, truncated and corrupt input included.
//!
//! # Records
//!
//! A record is two little words. Word 0 is `[kind: 4 bits][aux: 12 bits][tick: 48 bits]`; word 1 is the
//! kind's payload (a span serial, a callsite key, a count). 48 tick bits last 15 hours at 5 GHz; the
//! collector restores the top bits from the tick it reads when it drains the ring ([`restore_ticks`]),
//! milliseconds later.
//!
//! Records that carry variable data (span creation, `record`, events, counters, GPU scopes) are the *head*
//! of a *group*: `aux` holds the number of data records that follow, and the producer pushes the whole
//! group or nothing (one `Release` store of the ring's tail), so a group is never torn in the ring and the
//! collector, which drains a ring up to its tail, never splits one. Every data record is tagged
//! (`kind = Data`, `aux = its 1-based position in the group`), so a framing error, should one ever occur,
//! is detected and counted by the decoder instead of being read as something it is not.
//!
//! A data record carries 112 bits: the low 48 bits of word 0 and all of word 1. The first one or two data
//! records of a group are the kind's *fixed* records (below); the rest carry a byte payload, 14 bytes per
//! record (6 from word 0, little-endian, then 8 from word 1), whose exact length the first fixed record
//! states.
//!
//! | kind | tick | word 1 | fixed data records | payload |
//! |---|---|---|---|---|
//! | `SpanNew` | now, or 0 (untimed) | callsite key | with fields or a non-contextual parent: `[len, parent mode]` + explicit parent serial (or 0) | fields |
//! | `SpanRecord` | now | span serial | `[len]` | fields |
//! | `SpanEnter`, `SpanExit` | now | span serial | | |
//! | `SpanClose` | now, or 0 with `aux` bit [`AT_LAST_EXIT`] | span serial; `aux` bit [`VALUES_FINAL`]: no `record` reached the span; bit [`MAY_BE_TASK`]: entered more than once or named as a parent | | |
//! | `Event` | now | callsite key | `[len, parent mode]` + explicit parent serial (or 0) | fields |
//! | `ScopeBegin`, `ScopeEnd` | now, with `aux` the scope's tag (1 to 4095, the same on its begin and end; 0 in captures before version 5) | callsite key | | |
//! | `Instant` | now | callsite key | | |
//! | `Counter` | now | callsite key | value (`f64` bits) | |
//! | `GpuBegin` | now | callsite key | `[len]` + GPU scope key | fields |
//! | `Gap` | now | records dropped since the last gap; 0 in the ring's last record, made as its thread exits: the last moment the thread is known to have lived | | |
//!
//! A span's serial is not in its records' bits twice over: span serials are handed out per ring in order,
//! `(ring number << 40) | n` for the ring's `n`-th `SpanNew`, so the collector numbers the `SpanNew` records
//! of a ring as it meets them. A creation that a full ring refused takes no number (its span's records are
//! all dropped and counted). A timeline that shows async task lifetimes (the default) stamps `SpanNew`; one
//! that does not saves the counter read and writes 0, and the collector then places the creation at the next
//! timed record of its ring (for a span entered right away, its first enter).
//!
//! Callsite keys are the addresses of `'static` callsites (`tracing`'s `Metadata`, tickline's
//! [`NativeCallsite`](crate::export::NativeCallsite)). The collector never dereferences one: callsites are registered with it
//! over the timeline's control channel (`Layer::register_callsite`, a native macro's first use), and it
//! looks keys up in its own table; a key it does not know is counted, never followed.
//!
//! # Fields
//!
//! A field payload is a sequence of `[field index: u8][tag: u8][value]` entries; strings are
//! `[len: u16][utf-8 bytes]`. Index [`META_INDEX`] carries tickline's own entries: [`TAG_TRUNCATED`] says
//! how many fields were cut or left out because the payload reached its limit.

use std::fmt::{self, Write as _};

/// One raw record: 16 bytes, `Copy`, written by one thread, read by the collector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub(crate) struct Record {
    pub(crate) word0: u64,
    pub(crate) word1: u64,
}

const _: () = assert!(std::mem::size_of::<Record>() == 16);

const KIND_SHIFT: u32 = 60;
const AUX_SHIFT: u32 = 48;
/// Largest `aux` value (12 bits).
pub(crate) const AUX_MAX: u64 = 0xFFF;
/// Bits of the raw tick a record keeps.
pub(crate) const TICK_BITS: u32 = 48;
/// The tick bits of word 0, and the data bits of a data record's word 0.
pub(crate) const TICK_MASK: u64 = (1 << TICK_BITS) - 1;
/// Payload bytes one data record carries.
pub(crate) const DATA_BYTES: usize = 14;
/// Most data records one group can have (`aux` is 12 bits).
pub(crate) const MAX_DATA_RECORDS: usize = AUX_MAX as usize;
/// `SpanClose` flag: untimed, the span closed right after its last exit on this thread, whose tick it takes.
pub(crate) const AT_LAST_EXIT: u64 = 1;
/// `SpanClose` flag: no `record` reached the span after its creation (on any thread), so the values it was
/// created with are its values at every moment: its slices need not wait for values recorded elsewhere.
pub(crate) const VALUES_FINAL: u64 = 2;
/// `SpanClose` flag: the span was entered more than once (on any threads), or named as a span's explicit
/// parent, so it may be an async task (or hold some) even when this close directly follows its only exit on
/// this thread: another thread's enter may be on a ring the collector processes later.
pub(crate) const MAY_BE_TASK: u64 = 4;
/// Every `SpanClose` flag: a close with any other `aux` bit is a framing error.
const CLOSE_FLAGS: u64 = AT_LAST_EXIT | VALUES_FINAL | MAY_BE_TASK;

/// Whether `record` is a close of span `serial` that the decoder accepts as one (no unknown flag), so that
/// looking ahead for a close never finds one the decoder would skip. Kinds are tagged: a data record never
/// passes for a close.
#[inline]
pub(crate) fn is_close_of(record: &Record, serial: u64) -> bool {
    record.kind() == Some(Kind::SpanClose) && record.word1 == serial && record.aux() & !CLOSE_FLAGS == 0
}

/// What a record means. Stored in the top 4 bits of word 0; 0 (zeroed memory) is no kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    SpanNew = 1,
    SpanRecord = 2,
    SpanEnter = 3,
    SpanExit = 4,
    SpanClose = 5,
    Event = 6,
    ScopeBegin = 7,
    ScopeEnd = 8,
    Instant = 9,
    Counter = 10,
    GpuBegin = 11,
    Gap = 12,
    /// A data record of a group (never first).
    Data = 15,
}

impl Kind {
    /// The kind a record's kind bits name, if any.
    pub(crate) fn from_bits(bits: u64) -> Option<Kind> {
        Some(match bits {
            1 => Kind::SpanNew,
            2 => Kind::SpanRecord,
            3 => Kind::SpanEnter,
            4 => Kind::SpanExit,
            5 => Kind::SpanClose,
            6 => Kind::Event,
            7 => Kind::ScopeBegin,
            8 => Kind::ScopeEnd,
            9 => Kind::Instant,
            10 => Kind::Counter,
            11 => Kind::GpuBegin,
            12 => Kind::Gap,
            15 => Kind::Data,
            _ => return None,
        })
    }

    /// Fixed data records a group of this kind has at least (0 for kinds that are not groups).
    fn min_fixed(self) -> usize {
        match self {
            Kind::SpanRecord | Kind::Event | Kind::Counter | Kind::GpuBegin => 1,
            _ => 0,
        }
    }
}

impl Record {
    /// A record of `kind` stamped `ticks` (low 48 bits kept), with `aux` and `word1`.
    #[inline(always)]
    pub(crate) const fn head(kind: Kind, aux: u64, ticks: u64, word1: u64) -> Record {
        Record {
            word0: ((kind as u64) << KIND_SHIFT) | ((aux & AUX_MAX) << AUX_SHIFT) | (ticks & TICK_MASK),
            word1,
        }
    }

    /// A native scope's begin or end stamped `ticks`, with its tag: an end closes the open scope of its callsite
    /// and tag, so guards of one call site dropped out of order end their own slices.
    #[inline(always)]
    pub(crate) const fn scope(kind: Kind, ticks: u64, callsite: u64, tag: u16) -> Record {
        Record::head(kind, tag as u64, ticks, callsite)
    }

    /// A one-record kind (enter, exit, scope begin/end, instant, gap) stamped `ticks`.
    #[inline(always)]
    pub(crate) const fn timed(kind: Kind, ticks: u64, word1: u64) -> Record {
        Record::head(kind, 0, ticks, word1)
    }

    /// Data record number `index` (1-based) of a group, carrying 48 + 64 bits.
    #[inline(always)]
    pub(crate) const fn data(index: usize, low48: u64, word1: u64) -> Record {
        Record::head(Kind::Data, index as u64, low48, word1)
    }

    fn kind_bits(&self) -> u64 {
        self.word0 >> KIND_SHIFT
    }

    pub(crate) fn kind(&self) -> Option<Kind> {
        Kind::from_bits(self.kind_bits())
    }

    pub(crate) fn aux(&self) -> u64 {
        (self.word0 >> AUX_SHIFT) & AUX_MAX
    }

    /// The low 48 bits of the tick (or of a data record's word 0).
    pub(crate) fn low48(&self) -> u64 {
        self.word0 & TICK_MASK
    }
}

/// Restores a 48-bit tick to 64 bits: the value with those low bits nearest to (and not far after) `now`.
#[inline]
pub(crate) fn restore_ticks(low: u64, now: u64) -> u64 {
    let back = now.wrapping_sub(low) & TICK_MASK;
    // Records are older than `now`; a record a little newer than `now` (a read racing the collector's own
    // read on another CPU) shows up as a huge `back`: treat the top 1/16 of the range as "slightly ahead".
    if back > TICK_MASK - (TICK_MASK >> 4) {
        now.wrapping_add((TICK_MASK + 1) - back)
    } else {
        now.wrapping_sub(back)
    }
}

/// How a span or event names its parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Parent {
    /// The span current on the recording thread (the collector knows which: the innermost open span slice).
    Contextual,
    /// No parent.
    Root,
    /// An explicitly given span, by serial.
    Explicit(u64),
}

const PARENT_CONTEXTUAL: u64 = 0;
const PARENT_ROOT: u64 = 1;
const PARENT_EXPLICIT: u64 = 2;

impl Parent {
    fn mode(self) -> u64 {
        match self {
            Parent::Contextual => PARENT_CONTEXTUAL,
            Parent::Root => PARENT_ROOT,
            Parent::Explicit(_) => PARENT_EXPLICIT,
        }
    }
}

/// Data records a payload of `len` bytes needs.
#[inline]
pub(crate) fn payload_records(len: usize) -> usize {
    len.div_ceil(DATA_BYTES)
}

/// Appends `payload` as data records numbered from `first_index` on (the last one zero-padded).
#[inline]
fn push_payload(out: &mut Vec<Record>, first_index: usize, payload: &[u8]) {
    // Whole records with fixed-size loads (the hot path of every event: no variable-length copy per record),
    // then the zero-padded tail.
    let data = |index: usize, bytes: &[u8; DATA_BYTES]| {
        let mut low = [0u8; 8];
        low[..6].copy_from_slice(&bytes[..6]);
        let word1 = u64::from_le_bytes(bytes[6..].try_into().expect("8 bytes"));
        Record::data(index, u64::from_le_bytes(low), word1)
    };
    out.reserve(payload_records(payload.len()));
    let mut whole = payload.chunks_exact(DATA_BYTES);
    let mut index = first_index;
    for chunk in &mut whole {
        out.push(data(index, chunk.try_into().expect("DATA_BYTES bytes")));
        index += 1;
    }
    let tail = whole.remainder();
    if !tail.is_empty() {
        // Byte by byte: a short copy into a zeroed array would call memset and memcpy for a few bytes.
        let (mut low48, mut word1) = (0u64, 0u64);
        for (k, &b) in tail.iter().enumerate() {
            if k < 6 {
                low48 |= u64::from(b) << (8 * k);
            } else {
                word1 |= u64::from(b) << (8 * (k - 6));
            }
        }
        out.push(Record::data(index, low48, word1));
    }
}

/// The group of a span's creation with fields or a parent that is not the contextual one, at `ticks` (0:
/// untimed).
pub(crate) fn encode_span_new(out: &mut Vec<Record>, ticks: u64, callsite: u64, parent: Parent, payload: &[u8]) {
    encode_with_parent(out, Kind::SpanNew, ticks, callsite, parent, payload);
}

/// A group of `kind` whose first data record carries the payload length, the parent mode and an explicit
/// parent's serial (0 otherwise): span creations and events.
fn encode_with_parent(out: &mut Vec<Record>, kind: Kind, ticks: u64, callsite: u64, parent: Parent, payload: &[u8]) {
    out.clear();
    out.push(Record::head(
        kind,
        (1 + payload_records(payload.len())) as u64,
        ticks,
        callsite,
    ));
    let parent_serial = match parent {
        Parent::Explicit(serial) => serial,
        _ => 0,
    };
    out.push(Record::data(
        1,
        payload.len() as u64 | (parent.mode() << 16),
        parent_serial,
    ));
    push_payload(out, 2, payload);
}

/// A span created without field values and with a contextual parent, at `ticks` (0: untimed): one record.
#[inline(always)]
pub(crate) fn span_new_bare(ticks: u64, callsite: u64) -> Record {
    Record::head(Kind::SpanNew, 0, ticks, callsite)
}

/// The group of a `record` of span fields.
pub(crate) fn encode_span_record(out: &mut Vec<Record>, ticks: u64, serial: u64, payload: &[u8]) {
    out.clear();
    out.push(Record::head(
        Kind::SpanRecord,
        (1 + payload_records(payload.len())) as u64,
        ticks,
        serial,
    ));
    out.push(Record::data(1, payload.len() as u64, 0));
    push_payload(out, 2, payload);
}

/// The group of an event.
pub(crate) fn encode_event(out: &mut Vec<Record>, ticks: u64, callsite: u64, parent: Parent, payload: &[u8]) {
    encode_with_parent(out, Kind::Event, ticks, callsite, parent, payload);
}

/// The group of a GPU scope's begin: the callsite, the scope key (device, queue, timestamp pair), fields.
pub(crate) fn encode_gpu_begin(out: &mut Vec<Record>, ticks: u64, callsite: u64, key: u64, payload: &[u8]) {
    out.clear();
    out.push(Record::head(
        Kind::GpuBegin,
        (1 + payload_records(payload.len())) as u64,
        ticks,
        callsite,
    ));
    out.push(Record::data(1, payload.len() as u64, key));
    push_payload(out, 2, payload);
}

/// A counter value: two records, no scratch space.
#[inline(always)]
pub(crate) fn counter(ticks: u64, callsite: u64, value: f64) -> [Record; 2] {
    [
        Record::head(Kind::Counter, 1, ticks, callsite),
        Record::data(1, 0, value.to_bits()),
    ]
}

/// A decoded payload: its data records and exact length in bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Payload<'a> {
    records: &'a [Record],
    len: usize,
}

impl<'a> Payload<'a> {
    /// The payload's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies the payload's bytes into `out` (replacing its contents).
    pub(crate) fn bytes_into(&self, out: &mut Vec<u8>) {
        out.clear();
        for r in self.records {
            out.extend_from_slice(&r.word0.to_le_bytes()[..6]);
            out.extend_from_slice(&r.word1.to_le_bytes());
        }
        out.truncate(self.len);
    }
}

/// A leaf span's four records, one after another in its ring: a bare creation (no fields, contextual parent),
/// its enter, its exit, and its close right after the exit. Nothing else was recorded on the thread from the
/// span's creation to its close: the common case of `info_span!(..).entered()` around code that records
/// nothing itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LeafSpan {
    /// The creation's ticks (0: untimed).
    pub(crate) created_ticks: u64,
    pub(crate) callsite: u64,
    pub(crate) enter_ticks: u64,
    pub(crate) exit_ticks: u64,
    /// The serial the enter, exit and close name (the creation's serial is its position in the ring: the
    /// caller checks they agree).
    pub(crate) serial: u64,
}

impl LeafSpan {
    /// Records in a leaf span.
    pub(crate) const RECORDS: usize = 4;

    /// The leaf span `records` starts with, if it starts with one. Kinds and aux bits are compared as bits, four
    /// at once: no per-record decoding.
    #[inline]
    pub(crate) fn at(records: &[Record]) -> Option<LeafSpan> {
        let [new, rest @ ..] = records else {
            return None;
        };
        if record_head(new) != expected_head(Kind::SpanNew, 0) {
            return None;
        }
        let tail = LeafTail::at(rest)?;
        Some(LeafSpan {
            created_ticks: new.low48(),
            callsite: new.word1,
            enter_ticks: tail.enter_ticks,
            exit_ticks: tail.exit_ticks,
            serial: tail.serial,
        })
    }

    /// Whether `records` may start with a creation group with fields or an explicit parent (a `SpanNew` head
    /// with data records): the caller decodes it and checks for a [`LeafTail`] after it.
    #[inline]
    pub(crate) fn group_at(records: &[Record]) -> bool {
        records
            .first()
            .is_some_and(|new| new.kind() == Some(Kind::SpanNew) && record_head(new) != expected_head(Kind::SpanNew, 0))
    }
}

/// A leaf span's last three records: its enter, its exit, and its close right after the exit, all naming
/// one serial. After a bare creation, a [`LeafSpan`]; after a creation group with fields, the leaf span with
/// fields of `Processor::leaf_span_with_fields`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LeafTail {
    pub(crate) enter_ticks: u64,
    pub(crate) exit_ticks: u64,
    pub(crate) serial: u64,
    /// The close says the span's creation values are final ([`VALUES_FINAL`]).
    pub(crate) values_final: bool,
}

impl LeafTail {
    /// Records in a leaf tail.
    pub(crate) const RECORDS: usize = 3;

    /// The leaf tail `records` starts with, if it starts with one (kinds and aux bits compared as bits).
    #[inline]
    pub(crate) fn at(records: &[Record]) -> Option<LeafTail> {
        let [enter, exit, close, ..] = records else {
            return None;
        };
        // The close's VALUES_FINAL bit may be either way: compared with it set.
        let shape = record_head(enter) == expected_head(Kind::SpanEnter, 0)
            && record_head(exit) == expected_head(Kind::SpanExit, 0)
            && record_head(close) | VALUES_FINAL == expected_head(Kind::SpanClose, AT_LAST_EXIT | VALUES_FINAL);
        let serial = enter.word1;
        (shape && exit.word1 == serial && close.word1 == serial).then(|| LeafTail {
            enter_ticks: enter.low48(),
            exit_ticks: exit.low48(),
            serial,
            values_final: close.aux() & VALUES_FINAL != 0,
        })
    }
}

/// A record's kind and aux bits, for comparing shapes without decoding.
#[inline(always)]
fn record_head(r: &Record) -> u64 {
    r.word0 >> AUX_SHIFT
}

/// The kind and aux bits of a record of `kind` with `aux`.
#[inline(always)]
fn expected_head(kind: Kind, aux: u64) -> u64 {
    ((kind as u64) << (KIND_SHIFT - AUX_SHIFT)) | aux
}

/// One decoded record or group.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Item<'a> {
    /// A span's creation (its serial is its position among the ring's `SpanNew`s), at `ticks` (0: untimed).
    SpanNew {
        ticks: u64,
        callsite: u64,
        parent: Parent,
        fields: Payload<'a>,
    },
    SpanRecord {
        ticks: u64,
        serial: u64,
        fields: Payload<'a>,
    },
    SpanEnter {
        ticks: u64,
        serial: u64,
    },
    SpanExit {
        ticks: u64,
        serial: u64,
    },
    /// `ticks` is `None` when the span closed right after its last exit on this thread (take that tick).
    /// `values_final`: see [`VALUES_FINAL`]; `may_be_task`: see [`MAY_BE_TASK`].
    SpanClose {
        ticks: Option<u64>,
        serial: u64,
        values_final: bool,
        may_be_task: bool,
    },
    Event {
        ticks: u64,
        callsite: u64,
        #[allow(
            dead_code,
            reason = "events are placed on their thread's track; a parent is for async task tracks"
        )]
        parent: Parent,
        fields: Payload<'a>,
    },
    ScopeBegin {
        ticks: u64,
        callsite: u64,
        tag: u16,
    },
    ScopeEnd {
        ticks: u64,
        callsite: u64,
        tag: u16,
    },
    Instant {
        ticks: u64,
        callsite: u64,
    },
    Counter {
        ticks: u64,
        callsite: u64,
        value: f64,
    },
    GpuBegin {
        ticks: u64,
        callsite: u64,
        key: u64,
        fields: Payload<'a>,
    },
    /// `dropped` records were dropped (ring full) on this thread just before this point; with none dropped,
    /// the thread exited here.
    Gap {
        ticks: u64,
        dropped: u64,
    },
}

/// Why records could not be decoded. The decoder skips them and goes on at the next head record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// A record whose kind is no head kind where a head was expected.
    Stray,
    /// A group whose data records run past the end of the input.
    Truncated,
    /// A group whose data records are mistagged or whose fixed records are inconsistent.
    Malformed,
}

/// Decodes records into [`Item`]s, validating the framing. Never panics, whatever the input.
#[derive(Clone, Debug)]
pub(crate) struct Decoder<'a> {
    records: &'a [Record],
    pos: usize,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(records: &'a [Record]) -> Self {
        Decoder { records, pos: 0 }
    }

    /// Skips the head at `pos` and any data records after it; returns the error with how many went.
    fn skip(&mut self, error: FrameError) -> Option<(Result<Item<'a>, FrameError>, usize)> {
        let start = self.pos;
        self.pos += 1;
        while self.records.get(self.pos).is_some_and(|r| r.kind() == Some(Kind::Data)) {
            self.pos += 1;
        }
        Some((Err(error), self.pos - start))
    }

    /// The records not yet decoded.
    #[inline]
    pub(crate) fn rest(&self) -> &'a [Record] {
        &self.records[self.pos.min(self.records.len())..]
    }

    /// Moves past `n` records the caller decoded itself (a [`LeafSpan`]).
    #[inline]
    pub(crate) fn skip_decoded(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.records.len());
    }

    /// Whether the next record (not yet decoded) is the close of span `serial`, saying the span was entered
    /// only once ([`MAY_BE_TASK`] not set): the exit before it ended the span's only poll.
    #[inline]
    pub(crate) fn next_closes_synchronous(&self, serial: u64) -> bool {
        self.records
            .get(self.pos)
            .is_some_and(|r| is_close_of(r, serial) && r.aux() & MAY_BE_TASK == 0)
    }

    /// The next item and how many records it spans, or the framing error and how many records were skipped.
    #[inline(always)]
    pub(crate) fn next_with_len(&mut self) -> Option<(Result<Item<'a>, FrameError>, usize)> {
        let head = *self.records.get(self.pos)?;
        let Some(kind) = head.kind().filter(|&k| k != Kind::Data) else {
            return self.skip(FrameError::Stray);
        };
        let ticks = head.low48();
        let word1 = head.word1;
        let min_fixed = kind.min_fixed();
        if kind == Kind::SpanNew && head.aux() == 0 {
            // A bare creation: no fields, the contextual parent.
            self.pos += 1;
            return Some((
                Ok(Item::SpanNew {
                    ticks,
                    callsite: word1,
                    parent: Parent::Contextual,
                    fields: Payload { records: &[], len: 0 },
                }),
                1,
            ));
        }
        let min_fixed = if kind == Kind::SpanNew { 1 } else { min_fixed };
        if min_fixed == 0 {
            let aux = head.aux();
            let item = match kind {
                Kind::SpanEnter if aux == 0 => Item::SpanEnter { ticks, serial: word1 },
                Kind::SpanExit if aux == 0 => Item::SpanExit { ticks, serial: word1 },
                Kind::SpanClose if aux & !CLOSE_FLAGS == 0 => Item::SpanClose {
                    ticks: (aux & AT_LAST_EXIT == 0).then_some(ticks),
                    serial: word1,
                    values_final: aux & VALUES_FINAL != 0,
                    may_be_task: aux & MAY_BE_TASK != 0,
                },
                Kind::ScopeBegin => Item::ScopeBegin {
                    ticks,
                    callsite: word1,
                    tag: aux as u16, // 12 bits
                },
                Kind::ScopeEnd => Item::ScopeEnd {
                    ticks,
                    callsite: word1,
                    tag: aux as u16,
                },
                Kind::Instant if aux == 0 => Item::Instant { ticks, callsite: word1 },
                Kind::Gap if aux == 0 => Item::Gap { ticks, dropped: word1 },
                _ => return self.skip(FrameError::Malformed),
            };
            self.pos += 1;
            return Some((Ok(item), 1));
        }
        let ndata = head.aux() as usize;
        if ndata < min_fixed {
            return self.skip(FrameError::Malformed);
        }
        let Some(data) = self.records.get(self.pos + 1..self.pos + 1 + ndata) else {
            return self.skip(FrameError::Truncated);
        };
        if data
            .iter()
            .enumerate()
            .any(|(k, r)| r.kind() != Some(Kind::Data) || r.aux() != (k as u64 + 1) & AUX_MAX)
        {
            return self.skip(FrameError::Malformed);
        }
        let first = data[0];
        // The payload follows `fixed` records and states its exact length in the first one.
        let payload = |fixed: usize| -> Option<Payload<'a>> {
            let records = data.get(fixed..)?;
            let len = (first.low48() & 0xFFFF) as usize;
            (payload_records(len) == records.len()).then_some(Payload { records, len })
        };
        let parent_mode = (first.low48() >> 16) & 0xFFFF;
        let high_bits_clear = first.low48() >> 32 == 0;
        let item = match kind {
            Kind::SpanNew if high_bits_clear => {
                let parent = match parent_mode {
                    PARENT_CONTEXTUAL => Parent::Contextual,
                    PARENT_ROOT => Parent::Root,
                    PARENT_EXPLICIT => Parent::Explicit(first.word1),
                    _ => return self.skip(FrameError::Malformed),
                };
                payload(1).map(|fields| Item::SpanNew {
                    ticks,
                    callsite: word1,
                    parent,
                    fields,
                })
            }
            Kind::SpanRecord if parent_mode == 0 && high_bits_clear => payload(1).map(|fields| Item::SpanRecord {
                ticks,
                serial: word1,
                fields,
            }),
            Kind::Event if high_bits_clear => {
                let parent = match parent_mode {
                    PARENT_CONTEXTUAL => Some(Parent::Contextual),
                    PARENT_ROOT => Some(Parent::Root),
                    PARENT_EXPLICIT => Some(Parent::Explicit(first.word1)),
                    _ => None,
                };
                parent.and_then(|parent| {
                    payload(1).map(|fields| Item::Event {
                        ticks,
                        callsite: word1,
                        parent,
                        fields,
                    })
                })
            }
            Kind::Counter if ndata == 1 && first.low48() == 0 => Some(Item::Counter {
                ticks,
                callsite: word1,
                value: f64::from_bits(first.word1),
            }),
            Kind::GpuBegin if parent_mode == 0 && high_bits_clear => payload(1).map(|fields| Item::GpuBegin {
                ticks,
                callsite: word1,
                key: first.word1,
                fields,
            }),
            _ => None,
        };
        match item {
            Some(item) => {
                self.pos += 1 + ndata;
                Some((Ok(item), 1 + ndata))
            }
            None => self.skip(FrameError::Malformed),
        }
    }
}

impl<'a> Iterator for Decoder<'a> {
    type Item = Result<Item<'a>, FrameError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.next_with_len().map(|(item, _)| item)
    }
}

// ---------------------------------------------------------------------------------------------------------
// Field payloads.

pub(crate) const TAG_I64: u8 = 0;
pub(crate) const TAG_U64: u8 = 1;
pub(crate) const TAG_F64: u8 = 2;
pub(crate) const TAG_BOOL: u8 = 3;
pub(crate) const TAG_STR: u8 = 4;
/// Under [`META_INDEX`]: how many fields were cut or left out (`u16`).
pub(crate) const TAG_TRUNCATED: u8 = 5;
/// The field index of tickline's own entries (tracing allows at most 32 fields per callsite).
pub(crate) const META_INDEX: u8 = 0xFF;

/// Longest string value kept, in bytes; a longer one is cut at a char boundary, ends in "…" and counts as a
/// truncated field.
pub(crate) const MAX_STR: usize = 4096;
/// Most payload bytes one record group carries (the ring's size may set a lower limit). Fields beyond it are
/// left out and counted.
pub(crate) const MAX_PAYLOAD_BYTES: usize = 48 * 1024;
/// Bytes kept free at the end of a payload for the truncation marker.
const MARKER_BYTES: usize = 4;

/// Encodes fields into a byte payload of at most `limit` bytes: per field `[field index u8][tag u8][value]`.
/// A field that does not fit is left out; a string or `Debug` value that does not fit is cut; either way
/// it is counted and [`finish`](Self::finish) appends the count as a marker.
pub(crate) struct FieldEncoder<'a> {
    buf: &'a mut Vec<u8>,
    /// Most bytes the fields may take, the marker's room excluded.
    limit: usize,
    truncated: u16,
}

impl<'a> FieldEncoder<'a> {
    /// An encoder appending to `buf` (emptied first) with room for `max_bytes` bytes in all.
    pub(crate) fn new(buf: &'a mut Vec<u8>, max_bytes: usize) -> Self {
        buf.clear();
        FieldEncoder {
            buf,
            limit: max_bytes.min(MAX_PAYLOAD_BYTES).saturating_sub(MARKER_BYTES),
            truncated: 0,
        }
    }

    #[inline]
    fn room(&self) -> usize {
        self.limit.saturating_sub(self.buf.len())
    }

    #[inline]
    fn fixed(&mut self, index: u8, tag: u8, bytes: &[u8]) {
        if self.room() < 2 + bytes.len() {
            self.truncated = self.truncated.saturating_add(1);
            return;
        }
        self.buf.extend_from_slice(&[index, tag]);
        self.buf.extend_from_slice(bytes);
    }

    #[inline]
    pub(crate) fn i64(&mut self, index: u8, v: i64) {
        self.fixed(index, TAG_I64, &v.to_le_bytes());
    }
    #[inline]
    pub(crate) fn u64(&mut self, index: u8, v: u64) {
        self.fixed(index, TAG_U64, &v.to_le_bytes());
    }
    #[inline]
    pub(crate) fn f64(&mut self, index: u8, v: f64) {
        self.fixed(index, TAG_F64, &v.to_bits().to_le_bytes());
    }
    #[inline]
    pub(crate) fn bool(&mut self, index: u8, v: bool) {
        self.fixed(index, TAG_BOOL, &[v as u8]);
    }

    /// The longest string value that still fits, or `None` when not even a cut one does.
    fn string_room(&self) -> Option<usize> {
        // Header (4 bytes) plus at least a few bytes and the ellipsis: else leave the field out.
        let room = self.room().checked_sub(4)?;
        (room >= 8).then_some(room.min(MAX_STR + '…'.len_utf8()))
    }

    pub(crate) fn str(&mut self, index: u8, v: &str) {
        let Some(room) = self.string_room() else {
            self.truncated = self.truncated.saturating_add(1);
            return;
        };
        let (kept, truncated) = if v.len() <= room.min(MAX_STR) {
            (v, false)
        } else {
            let mut cut = (room - '…'.len_utf8()).min(MAX_STR).min(v.len());
            while !v.is_char_boundary(cut) {
                cut -= 1;
            }
            (&v[..cut], true)
        };
        let len = kept.len() + if truncated { '…'.len_utf8() } else { 0 };
        self.buf.extend_from_slice(&[index, TAG_STR]);
        self.buf.extend_from_slice(&(len as u16).to_le_bytes());
        self.buf.extend_from_slice(kept.as_bytes());
        if truncated {
            self.buf.extend_from_slice("…".as_bytes());
            self.truncated = self.truncated.saturating_add(1);
        }
    }

    /// Formats a `Debug` value as a string field, without a temporary allocation. Formatting stops as soon as
    /// the value reaches its limit (the writer returns an error, which ends `Debug` early), so a huge value
    /// costs no more than the part that is kept.
    pub(crate) fn debug(&mut self, index: u8, v: &dyn fmt::Debug) {
        let Some(room) = self.string_room() else {
            self.truncated = self.truncated.saturating_add(1);
            return;
        };
        self.buf.extend_from_slice(&[index, TAG_STR, 0, 0]);
        let start = self.buf.len();
        let mut w = BoundedWriter {
            buf: self.buf,
            start,
            cap: (room - '…'.len_utf8()).min(MAX_STR),
            truncated: false,
        };
        // An error here is our own cap (or a Debug impl that failed): what was written is kept.
        let _ = write!(w, "{v:?}");
        if w.truncated {
            self.buf.extend_from_slice("…".as_bytes());
            self.truncated = self.truncated.saturating_add(1);
        }
        let len = self.buf.len() - start;
        self.buf[start - 2..start].copy_from_slice(&(len as u16).to_le_bytes());
    }

    /// Appends the truncation marker if any field was cut or left out; returns how many were.
    pub(crate) fn finish(self) -> u16 {
        if self.truncated > 0 {
            self.buf.extend_from_slice(&[META_INDEX, TAG_TRUNCATED]);
            self.buf.extend_from_slice(&self.truncated.to_le_bytes());
        }
        self.truncated
    }
}

/// Writes into the payload until `cap` bytes, then fails, so the formatting stops.
struct BoundedWriter<'a> {
    buf: &'a mut Vec<u8>,
    start: usize,
    cap: usize,
    truncated: bool,
}

impl fmt::Write for BoundedWriter<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = self.cap - (self.buf.len() - self.start);
        if s.len() <= room {
            self.buf.extend_from_slice(s.as_bytes());
            return Ok(());
        }
        let mut cut = room;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        self.buf.extend_from_slice(&s.as_bytes()[..cut]);
        self.truncated = true;
        Err(fmt::Error)
    }
}

/// A decoded field value, borrowing strings from the payload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum RawValue<'a> {
    I64(i64),
    U64(u64),
    F64(f64),
    Bool(bool),
    Str(&'a str),
    /// Under [`META_INDEX`]: fields cut or left out.
    Truncated(u16),
}

/// Iterates the `(field index, value)` pairs of a payload. Stops at the first malformed entry.
pub(crate) fn decode_fields(mut bytes: &[u8]) -> impl Iterator<Item = (u8, RawValue<'_>)> {
    std::iter::from_fn(move || {
        let (&index, rest) = bytes.split_first()?;
        let (&tag, rest) = rest.split_first()?;
        let take8 = |r: &[u8]| -> Option<[u8; 8]> { r.get(..8)?.try_into().ok() };
        let (value, used) = match tag {
            TAG_I64 => (RawValue::I64(i64::from_le_bytes(take8(rest)?)), 8),
            TAG_U64 => (RawValue::U64(u64::from_le_bytes(take8(rest)?)), 8),
            TAG_F64 => (RawValue::F64(f64::from_bits(u64::from_le_bytes(take8(rest)?))), 8),
            TAG_BOOL => (RawValue::Bool(*rest.first()? != 0), 1),
            TAG_STR => {
                let len = u16::from_le_bytes(rest.get(..2)?.try_into().ok()?) as usize;
                let s = std::str::from_utf8(rest.get(2..2 + len)?).ok()?;
                (RawValue::Str(s), 2 + len)
            }
            TAG_TRUNCATED if index == META_INDEX => (
                RawValue::Truncated(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?)),
                2,
            ),
            _ => return None,
        };
        bytes = &rest[used..];
        Some((index, value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn decode_all(records: &[Record]) -> Vec<Result<Item<'_>, FrameError>> {
        Decoder::new(records).collect()
    }

    fn bytes(p: &Payload<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        p.bytes_into(&mut out);
        out
    }

    #[test]
    fn one_record_kinds_round_trip() {
        let t = 0xABCD_0123_4567_89EFu64;
        let records = [
            Record::timed(Kind::SpanEnter, t, 7),
            Record::timed(Kind::SpanExit, t + 1, 7),
            Record::head(Kind::SpanClose, AT_LAST_EXIT, 0, 7),
            Record::timed(Kind::SpanClose, t + 2, 8),
            Record::timed(Kind::ScopeBegin, t, 0x1000),
            Record::timed(Kind::ScopeEnd, t, 0x1000),
            Record::timed(Kind::Instant, t, 0x2000),
            Record::timed(Kind::Gap, t, 12),
            Record::head(Kind::SpanClose, AT_LAST_EXIT | VALUES_FINAL, 0, 9),
            Record::head(Kind::SpanClose, VALUES_FINAL, t + 3, 10),
            // An aux bit no close has: a framing error, not a close.
            Record::head(Kind::SpanClose, 8, t + 4, 11),
            Record::head(Kind::SpanClose, MAY_BE_TASK | VALUES_FINAL, t + 5, 12),
        ];
        let items = decode_all(&records);
        assert_eq!(items.len(), 12);
        let low = t & TICK_MASK;
        assert!(matches!(items[0], Ok(Item::SpanEnter { ticks, serial: 7 }) if ticks == low));
        assert!(matches!(items[1], Ok(Item::SpanExit { serial: 7, .. })));
        assert!(matches!(
            items[2],
            Ok(Item::SpanClose {
                ticks: None,
                serial: 7,
                values_final: false,
                may_be_task: false
            })
        ));
        assert!(matches!(
            items[3],
            Ok(Item::SpanClose {
                ticks: Some(_),
                serial: 8,
                values_final: false,
                may_be_task: false
            })
        ));
        assert!(matches!(items[4], Ok(Item::ScopeBegin { callsite: 0x1000, .. })));
        assert!(matches!(items[5], Ok(Item::ScopeEnd { callsite: 0x1000, .. })));
        assert!(matches!(items[6], Ok(Item::Instant { callsite: 0x2000, .. })));
        assert!(matches!(items[7], Ok(Item::Gap { dropped: 12, .. })));
        assert!(matches!(
            items[8],
            Ok(Item::SpanClose {
                ticks: None,
                serial: 9,
                values_final: true,
                may_be_task: false
            })
        ));
        assert!(matches!(
            items[9],
            Ok(Item::SpanClose {
                ticks: Some(_),
                serial: 10,
                values_final: true,
                may_be_task: false
            })
        ));
        assert!(items[10].is_err(), "{:?}", items[10]);
        assert!(matches!(
            items[11],
            Ok(Item::SpanClose {
                ticks: Some(_),
                serial: 12,
                values_final: true,
                may_be_task: true
            })
        ));
    }

    #[test]
    fn groups_round_trip_with_their_payloads() {
        let payload: Vec<u8> = (0..100u8).collect();
        let mut out = Vec::new();
        let mut all = Vec::new();
        encode_span_new(&mut out, 5, 0xdead0, Parent::Explicit(3), &payload);
        all.extend_from_slice(&out);
        all.push(span_new_bare(0, 0xbeef0));
        encode_span_record(&mut out, 7, 11, &payload[..13]);
        all.extend_from_slice(&out);
        encode_event(&mut out, 8, 0xfeed0, Parent::Root, &payload[..14]);
        all.extend_from_slice(&out);
        encode_gpu_begin(&mut out, 9, 0xc0de0, 0x0001_0002_0000_0003, &[]);
        all.extend_from_slice(&out);
        all.extend_from_slice(&counter(10, 0xabc0, -2.5));
        let items = decode_all(&all);
        assert_eq!(items.len(), 6, "{items:?}");
        match items[0] {
            Ok(Item::SpanNew {
                ticks: 5,
                callsite: 0xdead0,
                parent: Parent::Explicit(3),
                fields,
            }) => assert_eq!(bytes(&fields), payload),
            ref other => panic!("{other:?}"),
        }
        match items[1] {
            Ok(Item::SpanNew {
                ticks: 0,
                callsite: 0xbeef0,
                parent: Parent::Contextual,
                fields,
            }) => assert_eq!(fields.len(), 0),
            ref other => panic!("{other:?}"),
        }
        match items[2] {
            Ok(Item::SpanRecord { serial: 11, fields, .. }) => assert_eq!(bytes(&fields), &payload[..13]),
            ref other => panic!("{other:?}"),
        }
        match items[3] {
            Ok(Item::Event {
                callsite: 0xfeed0,
                parent: Parent::Root,
                fields,
                ..
            }) => assert_eq!(bytes(&fields), &payload[..14]),
            ref other => panic!("{other:?}"),
        }
        assert!(matches!(
            items[4],
            Ok(Item::GpuBegin {
                key: 0x0001_0002_0000_0003,
                ..
            })
        ));
        assert!(matches!(items[5], Ok(Item::Counter { value, .. }) if value == -2.5));
    }

    #[test]
    fn restore_ticks_near_now() {
        let now = 0xF000_0000_0000_1000u64;
        for back in [0u64, 1, 1_000, 1 << 40] {
            let t = now - back;
            assert_eq!(restore_ticks(t & TICK_MASK, now), t);
        }
        assert_eq!(restore_ticks((now + 5) & TICK_MASK, now), now + 5);
        let now = (1u64 << 48) + 10;
        assert_eq!(restore_ticks(((1u64 << 48) - 5) & TICK_MASK, now), (1u64 << 48) - 5);
    }

    #[test]
    fn framing_errors_are_skipped_and_decoding_resumes() {
        let mut out = Vec::new();
        encode_event(&mut out, 1, 0x10, Parent::Contextual, b"abcdefghijklmnopqrstuvwxyz");
        let good = out.clone();
        // A group cut short, then a good record.
        let mut input = good[..good.len() - 1].to_vec();
        input.push(Record::timed(Kind::Instant, 2, 0x20));
        let items = decode_all(&input);
        // The cut group's data records run into the instant: its count says more than there are.
        assert!(items.iter().any(|i| i.is_err()));
        assert!(matches!(items.last(), Some(Ok(Item::Instant { callsite: 0x20, .. }))));
        // Stray data records (a drain that started mid-group) are skipped.
        let input: Vec<Record> = good[1..]
            .iter()
            .copied()
            .chain([Record::timed(Kind::Instant, 3, 0x30)])
            .collect();
        let items = decode_all(&input);
        assert!(matches!(items[0], Err(FrameError::Stray)));
        assert!(matches!(items[1], Ok(Item::Instant { callsite: 0x30, .. })));
        // A mistagged data record.
        let mut input = good.clone();
        input[2].word0 ^= 1 << AUX_SHIFT;
        assert!(matches!(decode_all(&input)[0], Err(FrameError::Malformed)));
        // Zeroed memory is no record.
        assert!(matches!(decode_all(&[Record::default()])[0], Err(FrameError::Stray)));
        // A truncated group at the end of input.
        assert!(matches!(decode_all(&good[..2])[0], Err(FrameError::Truncated)));
    }

    #[test]
    fn fields_round_trip_and_the_marker_counts_what_was_cut() {
        let mut buf = Vec::new();
        let mut enc = FieldEncoder::new(&mut buf, 1024);
        enc.i64(0, -5);
        enc.u64(1, u64::MAX);
        enc.f64(2, 1.5);
        enc.bool(3, true);
        enc.str(4, "héllo");
        enc.debug(5, &Some(3));
        assert_eq!(enc.finish(), 0);
        let fields: Vec<_> = decode_fields(&buf).collect();
        assert_eq!(
            fields,
            vec![
                (0, RawValue::I64(-5)),
                (1, RawValue::U64(u64::MAX)),
                (2, RawValue::F64(1.5)),
                (3, RawValue::Bool(true)),
                (4, RawValue::Str("héllo")),
                (5, RawValue::Str("Some(3)")),
            ]
        );
        // 32 fields of 1 KiB into a 16 KiB payload: some fit, the others are counted.
        let mut buf = Vec::new();
        let mut enc = FieldEncoder::new(&mut buf, 16 * 1024);
        let big = "x".repeat(1024);
        for i in 0..32 {
            enc.str(i, &big);
        }
        let cut = enc.finish();
        assert!(buf.len() <= 16 * 1024);
        let fields: Vec<_> = decode_fields(&buf).collect();
        let kept = fields.iter().filter(|(i, _)| *i != META_INDEX).count();
        assert_eq!(
            kept + cut as usize,
            32 + fields
                .iter()
                .filter(|(_, v)| matches!(v, RawValue::Str(s) if s.ends_with('…')))
                .count()
        );
        assert_eq!(fields.last(), Some(&(META_INDEX, RawValue::Truncated(cut))));
        assert!(cut > 0);
    }

    #[test]
    fn huge_debug_values_stop_formatting_at_the_cap() {
        struct Endless(std::cell::Cell<usize>);
        impl fmt::Debug for Endless {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                for _ in 0..1_000_000 {
                    self.0.set(self.0.get() + 1);
                    f.write_str("0123456789")?;
                }
                Ok(())
            }
        }
        let value = Endless(std::cell::Cell::new(0));
        let mut buf = Vec::new();
        let mut enc = FieldEncoder::new(&mut buf, MAX_PAYLOAD_BYTES);
        enc.debug(0, &value);
        assert_eq!(enc.finish(), 1);
        assert!(value.0.get() <= MAX_STR / 10 + 1, "Debug ran {} steps", value.0.get());
        let (_, v) = decode_fields(&buf).next().unwrap();
        let RawValue::Str(s) = v else { panic!("{v:?}") };
        assert!(s.ends_with('…') && s.len() <= MAX_STR + 3);
    }

    #[test]
    fn long_strings_are_cut_at_a_char_boundary() {
        let long = "é".repeat(MAX_STR);
        let mut buf = Vec::new();
        let mut enc = FieldEncoder::new(&mut buf, MAX_PAYLOAD_BYTES);
        enc.str(0, &long);
        enc.debug(1, &long);
        assert_eq!(enc.finish(), 2);
        let fields: Vec<_> = decode_fields(&buf).filter(|(i, _)| *i != META_INDEX).collect();
        assert_eq!(fields.len(), 2);
        for (_, v) in fields {
            let RawValue::Str(s) = v else { panic!("{v:?}") };
            assert!(s.ends_with('…') && s.len() <= MAX_STR + 3, "{}", s.len());
        }
    }

    #[test]
    fn malformed_field_payloads_stop_decoding() {
        assert_eq!(decode_fields(&[0, TAG_I64, 1, 2]).count(), 0);
        assert_eq!(decode_fields(&[0, 99]).count(), 0);
        assert_eq!(decode_fields(&[0, TAG_STR, 10, 0, b'a']).count(), 0);
        assert_eq!(
            decode_fields(&[0, TAG_TRUNCATED, 1, 0]).count(),
            0,
            "only under the meta index"
        );
    }

    fn arbitrary_record() -> impl Strategy<Value = Record> {
        prop_oneof![
            any::<(u64, u64)>().prop_map(|(word0, word1)| Record { word0, word1 }),
            (0u64..16, 0u64..8, any::<u64>(), any::<u64>()).prop_map(|(kind, aux, t, word1)| Record::head(
                Kind::from_bits(kind).unwrap_or(Kind::Data),
                aux,
                t,
                word1
            )),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 16 } else { 2048 }))]

        #[test]
        fn random_records_never_panic_and_every_record_is_accounted(records in prop::collection::vec(arbitrary_record(), 0..64)) {
            let mut decoder = Decoder::new(&records);
            let mut seen = 0;
            while let Some((item, len)) = decoder.next_with_len() {
                prop_assert!(len >= 1);
                seen += len;
                if let Ok(Item::SpanNew { fields, .. } | Item::Event { fields, .. } | Item::SpanRecord { fields, .. } | Item::GpuBegin { fields, .. }) = item {
                    let mut out = Vec::new();
                    fields.bytes_into(&mut out);
                    prop_assert_eq!(out.len(), fields.len());
                    let _ = decode_fields(&out).count();
                }
            }
            prop_assert_eq!(seen, records.len());
        }

        #[test]
        fn valid_streams_cut_anywhere_decode_their_whole_groups(cut in 0usize..40, payload in prop::collection::vec(any::<u8>(), 0..60)) {
            let mut stream = Vec::new();
            let mut out = Vec::new();
            for i in 0..4u64 {
                encode_event(&mut out, i, 0x100 + i, Parent::Contextual, &payload);
                stream.extend_from_slice(&out);
                stream.push(Record::timed(Kind::SpanEnter, i, i));
            }
            let cut = cut.min(stream.len());
            let whole = Decoder::new(&stream[..cut]).filter(|i| i.is_ok()).count();
            let mut expected = 0;
            let mut pos = 0;
            for _ in 0..4 {
                let group = 2 + payload_records(payload.len());
                if pos + group <= cut { expected += 1; }
                pos += group;
                if pos < cut { expected += 1; }
                pos += 1;
            }
            prop_assert_eq!(whole, expected);
        }
    }
}
