//! tickline-perfetto: writes a tickline timeline as a Perfetto trace file (open it at ui.perfetto.dev).
//!
//! A streaming writer of `TracePacket`s on one packet sequence: a clock snapshot first, then track
//! descriptors, interned names and track events, in the order the collector hands them over. Packets are
//! encoded by hand with `prost::encoding` into reused buffers (no allocation per event in steady state) and
//! written to the file in whole packets, so a trace cut short by a crash still loads up to its last packet.
//!
//! # Clocks
//!
//! tickline converts every timestamp itself to `CLOCK_MONOTONIC` ns; this exporter writes them in
//! `CLOCK_BOOTTIME` ns, Perfetto's default trace clock, by adding the BOOTTIME−MONOTONIC offset (the time spent
//! suspended). A clock snapshot of BOOTTIME, MONOTONIC and REALTIME comes first in the file, and a new one
//! after a suspend changes the offset, so the trace lines up with a Perfetto system trace of the same machine.
//!
//! # Caveats
//!
//! Perfetto's importer silently drops a packed `flow_ids`, so flow ids are written unpacked. Track uuids are
//! the timeline's track ids salted with the process id, unique within one trace file.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use prost::encoding::{encode_key, encode_varint, WireType};
use tickline::{Batch, Event, EventKind, ExportError, Exporter, FieldValue, TrackDescriptor, TrackKind};

/// The one packet sequence this writer emits.
const SEQUENCE_ID: u64 = 1;
const SEQ_INCREMENTAL_STATE_CLEARED: u64 = 1;
const SEQ_NEEDS_INCREMENTAL_STATE: u64 = 2;
const CLOCK_REALTIME: u64 = 1;
const CLOCK_MONOTONIC: u64 = 3;
const CLOCK_BOOTTIME: u64 = 6;
/// Write the buffer out when it holds this much: big writes, bounded memory.
const FLUSH_AT_BYTES: usize = 1 << 20;
/// A suspend shorter than this does not warrant a new clock snapshot.
const SNAPSHOT_TOLERANCE_NS: i64 = 1_000_000;

// Field numbers, from Perfetto's protos/perfetto/trace/*.proto.
mod field {
    pub const TRACE_PACKET: u32 = 1;
    pub mod packet {
        pub const CLOCK_SNAPSHOT: u32 = 6;
        pub const TIMESTAMP: u32 = 8;
        pub const TRUSTED_PACKET_SEQUENCE_ID: u32 = 10;
        pub const TRACK_EVENT: u32 = 11;
        pub const INTERNED_DATA: u32 = 12;
        pub const SEQUENCE_FLAGS: u32 = 13;
        pub const TRACK_DESCRIPTOR: u32 = 60;
    }
    pub mod snapshot {
        pub const CLOCKS: u32 = 1;
        pub const PRIMARY_TRACE_CLOCK: u32 = 2;
        pub const CLOCK_ID: u32 = 1;
        pub const TIMESTAMP: u32 = 2;
    }
    pub mod event {
        pub const DEBUG_ANNOTATIONS: u32 = 4;
        pub const TYPE: u32 = 9;
        pub const NAME_IID: u32 = 10;
        pub const TRACK_UUID: u32 = 11;
        pub const DOUBLE_COUNTER_VALUE: u32 = 44;
        pub const FLOW_IDS: u32 = 47;
        pub const TERMINATING_FLOW_IDS: u32 = 48;
        pub const TYPE_SLICE_BEGIN: u64 = 1;
        pub const TYPE_SLICE_END: u64 = 2;
        pub const TYPE_INSTANT: u64 = 3;
        pub const TYPE_COUNTER: u64 = 4;
    }
    pub mod annotation {
        pub const NAME_IID: u32 = 1;
        pub const BOOL_VALUE: u32 = 2;
        pub const UINT_VALUE: u32 = 3;
        pub const INT_VALUE: u32 = 4;
        pub const DOUBLE_VALUE: u32 = 5;
        pub const STRING_VALUE: u32 = 6;
    }
    pub mod interned {
        pub const EVENT_NAMES: u32 = 2;
        pub const DEBUG_ANNOTATION_NAMES: u32 = 3;
        pub const IID: u32 = 1;
        pub const NAME: u32 = 2;
    }
    pub mod track {
        pub const UUID: u32 = 1;
        pub const NAME: u32 = 2;
        pub const PROCESS: u32 = 3;
        pub const THREAD: u32 = 4;
        pub const PARENT_UUID: u32 = 5;
        pub const COUNTER: u32 = 8;
        pub const PID: u32 = 1;
        pub const PROCESS_NAME: u32 = 6;
        pub const TID: u32 = 2;
        pub const THREAD_NAME: u32 = 5;
        pub const UNIT_NAME: u32 = 6;
    }
}

