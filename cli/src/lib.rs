//! The `tickline` command's library: what its subcommands do, callable from tests.
//!
//! - [`clock`]: `tickline clock`, the CPU clock report.
//! - [`merge`]: `tickline merge`, several processes' and hosts' traces on one time axis.
//! - `stats` (feature `protos`): `tickline stats`, a `.pftrace` decoded with Perfetto's own schema.
//! - [`wire`], [`tracefile`]: reading traces at the protobuf wire level.
//!
//! `tickline convert` and `tickline stats` on a raw `.tickline` capture come with the raw capture format
//! (issue 12): they will sit beside these, on the library's reader.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod clock;
pub mod merge;
#[cfg(feature = "protos")]
pub mod stats;
pub mod tracefile;
pub mod wire;
