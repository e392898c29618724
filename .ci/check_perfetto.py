#!/usr/bin/env python3
"""Checks a Perfetto trace written by tickline with Perfetto's own Python bindings.

usage: check_perfetto.py TRACE [--expect-slices NAME=COUNT ...] [--expect-total-slices N]
                               [--expect-thread-tracks N] [--require-annotation NAME]
                               [--expect-gpu-devices N] [--expect-gpu-slices N] [--allow-cut-tail]
                               [--check-cross-flows] [--min-cross-flows N]
                               [--check-truth] [--truth-slack-ns NS] [--expect-processes N]
                               [--expect-async-tasks NAME=COUNT ...] [--expect-polls N]

Asserts, streaming packet by packet: a clock snapshot comes first and the first packet clears the incremental
state; every track uuid is described before use; interned ids are defined before use; timestamps never go
backwards per track nor clock snapshots' BOOTTIME in file order; no track but a thread's or a process's may be merged with a sibling of its name
(sibling_merge_behavior NONE); every slice begin has its end on the same track and nothing is left open; every flow
has both ends and is drawn: Perfetto's importer (trace_processor's FlowTracker) reads track events in timestamp
order (ties in file order); an id in `flow_ids` starts a flow the first time and links the flow's last slice to
this one after; an id in `terminating_flow_ids` ends a flow only if it started, else it is ignored. The check
replays that and requires a drawn arrow for every flow. What a track is, the exporter says in its description, never in its name: every slice that is
not on a thread track lies on a GPU queue track ("tickline GPU queue") whose parent is a GPU device track
("tickline GPU device"), carries the `uncertainty_ns` annotation and ends a flow (from the CPU code that
recorded it), or on an async task track ("tickline async task"). Async tasks: any other track that is not a thread's holds one lifetime slice (named after
its span) with `poll` slices as children, or (a lane for polls that overlap) only `poll` slices; every poll is
drawn linked to a slice on a thread track. With the options, slice counts per name, the total, the thread track count, the GPU
device count, the GPU slice count, the async task count per span name (its lifetime slice's name) and the poll
count (each ending a flow from a thread track) must match.

--allow-cut-tail accepts a file that ends inside a packet (a killed process): it is read up to its last whole
packet, and slices or flows left open by the cut are not errors.

Merged traces (`tickline merge`): interned names are per packet sequence. --check-cross-flows requires every
flow between two processes to go forward in time (its end at or after its start); --min-cross-flows N that there
are at least N. --check-truth checks the alignment against known truth: every event with a `probe` annotation
must lie within [truth_lo_ns - U - slack, truth_hi_ns + U + slack], where truth_lo_ns/truth_hi_ns come from the
event with the same `probe_truth` value on the same track (real clock reads before and after the probe) and U is
the process's `tickline alignment uncertainty` counter at that time.
Exits non-zero with one clear line on the first failure.
"""
import argparse
import collections
import sys

from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

TYPE_SLICE_BEGIN, TYPE_SLICE_END, TYPE_INSTANT, TYPE_COUNTER = 1, 2, 3, 4
SEQ_INCREMENTAL_STATE_CLEARED = 1
# TrackDescriptor.SiblingMergeBehavior: every track tickline describes stands for one thing (Perfetto's default
# merges siblings that share a name: two tasks, or two GPUs, of one name would share a track).
SIBLING_MERGE_NONE = 2
BOOTTIME = 6


class TraceError(Exception):
    pass


def read_varint(data, pos):
    result, shift = 0, 0
    while True:
        if pos >= len(data):
            raise TraceError("truncated varint in the packet framing")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


class CutTail(Exception):
    pass


def packets(data, allow_cut=False):
    """Yields each TracePacket of the outer `Trace` message (field 1, length-delimited), one at a time."""
    pos = 0
    while pos < len(data):
        start = pos
        try:
            key, pos = read_varint(data, pos)
            if key != (1 << 3 | 2):
                raise TraceError(f"unexpected outer field key {key} at byte {pos}: not a Trace.packet")
            length, pos = read_varint(data, pos)
        except TraceError as e:
            if allow_cut and "truncated varint" in str(e):
                raise CutTail(start)
            raise
        if pos + length > len(data):
            if allow_cut:
                raise CutTail(start)
            raise TraceError(f"the last packet is cut short ({len(data) - pos} of {length} bytes)")
        packet = pb.TracePacket()
        packet.ParseFromString(data[pos:pos + length])
        pos += length
        yield packet


