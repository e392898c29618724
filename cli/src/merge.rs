//! `tickline merge`: several processes' and hosts' traces on one time axis, with a stated uncertainty.
//!
//! # Algorithm
//!
//! Every input says which machine (one boot of one host) wrote it. Traces of the same machine share its
//! `CLOCK_BOOTTIME` exactly and need no mapping. The reference machine (the first input's, or
//! `--reference`) gives the merged trace its time axis: its own BOOTTIME. Every other machine is mapped onto
//! it along the cheapest chain of two kinds of links:
//!
//! - **Clock exchange** (`tickline::sync::ClockExchange`): the rounds between two machines, found in either's trace,
//!   grouped into bursts, of which the tightest quarter (minimum round trip, as NTP filters) feeds a
//!   [`CalibrationHistory`] of one machine's clock against the other's: knots at each window's centroid,
//!   linear between them, so drift is followed; its stated uncertainty is at least what the rounds' brackets
//!   (half the round trip) allow.
//! - **REALTIME**: each machine's bracketed snapshots of BOOTTIME and REALTIME feed a history of one against
//!   the other (piecewise linear between snapshot pairs, following NTP's slewing or a simulated drift), and
//!   the two machines' REALTIME clocks are taken to agree within the sum of the kernel's maximum errors
//!   (`adjtimex`), which is what the link states. An unsynchronised clock states the kernel's 16 s.
//!
//! Links are weighed by their typical uncertainty and the cheapest path to the reference wins (Dijkstra), so
//! an exchange beats REALTIME, and a machine can be reached through another one's exchange. A machine's
//! uncertainty at a time is the sum of its path's links' there.
//!
//! The output is the inputs' packets with their timestamps mapped and each input on a packet sequence of its
//! own (no `TracePacket.machine_id`: Perfetto's importer keeps flows per machine, so cross-machine flows would
//! not connect; a machine whose pids or tids collide with an earlier one's has all of them moved up by a
//! multiple of 2^22, Linux's largest `pid_max`, and so has a trace whose ids collide with another trace's of
//! its own machine: a pid used again, a container's pid 1), a `TraceUuid` of its own, the reference machine's
//! clock snapshots (the other machines' would contradict the axis), and per process a counter track
//! `tickline alignment uncertainty` (ns, conservative over each 100 ms step) whose description says how its
//! machine was aligned. Spans and events carrying a
//! `tickline.flow_out` field are linked by Perfetto flows to those carrying `tickline.flow_in` with the same
//! value, in any process (each receiver to its one sender; the flow an exporter already drew within its own
//! trace is replaced, not drawn twice). Within one trace a key's first sender is its sender (a span entered
//! twice, or an async task's lifetime slice beside its polls, carries the field more than once); senders of
//! one key in two traces are ambiguous, and left unlinked.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use tickline::{
    calibration::{CalibrationHistory, CalibrationSample, ClockDomain, FitOptions, FitStrategy, HistoryConfig},
    sync::{ExchangeSample, MachineId, TraceUuid},
};

use crate::tracefile::{packet, ReadError, Snapshot, TraceFile, CLOCK_BOOTTIME, CLOCK_REALTIME};
use crate::wire::{self, put_bytes, put_fixed64, put_varint};

/// The annotation that marks a span or event as a flow's sending end.
pub const FLOW_OUT_FIELD: &str = "tickline.flow_out";
/// The annotation that marks a span or event as a flow's receiving end.
pub const FLOW_IN_FIELD: &str = "tickline.flow_in";
/// The name of the per-process counter track stating the alignment uncertainty.
pub const ALIGNMENT_TRACK: &str = "tickline alignment uncertainty";
/// What an unknown or unsynchronised REALTIME is trusted to: the kernel's `NTP_PHASE_LIMIT`-based 16 s.
const UNSYNCED_ERROR_NS: u64 = 16_000_000_000;
/// Rounds of one burst (same burst number) are taken back to back; a gap longer than this starts a new one.
const BURST_GAP_NS: u64 = 50_000_000;
/// The uncertainty counter's step.
const COUNTER_STEP_NS: u64 = 100_000_000;

/// What to merge.
#[derive(Clone, Debug)]
pub struct MergeOptions {
    /// The traces.
    pub inputs: Vec<PathBuf>,
    /// The merged trace.
    pub output: PathBuf,
    /// The trace whose machine gives the time axis (default: the first input).
    pub reference: Option<PathBuf>,
    /// The flow-out annotation name.
    pub flow_out: String,
    /// The flow-in annotation name.
    pub flow_in: String,
}

impl MergeOptions {
    /// Merge `inputs` into `output` with the default flow fields.
    pub fn new(inputs: Vec<PathBuf>, output: PathBuf) -> Self {
        MergeOptions {
            inputs,
            output,
            reference: None,
            flow_out: FLOW_OUT_FIELD.into(),
            flow_in: FLOW_IN_FIELD.into(),
        }
    }
}

/// Why traces could not be merged.
#[derive(Debug)]
#[non_exhaustive]
pub enum MergeError {
    /// A file could not be read or is not a Perfetto trace.
    Read(ReadError),
    /// A trace carries no tickline identity.
    NotTickline(PathBuf),
    /// An input is itself a merged trace: its processes' clocks were mapped onto another trace's axis
    /// already, and its identity, snapshots and exchange rounds are several traces' mixed.
    AlreadyMerged {
        /// The merged input.
        path: PathBuf,
        /// How many traces it holds.
        traces: usize,
    },
    /// The same trace (UUID) was given twice.
    DuplicateTrace(PathBuf, PathBuf),
    /// Two traces of one recording: a trace written live and one converted from its capture, or one capture
    /// converted twice. Merged, every slice would be there twice.
    SameRecording {
        /// One trace.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// The recording's id.
        recording: String,
    },
    /// Two traces describe the same track uuid.
    OverlappingTracks {
        /// One trace.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// The uuid.
        uuid: u64,
    },
    /// Two traces claim the same machine but their clocks say otherwise.
    MachineClockMismatch {
        /// The machine id.
        machine: MachineId,
        /// One trace.
        a: PathBuf,
        /// The other.
        b: PathBuf,
        /// How far their REALTIME−BOOTTIME offsets differ beyond what NTP could slew.
        difference_ns: i128,
    },
    /// A machine cannot be placed on the reference axis.
    Unaligned {
        /// The machine.
        machine: MachineId,
        /// Why.
        reason: String,
    },
    /// Writing the output failed.
    Write(PathBuf, std::io::Error),
    /// `--reference` names no input.
    BadReference(PathBuf),
    /// An input is a raw capture (`.tickline`), which merges once converted.
    RawCapture(PathBuf),
    /// The flow annotations are empty or the same: a flow needs a sending and a receiving end.
    BadFlowFields {
        /// `--flow-out`.
        flow_out: String,
        /// `--flow-in`.
        flow_in: String,
    },
    /// The output is one of the inputs (under another spelling, a symlink or a hard link included).
    OutputIsInput(crate::output::OutputIsInput),
}

