//! The CUDA examples' PTX kernels, loaded by the driver (no toolkit or NVRTC needed).

#![allow(dead_code)] // each example uses part of it

use std::error::Error;
use std::ffi::c_void;
use std::sync::Arc;

use tickline::gpu::cuda::cudarc::driver::{result, sys, CudaContext, CudaStream};

/// `scale(x, n, a)`: `x[i] *= a` for `i < n`, one thread per element. `spin(ns)`: one thread busy for `ns`
/// nanoseconds of `%globaltimer` (stands in for a long kernel).
pub const KERNELS: &str = r#"
.version 7.0
.target sm_50
.address_size 64

.visible .entry scale(.param .u64 x, .param .u32 n, .param .f32 a)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .f32 %f<4>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [x];
    cvta.to.global.u64 %rd1, %rd1;
    ld.param.u32 %r1, [n];
    ld.param.f32 %f1, [a];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra SCALE_DONE;
    mul.wide.u32 %rd2, %r5, 4;
    add.s64 %rd3, %rd1, %rd2;
    ld.global.f32 %f2, [%rd3];
    mul.f32 %f3, %f2, %f1;
    st.global.f32 [%rd3], %f3;
SCALE_DONE:
    ret;
}

.visible .entry spin(.param .u64 ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
SPIN_LOOP:
    mov.u64 %rd4, %globaltimer;
    setp.lt.u64 %p1, %rd4, %rd3;
    @%p1 bra SPIN_LOOP;
    ret;
}
"#;

/// The example's kernels, loaded into the context.
pub struct Kernels {
    scale: sys::CUfunction,
    spin: sys::CUfunction,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels, Box<dyn Error>> {
        ctx.bind_to_thread()?;
        let ptx = std::ffi::CString::new(KERNELS)?;
        // SAFETY: a NUL-terminated PTX text that outlives the call, in the bound context. The module is never
        // unloaded (it lives as long as the process).
        let module = unsafe { result::module::load_data(ptx.as_ptr().cast()) }?;
        // SAFETY: the module was just loaded and is never unloaded.
        let scale = unsafe { result::module::get_function(module, c"scale".to_owned()) }?;
        // SAFETY: as above.
        let spin = unsafe { result::module::get_function(module, c"spin".to_owned()) }?;
        Ok(Kernels { scale, spin })
    }

    pub fn scale(&self, stream: &CudaStream, x: sys::CUdeviceptr, n: u32, a: f32) -> Result<(), Box<dyn Error>> {
        let (mut x, mut n, mut a) = (x, n, a);
        let mut params = [
            (&mut x as *mut sys::CUdeviceptr).cast::<c_void>(),
            (&mut n as *mut u32).cast::<c_void>(),
            (&mut a as *mut f32).cast::<c_void>(),
        ];
        // SAFETY: `scale` takes (f32 pointer, u32, f32), as `params` holds; `x` points to at least `n` floats of
        // a buffer allocated on `stream`, which outlives the kernel (the caller synchronises before freeing).
        unsafe {
            result::launch_kernel(
                self.scale,
                (n.div_ceil(256), 1, 1),
                (256, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }?;
        Ok(())
    }

    pub fn spin(&self, stream: &CudaStream, ns: u64) -> Result<(), Box<dyn Error>> {
        let mut ns = ns;
        let mut params = [(&mut ns as *mut u64).cast::<c_void>()];
        // SAFETY: `spin` takes one u64, as `params` holds; it touches no memory.
        unsafe { result::launch_kernel(self.spin, (1, 1, 1), (1, 1, 1), 0, stream.cu_stream(), &mut params) }?;
        Ok(())
    }
}
