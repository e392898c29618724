//! Three processes playing three machines whose clocks disagree by known amounts, merged by `tickline merge`
//! and checked against the truth.
//!
//! The test binary runs itself as the children (the `child` test does nothing unless `TICKLINE_TEST_ROLE` is
//! set). Each child claims its own machine (`TICKLINE_MACHINE_ID`) and runs with simulated clocks
//! (`TICKLINE_SIMULATE_CLOCK`: an offset, a drift and a REALTIME error, and a stated time-sync state):
//!
//! - `alpha`, the client and the reference: real clocks; NTP-style max error 1 ms.
//! - `beta`, a server alpha talks to: 3.7 s behind, 180 ppm fast, REALTIME 1.5 ms off; a clock exchange with
//!   alpha, and a request/response flow pair per request.
//! - `gamma`, a batch worker nobody talks to: 42 s ahead, 120 ppm slow, REALTIME 0.7 ms off (max error 2 ms):
//!   placed by REALTIME only.
//!
//! Every child also writes probes: an event between two reads of the real BOOTTIME (the truth, since alpha's
//! clock is the merged axis). `.ci/check_perfetto.py --check-truth` then checks that every probe lies within
//! its process's stated alignment uncertainty of the truth, and `--check-cross-flows` that every flow between
//! processes goes forward in time.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tracing::{info, info_span};
use tracing_subscriber::layer::SubscriberExt;

const ROLE: &str = "TICKLINE_TEST_ROLE";
const TRACE: &str = "TICKLINE_TEST_TRACE";
const PEER: &str = "TICKLINE_TEST_PEER";
const RUN_FOR: Duration = Duration::from_millis(2500);

/// The real (unsimulated) BOOTTIME: one read, for a tight truth bracket.
fn real_boottime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec and CLOCK_BOOTTIME exists on every Linux kernel.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One probe: an event between two real-clock reads, then the truth as a second event.
fn probe(seq: u64) {
    let lo = real_boottime_ns();
    info!(probe = seq);
    let hi = real_boottime_ns();
    info!(probe_truth = seq, truth_lo_ns = lo, truth_hi_ns = hi);
}

fn start_timeline(exchange: Option<tickline::sync::ClockExchange>) -> tickline::Timeline {
    let path = std::env::var(TRACE).expect("trace path");
    let mut exporter = tickline_perfetto::PerfettoExporter::create(&path)
        .unwrap()
        .snapshot_interval(Duration::from_millis(250));
    if let Some(x) = exchange {
        exporter = exporter.clock_exchange(x);
    }
    let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(timeline.layer())).unwrap();
    timeline
}

fn run_server() {
    let app = TcpListener::bind("127.0.0.1:0").unwrap();
    let exchange = tickline::sync::ClockExchange::listen("127.0.0.1:0").unwrap();
    let timeline = start_timeline(Some(exchange.clone()));
    println!(
        "READY {} {}",
        app.local_addr().unwrap().port(),
        exchange.local_addr().unwrap().port()
    );
    std::io::stdout().flush().unwrap();
    let (stream, _) = app.accept().unwrap();
    stream.set_nodelay(true).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut line = String::new();
    let mut seq = 0;
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 || line.trim() == "BYE" {
            break;
        }
        let id = line.trim().trim_start_matches("REQ ").to_owned();
        {
            let _handle = info_span!("handle request", "tickline.flow_in" = format!("req-{id}").as_str()).entered();
            let until = Instant::now() + Duration::from_micros(300);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            let _reply = info_span!("send reply", "tickline.flow_out" = format!("resp-{id}").as_str()).entered();
            writer.write_all(format!("RESP {id}\n").as_bytes()).unwrap();
        }
        probe(seq);
        seq += 1;
    }
    timeline.shutdown().unwrap();
    exchange.shutdown();
}

