//! [`request_device`]: `Adapter::request_device`, plus what tickline's calibration wants where wgpu runs on
//! Vulkan.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use wgpu_hal as hal;

use super::open_device;
use crate::gpu::GpuError;

/// `adapter.request_device(descriptor)`, and on Vulkan the same device with `VK_KHR/EXT_calibrated_timestamps`
/// (and `hostQueryReset`) enabled where the adapter offers them, so that a [`WgpuProfiler`](super::WgpuProfiler)
/// calibrates the device clock with the driver's own bracket (a few ns) rather than a submitted probe (tens of
/// µs). Safe: it checks what wgpu's `request_device` checks (features, experimental features, limits) before
/// opening the hal device with exactly the descriptor's features and limits.
///
/// On other backends (or when the Vulkan route fails to open) it is `adapter.request_device(descriptor)`,
/// resolved at once (native wgpu resolves it synchronously).
///
/// ```no_run
/// # #[allow(dead_code)]
/// # fn demo(adapter: &wgpu::Adapter) -> Result<(), tickline::gpu::GpuError> {
/// use tickline::gpu::wgpu::{request_device, WgpuProfiler};
/// let (device, queue) = request_device(
///     adapter,
///     &wgpu::DeviceDescriptor {
///         required_features: adapter.features() & WgpuProfiler::ALL_WGPU_TIMER_FEATURES,
///         ..Default::default()
///     },
/// )?;
/// # drop((device, queue));
/// # Ok(())
/// # }
/// ```
pub fn request_device(
    adapter: &wgpu::Adapter,
    descriptor: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue), GpuError> {
    let features = descriptor.required_features;
    let missing = features - adapter.features();
    if !missing.is_empty() {
        return Err(GpuError::Invalid {
            detail: format!("the adapter does not offer the requested features {missing:?}"),
        });
    }
    if features.intersects(wgpu::Features::all_experimental_mask()) && !descriptor.experimental_features.is_enabled() {
        return Err(GpuError::Invalid {
            detail: format!(
                "experimental features {:?} requested without DeviceDescriptor::experimental_features",
                features & wgpu::Features::all_experimental_mask()
            ),
        });
    }
    let mut over = Vec::new();
    descriptor
        .required_limits
        .check_limits_with_fail_fn(&adapter.limits(), false, |name, wanted, allowed| {
            over.push(format!("{name} {wanted} (allowed {allowed})"))
        });
    if !over.is_empty() {
        return Err(GpuError::Invalid {
            detail: format!("the requested limits exceed the adapter's: {}", over.join(", ")),
        });
    }
    if adapter.get_info().backend == wgpu::Backend::Vulkan {
        // SAFETY: the hal adapter is the wgpu adapter's own and is alive while the guard is; the features and limits
        // are the descriptor's, checked above against what the adapter offers (what `open_device` requires). The
        // device is handed to the same adapter with the same descriptor (`create_device_from_hal`'s contract).
        let opened = unsafe {
            adapter.as_hal::<hal::api::Vulkan>().map(|hal_adapter| {
                open_device(
                    &hal_adapter,
                    features,
                    &descriptor.required_limits,
                    &descriptor.memory_hints,
                )
            })
        };
        if let Some(Ok((open, _))) = opened {
            // SAFETY: as above.
            let created = unsafe { adapter.create_device_from_hal(open, descriptor) };
            return created.map_err(|e| GpuError::Api {
                call: "wgpu Adapter::create_device_from_hal",
                detail: e.to_string(),
            });
        }
    }
    ready(adapter.request_device(descriptor))
        .ok_or_else(|| GpuError::Api {
            call: "wgpu Adapter::request_device",
            detail: "the request did not resolve at once (a web backend?)".into(),
        })?
        .map_err(|e| GpuError::Api {
            call: "wgpu Adapter::request_device",
            detail: e.to_string(),
        })
}

/// Polls a future once: native wgpu's futures are ready at once.
fn ready<T>(future: impl Future<Output = T>) -> Option<T> {
    let mut future = pin!(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(value) => Some(value),
        Poll::Pending => None,
    }
}
