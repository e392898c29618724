//! What `merge` needs from one `.pftrace`: its packets, and what tickline wrote about where it came from
//! (trace identity, clock snapshots, time-sync state, clock-exchange rounds, cross-process flow marks).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tickline::sync::{ExchangeSample, MachineId};
use tickline_perfetto::{CLOCK_EXCHANGE_EVENT, CLOCK_SNAPSHOT_EVENT, TRACE_INFO_EVENT};

use crate::wire::{self, Value};

/// `TracePacket` field numbers used here (Perfetto's `protos/perfetto/trace/trace_packet.proto`).
#[allow(missing_docs)]
pub mod packet {
    pub const CLOCK_SNAPSHOT: u32 = 6;
    pub const TIMESTAMP: u32 = 8;
    pub const SEQUENCE_ID: u32 = 10;
    pub const TRACK_EVENT: u32 = 11;
    pub const INTERNED_DATA: u32 = 12;
    pub const SEQUENCE_FLAGS: u32 = 13;
    pub const SYSTEM_INFO: u32 = 45;
    pub const TRACK_DESCRIPTOR: u32 = 60;
    pub const TRACE_UUID: u32 = 89;
}

/// `BuiltinClock.BUILTIN_CLOCK_BOOTTIME`: the id of BOOTTIME in a `ClockSnapshot`, the trace's time axis.
pub const CLOCK_BOOTTIME: u64 = 6;
/// `BuiltinClock.BUILTIN_CLOCK_REALTIME`.
pub const CLOCK_REALTIME: u64 = 1;

/// The trace's identity, from its `tickline trace` instant (and `TraceUuid` packet).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceIdentity {
    /// The trace UUID, as text.
    pub trace_uuid: String,
    /// The recording the trace was made of, as text (the same for a trace written live and the conversions
    /// of its capture; empty in traces that do not say).
    pub recording_id: String,
    /// The machine (one boot).
    pub machine_id: u64,
    /// `boot_id`, `override` or `host_name`.
    pub machine_id_source: String,
    /// The kernel's boot id.
    pub boot_id: String,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u64,
    /// Process name.
    pub process: String,
}

/// One `tickline clock snapshot`: the machine's four clocks and its time-sync state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// `CLOCK_BOOTTIME` (the trace's time axis).
    pub boottime_ns: u64,
    /// `CLOCK_REALTIME`.
    pub realtime_ns: u64,
    /// The bracket's width.
    pub bracket_ns: u64,
    /// The kernel's time-sync state, if known: (synchronised, estimated error, maximum error).
    pub sync: Option<(bool, u64, u64)>,
}

/// A span or event marked with a cross-process flow field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowMark {
    /// The packet's index in [`TraceFile::packets`].
    pub packet: usize,
    /// `true` for the sending end (`tickline.flow_out`), `false` for the receiving end.
    pub out: bool,
    /// The id the two ends share, as text.
    pub key: String,
    /// On an async task's track (`tickline_perfetto::DESCRIPTION_ASYNC_TASK`): the task's lifetime slice,
    /// which carries its span's fields as the span's slices on a thread do.
    pub on_task: bool,
}

/// A process track the trace describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessTrack {
    /// Its track uuid.
    pub uuid: u64,
    /// Its pid.
    pub pid: u64,
    /// Its name.
    pub name: String,
}

/// One trace file, read.
#[derive(Debug)]
pub struct TraceFile {
    /// Where it came from.
    pub path: PathBuf,
    /// The whole file.
    pub data: Vec<u8>,
    /// `(start, end)` of each whole packet's body.
    pub packets: Vec<(usize, usize)>,
    /// Where a cut-short last packet starts, if the file ends inside one.
    pub cut_at: Option<usize>,
    /// The `tickline trace` instant's identity, if any (the last one).
    pub identity: Option<TraceIdentity>,
    /// How many different traces' `tickline trace` identities the file holds: 1 for a trace tickline wrote,
    /// more for a merged one.
    pub identities: usize,
    /// The `TraceUuid` packet's value.
    pub trace_uuid: Option<u128>,
    /// Clock snapshots, in file order.
    pub snapshots: Vec<Snapshot>,
    /// The `ClockSnapshot` packets with a BOOTTIME reading: `(BOOTTIME, packet index)`, in file order.
    pub clock_snapshot_packets: Vec<(u64, usize)>,
    /// Clock-exchange rounds.
    pub exchange: Vec<ExchangeSample>,
    /// Cross-process flow marks.
    pub flow_marks: Vec<FlowMark>,
    /// Every track uuid the trace describes.
    pub track_uuids: Vec<u64>,
    /// Root process tracks.
    pub processes: Vec<ProcessTrack>,
    /// Every pid and tid its process and thread tracks name.
    pub os_ids: std::collections::BTreeSet<u64>,
    /// Smallest and largest packet timestamp.
    pub time_range: Option<(u64, u64)>,
}

