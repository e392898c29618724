//! Skipping what needs a GPU when the machine has none, with the reason on stderr: shared by the integration
//! tests and the GPU benches (each includes this file with `#[path]`). The examples fail instead.

#![allow(dead_code)]

use std::fmt::Display;
use std::io::Write;

/// Says why `what` (a test, a bench) does not run, on the process's stderr: straight to the stream, not through
/// `eprintln!`, which the test harness captures, so the line shows even when the test passes.
pub fn skip(what: &str, reason: impl Display) {
    let _ = writeln!(std::io::stderr(), "SKIP: {what}: {reason}");
}

/// What was set up for `what`, or `None` after saying why not.
pub fn or_skip<T>(what: &str, set_up: Result<T, impl Display>) -> Option<T> {
    match set_up {
        Ok(value) => Some(value),
        Err(reason) => {
            skip(what, reason);
            None
        }
    }
}
