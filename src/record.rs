//! The 16-byte raw record the hot path writes, and the field payload format.
//!
//! A record is two words. Word 0 holds the record's kind in its top 4 bits and the low 60 bits of the raw
//! tick; the collector restores the top bits from the current tick (60 bits of a 5 GHz counter last 7 years,
//! so the nearest match is unambiguous). Word 1 is the kind's payload: a span id, or the address of a
//! `'static` callsite (tracing's `Metadata` or a native [`scope!`](macro@crate::scope) callsite), so the hot path copies a
//! word and never looks up or interns anything.
//!
//! Records that carry fields (span creation with field values, `record`, events) are followed in the same ring
//! by a payload header `[len_bytes, metadata address]` and `ceil(len / 16)` data records holding the encoded
//! fields. The producer pushes the whole group or nothing, so the ring itself is the per-thread side buffer
//! and a group is never torn. A span created without field values is announced in one record
//! ([`Kind::SpanNewBare`]): it needs no timestamp, so word 0 carries the metadata address instead.

use std::fmt::{self, Write as _};

/// One raw record: 16 bytes, `Copy`, written by one thread, read by the collector.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C, align(16))]
pub(crate) struct Record {
    pub(crate) word0: u64,
    pub(crate) word1: u64,
}

const _: () = assert!(std::mem::size_of::<Record>() == 16);

pub(crate) const TICK_BITS: u32 = 60;
pub(crate) const TICK_MASK: u64 = (1 << TICK_BITS) - 1;

/// What a record means. Stored in the top 4 bits of word 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// Word 1: span id. A payload group follows (metadata address + fields).
    SpanNew = 1,
    /// Word 1: span id. A payload group follows (fields recorded later).
    SpanRecord = 2,
    /// Word 1: span id.
    SpanEnter = 3,
    /// Word 1: span id.
    SpanExit = 4,
    /// Word 1: span id.
    SpanClose = 5,
    /// Word 1: metadata address. A payload group follows (fields).
    Event = 6,
    /// Word 1: native callsite address.
    ScopeBegin = 7,
    /// Word 1: native callsite address.
    ScopeEnd = 8,
    /// Word 1: native callsite address.
    Instant = 9,
    /// Word 1: native callsite address. One data record follows with the f64 value's bits in word 0.
    Counter = 10,
    /// Word 1: native callsite address. A payload group follows: header `[len, scope key]` (device, queue,
    /// timestamp pair; see `gpu::scope_key`) and the encoded fields.
    GpuBegin = 11,
    /// A span created without field values, announced in one record: untimed, so word 0's tick bits hold the
    /// span's `'static` metadata address ([`Record::span_new_bare`]). Word 1: span id. No payload follows.
    SpanNewBare = 12,
    /// A payload header or data record (never first in a group).
    Data = 15,
}

impl Kind {
    fn from_bits(bits: u8) -> Option<Kind> {
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
            12 => Kind::SpanNewBare,
            15 => Kind::Data,
            _ => return None,
        })
    }
}

impl Record {
    #[inline(always)]
    pub(crate) fn new(kind: Kind, ticks: u64, payload: u64) -> Record {
        Record {
            word0: ((kind as u64) << TICK_BITS) | (ticks & TICK_MASK),
            word1: payload,
        }
    }

    #[inline]
    pub(crate) fn kind(&self) -> Option<Kind> {
        Kind::from_bits((self.word0 >> TICK_BITS) as u8)
    }

    /// The one-record announcement of span `id`, created without field values, with the metadata at address
    /// `meta`; `None` if the address does not fit the 60 tick bits (user-space addresses on x86_64 and
    /// aarch64 Linux have at most 48 bits, 57 with 5-level paging), for which the caller sends the group.
    #[inline(always)]
    pub(crate) fn span_new_bare(meta: u64, id: u64) -> Option<Record> {
        (meta <= TICK_MASK).then(|| Record::new(Kind::SpanNewBare, meta, id))
    }

    /// The low 60 bits of the tick.
    #[inline]
    pub(crate) fn ticks_low(&self) -> u64 {
        self.word0 & TICK_MASK
    }

    /// How many records a payload of `len` bytes needs after its header.
    #[inline]
    pub(crate) fn data_records(len: usize) -> usize {
        len.div_ceil(16)
    }
}

/// Restores a 60-bit tick to 64 bits: the value with those low bits nearest to (and not far after) `now`.
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

