//! Integration tests, built as one binary.

mod async_tasks;
mod capture;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cupti")]
mod cupti;
mod gpu;
mod gpu_clocks;
mod live;
mod load;
mod pipeline;
mod process;
#[path = "../../examples/support/skip.rs"]
mod skip;
#[path = "../../examples/support/slices.rs"]
mod slices;
#[cfg(feature = "vulkan")]
mod vulkan;
#[cfg(feature = "wgpu")]
mod wgpu;
#[cfg(feature = "wgpu")]
mod wgpu_level;

/// Native macros on threads that started no timeline record into the most recently started one, so every test
/// that starts a timeline holds this lock: one at a time.
pub(crate) fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
