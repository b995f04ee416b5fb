//! The CUDA engine of a load (`load::engine::Engine`): arenas are device
//! allocations exported by IPC handle, lanes are pinned host slabs with a
//! stream and an event each.
//!
//! CUDA is loaded at run time (cudarc's dynamic loading): the binary starts and
//! serves on machines without a driver, where a load answers ENODEV. cudarc
//! panics if a CUDA call is made without the library, so `driver_present` is
//! checked before any call.
//!
//! Arenas are plain cuMemAlloc allocations: stream-ordered pool allocations
//! cannot be exported by IPC handle. Slabs are cuMemHostAlloc with flags 0:
//! cacheable pinned memory. Write-combined memory is faster for the DMA engine
//! to read but slow for anything on the CPU that reads it, and the kernel's
//! copy into it during pread is not the streaming write that WC favours.
//!
//! Status: written against cudarc 0.19's driver API and checked to build and to
//! answer ENODEV without a driver; not yet run on a GPU (scripts/gpu-check.sh).

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys;

use super::load::engine::{Alive, Arena, Copy, Engine, Lane};
use super::load::error::LoadError;

fn driver(what: &str) -> impl Fn(result::DriverError) -> LoadError + '_ {
    move |e| LoadError::Device(format!("{what}: {e}"))
}

/// Whether a CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// A device's retained primary context, released when the engine and its
/// last arena and lane are gone.
struct Context {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: the raw CUDA handles are plain identifiers, valid from any thread
// once the context is made current there (each use does so).
unsafe impl Send for Context {}
// SAFETY: as for Send: shared references only read the identifiers.
unsafe impl Sync for Context {}

impl Context {
    fn make_current(&self) -> Result<(), LoadError> {
        // SAFETY: the context is retained while self lives.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(driver("cuCtxSetCurrent"))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain of CudaEngine::new.
        unsafe {
            let _ = result::primary_ctx::release(self.device);
        }
    }
}

/// Loads into CUDA device `ordinal`.
pub struct CudaEngine {
    ordinal: i32,
    context: Arc<Context>,
}

impl CudaEngine {
    /// The engine of device `ordinal`: ENODEV without a driver or device.
    pub fn new(ordinal: i32) -> Result<CudaEngine, LoadError> {
        if !driver_present() {
            return Err(LoadError::NoDevice(
                "no CUDA driver (libcuda.so) on this machine".into(),
            ));
        }
        result::init()
            .map_err(|e| LoadError::NoDevice(format!("CUDA driver did not initialize: {e}")))?;
        let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
        if ordinal < 0 || ordinal >= count {
            return Err(LoadError::NoDevice(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        let device = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        // SAFETY: device is valid; Context releases the retained context.
        let ctx = unsafe { result::primary_ctx::retain(device) }
            .map_err(driver("cuDevicePrimaryCtxRetain"))?;
        Ok(CudaEngine {
            ordinal,
            context: Arc::new(Context { device, ctx }),
        })
    }
}

struct CudaLane {
    context: Arc<Context>,
    slab: *mut u8,
    len: usize,
    stream: sys::CUstream,
    event: sys::CUevent,
    pending: bool,
}

// SAFETY: the slab, stream and event are used by one thread at a time (the
// pool hands a lane to one worker), with the context made current first.
unsafe impl Send for CudaLane {}

struct CudaArena {
    context: Arc<Context>,
    ptr: sys::CUdeviceptr,
    size: u64,
    handle: [u8; 64],
    _alive: Alive,
}

// SAFETY: identifiers only; the memory is written by lanes through the driver.
unsafe impl Send for CudaArena {}
// SAFETY: as for Send.
unsafe impl Sync for CudaArena {}

impl Engine for CudaEngine {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn new_lane(&self, slab: usize) -> Result<Box<dyn Lane>, LoadError> {
        self.context.make_current()?;
        // SAFETY: a pinned allocation of `slab` bytes, freed by CudaLane::drop.
        let ptr = unsafe { result::malloc_host(slab, 0) }
            .map_err(|e| LoadError::OutOfMemory(format!("cuMemHostAlloc of {slab} bytes: {e}")))?
            as *mut u8;
        let mut lane = CudaLane {
            context: self.context.clone(),
            slab: ptr,
            len: slab,
            stream: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
            pending: false,
        };
        lane.stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(driver("cuStreamCreate"))?;
        lane.event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(driver("cuEventCreate"))?;
        Ok(Box::new(lane))
    }

    fn new_arena(&self, size: u64) -> Result<Arc<dyn Arena>, LoadError> {
        self.context.make_current()?;
        let bytes = (size as usize).max(1);
        // SAFETY: a plain allocation in the current context, freed by CudaArena::drop.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
            LoadError::OutOfMemory(format!(
                "cuMemAlloc of {bytes} bytes on {}: {e}",
                self.name()
            ))
        })?;
        let mut arena = CudaArena {
            context: self.context.clone(),
            ptr,
            size,
            handle: [0; 64],
            _alive: Alive::new(),
        };
        let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: ptr is a cuMemAlloc allocation, which can be exported.
        unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), arena.ptr) }
            .result()
            .map_err(driver("cuIpcGetMemHandle"))?;
        // SAFETY: initialized by the successful call above.
        let handle = unsafe { handle.assume_init() };
        for (dst, src) in arena.handle.iter_mut().zip(handle.reserved.iter()) {
            *dst = *src as u8;
        }
        Ok(Arc::new(arena))
    }
}

