//! `tickline stats FILE.pftrace`: a trace decoded packet by packet with Perfetto's own schema
//! (`perfetto_protos`), summarised: tracks, slices, events, flows, losses, clock snapshots, the trace's
//! identity and every counter (calibration drift and error bounds, dropped records, alignment uncertainty).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use perfetto_protos::debug_annotation::DebugAnnotation;
use perfetto_protos::trace_packet::TracePacket;
use perfetto_protos::track_event::track_event::Type as EventType;
use protobuf::Message;

use crate::merge::human_ns;
use crate::wire;

/// One counter track's values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CounterStats {
    /// Its unit (empty for none).
    pub unit: String,
    /// Values written.
    pub samples: u64,
    /// The last value.
    pub last: f64,
    /// The largest value.
    pub max: f64,
}

/// What a trace holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TraceStats {
    /// Whole packets, all decoded.
    pub packets: u64,
    /// File size.
    pub bytes: u64,
    /// Where a cut-short last packet begins, if the file ends inside one.
    pub cut_at: Option<u64>,
    /// Process tracks.
    pub process_tracks: u64,
    /// Thread tracks.
    pub thread_tracks: u64,
    /// Counter tracks.
    pub counter_tracks: u64,
    /// Other tracks (GPU devices and queues, tickline's own).
    pub other_tracks: u64,
    /// Slices begun.
    pub slices: u64,
    /// Slices begun per name.
    pub slices_by_name: BTreeMap<String, u64>,
    /// Per name, the first and the last slice begin (trace timestamps, ns).
    pub slice_times_by_name: BTreeMap<String, (u64, u64)>,
    /// Slices begun and never ended.
    pub open_slices: u64,
    /// Instants.
    pub instants: u64,
    /// Counter values.
    pub counter_values: u64,
    /// Flows with both ends.
    pub flows: u64,
    /// Flow ids with only one end.
    pub half_flows: u64,
    /// `ClockSnapshot` packets.
    pub clock_snapshots: u64,
    /// Clocks named in them (Perfetto's builtin ids).
    pub snapshot_clocks: Vec<u32>,
    /// The `TraceUuid`, as text.
    pub trace_uuid: Option<String>,
    /// `SystemInfo`'s uname: sysname, release, machine.
    pub system: Option<String>,
    /// From each `tickline trace` instant (one per process; several in a merged trace): host, machine id, pid,
    /// process.
    pub identity: Vec<String>,
    /// `tickline trace end` instants: recordings that ended with their timeline stopped. Fewer than
    /// [`identity`](Self::identity) entries: a recording never stopped its timeline (its process killed or
    /// aborted, ended by `exit` with it running, or still running), and the trace holds what it had written out.
    pub recordings_ended: u64,
    /// The CPU clock decision, from each `tickline: CPU clock` instant (at start, and when the decision was
    /// revised): the decision in words, prefixed when the timeline fell back to CLOCK_MONOTONIC or the TSC
    /// is in doubt.
    pub cpu_clock: Vec<String>,
    /// Clock-exchange rounds stored.
    pub exchange_rounds: u64,
    /// Every counter track, by name.
    pub counters: BTreeMap<String, CounterStats>,
    /// The largest `uncertainty_ns` annotation (GPU slices).
    pub max_gpu_uncertainty_ns: Option<u64>,
    /// First and last timestamp.
    pub time_range: Option<(u64, u64)>,
    /// Fields the schema does not know, in packets, track events and track descriptors (0 for a trace that
    /// uses only the fields of the Perfetto release `perfetto_protos` was generated from).
    pub unknown_fields: u64,
    /// Their field numbers, as `message.number`.
    pub unknown_field_numbers: std::collections::BTreeSet<String>,
}

fn annotation_name(a: &DebugAnnotation, names: &HashMap<u64, String>) -> String {
    if a.has_name() {
        a.name().to_owned()
    } else {
        names.get(&a.name_iid()).cloned().unwrap_or_default()
    }
}

fn annotation_text(a: &DebugAnnotation) -> String {
    if a.has_string_value() {
        a.string_value().to_owned()
    } else if a.has_uint_value() {
        a.uint_value().to_string()
    } else if a.has_int_value() {
        a.int_value().to_string()
    } else {
        String::new()
    }
}

/// The instant the collector writes on the process track with the CPU clock decision.
const CPU_CLOCK_EVENT: &str = "tickline: CPU clock";