/// Why a trace could not be read.
#[derive(Debug)]
pub struct ReadError {
    /// The file.
    pub path: PathBuf,
    /// What went wrong.
    pub message: String,
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.message)
    }
}

impl std::error::Error for ReadError {}

/// A debug annotation's value.
#[derive(Clone, Debug, PartialEq)]
enum AnnValue {
    U(u64),
    I(i64),
    B(bool),
    S(String),
    Other,
}

impl AnnValue {
    fn key(&self) -> Option<String> {
        match self {
            AnnValue::U(v) => Some(v.to_string()),
            AnnValue::I(v) => Some(v.to_string()),
            AnnValue::S(s) => Some(s.clone()),
            AnnValue::B(_) | AnnValue::Other => None,
        }
    }

    fn u64(&self) -> Option<u64> {
        match self {
            AnnValue::U(v) => Some(*v),
            AnnValue::I(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
}

fn parse_annotation(bytes: &[u8], names: &HashMap<u64, String>) -> Result<(String, AnnValue), wire::WireError> {
    let (mut name, mut value) = (String::new(), AnnValue::Other);
    for f in wire::fields(bytes) {
        let (n, v, _) = f?;
        match n {
            1 => name = v.as_u64().and_then(|iid| names.get(&iid).cloned()).unwrap_or_default(),
            10 => name = v.as_str().unwrap_or_default(),
            2 => value = AnnValue::B(v.as_u64().unwrap_or(0) != 0),
            3 => value = AnnValue::U(v.as_u64().unwrap_or(0)),
            4 => value = AnnValue::I(v.as_u64().unwrap_or(0) as i64),
            6 => value = AnnValue::S(v.as_str().unwrap_or_default()),
            _ => {}
        }
    }
    Ok((name, value))
}

fn hex_u64(s: &str) -> Option<u64> {
    u64::from_str_radix(s.trim(), 16).ok()
}

impl TraceFile {
    /// Reads and indexes `path`. `flow_out`/`flow_in` name the annotation fields that mark cross-process
    /// flows.
    pub fn read(path: &Path, flow_out: &str, flow_in: &str) -> Result<TraceFile, ReadError> {
        let err = |message: String| ReadError {
            path: path.to_owned(),
            message,
        };
        let data = crate::wire::read_trace_bytes(path).map_err(err)?;
        if data.is_empty() {
            return Err(err("the file is empty".into()));
        }
        let framing = wire::framing(&data).map_err(|e| err(e.to_string()))?;
        // Merge reads only the fields it needs and copies the rest: a packet Perfetto's schema cannot decode
        // would go into the merged trace as it is, and `tickline stats` (or Perfetto) reject that trace.
        #[cfg(feature = "protos")]
        for (index, &(start, end)) in framing.packets.iter().enumerate() {
            use protobuf::Message;
            if let Err(e) = perfetto_protos::trace_packet::TracePacket::parse_from_bytes(&data[start..end]) {
                return Err(err(format!(
                    "packet {index} (byte {start}): {e}: not a well-formed trace"
                )));
            }
        }
        let mut t = TraceFile {
            path: path.to_owned(),
            packets: framing.packets,
            cut_at: framing.cut_at,
            data: Vec::new(),
            identity: None,
            identities: 0,
            trace_uuid: None,
            snapshots: Vec::new(),
            clock_snapshot_packets: Vec::new(),
            exchange: Vec::new(),
            flow_marks: Vec::new(),
            track_uuids: Vec::new(),
            processes: Vec::new(),
            os_ids: std::collections::BTreeSet::new(),
            time_range: None,
        };
        // Interned debug-annotation names, per sequence.
        let mut seq_names: HashMap<u64, HashMap<u64, String>> = HashMap::new();
        // Async task tracks, by uuid (see `FlowMark::on_task`).
        let mut task_tracks = std::collections::HashSet::new();
        for (index, &(start, end)) in t.packets.iter().enumerate() {
            let body = &data[start..end];
            let (mut ts, mut seq) = (None, 0u64);
            let mut event: Option<&[u8]> = None;
            // The sequence id may follow the interned data in the packet: file the names after the loop.
            let mut interned: Vec<(u64, String)> = Vec::new();
            for f in wire::fields(body) {
                let (n, v, _) = f.map_err(|e| err(format!("packet {index}: {e}")))?;
                match n {
                    packet::TIMESTAMP => ts = v.as_u64(),
                    packet::SEQUENCE_ID => seq = v.as_u64().unwrap_or(0),
                    packet::TRACK_EVENT => event = v.as_bytes(),
                    packet::CLOCK_SNAPSHOT => {
                        if let Some(boottime) = snapshot_clock(v.as_bytes().unwrap_or_default(), CLOCK_BOOTTIME) {
                            t.clock_snapshot_packets.push((boottime, index));
                        }
                    }
                    packet::INTERNED_DATA => {
                        for f in wire::fields(v.as_bytes().unwrap_or_default()) {
                            let (n, v, _) = f.map_err(|e| err(format!("packet {index}: interned data: {e}")))?;
                            if n != 3 {
                                continue;
                            }
                            let (mut iid, mut name) = (0, String::new());
                            for f in wire::fields(v.as_bytes().unwrap_or_default()) {
                                let (n, v, _) = f.map_err(|e| err(format!("packet {index}: {e}")))?;
                                match n {
                                    1 => iid = v.as_u64().unwrap_or(0),
                                    2 => name = v.as_str().unwrap_or_default(),
                                    _ => {}
                                }
                            }
                            interned.push((iid, name));
                        }
                    }
                    packet::TRACK_DESCRIPTOR => {
                        let (mut uuid, mut parent, mut process, mut task) = (0, None, None, false);
                        for f in wire::fields(v.as_bytes().unwrap_or_default()) {
                            let (n, v, _) = f.map_err(|e| err(format!("packet {index}: track: {e}")))?;
                            match n {
                                1 => uuid = v.as_u64().unwrap_or(0),
                                5 => parent = v.as_u64(),
                                14 => task = v.as_str().as_deref() == Some(tickline_perfetto::DESCRIPTION_ASYNC_TASK),
                                3 => {
                                    let (mut pid, mut name) = (0, String::new());
                                    for f in wire::fields(v.as_bytes().unwrap_or_default()) {
                                        let (n, v, _) = f.map_err(|e| err(format!("packet {index}: {e}")))?;
                                        match n {
                                            1 => pid = v.as_u64().unwrap_or(0),
                                            6 => name = v.as_str().unwrap_or_default(),
                                            _ => {}
                                        }
                                    }
                                    process = Some((pid, name));
                                }
                                4 => {
                                    for f in wire::fields(v.as_bytes().unwrap_or_default()).flatten() {
                                        if let (1 | 2, Some(id)) = (f.0, f.1.as_u64()) {
                                            t.os_ids.insert(id);
                                        }
                                    }
                                }
                                _ => {}
                            }
                        }
                        t.track_uuids.push(uuid);
                        if task {
                            task_tracks.insert(uuid);
                        }
                        if let Some((pid, _)) = &process {
                            t.os_ids.insert(*pid);
                        }
                        if let (Some((pid, name)), None) = (process, parent) {
                            t.processes.push(ProcessTrack { uuid, pid, name });
                        }
                    }
                    packet::TRACE_UUID => {
                        let (mut msb, mut lsb) = (0u64, 0u64);
                        for f in wire::fields(v.as_bytes().unwrap_or_default()).flatten() {
                            match f.0 {
                                1 => msb = f.1.as_u64().unwrap_or(0),
                                2 => lsb = f.1.as_u64().unwrap_or(0),
                                _ => {}
                            }
                        }
                        t.trace_uuid = Some(u128::from(msb) << 64 | u128::from(lsb));
                    }
                    _ => {}
                }
            }
            if !interned.is_empty() {
                seq_names.entry(seq).or_default().extend(interned);
            }
            if let Some(ts) = ts {
                t.time_range = Some(match t.time_range {
                    Some((lo, hi)) => (lo.min(ts), hi.max(ts)),
                    None => (ts, ts),
                });
            }
            let Some(event) = event else { continue };
            let empty = HashMap::new();
            let table = seq_names.get(&seq).unwrap_or(&empty);
            let mut name = None;
            let mut track = None;
            let mut annotations = Vec::new();
            for f in wire::fields(event) {
                let (n, v, _) = f.map_err(|e| err(format!("packet {index}: track event: {e}")))?;
                match n {
                    23 => name = v.as_str(),
                    11 => track = v.as_u64(),
                    4 => annotations.push(
                        parse_annotation(v.as_bytes().unwrap_or_default(), table)
                            .map_err(|e| err(format!("packet {index}: annotation: {e}")))?,
                    ),
                    _ => {}
                }
            }
            let get = |key: &str| annotations.iter().find(|(k, _)| k == key).map(|(_, v)| v);
            let get_u = |key: &str| get(key).and_then(AnnValue::u64);
            let get_s = |key: &str| match get(key) {
                Some(AnnValue::S(s)) => s.clone(),
                _ => String::new(),
            };
            match name.as_deref() {
                Some(TRACE_INFO_EVENT) => {
                    if t.identity
                        .as_ref()
                        .is_none_or(|known| known.trace_uuid != get_s("trace_uuid"))
                    {
                        t.identities += 1;
                    }
                    t.identity = Some(TraceIdentity {
                        trace_uuid: get_s("trace_uuid"),
                        recording_id: get_s("recording_id"),
                        machine_id: hex_u64(&get_s("machine_id")).unwrap_or(0),
                        machine_id_source: get_s("machine_id_source"),
                        boot_id: get_s("boot_id"),
                        host: get_s("host"),
                        pid: get_u("pid").unwrap_or(0),
                        process: get_s("process"),
                    })
                }
                Some(CLOCK_SNAPSHOT_EVENT) => {
                    let sync = match (
                        get("sync_synchronized"),
                        get_u("sync_est_error_ns"),
                        get_u("sync_max_error_ns"),
                    ) {
                        (Some(AnnValue::B(s)), Some(est), Some(max)) => Some((*s, est, max)),
                        _ => None,
                    };
                    if let (Some(boottime_ns), Some(realtime_ns)) = (get_u("boottime_ns"), get_u("realtime_ns")) {
                        t.snapshots.push(Snapshot {
                            boottime_ns,
                            realtime_ns,
                            bracket_ns: get_u("bracket_ns").unwrap_or(0),
                            sync,
                        });
                    }
                }
                Some(CLOCK_EXCHANGE_EVENT) => {
                    let (Some(client), Some(server)) =
                        (hex_u64(&get_s("client_machine")), hex_u64(&get_s("server_machine")))
                    else {
                        continue;
                    };
                    if let (Some(t1), Some(t2), Some(t3), Some(t4)) =
                        (get_u("t1_ns"), get_u("t2_ns"), get_u("t3_ns"), get_u("t4_ns"))
                    {
                        t.exchange.push(ExchangeSample {
                            client: MachineId(client),
                            server: MachineId(server),
                            burst: get_u("burst").unwrap_or(0),
                            t1_client_send_ns: t1,
                            t2_server_receive_ns: t2,
                            t3_server_send_ns: t3,
                            t4_client_receive_ns: t4,
                        });
                    }
                }
                _ => {
                    for (k, v) in &annotations {
                        let out = if k == flow_out {
                            true
                        } else if k == flow_in {
                            false
                        } else {
                            continue;
                        };
                        if let Some(key) = v.key() {
                            t.flow_marks.push(FlowMark {
                                packet: index,
                                out,
                                key,
                                on_task: track.is_some_and(|track| task_tracks.contains(&track)),
                            });
                        }
                    }
                }
            }
        }
        t.data = data;
        Ok(t)
    }

    /// The body of packet `i`.
    pub fn packet(&self, i: usize) -> &[u8] {
        let (s, e) = self.packets[i];
        &self.data[s..e]
    }

    /// Every field of packet `i` (the packet is known to parse).
    pub fn packet_fields(&self, i: usize) -> impl Iterator<Item = (u32, Value<'_>, &[u8])> {
        wire::fields(self.packet(i)).flatten()
    }
}

/// The time of clock `clock_id` in a `ClockSnapshot` message (clocks 1: each `Clock { clock_id 1, timestamp
/// 2 }`).
fn snapshot_clock(snapshot: &[u8], clock_id: u64) -> Option<u64> {
    wire::fields(snapshot).flatten().find_map(|(n, v, _)| {
        let clock = v.as_bytes().filter(|_| n == 1)?;
        let mut id = None;
        let mut ts = None;
        for (k, value, _) in wire::fields(clock).flatten() {
            match k {
                1 => id = value.as_u64(),
                2 => ts = value.as_u64(),
                _ => {}
            }
        }
        (id == Some(clock_id)).then_some(ts).flatten()
    })
}
