//! tickline-perfetto: writes a tickline timeline as a Perfetto trace file (open it at ui.perfetto.dev).
//!
//! A streaming writer of `TracePacket`s: a clock snapshot first, then track descriptors, interned names and
//! track events, in the order the collector hands them over, on one packet sequence (threads' track descriptors
//! on a second one that holds nothing else, so that Perfetto names no thread on a GPU queue's or a task's
//! slices). Packets are
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
//! Clock snapshots of BOOTTIME, MONOTONIC, MONOTONIC_RAW and REALTIME, each read inside one tight bracket,
//! are written at the start, every [`snapshot_interval`](PerfettoExporter::snapshot_interval) (2 s by
//! default) and at the end, so `tickline merge` can follow this host's clocks between them.
//!
//! # A trace that says where it came from
//!
//! Besides the timeline, a trace holds what merging it with other processes' and hosts' traces needs, in
//! Perfetto's own fields where they exist: a `TraceUuid` packet, a `SystemInfo` packet (`uname`, CPUs, page
//! size), the process track's `process_labels` (`host=...`, `machine=...`), and the periodic
//! `ClockSnapshot`s. What Perfetto has no field for sits on a track named `tickline clock` as instants with
//! debug annotations (visible in the UI, and read back by `tickline merge`):
//!
//! - `tickline trace` (once): `trace_uuid`, `recording_id` (the recording the trace was made of: the same in
//!   a trace written live and one converted from its capture), `machine_id` (16 hex digits),
//!   `machine_id_source`, `boot_id`, `host`, `pid`, `process`, `tickline_version`;
//! - `tickline clock snapshot` (with every `ClockSnapshot`): `boottime_ns`, `monotonic_ns`,
//!   `monotonic_raw_ns`, `realtime_ns`, `bracket_ns`, and the kernel's time-sync state `sync_synchronized`,
//!   `sync_est_error_ns`, `sync_max_error_ns`, `sync_status`;
//! - `tickline clock exchange` (one per round of a [`ClockExchange`], on a child track per peer): `role`,
//!   `client_machine`, `server_machine`, `burst`, `t1_ns` .. `t4_ns`.
//!
//! These are written by the collector thread as it exports, a few packets per second: nothing on the
//! application's hot path.
//!
//! # Durability
//!
//! Packets are written to the file whole, at the latest every [`flush_interval`](PerfettoExporter::flush_interval)
//! (500 ms by default) while the timeline exports (it calls [`Exporter::export`] at least every ~100 ms, with
//! an empty batch when idle), so a killed process loses at most about its last 0.6 s; the first export writes
//! out at once, so a process killed in its first moments leaves a trace that loads; a file cut at any byte
//! still loads up to its last whole packet.
//!
//! # Flows between spans
//!
//! A span or event with a [`FLOW_OUT_FIELD`] field (`tickline.flow_out = ID`, an integer or a string) starts a
//! flow that ends at the next span or event written with a [`FLOW_IN_FIELD`] field (`tickline.flow_in = ID`)
//! of the same value, whichever is written first (a sender span still open while its receiver ends is
//! written after it): one sender, one receiver per ID in a trace (a later receiver of the same ID, or one
//! whose sender is not in the trace, is left unlinked; the first receiver of an ID whose sender is not in
//! the trace still ends a flow of that ID, which Perfetto ignores). `tickline merge` links the senders and receivers of
//! every trace it merges, each receiver to its sender, across processes and machines.
//!
//! ```
//! use tracing_subscriber::layer::SubscriberExt;
//! # let path = std::env::temp_dir().join(format!("tickline-flow-doc-{}.pftrace", std::process::id()));
//! let timeline = tickline::Timeline::builder()
//!     .exporter(tickline_perfetto::PerfettoExporter::create(&path).unwrap())
//!     .start()
//!     .unwrap();
//! let subscriber = tracing_subscriber::registry().with(timeline.layer());
//! tracing::subscriber::with_default(subscriber, || {
//!     let request_id = 7;
//!     {
//!         let _send = tracing::info_span!("enqueue", "tickline.flow_out" = request_id).entered();
//!     }
//!     // Later, maybe on another thread: Perfetto draws an arrow from "enqueue" to "handle".
//!     let _handle = tracing::info_span!("handle", "tickline.flow_in" = request_id).entered();
//! });
//! timeline.shutdown().unwrap();
//! # std::fs::remove_file(&path).ok();
//! ```
//!
//! # Caveats
//!
//! Perfetto's importer silently drops a packed `flow_ids`, so flow ids are written unpacked. Both ends of a
//! flow carry its id in `flow_ids` (none in `terminating_flow_ids`): the importer reads events in timestamp
//! order and ignores a terminating id it has not seen start, which would lose every flow whose end is earlier
//! in time than its start event (a task's `poll` begins before its thread slice ends). Perfetto draws the
//! arrow from the slice that began first (for two that began together, from the one whose event it read
//! first: a thread slice's end comes before its poll's in the file). Track uuids and
//! flow ids are the timeline's ids XORed with a 32-bit salt drawn from the trace UUID (in the high half), so
//! they are unique within a trace and, to one chance in 2^32 per pair of traces, across traces; `tickline
//! merge` checks.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs, clippy::undocumented_unsafe_blocks)]

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tickline::{
    export::{
        Batch, EventKind, ExportError, Exporter, FieldValue, RecordingOrigin, TraceEvent, TraceField, TraceFile,
        TrackDescriptor, TrackKind,
    },
    sync::{
        ClockExchange, ClockReadings, ExchangeSample, HostInfo, MachineId, MachineIdSource, SimulatedClock,
        TimeSyncState, TraceUuid,
    },
};

/// A span or event field that starts a flow: `info_span!("send", "tickline.flow_out" = id)`. It is linked to
/// the span or event whose [`FLOW_IN_FIELD`] has the same value (an integer or a string), in this trace by
/// this exporter and across traces by `tickline merge`.
pub const FLOW_OUT_FIELD: &str = "tickline.flow_out";
/// A span or event field that ends the flow whose [`FLOW_OUT_FIELD`] has the same value.
pub const FLOW_IN_FIELD: &str = "tickline.flow_in";
/// Bit 63 of an unsalted flow id: set for flows asked for by [`FLOW_OUT_FIELD`] / [`FLOW_IN_FIELD`], clear
/// for tickline's own (CPU to GPU, task polls), which count up from 1.
const FIELD_FLOW_BIT: u64 = 1 << 63;
/// Field flows kept open for a receiver in this trace: a receiver after this many later senders is left to
/// `tickline merge`.
const FIELD_FLOWS_KEPT: usize = 1 << 16;

/// The unsalted flow id of a flow field's value `key` (its decimal digits for an integer): the same in every
/// trace, a 63-bit FNV-1a hash with [`FIELD_FLOW_BIT`] set.
fn field_flow_id(key: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash | FIELD_FLOW_BIT
}

/// Whether `flow_id`, as written in the trace whose UUID is `trace_uuid`, is a flow this exporter linked from
/// [`FLOW_OUT_FIELD`] / [`FLOW_IN_FIELD`] fields rather than one of tickline's own (`tickline merge` replaces
/// those with flows of its own, which link every receiver across traces).
///
/// ```
/// use tickline::sync::TraceUuid;
/// let uuid = TraceUuid(0x1234_5678_9abc_def0_1234_5678_9abc_def0);
/// let salt = u64::from(uuid.salt32()) << 32;
/// assert!(!tickline_perfetto::is_field_flow_id(uuid, salt ^ 7)); // tickline's own flow 7
/// ```
pub fn is_field_flow_id(trace_uuid: TraceUuid, flow_id: u64) -> bool {
    let salt = u64::from(trace_uuid.salt32()) << 32;
    (flow_id ^ salt) & FIELD_FLOW_BIT != 0
}

/// Flows asked for by [`FLOW_OUT_FIELD`] / [`FLOW_IN_FIELD`] fields, linked as the exporter writes events.
/// Perfetto links flow ends by id after sorting by time, so a receiver may be written before its sender: in
/// the same batch (tracks are not written in time order), or batches earlier (a sender span still open, its
/// begin held for its values, after its receiver has ended). Such a receiver carries the flow's id at once;
/// the sender, whenever it is written, carries it too, and Perfetto links the two.
#[derive(Default)]
struct FieldFlows {
    /// The interned ids of the two field names, once the timeline used them.
    names: (Option<tickline::export::NameId>, Option<tickline::export::NameId>),
    /// Started and not ended yet (unsalted ids): a sender whose receiver is in another process never ends
    /// here, so the oldest are forgotten beyond [`FIELD_FLOWS_KEPT`].
    open: KeptIds,
    /// Ended by a receiver written before any sender of its id (forgotten alike).
    ended_early: KeptIds,
    /// Linked: a later receiver of the id is left unlinked (forgotten alike).
    linked: KeptIds,
    /// A field's value as its key (reused).
    key: String,
}

/// A set of flow ids that forgets the oldest beyond [`FIELD_FLOWS_KEPT`].
#[derive(Default)]
struct KeptIds {
    ids: std::collections::HashSet<u64>,
    order: std::collections::VecDeque<u64>,
}

impl KeptIds {
    fn insert(&mut self, id: u64) -> bool {
        if !self.ids.insert(id) {
            return false;
        }
        if self.order.len() >= FIELD_FLOWS_KEPT {
            // Stale entries (removed since) are skipped over.
            while let Some(oldest) = self.order.pop_front() {
                if self.ids.remove(&oldest) {
                    break;
                }
            }
        }
        self.order.push_back(id);
        true
    }

