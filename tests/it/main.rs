//! Integration tests, built as one binary.

mod cli;
mod gpu;
mod live;
mod pipeline;
