//! Tracy's GPU contexts are a process-wide resource (255, never deleted): a timeline started after another
//! ended takes over the contexts of its lanes of the same names. Its own process (its own test binary), so
//! that no other test's contexts count.

use std::time::Duration;

use tickline::gpu::sim::{SimCommands, SimGpu, SimGpuConfig};
use tickline::Timeline;
use tickline_tracy::{TracyExporter, TracyStats};

/// A timeline with `queues` simulated GPU queues named `q0`, `q1`...: one GPU scope on each. The Tracy
/// exporter's stats at its end.
fn one_scope_per_queue(queues: usize) -> TracyStats {
    let tracy = TracyExporter::new();
    let stats = tracy.stats();
    let timeline = tracy.install(Timeline::builder()).start().unwrap();
    let gpu = timeline.gpu(SimGpu::new(SimGpuConfig::default()).unwrap()).unwrap();
    let queues: Vec<_> = (0..queues).map(|i| gpu.queue(&format!("q{i}")).unwrap()).collect();
    let commands = SimCommands::new();
    for queue in &queues {
        let _scope = tickline::gpu_scope!(queue, &commands, "work");
        commands.work(Duration::from_micros(5));
    }
    gpu.backend().submit(commands).wait();
    timeline.shutdown().unwrap();
    drop(queues);
    stats.get()
}

#[test]
fn timelines_one_after_another_reuse_their_lanes_tracy_gpu_contexts() {
    // More lanes than Tracy has contexts: 255 get one, the rest are counted.
    let first = one_scope_per_queue(300);
    assert_eq!(
        (first.gpu_contexts, first.gpu_zones, first.gpu_zones_without_context),
        (255, 255, 45),
        "{first:?}"
    );
    // The same lanes again, in a new timeline: the contexts of the ended one, none made (none are left).
    for _ in 0..3 {
        let again = one_scope_per_queue(300);
        assert_eq!(
            (again.gpu_contexts, again.gpu_zones, again.gpu_zones_without_context),
            (255, 255, 45),
            "{again:?}"
        );
    }
    let fewer = one_scope_per_queue(10);
    assert_eq!((fewer.gpu_zones, fewer.gpu_zones_without_context), (10, 0), "{fewer:?}");
}

/// No profiler connects in this test: waiting for one is a clear error after the time given, not a hang.
#[test]
fn waiting_for_a_profiler_that_never_comes_is_a_clear_error() {
    let begin = std::time::Instant::now();
    let err = TracyExporter::wait_for_connection(Duration::from_millis(200)).unwrap_err();
    let waited = begin.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert!(matches!(err, tickline_tracy::TracyError::NotConnected { waited } if waited >= Duration::from_millis(200)));
    assert!(err.to_string().contains("no Tracy profiler connected"), "{err}");
}