    fn remove(&mut self, id: u64) -> bool {
        let removed = self.ids.remove(&id);
        if removed && self.order.len() > 2 * FIELD_FLOWS_KEPT {
            // Drop the stale entries of removed ids.
            let ids = &self.ids;
            self.order.retain(|id| ids.contains(id));
        }
        removed
    }

    fn contains(&self, id: u64) -> bool {
        self.ids.contains(&id)
    }
}

impl FieldFlows {
    fn note_names(&mut self, names: &[(tickline::export::NameId, String)]) {
        for (id, name) in names {
            if name == FLOW_OUT_FIELD {
                self.names.0 = Some(*id);
            } else if name == FLOW_IN_FIELD {
                self.names.1 = Some(*id);
            }
        }
    }

    #[inline]
    fn in_use(&self) -> bool {
        self.names != (None, None)
    }

    /// The flow id of `field` if it is a flow field with a usable value (an integer or a string), and
    /// whether it is a sender's.
    fn flow_field(&mut self, field: &TraceField) -> Option<(u64, bool)> {
        use std::fmt::Write as _;
        let is_out = Some(field.name) == self.names.0;
        if !is_out && Some(field.name) != self.names.1 {
            return None;
        }
        self.key.clear();
        let key = match &field.value {
            FieldValue::U64(v) => {
                let _ = write!(self.key, "{v}");
                self.key.as_str()
            }
            FieldValue::I64(v) => {
                let _ = write!(self.key, "{v}");
                self.key.as_str()
            }
            FieldValue::Str(s) => s.as_str(),
            FieldValue::Bool(_) | FieldValue::F64(_) => return None,
        };
        Some((field_flow_id(key), is_out))
    }

    /// The flows (unsalted ids: started here, ended here) that an event with `fields` takes part in.
    fn flows_of(&mut self, fields: &[TraceField]) -> (Option<u64>, Option<u64>) {
        let mut flows = (None, None);
        for field in fields {
            match self.flow_field(field) {
                Some((id, true)) => {
                    if self.linked.contains(id) {
                        // A sender of a flow already linked (an async task's lifetime slice after its first
                        // poll's, both the span's): Perfetto would chain it on from the receiver.
                    } else if self.ended_early.remove(id) {
                        // Its receiver was written first.
                        self.linked.insert(id);
                        flows.0 = Some(id);
                    } else if self.open.insert(id) {
                        flows.0 = Some(id);
                    }
                    // Else a second sender of an open flow: Perfetto would chain it on from the first.
                }
                Some((id, false)) => {
                    // Its sender written before; or none yet, and this is the id's first receiver: its sender
                    // may still come (else the flow's end is left dangling, which Perfetto ignores). A later
                    // receiver is left unlinked.
                    let linked = if self.open.remove(id) {
                        self.linked.insert(id);
                        true
                    } else {
                        !self.linked.contains(id) && self.ended_early.insert(id)
                    };
                    if linked {
                        flows.1 = Some(id);
                    }
                }
                None => {}
            }
        }
        flows
    }
}

/// The packet sequence of everything but threads' track descriptors.
const SEQUENCE_ID: u64 = 1;
/// Threads' track descriptors go on a sequence of their own, which never clears its incremental state: Perfetto's
/// importer makes a thread described on a sequence with valid incremental state that sequence's default thread,
/// and names it (`legacy_event.passthrough_utid`) on every event of the sequence that is not on a thread's track
/// (GPU queues, async tasks, counters), as if that thread had done it.
const THREAD_DESCRIPTOR_SEQUENCE_ID: u64 = 2;
const SEQ_INCREMENTAL_STATE_CLEARED: u64 = 1;
const SEQ_NEEDS_INCREMENTAL_STATE: u64 = 2;
const CLOCK_REALTIME: u64 = 1;
const CLOCK_MONOTONIC: u64 = 3;
const CLOCK_MONOTONIC_RAW: u64 = 5;
const CLOCK_BOOTTIME: u64 = 6;
/// Event names of tickline's own instants (written with a plain `name`, never interned).
pub const TRACE_INFO_EVENT: &str = "tickline trace";
/// See [`TRACE_INFO_EVENT`].
pub const CLOCK_SNAPSHOT_EVENT: &str = "tickline clock snapshot";
/// See [`TRACE_INFO_EVENT`].
pub const CLOCK_EXCHANGE_EVENT: &str = "tickline clock exchange";
/// The last packet of a trace whose recording ended with its timeline stopped (written by
/// [`finish`](Exporter::finish), after the closing clock snapshot). A trace without it was cut short: its
/// process was killed or aborted (or still runs), or it was converted from a capture that was; `tickline
/// stats` says which.
pub const TRACE_END_EVENT: &str = "tickline trace end";
/// The name of the track holding them.
pub const CLOCK_TRACK_NAME: &str = "tickline clock";
/// Mixed into a converted trace's UUID, so that it differs from its recording's id.
const CONVERTED_TRACE_TAG: u64 = 0x636f_6e76_6572_7465; // "converte"

/// Track ids at and above this are the exporter's own (the timeline's are small counters).
const OWN_TRACKS: u64 = 0xffff_ff00;
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
        pub const SYSTEM_INFO: u32 = 45;
        pub const TRACE_UUID: u32 = 89;
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
    pub mod uuid {
        pub const MSB: u32 = 1;
        pub const LSB: u32 = 2;
    }
    pub mod system_info {
        pub const UTSNAME: u32 = 1;
        pub const PAGE_SIZE: u32 = 6;
        pub const NUM_CPUS: u32 = 8;
        pub const SYSNAME: u32 = 1;
        pub const VERSION: u32 = 2;
        pub const RELEASE: u32 = 3;
        pub const MACHINE: u32 = 4;
    }
    pub mod event {
        pub const DEBUG_ANNOTATIONS: u32 = 4;
        pub const NAME: u32 = 23;
        pub const TYPE: u32 = 9;
        pub const NAME_IID: u32 = 10;
        pub const TRACK_UUID: u32 = 11;
        pub const DOUBLE_COUNTER_VALUE: u32 = 44;
        pub const FLOW_IDS: u32 = 47;
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
        pub const NAME: u32 = 10;
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
        pub const PROCESS_LABELS: u32 = 8;
        pub const TID: u32 = 2;
        pub const THREAD_NAME: u32 = 5;
        pub const UNIT_NAME: u32 = 6;
        pub const DESCRIPTION: u32 = 14;
        pub const SIBLING_MERGE_BEHAVIOR: u32 = 15;
        /// `SiblingMergeBehavior.SIBLING_MERGE_BEHAVIOR_NONE`.
        pub const SIBLING_MERGE_NONE: u64 = 2;
    }
}

/// The `TrackDescriptor.description` of a GPU device track.
pub const DESCRIPTION_GPU_DEVICE: &str = "tickline GPU device";
/// The `TrackDescriptor.description` of a GPU queue track (a lane of one queue).
pub const DESCRIPTION_GPU_QUEUE: &str = "tickline GPU queue";
/// The `TrackDescriptor.description` of an async task track (see `tickline::AsyncTasks`).
pub const DESCRIPTION_ASYNC_TASK: &str = "tickline async task";
/// The `TrackDescriptor.description` of a track holding its parent track's slices nested deeper than
/// Perfetto shows on one track (512): a child of the track they belong to, named `nested deeper than 512`
/// (1024, ...).
pub const DESCRIPTION_DEEPER_SLICES: &str = "tickline deeper slices";

/// Counts of what was written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerfettoStats {
    /// `TracePacket`s encoded.
    pub packets: u64,
    /// Bytes handed to the writer.
    pub bytes_written: u64,
    /// Clock snapshots written (at start, periodically, after a suspend and at the end).
    pub clock_snapshots: u64,
    /// Clock-exchange rounds written.
    pub exchange_samples: u64,
}