impl std::fmt::Display for MergeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MergeError::Read(e) => write!(f, "{e}"),
            MergeError::NotTickline(p) => write!(
                f,
                "{}: no `tickline trace` identity: not written by tickline's Perfetto exporter (or cut before its \
                 first packets)",
                p.display()
            ),
            MergeError::AlreadyMerged { path, traces } => write!(
                f,
                "{} is a merged trace ({traces} traces in it): its timestamps are already on another machine's \
                 axis and its clock data is theirs mixed, so it cannot be placed again; merge the original traces \
                 instead",
                path.display()
            ),
            MergeError::DuplicateTrace(a, b) => write!(
                f,
                "{} and {} are the same trace (same trace UUID): give each trace once",
                a.display(),
                b.display()
            ),
            MergeError::SameRecording { a, b, recording } => write!(
                f,
                "{} and {} are traces of the same recording ({recording}: a trace written live and one converted \
                 from its raw capture, or one capture converted twice): give it once",
                a.display(),
                b.display()
            ),
            MergeError::OverlappingTracks { a, b, uuid } => write!(
                f,
                "{} and {} both describe track uuid {uuid:#x}: their ids would collide in one trace (the same \
                 trace written twice, or copied)",
                a.display(),
                b.display()
            ),
            MergeError::MachineClockMismatch {
                machine,
                a,
                b,
                difference_ns,
            } => write!(
                f,
                "{} and {} both claim machine {machine}, but their boot clocks disagree by {:.3} s: they come \
                 from different machines or boots (a reused TICKLINE_MACHINE_ID?), and merging them as one \
                 would misplace one of them",
                a.display(),
                b.display(),
                *difference_ns as f64 / 1e9
            ),
            MergeError::Unaligned { machine, reason } => {
                write!(f, "cannot place machine {machine} on the reference axis: {reason}")
            }
            MergeError::Write(p, e) => write!(f, "cannot write {}: {e}", p.display()),
            MergeError::BadReference(p) => write!(f, "--reference {} is not one of the inputs", p.display()),
            MergeError::BadFlowFields { flow_out, flow_in } => write!(
                f,
                "--flow-out {flow_out:?} and --flow-in {flow_in:?}: each must name an annotation, and not the same \
                 one (a flow's sending end and its receiving end)"
            ),
            MergeError::RawCapture(p) => write!(
                f,
                "{0}: a raw capture, not a Perfetto trace: convert it first (`tickline convert {0} -o \
                 trace.pftrace`) and merge the converted trace",
                p.display()
            ),
            MergeError::OutputIsInput(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for MergeError {}

/// How one machine was placed.
#[derive(Clone, Debug)]
pub struct MachineReport {
    /// The machine.
    pub machine: MachineId,
    /// Its host name(s).
    pub host: String,
    /// Its traces: `path (pid name)`.
    pub traces: Vec<String>,
    /// How it was aligned, in words.
    pub method: String,
    /// Its clock minus the reference's at its first packet (0 for the reference).
    pub offset_ns: i64,
    /// How fast its clock ran against the reference's over its traces, in ppm.
    pub drift_ppm: f64,
    /// The median and largest stated uncertainty over its time range.
    pub uncertainty_ns: (u64, u64),
}

/// What a merge did.
#[derive(Clone, Debug)]
pub struct MergeReport {
    /// The merged trace.
    pub output: PathBuf,
    /// Machines, the reference first.
    pub machines: Vec<MachineReport>,
    /// Packets written.
    pub packets: usize,
    /// Flows made from flow fields, one per receiver.
    pub flows: usize,
    /// Those of them between two traces (two processes).
    pub cross_process_flows: usize,
    /// Flow ids with no match (no receiver, no sender, or senders in more than one trace).
    pub unmatched_flow_ids: Vec<String>,
    /// Inputs whose last packet was cut short (dropped).
    pub cut_inputs: Vec<PathBuf>,
    /// Machines whose pids and tids collided with an earlier machine's, and what was added to all of theirs.
    pub renumbered: Vec<(MachineId, u64)>,
    /// Traces whose pids and tids collided with another trace's of their own machine (a pid used again, a
    /// container's own pid 1), and what was added to theirs.
    pub renumbered_traces: Vec<(PathBuf, u64)>,
}

impl std::fmt::Display for MergeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let traces: usize = self.machines.iter().map(|m| m.traces.len()).sum();
        let plural = |n: usize, one: &'static str, many: &'static str| if n == 1 { one } else { many };
        let machines = self.machines.len();
        writeln!(
            f,
            "merged {traces} {} from {machines} {} into {}: {} packets, {} flows from flow fields ({} across processes)",
            plural(traces, "trace", "traces"),
            plural(machines, "machine", "machines"),
            self.output.display(),
            self.packets,
            self.flows,
            self.cross_process_flows
        )?;
        for (i, m) in self.machines.iter().enumerate() {
            let role = if i == 0 {
                " (reference: its BOOTTIME is the time axis)"
            } else {
                ""
            };
            writeln!(f, "machine {} on {}{role}", m.machine, m.host)?;
            for t in &m.traces {
                writeln!(f, "  {t}")?;
            }
            writeln!(f, "  aligned by: {}", m.method)?;
            if i > 0 {
                writeln!(
                    f,
                    "  offset {:+.6} s, drift {:+.3} ppm; uncertainty ±{} median, ±{} max",
                    m.offset_ns as f64 / 1e9,
                    m.drift_ppm,
                    human_ns(m.uncertainty_ns.0),
                    human_ns(m.uncertainty_ns.1)
                )?;
            }
        }
        if !self.unmatched_flow_ids.is_empty() {
            let shown: Vec<_> = self.unmatched_flow_ids.iter().take(8).cloned().collect();
            writeln!(
                f,
                "{} flow ids without exactly one sender and a receiver (left as annotations): {}{}",
                self.unmatched_flow_ids.len(),
                shown.join(", "),
                if self.unmatched_flow_ids.len() > 8 { ", ..." } else { "" }
            )?;
        }
        for (m, offset) in &self.renumbered {
            writeln!(
                f,
                "note: machine {m}'s pids and tids collide with another machine's: shown as pid + {offset}"
            )?;
        }
        for (path, offset) in &self.renumbered_traces {
            writeln!(
                f,
                "note: {}'s pids and tids collide with another trace's of the same machine (a pid used again, \
                 or a container's): shown as pid + {offset}",
                path.display()
            )?;
        }
        for p in &self.cut_inputs {
            writeln!(
                f,
                "note: {} ends inside a packet (a killed process?): its whole packets were merged",
                p.display()
            )?;
        }
        Ok(())
    }
}

