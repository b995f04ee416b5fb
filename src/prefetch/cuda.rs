//! Prefetch into CUDA device memory, exported with a CUDA IPC handle.
//!
//! CUDA is loaded at run time (cudarc's dynamic loading): the binary starts and
//! serves on machines without a driver, where this answers ENODEV. cudarc
//! panics if a CUDA call is made without the library, so `driver_present` is
//! checked before any call.
//!
//! Pipeline: worker threads each own a pinned host slab and a stream; a worker
//! preads its next chunk into its slab (after the slab's previous copy has
//! finished, tracked by an event), then queues an asynchronous host-to-device
//! copy on its stream. The device allocation is a plain cuMemAlloc: stream-
//! ordered pool allocations cannot be exported by IPC handle.
//!
//! Slabs are allocated with cuMemHostAlloc flags 0: cacheable pinned memory.
//! Write-combined memory is faster for the DMA engine to read but slow for
//! anything on the CPU that reads it, and the kernel's copy into it during
//! pread is not the streaming write that WC favours.
//!
//! Status: written against cudarc 0.19's driver API and checked to build and to
//! answer ENODEV without a driver; not yet run on a GPU (scripts/gpu-check.sh).

use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result;

use crate::source::Backing;
use cudarc::driver::sys;

/// Bytes a worker reads and copies at a time.
const SLAB: usize = 16 << 20;
const WORKERS: usize = 4;

/// Why a CUDA prefetch failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No driver library on this machine (ENODEV).
    #[error("{0}")]
    NoDriver(String),
    /// No such device, or the driver did not initialize (ENODEV).
    #[error("{0}")]
    NoDevice(String),
    /// The device allocation failed (ENOMEM).
    #[error("{0}")]
    OutOfMemory(String),
    /// Another driver call failed (EIO).
    #[error("{0}")]
    Driver(String),
    /// Reading the tensor's bytes failed, or the caller went away.
    #[error("reading the tensor: {0}")]
    Io(#[source] std::io::Error),
}

impl crate::errno::ToErrno for CudaError {
    fn to_errno(&self) -> i32 {
        match self {
            CudaError::NoDriver(_) | CudaError::NoDevice(_) => libc::ENODEV,
            CudaError::OutOfMemory(_) => libc::ENOMEM,
            CudaError::Driver(_) => libc::EIO,
            CudaError::Io(e) => e.to_errno(),
        }
    }
}

fn driver(what: &str) -> impl Fn(result::DriverError) -> CudaError + '_ {
    move |e| CudaError::Driver(format!("{what}: {e}"))
}

/// Whether a CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library; no CUDA call is made.
    unsafe { sys::is_culib_present() }
}

/// A device allocation holding a tensor; freed when dropped (when the file
/// handle that asked for it is closed).
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: sys::CUcontext,
    device: sys::CUdevice,
    /// The CUDA IPC memory handle of the allocation.
    pub ipc_handle: [u8; 64],
}

// SAFETY: the raw CUDA handles are plain identifiers, valid from any thread
// once the context is made current there (Drop does so).
unsafe impl Send for DeviceBuffer {}
// SAFETY: as for Send: shared references only read the identifiers.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr was allocated in ctx by cuMemAlloc and all copies into it
        // were synchronized before it was handed out.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::free_sync(self.ptr);
            let _ = result::primary_ctx::release(self.device);
        }
    }
}

/// Per-worker pinned slab, stream and event.
struct Lane {
    slab: *mut u8,
    stream: sys::CUstream,
    event: sys::CUevent,
    pending: bool,
}

impl Drop for Lane {
    fn drop(&mut self) {
        // SAFETY: created by this module in the current context; synchronized first.
        unsafe {
            let _ = result::stream::synchronize(self.stream);
            let _ = result::free_host(self.slab.cast());
            let _ = result::stream::destroy(self.stream);
            let _ = sys::cuEventDestroy_v2(self.event);
        }
    }
}

