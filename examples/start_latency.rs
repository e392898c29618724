//! How long `Timeline::builder().start()` takes: the first start in a process and the starts after it, and
//! which CPU tick source each start picked. One process prints one JSON line; `benches/start_latency.sh` runs
//! it many times and reports p50/p99, and `benches/tsc_decision_under_load.sh` runs it beside busy loops and
//! counts processes that did not record with the TSC.
//!
//! `cargo run --release --example start_latency [-- LATER_STARTS [WAIT_FINAL_MS]]`
//!
//! With `WAIT_FINAL_MS` > 0 it also waits (at most that long) for the process's final tick-source decision
//! (the full reliability check finishes in the background after the first start) and prints it.

use std::time::{Duration, Instant};

use tickline::{clock::TickSource, Timeline};

fn main() {
    let mut args = std::env::args().skip(1);
    let later_starts: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let wait_final_ms: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0);

    let mut starts_us = Vec::with_capacity(later_starts + 1);
    let mut sources = Vec::with_capacity(later_starts + 1);
    let mut first_reason = None;
    for i in 0..=later_starts {
        let t0 = Instant::now();
        let timeline = Timeline::builder().start().expect("the timeline starts");
        let elapsed = t0.elapsed();
        starts_us.push(elapsed.as_secs_f64() * 1e6);
        sources.push(format!("{:?}", timeline.tick_source()));
        if i == 0 {
            first_reason = timeline.tsc_fallback_reason().map(str::to_string);
        }
        timeline.shutdown().expect("the timeline stops");
    }
    let hardware = TickSource::hardware().map(|s| format!("{s:?}"));
    let final_decision = final_decision(Duration::from_millis(wait_final_ms));
    let later: Vec<String> = starts_us[1..].iter().map(|us| format!("{us:.1}")).collect();
    let sources: Vec<String> = sources.iter().map(|s| format!("\"{s}\"")).collect();
    println!(
        "{{\"first_us\":{:.1},\"later_us\":[{}],\"sources\":[{}],\"hardware\":{},\"first_fallback_reason\":{},\"final\":{}}}",
        starts_us[0],
        later.join(","),
        sources.join(","),
        json_string(hardware.as_deref()),
        json_string(first_reason.as_deref()),
        final_decision,
    );
}

/// The process's final decision as JSON (`null` when not asked for).
fn final_decision(wait: Duration) -> String {
    if wait.is_zero() {
        return "null".to_string();
    }
    let decision = tickline::clock::TscDecider::process().wait_final(wait);
    let figures = &decision.figures;
    serde_json::json!({
        "source": format!("{:?}", decision.source),
        "stage": decision.stage.name(),
        "fallback": decision.is_fallback(),
        "reason": decision.fallback_reason,
        "warnings": decision.warnings,
        "passes": figures.passes,
        "check_ms": figures.check_time.as_secs_f64() * 1e3,
        "cpus_tested": figures.cpus_tested,
        "max_shift_ns": figures.max_shift_ns,
        "rate_spread_ppm": figures.rate_spread_ppm,
    })
    .to_string()
}

fn json_string(s: Option<&str>) -> String {
    match s {
        Some(s) => serde_json::Value::String(s.to_string()).to_string(),
        None => "null".to_string(),
    }
}
