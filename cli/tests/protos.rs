//! Every packet tickline writes, decoded with Perfetto's official schema (`perfetto_protos`): a timeline with
//! threads, fields, counters, a simulated GPU (device and queue tracks, flows), a clock exchange, and then the
//! same traces merged, and cut short.
#![cfg(feature = "protos")]

use std::time::Duration;

use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
use tracing_subscriber::layer::SubscriberExt;

/// One timeline at a time: native macros record into the most recently started timeline, so two tests'
/// timelines side by side would take each other's records.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn record(path: &std::path::Path, exchange: tickline::sync::ClockExchange, flow_field: &str) {
    let exporter = tickline_perfetto::PerfettoExporter::create(path)
        .unwrap()
        .clock_exchange(exchange)
        .snapshot_interval(Duration::from_millis(20));
    let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
    let queue = gpu.queue("compute").unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..20u32 {
            let key = format!("msg-{i}");
            let _span = if flow_field == "out" {
                tracing::info_span!(
                    "send",
                    n = i,
                    ratio = 0.5,
                    ok = true,
                    "tickline.flow_out" = key.as_str()
                )
            } else {
                tracing::info_span!("receive", n = i, "tickline.flow_in" = key.as_str())
            }
            .entered();
            // A value longer than 127 bytes: its annotation's length prefix is widened after encoding.
            let note = "n".repeat(120 + 10 * i as usize);
            tracing::info!(step = i, note = note.as_str(), "an event");
            tickline::counter!("depth", i64::from(i));
            let commands = SimCommands::new();
            {
                let _k = tickline::gpu_scope!(queue, &commands, "kernel", index = i);
                commands.work(Duration::from_micros(20));
            }
            let _ = gpu.backend().submit(commands).wait();
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    timeline.shutdown().unwrap();
}