/// `1.23 ms`, `45 µs`, `16.0 s`.
pub fn human_ns(ns: u64) -> String {
    match ns {
        0..=9_999 => format!("{ns} ns"),
        10_000..=999_999 => format!("{:.1} µs", ns as f64 / 1e3),
        1_000_000..=9_999_999_999 => format!("{:.2} ms", ns as f64 / 1e6),
        _ => format!("{:.1} s", ns as f64 / 1e9),
    }
}

fn ns_domain() -> ClockDomain {
    ClockDomain::new(64, 1.0).expect("64 bits, 1 ns per ns")
}

fn history(window_bursts: usize, burst_keep: f64) -> CalibrationHistory {
    CalibrationHistory::new(
        ns_domain(),
        HistoryConfig {
            fit: FitOptions {
                strategy: FitStrategy::Weighted,
                keep_tightest: 1.0,
                min_samples: 2,
            },
            burst_keep,
            window_bursts,
            max_knots: 1 << 16,
            ..HistoryConfig::default()
        },
    )
}

/// One link of a machine's path to the reference.
enum Step {
    /// Machine's BOOTTIME to REALTIME, plus its REALTIME error bound.
    ToRealtime { map: CalibrationHistory, error_ns: u64 },
    /// REALTIME to the machine's BOOTTIME, plus its REALTIME error bound.
    FromRealtime { map: CalibrationHistory, error_ns: u64 },
    /// One machine's clock to another's, by exchange rounds.
    Exchange { map: CalibrationHistory },
}

impl Step {
    fn apply(&self, t: i128) -> Option<(i128, f64)> {
        let (map, extra) = match self {
            Step::ToRealtime { map, error_ns } | Step::FromRealtime { map, error_ns } => (map, *error_ns as f64),
            Step::Exchange { map } => (map, 0.0),
        };
        let c = map.peek(u64::try_from(t).ok()?)?;
        Some((i128::from(c.ns), c.uncertainty_ns as f64 + extra))
    }
}

/// A machine's map onto the reference axis.
struct Path_ {
    steps: Vec<Step>,
}

impl Path_ {
    fn apply(&self, t: u64) -> Option<(u64, u64)> {
        let (mut x, mut u) = (i128::from(t), 0.0);
        for s in &self.steps {
            let (y, du) = s.apply(x)?;
            x = y;
            u += du;
        }
        Some((u64::try_from(x).ok()?, u.ceil() as u64))
    }
}

struct Machine {
    id: MachineId,
    traces: Vec<usize>,
    snapshots: Vec<Snapshot>,
    /// The largest REALTIME error the kernel stated (None: never stated).
    sync_error_ns: Option<u64>,
    synchronized: bool,
    range: (u64, u64),
}

impl Machine {
    fn realtime_error_ns(&self) -> u64 {
        match self.sync_error_ns {
            Some(e) if self.synchronized => e,
            Some(e) => e.max(UNSYNCED_ERROR_NS),
            None => UNSYNCED_ERROR_NS,
        }
    }

    fn realtime_words(&self) -> String {
        match self.sync_error_ns {
            Some(e) if self.synchronized => format!("synchronised, max error {}", human_ns(e)),
            Some(_) => format!("NOT synchronised (trusted to {})", human_ns(UNSYNCED_ERROR_NS)),
            None => format!("time-sync state unknown (trusted to {})", human_ns(UNSYNCED_ERROR_NS)),
        }
    }

    /// BOOTTIME→REALTIME (or the reverse) from its snapshots.
    fn snapshot_map(&self, reverse: bool) -> Option<CalibrationHistory> {
        let mut h = history(2, 1.0);
        for s in &self.snapshots {
            let dev = s.bracket_ns.max(1);
            let (source, reference) = if reverse {
                (s.realtime_ns, s.boottime_ns)
            } else {
                (s.boottime_ns, s.realtime_ns)
            };
            let _ = h.add_burst(&[CalibrationSample {
                source_ticks: source,
                reference_ns: reference,
                max_deviation_ns: dev,
            }]);
        }
        h.latest().is_some().then_some(h)
    }
}

/// The exchange rounds between two machines, as bursts.
struct ExchangeLink {
    client: usize,
    server: usize,
    bursts: Vec<Vec<ExchangeSample>>,
}

impl ExchangeLink {
    /// The history of `from`'s clock against `to`'s.
    fn map(&self, from: usize) -> CalibrationHistory {
        let mut h = history(4, 0.25);
        for burst in &self.bursts {
            let samples: Vec<CalibrationSample> = burst
                .iter()
                .map(|s| {
                    if from == self.server {
                        s.as_calibration_sample()
                    } else {
                        s.as_reverse_calibration_sample()
                    }
                })
                .collect();
            let _ = h.add_burst(&samples);
        }
        h
    }

    /// The median over bursts of the burst's tightest bracket: this link's weight.
    fn typical_ns(&self) -> u64 {
        let mut best: Vec<u64> = self
            .bursts
            .iter()
            .filter_map(|b| b.iter().map(|s| s.round_trip_ns().div_ceil(2)).min())
            .collect();
        best.sort_unstable();
        best.get(best.len() / 2).copied().unwrap_or(u64::MAX)
    }

    fn best_round_trip_ns(&self) -> u64 {
        self.bursts
            .iter()
            .flatten()
            .map(|s| s.round_trip_ns())
            .min()
            .unwrap_or(0)
    }
}