fn run_client() {
    let peer = std::env::var(PEER).expect("peer ports");
    let (app_port, exchange_port) = peer.split_once(' ').unwrap();
    let exchange = tickline::sync::ClockExchange::connect_with(
        ("127.0.0.1", exchange_port.parse::<u16>().unwrap()),
        tickline::sync::ClockExchangeConfig {
            interval: Duration::from_millis(200),
            ..tickline::sync::ClockExchangeConfig::default()
        },
    )
    .unwrap();
    let timeline = start_timeline(Some(exchange.clone()));
    let stream = TcpStream::connect(("127.0.0.1", app_port.parse::<u16>().unwrap())).unwrap();
    stream.set_nodelay(true).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let start = Instant::now();
    let mut i = 0u64;
    let mut line = String::new();
    while start.elapsed() < RUN_FOR {
        {
            let _request = info_span!("request", n = i).entered();
            {
                let _send = info_span!("send request", "tickline.flow_out" = format!("req-{i}").as_str()).entered();
                writer.write_all(format!("REQ {i}\n").as_bytes()).unwrap();
            }
            line.clear();
            reader.read_line(&mut line).unwrap();
            let _got = info_span!("got reply", "tickline.flow_in" = format!("resp-{i}").as_str()).entered();
            assert_eq!(line.trim(), format!("RESP {i}"));
        }
        probe(i);
        i += 1;
        std::thread::sleep(Duration::from_millis(20));
    }
    writer.write_all(b"BYE\n").unwrap();
    timeline.shutdown().unwrap();
    exchange.shutdown();
}

fn run_batch() {
    let timeline = start_timeline(None);
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < RUN_FOR {
        let _job = info_span!("batch job", n = i).entered();
        std::thread::sleep(Duration::from_millis(15));
        probe(i);
        i += 1;
    }
    timeline.shutdown().unwrap();
}

/// The children's entry point: does nothing in a normal test run.
#[test]
fn child() {
    match std::env::var(ROLE).as_deref() {
        Ok("server") => run_server(),
        Ok("client") => run_client(),
        Ok("batch") => run_batch(),
        _ => {}
    }
}

fn spawn(role: &str, machine: &str, simulate: &str, trace: &Path, peer: Option<&str>) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(ROLE, role)
        .env(TRACE, trace)
        .env(tickline::sync::MACHINE_ID_ENV, machine)
        .env(tickline::sync::SIMULATE_CLOCK_ENV, simulate)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(p) = peer {
        c.env(PEER, p);
    }
    c.spawn().unwrap()
}

fn tickline_cmd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tickline"))
        .args(args)
        .output()
        .unwrap()
}

