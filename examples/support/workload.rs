//! The demo workload the quickstart and `tracy_live` share: CPU jobs recorded through `tracing` and native
//! scopes, and GPU frames on tickline's simulated GPU.
//!
//! Included with `#[path = "support/workload.rs"] mod workload;`.

use std::time::{Duration, Instant};

use tickline::gpu::sim::{SimCommands, SimGpu};
use tickline::gpu::GpuQueue;
use tracing::{debug, info_span};

/// A stand-in for real work: spin for about `micros` µs so the slices have visible widths.
pub fn busy(micros: u64) -> u64 {
    let end = Instant::now() + Duration::from_micros(micros);
    let mut x = 0u64;
    while Instant::now() < end {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    }
    x
}

/// One job of worker `worker`: a `job` span (a field recorded after creation) holding a `load` span and a
/// `compute` span of three native `kernel step` scopes, each setting a counter; then an event.
pub fn job(worker: usize, job: usize) {
    let span = info_span!("job", worker, job, kind = tracing::field::Empty);
    let _job = span.enter();
    span.record("kind", if job % 3 == 0 { "heavy" } else { "light" });
    {
        let _load = info_span!("load", bytes = 4096 * (job % 64 + 1)).entered();
        busy(40);
    }
    {
        let _compute = info_span!("compute").entered();
        for step in 0..3 {
            let _s = tickline::scope!("kernel step");
            busy(if job % 3 == 0 { 60 } else { 20 });
            tickline::counter!("worker steps", (job * 3 + step) as f64);
        }
    }
    debug!(worker, job, "job finished");
}

/// One frame on the simulated GPU, inside a `render frame` span: an `upload` scope on the transfer queue and a
/// `frame` scope holding `shadow pass` and `lighting` on the graphics queue, run concurrently on two hardware
/// queues and waited for.
pub fn simulated_frame(gpu: &SimGpu, graphics: &GpuQueue<SimGpu>, transfer: &GpuQueue<SimGpu>, frame: u32) {
    let _frame_span = info_span!("render frame", frame).entered();
    let (draw, upload) = (SimCommands::new(), SimCommands::new());
    {
        let _upload = tickline::gpu_scope!(transfer, &upload, "upload", bytes = 1u64 << 20);
        upload.work(Duration::from_micros(250));
    }
    {
        let _frame = tickline::gpu_scope!(graphics, &draw, "frame", index = frame);
        {
            let _shadows = tickline::gpu_scope!(graphics, &draw, "shadow pass");
            draw.work(Duration::from_micros(300));
        }
        let _lighting = tickline::gpu_scope!(graphics, &draw, "lighting");
        draw.work(Duration::from_micros(500));
    }
    let uploaded = gpu.submit_to(1, upload);
    let drawn = gpu.submit_to(0, draw);
    let _wait = info_span!("wait for GPU").entered();
    let _ = (uploaded.wait(), drawn.wait());
}