/// Merges the traces of `options.inputs` into `options.output`.
pub fn merge(options: &MergeOptions) -> Result<MergeReport, MergeError> {
    if options.flow_out.is_empty() || options.flow_in.is_empty() || options.flow_out == options.flow_in {
        return Err(MergeError::BadFlowFields {
            flow_out: options.flow_out.clone(),
            flow_in: options.flow_in.clone(),
        });
    }
    // Before anything is read or written: the merged trace would replace that input.
    crate::output::check_not_input(&options.output, options.inputs.iter().map(PathBuf::as_path))
        .map_err(MergeError::OutputIsInput)?;
    let mut traces = Vec::with_capacity(options.inputs.len());
    for path in &options.inputs {
        let t = TraceFile::read(path, &options.flow_out, &options.flow_in).map_err(|e| {
            // A raw capture is no Perfetto trace; say what to do with it.
            match crate::capture::is_capture_file(path) {
                Ok(true) => MergeError::RawCapture(path.clone()),
                _ => MergeError::Read(e),
            }
        })?;
        if t.identity.is_none() {
            return Err(MergeError::NotTickline(path.clone()));
        }
        if t.identities > 1 {
            return Err(MergeError::AlreadyMerged {
                path: path.clone(),
                traces: t.identities,
            });
        }
        traces.push(t);
    }
    check_unique(&traces)?;
    let reference_trace = match &options.reference {
        None => 0,
        Some(r) => options
            .inputs
            .iter()
            .position(|p| p == r || crate::output::is_same_file(p, r))
            .ok_or_else(|| MergeError::BadReference(r.clone()))?,
    };

    // Machines, the reference's first.
    let mut machines: Vec<Machine> = Vec::new();
    let mut machine_of = vec![0usize; traces.len()];
    let order: Vec<usize> = std::iter::once(reference_trace)
        .chain((0..traces.len()).filter(|&i| i != reference_trace))
        .collect();
    for &i in &order {
        let t = &traces[i];
        let id = MachineId(t.identity.as_ref().map_or(0, |x| x.machine_id));
        let m = match machines.iter().position(|m| m.id == id) {
            Some(m) => m,
            None => {
                machines.push(Machine {
                    id,
                    traces: Vec::new(),
                    snapshots: Vec::new(),
                    sync_error_ns: None,
                    synchronized: true,
                    range: (u64::MAX, 0),
                });
                machines.len() - 1
            }
        };
        machine_of[i] = m;
        let machine = &mut machines[m];
        machine.traces.push(i);
        machine.snapshots.extend(t.snapshots.iter().copied());
        for s in &t.snapshots {
            if let Some((synced, _est, max)) = s.sync {
                machine.sync_error_ns = Some(machine.sync_error_ns.unwrap_or(0).max(max));
                machine.synchronized &= synced;
            }
        }
        if let Some((lo, hi)) = t.time_range {
            machine.range = (machine.range.0.min(lo), machine.range.1.max(hi));
        }
    }
    for m in &mut machines {
        m.snapshots.sort_by_key(|s| s.boottime_ns);
        m.snapshots.dedup_by_key(|s| s.boottime_ns);
        if m.sync_error_ns.is_none() {
            m.synchronized = false;
        }
        check_same_machine(m, &traces)?;
    }

    let (machine_pid_offsets, pid_offsets) = pid_offsets(&machines, &traces);
    let links = exchange_links(&traces, &machines);
    let paths = shortest_paths(&machines, &links)?;

    // Per machine: its report.
    let mut reports = Vec::with_capacity(machines.len());
    for (mi, m) in machines.iter().enumerate() {
        let (path, method) = &paths[mi];
        let (lo, hi) = if m.range.0 <= m.range.1 { m.range } else { (0, 0) };
        let mut us = Vec::new();
        let mut t = lo;
        loop {
            let (_, u) = path.apply(t).ok_or_else(|| MergeError::Unaligned {
                machine: m.id,
                reason: format!("its clock at {t} ns falls outside what its links can convert"),
            })?;
            us.push(u);
            if t >= hi {
                break;
            }
            t = (t + COUNTER_STEP_NS).min(hi);
        }
        us.sort_unstable();
        let (start, end) = (path.apply(lo).map_or(lo, |x| x.0), path.apply(hi).map_or(hi, |x| x.0));
        let drift = if hi > lo {
            ((end as f64 - start as f64) / (hi - lo) as f64 - 1.0) * 1e6
        } else {
            0.0
        };
        let hosts: Vec<String> = m
            .traces
            .iter()
            .filter_map(|&i| traces[i].identity.as_ref().map(|x| x.host.clone()))
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        reports.push(MachineReport {
            machine: m.id,
            host: hosts.join(", "),
            traces: m
                .traces
                .iter()
                .map(|&i| {
                    let id = traces[i].identity.as_ref().expect("checked");
                    format!("{} (pid {} {})", traces[i].path.display(), id.pid, id.process)
                })
                .collect(),
            method: method.clone(),
            offset_ns: lo as i64 - start as i64,
            drift_ppm: -drift,
            uncertainty_ns: (us[us.len() / 2], us[us.len() - 1]),
        });
    }

    let flows = match_flows(&traces);
    let context = Context {
        traces: &traces,
        machines: &machines,
        machine_of: &machine_of,
        paths: &paths,
        flows: &flows,
        reports: &reports,
        pid_offsets: &pid_offsets,
    };
    let packets = write_output(options, &context)?;
    let renumbered = machines
        .iter()
        .zip(&machine_pid_offsets)
        .filter(|(_, &o)| o != 0)
        .map(|(m, &o)| (m.id, o))
        .collect();
    let renumbered_traces = machines
        .iter()
        .zip(&machine_pid_offsets)
        .flat_map(|(m, &machine_offset)| m.traces.iter().map(move |&i| (i, machine_offset)))
        .filter(|&(i, machine_offset)| pid_offsets[i] != machine_offset)
        .map(|(i, _)| (traces[i].path.clone(), pid_offsets[i]))
        .collect();
    Ok(MergeReport {
        output: options.output.clone(),
        machines: reports,
        packets,
        flows: flows.flows,
        cross_process_flows: flows.cross_process,
        unmatched_flow_ids: flows.unmatched,
        cut_inputs: traces
            .iter()
            .filter(|t| t.cut_at.is_some())
            .map(|t| t.path.clone())
            .collect(),
        renumbered,
        renumbered_traces,
    })
}

/// Linux pids and tids stay below `pid_max` <= 2^22; a machine whose ids collide with an earlier machine's
/// gets all of them moved up by a multiple of that, or Perfetto would take two hosts' pid 1 for one process.
const PID_SPAN: u64 = 1 << 22;