/// Counts of what was written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerfettoStats {
    /// `TracePacket`s encoded.
    pub packets: u64,
    /// Bytes handed to the writer.
    pub bytes_written: u64,
    /// Clock snapshots written (one at start, one after each suspend).
    pub clock_snapshots: u64,
}

/// An [`Exporter`] writing a Perfetto trace.
///
/// ```
/// let path = std::env::temp_dir().join("tickline-doc-example.pftrace");
/// let exporter = tickline_perfetto::PerfettoExporter::create(&path).unwrap();
/// let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
/// {
///     let _s = tickline::scope!("work");
/// }
/// timeline.shutdown().unwrap();
/// assert!(std::fs::metadata(&path).unwrap().len() > 0);
/// ```
pub struct PerfettoExporter<W: Write + Send = File> {
    writer: W,
    path: Option<PathBuf>,
    buf: Vec<u8>,
    packet: Vec<u8>,
    body: Vec<u8>,
    nested: Vec<u8>,
    uuid_salt: u64,
    boot_offset_ns: i64,
    started: bool,
    failed: Option<(std::io::ErrorKind, String)>,
    stats: PerfettoStats,
}

impl<W: Write + Send> std::fmt::Debug for PerfettoExporter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerfettoExporter")
            .field("path", &self.path)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PerfettoExporter<File> {
    /// Creates (or truncates) the trace file at `path`.
    pub fn create(path: impl AsRef<Path>) -> Result<Self, ExportError> {
        let path = path.as_ref();
        let file = File::create(path).map_err(|e| {
            ExportError::Io(std::io::Error::new(
                e.kind(),
                format!("cannot create trace file {}: {e}", path.display()),
            ))
        })?;
        let mut exporter = PerfettoExporter::new(file);
        exporter.path = Some(path.to_owned());
        Ok(exporter)
    }
}

fn clock_ns(clock: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec and the clock ids used here exist on every Linux kernel
    // tickline supports; on failure `ts` stays zero.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    // `time_t` and `c_long` are i64 on 64-bit Linux but i32 on 32-bit targets: keep the casts.
    #[allow(clippy::unnecessary_cast)]
    let ns = ts.tv_sec as i64 * 1_000_000_000 + ts.tv_nsec as i64;
    ns
}

/// `(BOOTTIME, MONOTONIC, REALTIME)` now, MONOTONIC read between the others.
fn read_clocks() -> (i64, i64, i64) {
    let boot = clock_ns(libc::CLOCK_BOOTTIME);
    let mono = clock_ns(libc::CLOCK_MONOTONIC);
    let real = clock_ns(libc::CLOCK_REALTIME);
    (boot, mono, real)
}

fn put_varint_field(buf: &mut Vec<u8>, tag: u32, value: u64) {
    encode_key(tag, WireType::Varint, buf);
    encode_varint(value, buf);
}

fn put_bytes_field(buf: &mut Vec<u8>, tag: u32, bytes: &[u8]) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(bytes.len() as u64, buf);
    buf.extend_from_slice(bytes);
}

fn put_fixed64_field(buf: &mut Vec<u8>, tag: u32, value: u64) {
    encode_key(tag, WireType::SixtyFourBit, buf);
    buf.extend_from_slice(&value.to_le_bytes());
}

/// Writes `value` as a varint at `b[pos..]`, returning the position after it. At most 10 bytes.
#[inline(always)]
fn put_varint(b: &mut [u8; 64], mut pos: usize, mut value: u64) -> usize {
    while value >= 0x80 {
        b[pos] = (value as u8) | 0x80;
        value >>= 7;
        pos += 1;
    }
    b[pos] = value as u8;
    pos + 1
}

/// Fills in the one-byte length placeholder just before `body_start` with the length of everything after
/// it, widening the varint in place when the body is 128 bytes or more.
#[inline]
fn patch_length(buf: &mut Vec<u8>, body_start: usize) {
    let len = buf.len() - body_start;
    if len < 0x80 {
        buf[body_start - 1] = len as u8;
        return;
    }
    let mut prefix = Vec::with_capacity(10);
    encode_varint(len as u64, &mut prefix);
    buf.splice(body_start - 1..body_start, prefix);
}