/// Encodes fields into a byte payload: per field `[field index u8][tag u8][value]`.
pub(crate) struct FieldEncoder<'a> {
    pub(crate) buf: &'a mut Vec<u8>,
}

pub(crate) const TAG_I64: u8 = 0;
pub(crate) const TAG_U64: u8 = 1;
pub(crate) const TAG_F64: u8 = 2;
pub(crate) const TAG_BOOL: u8 = 3;
pub(crate) const TAG_STR: u8 = 4;

/// Longest string value kept, in bytes; longer ones are cut at a char boundary and end in "…".
pub(crate) const MAX_STR: usize = 4096;

impl FieldEncoder<'_> {
    #[inline]
    pub(crate) fn i64(&mut self, index: u8, v: i64) {
        self.buf.extend_from_slice(&[index, TAG_I64]);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    pub(crate) fn u64(&mut self, index: u8, v: u64) {
        self.buf.extend_from_slice(&[index, TAG_U64]);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    #[inline]
    pub(crate) fn f64(&mut self, index: u8, v: f64) {
        self.buf.extend_from_slice(&[index, TAG_F64]);
        self.buf.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    #[inline]
    pub(crate) fn bool(&mut self, index: u8, v: bool) {
        self.buf.extend_from_slice(&[index, TAG_BOOL, v as u8]);
    }
    pub(crate) fn str(&mut self, index: u8, v: &str) {
        let mut cut = v.len().min(MAX_STR);
        while !v.is_char_boundary(cut) {
            cut -= 1;
        }
        let truncated = cut < v.len();
        let len = cut + if truncated { '…'.len_utf8() } else { 0 };
        self.buf.extend_from_slice(&[index, TAG_STR]);
        self.buf.extend_from_slice(&(len as u16).to_le_bytes());
        self.buf.extend_from_slice(&v.as_bytes()[..cut]);
        if truncated {
            self.buf.extend_from_slice("…".as_bytes());
        }
    }
    /// Formats a `Debug` value as a string field without a temporary allocation.
    pub(crate) fn debug(&mut self, index: u8, v: &dyn fmt::Debug) {
        self.buf.extend_from_slice(&[index, TAG_STR, 0, 0]);
        let start = self.buf.len();
        let mut w = BoundedWriter {
            buf: self.buf,
            start,
            truncated: false,
        };
        let _ = write!(w, "{v:?}");
        let len = self.buf.len() - start;
        self.buf[start - 2..start].copy_from_slice(&(len as u16).to_le_bytes());
    }
}

struct BoundedWriter<'a> {
    buf: &'a mut Vec<u8>,
    start: usize,
    truncated: bool,
}

impl fmt::Write for BoundedWriter<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if self.truncated {
            return Ok(());
        }
        let room = MAX_STR - (self.buf.len() - self.start);
        if s.len() <= room {
            self.buf.extend_from_slice(s.as_bytes());
            return Ok(());
        }
        let mut cut = room;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        self.buf.extend_from_slice(&s.as_bytes()[..cut]);
        self.buf.extend_from_slice("…".as_bytes());
        self.truncated = true;
        Ok(())
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
}

/// Iterates the `(field index, value)` pairs of a payload. Stops at the first malformed entry.
pub(crate) fn decode_fields(mut bytes: &[u8]) -> impl Iterator<Item = (u8, RawValue<'_>)> {
    std::iter::from_fn(move || {
        let (&index, rest) = bytes.split_first()?;
        let (&tag, rest) = rest.split_first()?;
        let take8 = |r: &[u8]| -> Option<([u8; 8], usize)> { Some((r.get(..8)?.try_into().ok()?, 8)) };
        let (value, used) = match tag {
            TAG_I64 => take8(rest).map(|(b, n)| (RawValue::I64(i64::from_le_bytes(b)), n))?,
            TAG_U64 => take8(rest).map(|(b, n)| (RawValue::U64(u64::from_le_bytes(b)), n))?,
            TAG_F64 => take8(rest).map(|(b, n)| (RawValue::F64(f64::from_bits(u64::from_le_bytes(b))), n))?,
            TAG_BOOL => (RawValue::Bool(*rest.first()? != 0), 1),
            TAG_STR => {
                let len = u16::from_le_bytes(rest.get(..2)?.try_into().ok()?) as usize;
                let s = std::str::from_utf8(rest.get(2..2 + len)?).ok()?;
                (RawValue::Str(s), 2 + len)
            }
            _ => return None,
        };
        bytes = &rest[used..];
        Some((index, value))
    })
}