/// What each machine's and each trace's pids and tids are moved up by: a machine whose ids collide with an
/// earlier machine's moves as a whole; a trace whose ids collide with an earlier trace's of its own machine (a
/// pid used again after its process ended, or processes in containers, each with its own pid 1) moves again,
/// on its own. `(per machine, per trace)`.
fn pid_offsets(machines: &[Machine], traces: &[TraceFile]) -> (Vec<u64>, Vec<u64>) {
    use std::collections::BTreeSet;
    // Whether `ids` moved up by `offset` collide with none of `taken`.
    let free =
        |taken: &BTreeSet<u64>, ids: &BTreeSet<u64>, offset: u64| ids.iter().all(|id| !taken.contains(&(id + offset)));
    let mut used: BTreeSet<u64> = BTreeSet::new();
    let mut next = 1;
    let mut fresh = |used: &BTreeSet<u64>, ids: &BTreeSet<u64>| loop {
        let offset = next * PID_SPAN;
        next += 1;
        if free(used, ids, offset) {
            return offset;
        }
    };
    let mut by_trace = vec![0; traces.len()];
    let by_machine = machines
        .iter()
        .map(|m| {
            let ids: BTreeSet<u64> = m
                .traces
                .iter()
                .flat_map(|&i| traces[i].os_ids.iter().copied())
                .collect();
            let offset = if free(&used, &ids, 0) { 0 } else { fresh(&used, &ids) };
            let mut own: BTreeSet<u64> = BTreeSet::new();
            for &i in &m.traces {
                let ids = &traces[i].os_ids;
                let trace_offset = if free(&own, ids, offset) {
                    offset
                } else {
                    fresh(&used, ids)
                };
                own.extend(ids.iter().map(|id| id + trace_offset));
                used.extend(ids.iter().map(|id| id + trace_offset));
                by_trace[i] = trace_offset;
            }
            offset
        })
        .collect();
    (by_machine, by_trace)
}

/// A track descriptor with its process's pid and its thread's pid and tid moved up by `offset`.
fn renumber_track(descriptor: &[u8], offset: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(descriptor.len() + 8);
    for (n, v, raw) in wire::fields(descriptor).flatten() {
        match (n, v.as_bytes()) {
            (3 | 4, Some(inner)) => {
                let mut rebuilt = Vec::with_capacity(inner.len() + 8);
                for (m, w, raw) in wire::fields(inner).flatten() {
                    match (m, w.as_u64()) {
                        (1, Some(id)) => put_varint(&mut rebuilt, 1, id + offset),
                        (2, Some(id)) if n == 4 => put_varint(&mut rebuilt, 2, id + offset),
                        _ => rebuilt.extend_from_slice(raw),
                    }
                }
                put_bytes(&mut out, n, &rebuilt);
            }
            _ => out.extend_from_slice(raw),
        }
    }
    out
}

fn check_unique(traces: &[TraceFile]) -> Result<(), MergeError> {
    let mut uuids: HashMap<u128, usize> = HashMap::new();
    let mut recordings: HashMap<&str, usize> = HashMap::new();
    let mut tracks: HashMap<u64, usize> = HashMap::new();
    for (i, t) in traces.iter().enumerate() {
        if let Some(u) = t.trace_uuid {
            if let Some(&j) = uuids.get(&u) {
                return Err(MergeError::DuplicateTrace(traces[j].path.clone(), t.path.clone()));
            }
            uuids.insert(u, i);
        }
        let recording = t.identity.as_ref().map_or("", |id| id.recording_id.as_str());
        if !recording.is_empty() {
            if let Some(&j) = recordings.get(recording) {
                return Err(MergeError::SameRecording {
                    a: traces[j].path.clone(),
                    b: t.path.clone(),
                    recording: recording.to_owned(),
                });
            }
            recordings.insert(recording, i);
        }
        for &uuid in &t.track_uuids {
            if let Some(&j) = tracks.get(&uuid) {
                if j != i {
                    return Err(MergeError::OverlappingTracks {
                        a: traces[j].path.clone(),
                        b: t.path.clone(),
                        uuid,
                    });
                }
            }
            tracks.insert(uuid, i);
        }
    }
    Ok(())
}

/// Traces claiming one machine must agree on its clocks: REALTIME − BOOTTIME may differ by what NTP can
/// slew (500 ppm) between their snapshots, plus a few ms for a step, not by the seconds or days between two
/// boots.
fn check_same_machine(m: &Machine, traces: &[TraceFile]) -> Result<(), MergeError> {
    let firsts: Vec<(usize, &Snapshot)> = m
        .traces
        .iter()
        .filter_map(|&i| traces[i].snapshots.first().map(|s| (i, s)))
        .collect();
    for (k, &(i, a)) in firsts.iter().enumerate() {
        for &(j, b) in &firsts[k + 1..] {
            let off = |s: &Snapshot| s.realtime_ns as i128 - s.boottime_ns as i128;
            let diff = off(a) - off(b);
            let gap = (a.boottime_ns as i128 - b.boottime_ns as i128).abs();
            let allowed = 5_000_000 + gap / 2_000 + (a.bracket_ns + b.bracket_ns) as i128;
            if diff.abs() > allowed {
                return Err(MergeError::MachineClockMismatch {
                    machine: m.id,
                    a: traces[i].path.clone(),
                    b: traces[j].path.clone(),
                    difference_ns: diff,
                });
            }
        }
    }
    Ok(())
}

fn exchange_links(traces: &[TraceFile], machines: &[Machine]) -> Vec<ExchangeLink> {
    let index: HashMap<MachineId, usize> = machines.iter().enumerate().map(|(i, m)| (m.id, i)).collect();
    let mut all: HashSet<(MachineId, MachineId, u64, u64, u64, u64)> = HashSet::new();
    let mut by_pair: BTreeMap<(usize, usize), Vec<ExchangeSample>> = BTreeMap::new();
    for t in traces {
        for s in &t.exchange {
            let key = (
                s.client,
                s.server,
                s.t1_client_send_ns,
                s.t2_server_receive_ns,
                s.t3_server_send_ns,
                s.t4_client_receive_ns,
            );
            let (Some(&c), Some(&sv)) = (index.get(&s.client), index.get(&s.server)) else {
                continue;
            };
            if c == sv || !all.insert(key) {
                continue;
            }
            by_pair.entry((c, sv)).or_default().push(*s);
        }
    }
    by_pair
        .into_iter()
        .map(|((client, server), mut samples)| {
            samples.sort_by_key(|s| s.t1_client_send_ns);
            let mut bursts: Vec<Vec<ExchangeSample>> = Vec::new();
            for s in samples {
                match bursts.last_mut() {
                    Some(b)
                        if b.last().is_some_and(|l| {
                            l.burst == s.burst && s.t1_client_send_ns - l.t1_client_send_ns < BURST_GAP_NS
                        }) =>
                    {
                        b.push(s)
                    }
                    _ => bursts.push(vec![s]),
                }
            }
            ExchangeLink { client, server, bursts }
        })
        .collect()
}