impl<W: Write + Send> PerfettoExporter<W> {
    /// A writer of a Perfetto trace to `writer` (a file, a `Vec<u8>`, a socket).
    pub fn new(writer: W) -> Self {
        PerfettoExporter {
            writer,
            path: None,
            buf: Vec::with_capacity(FLUSH_AT_BYTES + 4096),
            packet: Vec::with_capacity(256),
            body: Vec::with_capacity(256),
            nested: Vec::with_capacity(256),
            uuid_salt: (std::process::id() as u64) << 32,
            boot_offset_ns: 0,
            started: false,
            failed: None,
            stats: PerfettoStats::default(),
        }
    }

    /// What was written so far.
    pub fn stats(&self) -> PerfettoStats {
        self.stats
    }

    /// Flushes and returns the writer.
    pub fn into_inner(mut self) -> Result<W, ExportError> {
        self.flush()?;
        Ok(self.writer)
    }

    fn uuid(&self, track: tickline::TrackId) -> u64 {
        self.uuid_salt | track.0
    }

    /// Frames `self.packet` as one `Trace.packet` in the output buffer.
    fn commit_packet(&mut self) {
        put_bytes_field(&mut self.buf, field::TRACE_PACKET, &self.packet);
        self.packet.clear();
        self.stats.packets += 1;
    }

