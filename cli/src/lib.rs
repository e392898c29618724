//! The `tickline` command's library: what its subcommands do, callable from tests.
//!
//! - [`clock`]: `tickline clock`, the CPU clock report.
//! - [`capture`]: `tickline convert` and `tickline stats` on a raw `.tickline` capture.
//! - [`merge`]: `tickline merge`, several processes' and hosts' traces on one time axis.
//! - [`input`]: inputs read more than once, a pipe's included.
//! - [`output`]: writing an output without destroying an input or the file it replaces.
//! - `stats` (feature `protos`): `tickline stats`, a `.pftrace` decoded with Perfetto's own schema.
//! - [`wire`], [`tracefile`]: reading traces at the protobuf wire level.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod capture;
pub mod clock;
pub mod input;
pub mod merge;
pub mod output;
#[cfg(feature = "protos")]
pub mod stats;
pub mod tracefile;
pub mod wire;