/// For every machine, the cheapest chain of links to the reference (machine 0) and its description.
fn shortest_paths(machines: &[Machine], links: &[ExchangeLink]) -> Result<Vec<(Path_, String)>, MergeError> {
    let n = machines.len();
    let utc = n;
    // Edges: (to, weight, kind) where kind: None = REALTIME, Some(link index) = exchange.
    let mut edges: Vec<Vec<(usize, u64, Option<usize>)>> = vec![Vec::new(); n + 1];
    for (i, m) in machines.iter().enumerate() {
        if m.snapshots.len() >= 2 {
            let w = m.realtime_error_ns();
            edges[i].push((utc, w, None));
            edges[utc].push((i, w, None));
        }
    }
    for (li, l) in links.iter().enumerate() {
        let w = l.typical_ns();
        edges[l.client].push((l.server, w, Some(li)));
        edges[l.server].push((l.client, w, Some(li)));
    }
    // Dijkstra from the reference; `prev[x]` is the next hop from x towards it.
    let mut dist = vec![u64::MAX; n + 1];
    let mut prev: Vec<Option<(usize, Option<usize>)>> = vec![None; n + 1];
    let mut done = vec![false; n + 1];
    dist[0] = 0;
    for _ in 0..=n {
        let Some(u) = (0..=n)
            .filter(|&x| !done[x] && dist[x] < u64::MAX)
            .min_by_key(|&x| dist[x])
        else {
            break;
        };
        done[u] = true;
        for &(v, w, kind) in &edges[u] {
            let d = dist[u].saturating_add(w);
            if d < dist[v] {
                dist[v] = d;
                prev[v] = Some((u, kind));
            }
        }
    }
    let mut out = Vec::with_capacity(n);
    for (i, m) in machines.iter().enumerate() {
        if i == 0 {
            out.push((Path_ { steps: Vec::new() }, "reference".to_owned()));
            continue;
        }
        if dist[i] == u64::MAX {
            let reason = if m.snapshots.len() >= 2 && machines[0].snapshots.len() < 2 {
                // This machine could be placed by REALTIME; the reference cannot.
                format!(
                    "it has no clock exchange with the reference machine {}, whose traces hold fewer than two \
                     REALTIME snapshots (cut before the 2 s snapshot?): choose another --reference",
                    machines[0].id
                )
            } else {
                "it has no clock exchange with the other machines and fewer than two REALTIME snapshots (a trace \
                 cut before the 2 s snapshot?)"
                    .to_owned()
            };
            return Err(MergeError::Unaligned { machine: m.id, reason });
        }
        let (mut steps, mut words) = (Vec::new(), Vec::new());
        let mut at = i;
        while at != 0 {
            let (next, kind) = prev[at].expect("reachable");
            match kind {
                Some(li) => {
                    let l = &links[li];
                    steps.push(Step::Exchange { map: l.map(at) });
                    words.push(format!(
                        "clock exchange with {} ({} bursts, best round trip {})",
                        machines[next].id,
                        l.bursts.len(),
                        human_ns(l.best_round_trip_ns())
                    ));
                }
                None if next == utc => {
                    let mm = &machines[at];
                    let map = mm.snapshot_map(false).ok_or_else(|| MergeError::Unaligned {
                        machine: mm.id,
                        reason: "its REALTIME snapshots do not fit".into(),
                    })?;
                    steps.push(Step::ToRealtime {
                        map,
                        error_ns: mm.realtime_error_ns(),
                    });
                    words.push(format!(
                        "REALTIME: its {} snapshots ({})",
                        mm.snapshots.len(),
                        mm.realtime_words()
                    ));
                }
                None => {
                    let mm = &machines[next];
                    let map = mm.snapshot_map(true).ok_or_else(|| MergeError::Unaligned {
                        machine: mm.id,
                        reason: "its REALTIME snapshots do not fit".into(),
                    })?;
                    steps.push(Step::FromRealtime {
                        map,
                        error_ns: mm.realtime_error_ns(),
                    });
                    words.push(format!("machine {}'s REALTIME ({})", mm.id, mm.realtime_words()));
                }
            }
            at = next;
        }
        out.push((Path_ { steps }, words.join(", against ")));
    }
    Ok(out)
}

struct Flows {
    /// (trace, packet) -> (flow ids out, flow ids in).
    at: HashMap<(usize, usize), (Vec<u64>, Vec<u64>)>,
    flows: usize,
    /// Flows whose ends are in two traces.
    cross_process: usize,
    unmatched: Vec<String>,
}

