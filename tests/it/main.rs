//! Integration tests, built as one binary.

mod cli;
mod gpu;
mod pipeline;
#[cfg(feature = "vulkan")]
mod vulkan;