/// Decodes every packet of `path` with Perfetto's schema. A file that ends inside a packet is read up to its
/// last whole packet (and says so); a packet the schema cannot decode is an error naming it.
pub fn read(path: &Path) -> Result<TraceStats, String> {
    let data = crate::wire::read_trace_bytes(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if data.is_empty() {
        // Framed, an empty file is a trace of no packets; as a file to look at, it is no trace at all.
        return Err(format!(
            "{}: the file is empty: neither a trace nor a raw capture",
            path.display()
        ));
    }
    let framing = wire::framing(&data).map_err(|e| format!("{}: {e}", path.display()))?;
    if framing.packets.is_empty() {
        // A trace cut inside its first packet holds nothing to report; a file that is not a trace looks the same.
        return Err(format!(
            "{}: no whole packet in {} bytes: not a Perfetto trace, or one cut inside its first packet",
            path.display(),
            data.len()
        ));
    }
    let mut s = TraceStats {
        bytes: data.len() as u64,
        cut_at: framing.cut_at.map(|c| c as u64),
        ..TraceStats::default()
    };
    let mut event_names: HashMap<(u32, u64), String> = HashMap::new();
    let mut annotation_names: HashMap<u32, HashMap<u64, String>> = HashMap::new();
    let mut counter_tracks: HashMap<u64, String> = HashMap::new();
    let mut open: HashMap<u64, u64> = HashMap::new();
    // Events carrying each flow id (in `flow_ids`, or `terminating_flow_ids` in older traces): a flow has
    // both its ends when two events carry its id.
    let mut flow_events: HashMap<u64, u32> = HashMap::new();
    let mut clocks = std::collections::BTreeSet::new();
    for (index, &(start, end)) in framing.packets.iter().enumerate() {
        let p = TracePacket::parse_from_bytes(&data[start..end])
            .map_err(|e| format!("{}: packet {index} (byte {start}): {e}", path.display()))?;
        s.packets += 1;
        let mut unknown = |message: &str, fields: &protobuf::UnknownFields| {
            for (number, _) in fields.iter() {
                s.unknown_fields += 1;
                s.unknown_field_numbers.insert(format!("{message}.{number}"));
            }
        };
        unknown("TracePacket", p.special_fields.unknown_fields());
        if p.has_track_event() {
            unknown("TrackEvent", p.track_event().special_fields.unknown_fields());
        }
        if p.has_track_descriptor() {
            unknown("TrackDescriptor", p.track_descriptor().special_fields.unknown_fields());
        }
        let seq = p.trusted_packet_sequence_id();
        if p.has_timestamp() {
            let ts = p.timestamp();
            s.time_range = Some(s.time_range.map_or((ts, ts), |(lo, hi)| (lo.min(ts), hi.max(ts))));
        }
        if let Some(d) = p.interned_data.as_ref() {
            for n in &d.event_names {
                event_names.insert((seq, n.iid()), n.name().to_owned());
            }
            let table = annotation_names.entry(seq).or_default();
            for n in &d.debug_annotation_names {
                table.insert(n.iid(), n.name().to_owned());
            }
        }
        if p.has_clock_snapshot() {
            s.clock_snapshots += 1;
            for c in &p.clock_snapshot().clocks {
                clocks.insert(c.clock_id());
            }
        }
        if p.has_trace_uuid() {
            let u = p.trace_uuid();
            s.trace_uuid = Some(format!("{:016x}{:016x}", u.msb() as u64, u.lsb() as u64));
        }
        if p.has_system_info() {
            let u = p.system_info().utsname.clone().unwrap_or_default();
            s.system = Some(format!("{} {} {}", u.sysname(), u.release(), u.machine()));
        }
        if p.has_track_descriptor() {
            let td = p.track_descriptor();
            if td.process.is_some() {
                s.process_tracks += 1;
            } else if td.thread.is_some() {
                s.thread_tracks += 1;
            } else if td.counter.is_some() {
                s.counter_tracks += 1;
                let name = td.name().to_owned();
                let unit = td.counter.unit_name().to_owned();
                s.counters.entry(name.clone()).or_insert_with(|| CounterStats {
                    unit,
                    max: f64::NEG_INFINITY,
                    ..CounterStats::default()
                });
                counter_tracks.insert(td.uuid(), name);
            } else {
                s.other_tracks += 1;
            }
        }
        if p.has_track_event() {
            let ev = p.track_event();
            let empty = HashMap::new();
            let names = annotation_names.get(&seq).unwrap_or(&empty);
            let name = if ev.has_name_iid() {
                event_names.get(&(seq, ev.name_iid())).cloned().unwrap_or_default()
            } else {
                ev.name().to_owned()
            };
            for &id in ev.flow_ids.iter().chain(&ev.terminating_flow_ids) {
                *flow_events.entry(id).or_default() += 1;
            }
            for a in &ev.debug_annotations {
                if annotation_name(a, names) == "uncertainty_ns" && a.has_uint_value() {
                    s.max_gpu_uncertainty_ns = Some(s.max_gpu_uncertainty_ns.unwrap_or(0).max(a.uint_value()));
                }
            }
            match ev.type_() {
                EventType::TYPE_SLICE_BEGIN => {
                    s.slices += 1;
                    if p.has_timestamp() {
                        let ts = p.timestamp();
                        let times = s.slice_times_by_name.entry(name.clone()).or_insert((ts, ts));
                        *times = (times.0.min(ts), times.1.max(ts));
                    }
                    *s.slices_by_name.entry(name).or_default() += 1;
                    *open.entry(ev.track_uuid()).or_default() += 1;
                }
                EventType::TYPE_SLICE_END => {
                    let o = open.entry(ev.track_uuid()).or_default();
                    *o = o.saturating_sub(1);
                }
                EventType::TYPE_INSTANT => {
                    s.instants += 1;
                    if name == tickline_perfetto::CLOCK_EXCHANGE_EVENT {
                        s.exchange_rounds += 1;
                    }
                    if name == CPU_CLOCK_EVENT {
                        let get = |k: &str| {
                            ev.debug_annotations
                                .iter()
                                .find(|a| annotation_name(a, names) == k)
                                .map(|a| {
                                    if a.has_bool_value() {
                                        a.bool_value().to_string()
                                    } else {
                                        annotation_text(a)
                                    }
                                })
                                .unwrap_or_default()
                        };
                        let tag = if get("fallback") == "true" {
                            "fell back to CLOCK_MONOTONIC: "
                        } else if get("doubt") == "true" {
                            "in doubt: "
                        } else {
                            ""
                        };
                        s.cpu_clock.push(format!("{tag}{}", get("decision")));
                    }
                    if name == tickline_perfetto::TRACE_END_EVENT {
                        s.recordings_ended += 1;
                    }
                    if name == tickline_perfetto::TRACE_INFO_EVENT {
                        let get = |k: &str| {
                            ev.debug_annotations
                                .iter()
                                .find(|a| annotation_name(a, names) == k)
                                .map(annotation_text)
                                .unwrap_or_default()
                        };
                        s.identity.push(format!(
                            "host {} machine {} ({}), pid {} {}",
                            get("host"),
                            get("machine_id"),
                            get("machine_id_source"),
                            get("pid"),
                            get("process")
                        ));
                    }
                }
                EventType::TYPE_COUNTER => {
                    s.counter_values += 1;
                    let value = if ev.has_double_counter_value() {
                        ev.double_counter_value()
                    } else {
                        ev.counter_value() as f64
                    };
                    if let Some(c) = counter_tracks.get(&ev.track_uuid()).and_then(|n| s.counters.get_mut(n)) {
                        c.samples += 1;
                        c.last = value;
                        c.max = c.max.max(value);
                    }
                }
                _ => {}
            }
        }
    }
    s.open_slices = open.values().sum();
    s.flows = flow_events.values().filter(|&&n| n >= 2).count() as u64;
    s.half_flows = flow_events.values().filter(|&&n| n == 1).count() as u64;
    s.snapshot_clocks = clocks.into_iter().collect();
    for c in s.counters.values_mut() {
        if c.samples == 0 {
            c.max = 0.0;
        }
    }
    Ok(s)
}

impl TraceStats {
    /// As one JSON object.
    pub fn to_json(&self) -> serde_json::Value {
        let counters: serde_json::Map<String, serde_json::Value> = self
            .counters
            .iter()
            .map(|(k, c)| {
                (
                    k.clone(),
                    serde_json::json!({"unit": c.unit, "samples": c.samples, "last": c.last, "max": c.max}),
                )
            })
            .collect();
        serde_json::json!({
            "packets": self.packets,
            "bytes": self.bytes,
            "cut_at": self.cut_at,
            "tracks": {"process": self.process_tracks, "thread": self.thread_tracks,
                       "counter": self.counter_tracks, "other": self.other_tracks},
            "slices": self.slices,
            "slices_by_name": self.slices_by_name,
            "open_slices": self.open_slices,
            "instants": self.instants,
            "counter_values": self.counter_values,
            "flows": self.flows,
            "half_flows": self.half_flows,
            "clock_snapshots": self.clock_snapshots,
            "snapshot_clocks": self.snapshot_clocks,
            "trace_uuid": self.trace_uuid,
            "system": self.system,
            "identity": self.identity,
            "recordings_ended": self.recordings_ended,
            "cpu_clock": self.cpu_clock,
            "exchange_rounds": self.exchange_rounds,
            "counters": counters,
            "max_gpu_uncertainty_ns": self.max_gpu_uncertainty_ns,
            "time_range": self.time_range,
            "unknown_fields": self.unknown_fields,
            "unknown_field_numbers": self.unknown_field_numbers,
        })
    }
}

impl std::fmt::Display for TraceStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let span = self.time_range.map_or(0, |(lo, hi)| hi - lo);
        writeln!(
            f,
            "{} packets, {} bytes, {} of trace time{}",
            self.packets,
            self.bytes,
            human_ns(span),
            match self.cut_at {
                Some(at) => format!(" (cut at byte {at}, inside a packet or where zero bytes begin: read up to it)"),
                None => String::new(),
            }
        )?;
        for id in &self.identity {
            writeln!(f, "recorded by:   {id}")?;
        }
        let recordings = self.identity.len() as u64;
        if recordings > 0 {
            let ended = self.recordings_ended.min(recordings);
            if ended == recordings {
                writeln!(f, "ended:         with its timeline stopped (its end marker is in)")?;
            } else {
                let which = if recordings == 1 {
                    "its recording".to_owned()
                } else {
                    format!("{} of its {recordings} recordings", recordings - ended)
                };
                writeln!(
                    f,
                    "ended:         without its end marker: {which} never stopped its timeline (the process was \
                     killed or aborted, called `exit` with it running, or still runs): the trace holds what was \
                     written out"
                )?;
            }
        }
        for c in &self.cpu_clock {
            writeln!(f, "CPU clock:     {c}")?;
        }
        if let Some(u) = &self.trace_uuid {
            writeln!(f, "trace uuid:    {u}")?;
        }
        if let Some(sys) = &self.system {
            writeln!(f, "system:        {sys}")?;
        }
        writeln!(
            f,
            "tracks:        {} process, {} thread, {} counter, {} other",
            self.process_tracks, self.thread_tracks, self.counter_tracks, self.other_tracks
        )?;
        writeln!(
            f,
            "events:        {} slices ({} never ended), {} instants, {} counter values, {} flows ({} half)",
            self.slices, self.open_slices, self.instants, self.counter_values, self.flows, self.half_flows
        )?;
        let mut top: Vec<_> = self.slices_by_name.iter().collect();
        top.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        for (name, n) in top.iter().take(10) {
            writeln!(f, "  {n:>8}  {name}")?;
        }
        if top.len() > 10 {
            writeln!(f, "  ... and {} more names", top.len() - 10)?;
        }
        writeln!(
            f,
            "clocks:        {} snapshots of clock ids {:?}; {} clock-exchange rounds",
            self.clock_snapshots, self.snapshot_clocks, self.exchange_rounds
        )?;
        if let Some(u) = self.max_gpu_uncertainty_ns {
            writeln!(f, "GPU:           largest stated uncertainty {}", human_ns(u))?;
        }
        let dropped = self
            .counters
            .iter()
            .filter(|(k, _)| k.contains("dropped") || k.contains("truncated") || k.contains("lost"))
            .map(|(k, c)| format!("{k} = {}", c.last))
            .collect::<Vec<_>>();
        writeln!(
            f,
            "losses:        {}",
            if dropped.is_empty() {
                "no loss counters in this trace".to_owned()
            } else {
                dropped.join(", ")
            }
        )?;
        if !self.counters.is_empty() {
            writeln!(f, "counters (last / max):")?;
            for (k, c) in &self.counters {
                if c.samples == 0 {
                    writeln!(f, "  {k}: no values")?;
                } else {
                    writeln!(
                        f,
                        "  {k}: {} / {} {} ({} values)",
                        shown(c.last),
                        shown(c.max),
                        c.unit,
                        c.samples
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// A counter value for people: whole numbers as such, others to 4 decimals (`-0.2647`, not
/// `-0.2647122443466543`); the JSON output keeps them whole.
fn shown(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn counter_values_are_shown_rounded_and_whole_numbers_as_such() {
        assert_eq!(super::shown(-0.2647122443466543), "-0.2647");
        assert_eq!(super::shown(28752.0), "28752");
        assert_eq!(super::shown(0.0), "0");
        assert_eq!(super::shown(1e20), "100000000000000000000.0000");
    }
}