fn match_flows(traces: &[TraceFile]) -> Flows {
    // key -> (senders, receivers), each as (trace, packet).
    type Ends = Vec<(usize, usize)>;
    let mut by_key: BTreeMap<&str, (Ends, Ends)> = BTreeMap::new();
    for (ti, t) in traces.iter().enumerate() {
        // An async task's lifetime slice carries its span's flow field, as the span's slices on threads do:
        // one end, counted once (the thread's), unless the field is on the task's slice alone. A span entered
        // twice sends twice: within a trace the first sender of a key is its sender, as the exporter links it.
        let on_thread: HashSet<(&str, bool)> = t
            .flow_marks
            .iter()
            .filter(|m| !m.on_task)
            .map(|m| (m.key.as_str(), m.out))
            .collect();
        let mut sent = HashSet::new();
        for m in &t.flow_marks {
            if m.on_task && on_thread.contains(&(m.key.as_str(), m.out)) {
                continue;
            }
            if m.out && !sent.insert(m.key.as_str()) {
                continue;
            }
            let e = by_key.entry(m.key.as_str()).or_default();
            if m.out {
                e.0.push((ti, m.packet));
            } else {
                e.1.push((ti, m.packet));
            }
        }
    }
    let salt = (TraceUuid::new_random().0 as u64) | 1;
    let mut flows = Flows {
        at: HashMap::new(),
        flows: 0,
        cross_process: 0,
        unmatched: Vec::new(),
    };
    for (key, (outs, ins)) in by_key {
        if outs.len() != 1 || ins.is_empty() {
            flows.unmatched.push(key.to_owned());
            continue;
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in key.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        for (j, &end) in ins.iter().enumerate() {
            let id = mix(h ^ salt ^ (j as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).max(1);
            flows.at.entry(outs[0]).or_default().0.push(id);
            flows.at.entry(end).or_default().1.push(id);
            flows.flows += 1;
            flows.cross_process += usize::from(outs[0].0 != end.0);
        }
    }
    flows
}

/// A track event's bytes without the flow ids its exporter linked from flow fields within its own trace
/// ([`tickline_perfetto::is_field_flow_id`]): the merge links every sender and receiver itself, so keeping
/// them would draw a flow twice. tickline's own flows (CPU to GPU, task polls) stay.
fn without_field_flows(event: &[u8], trace_uuid: Option<u128>) -> Vec<u8> {
    let Some(uuid) = trace_uuid.map(TraceUuid) else {
        return event.to_vec();
    };
    let mut out = Vec::with_capacity(event.len() + 40);
    for field in wire::fields(event) {
        let Ok((n, v, raw)) = field else {
            // Unreadable: left as it was (the trace was read whole before, so this does not happen).
            return event.to_vec();
        };
        let field_flow = matches!(n, 47 | 48)
            && v.as_u64()
                .is_some_and(|id| tickline_perfetto::is_field_flow_id(uuid, id));
        if !field_flow {
            out.extend_from_slice(raw);
        }
    }
    out
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const SEQ_INCREMENTAL_STATE_CLEARED: u64 = 1;

fn frame(out: &mut Vec<u8>, packet: &[u8]) {
    put_bytes(out, 1, packet);
}

fn own_sequence(packet: &mut Vec<u8>) {
    put_varint(packet, packet::SEQUENCE_ID, 1);
}

/// Everything the writer needs.
struct Context<'a> {
    traces: &'a [TraceFile],
    machines: &'a [Machine],
    machine_of: &'a [usize],
    paths: &'a [(Path_, String)],
    flows: &'a Flows,
    reports: &'a [MachineReport],
    /// What each trace's pids and tids are moved up by.
    pid_offsets: &'a [u64],
}

fn write_output(options: &MergeOptions, c: &Context<'_>) -> Result<usize, MergeError> {
    let Context {
        traces,
        machines,
        machine_of,
        paths,
        flows,
        reports,
        pid_offsets,
    } = *c;
    let mut out = Vec::with_capacity(traces.iter().map(|t| t.data.len()).sum::<usize>() + 4096);
    let mut packets = 0usize;
    // The head, on sequence 1: the reference's first snapshot (BOOTTIME and REALTIME), a TraceUuid of our own,
    // and a merge track with the report.
    let reference = &machines[0];
    let first = reference.snapshots.first().copied().unwrap_or_default();
    let mut p = Vec::new();
    let mut snap = Vec::new();
    for (id, ts) in [(CLOCK_BOOTTIME, first.boottime_ns), (CLOCK_REALTIME, first.realtime_ns)] {
        let mut clock = Vec::new();
        put_varint(&mut clock, 1, id);
        put_varint(&mut clock, 2, ts);
        put_bytes(&mut snap, 1, &clock);
    }
    put_varint(&mut snap, 2, CLOCK_BOOTTIME);
    put_varint(&mut p, packet::TIMESTAMP, first.boottime_ns);
    put_bytes(&mut p, packet::CLOCK_SNAPSHOT, &snap);
    own_sequence(&mut p);
    put_varint(&mut p, packet::SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED);
    frame(&mut out, &p);
    let uuid = TraceUuid::new_random();
    let mut u = Vec::new();
    put_varint(&mut u, 1, uuid.msb() as u64);
    put_varint(&mut u, 2, uuid.lsb() as u64);
    let mut p = Vec::new();
    put_bytes(&mut p, packet::TRACE_UUID, &u);
    own_sequence(&mut p);
    frame(&mut out, &p);
    packets += 2;
    // The reference machine's clock snapshots, from all its traces, in time order: Perfetto's importer rejects
    // a snapshot whose trace clock (BOOTTIME) goes back from the one before it in the file (an import error),
    // which each trace's own run of snapshots would do after the one before it. The other machines' are left
    // out (their clocks are not the axis).
    let mut snapshots: Vec<(u64, Vec<u8>)> = Vec::new();
    for (ti, t) in traces.iter().enumerate() {
        if machine_of[ti] != 0 {
            continue;
        }
        for &(boottime, pi) in &t.clock_snapshot_packets {
            let Some(snapshot) = t
                .packet_fields(pi)
                .find(|(n, ..)| *n == packet::CLOCK_SNAPSHOT)
                .and_then(|(_, v, _)| v.as_bytes())
            else {
                continue;
            };
            let mut p = Vec::new();
            put_varint(&mut p, packet::TIMESTAMP, boottime);
            put_bytes(&mut p, packet::CLOCK_SNAPSHOT, snapshot);
            own_sequence(&mut p);
            snapshots.push((boottime, p));
        }
    }
    snapshots.sort_by_key(|s| s.0);
    let mut last_boottime = first.boottime_ns;
    for (boottime, p) in snapshots {
        if boottime > last_boottime {
            last_boottime = boottime;
            frame(&mut out, &p);
            packets += 1;
        }
    }
    let salt = u64::from(uuid.salt32()) << 32;

    // Each input sequence gets an output sequence of its own (1 is ours), numbered in the order they appear: a
    // tickline trace has two (its threads' track descriptors on the second, which never clears its incremental
    // state, so Perfetto makes no thread the default of the sequence its GPU and task slices are on).
    let mut next_sequence = 2u64;
    for (ti, t) in traces.iter().enumerate() {
        let mi = machine_of[ti];
        let same_machine_as_reference = mi == 0;
        let path = &paths[mi].0;
        // Input sequence id -> (output sequence id, whether a packet left out cleared its incremental state: the
        // next one written carries that instead).
        let mut sequences: HashMap<u64, (u64, bool)> = HashMap::new();
        for pi in 0..t.packets.len() {
            let (mut input_sequence, mut input_flags) = (0u64, None);
            let mut rebuilt = Vec::with_capacity(t.packets[pi].1 - t.packets[pi].0 + 32);
            let mut skip = false;
            for (n, v, raw) in t.packet_fields(pi) {
                match n {
                    // Snapshots went out after the head, in time order.
                    packet::CLOCK_SNAPSHOT => skip = true,
                    packet::SYSTEM_INFO if !same_machine_as_reference => skip = true,
                    packet::TRACE_UUID => skip = true,
                    packet::TIMESTAMP => {
                        let ts = v.as_u64().unwrap_or(0);
                        let mapped = if same_machine_as_reference {
                            ts
                        } else {
                            path.apply(ts)
                                .ok_or_else(|| MergeError::Unaligned {
                                    machine: machines[mi].id,
                                    reason: format!("{}: timestamp {ts} cannot be mapped", t.path.display()),
                                })?
                                .0
                        };
                        put_varint(&mut rebuilt, packet::TIMESTAMP, mapped);
                    }
                    packet::SEQUENCE_ID => input_sequence = v.as_u64().unwrap_or(0),
                    packet::TRACK_DESCRIPTOR if pid_offsets[ti] != 0 => {
                        let descriptor = renumber_track(v.as_bytes().unwrap_or_default(), pid_offsets[ti]);
                        put_bytes(&mut rebuilt, packet::TRACK_DESCRIPTOR, &descriptor);
                    }
                    // Written with the sequence id below.
                    packet::SEQUENCE_FLAGS => input_flags = Some(v.as_u64().unwrap_or(0)),
                    packet::TRACK_EVENT => match flows.at.get(&(ti, pi)) {
                        Some((outs, ins)) => {
                            let mut event = without_field_flows(v.as_bytes().unwrap_or_default(), t.trace_uuid);
                            // Unpacked, as the exporter writes them (Perfetto drops packed flow ids), both ends
                            // in `flow_ids` (see tickline-perfetto's caveats: a terminating id read before its
                            // start is ignored).
                            for &id in outs.iter().chain(ins) {
                                put_fixed64(&mut event, 47, id);
                            }
                            put_bytes(&mut rebuilt, packet::TRACK_EVENT, &event);
                        }
                        None => rebuilt.extend_from_slice(raw),
                    },
                    _ => rebuilt.extend_from_slice(raw),
                }
            }
            let (sequence, clear_pending) = sequences.entry(input_sequence).or_insert_with(|| {
                next_sequence += 1;
                (next_sequence - 1, false)
            });
            let clears = input_flags.is_some_and(|f| f & SEQ_INCREMENTAL_STATE_CLEARED != 0);
            if skip {
                *clear_pending |= clears;
                continue;
            }
            put_varint(&mut rebuilt, packet::SEQUENCE_ID, *sequence);
            let flags = if *clear_pending {
                Some(input_flags.unwrap_or(0) | SEQ_INCREMENTAL_STATE_CLEARED)
            } else {
                input_flags
            };
            if let Some(flags) = flags {
                put_varint(&mut rebuilt, packet::SEQUENCE_FLAGS, flags);
            }
            *clear_pending = false;
            frame(&mut out, &rebuilt);
            packets += 1;
        }
        // The alignment counter under each of this trace's processes.
        let report = &reports[mi];
        let description = format!(
            "machine {} ({}): {}; uncertainty ±{} median, ±{} max",
            report.machine,
            report.host,
            report.method,
            human_ns(report.uncertainty_ns.0),
            human_ns(report.uncertainty_ns.1)
        );
        let (lo, hi) = t.time_range.unwrap_or((0, 0));
        for proc in &t.processes {
            let track = salt ^ mix(proc.uuid) >> 32 ^ (ti as u64) << 24 ^ 0x00ff_0000;
            let mut td = Vec::new();
            put_varint(&mut td, 1, track);
            put_varint(&mut td, 5, proc.uuid);
            put_bytes(&mut td, 2, ALIGNMENT_TRACK.as_bytes());
            put_bytes(&mut td, 14, description.as_bytes());
            // sibling_merge_behavior NONE, as the exporter writes its tracks: never merged by name.
            put_varint(&mut td, 15, 2);
            let mut counter = Vec::new();
            put_bytes(&mut counter, 6, b"ns");
            put_bytes(&mut td, 8, &counter);
            let mut p = Vec::new();
            put_bytes(&mut p, packet::TRACK_DESCRIPTOR, &td);
            own_sequence(&mut p);
            frame(&mut out, &p);
            packets += 1;
            let mut t0 = lo;
            loop {
                let t1 = (t0 + COUNTER_STEP_NS).min(hi);
                let mid = t0 + (t1 - t0) / 2;
                let (Some((x0, u0)), Some((_, u1)), Some((_, um))) = (path.apply(t0), path.apply(t1), path.apply(mid))
                else {
                    break;
                };
                let (x0, u) = if same_machine_as_reference {
                    (t0, 0)
                } else {
                    (x0, u0.max(u1).max(um))
                };
                let mut ev = Vec::new();
                put_varint(&mut ev, 9, 4); // TYPE_COUNTER
                put_varint(&mut ev, 11, track);
                put_fixed64(&mut ev, 44, (u as f64).to_bits());
                let mut p = Vec::new();
                put_varint(&mut p, packet::TIMESTAMP, x0);
                put_bytes(&mut p, packet::TRACK_EVENT, &ev);
                own_sequence(&mut p);
                frame(&mut out, &p);
                packets += 1;
                if t0 >= hi {
                    break;
                }
                t0 = t1;
            }
        }
    }
    write_file(&options.output, &out)?;
    Ok(packets)
}

/// Through a temporary file renamed over `path`: a failed write leaves an existing output as it was.
fn write_file(path: &Path, data: &[u8]) -> Result<(), MergeError> {
    let write = || {
        let mut file = crate::output::OutputFile::create(path)?;
        std::io::Write::write_all(file.file(), data)?;
        file.commit()
    };
    write().map_err(|e| MergeError::Write(path.to_owned(), e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human_ns(12), "12 ns");
        assert_eq!(human_ns(23_400), "23.4 µs");
        assert_eq!(human_ns(2_000_000), "2.00 ms");
        assert_eq!(human_ns(16_000_000_000), "16.0 s");
    }

    /// A simulated pair: server clock = client clock × (1 + 200 ppm) + 3.7 s, rounds with 30-80 µs round
    /// trips. The exchange map follows the drift within its stated uncertainty everywhere inside the rounds.
    #[test]
    fn the_exchange_map_follows_drift_within_its_uncertainty() {
        let truth = |client: u64| -> u64 { (client as f64 * (1.0 + 200e-6)) as u64 + 3_700_000_000 };
        let mut bursts = Vec::new();
        let mut rng = 12345u64;
        for b in 0..20u64 {
            let mut burst = Vec::new();
            for r in 0..8u64 {
                rng = mix(rng);
                let t1 = 10_000_000_000 + b * 500_000_000 + r * 100_000;
                let up = 15_000 + rng % 25_000;
                let down = 15_000 + (rng >> 20) % 25_000;
                let t2 = truth(t1 + up);
                let t3 = t2 + 2_000;
                let t4 = t1 + up + 2_000 + down;
                burst.push(ExchangeSample {
                    client: MachineId(1),
                    server: MachineId(2),
                    burst: b,
                    t1_client_send_ns: t1,
                    t2_server_receive_ns: t2,
                    t3_server_send_ns: t3,
                    t4_client_receive_ns: t4,
                });
            }
            bursts.push(burst);
        }
        let link = ExchangeLink {
            client: 0,
            server: 1,
            bursts,
        };
        let map = link.map(1); // server -> client
        let step = Step::Exchange { map };
        for k in 0..100u64 {
            let client = 10_100_000_000 + k * 95_000_000;
            let server = truth(client);
            let (got, u) = step.apply(i128::from(server)).unwrap();
            let err = (got - i128::from(client)).unsigned_abs() as f64;
            assert!(err <= u, "at {client}: error {err} ns > stated {u} ns");
            // Round trips of 30-80 µs: brackets of ±15-40 µs; the history states 3σ with the wander it has
            // measured (or, before it has, a cautious prior), so a little above the tightest bracket.
            assert!(u < 60_000.0, "stated {u} ns");
        }
    }
}
