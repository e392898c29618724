//! The slices on GPU queue tracks of a trace read back from a `MemoryExporter`, for the examples and tests
//! that check where GPU work landed.

#![allow(dead_code)] // each user reads part of it

use std::collections::HashMap;

use tickline::export::{EventKind, FieldValue, MemoryTrace, TrackId, TrackKind};

/// A slice on a GPU queue track (any lane) of a trace.
#[derive(Clone, Debug)]
pub struct QueueSlice {
    pub name: String,
    /// The queue's track (or its lane's).
    pub track: TrackId,
    /// The device's name (its track's).
    pub device: String,
    pub begin: u64,
    pub end: u64,
    pub fields: HashMap<String, FieldValue>,
    /// The flow from the CPU that ends here.
    pub flow_in: Option<u64>,
}

impl QueueSlice {
    /// An unsigned field (`uncertainty_ns`, an index the program gave the scope).
    pub fn u64(&self, name: &str) -> Option<u64> {
        match self.fields.get(name) {
            Some(FieldValue::U64(v)) => Some(*v),
            _ => None,
        }
    }
}

/// Every slice on the GPU queue tracks of `trace`, begins paired with ends per track; an end without its
/// begin is an error.
pub fn queue_slices(trace: &MemoryTrace) -> Result<Vec<QueueSlice>, String> {
    let mut open: HashMap<_, Vec<QueueSlice>> = HashMap::new();
    let mut done = Vec::new();
    for e in &trace.events {
        let Some(track) = trace.track(e.track) else { continue };
        if !matches!(track.kind, TrackKind::GpuQueue { .. }) {
            continue;
        }
        match e.kind {
            EventKind::SliceBegin => {
                let device = match track.parent.and_then(|p| trace.track(p)).map(|d| &d.kind) {
                    Some(TrackKind::GpuDevice { name, .. }) => name.clone(),
                    _ => String::new(),
                };
                open.entry(e.track).or_default().push(QueueSlice {
                    name: e.name.clone(),
                    track: e.track,
                    device,
                    begin: e.ts_ns,
                    end: 0,
                    fields: e.fields.iter().cloned().collect(),
                    flow_in: e.flow_in,
                });
            }
            EventKind::SliceEnd => {
                let mut s = open
                    .get_mut(&e.track)
                    .and_then(Vec::pop)
                    .ok_or_else(|| format!("a GPU slice end at {} ns without its begin", e.ts_ns))?;
                s.end = e.ts_ns;
                done.push(s);
            }
            _ => {}
        }
    }
    Ok(done)
}