GPU_DEVICE = "tickline GPU device"
GPU_QUEUE = "tickline GPU queue"
ASYNC_TASK = "tickline async task"
DEEPER = "tickline deeper slices"
# trace_processor's SliceTracker::kMaxDepth: a deeper begin is dropped, and the end after it closes the wrong slice.
MAX_DEPTH = 512
UNCERTAINTY = "uncertainty_ns"
POLL = "poll"
FLOW_OUT_FIELD = "tickline.flow_out"
FLOW_IN_FIELD = "tickline.flow_in"


ALIGNMENT_TRACK = "tickline alignment uncertainty"


def check(path, expect_slices, expect_total, expect_threads, require_annotations, expect_gpu_devices=None,
          expect_gpu_slices=None, allow_cut=False, check_cross_flows=False, min_cross_flows=None,
          check_truth=False, truth_slack_ns=0, expect_processes=None, expect_tasks=None, expect_polls=None):
    expect_tasks = expect_tasks or {}
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise TraceError("the trace is empty")
    described = {}
    event_names, annotation_names = {}, {}
    last_ts = {}
    last_snapshot_boottime = {}
    open_slices = collections.defaultdict(list)
    slice_counts = collections.Counter()
    # Flow id -> the events carrying it: (timestamp, packet index, slice, terminating).
    flow_events = collections.defaultdict(list)
    # Slice (track uuid, packet index of its begin) -> its start time; each slice's open stack per track.
    slice_start = {}
    open_slice_ids = collections.defaultdict(list)
    # Flows started by a `tickline.flow_out` field: their receiver may be in another process's trace.
    field_flow_starts = set()
    # Flows ended by a `tickline.flow_in` field: their sender may be in another process's trace.
    field_flow_ends = set()
    gpu_slice_ids = []
    annotated = collections.Counter()
    n_packets = n_events = gpu_slices = 0
    gpu_devices = set()
    flow_out_at, flow_in_at = {}, {}  # field flows: sender's and receiver's (timestamp, track uuid)
    counters = collections.defaultdict(list)  # counter track uuid -> [(ts, value)]
    probes, truths = [], {}
    cut_at = None
    task_lifetimes, task_names = collections.Counter(), collections.Counter()
    polls = []  # (packet index, slice)
    # trace_processor's importer: a thread's TrackDescriptor read on a sequence whose incremental state is valid
    # (it saw SEQ_INCREMENTAL_STATE_CLEARED) becomes that sequence's default thread (track_event_tokenizer.cc).
    valid_sequences, default_thread = set(), {}

    def each_packet():
        nonlocal cut_at
        try:
            yield from packets(data, allow_cut)
        except CutTail as c:
            cut_at = c.args[0]

    def base_track(uuid):
        """The track whose slices `uuid` holds: itself, or for a track of deeper slices, its parent's."""
        while described[uuid].description == DEEPER and described[uuid].HasField("parent_uuid"):
            uuid = described[uuid].parent_uuid
        return uuid

    def thread_scoped(uuid):
        """Whether the importer resolves `uuid` to a thread: it, or a track above it, is a thread's."""
        while True:
            td = described[uuid]
            if td.HasField("thread"):
                return True
            if not td.HasField("parent_uuid"):
                return False
            uuid = td.parent_uuid

    for index, packet in enumerate(each_packet()):
        seq = packet.trusted_packet_sequence_id
        n_packets += 1
        if packet.sequence_flags & SEQ_INCREMENTAL_STATE_CLEARED or packet.incremental_state_cleared:
            valid_sequences.add(seq)
        if index == 0:
            if not packet.HasField("clock_snapshot"):
                raise TraceError("the first packet is not a clock snapshot")
            if not packet.sequence_flags & SEQ_INCREMENTAL_STATE_CLEARED:
                raise TraceError("the first packet does not carry SEQ_INCREMENTAL_STATE_CLEARED")
        if packet.HasField("clock_snapshot"):
            # Perfetto's importer rejects a snapshot whose trace clock (BOOTTIME) goes back from the previous one
            # of the same set of clocks in file order ("the trace clock is not monotonic": an import error).
            clocks = {c.clock_id: c.timestamp for c in packet.clock_snapshot.clocks}
            key = frozenset(clocks)
            if BOOTTIME in clocks:
                if clocks[BOOTTIME] < last_snapshot_boottime.get(key, 0):
                    raise TraceError(f"packet {index}: clock snapshot BOOTTIME {clocks[BOOTTIME]} goes back from "
                                     f"{last_snapshot_boottime[key]}: Perfetto rejects it")
                last_snapshot_boottime[key] = clocks[BOOTTIME]
        if packet.HasField("track_descriptor"):
            td = packet.track_descriptor
            if td.uuid in described:
                raise TraceError(f"track uuid {td.uuid} described twice")
            if td.HasField("parent_uuid") and td.parent_uuid not in described:
                raise TraceError(f"track {td.uuid} names parent {td.parent_uuid} before it is described")
            described[td.uuid] = td
            if td.HasField("thread") and seq in valid_sequences:
                default_thread[seq] = td.uuid
            if not td.HasField("thread") and not td.HasField("process") and td.sibling_merge_behavior != SIBLING_MERGE_NONE:
                raise TraceError(f"track {td.uuid} ({td.name!r}) may be merged with a sibling of the same name: "
                                 f"sibling_merge_behavior is not NONE")
            if td.description == GPU_DEVICE:
                gpu_devices.add(td.uuid)
        if packet.HasField("interned_data"):
            for n in packet.interned_data.event_names:
                event_names[(seq, n.iid)] = n.name
            for n in packet.interned_data.debug_annotation_names:
                annotation_names[(seq, n.iid)] = n.name
        if not packet.HasField("track_event"):
            continue
        n_events += 1
        ev = packet.track_event
        uuid = ev.track_uuid
        if uuid not in described:
            raise TraceError(f"packet {index}: track uuid {uuid} used before it is described")
        # An event on a track of no thread (a GPU queue, a task, a counter) on a sequence with a default thread gets
        # a `legacy_event.passthrough_utid` argument naming that thread (track_event_event_importer.h): shown
        # with the slice as if that thread had done it.
        if seq in default_thread and not thread_scoped(uuid):
            raise TraceError(f"packet {index}: an event on track {uuid} (not a thread's) is on sequence {seq}, whose "
                             f"default thread is track {default_thread[seq]}: Perfetto names that thread on it "
                             f"(legacy_event.passthrough_utid)")
        ts = packet.timestamp
        if ts < last_ts.get(uuid, 0):
            raise TraceError(f"packet {index}: time goes backwards on track {uuid}: {ts} < {last_ts[uuid]}")
        last_ts[uuid] = ts
        if ev.HasField("name_iid") and (seq, ev.name_iid) not in event_names:
            raise TraceError(f"packet {index}: event name iid {ev.name_iid} is not interned")
        names_here = set()
        values = {}
        for a in ev.debug_annotations:
            if a.HasField("name_iid"):
                if (seq, a.name_iid) not in annotation_names:
                    raise TraceError(f"packet {index}: annotation name iid {a.name_iid} is not interned")
                aname = annotation_names[(seq, a.name_iid)]
                annotated[aname] += 1
            elif a.HasField("name"):
                aname = a.name
            else:
                continue
            names_here.add(aname)
            for kind in ("uint_value", "int_value", "string_value"):
                if a.HasField(kind):
                    values[aname] = getattr(a, kind)
        # The slice an event's flows bind to: a begin's or an instant's own, an end's the one it ends.
        if ev.type == TYPE_SLICE_END:
            this_slice = open_slice_ids[uuid][-1] if open_slice_ids[uuid] else None
        else:
            this_slice = (uuid, index)
            slice_start[this_slice] = ts
        for terminating, ids in ((False, ev.flow_ids), (True, ev.terminating_flow_ids)):
            for flow in ids:
                flow_events[flow].append((ts, index, this_slice, terminating))
                if FLOW_OUT_FIELD in names_here:
                    field_flow_starts.add(flow)
                    flow_out_at[flow] = (ts, uuid)
                elif FLOW_IN_FIELD in names_here:
                    field_flow_ends.add(flow)
                    flow_in_at[flow] = (ts, uuid)
        if "probe" in values:
            probes.append((index, ts, uuid, values["probe"]))
        if "probe_truth" in values:
            truths[(uuid, values["probe_truth"])] = (values.get("truth_lo_ns", 0), values.get("truth_hi_ns", 0))
        name = event_names.get((seq, ev.name_iid), ev.name)
        if ev.type == TYPE_SLICE_BEGIN:
            open_slices[uuid].append(name)
            open_slice_ids[uuid].append(this_slice)
            slice_counts[name] += 1
            if len(open_slices[uuid]) > MAX_DEPTH:
                raise TraceError(f"packet {index}: slice {name!r} nested {len(open_slices[uuid])} deep on track {uuid}: "
                                 f"Perfetto drops slices deeper than {MAX_DEPTH}")
            td = described[base_track(uuid)]
            if td.description == ASYNC_TASK:
                # An async task track (or a lane of one): one lifetime slice, its polls as children, each
                # ending the flow from its slice on a thread track.
                depth = len(open_slices[uuid]) - 1
                if name == POLL:
                    polls.append((index, this_slice))
                elif depth == 0:
                    task_lifetimes[uuid] += 1
                    task_names[name] += 1
                    if task_lifetimes[uuid] > 1:
                        raise TraceError(f"packet {index}: task track {uuid} ({td.name!r}) has a second lifetime "
                                         f"slice {name!r}")
                else:
                    raise TraceError(f"packet {index}: slice {name!r} on task track {uuid} is neither its lifetime "
                                     f"nor a poll")
            elif not td.HasField("thread"):
                if td.description != GPU_QUEUE:
                    raise TraceError(f"packet {index}: slice {name!r} on track {uuid} ({td.name!r}), which is neither "
                                     f"a thread, a GPU queue nor an async task track")
                # A GPU slice: on a queue track under its device, with its uncertainty and a flow from the CPU.
                gpu_slices += 1
                if td.parent_uuid not in gpu_devices:
                    raise TraceError(f"packet {index}: slice {name!r} on track {uuid} ({td.name!r}) whose parent "
                                     f"is not a GPU device track")
                if UNCERTAINTY not in names_here:
                    raise TraceError(f"packet {index}: GPU slice {name!r} has no {UNCERTAINTY} annotation")
                gpu_slice_ids.append((index, name, this_slice))
        elif ev.type == TYPE_SLICE_END:
            if not open_slices[uuid]:
                raise TraceError(f"packet {index}: slice end with no open slice on track {uuid}")
            open_slices[uuid].pop()
            open_slice_ids[uuid].pop()
        elif ev.type == TYPE_COUNTER:
            if not described[uuid].HasField("counter"):
                raise TraceError(f"packet {index}: counter value on non-counter track {uuid}")
            counters[uuid].append((ts, ev.double_counter_value))
        elif ev.type == TYPE_INSTANT:
            if len(open_slices[uuid]) >= MAX_DEPTH:
                raise TraceError(f"packet {index}: instant {name!r} nested {len(open_slices[uuid])} deep on track "
                                 f"{uuid}: Perfetto drops slices deeper than {MAX_DEPTH}")
        else:
            raise TraceError(f"packet {index}: unexpected track event type {ev.type}")
    # Replays the importer's flow rules (see the module docs): the arrows Perfetto draws, as (from, to) slices.
    drawn = collections.defaultdict(list)
    active = {}
    for ts, index, flow, this_slice, terminating in sorted(
            (ts, index, flow, sl, term) for flow, evs in flow_events.items() for ts, index, sl, term in evs):
        if this_slice is None:
            raise TraceError(f"packet {index}: flow {flow} on a slice end with no slice open")
        if flow not in active:
            if not terminating:
                active[flow] = this_slice
            continue
        existing = active[flow]
        late_first = slice_start[existing] > slice_start[this_slice]
        drawn[flow].append((this_slice, existing) if late_first else (existing, this_slice))
        if terminating:
            del active[flow]
        else:
            active[flow] = this_slice
    linked = collections.defaultdict(list)  # slice -> the slices Perfetto links it to
    for arrows in drawn.values():
        for a, b in arrows:
            linked[a].append(b)
            linked[b].append(a)
    polls_with_flows = 0
    for index, poll in polls:
        others = [o for o in linked.get(poll, []) if described[base_track(o[0])].HasField("thread")]
        if not others:
            if not allow_cut:
                raise TraceError(f"packet {index}: Perfetto draws no flow between this poll and a thread slice")
            continue
        polls_with_flows += 1
    for index, name, gpu_slice in gpu_slice_ids:
        if not any(described[base_track(o[0])].HasField("thread") for o in linked.get(gpu_slice, [])) and not allow_cut:
            raise TraceError(f"packet {index}: Perfetto draws no flow from the CPU to GPU slice {name!r}")
    if expect_polls is not None and (len(polls), polls_with_flows) != (expect_polls, expect_polls):
        raise TraceError(f"expected {expect_polls} polls on task tracks, each ending a flow from a thread track; "
                         f"found {len(polls)} polls, {polls_with_flows} with such a flow")
    for name, count in expect_tasks.items():
        if task_names[name] != count:
            raise TraceError(f"expected {count} async task tracks named {name!r}, found {task_names[name]}")
    still_open = {u: s for u, s in open_slices.items() if s}
    if still_open and not allow_cut:
        raise TraceError(f"slices never ended: {still_open}")
    for flow, evs in flow_events.items():
        dangling_field_flow = len(evs) == 1 and (flow in field_flow_starts or flow in field_flow_ends)
        if len(evs) > 2 or (not allow_cut and not dangling_field_flow and len(evs) != 2):
            raise TraceError(f"flow {flow} is on {len(evs)} event(s), not 2")
        if len(evs) == 2 and len(drawn[flow]) != 1:
            raise TraceError(f"flow {flow} (events at packets {[e[1] for e in evs]}): Perfetto draws "
                             f"{len(drawn[flow])} arrows for it, not 1")

    def process_of(uuid):
        """The root process track above a track (its own uuid for a root)."""
        seen = 0
        while described[uuid].HasField("parent_uuid") and seen < 64:
            uuid = described[uuid].parent_uuid
            seen += 1
        return uuid

    cross = 0
    for flow, (ts_out, track_out) in flow_out_at.items():
        if flow not in flow_in_at:
            continue
        ts_in, track_in = flow_in_at[flow]
        if process_of(track_out) == process_of(track_in):
            continue
        cross += 1
        if check_cross_flows and ts_in < ts_out:
            raise TraceError(f"flow {flow} from process track {process_of(track_out)} to "
                             f"{process_of(track_in)} goes back in time by {ts_out - ts_in} ns")
    if min_cross_flows is not None and cross < min_cross_flows:
        raise TraceError(f"expected at least {min_cross_flows} cross-process flows, found {cross}")
    truth_line = ""
    if check_truth:
        alignment = {}
        for uuid, td in described.items():
            if td.name == ALIGNMENT_TRACK and td.HasField("parent_uuid"):
                alignment[td.parent_uuid] = sorted(counters[uuid])
        if not probes:
            raise TraceError("--check-truth: no event carries a `probe` annotation")
        worst = {}
        for index, ts, uuid, seq_no in probes:
            if (uuid, seq_no) not in truths:
                continue
            lo, hi = truths[(uuid, seq_no)]
            proc = process_of(uuid)
            values = alignment.get(proc)
            if not values:
                raise TraceError(f"--check-truth: process track {proc} has no {ALIGNMENT_TRACK!r} counter")
            u = values[0][1]
            for t, v in values:
                if t <= ts:
                    u = v
                else:
                    break
            error = max(lo - ts, ts - hi, 0)
            if error > u + truth_slack_ns:
                raise TraceError(f"packet {index}: probe {seq_no} of process track {proc} is {error} ns from its "
                                 f"truth [{lo}, {hi}], beyond the stated uncertainty {u:.0f} ns + {truth_slack_ns} ns")
            w = worst.setdefault(proc, [0, 0.0, 0, 0])
            w[0] = max(w[0], error)
            w[1] = max(w[1], u)
            w[2] += 1
            w[3] = max(w[3], abs(ts - (lo + hi) // 2))
        truth_line = "; truth: " + ", ".join(
            f"process {p}: {n} probes, worst {e} ns outside the truth bracket ({m} ns from its middle) within the "
            f"stated {u:.0f} ns" for p, (e, u, n, m) in worst.items())
    processes = sum(1 for td in described.values() if td.HasField("process") and not td.HasField("parent_uuid"))
    if expect_processes is not None and processes != expect_processes:
        raise TraceError(f"expected {expect_processes} process tracks, found {processes}")
    for name, count in expect_slices.items():
        if slice_counts[name] != count:
            raise TraceError(f"expected {count} slices named {name!r}, found {slice_counts[name]}")
    total = sum(slice_counts.values())
    if expect_total is not None and total != expect_total:
        raise TraceError(f"expected {expect_total} slices in all, found {total}")
    threads = sum(1 for td in described.values() if td.HasField("thread"))
    if expect_threads is not None and threads != expect_threads:
        raise TraceError(f"expected {expect_threads} thread tracks, found {threads}")
    if expect_gpu_devices is not None and len(gpu_devices) != expect_gpu_devices:
        raise TraceError(f"expected {expect_gpu_devices} GPU device tracks, found {len(gpu_devices)}")
    if expect_gpu_slices is not None and gpu_slices != expect_gpu_slices:
        raise TraceError(f"expected {expect_gpu_slices} GPU slices, found {gpu_slices}")
    for name in require_annotations:
        if not annotated[name]:
            raise TraceError(f"no event carries the annotation {name!r}")
    cut = f" (cut at byte {cut_at}: read up to it)" if cut_at is not None else ""
    return (f"ok: {path}: {n_packets} packets{cut}, {n_events} track events, {total} slices on "
            f"{len(described)} tracks ({threads} threads, {len(gpu_devices)} GPU devices, {gpu_slices} GPU slices), "
            f"{sum(1 for arrows in drawn.values() if arrows)} flows drawn ({cross} across processes), {sum(task_lifetimes.values())} async tasks with "
            f"{len(polls)} polls{truth_line}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--expect-slices", action="append", default=[], metavar="NAME=COUNT")
    parser.add_argument("--expect-total-slices", type=int)
    parser.add_argument("--expect-thread-tracks", type=int)
    parser.add_argument("--require-annotation", action="append", default=[], metavar="NAME")
    parser.add_argument("--expect-gpu-devices", type=int)
    parser.add_argument("--expect-gpu-slices", type=int)
    parser.add_argument("--allow-cut-tail", action="store_true")
    parser.add_argument("--check-cross-flows", action="store_true")
    parser.add_argument("--min-cross-flows", type=int)
    parser.add_argument("--check-truth", action="store_true")
    parser.add_argument("--truth-slack-ns", type=int, default=0)
    parser.add_argument("--expect-processes", type=int)
    parser.add_argument("--expect-async-tasks", action="append", default=[], metavar="NAME=COUNT")
    parser.add_argument("--expect-polls", type=int)
    args = parser.parse_args()
    expect = {}
    for item in args.expect_slices:
        name, _, count = item.rpartition("=")
        if not name or not count.isdigit():
            parser.error(f"--expect-slices wants NAME=COUNT, got {item!r}")
        expect[name] = int(count)
    tasks = {}
    for item in args.expect_async_tasks:
        name, _, count = item.rpartition("=")
        if not name or not count.isdigit():
            parser.error(f"--expect-async-tasks wants NAME=COUNT, got {item!r}")
        tasks[name] = int(count)
    try:
        print(check(args.trace, expect, args.expect_total_slices, args.expect_thread_tracks,
                    args.require_annotation, args.expect_gpu_devices, args.expect_gpu_slices, args.allow_cut_tail,
                    args.check_cross_flows, args.min_cross_flows, args.check_truth, args.truth_slack_ns,
                    args.expect_processes, tasks, args.expect_polls))
    except (TraceError, OSError) as e:
        print(f"check_perfetto: {args.trace}: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # a protobuf decode error is a broken trace too
        print(f"check_perfetto: {args.trace}: cannot decode: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