fn checker() -> Option<PathBuf> {
    let ok = Command::new("python3")
        .args(["-c", "import perfetto.protos.perfetto.trace.perfetto_trace_pb2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!("SKIP: the Perfetto checks: Perfetto's Python bindings are missing (pip install perfetto protobuf)");
        return None;
    }
    Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.ci/check_perfetto.py"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tickline-multi-host-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn three_simulated_machines_merge_onto_one_axis_within_their_stated_uncertainty() {
    let dir = scratch("three");
    let (a, b, g) = (
        dir.join("alpha.pftrace"),
        dir.join("beta.pftrace"),
        dir.join("gamma.pftrace"),
    );
    let mut server = spawn(
        "server",
        "beta",
        "offset_ns=-3700000000,drift_ppm=180,realtime_error_ns=1500000,max_error_us=2500,est_error_us=400",
        &b,
        None,
    );
    let mut ready = String::new();
    let mut out = BufReader::new(server.stdout.take().unwrap());
    // libtest may print "test child ... " on the same line first.
    while !ready.contains("READY ") {
        ready.clear();
        if out.read_line(&mut ready).unwrap() == 0 {
            let _ = server.kill();
            panic!("the server child exited before it was ready");
        }
    }
    let ports = ready[ready.find("READY ").unwrap() + 6..].trim().to_owned();
    let batch = spawn(
        "batch",
        "gamma",
        "offset_ns=42000000000,drift_ppm=-120,realtime_error_ns=-700000,max_error_us=2000,est_error_us=300",
        &g,
        None,
    );
    let client = spawn(
        "client",
        "alpha",
        "max_error_us=1000,est_error_us=200",
        &a,
        Some(&ports),
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut children = [("client", client), ("server", server), ("batch", batch)];
    for i in 0..children.len() {
        let status = loop {
            if let Some(status) = children[i].1.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                for (_, c) in &mut children {
                    let _ = c.kill();
                }
                panic!("the {} child did not finish in 120 s", children[i].0);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "the {} child failed: {status}", children[i].0);
    }
    let _ = out.read_to_string(&mut String::new());

    let merged = dir.join("all.pftrace");
    let out = tickline_cmd(&[
        "merge",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        g.to_str().unwrap(),
        "-o",
        merged.to_str().unwrap(),
    ]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    println!("{report}");
    assert!(report.contains("from 3 machines"), "{report}");
    let beta = tickline::sync::MachineId::from_name("beta").to_string();
    let gamma = tickline::sync::MachineId::from_name("gamma").to_string();
    let section = |id: &str| {
        let at = report
            .find(&format!("machine {id}"))
            .unwrap_or_else(|| panic!("{id} missing: {report}"));
        report[at..].lines().take(4).collect::<Vec<_>>().join("\n")
    };
    assert!(section(&beta).contains("clock exchange with"), "{}", section(&beta));
    assert!(section(&gamma).contains("REALTIME"), "{}", section(&gamma));

    let Some(script) = checker() else { return };
    let out = Command::new("python3")
        .arg(&script)
        .arg(&merged)
        .args([
            "--check-cross-flows",
            "--min-cross-flows",
            "100",
            "--check-truth",
            // tickline's own CPU conversion error and the event's distance from its truth reads.
            "--truth-slack-ns",
            "5000",
            "--expect-processes",
            "3",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    // Each input still opens on its own.
    for input in [&a, &b, &g] {
        let out = Command::new("python3").arg(&script).arg(input).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trace written in-process by a hand-driven exporter claiming `machine` with simulated clocks.
fn small_trace(path: &Path, machine: &str, simulate: &str) {
    use tickline::export::Exporter;
    let sim = tickline::sync::SimulatedClock::parse(simulate).unwrap();
    let mut exporter = tickline_perfetto::PerfettoExporter::create(path)
        .unwrap()
        .machine_id(tickline::sync::MachineId::from_name(machine))
        .simulate_clock(Some(sim));
    exporter.export(&tickline::export::Batch::default()).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    exporter.finish().unwrap();
}

#[test]
fn traces_that_would_merge_wrongly_are_clear_errors() {
    let dir = scratch("errors");
    let (x, y, z) = (dir.join("x.pftrace"), dir.join("y.pftrace"), dir.join("z.pftrace"));
    small_trace(&x, "one", "offset_ns=0");
    small_trace(&y, "one", "offset_ns=5000000000");
    small_trace(&z, "two", "offset_ns=0");
    let output = dir.join("out.pftrace");
    let run = |args: &[&Path]| {
        let mut a: Vec<&str> = vec!["merge"];
        a.extend(args.iter().map(|p| p.to_str().unwrap()));
        a.extend(["-o", output.to_str().unwrap()]);
        tickline_cmd(&a)
    };
    // The same machine id, clocks 5 s apart: different boots or machines.
    let out = run(&[&x, &y]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("both claim machine"), "{err}");
    // The same trace twice.
    let out = run(&[&x, &x]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("same trace"), "{err}");
    // A file that is not there, and one that is not a trace.
    let missing = dir.join("missing.pftrace");
    let out = run(&[&x, &missing]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("missing.pftrace") && err.contains("cannot read"),
        "{err}"
    );
    let junk = dir.join("junk.pftrace");
    std::fs::write(&junk, b"hello, not a protobuf").unwrap();
    let out = run(&[&x, &junk]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("junk.pftrace"), "{err}");
    // Two machines with only their snapshots merge, by REALTIME.
    let out = run(&[&x, &z]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("REALTIME"), "{text}");
    // A merged trace merged again: its clocks are already another machine's axis (placed again, it came out
    // 2.5 s off with a stated uncertainty of 64 µs).
    let again = dir.join("again.pftrace");
    small_trace(&again, "one", "offset_ns=0");
    let output_again = dir.join("out-again.pftrace");
    let out = tickline_cmd(&[
        "merge",
        again.to_str().unwrap(),
        output.to_str().unwrap(),
        "-o",
        output_again.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("out.pftrace is a merged trace (2 traces in it)"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two traces of one machine whose processes had the same pid (a pid used again after its process ended, or
/// processes in containers, each its own pid 1): the later one's pids and tids move up, or Perfetto would
/// show one process where there were two.
#[test]
fn traces_of_one_machine_with_the_same_pid_stay_two_processes() {
    let dir = scratch("same-pid");
    let (a, b) = (dir.join("a.pftrace"), dir.join("b.pftrace"));
    // Both recorded by this test's process: the same pid (and thread).
    for path in [&a, &b] {
        let exporter = tickline_perfetto::PerfettoExporter::create(path)
            .unwrap()
            .machine_id(tickline::sync::MachineId::from_name("one"));
        let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
        drop(tickline::scope!("work"));
        timeline.shutdown().unwrap();
    }
    let output = dir.join("out.pftrace");
    let out = tickline_cmd(&[
        "merge",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "-o",
        output.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        text.contains("b.pftrace's pids and tids collide with another trace's of the same machine"),
        "{text}"
    );
    if checker().is_some() {
        let pids = Command::new("python3")
            .args([
                "-c",
                "import sys\n\
                 from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb\n\
                 t = pb.Trace()\n\
                 t.ParseFromString(open(sys.argv[1], 'rb').read())\n\
                 print(sorted({p.track_descriptor.process.pid for p in t.packet \
                 if p.HasField('track_descriptor') and p.track_descriptor.HasField('process')}))",
                output.to_str().unwrap(),
            ])
            .output()
            .unwrap();
        let pids = String::from_utf8_lossy(&pids.stdout);
        let own = std::process::id();
        assert_eq!(
            pids.trim(),
            format!("[{own}, {}]", u64::from(own) + (1 << 22)),
            "{pids}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An output that is one of the inputs under another spelling (relative, absolute, a symlink, a hard link)
/// is refused before anything is written: the merge read its inputs, then replaced that one with the result.
#[test]
fn merge_refuses_an_output_that_is_one_of_its_inputs() {
    let dir = scratch("same-file");
    let (x, z) = (dir.join("x.pftrace"), dir.join("z.pftrace"));
    small_trace(&x, "one", "offset_ns=0");
    small_trace(&z, "two", "offset_ns=0");
    let (x_bytes, z_bytes) = (std::fs::read(&x).unwrap(), std::fs::read(&z).unwrap());
    std::os::unix::fs::symlink("z.pftrace", dir.join("link.pftrace")).unwrap();
    std::fs::hard_link(&x, dir.join("hard.pftrace")).unwrap();
    let absolute = x.to_str().unwrap();
    let cases: [&[&str]; 4] = [
        &["merge", "x.pftrace", "z.pftrace", "-o", "./x.pftrace"],
        &["merge", "z.pftrace", "x.pftrace", "-o", absolute],
        &["merge", "x.pftrace", "z.pftrace", "-o", "link.pftrace"],
        &["merge", "z.pftrace", "x.pftrace", "-o", "hard.pftrace"],
    ];
    for args in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_tickline"))
            .current_dir(&dir)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(std::fs::read(&x).unwrap() == x_bytes, "{args:?}: x changed: {err}");
        assert!(std::fs::read(&z).unwrap() == z_bytes, "{args:?}: z changed: {err}");
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("the same file"), "{args:?}: {err}");
    }
    // A failed merge leaves an existing output as it was; a successful one replaces it, leaving no temporary.
    let output = dir.join("out.pftrace");
    std::fs::write(&output, b"an earlier merge").unwrap();
    let junk = dir.join("junk.pftrace");
    std::fs::write(&junk, b"hello, not a protobuf").unwrap();
    let out = tickline_cmd(&[
        "merge",
        absolute,
        junk.to_str().unwrap(),
        "-o",
        output.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&output).unwrap(), b"an earlier merge");
    let out = tickline_cmd(&["merge", absolute, z.to_str().unwrap(), "-o", output.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read(&output).unwrap() != b"an earlier merge");
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A trace of a timeline in this process claiming `machine`, with spans carrying flow fields: each
/// `(name, field, key)` one span, in order; field `"out"` or `"out-task"` (a sender entered twice: an async
/// task) sends, any other receives.
fn flow_trace(path: &Path, machine: &str, spans: &[(&str, &str, &str)]) {
    let exporter = tickline_perfetto::PerfettoExporter::create(path)
        .unwrap()
        .machine_id(tickline::sync::MachineId::from_name(machine));
    let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for &(name, field, key) in spans {
            match field {
                "out" => drop(info_span!("flow", span = name, "tickline.flow_out" = key).entered()),
                "out-task" => {
                    let send = info_span!("flow", span = name, "tickline.flow_out" = key);
                    drop(send.enter());
                    drop(send.enter());
                }
                _ => drop(info_span!("flow", span = name, "tickline.flow_in" = key).entered()),
            }
        }
    });
    timeline.shutdown().unwrap();
}

/// `tickline merge A B -o MERGED`, which must succeed: its report.
fn merge_two(a: &Path, b: &Path, merged: &Path) -> String {
    let out = tickline_cmd(&[
        "merge",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "-o",
        merged.to_str().unwrap(),
    ]);
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    report
}

#[test]
fn merge_links_every_receiver_once_where_a_trace_already_linked_one() {
    let dir = scratch("field-flows");
    let (a, b) = (dir.join("a.pftrace"), dir.join("b.pftrace"));
    // Trace a links its sender to its own receiver; trace b holds a second receiver of the same key.
    flow_trace(&a, "one", &[("send", "out", "req-1"), ("here", "in", "req-1")]);
    flow_trace(&b, "two", &[("there", "in", "req-1")]);
    let merged = dir.join("merged.pftrace");
    let report = merge_two(&a, &b, &merged);
    assert!(
        report.contains("2 flows from flow fields (1 across processes)"),
        "{report}"
    );
    let Some(script) = checker() else { return };
    for (trace, flows) in [(&a, "1 flows"), (&merged, "2 flows")] {
        let out = Command::new("python3").arg(&script).arg(trace).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        // Merged: one flow per receiver, and not the one trace a drew itself on top.
        assert!(stdout.contains(flows), "{}: {stdout}", trace.display());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sender span that is an async task (entered twice) carries its flow field on its thread slices and on its
/// task's lifetime slice: still one sender (it was two, and the flow was left unlinked), one flow to the
/// receiver in the other trace.
#[test]
fn merge_counts_an_async_task_sender_once() {
    let dir = scratch("task-flow");
    let (a, b, merged) = (dir.join("a.pftrace"), dir.join("b.pftrace"), dir.join("ab.pftrace"));
    flow_trace(&a, "one", &[("send", "out-task", "req-7")]);
    flow_trace(&b, "two", &[("receive", "in", "req-7")]);
    let report = merge_two(&a, &b, &merged);
    assert!(
        report.contains("1 flows from flow fields (1 across processes)"),
        "{report}"
    );
    assert!(!report.contains("without exactly one sender"), "{report}");
    if let Some(script) = checker() {
        let out = Command::new("python3").arg(&script).arg(&merged).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two processes on one machine recording at the same time, merged: each trace's clock snapshots run from its
/// own start, so appended one after the other the second's would go back in time, which Perfetto's importer
/// rejects ("the trace clock is not monotonic", an import error). The merge writes the machine's snapshots
/// once, in time order; the checker replays that rule.
#[test]
fn traces_of_one_machine_recorded_at_once_merge_with_snapshots_in_time_order() {
    let dir = scratch("one-machine");
    let (a, b, merged) = (dir.join("a.pftrace"), dir.join("b.pftrace"), dir.join("ab.pftrace"));
    let first = spawn("batch", "delta", "offset_ns=0", &a, None);
    std::thread::sleep(Duration::from_millis(600));
    let second = spawn("batch", "delta", "offset_ns=0", &b, None);
    for child in [first, second] {
        assert!(child.wait_with_output().unwrap().status.success());
    }
    // The earlier trace second: its snapshots start before the later trace's ended.
    let out = tickline_cmd(&[
        "merge",
        b.to_str().unwrap(),
        a.to_str().unwrap(),
        "-o",
        merged.to_str().unwrap(),
    ]);
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{report}{}", String::from_utf8_lossy(&out.stderr));
    assert!(report.contains("from 1 machine into"), "{report}");
    let Some(script) = checker() else { return };
    let out = Command::new("python3")
        .arg(&script)
        .arg(&merged)
        .args(["--expect-processes", "2"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
}