/// Splits a payload into data records (the last one zero-padded).
pub(crate) fn payload_records(payload: &[u8]) -> impl Iterator<Item = Record> + '_ {
    payload.chunks(16).map(|chunk| {
        let mut bytes = [0u8; 16];
        bytes[..chunk.len()].copy_from_slice(chunk);
        Record {
            word0: u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")),
            word1: u64::from_le_bytes(bytes[8..].try_into().expect("8 bytes")),
        }
    })
}

/// Joins data records back into payload bytes.
pub(crate) fn collect_payload(records: &[Record], len: usize, out: &mut Vec<u8>) {
    out.clear();
    for r in records {
        out.extend_from_slice(&r.word0.to_le_bytes());
        out.extend_from_slice(&r.word1.to_le_bytes());
    }
    out.truncate(len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_and_ticks_round_trip() {
        let r = Record::new(Kind::SpanEnter, 0xABCD_0123_4567_89EF, 42);
        assert_eq!(r.kind(), Some(Kind::SpanEnter));
        assert_eq!(r.ticks_low(), 0xABCD_0123_4567_89EF & TICK_MASK);
        assert_eq!(r.word1, 42);
        assert_eq!(Record::default().kind(), None);
    }

    #[test]
    fn bare_span_announcement_carries_the_metadata_address() {
        let meta = 0x7fff_1234_5670u64;
        let r = Record::span_new_bare(meta, 7).expect("a 47-bit address fits");
        assert_eq!(r.kind(), Some(Kind::SpanNewBare));
        assert_eq!((r.ticks_low(), r.word1), (meta, 7));
        assert_eq!(
            Record::span_new_bare(TICK_MASK, 1).map(|r| r.ticks_low()),
            Some(TICK_MASK)
        );
        assert_eq!(Record::span_new_bare(TICK_MASK + 1, 1), None);
    }

    #[test]
    fn restore_ticks_near_now() {
        let now = 0xF000_0000_0000_1000u64;
        for back in [0u64, 1, 1_000, 1 << 40] {
            let t = now - back;
            assert_eq!(restore_ticks(t & TICK_MASK, now), t);
        }
        // Slightly ahead of `now` (another CPU read its counter after the collector did).
        assert_eq!(restore_ticks((now + 5) & TICK_MASK, now), now + 5);
        // Across the 60-bit boundary.
        let now = (1u64 << 60) + 10;
        assert_eq!(restore_ticks(((1u64 << 60) - 5) & TICK_MASK, now), (1u64 << 60) - 5);
    }

    #[test]
    fn fields_round_trip_through_records() {
        let mut buf = Vec::new();
        let mut enc = FieldEncoder { buf: &mut buf };
        enc.i64(0, -5);
        enc.u64(1, u64::MAX);
        enc.f64(2, 1.5);
        enc.bool(3, true);
        enc.str(4, "héllo");
        enc.debug(5, &Some(3));
        let records: Vec<Record> = payload_records(&buf).collect();
        assert_eq!(records.len(), Record::data_records(buf.len()));
        let mut back = Vec::new();
        collect_payload(&records, buf.len(), &mut back);
        let fields: Vec<_> = decode_fields(&back).collect();
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
    }

    #[test]
    fn long_strings_are_cut_at_a_char_boundary() {
        let long = "é".repeat(MAX_STR);
        let mut buf = Vec::new();
        FieldEncoder { buf: &mut buf }.str(0, &long);
        FieldEncoder { buf: &mut buf }.debug(1, &long);
        let fields: Vec<_> = decode_fields(&buf).collect();
        assert_eq!(fields.len(), 2);
        for (_, v) in fields {
            let RawValue::Str(s) = v else { panic!("{v:?}") };
            assert!(s.ends_with('…') && s.len() <= MAX_STR + 3, "{}", s.len());
        }
    }

    #[test]
    fn malformed_payload_stops_decoding() {
        assert_eq!(decode_fields(&[0, TAG_I64, 1, 2]).count(), 0);
        assert_eq!(decode_fields(&[0, 99]).count(), 0);
        assert_eq!(decode_fields(&[0, TAG_STR, 10, 0, b'a']).count(), 0);
    }
}