#[test]
fn every_packet_tickline_writes_decodes_with_perfettos_schema() {
    let _one_at_a_time = exclusive();
    let dir = std::env::temp_dir().join(format!("tickline-protos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (a, b, merged) = (dir.join("a.pftrace"), dir.join("b.pftrace"), dir.join("all.pftrace"));
    let server = tickline::sync::ClockExchange::listen_with(
        "127.0.0.1:0",
        tickline::sync::ClockExchangeConfig {
            machine_id: tickline::sync::MachineId::from_name("protos-b"),
            ..tickline::sync::ClockExchangeConfig::default()
        },
    )
    .unwrap();
    let client = tickline::sync::ClockExchange::connect_with(
        server.local_addr().unwrap(),
        tickline::sync::ClockExchangeConfig {
            machine_id: tickline::sync::MachineId::from_name("protos-a"),
            interval: Duration::from_millis(20),
            ..tickline::sync::ClockExchangeConfig::default()
        },
    )
    .unwrap();
    // One process records both traces, one after the other (timelines are one at a time per process).
    record(&a, client.clone(), "out");
    record(&b, server.clone(), "in");
    client.shutdown();
    server.shutdown();

    for path in [&a, &b] {
        let s = tickline_cli::stats::read(path).unwrap();
        println!("{}:\n{s}", path.display());
        // The GPU device and queue tracks say what they are in `description` (TrackDescriptor field 14), and
        // tracks other than threads' and processes' are never merged by name (`sibling_merge_behavior`, 15):
        // both newer than perfetto_protos 0.51's schema (Perfetto's current one, which the Python checker uses,
        // has them); nothing else is unknown.
        assert_eq!(
            s.unknown_field_numbers.iter().collect::<Vec<_>>(),
            ["TrackDescriptor.14", "TrackDescriptor.15"],
            "fields outside Perfetto's schema"
        );
        assert_eq!(s.open_slices, 0);
        assert_eq!(s.slices_by_name.get("kernel"), Some(&20));
        assert_eq!(s.thread_tracks, 1);
        assert!(s.flows >= 20, "CPU->GPU flows: {}", s.flows);
        assert!(s.clock_snapshots >= 3);
        assert_eq!(s.snapshot_clocks, vec![1, 3, 5, 6]);
        assert!(s.trace_uuid.is_some() && s.system.is_some() && s.identity.len() == 1);
        assert!(s.exchange_rounds >= 8, "{}", s.exchange_rounds);
        assert!(s.counters.contains_key("depth"));
        assert!(s.max_gpu_uncertainty_ns.is_some());
        assert_eq!(s.cut_at, None, "every packet whole");
    }
    let report = tickline_cli::merge::merge(&tickline_cli::merge::MergeOptions::new(
        vec![a.clone(), b.clone()],
        merged.clone(),
    ));
    // Both traces come from this one machine's clock but claim two machine ids: the exchange aligns them.
    let report = report.unwrap();
    println!("{report}");
    assert_eq!(report.flows, 20);
    assert_eq!(
        report.machines.len(),
        2,
        "the exporters take their exchange's machine ids"
    );
    assert!(report.machines[1].method.contains("clock exchange"), "{report}");
    // One process wrote both, as two machines: the second machine's pid and tids are moved out of the way.
    assert_eq!(report.renumbered.len(), 1, "{report}");
    assert!(report.to_string().contains("shown as pid + 4194304"), "{report}");
    let s = tickline_cli::stats::read(&merged).unwrap();
    // The alignment tracks' and GPU tracks' `description` (TrackDescriptor field 14) and
    // `sibling_merge_behavior` (15) are newer than perfetto_protos 0.51's schema; nothing else is unknown.
    assert_eq!(
        s.unknown_field_numbers.iter().collect::<Vec<_>>(),
        ["TrackDescriptor.14", "TrackDescriptor.15"]
    );
    assert_eq!(s.slices_by_name.get("kernel"), Some(&40));
    assert!(s.counters.contains_key(tickline_cli::merge::ALIGNMENT_TRACK));
    assert_eq!((s.process_tracks, s.thread_tracks), (2, 2));
    // Cut short: decoded up to the last whole packet.
    let bytes = std::fs::read(&a).unwrap();
    let cut = dir.join("cut.pftrace");
    for at in [bytes.len() / 3, bytes.len() / 2 + 1, bytes.len() - 2] {
        std::fs::write(&cut, &bytes[..at]).unwrap();
        let s = tickline_cli::stats::read(&cut).unwrap();
        assert!(s.packets > 0);
        // A cut that falls exactly between two packets leaves a whole (shorter) trace: nothing to report.
        assert!(
            s.cut_at.is_none_or(|c| c as usize <= at),
            "{:?} for a cut at {at}",
            s.cut_at
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `TimelineStats::events` counts every event the timeline handed the exporter; the Perfetto exporter adds its
/// own instants besides (the trace's identity, one per clock snapshot, one per clock-exchange round and its
/// end), and
/// nothing else: the file's track events are exactly the two.
#[test]
fn timeline_stats_count_every_event_in_the_file_but_the_exporters_own() {
    let _one_at_a_time = exclusive();
    let path = std::env::temp_dir().join(format!("tickline-protos-events-{}.pftrace", std::process::id()));
    let exporter = tickline_perfetto::PerfettoExporter::create(&path)
        .unwrap()
        .snapshot_interval(Duration::from_millis(5));
    let timeline = tickline::Timeline::builder().exporter(exporter).start().unwrap();
    let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
    let queue = gpu.queue("compute").unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..50u32 {
            let _span = tracing::info_span!("step", n = i).entered();
            tracing::info!(i, "an event");
            tickline::counter!("depth", i64::from(i));
            let commands = SimCommands::new();
            {
                let _k = tickline::gpu_scope!(queue, &commands, "kernel");
                commands.work(Duration::from_micros(20));
            }
            let _ = gpu.backend().submit(commands).wait();
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    drop(queue);
    drop(gpu);
    let stats = timeline.shutdown().unwrap();
    let s = tickline_cli::stats::read(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(s.open_slices, 0);
    let in_file = 2 * s.slices + s.instants + s.counter_values;
    let exporters_own = s.identity.len() as u64 + s.recordings_ended + s.clock_snapshots + s.exchange_rounds;
    assert!(s.clock_snapshots >= 3, "{}", s.clock_snapshots);
    assert_eq!(stats.events, in_file - exporters_own, "{stats:?}\n{s}");
}

/// A converted capture's summary counts the instants its Perfetto file holds, but the exporter's own.
#[test]
fn a_converted_captures_instants_are_its_files_but_the_exporters_own() {
    let _one_at_a_time = exclusive();
    let dir = std::env::temp_dir().join(format!("tickline-protos-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (capture, converted) = (dir.join("run.tickline"), dir.join("run.pftrace"));
    let timeline = tickline::Timeline::builder().raw_capture(&capture).start().unwrap();
    let subscriber = tracing_subscriber::registry().with(timeline.layer());
    tracing::subscriber::with_default(subscriber, || {
        for i in 0..30u32 {
            let _span = tracing::info_span!("step", n = i).entered();
            tracing::info!(i, "an event");
        }
    });
    timeline.shutdown().unwrap();
    let exporter = tickline_perfetto::PerfettoExporter::create(&converted).unwrap();
    let summary = tickline::capture::convert(&capture, exporter).unwrap();
    let s = tickline_cli::stats::read(&converted).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let exporters_own = s.identity.len() as u64 + s.recordings_ended + s.clock_snapshots + s.exchange_rounds;
    assert_eq!(summary.instants, s.instants - exporters_own, "{summary:?}\n{s}");
    assert_eq!(summary.slices, s.slices);
}