/// Copies `len` bytes at `offset` of `file` into a new allocation on CUDA
/// device `ordinal`. Returns the buffer, with its IPC handle.
pub fn to_device(
    ordinal: i32,
    backing: &Backing,
    keep_going: &(dyn Fn() -> bool + Sync),
) -> Result<DeviceBuffer, CudaError> {
    let (offset, len) = backing.range();
    if !driver_present() {
        return Err(CudaError::NoDriver(
            "no CUDA driver (libcuda.so) on this machine".into(),
        ));
    }
    result::init()
        .map_err(|e| CudaError::NoDevice(format!("CUDA driver did not initialize: {e}")))?;
    let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    if ordinal < 0 || ordinal >= count {
        return Err(CudaError::NoDevice(format!(
            "no CUDA device {ordinal} ({count} present)"
        )));
    }
    let device = result::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
    // SAFETY: device is valid; the retained context is released by DeviceBuffer.
    let ctx = unsafe { result::primary_ctx::retain(device) }
        .map_err(driver("cuDevicePrimaryCtxRetain"))?;
    let release = |e: CudaError| {
        // SAFETY: balances the retain above on the error path.
        unsafe {
            let _ = result::primary_ctx::release(device);
        }
        e
    };
    // SAFETY: ctx was just retained.
    unsafe { result::ctx::set_current(ctx) }
        .map_err(driver("cuCtxSetCurrent"))
        .map_err(release)?;
    let size = (len as usize).max(1);
    // SAFETY: a plain allocation in the current context.
    let ptr = unsafe { result::malloc_sync(size) }.map_err(|e| {
        release(CudaError::OutOfMemory(format!(
            "cuMemAlloc of {size} bytes: {e}"
        )))
    })?;
    let buffer = DeviceBuffer {
        ptr,
        len: len as usize,
        ctx,
        device,
        ipc_handle: [0; 64],
    };
    if let Backing::Remote { source, .. } = backing {
        // Parallel GETs into the disk cache first; the copy then reads the cache.
        let object = source.remote_object().expect("a remote source");
        object
            .warm(offset..offset + len, keep_going)
            .map_err(CudaError::Io)?;
    }
    copy_in(&buffer, backing, offset, len, keep_going)?;
    let mut handle = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
    // SAFETY: ptr is a cuMemAlloc allocation, which can be exported.
    unsafe { sys::cuIpcGetMemHandle(handle.as_mut_ptr(), buffer.ptr) }
        .result()
        .map_err(driver("cuIpcGetMemHandle"))?;
    // SAFETY: initialized by the successful call above.
    let handle = unsafe { handle.assume_init() };
    let mut buffer = buffer;
    for (dst, src) in buffer.ipc_handle.iter_mut().zip(handle.reserved.iter()) {
        *dst = *src as u8;
    }
    Ok(buffer)
}

fn copy_in(
    buffer: &DeviceBuffer,
    file: &Backing,
    offset: u64,
    len: u64,
    keep_going: &(dyn Fn() -> bool + Sync),
) -> Result<(), CudaError> {
    let chunks = len.div_ceil(SLAB as u64);
    let next = AtomicU64::new(0);
    let workers = WORKERS.min(chunks.max(1) as usize);
    std::thread::scope(|s| -> Result<(), CudaError> {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| -> Result<(), CudaError> {
                    // SAFETY: the context outlives this scope.
                    unsafe { result::ctx::set_current(buffer.ctx) }
                        .map_err(driver("cuCtxSetCurrent"))?;
                    // SAFETY: pinned allocation of SLAB bytes, freed by Lane::drop.
                    let slab = unsafe { result::malloc_host(SLAB, 0) }
                        .map_err(driver("cuMemHostAlloc"))?
                        as *mut u8;
                    let stream =
                        match result::stream::create(result::stream::StreamKind::NonBlocking) {
                            Ok(s) => s,
                            Err(e) => {
                                // SAFETY: allocated just above.
                                unsafe {
                                    let _ = result::free_host(slab.cast());
                                }
                                return Err(driver("cuStreamCreate")(e));
                            }
                        };
                    let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                        .map_err(driver("cuEventCreate"))?;
                    let mut lane = Lane {
                        slab,
                        stream,
                        event,
                        pending: false,
                    };
                    loop {
                        if !keep_going() {
                            return Err(CudaError::Io(std::io::Error::from_raw_os_error(
                                libc::EINTR,
                            )));
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= chunks {
                            break;
                        }
                        if lane.pending {
                            // SAFETY: the event was recorded on this lane's stream.
                            unsafe { result::event::synchronize(lane.event) }
                                .map_err(driver("cuEventSynchronize"))?;
                        }
                        let start = i * SLAB as u64;
                        let n = (SLAB as u64).min(len - start) as usize;
                        // SAFETY: the slab holds SLAB bytes and no copy from it is in flight.
                        let host = unsafe { std::slice::from_raw_parts_mut(lane.slab, n) };
                        let mut done = 0;
                        while done < n {
                            match file.read_at(&mut host[done..], offset + start + done as u64) {
                                Ok(0) => {
                                    return Err(CudaError::Io(std::io::Error::new(
                                        std::io::ErrorKind::UnexpectedEof,
                                        "the file ended before the tensor did",
                                    )));
                                }
                                Ok(k) => done += k,
                                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                                Err(e) => return Err(CudaError::Io(e)),
                            }
                        }
                        // SAFETY: destination range lies inside the allocation; the slab
                        // stays untouched until the event below has completed.
                        unsafe {
                            result::memcpy_htod_async(buffer.ptr + start, &host[..n], lane.stream)
                                .map_err(driver("cuMemcpyHtoDAsync"))?;
                            result::event::record(lane.event, lane.stream)
                                .map_err(driver("cuEventRecord"))?;
                        }
                        lane.pending = true;
                    }
                    // SAFETY: waits for this lane's copies before its slab is freed.
                    unsafe { result::stream::synchronize(lane.stream) }
                        .map_err(driver("cuStreamSynchronize"))?;
                    Ok(())
                })
            })
            .collect();
        let mut first_error = None;
        for h in handles {
            if let Err(e) = h.join().expect("CUDA prefetch worker panicked") {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    })
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
        let backing = Backing::File {
            file: std::sync::Arc::new(tempfile::tempfile().unwrap()),
            offset: 0,
            len: 16,
            sparse: false,
            moves_with: None,
        };
        let e = to_device(0, &backing, &|| true)
            .err()
            .expect("no driver, no buffer");
        assert!(matches!(e, CudaError::NoDriver(_)), "{e}");
        assert!(e.to_string().contains("no CUDA driver"));
    }
}