    fn write_clock_snapshot(&mut self, first: bool) {
        let (boot, mono, real) = read_clocks();
        self.boot_offset_ns = boot - mono;
        self.body.clear();
        for (id, ts) in [(CLOCK_BOOTTIME, boot), (CLOCK_MONOTONIC, mono), (CLOCK_REALTIME, real)] {
            self.nested.clear();
            put_varint_field(&mut self.nested, field::snapshot::CLOCK_ID, id);
            put_varint_field(&mut self.nested, field::snapshot::TIMESTAMP, ts as u64);
            put_bytes_field(&mut self.body, field::snapshot::CLOCKS, &self.nested);
        }
        put_varint_field(&mut self.body, field::snapshot::PRIMARY_TRACE_CLOCK, CLOCK_BOOTTIME);
        put_varint_field(&mut self.packet, field::packet::TIMESTAMP, boot as u64);
        put_bytes_field(&mut self.packet, field::packet::CLOCK_SNAPSHOT, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        if first {
            put_varint_field(
                &mut self.packet,
                field::packet::SEQUENCE_FLAGS,
                SEQ_INCREMENTAL_STATE_CLEARED,
            );
        }
        self.commit_packet();
        self.stats.clock_snapshots += 1;
    }

    fn write_track(&mut self, track: &TrackDescriptor) {
        self.body.clear();
        let (uuid, parent) = (self.uuid(track.id), track.parent.map(|p| self.uuid(p)));
        put_varint_field(&mut self.body, field::track::UUID, uuid);
        if let Some(parent) = parent {
            put_varint_field(&mut self.body, field::track::PARENT_UUID, parent);
        }
        self.nested.clear();
        match &track.kind {
            TrackKind::Process { pid, name } => {
                put_varint_field(&mut self.nested, field::track::PID, *pid as u64);
                put_bytes_field(&mut self.nested, field::track::PROCESS_NAME, name.as_bytes());
                put_bytes_field(&mut self.body, field::track::PROCESS, &self.nested);
            }
            TrackKind::Thread { pid, tid, name } => {
                put_varint_field(&mut self.nested, field::track::PID, *pid as u64);
                put_varint_field(&mut self.nested, field::track::TID, *tid as u64);
                put_bytes_field(&mut self.nested, field::track::THREAD_NAME, name.as_bytes());
                put_bytes_field(&mut self.body, field::track::THREAD, &self.nested);
            }
            TrackKind::Counter { name, unit } => {
                put_bytes_field(&mut self.body, field::track::NAME, name.as_bytes());
                if !unit.is_empty() {
                    put_bytes_field(&mut self.nested, field::track::UNIT_NAME, unit.as_bytes());
                }
                put_bytes_field(&mut self.body, field::track::COUNTER, &self.nested);
            }
            TrackKind::Group { name } => {
                put_bytes_field(&mut self.body, field::track::NAME, name.as_bytes());
            }
            other => {
                // A kind this exporter does not know yet still gets a named track.
                put_bytes_field(&mut self.body, field::track::NAME, format!("{other:?}").as_bytes());
            }
        }
        put_bytes_field(&mut self.packet, field::packet::TRACK_DESCRIPTOR, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        self.commit_packet();
    }

    /// Interns names for both event names and debug annotation names (the same iid serves both tables).
    fn write_interned(&mut self, names: &[(tickline::NameId, String)]) {
        if names.is_empty() {
            return;
        }
        self.body.clear();
        for table in [field::interned::EVENT_NAMES, field::interned::DEBUG_ANNOTATION_NAMES] {
            for (id, name) in names {
                self.nested.clear();
                put_varint_field(&mut self.nested, field::interned::IID, id.0 as u64);
                put_bytes_field(&mut self.nested, field::interned::NAME, name.as_bytes());
                put_bytes_field(&mut self.body, table, &self.nested);
            }
        }
        put_bytes_field(&mut self.packet, field::packet::INTERNED_DATA, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        put_varint_field(
            &mut self.packet,
            field::packet::SEQUENCE_FLAGS,
            SEQ_NEEDS_INCREMENTAL_STATE,
        );
        self.commit_packet();
    }

    /// The hot path: an event with no fields and no flows (most slice ends, most begins, every counter)
    /// is assembled on the stack with hand-rolled varints and appended in one copy.
    #[inline]
    fn write_plain_event(&mut self, event: &Event) {
        let mut b = [0u8; 64];
        // b[0] = Trace.packet key, b[1] = packet length, then the packet body from b[2].
        b[0] = 0x0a; // field 1, length-delimited
        let ts = (event.ts_ns as i64).saturating_add(self.boot_offset_ns).max(0) as u64;
        b[2] = 0x40; // TracePacket.timestamp (8), varint
        let mut pos = put_varint(&mut b, 3, ts);
        b[pos] = 0x5a; // TracePacket.track_event (11), length-delimited
        let event_len_at = pos + 1;
        pos += 2;
        let event_start = pos;
        b[pos] = 0x48; // TrackEvent.type (9)
        b[pos + 1] = match event.kind {
            EventKind::SliceBegin => field::event::TYPE_SLICE_BEGIN,
            EventKind::SliceEnd => field::event::TYPE_SLICE_END,
            EventKind::Instant => field::event::TYPE_INSTANT,
            EventKind::Counter(_) => field::event::TYPE_COUNTER,
        } as u8;
        b[pos + 2] = 0x58; // TrackEvent.track_uuid (11)
        pos = put_varint(&mut b, pos + 3, self.uuid_salt | event.track.0);
        match event.kind {
            EventKind::SliceBegin | EventKind::Instant => {
                b[pos] = 0x50; // TrackEvent.name_iid (10)
                pos = put_varint(&mut b, pos + 1, event.name.0 as u64);
            }
            EventKind::Counter(value) => {
                // TrackEvent.double_counter_value (44), fixed64: key 44 << 3 | 1 = 353 = varint [0xe1, 0x02].
                b[pos] = 0xe1;
                b[pos + 1] = 0x02;
                b[pos + 2..pos + 10].copy_from_slice(&value.to_bits().to_le_bytes());
                pos += 10;
            }
            EventKind::SliceEnd => {}
        }
        b[event_len_at] = (pos - event_start) as u8;
        // trusted_packet_sequence_id (10) = 1, sequence_flags (13) = SEQ_NEEDS_INCREMENTAL_STATE.
        b[pos..pos + 4].copy_from_slice(&[0x50, SEQUENCE_ID as u8, 0x68, SEQ_NEEDS_INCREMENTAL_STATE as u8]);
        pos += 4;
        b[1] = (pos - 2) as u8;
        self.buf.extend_from_slice(&b[..pos]);
        self.stats.packets += 1;
    }

    fn write_event(&mut self, batch: &Batch, event: &Event) {
        if event.fields.is_empty() && event.flow_out.is_none() && event.flow_in.is_none() {
            return self.write_plain_event(event);
        }
        // Encoded straight into the output buffer: `Trace.packet { timestamp, track_event { .. }, sequence id,
        // flags }`. Both length prefixes get one byte up front, the common case (a packet under 128 bytes);
        // a longer one is widened in place after the fact.
        let buf = &mut self.buf;
        let packet_start = buf.len();
        encode_key(field::TRACE_PACKET, WireType::LengthDelimited, buf);
        buf.push(0);
        let packet_body = buf.len();
        let ts = (event.ts_ns as i64).saturating_add(self.boot_offset_ns).max(0) as u64;
        put_varint_field(buf, field::packet::TIMESTAMP, ts);
        encode_key(field::packet::TRACK_EVENT, WireType::LengthDelimited, buf);
        buf.push(0);
        let event_body = buf.len();
        let kind = match event.kind {
            EventKind::SliceBegin => field::event::TYPE_SLICE_BEGIN,
            EventKind::SliceEnd => field::event::TYPE_SLICE_END,
            EventKind::Instant => field::event::TYPE_INSTANT,
            EventKind::Counter(_) => field::event::TYPE_COUNTER,
        };
        put_varint_field(buf, field::event::TYPE, kind);
        put_varint_field(buf, field::event::TRACK_UUID, self.uuid_salt | event.track.0);
        match event.kind {
            EventKind::SliceBegin | EventKind::Instant => {
                put_varint_field(buf, field::event::NAME_IID, event.name.0 as u64);
            }
            EventKind::Counter(value) => {
                put_fixed64_field(buf, field::event::DOUBLE_COUNTER_VALUE, value.to_bits());
            }
            EventKind::SliceEnd => {}
        }
        for f in batch.fields_of(event) {
            let nested = &mut self.nested;
            nested.clear();
            put_varint_field(nested, field::annotation::NAME_IID, f.name.0 as u64);
            match &f.value {
                FieldValue::Bool(v) => put_varint_field(nested, field::annotation::BOOL_VALUE, *v as u64),
                FieldValue::U64(v) => put_varint_field(nested, field::annotation::UINT_VALUE, *v),
                FieldValue::I64(v) => put_varint_field(nested, field::annotation::INT_VALUE, *v as u64),
                FieldValue::F64(v) => put_fixed64_field(nested, field::annotation::DOUBLE_VALUE, v.to_bits()),
                FieldValue::Str(s) => put_bytes_field(nested, field::annotation::STRING_VALUE, s.as_bytes()),
            }
            put_bytes_field(buf, field::event::DEBUG_ANNOTATIONS, nested);
        }
        // Unpacked, one key per id: Perfetto's importer drops packed flow ids without a word.
        if let Some(flow) = event.flow_out {
            put_fixed64_field(buf, field::event::FLOW_IDS, flow);
        }
        if let Some(flow) = event.flow_in {
            put_fixed64_field(buf, field::event::TERMINATING_FLOW_IDS, flow);
        }
        patch_length(buf, event_body);
        put_varint_field(buf, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        put_varint_field(buf, field::packet::SEQUENCE_FLAGS, SEQ_NEEDS_INCREMENTAL_STATE);
        patch_length(buf, packet_body);
        debug_assert!(buf.len() > packet_start);
        self.stats.packets += 1;
    }

    fn check_failed(&self) -> Result<(), ExportError> {
        match &self.failed {
            Some((kind, message)) => Err(ExportError::Io(std::io::Error::new(*kind, message.clone()))),
            None => Ok(()),
        }
    }

    fn write_out(&mut self) -> Result<(), ExportError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        if let Err(e) = self.writer.write_all(&self.buf) {
            let target = self
                .path
                .as_ref()
                .map_or_else(|| "the trace writer".to_owned(), |p| p.display().to_string());
            let message = format!("writing Perfetto trace to {target}: {e}");
            self.failed = Some((e.kind(), message.clone()));
            self.buf.clear();
            return Err(ExportError::Io(std::io::Error::new(e.kind(), message)));
        }
        self.stats.bytes_written += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }
}

impl<W: Write + Send> Exporter for PerfettoExporter<W> {
    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        self.check_failed()?;
        if !self.started {
            self.write_clock_snapshot(true);
            self.started = true;
        }
        for track in &batch.new_tracks {
            self.write_track(track);
        }
        self.write_interned(&batch.new_names);
        for event in &batch.events {
            self.write_event(batch, event);
            if self.buf.len() >= FLUSH_AT_BYTES {
                self.write_out()?;
            }
        }
        // Facts about tracks (the CPU clock decision on the process track): an instant carrying them.
        for m in &batch.metadata {
            let event = Event {
                ts_ns: m.ts_ns,
                track: m.track,
                kind: EventKind::Instant,
                name: m.name,
                fields: m.fields.clone(),
                flow_out: None,
                flow_in: None,
            };
            self.write_event(batch, &event);
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        self.check_failed()?;
        if !self.started {
            self.write_clock_snapshot(true);
            self.started = true;
        } else {
            // A suspend since the last snapshot moves BOOTTIME against MONOTONIC: record it.
            let (boot, mono, _) = read_clocks();
            if ((boot - mono) - self.boot_offset_ns).abs() > SNAPSHOT_TOLERANCE_NS {
                self.write_clock_snapshot(false);
            }
        }
        self.write_out()?;
        if let Err(e) = self.writer.flush() {
            let message = format!("flushing Perfetto trace: {e}");
            self.failed = Some((e.kind(), message.clone()));
            return Err(ExportError::Io(std::io::Error::new(e.kind(), message)));
        }
        Ok(())
    }
}
