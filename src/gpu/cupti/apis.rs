//! The driver API calls whose work CUPTI records (kernel launches, copies, memsets, graph launches): their
//! callback ids and where each keeps its stream, grid and block among its parameters.
//!
//! Only the driver domain is subscribed: a runtime call (`cudaLaunchKernel`, `cudaMemcpyAsync`...) calls back
//! again from the driver call it makes, with the same correlation id (seen on CUDA 13.0), so the driver domain
//! sees every launch once. The ids and offsets come from CUPTI 13.0's `cupti_driver_cbid.h` and
//! `generated_cuda_meta.h` (ids are never reused, parameter structs never change once published).

use std::ffi::c_void;

/// What a call puts on the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ApiKind {
    /// A kernel launch: one kernel record.
    Kernel,
    /// A copy: one memcpy record (a batch copy: one per copy, merged into one slice).
    Memcpy,
    /// A memset: one memset record.
    Memset,
    /// A CUDA graph launch: one record per node, all with the launch's correlation id.
    Graph,
    /// A call that changes which nodes a graph executable (its first parameter) runs, or destroys it: it puts
    /// nothing on the GPU, but what its launches taught about its nodes no longer holds.
    GraphChange,
}

/// Where a call's parameter struct holds what tickline shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Params {
    /// No stream parameter: the legacy default stream, or the thread's with `per_thread`.
    NoStream,
    /// A `CUstream` at this byte offset.
    Stream(usize),
    /// `cuLaunchKernel`'s layout: grid at 8, block at 20 (three `u32` each), stream at 40.
    DriverLaunch,
    /// `cuLaunchKernelEx`: a `CUlaunchConfig` pointer at 0 (grid at 0, block at 12, stream at 32).
    DriverLaunchEx,
    /// A graph executable's handle at 0, no stream (the graph-changing calls).
    GraphExec,
}

/// One driver API call CUPTI calls back for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Api {
    /// CUPTI's callback id in the driver domain.
    pub(crate) cbid: u32,
    /// The driver function's name.
    pub(crate) name: &'static str,
    pub(crate) kind: ApiKind,
    /// Whether its stream-less form means the calling thread's default stream (`_ptds`/`_ptsz`).
    pub(crate) per_thread: bool,
    pub(crate) params: Params,
}

const fn api(cbid: u32, name: &'static str, kind: ApiKind, per_thread: bool, params: Params) -> Api {
    Api {
        cbid,
        name,
        kind,
        per_thread,
        params,
    }
}