/// An [`Exporter`] writing a Perfetto trace.
///
/// ```
/// use std::time::Duration;
/// let path = std::env::temp_dir().join("tickline-doc-example.pftrace");
/// let exporter = tickline_perfetto::PerfettoExporter::create(&path)
///     .unwrap()
///     .flush_interval(Duration::from_millis(500));
/// let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
/// {
///     let _s = tickline::scope!("work");
/// }
/// timeline.shutdown().unwrap();
/// assert!(std::fs::metadata(&path).unwrap().len() > 0);
/// ```
pub struct PerfettoExporter<W: Write + Send = File> {
    /// `Some` until [`into_inner`](PerfettoExporter::into_inner) takes it.
    writer: Option<W>,
    /// The file of [`create`](PerfettoExporter::create), written in whole blocks that bypass the page cache
    /// (`writer` is then the same file, handed back by `into_inner`).
    file: Option<TraceFile>,
    path: Option<PathBuf>,
    buf: Vec<u8>,
    packet: Vec<u8>,
    body: Vec<u8>,
    nested: Vec<u8>,
    /// XORed into the high half of every track uuid and flow id: the trace's own.
    uuid_salt: u64,
    /// The last plain event's track uuid and its varint (10 bytes, zero-padded) and length: a salted uuid is
    /// a 10-byte varint, and consecutive events are mostly on one track.
    last_track_uuid: (u64, [u8; 10], usize),
    boot_offset_ns: i64,
    started: bool,
    /// [`finish`](Exporter::finish) ran: a drop has nothing left to write.
    finished: bool,
    failed: Option<(std::io::ErrorKind, String)>,
    stats: PerfettoStats,
    trace_uuid: TraceUuid,
    /// The recording the events come from (from the timeline's origin; `None` for batches made by hand).
    recording: Option<TraceUuid>,
    /// The recording ended with its timeline stopped (see `RecordingOrigin::finished`).
    recording_finished: bool,
    host: HostInfo,
    simulate: Option<SimulatedClock>,
    flush_interval: Duration,
    snapshot_interval: Duration,
    /// The last timed write-out; `None` before the first, which the first export does at once (a process
    /// killed in its first `flush_interval` leaves a trace that loads, not an empty file).
    last_write: Option<Instant>,
    last_snapshot: Instant,
    /// The process track's uuid, once the timeline described it (the clock track hangs under it).
    process_uuid: Option<u64>,
    clock_track_described: bool,
    exchange: Option<ClockExchange>,
    exchange_cursor: usize,
    /// Peer machines that have a clock-exchange track, and the last timestamp written on each.
    exchange_tracks: Vec<(MachineId, u64)>,
    last_clock_ts: u64,
    /// Snapshots' readings written before the clock track exists to hold their instants.
    pending_snapshots: Vec<(ClockReadings, Option<TimeSyncState>)>,
    /// The recording process (this one, or a converted capture's), for the `tickline trace` instant.
    recorded_pid: u32,
    recorded_process: String,
    /// Converting a capture: the recording's clock readings not written yet, oldest first. The exporter
    /// then never reads this process's clocks (they say nothing about when the capture was recorded).
    /// Each with the recording host's time-sync state read with it, where the capture has it.
    replay: Option<std::collections::VecDeque<(ClockReadings, Option<TimeSyncState>)>>,
    /// Flows asked for by span and event fields.
    field_flows: FieldFlows,
    /// Slices open on each track, by track id (see [`MAX_TRACK_DEPTH`]).
    depths: Vec<u32>,
    /// The same for track ids from [`DEPTH_TRACKED_TRACKS`] on, while they have slices open.
    far_depths: HashMap<u64, u32>,
    /// Overflow tracks described so far (see [`MAX_TRACK_DEPTH`]).
    deep_tracks: std::collections::HashSet<u64>,
}

/// A flush writes a clock snapshot when the last one is older than this (see `flush`): at most ten a second
/// however often the application flushes.
const FLUSH_SNAPSHOT_AGE: Duration = Duration::from_millis(100);

/// Most slices Perfetto nests on one track (trace_processor's `SliceTracker::kMaxDepth`): its importer drops a
/// deeper begin, and the end that follows then closes the wrong slice, cutting the slices around it short.
/// Slices (and instants) nested deeper go on a child track, [`MAX_TRACK_DEPTH`] levels each, so every slice
/// keeps its place and duration.
const MAX_TRACK_DEPTH: u32 = 512;
/// Track ids below this keep their open-slice count in a vector slot (the timeline numbers its tracks from 1
/// up: 4 bytes per track, at most 64 MiB); beyond it (a program that made 16 million async tasks), in a map
/// that holds only tracks with slices open.
const DEPTH_TRACKED_TRACKS: u64 = 1 << 24;
/// The bit that marks an overflow track's id (with its level at bit 40 and its track's id below).
const DEEP_TRACK_BIT: u64 = 1 << 62;

impl<W: Write + Send> std::fmt::Debug for PerfettoExporter<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerfettoExporter")
            .field("path", &self.path)
            .field("trace_uuid", &self.trace_uuid)
            .field("stats", &self.stats)
            .finish()
    }
}