impl Lane for CudaLane {
    fn slab(&mut self) -> &mut [u8] {
        // SAFETY: the slab holds `len` bytes; callers write it only after
        // `wait`, when no copy reads it.
        unsafe { std::slice::from_raw_parts_mut(self.slab, self.len) }
    }

    fn submit(&mut self, arena: &dyn Arena, copies: &[Copy]) -> Result<(), LoadError> {
        let arena = arena
            .as_any()
            .downcast_ref::<CudaArena>()
            .ok_or_else(|| LoadError::Device("a CUDA lane given another engine's arena".into()))?;
        self.context.make_current()?;
        for c in copies {
            let in_arena =
                c.to.checked_add(c.len as u64)
                    .is_some_and(|end| end <= arena.size);
            if !in_arena || c.from + c.len > self.len {
                return Err(LoadError::Device(format!("a copy out of bounds: {c:?}")));
            }
            // SAFETY: both ranges were checked; the slab is not written again
            // until the event recorded below has completed (`wait`).
            unsafe {
                let host = std::slice::from_raw_parts(self.slab.add(c.from), c.len);
                result::memcpy_htod_async(arena.ptr + c.to, host, self.stream)
                    .map_err(driver("cuMemcpyHtoDAsync"))?;
            }
        }
        // SAFETY: the event and stream belong to this lane.
        unsafe { result::event::record(self.event, self.stream) }
            .map_err(driver("cuEventRecord"))?;
        self.pending = true;
        Ok(())
    }

    fn wait(&mut self) -> Result<(), LoadError> {
        if self.pending {
            self.context.make_current()?;
            // SAFETY: the event was recorded on this lane's stream.
            unsafe { result::event::synchronize(self.event) }
                .map_err(driver("cuEventSynchronize"))?;
            self.pending = false;
        }
        Ok(())
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        // SAFETY: made by this module in this context; synchronized first.
        unsafe {
            let _ = result::ctx::set_current(self.context.ctx);
            if !self.stream.is_null() {
                let _ = result::stream::synchronize(self.stream);
                let _ = result::stream::destroy(self.stream);
            }
            if !self.event.is_null() {
                let _ = sys::cuEventDestroy_v2(self.event);
            }
            let _ = result::free_host(self.slab.cast());
        }
    }
}

impl Arena for CudaArena {
    fn size(&self) -> u64 {
        self.size
    }

    fn handle(&self) -> [u8; 64] {
        self.handle
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaArena {
    fn drop(&mut self) {
        // SAFETY: allocated in this context by cuMemAlloc; every copy into it
        // was waited for before the load's workers ended.
        unsafe {
            let _ = result::ctx::set_current(self.context.ctx);
            let _ = result::free_sync(self.ptr);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_the_answer_is_enodev_not_a_panic() {
        if driver_present() {
            eprintln!("a CUDA driver is present: scripts/gpu-check.sh covers this machine");
            return;
        }
        let e = CudaEngine::new(0).err().expect("no driver, no engine");
        assert!(matches!(e, LoadError::NoDevice(_)), "{e}");
        assert!(e.to_string().contains("no CUDA driver"));
        assert_eq!(crate::errno::ToErrno::to_errno(&e), libc::ENODEV);
    }
}