/// Every driver call tickline subscribes to, by callback id (sorted: looked up by binary search).
pub(crate) static APIS: &[Api] = &[
    api(43, "cuMemcpyHtoD", ApiKind::Memcpy, false, Params::NoStream),
    api(45, "cuMemcpyDtoH", ApiKind::Memcpy, false, Params::NoStream),
    api(47, "cuMemcpyDtoD", ApiKind::Memcpy, false, Params::NoStream),
    api(49, "cuMemcpyDtoA", ApiKind::Memcpy, false, Params::NoStream),
    api(51, "cuMemcpyAtoD", ApiKind::Memcpy, false, Params::NoStream),
    api(53, "cuMemcpyHtoA", ApiKind::Memcpy, false, Params::NoStream),
    api(54, "cuMemcpyAtoH", ApiKind::Memcpy, false, Params::NoStream),
    api(55, "cuMemcpyAtoA", ApiKind::Memcpy, false, Params::NoStream),
    api(56, "cuMemcpy2D", ApiKind::Memcpy, false, Params::NoStream),
    api(57, "cuMemcpy2DUnaligned", ApiKind::Memcpy, false, Params::NoStream),
    api(58, "cuMemcpy3D", ApiKind::Memcpy, false, Params::NoStream),
    api(60, "cuMemcpyHtoDAsync", ApiKind::Memcpy, false, Params::Stream(24)),
    api(62, "cuMemcpyDtoHAsync", ApiKind::Memcpy, false, Params::Stream(16)),
    api(64, "cuMemcpyDtoDAsync", ApiKind::Memcpy, false, Params::Stream(16)),
    api(66, "cuMemcpyHtoAAsync", ApiKind::Memcpy, false, Params::Stream(32)),
    api(67, "cuMemcpyAtoHAsync", ApiKind::Memcpy, false, Params::Stream(24)),
    api(68, "cuMemcpy2DAsync", ApiKind::Memcpy, false, Params::Stream(8)),
    api(69, "cuMemcpy3DAsync", ApiKind::Memcpy, false, Params::Stream(8)),
    api(71, "cuMemsetD8", ApiKind::Memset, false, Params::NoStream),
    api(73, "cuMemsetD16", ApiKind::Memset, false, Params::NoStream),
    api(75, "cuMemsetD32", ApiKind::Memset, false, Params::NoStream),
    api(77, "cuMemsetD2D8", ApiKind::Memset, false, Params::NoStream),
    api(79, "cuMemsetD2D16", ApiKind::Memset, false, Params::NoStream),
    api(81, "cuMemsetD2D32", ApiKind::Memset, false, Params::NoStream),
    api(115, "cuLaunch", ApiKind::Kernel, false, Params::NoStream),
    api(116, "cuLaunchGrid", ApiKind::Kernel, false, Params::NoStream),
    api(117, "cuLaunchGridAsync", ApiKind::Kernel, false, Params::Stream(16)),
    api(216, "cuMemsetD8Async", ApiKind::Memset, false, Params::Stream(24)),
    api(218, "cuMemsetD16Async", ApiKind::Memset, false, Params::Stream(24)),
    api(220, "cuMemsetD32Async", ApiKind::Memset, false, Params::Stream(24)),
    api(222, "cuMemsetD2D8Async", ApiKind::Memset, false, Params::Stream(40)),
    api(224, "cuMemsetD2D16Async", ApiKind::Memset, false, Params::Stream(40)),
    api(226, "cuMemsetD2D32Async", ApiKind::Memset, false, Params::Stream(40)),
    api(249, "cuMemsetD8_v2", ApiKind::Memset, false, Params::NoStream),
    api(250, "cuMemsetD16_v2", ApiKind::Memset, false, Params::NoStream),
    api(251, "cuMemsetD32_v2", ApiKind::Memset, false, Params::NoStream),
    api(252, "cuMemsetD2D8_v2", ApiKind::Memset, false, Params::NoStream),
    api(253, "cuMemsetD2D16_v2", ApiKind::Memset, false, Params::NoStream),
    api(254, "cuMemsetD2D32_v2", ApiKind::Memset, false, Params::NoStream),
    api(276, "cuMemcpyHtoD_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(277, "cuMemcpyHtoDAsync_v2", ApiKind::Memcpy, false, Params::Stream(24)),
    api(278, "cuMemcpyDtoH_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(279, "cuMemcpyDtoHAsync_v2", ApiKind::Memcpy, false, Params::Stream(24)),
    api(280, "cuMemcpyDtoD_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(281, "cuMemcpyDtoDAsync_v2", ApiKind::Memcpy, false, Params::Stream(24)),
    api(282, "cuMemcpyAtoH_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(283, "cuMemcpyAtoHAsync_v2", ApiKind::Memcpy, false, Params::Stream(32)),
    api(284, "cuMemcpyAtoD_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(285, "cuMemcpyDtoA_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(286, "cuMemcpyAtoA_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(287, "cuMemcpy2D_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(288, "cuMemcpy2DUnaligned_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(289, "cuMemcpy2DAsync_v2", ApiKind::Memcpy, false, Params::Stream(8)),
    api(290, "cuMemcpy3D_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(291, "cuMemcpy3DAsync_v2", ApiKind::Memcpy, false, Params::Stream(8)),
    api(292, "cuMemcpyHtoA_v2", ApiKind::Memcpy, false, Params::NoStream),
    api(293, "cuMemcpyHtoAAsync_v2", ApiKind::Memcpy, false, Params::Stream(32)),
    api(305, "cuMemcpy", ApiKind::Memcpy, false, Params::NoStream),
    api(306, "cuMemcpyAsync", ApiKind::Memcpy, false, Params::Stream(24)),
    api(307, "cuLaunchKernel", ApiKind::Kernel, false, Params::DriverLaunch),
    api(318, "cuMemcpyPeer", ApiKind::Memcpy, false, Params::NoStream),
    api(319, "cuMemcpyPeerAsync", ApiKind::Memcpy, false, Params::Stream(40)),
    api(320, "cuMemcpy3DPeer", ApiKind::Memcpy, false, Params::NoStream),
    api(321, "cuMemcpy3DPeerAsync", ApiKind::Memcpy, false, Params::Stream(8)),
    api(397, "cuMemcpyHtoD_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(398, "cuMemcpyDtoH_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(399, "cuMemcpyDtoD_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(400, "cuMemcpyDtoA_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(401, "cuMemcpyAtoD_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(402, "cuMemcpyHtoA_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(403, "cuMemcpyAtoH_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(404, "cuMemcpyAtoA_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(405, "cuMemcpy2D_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(
        406,
        "cuMemcpy2DUnaligned_v2_ptds",
        ApiKind::Memcpy,
        true,
        Params::NoStream,
    ),
    api(407, "cuMemcpy3D_v2_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(408, "cuMemcpy_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(409, "cuMemcpyPeer_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(410, "cuMemcpy3DPeer_ptds", ApiKind::Memcpy, true, Params::NoStream),
    api(411, "cuMemsetD8_v2_ptds", ApiKind::Memset, true, Params::NoStream),
    api(412, "cuMemsetD16_v2_ptds", ApiKind::Memset, true, Params::NoStream),
    api(413, "cuMemsetD32_v2_ptds", ApiKind::Memset, true, Params::NoStream),
    api(414, "cuMemsetD2D8_v2_ptds", ApiKind::Memset, true, Params::NoStream),
    api(415, "cuMemsetD2D16_v2_ptds", ApiKind::Memset, true, Params::NoStream),
    api(416, "cuMemsetD2D32_v2_ptds", ApiKind::Memset, true, Params::NoStream),
    api(418, "cuMemcpyAsync_ptsz", ApiKind::Memcpy, true, Params::Stream(24)),
    api(
        419,
        "cuMemcpyHtoAAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(32),
    ),
    api(
        420,
        "cuMemcpyAtoHAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(32),
    ),
    api(
        421,
        "cuMemcpyHtoDAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(24),
    ),
    api(
        422,
        "cuMemcpyDtoHAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(24),
    ),
    api(
        423,
        "cuMemcpyDtoDAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(24),
    ),
    api(424, "cuMemcpy2DAsync_v2_ptsz", ApiKind::Memcpy, true, Params::Stream(8)),
    api(425, "cuMemcpy3DAsync_v2_ptsz", ApiKind::Memcpy, true, Params::Stream(8)),
    api(426, "cuMemcpyPeerAsync_ptsz", ApiKind::Memcpy, true, Params::Stream(40)),
    api(
        427,
        "cuMemcpy3DPeerAsync_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(8),
    ),
    api(428, "cuMemsetD8Async_ptsz", ApiKind::Memset, true, Params::Stream(24)),
    api(429, "cuMemsetD16Async_ptsz", ApiKind::Memset, true, Params::Stream(24)),
    api(430, "cuMemsetD32Async_ptsz", ApiKind::Memset, true, Params::Stream(24)),
    api(431, "cuMemsetD2D8Async_ptsz", ApiKind::Memset, true, Params::Stream(40)),
    api(
        432,
        "cuMemsetD2D16Async_ptsz",
        ApiKind::Memset,
        true,
        Params::Stream(40),
    ),
    api(
        433,
        "cuMemsetD2D32Async_ptsz",
        ApiKind::Memset,
        true,
        Params::Stream(40),
    ),
    api(442, "cuLaunchKernel_ptsz", ApiKind::Kernel, true, Params::DriverLaunch),
    api(
        477,
        "cuLaunchCooperativeKernel",
        ApiKind::Kernel,
        false,
        Params::DriverLaunch,
    ),
    api(
        478,
        "cuLaunchCooperativeKernel_ptsz",
        ApiKind::Kernel,
        true,
        Params::DriverLaunch,
    ),
    api(514, "cuGraphLaunch", ApiKind::Graph, false, Params::Stream(8)),
    api(515, "cuGraphLaunch_ptsz", ApiKind::Graph, true, Params::Stream(8)),
    api(
        516,
        "cuGraphExecDestroy",
        ApiKind::GraphChange,
        false,
        Params::GraphExec,
    ),
    api(561, "cuGraphExecUpdate", ApiKind::GraphChange, false, Params::GraphExec),
    api(
        586,
        "cuGraphExecChildGraphNodeSetParams",
        ApiKind::GraphChange,
        false,
        Params::GraphExec,
    ),
    api(
        650,
        "cuGraphNodeSetEnabled",
        ApiKind::GraphChange,
        false,
        Params::GraphExec,
    ),
    api(652, "cuLaunchKernelEx", ApiKind::Kernel, false, Params::DriverLaunchEx),
    api(
        653,
        "cuLaunchKernelEx_ptsz",
        ApiKind::Kernel,
        true,
        Params::DriverLaunchEx,
    ),
    api(
        696,
        "cuGraphExecUpdate_v2",
        ApiKind::GraphChange,
        false,
        Params::GraphExec,
    ),
    api(
        714,
        "cuGraphExecNodeSetParams",
        ApiKind::GraphChange,
        false,
        Params::GraphExec,
    ),
    api(776, "cuMemcpyBatchAsync", ApiKind::Memcpy, false, Params::Stream(64)),
    api(
        777,
        "cuMemcpyBatchAsync_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(64),
    ),
    api(778, "cuMemcpy3DBatchAsync", ApiKind::Memcpy, false, Params::Stream(32)),
    api(
        779,
        "cuMemcpy3DBatchAsync_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(32),
    ),
    api(796, "cuMemcpyBatchAsync_v2", ApiKind::Memcpy, false, Params::Stream(56)),
    api(
        797,
        "cuMemcpyBatchAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(56),
    ),
    api(
        798,
        "cuMemcpy3DBatchAsync_v2",
        ApiKind::Memcpy,
        false,
        Params::Stream(24),
    ),
    api(
        799,
        "cuMemcpy3DBatchAsync_v2_ptsz",
        ApiKind::Memcpy,
        true,
        Params::Stream(24),
    ),
];

/// The call with this driver-domain callback id, if tickline subscribes to it.
pub(crate) fn lookup(cbid: u32) -> Option<&'static Api> {
    APIS.binary_search_by_key(&cbid, |a| a.cbid).ok().map(|i| &APIS[i])
}

/// What a launch's parameters say: its stream handle (null: the default stream) and, for kernels, grid and
/// block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LaunchParams {
    pub(crate) stream: usize,
    /// A graph launch's executable (`CUgraphExec`, the first parameter of every graph launch and graph-changing
    /// call); 0 otherwise.
    pub(crate) graph: usize,
    pub(crate) grid: Option<[u32; 3]>,
    pub(crate) block: Option<[u32; 3]>,
}

/// Reads a call's stream, grid and block from its parameter struct.
///
/// # Safety
///
/// `params` is the `functionParams` CUPTI passed for a call of `api` (a live struct of that call's layout, and
/// for the `Ex` launches a pointer to a live launch configuration), or null.
pub(crate) unsafe fn launch_params(api: &Api, params: *const c_void) -> LaunchParams {
    if params.is_null() {
        return LaunchParams::default();
    }
    let base = params.cast::<u8>();
    // The offsets below are `api.params`' layout, read off CUDA's generated headers (and checked by the tests).
    match api.params {
        Params::NoStream => LaunchParams::default(),
        Params::Stream(offset) => LaunchParams {
            // SAFETY: the caller's struct has a stream handle at `offset`.
            stream: unsafe { word(base.add(offset)) },
            graph: if api.kind == ApiKind::Graph {
                // SAFETY: a graph launch's struct starts with its executable's handle.
                unsafe { word(base) }
            } else {
                0
            },
            ..LaunchParams::default()
        },
        Params::GraphExec => LaunchParams {
            // SAFETY: the caller's struct starts with the executable's handle.
            graph: unsafe { word(base) },
            ..LaunchParams::default()
        },
        Params::DriverLaunch => {
            // SAFETY: cuLaunchKernel's struct (the caller's): grid at 8, block at 20, stream at 40.
            unsafe {
                LaunchParams {
                    stream: word(base.add(40)),
                    graph: 0,
                    grid: Some(dims(base.add(8))),
                    block: Some(dims(base.add(20))),
                }
            }
        }
        Params::DriverLaunchEx => {
            // SAFETY: cuLaunchKernelEx's struct starts with its `CUlaunchConfig` pointer (read as a pointer, so it
            // keeps its provenance).
            let config = unsafe { base.cast::<*const u8>().read_unaligned() };
            if config.is_null() {
                return LaunchParams::default();
            }
            // SAFETY: the call's live `CUlaunchConfig`: grid at 0, block at 12, stream at 32.
            unsafe {
                LaunchParams {
                    stream: word(config.add(32)),
                    graph: 0,
                    grid: Some(dims(config)),
                    block: Some(dims(config.add(12))),
                }
            }
        }
    }
}

/// A pointer-sized word at `at`, read unaligned.
///
/// # Safety
///
/// `at` points to 8 readable bytes.
unsafe fn word(at: *const u8) -> usize {
    // SAFETY: the caller's guarantee; no alignment assumed.
    unsafe { at.cast::<usize>().read_unaligned() }
}

/// Three `u32`s at `at` (a grid or block size), read unaligned.
///
/// # Safety
///
/// `at` points to 12 readable bytes.
unsafe fn dims(at: *const u8) -> [u32; 3] {
    // SAFETY: the caller's guarantee; no alignment assumed.
    [0, 4, 8].map(|o| unsafe { at.add(o).cast::<u32>().read_unaligned() })
}