impl PerfettoExporter<File> {
    /// Creates (or truncates) the trace file at `path`, written through a [`TraceFile`]: whole blocks bypass the
    /// page cache where the file system allows it (a trace is written once and not read back by the program,
    /// and copying it into the page cache was a large part of the collector's CPU), written by a thread of the
    /// file's own.
    pub fn create(path: impl AsRef<Path>) -> Result<Self, ExportError> {
        let path = path.as_ref();
        let cannot = |e: std::io::Error| {
            ExportError::Io(std::io::Error::new(
                e.kind(),
                format!("cannot create trace file {}: {e}", path.display()),
            ))
        };
        let file = TraceFile::create(path).map_err(cannot)?;
        let mut exporter = PerfettoExporter::new(file.try_clone_file().map_err(cannot)?);
        exporter.file = Some(file);
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

/// The host's `uname()`: (sysname, release, version, machine).
fn uname() -> Option<[String; 4]> {
    // SAFETY: an all-zero `utsname` is a valid value of this plain C struct of byte arrays.
    let mut u: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable utsname.
    if unsafe { libc::uname(&mut u) } != 0 {
        return None;
    }
    let text = |field: &[libc::c_char]| {
        let bytes: Vec<u8> = field.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    Some([text(&u.sysname), text(&u.release), text(&u.version), text(&u.machine)])
}

fn sysconf(name: libc::c_int) -> Option<u64> {
    // SAFETY: sysconf takes any name and returns -1 for unknown ones.
    let v = unsafe { libc::sysconf(name) };
    (v > 0).then_some(v as u64)
}

/// One debug annotation with a plain (not interned) name, for tickline's own instants.
enum Annotation<'a> {
    U64(&'a str, u64),
    I64(&'a str, i64),
    Bool(&'a str, bool),
    Str(&'a str, &'a str),
}

/// Protobuf wire types.
/// [`PerfettoExporter::write_small_event`]'s bounds: the fixed part of a packet (keys and lengths 2 + timestamp
/// 11 + track event key and length 2 + type 2 + track uuid 11 + name 11 + two flows 20 + sequence id and flags
/// 4), what a field adds besides a string's bytes (key and length 2 + name 11 + value 11), and the largest
/// packet it writes (a body under 128 bytes: every length prefix one byte).
const SMALL_PACKET_FIXED: usize = 63;
const SMALL_PACKET_PER_FIELD: usize = 24;
const SMALL_PACKET_BOUND: usize = 129;

/// An upper bound of the size of an event's packet with `fields`: its fixed part (with both flows) and, per
/// field, the key, length, name and value (a string's bytes on top).
#[inline]
fn small_packet_bound(fields: &[TraceField]) -> usize {
    let mut bound = SMALL_PACKET_FIXED;
    for f in fields {
        bound += SMALL_PACKET_PER_FIELD
            + if let FieldValue::Str(text) = &f.value {
                text.len()
            } else {
                0
            };
    }
    bound
}

/// Writes a packet's head into `b` (the room made for it in the output buffer): `b[0]` the `Trace.packet` key,
/// `b[1]` left for the packet's length, then the timestamp, the `track_event` key (its length left at
/// `event_start - 1`), the event's type, track uuid (its varint `uuid_bytes[..uuid_len]`) and name or counter
/// value. Returns where the event body goes on and where it starts.
#[inline(always)]
fn put_event_head<const N: usize>(
    b: &mut [u8; N],
    event: &TraceEvent,
    ts: u64,
    uuid_bytes: &[u8; 10],
    uuid_len: usize,
) -> (usize, usize) {
    b[0] = const { key_byte(field::TRACE_PACKET, WIRE_LENGTH_DELIMITED) };
    b[2] = const { key_byte(field::packet::TIMESTAMP, WIRE_VARINT) };
    let mut pos = put_varint_into(b, 3, ts);
    b[pos] = const { key_byte(field::packet::TRACK_EVENT, WIRE_LENGTH_DELIMITED) };
    pos += 2;
    let event_start = pos;
    b[pos] = const { key_byte(field::event::TYPE, WIRE_VARINT) };
    b[pos + 1] = match event.kind {
        EventKind::SliceBegin => field::event::TYPE_SLICE_BEGIN,
        EventKind::SliceEnd => field::event::TYPE_SLICE_END,
        EventKind::Instant => field::event::TYPE_INSTANT,
        EventKind::Counter(_) => field::event::TYPE_COUNTER,
    } as u8;
    b[pos + 2] = const { key_byte(field::event::TRACK_UUID, WIRE_VARINT) };
    // All 10 bytes (a fixed-size copy), then only the varint's length counts.
    b[pos + 3..pos + 13].copy_from_slice(uuid_bytes);
    pos += 3 + uuid_len;
    match event.kind {
        EventKind::SliceBegin | EventKind::Instant => {
            b[pos] = const { key_byte(field::event::NAME_IID, WIRE_VARINT) };
            pos = put_varint_into(b, pos + 1, event.name.0 as u64);
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
    (pos, event_start)
}

/// Ends a packet whose event body started at `event_start` and goes on to `pos`: both lengths (one byte each:
/// the caller keeps the packet under 128 bytes), the sequence id and flags. Returns the packet's size.
#[inline(always)]
fn put_packet_tail<const N: usize>(b: &mut [u8; N], mut pos: usize, event_start: usize) -> usize {
    b[event_start - 1] = (pos - event_start) as u8;
    // trusted_packet_sequence_id (10) = 1, sequence_flags (13) = SEQ_NEEDS_INCREMENTAL_STATE.
    b[pos..pos + 4].copy_from_slice(&[
        const { key_byte(field::packet::TRUSTED_PACKET_SEQUENCE_ID, WIRE_VARINT) },
        SEQUENCE_ID as u8,
        const { key_byte(field::packet::SEQUENCE_FLAGS, WIRE_VARINT) },
        SEQ_NEEDS_INCREMENTAL_STATE as u8,
    ]);
    pos += 4;
    b[1] = (pos - 2) as u8;
    pos
}

/// A field key that fits in one byte (tags below 16).
const fn key_byte(tag: u32, wire_type: u64) -> u8 {
    assert!(tag < 16);
    ((tag << 3) as u8) | wire_type as u8
}

const WIRE_VARINT: u64 = 0;
const WIRE_FIXED64: u64 = 1;
const WIRE_LENGTH_DELIMITED: u64 = 2;

/// Appends `value` as a varint, byte by byte into room reserved once. (Through prost's `BufMut` this was a
/// third of the collector's time on events with fields; built on the stack and appended as a slice, it called
/// `memcpy` with a run-time length: `total_cpu`'s event 178 ns of collector CPU, against 150 ns this way.)
#[inline(always)]
fn encode_varint(mut value: u64, buf: &mut Vec<u8>) {
    buf.reserve(10);
    while value >= 0x80 {
        buf.push(value as u8 | 0x80);
        value >>= 7;
    }
    buf.push(value as u8);
}

/// A field's key: its number and wire type.
#[inline(always)]
fn encode_key(tag: u32, wire_type: u64, buf: &mut Vec<u8>) {
    encode_varint((u64::from(tag) << 3) | wire_type, buf);
}

#[inline]
fn put_varint_field(buf: &mut Vec<u8>, tag: u32, value: u64) {
    encode_key(tag, WIRE_VARINT, buf);
    encode_varint(value, buf);
}

#[inline]
fn put_bytes_field(buf: &mut Vec<u8>, tag: u32, bytes: &[u8]) {
    encode_key(tag, WIRE_LENGTH_DELIMITED, buf);
    encode_varint(bytes.len() as u64, buf);
    buf.extend_from_slice(bytes);
}

#[inline]
fn put_fixed64_field(buf: &mut Vec<u8>, tag: u32, value: u64) {
    encode_key(tag, WIRE_FIXED64, buf);
    buf.extend_from_slice(&value.to_le_bytes());
}

/// Writes `value` as a varint at `b[pos..]`, returning the position after it. At most 10 bytes.
#[inline(always)]
fn put_varint_into(b: &mut [u8], mut pos: usize, mut value: u64) -> usize {
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
    let mut prefix = [0u8; 10];
    let end = put_varint_into(&mut prefix, 0, len as u64);
    buf.splice(body_start - 1..body_start, prefix[..end].iter().copied());
}

impl<W: Write + Send> PerfettoExporter<W> {
    /// A writer of a Perfetto trace to `writer` (a file, a `Vec<u8>`, a socket), with a fresh [`TraceUuid`]
    /// and this machine's [`HostInfo`].
    ///
    /// Given to a timeline, the exporter (and its writer) belongs to the timeline: [`into_inner`](Self::into_inner)
    /// serves an exporter driven by hand. To read a timeline's trace back from memory, give it a writer you keep
    /// a handle to:
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    ///
    /// #[derive(Clone, Default)]
    /// struct SharedBytes(Arc<Mutex<Vec<u8>>>);
    ///
    /// impl std::io::Write for SharedBytes {
    ///     fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
    ///         self.0.lock().unwrap().extend_from_slice(bytes);
    ///         Ok(bytes.len())
    ///     }
    ///     fn flush(&mut self) -> std::io::Result<()> {
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let trace = SharedBytes::default();
    /// let exporter = tickline_perfetto::PerfettoExporter::new(trace.clone());
    /// let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    /// {
    ///     let _s = tickline::scope!("work");
    /// }
    /// timeline.shutdown().unwrap();
    /// assert!(!trace.0.lock().unwrap().is_empty());
    /// ```
    pub fn new(writer: W) -> Self {
        let trace_uuid = TraceUuid::new_random();
        let now = Instant::now();
        PerfettoExporter {
            writer: Some(writer),
            file: None,
            path: None,
            buf: Vec::with_capacity(FLUSH_AT_BYTES + 4096),
            packet: Vec::with_capacity(256),
            body: Vec::with_capacity(256),
            nested: Vec::with_capacity(256),
            uuid_salt: u64::from(trace_uuid.salt32()) << 32,
            last_track_uuid: (0, [0; 10], 1),
            boot_offset_ns: 0,
            started: false,
            finished: false,
            failed: None,
            stats: PerfettoStats::default(),
            trace_uuid,
            recording: None,
            recording_finished: true,
            host: HostInfo::current().clone(),
            simulate: tickline::sync::simulation().copied(),
            flush_interval: Duration::from_millis(500),
            snapshot_interval: Duration::from_secs(2),
            last_write: None,
            last_snapshot: now,
            process_uuid: None,
            clock_track_described: false,
            exchange: None,
            exchange_cursor: 0,
            exchange_tracks: Vec::new(),
            last_clock_ts: 0,
            pending_snapshots: Vec::new(),
            field_flows: FieldFlows::default(),
            recorded_pid: std::process::id(),
            recorded_process: tickline::sync::process_name(),
            replay: None,
            depths: Vec::new(),
            far_depths: HashMap::new(),
            deep_tracks: std::collections::HashSet::new(),
        }
    }

    /// Writes whole packets to the writer at least this often while the timeline exports (default 500 ms: one
    /// `write` call each time, nothing measurable), so a killed process loses at most about this much plus
    /// the collector's export period (~100 ms). `Duration::ZERO` writes on every export.
    pub fn flush_interval(mut self, interval: Duration) -> Self {
        self.flush_interval = interval;
        self
    }

    /// Takes a bracketed clock snapshot this often (default 2 s; at least 10 ms): what lets `tickline merge`
    /// follow this host's clocks against each other (and NTP's corrections) between the start and the end.
    pub fn snapshot_interval(mut self, interval: Duration) -> Self {
        self.snapshot_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// Stores the rounds of `exchange` in the trace (as `tickline clock exchange` instants), so `tickline
    /// merge` can align this trace with its peer's by them; at [`finish`](Exporter::finish) a client side runs
    /// one last burst first. The trace takes the exchange's machine id (they must agree for the rounds to
    /// mean anything).
    pub fn clock_exchange(mut self, exchange: ClockExchange) -> Self {
        if exchange.machine_id() != self.host.machine_id {
            self.host.machine_id = exchange.machine_id();
            self.host.machine_id_source = MachineIdSource::Override;
        }
        self.exchange = Some(exchange);
        self
    }

    /// Claims another machine identity than [`HostInfo::current`]'s (e.g. one per container image whose
    /// clocks are the host's: better left alone; or to tell simulated machines apart in tests).
    pub fn machine_id(mut self, id: MachineId) -> Self {
        self.host.machine_id = id;
        self.host.machine_id_source = MachineIdSource::Override;
        self
    }

    /// The test hook: writes every timestamp as a machine whose clocks run off this one's would.
    #[doc(hidden)]
    pub fn simulate_clock(mut self, sim: Option<SimulatedClock>) -> Self {
        self.simulate = sim;
        self
    }

    /// Names the file the writer writes in this exporter's error messages ([`create`](PerfettoExporter::create)
    /// does it; for a writer opened some other way, such as a temporary file renamed over `path` once complete).
    ///
    /// ```
    /// let exporter = tickline_perfetto::PerfettoExporter::new(std::io::sink()).output_name("run.pftrace");
    /// # drop(exporter);
    /// ```
    pub fn output_name(mut self, path: impl Into<PathBuf>) -> Self {
        self.path = Some(path.into());
        self
    }

    /// This trace's UUID (also in its `TraceUuid` packet). Drawn at random when the exporter is made; when
    /// it converts a raw capture, derived from the capture's recording as the conversion starts instead, so
    /// that converting one capture twice writes the same trace.
    pub fn trace_uuid(&self) -> TraceUuid {
        self.trace_uuid
    }

    /// What was written so far.
    pub fn stats(&self) -> PerfettoStats {
        self.stats
    }

    /// Flushes and returns the writer.
    pub fn into_inner(mut self) -> Result<W, ExportError> {
        self.flush()?;
        if let Some(file) = self.file.take() {
            // `writer` shares the file's position (a clone of its handle): the trace's end, from here.
            if let Err(e) = file.into_file() {
                return Err(self.fail(e, "flushing Perfetto trace"));
            }
        }
        Ok(self
            .writer
            .take()
            .expect("taken only here, which consumes the exporter"))
    }

    fn uuid(&self, track: tickline::export::TrackId) -> u64 {
        self.uuid_salt ^ track.0
    }

    /// A reference-clock (MONOTONIC) timestamp as the trace shows it: BOOTTIME, through the test hook when
    /// `SIM` (a const, so the event loop without the hook has no branch for it).
    #[inline(always)]
    fn trace_ts<const SIM: bool>(&self, mono_ns: u64) -> u64 {
        let mut ts = (mono_ns as i64).saturating_add(self.boot_offset_ns);
        if SIM {
            if let Some(sim) = &self.simulate {
                ts = ts.saturating_add(sim.shift_ns(mono_ns));
            }
        }
        ts.max(0) as u64
    }

    /// The events of a batch, in order.
    fn write_events<const SIM: bool>(&mut self, batch: &Batch) -> Result<(), ExportError> {
        for event in &batch.events {
            match self.overflow_level(event) {
                0 => self.write_event::<SIM>(batch, event),
                level => {
                    let deep = self.deep_track(event.track, level);
                    let moved = TraceEvent {
                        track: deep,
                        ..event.clone()
                    };
                    self.write_event::<SIM>(batch, &moved);
                }
            }
            if self.buf.len() >= FLUSH_AT_BYTES {
                self.write_out()?;
            }
        }
        Ok(())
    }

    /// How many [`MAX_TRACK_DEPTH`]s of slices `event` sits under on its track (0 almost always), counting
    /// the track's open slices as it goes.
    #[inline]
    fn overflow_level(&mut self, event: &TraceEvent) -> u32 {
        let index = event.track.0;
        if index >= DEPTH_TRACKED_TRACKS {
            return self.far_overflow_level(event);
        }
        let index = index as usize;
        if index >= self.depths.len() {
            if event.kind != EventKind::SliceBegin {
                return 0;
            }
            self.depths.resize(index + 1, 0);
        }
        Self::count_depth(&mut self.depths[index], event.kind)
    }

    /// [`overflow_level`](Self::overflow_level) for a track id beyond [`DEPTH_TRACKED_TRACKS`].
    #[cold]
    fn far_overflow_level(&mut self, event: &TraceEvent) -> u32 {
        let Some(depth) = (match event.kind {
            EventKind::SliceBegin => Some(self.far_depths.entry(event.track.0).or_insert(0)),
            _ => self.far_depths.get_mut(&event.track.0),
        }) else {
            return 0;
        };
        let level = Self::count_depth(depth, event.kind);
        if *depth == 0 {
            self.far_depths.remove(&event.track.0);
        }
        level
    }

    /// Counts `kind` into a track's open slices `depth`; the overflow level it sits at.
    #[inline(always)]
    fn count_depth(depth: &mut u32, kind: EventKind) -> u32 {
        match kind {
            EventKind::SliceBegin => {
                *depth += 1;
                (*depth - 1) / MAX_TRACK_DEPTH
            }
            EventKind::SliceEnd => {
                *depth = depth.saturating_sub(1);
                *depth / MAX_TRACK_DEPTH
            }
            EventKind::Instant => *depth / MAX_TRACK_DEPTH,
            _ => 0,
        }
    }

    /// The child track of `track` that holds its slices nested `level` x [`MAX_TRACK_DEPTH`] deep and more,
    /// described on first use.
    #[cold]
    fn deep_track(&mut self, track: tickline::export::TrackId, level: u32) -> tickline::export::TrackId {
        // Level 0 is the track itself.
        let at_level = |level: u32| match level {
            0 => track,
            level => tickline::export::TrackId(DEEP_TRACK_BIT | u64::from(level) << 40 | track.0),
        };
        let deep = at_level(level);
        if self.deep_tracks.insert(deep.0) {
            let parent = at_level(level - 1);
            let name = format!("nested deeper than {}", u64::from(level) * u64::from(MAX_TRACK_DEPTH));
            self.write_described_track(
                self.uuid(deep),
                Some(self.uuid(parent)),
                &name,
                Some(DESCRIPTION_DEEPER_SLICES),
            );
        }
        deep
    }

    fn read_clocks(&self) -> ClockReadings {
        let real = tickline::sync::read_real_clocks();
        match &self.simulate {
            Some(sim) => sim.apply(real),
            None => real,
        }
    }

    /// Frames `self.packet` as one `Trace.packet` in the output buffer.
    fn commit_packet(&mut self) {
        put_bytes_field(&mut self.buf, field::TRACE_PACKET, &self.packet);
        self.packet.clear();
        self.stats.packets += 1;
    }

    /// A bracketed snapshot of the four clocks read now (live), and (once the clock track exists) its
    /// instant with the bracket and the time-sync state.
    fn write_clock_snapshot(&mut self, first: bool) {
        let real = tickline::sync::read_real_clocks();
        self.boot_offset_ns = real.boottime_ns as i64 - real.monotonic_ns as i64;
        let r = match &self.simulate {
            Some(sim) => sim.apply(real),
            None => real,
        };
        self.write_snapshot_of(r, None, first);
    }

    /// Converting a capture: the recording's readings up to `until_mono_ns` (all with `None`) as snapshots.
    /// Events are placed on BOOTTIME with the offset of the latest one, as the live exporter does.
    fn replay_snapshots(&mut self, until_mono_ns: Option<u64>) {
        while let Some((r, sync)) = self.replay.as_mut().and_then(|q| {
            let due = q
                .front()
                .is_some_and(|(r, _)| until_mono_ns.is_none_or(|t| r.monotonic_ns <= t));
            if due {
                q.pop_front()
            } else {
                None
            }
        }) {
            self.boot_offset_ns = r.boottime_ns as i64 - r.monotonic_ns as i64;
            self.write_snapshot_of(r, sync, false);
        }
    }

    /// `sync`: the time-sync state recorded with `r` (a converted capture's); a live snapshot's is read when its
    /// instant is written.
    fn write_snapshot_of(&mut self, r: ClockReadings, sync: Option<TimeSyncState>, first: bool) {
        self.body.clear();
        for (id, ts) in [
            (CLOCK_BOOTTIME, r.boottime_ns),
            (CLOCK_MONOTONIC, r.monotonic_ns),
            (CLOCK_MONOTONIC_RAW, r.monotonic_raw_ns),
            (CLOCK_REALTIME, r.realtime_ns),
        ] {
            self.nested.clear();
            put_varint_field(&mut self.nested, field::snapshot::CLOCK_ID, id);
            put_varint_field(&mut self.nested, field::snapshot::TIMESTAMP, ts);
            put_bytes_field(&mut self.body, field::snapshot::CLOCKS, &self.nested);
        }
        put_varint_field(&mut self.body, field::snapshot::PRIMARY_TRACE_CLOCK, CLOCK_BOOTTIME);
        put_varint_field(&mut self.packet, field::packet::TIMESTAMP, r.boottime_ns);
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
        self.last_snapshot = Instant::now();
        if self.clock_track_described {
            self.write_snapshot_instant(&r, sync);
        } else {
            self.pending_snapshots.push((r, sync));
        }
    }

    fn write_snapshot_instant(&mut self, r: &ClockReadings, recorded_sync: Option<TimeSyncState>) {
        // This machine's time-sync state says nothing about a converted capture's recording: the recording
        // host's, as its capture kept it.
        let sync = if self.replay.is_some() {
            recorded_sync
        } else {
            tickline::sync::time_sync_state()
        };
        let mut annotations = vec![
            Annotation::U64("boottime_ns", r.boottime_ns),
            Annotation::U64("monotonic_ns", r.monotonic_ns),
            Annotation::U64("monotonic_raw_ns", r.monotonic_raw_ns),
            Annotation::U64("realtime_ns", r.realtime_ns),
            Annotation::U64("bracket_ns", r.bracket_ns),
        ];
        if let Some(sync) = &sync {
            annotations.extend([
                Annotation::Bool("sync_synchronized", sync.synchronized),
                Annotation::U64("sync_est_error_ns", sync.est_error_ns),
                Annotation::U64("sync_max_error_ns", sync.max_error_ns),
                Annotation::I64("sync_status", i64::from(sync.status)),
            ]);
        }
        // The clock track's timestamps never go backwards, even if a snapshot's BOOTTIME did (it cannot).
        let ts = r.boottime_ns.max(self.last_clock_ts);
        self.last_clock_ts = ts;
        let track = self.uuid_salt ^ OWN_TRACKS;
        self.write_own_instant(ts, track, CLOCK_SNAPSHOT_EVENT, &annotations);
    }

    /// `SystemInfo`, `TraceUuid`: once, after the first snapshot.
    fn write_identity_packets(&mut self) {
        self.body.clear();
        put_varint_field(&mut self.body, field::uuid::MSB, self.trace_uuid.msb() as u64);
        put_varint_field(&mut self.body, field::uuid::LSB, self.trace_uuid.lsb() as u64);
        put_bytes_field(&mut self.packet, field::packet::TRACE_UUID, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        self.commit_packet();

        self.body.clear();
        if let Some([sysname, release, version, machine]) = uname() {
            self.nested.clear();
            put_bytes_field(&mut self.nested, field::system_info::SYSNAME, sysname.as_bytes());
            put_bytes_field(&mut self.nested, field::system_info::VERSION, version.as_bytes());
            put_bytes_field(&mut self.nested, field::system_info::RELEASE, release.as_bytes());
            put_bytes_field(&mut self.nested, field::system_info::MACHINE, machine.as_bytes());
            put_bytes_field(&mut self.body, field::system_info::UTSNAME, &self.nested);
        }
        if let Some(page) = sysconf(libc::_SC_PAGESIZE) {
            put_varint_field(&mut self.body, field::system_info::PAGE_SIZE, page);
        }
        if let Some(cpus) = sysconf(libc::_SC_NPROCESSORS_CONF) {
            put_varint_field(&mut self.body, field::system_info::NUM_CPUS, cpus);
        }
        put_bytes_field(&mut self.packet, field::packet::SYSTEM_INFO, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        self.commit_packet();
    }

    /// The `tickline clock` track (under the process track when the timeline described one) and the
    /// `tickline trace` instant; then the first snapshot's instant.
    fn write_clock_track(&mut self) {
        let uuid = self.uuid_salt ^ OWN_TRACKS;
        self.write_named_track(uuid, self.process_uuid, CLOCK_TRACK_NAME);
        self.clock_track_described = true;
        let mut pending = std::mem::take(&mut self.pending_snapshots);
        if pending.is_empty() {
            pending.push((self.read_clocks(), None));
        }
        let first = pending[0].0;
        let (uuid_text, machine) = (self.trace_uuid.to_string(), self.host.machine_id.to_string());
        let recording = self.recording.map(|r| r.to_string()).unwrap_or_default();
        let host = self.host.clone();
        let process = self.recorded_process.clone();
        let annotations = [
            Annotation::Str("trace_uuid", &uuid_text),
            Annotation::Str("recording_id", &recording),
            Annotation::Str("machine_id", &machine),
            Annotation::Str("machine_id_source", host.machine_id_source.as_str()),
            Annotation::Str("boot_id", &host.boot_id),
            Annotation::Str("host", &host.host_name),
            Annotation::U64("pid", u64::from(self.recorded_pid)),
            Annotation::Str("process", &process),
            Annotation::Str("tickline_version", env!("CARGO_PKG_VERSION")),
        ];
        self.last_clock_ts = first.boottime_ns;
        self.write_own_instant(first.boottime_ns, uuid, TRACE_INFO_EVENT, &annotations);
        for (r, sync) in &pending {
            self.write_snapshot_instant(r, *sync);
        }
    }

    fn write_named_track(&mut self, uuid: u64, parent: Option<u64>, name: &str) {
        self.write_described_track(uuid, parent, name, None);
    }

    fn write_described_track(&mut self, uuid: u64, parent: Option<u64>, name: &str, description: Option<&str>) {
        self.body.clear();
        put_varint_field(&mut self.body, field::track::UUID, uuid);
        if let Some(parent) = parent {
            put_varint_field(&mut self.body, field::track::PARENT_UUID, parent);
        }
        put_bytes_field(&mut self.body, field::track::NAME, name.as_bytes());
        if let Some(description) = description {
            put_bytes_field(&mut self.body, field::track::DESCRIPTION, description.as_bytes());
        }
        put_varint_field(
            &mut self.body,
            field::track::SIBLING_MERGE_BEHAVIOR,
            field::track::SIBLING_MERGE_NONE,
        );
        put_bytes_field(&mut self.packet, field::packet::TRACK_DESCRIPTOR, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        self.commit_packet();
    }

    /// An instant with a plain name and plain-named annotations on one of the exporter's own tracks.
    fn write_own_instant(&mut self, ts: u64, track: u64, name: &str, annotations: &[Annotation<'_>]) {
        self.body.clear();
        put_varint_field(&mut self.body, field::event::TYPE, field::event::TYPE_INSTANT);
        put_varint_field(&mut self.body, field::event::TRACK_UUID, track);
        put_bytes_field(&mut self.body, field::event::NAME, name.as_bytes());
        for a in annotations {
            self.nested.clear();
            let n = &mut self.nested;
            match a {
                Annotation::U64(k, v) => {
                    put_bytes_field(n, field::annotation::NAME, k.as_bytes());
                    put_varint_field(n, field::annotation::UINT_VALUE, *v);
                }
                Annotation::I64(k, v) => {
                    put_bytes_field(n, field::annotation::NAME, k.as_bytes());
                    put_varint_field(n, field::annotation::INT_VALUE, *v as u64);
                }
                Annotation::Bool(k, v) => {
                    put_bytes_field(n, field::annotation::NAME, k.as_bytes());
                    put_varint_field(n, field::annotation::BOOL_VALUE, u64::from(*v));
                }
                Annotation::Str(k, v) => {
                    put_bytes_field(n, field::annotation::NAME, k.as_bytes());
                    put_bytes_field(n, field::annotation::STRING_VALUE, v.as_bytes());
                }
            }
            put_bytes_field(&mut self.body, field::event::DEBUG_ANNOTATIONS, &self.nested);
        }
        put_varint_field(&mut self.packet, field::packet::TIMESTAMP, ts);
        put_bytes_field(&mut self.packet, field::packet::TRACK_EVENT, &self.body);
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, SEQUENCE_ID);
        self.commit_packet();
    }

    /// Writes the exchange rounds finished since the last call, on one track per peer machine.
    fn write_exchange_samples(&mut self) {
        let Some(exchange) = &self.exchange else {
            return;
        };
        let (samples, next) = exchange.samples_since(self.exchange_cursor);
        if samples.is_empty() {
            return;
        }
        self.exchange_cursor = next;
        let local = exchange.machine_id();
        let peers = exchange.peers();
        for s in samples {
            self.write_exchange_sample(&s, local, &peers);
        }
    }

    fn write_exchange_sample(&mut self, s: &ExchangeSample, local: MachineId, peers: &[(MachineId, String)]) {
        let is_client = s.client == local;
        let peer = if is_client { s.server } else { s.client };
        let index = match self.exchange_tracks.iter().position(|(m, _)| *m == peer) {
            Some(i) => i,
            None => {
                let host = peers
                    .iter()
                    .find(|(m, _)| *m == peer)
                    .map_or_else(|| peer.to_string(), |(_, h)| h.clone());
                let uuid = self.uuid_salt ^ (OWN_TRACKS + 1 + self.exchange_tracks.len() as u64);
                let name = format!("{CLOCK_EXCHANGE_EVENT} with {host} ({peer})");
                self.write_named_track(uuid, Some(self.uuid_salt ^ OWN_TRACKS), &name);
                self.exchange_tracks.push((peer, 0));
                self.exchange_tracks.len() - 1
            }
        };
        let local_ts = if is_client {
            s.t4_client_receive_ns
        } else {
            s.t3_server_send_ns
        };
        let ts = local_ts.max(self.exchange_tracks[index].1);
        self.exchange_tracks[index].1 = ts;
        let uuid = self.uuid_salt ^ (OWN_TRACKS + 1 + index as u64);
        let (client, server) = (s.client.to_string(), s.server.to_string());
        let annotations = [
            Annotation::Str("role", if is_client { "client" } else { "server" }),
            Annotation::Str("client_machine", &client),
            Annotation::Str("server_machine", &server),
            Annotation::U64("burst", s.burst),
            Annotation::U64("t1_ns", s.t1_client_send_ns),
            Annotation::U64("t2_ns", s.t2_server_receive_ns),
            Annotation::U64("t3_ns", s.t3_server_send_ns),
            Annotation::U64("t4_ns", s.t4_client_receive_ns),
        ];
        self.write_own_instant(ts, uuid, CLOCK_EXCHANGE_EVENT, &annotations);
        self.stats.exchange_samples += 1;
    }

    /// The start of the file: snapshot (clearing the sequence's state), `TraceUuid`, `SystemInfo`.
    fn start(&mut self) {
        if !self.started {
            // A converted capture starts with its first reading (one written before readings were
            // captured has none: this machine's clocks now are the best there is).
            match self.replay.as_mut().and_then(|q| q.pop_front()) {
                Some((r, sync)) => {
                    self.boot_offset_ns = r.boottime_ns as i64 - r.monotonic_ns as i64;
                    self.write_snapshot_of(r, sync, true);
                }
                None => self.write_clock_snapshot(true),
            }
            self.write_identity_packets();
            self.started = true;
        }
    }

    /// What the exporter writes on its own: the clock track once the timeline's tracks are in, periodic
    /// snapshots, exchange rounds, and the timed write-out.
    fn housekeeping(&mut self, force_write: bool) -> Result<(), ExportError> {
        if !self.clock_track_described {
            self.write_clock_track();
        }
        let now = Instant::now();
        if self.replay.is_none() && now.duration_since(self.last_snapshot) >= self.snapshot_interval {
            self.write_clock_snapshot(false);
        }
        self.write_exchange_samples();
        let due = self
            .last_write
            .is_none_or(|last| now.duration_since(last) >= self.flush_interval);
        if force_write || due {
            self.last_write = Some(now);
            self.write_out()?;
            let flushed = match &mut self.file {
                Some(file) => file.flush(),
                None => self.writer.as_mut().map_or(Ok(()), Write::flush),
            };
            if let Err(e) = flushed {
                return Err(self.fail(e, "flushing Perfetto trace"));
            }
        }
        Ok(())
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
                // Shown beside the process name in the UI: which host and machine (boot) it ran on.
                let host = format!("host={}", self.host.host_name);
                let machine = format!("machine={}", self.host.machine_id);
                put_bytes_field(&mut self.nested, field::track::PROCESS_LABELS, host.as_bytes());
                put_bytes_field(&mut self.nested, field::track::PROCESS_LABELS, machine.as_bytes());
                put_bytes_field(&mut self.body, field::track::PROCESS, &self.nested);
                if self.process_uuid.is_none() && parent.is_none() {
                    self.process_uuid = Some(uuid);
                }
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
            // What a track is goes in its description (shown with it in the UI, read by `.ci/check_perfetto.py`);
            // the name is for display only.
            TrackKind::GpuDevice { name, api } => {
                let name = format!("GPU: {name} ({api})");
                put_bytes_field(&mut self.body, field::track::NAME, name.as_bytes());
                put_bytes_field(
                    &mut self.body,
                    field::track::DESCRIPTION,
                    DESCRIPTION_GPU_DEVICE.as_bytes(),
                );
            }
            TrackKind::GpuQueue { name, lane } => {
                let name = match lane {
                    0 => name.clone(),
                    lane => format!("{name} ({})", lane + 1),
                };
                put_bytes_field(&mut self.body, field::track::NAME, name.as_bytes());
                put_bytes_field(
                    &mut self.body,
                    field::track::DESCRIPTION,
                    DESCRIPTION_GPU_QUEUE.as_bytes(),
                );
            }
            TrackKind::AsyncTask { name } => {
                put_bytes_field(&mut self.body, field::track::NAME, name.as_bytes());
                put_bytes_field(
                    &mut self.body,
                    field::track::DESCRIPTION,
                    DESCRIPTION_ASYNC_TASK.as_bytes(),
                );
            }
            other => {
                // A kind this exporter does not know yet still gets a named track.
                put_bytes_field(&mut self.body, field::track::NAME, format!("{other:?}").as_bytes());
            }
        }
        if !matches!(track.kind, TrackKind::Process { .. } | TrackKind::Thread { .. }) {
            // Each track stands for one thing: Perfetto merges siblings of the same name unless told not to,
            // which would put two tasks of one name (or two GPUs of one model) on one track.
            put_varint_field(
                &mut self.body,
                field::track::SIBLING_MERGE_BEHAVIOR,
                field::track::SIBLING_MERGE_NONE,
            );
        }
        put_bytes_field(&mut self.packet, field::packet::TRACK_DESCRIPTOR, &self.body);
        let sequence = match track.kind {
            TrackKind::Thread { .. } => THREAD_DESCRIPTOR_SEQUENCE_ID,
            _ => SEQUENCE_ID,
        };
        put_varint_field(&mut self.packet, field::packet::TRUSTED_PACKET_SEQUENCE_ID, sequence);
        self.commit_packet();
    }

    /// Interns names for both event names and debug annotation names (the same iid serves both tables).
    fn write_interned(&mut self, names: &[(tickline::export::NameId, String)]) {
        if names.is_empty() {
            return;
        }
        self.field_flows.note_names(names);
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

    /// `track`'s salted uuid as a varint (10 bytes, the first `len` of them used), encoded once per run of events
    /// on one track.
    #[inline(always)]
    fn track_uuid_varint(&mut self, track: tickline::export::TrackId) -> ([u8; 10], usize) {
        let uuid = self.uuid_salt ^ track.0;
        if self.last_track_uuid.0 != uuid {
            let mut bytes = [0u8; 10];
            let len = put_varint_into(&mut bytes, 0, uuid);
            self.last_track_uuid = (uuid, bytes, len);
        }
        (self.last_track_uuid.1, self.last_track_uuid.2)
    }

    /// The hot path: an event with no fields and no flows (most slice ends, most begins, every counter)
    /// is written straight into the output buffer with hand-rolled varints.
    #[inline]
    fn write_plain_event<const SIM: bool>(&mut self, event: &TraceEvent) {
        let ts = self.trace_ts::<SIM>(event.ts_ns);
        let (uuid_bytes, uuid_len) = self.track_uuid_varint(event.track);
        // Written in place: 64 bytes made room for (two vector stores), the packet written into them, the rest
        // cut off. Built on the stack and copied out instead, the copy's wide loads waited on the packet's
        // byte stores (a failed store-to-load forward, 12 % of the processing stage's time).
        let start = self.buf.len();
        self.buf.resize(start + 64, 0);
        let b: &mut [u8; 64] = (&mut self.buf[start..start + 64])
            .try_into()
            .expect("64 bytes were just added");
        let (pos, event_start) = put_event_head(b, event, ts, &uuid_bytes, uuid_len);
        let pos = put_packet_tail(b, pos, event_start);
        self.buf.truncate(start + pos);
        self.stats.packets += 1;
    }

    /// An event with fields or flows whose packet is under 128 bytes (an `info!` event, a slice end with its
    /// flow): written in place like [`write_plain_event`](Self::write_plain_event), with room for
    /// [`SMALL_PACKET_BOUND`] bytes made (the caller checked that the packet fits, so every length prefix is one
    /// byte). Pushed byte by byte with length prefixes patched afterwards, an `info!` event's packet was the
    /// processing stage's largest cost for events.
    fn write_small_event<const SIM: bool>(&mut self, event: &TraceEvent, fields: &[TraceField]) {
        debug_assert!(small_packet_bound(fields) <= SMALL_PACKET_BOUND);
        let ts = self.trace_ts::<SIM>(event.ts_ns);
        let (uuid_bytes, uuid_len) = self.track_uuid_varint(event.track);
        let salt = self.uuid_salt;
        let start = self.buf.len();
        self.buf.resize(start + SMALL_PACKET_BOUND, 0);
        let b: &mut [u8; SMALL_PACKET_BOUND] = (&mut self.buf[start..start + SMALL_PACKET_BOUND])
            .try_into()
            .expect("the bound's bytes were just added");
        let (mut pos, event_start) = put_event_head(b, event, ts, &uuid_bytes, uuid_len);
        for f in fields {
            b[pos] = const { key_byte(field::event::DEBUG_ANNOTATIONS, WIRE_LENGTH_DELIMITED) };
            let annotation_len_at = pos + 1;
            pos += 2;
            let annotation_start = pos;
            b[pos] = const { key_byte(field::annotation::NAME_IID, WIRE_VARINT) };
            pos = put_varint_into(b, pos + 1, f.name.0 as u64);
            match &f.value {
                FieldValue::Bool(v) => {
                    b[pos] = const { key_byte(field::annotation::BOOL_VALUE, WIRE_VARINT) };
                    pos = put_varint_into(b, pos + 1, u64::from(*v));
                }
                FieldValue::U64(v) => {
                    b[pos] = const { key_byte(field::annotation::UINT_VALUE, WIRE_VARINT) };
                    pos = put_varint_into(b, pos + 1, *v);
                }
                FieldValue::I64(v) => {
                    b[pos] = const { key_byte(field::annotation::INT_VALUE, WIRE_VARINT) };
                    pos = put_varint_into(b, pos + 1, *v as u64);
                }
                FieldValue::F64(v) => {
                    b[pos] = const { key_byte(field::annotation::DOUBLE_VALUE, WIRE_FIXED64) };
                    b[pos + 1..pos + 9].copy_from_slice(&v.to_bits().to_le_bytes());
                    pos += 9;
                }
                FieldValue::Str(text) => {
                    b[pos] = const { key_byte(field::annotation::STRING_VALUE, WIRE_LENGTH_DELIMITED) };
                    pos = put_varint_into(b, pos + 1, text.len() as u64);
                    b[pos..pos + text.len()].copy_from_slice(text.as_bytes());
                    pos += text.len();
                }
            }
            b[annotation_len_at] = (pos - annotation_start) as u8;
        }
        // Unpacked, one key per id, both ends in `flow_ids` (see `write_large_event`); key 47, fixed64: a
        // two-byte varint.
        for flow in [event.flow_out, event.flow_in].into_iter().flatten() {
            b[pos..pos + 2].copy_from_slice(&[0xf9, 0x02]);
            b[pos + 2..pos + 10].copy_from_slice(&(salt ^ flow).to_le_bytes());
            pos += 10;
        }
        let pos = put_packet_tail(b, pos, event_start);
        self.buf.truncate(start + pos);
        self.stats.packets += 1;
    }

    fn write_event<const SIM: bool>(&mut self, batch: &Batch, event: &TraceEvent) {
        if event.fields.is_empty() && event.flow_out.is_none() && event.flow_in.is_none() {
            return self.write_plain_event::<SIM>(event);
        }
        let fields = batch.fields_of(event);
        if self.field_flows.in_use() && matches!(event.kind, EventKind::SliceBegin | EventKind::Instant) {
            let flows = self.field_flows.flows_of(fields);
            if flows != (None, None) {
                return self.write_large_event::<SIM>(fields, event, flows);
            }
        }
        if small_packet_bound(fields) <= SMALL_PACKET_BOUND {
            return self.write_small_event::<SIM>(event, fields);
        }
        self.write_large_event::<SIM>(fields, event, (None, None));
    }

    /// An event whose packet may be 128 bytes or more: encoded field by field into the output buffer, each length
    /// prefix widened in place where its body turned out longer than 127 bytes.
    ///
    /// `field_flows`: flows asked for by the event's fields (unsalted ids: out, in), besides its own.
    fn write_large_event<const SIM: bool>(
        &mut self,
        fields: &[TraceField],
        event: &TraceEvent,
        field_flows: (Option<u64>, Option<u64>),
    ) {
        // Encoded straight into the output buffer: `Trace.packet { timestamp, track_event { .. }, sequence id,
        // flags }`. Both length prefixes get one byte up front, the common case (a packet under 128 bytes);
        // a longer one is widened in place after the fact.
        let ts = self.trace_ts::<SIM>(event.ts_ns);
        let buf = &mut self.buf;
        let packet_start = buf.len();
        encode_key(field::TRACE_PACKET, WIRE_LENGTH_DELIMITED, buf);
        buf.push(0);
        let packet_body = buf.len();
        put_varint_field(buf, field::packet::TIMESTAMP, ts);
        encode_key(field::packet::TRACK_EVENT, WIRE_LENGTH_DELIMITED, buf);
        buf.push(0);
        let event_body = buf.len();
        let kind = match event.kind {
            EventKind::SliceBegin => field::event::TYPE_SLICE_BEGIN,
            EventKind::SliceEnd => field::event::TYPE_SLICE_END,
            EventKind::Instant => field::event::TYPE_INSTANT,
            EventKind::Counter(_) => field::event::TYPE_COUNTER,
        };
        put_varint_field(buf, field::event::TYPE, kind);
        put_varint_field(buf, field::event::TRACK_UUID, self.uuid_salt ^ event.track.0);
        match event.kind {
            EventKind::SliceBegin | EventKind::Instant => {
                put_varint_field(buf, field::event::NAME_IID, event.name.0 as u64);
            }
            EventKind::Counter(value) => {
                put_fixed64_field(buf, field::event::DOUBLE_COUNTER_VALUE, value.to_bits());
            }
            EventKind::SliceEnd => {}
        }
        for f in fields {
            // In place, like the packet: a one-byte length up front, widened after the fact if need be.
            encode_key(field::event::DEBUG_ANNOTATIONS, WIRE_LENGTH_DELIMITED, buf);
            buf.push(0);
            let annotation_body = buf.len();
            put_varint_field(buf, field::annotation::NAME_IID, f.name.0 as u64);
            match &f.value {
                FieldValue::Bool(v) => put_varint_field(buf, field::annotation::BOOL_VALUE, *v as u64),
                FieldValue::U64(v) => put_varint_field(buf, field::annotation::UINT_VALUE, *v),
                FieldValue::I64(v) => put_varint_field(buf, field::annotation::INT_VALUE, *v as u64),
                FieldValue::F64(v) => put_fixed64_field(buf, field::annotation::DOUBLE_VALUE, v.to_bits()),
                FieldValue::Str(s) => put_bytes_field(buf, field::annotation::STRING_VALUE, s.as_bytes()),
            }
            patch_length(buf, annotation_body);
        }
        // Unpacked, one key per id: Perfetto's importer drops packed flow ids without a word.
        // Salted like track uuids: unique across the traces of several processes.
        // Both ends in `flow_ids`, never `terminating_flow_ids`: the importer reads events in timestamp order,
        // and skips a terminating id it has not seen start, so an end earlier in time than its start (a task's
        // poll begins before its thread slice ends) would lose the flow. With `flow_ids` on both, whichever
        // comes first starts it and the other completes it; the arrow goes from the slice that began first.
        // Every flow id is used by one flow only, so none needs terminating.
        for flow in [event.flow_out, event.flow_in, field_flows.0, field_flows.1]
            .into_iter()
            .flatten()
        {
            put_fixed64_field(buf, field::event::FLOW_IDS, self.uuid_salt ^ flow);
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

    /// Records a write failure (the exporter stays failed) and returns it as an error naming the target.
    fn fail(&mut self, e: std::io::Error, what: &str) -> ExportError {
        let target = self
            .path
            .as_ref()
            .map_or_else(|| "the trace writer".to_owned(), |p| p.display().to_string());
        let message = format!("{what} to {target}: {e}");
        self.failed = Some((e.kind(), message.clone()));
        self.buf.clear();
        ExportError::Io(std::io::Error::new(e.kind(), message))
    }

    fn write_out(&mut self) -> Result<(), ExportError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let written = match &mut self.file {
            Some(file) => file.write_all(&self.buf),
            None => self.writer.as_mut().map_or(Ok(()), |w| w.write_all(&self.buf)),
        };
        if let Err(e) = written {
            return Err(self.fail(e, "writing Perfetto trace"));
        }
        self.stats.bytes_written += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }
}

impl<W: Write + Send> Exporter for PerfettoExporter<W> {
    /// A converted capture's origin replaces this process: its host, pid and process name go into the
    /// `tickline trace` instant and the process track, and its recorded clock readings are the snapshots.
    fn origin(&mut self, origin: &RecordingOrigin) {
        self.recorded_pid = origin.pid;
        self.recorded_process = origin.process_name.clone();
        self.recording = Some(origin.recording);
        self.recording_finished = origin.finished;
        if origin.replay {
            self.host = origin.host.clone();
            let sync = origin.clock_sync.iter().copied().chain(std::iter::repeat(None));
            self.replay = Some(origin.clocks.iter().copied().zip(sync).collect());
            if !self.started {
                // The same trace each time the capture is converted (its ids are salted with the UUID).
                let recording = origin.recording.0;
                self.trace_uuid =
                    TraceUuid::derived_from(&[(recording >> 64) as u64, recording as u64, CONVERTED_TRACE_TAG]);
                self.uuid_salt = u64::from(self.trace_uuid.salt32()) << 32;
            }
        }
    }

    fn export(&mut self, batch: &Batch) -> Result<(), ExportError> {
        self.check_failed()?;
        self.finished = false;
        self.start();
        if self.replay.is_some() {
            let last = batch.events.iter().map(|e| e.ts_ns).max();
            if let Some(last) = last {
                self.replay_snapshots(Some(last));
            }
        }
        for track in &batch.new_tracks {
            debug_assert!(
                track.id.0 < OWN_TRACKS,
                "track id {} collides with the exporter's own",
                track.id.0
            );
            self.write_track(track);
        }
        self.write_interned(&batch.new_names);
        if self.simulate.is_some() {
            self.write_events::<true>(batch)?;
        } else {
            self.write_events::<false>(batch)?;
        }
        // Facts about tracks (the CPU clock decision on the process track): an instant carrying them.
        for m in &batch.metadata {
            let event = TraceEvent {
                ts_ns: m.ts_ns,
                track: m.track,
                kind: EventKind::Instant,
                name: m.name,
                fields: m.fields.clone(),
                flow_out: None,
                flow_in: None,
            };
            if self.simulate.is_some() {
                self.write_event::<true>(batch, &event);
            } else {
                self.write_event::<false>(batch, &event);
            }
        }
        self.housekeeping(false)
    }

    fn flush(&mut self) -> Result<(), ExportError> {
        self.check_failed()?;
        if self.started && self.replay.is_none() {
            // A suspend since the last snapshot moves BOOTTIME against MONOTONIC: record it.
            // And a flush may be the last thing the trace gets (the exit hook flushes, a killed process
            // stops): a snapshot unless one is recent, so the end is bracketed too.
            let offset = clock_ns(libc::CLOCK_BOOTTIME) - clock_ns(libc::CLOCK_MONOTONIC);
            if (offset - self.boot_offset_ns).abs() > SNAPSHOT_TOLERANCE_NS
                || self.last_snapshot.elapsed() >= FLUSH_SNAPSHOT_AGE
            {
                self.write_clock_snapshot(false);
            }
        }
        self.start();
        self.housekeeping(true)
    }

    fn finish(&mut self) -> Result<(), ExportError> {
        self.check_failed()?;
        self.start();
        if let Some(exchange) = &self.exchange {
            // One last burst so the trace's end is bracketed by rounds (a server side returns at once).
            let _ = exchange.sync_now();
        }
        if !self.clock_track_described {
            self.write_clock_track();
        }
        self.write_exchange_samples();
        // The closing snapshot: the end of the trace is bracketed too (a converted capture's last readings).
        if self.replay.is_some() {
            self.replay_snapshots(None);
        } else {
            self.write_clock_snapshot(false);
        }
        if self.recording_finished {
            let track = self.uuid_salt ^ OWN_TRACKS;
            self.write_own_instant(self.last_clock_ts, track, TRACE_END_EVENT, &[]);
        }
        self.finished = true;
        self.housekeeping(true)
    }
}

/// An exporter dropped before it was finished (one driven by hand) writes out the packets it holds, as a
/// `BufWriter` does: whole packets, with no closing snapshot (that is [`finish`](Exporter::finish)'s). Errors
/// are lost; call `flush`, `finish` or [`into_inner`](PerfettoExporter::into_inner) to see them.
impl<W: Write + Send> Drop for PerfettoExporter<W> {
    fn drop(&mut self) {
        if self.finished || self.failed.is_some() || self.writer.is_none() {
            return;
        }
        if self.write_out().is_ok() {
            let _ = match &mut self.file {
                Some(file) => file.flush(),
                None => self.writer.as_mut().map_or(Ok(()), Write::flush),
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tickline::export::{NameId, TrackId};

    /// The small-packet path writes every event it takes byte for byte as the general path does: each kind,
    /// every value type, strings up to the bound, with and without flows, small and large timestamps, track
    /// uuids and names (one- and multi-byte varints).
    #[test]
    fn small_packets_are_byte_for_byte_the_general_encoding() {
        let values = [
            FieldValue::Bool(true),
            FieldValue::Bool(false),
            FieldValue::U64(0),
            FieldValue::U64(u64::MAX),
            FieldValue::I64(-1),
            FieldValue::I64(300),
            FieldValue::F64(-1.5),
            FieldValue::Str(String::new()),
            FieldValue::Str("event".into()),
            FieldValue::Str("é".repeat(20)),
        ];
        let kinds = [
            EventKind::SliceBegin,
            EventKind::SliceEnd,
            EventKind::Instant,
            EventKind::Counter(2.5),
        ];
        let mut exporter = PerfettoExporter::new(Vec::<u8>::new());
        let mut checked = 0;
        for (k, kind) in kinds.iter().enumerate() {
            for n_fields in 0..3usize {
                for first in 0..values.len() {
                    for flows in 0..4u64 {
                        let fields: Vec<TraceField> = (0..n_fields)
                            .map(|i| TraceField {
                                name: NameId(1 + (i as u32) * 200),
                                value: values[(first + 3 * i) % values.len()].clone(),
                            })
                            .collect();
                        let event = TraceEvent {
                            ts_ns: [0, 1 << 40, u64::MAX / 4][(first + k) % 3],
                            track: TrackId([1, 1 << 20][flows as usize % 2]),
                            kind: *kind,
                            name: NameId([1, 300][first % 2]),
                            fields: 0..fields.len() as u32,
                            flow_out: (flows & 1 == 1).then_some(7 + first as u64),
                            flow_in: (flows & 2 == 2).then_some(1 << 50),
                        };
                        let bound = small_packet_bound(&fields);
                        if bound > SMALL_PACKET_BOUND {
                            continue;
                        }
                        exporter.buf.clear();
                        exporter.write_small_event::<false>(&event, &fields);
                        let small = exporter.buf.clone();
                        exporter.buf.clear();
                        exporter.write_large_event::<false>(&fields, &event, (None, None));
                        assert_eq!(small, exporter.buf, "{event:?} {fields:?}");
                        assert!(small.len() <= bound, "{} > {bound}", small.len());
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 300, "{checked}");
    }
}
