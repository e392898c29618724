//! `tickline convert` and `tickline stats` on a raw `.tickline` capture, on the library's reader
//! ([`tickline::capture`]).

use std::fmt::Write as _;
use std::path::Path;

use tickline::capture::{CaptureError, CaptureSummary};

use crate::merge::human_ns;
use crate::output::OutputFile;

/// Whether the file at `path` is a raw capture (by its magic), not a Perfetto trace.
pub fn is_capture_file(path: &Path) -> std::io::Result<bool> {
    use std::io::Read;
    let mut head = [0u8; 8];
    let mut file = std::fs::File::open(path)?;
    let mut filled = 0;
    while filled < head.len() {
        match file.read(&mut head[filled..])? {
            0 => break,
            n => filled += n,
        }
    }
    // A file shorter than the magic but a prefix of it is a capture cut inside its header (the reader says so);
    // no Perfetto trace starts with `T` (field 10, wire type 4: invalid).
    let head = &head[..filled];
    Ok(tickline::capture::is_capture(head) || (!head.is_empty() && b"TICKLINE".starts_with(head)))
}

/// `tickline convert INPUT -o OUTPUT`: the capture converted into a Perfetto trace, with the whole
/// calibration history. A capture cut short converts up to its last whole frame (the summary says so).
pub fn convert(input: &Path, output: &Path) -> Result<CaptureSummary, String> {
    if !is_capture_file(input).map_err(|e| format!("{}: cannot read: {e}", input.display()))? {
        return Err(format!(
            "{}: not a tickline raw capture (it does not start with TICKLINE); `tickline stats` reads .pftrace files",
            input.display()
        ));
    }
    // By file identity: `-o ./X`, an absolute path, a symlink or a hard link to the capture would otherwise
    // be truncated before the capture is read.
    crate::output::check_not_input(output, [input]).map_err(|e| e.to_string())?;
    // Written beside the output and renamed over it only on success: a corrupt capture or a failed write
    // leaves an existing output as it was.
    let mut file = OutputFile::create(output).map_err(|e| cannot_create(output, &e))?;
    let writer = file.file().try_clone().map_err(|e| cannot_create(output, &e))?;
    // Its errors name the output, not the temporary file it writes.
    let exporter = tickline_perfetto::PerfettoExporter::new(writer).output_name(output);
    // `convert` finishes the exporter (its last packets written) and drops it before it returns.
    let summary = tickline::capture::convert(input, exporter).map_err(|e| describe(input, &e))?;
    file.commit()
        .map_err(|e| format!("cannot write trace file {}: {e}", output.display()))?;
    Ok(summary)
}

fn cannot_create(output: &Path, e: &std::io::Error) -> String {
    format!("cannot create trace file {}: {e}", output.display())
}

/// `tickline stats FILE.tickline`: what the capture holds, read and converted into nothing.
pub fn stats(input: &Path) -> Result<CaptureSummary, String> {
    tickline::capture::summarize(input).map_err(|e| describe(input, &e))
}

fn describe(path: &Path, e: &CaptureError) -> String {
    format!("{}: {e}", path.display())
}

fn number(v: f64, digits: usize) -> String {
    if v.is_finite() {
        format!("{v:.digits$}")
    } else {
        "not measured".to_owned()
    }
}

/// The summary as text, one fact per line.
pub fn summary_text(s: &CaptureSummary) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "raw capture of pid {} ({}), {}",
        s.pid,
        s.process_name,
        match (&s.stopped_early, s.complete) {
            (Some(why), _) => format!("cut short: {why} (read up to its last whole frame)"),
            (None, true) => "complete".to_owned(),
            (None, false) =>
                "not finished by its writer (still being written, or the process ended without stopping the timeline)"
                    .to_owned(),
        }
    );
    let _ = writeln!(t, "threads:       {} ({} call sites)", s.threads, s.callsites);
    let _ = writeln!(
        t,
        "records:       {} kept, {} dropped while recording ({} slices dropped whole)",
        s.records, s.dropped_records, s.dropped_slices
    );
    let _ = writeln!(
        t,
        "converted:     {} slices, {} instants; {} truncated slices, {} unknown spans, {} framing errors",
        s.slices, s.instants, s.stats.truncated_slices, s.stats.unknown_spans, s.stats.framing_errors
    );
    let _ = writeln!(
        t,
        "CPU clock:     {}, {} calibration bursts, drift {} ppm, error bound {} ns",
        s.tick_source,
        s.cpu_calibration_bursts,
        number(s.cpu_drift_ppm, 3),
        number(s.cpu_error_bound_ns, 1)
    );
    if let Some((fallback, doubt, text)) = &s.cpu_clock_note {
        let tag = match (fallback, doubt) {
            (true, _) => "fell back to CLOCK_MONOTONIC: ",
            (false, true) => "in doubt: ",
            (false, false) => "",
        };
        let _ = writeln!(t, "CPU decision:  {tag}{text}");
    }
    for g in &s.gpu_clocks {
        let _ = writeln!(
            t,
            "GPU clock:     {} ({}), {} calibration bursts, drift {} ppm, error bound {}",
            g.name,
            g.api,
            g.bursts,
            number(g.drift_ppm, 3),
            if g.error_bound_ns.is_finite() {
                human_ns(g.error_bound_ns.round() as u64)
            } else {
                "not measured".to_owned()
            }
        );
    }
    let _ = writeln!(
        t,
        "GPU:           {} scopes, {} lost, {} causality violations",
        s.stats.gpu_scopes, s.stats.gpu_lost_scopes, s.stats.gpu_causality_violations
    );
    t
}

/// The summary as one JSON object (non-finite numbers become `null`).
pub fn summary_json(s: &CaptureSummary) -> serde_json::Value {
    let finite = |v: f64| {
        if v.is_finite() {
            serde_json::json!(v)
        } else {
            serde_json::Value::Null
        }
    };
    let gpus: Vec<serde_json::Value> = s
        .gpu_clocks
        .iter()
        .map(|g| {
            serde_json::json!({
                "name": g.name, "api": g.api, "bursts": g.bursts,
                "drift_ppm": finite(g.drift_ppm), "error_bound_ns": finite(g.error_bound_ns),
            })
        })
        .collect();
    serde_json::json!({
        "kind": "tickline raw capture",
        "pid": s.pid,
        "process": s.process_name,
        "complete": s.complete,
        "stopped_early": s.stopped_early,
        "threads": s.threads,
        "callsites": s.callsites,
        "records": s.records,
        "dropped_records": s.dropped_records,
        "dropped_slices": s.dropped_slices,
        "slices": s.slices,
        "instants": s.instants,
        "truncated_slices": s.stats.truncated_slices,
        "unknown_spans": s.stats.unknown_spans,
        "framing_errors": s.stats.framing_errors,
        "cpu_clock": {
            "tick_source": s.tick_source,
            "bursts": s.cpu_calibration_bursts,
            "drift_ppm": finite(s.cpu_drift_ppm),
            "error_bound_ns": finite(s.cpu_error_bound_ns),
            "fallback": s.cpu_clock_note.as_ref().map(|n| n.0),
            "doubt": s.cpu_clock_note.as_ref().map(|n| n.1),
            "decision": s.cpu_clock_note.as_ref().map(|n| n.2.clone()),
        },
        "gpu_clocks": gpus,
        "gpu_scopes": s.stats.gpu_scopes,
        "gpu_lost_scopes": s.stats.gpu_lost_scopes,
    })
}
