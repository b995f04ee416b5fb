//! The seam between a load's pipeline and the memory it fills: an engine
//! makes arenas (one allocation per load) and lanes (a host slab and a queue
//! of copies from it). CUDA implements it in `prefetch::cuda`; `HostEngine`
//! here implements it with ordinary memory, so that every part of the
//! pipeline (planning, chunking, ordering, slab reuse, cancellation, errors,
//! progress) runs on machines without a GPU, through the same code.

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::LoadError;

/// One copy from a lane's slab into an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy {
    /// Where the bytes are in the slab.
    pub from: usize,
    pub len: usize,
    /// Where they go in the arena.
    pub to: u64,
}

/// Makes the memory a load fills.
pub trait Engine: Send + Sync {
    /// What the engine is, for messages ("cuda:0", "host").
    fn name(&self) -> String;
    /// A lane with a host slab of `slab` bytes.
    fn new_lane(&self, slab: usize) -> Result<Box<dyn Lane>, LoadError>;
    /// One allocation of `size` bytes (at least one byte is allocated).
    fn new_arena(&self, size: u64) -> Result<Arc<dyn Arena>, LoadError>;
}

/// A host slab and the queue its copies run on (a CUDA stream).
pub trait Lane: Send {
    /// The slab; the caller writes it only after `wait`.
    fn slab(&mut self) -> &mut [u8];
    /// Queues copies of slab bytes into `arena`.
    fn submit(&mut self, arena: &dyn Arena, copies: &[Copy]) -> Result<(), LoadError>;
    /// Returns once every copy submitted so far has finished.
    fn wait(&mut self) -> Result<(), LoadError>;
}

/// One allocation a load fills, freed when the last reference goes.
pub trait Arena: Send + Sync {
    fn size(&self) -> u64;
    /// What a client opens to reach the arena: a CUDA IPC handle, or (host)
    /// the daemon's pid (i32) and, at byte 8, the arena's address (u64),
    /// little-endian, to read through /proc/PID/mem.
    fn handle(&self) -> [u8; 64];
    fn as_any(&self) -> &dyn Any;
    /// The arena's memory, where the daemon can write it itself (host
    /// memory): a load then reads each chunk straight into it, one copy, as
    /// a DMA engine reading the page cache would make. None: through slabs.
    fn host_memory(&self) -> Option<*mut u8> {
        None
    }
}

/// Arenas alive now, of every engine (tests check that a cancelled or
/// failed load leaves none).
pub static LIVE_ARENAS: AtomicU64 = AtomicU64::new(0);

/// Counts an arena while it lives.
pub struct Alive(());

impl Alive {
    pub fn new() -> Alive {
        LIVE_ARENAS.fetch_add(1, Ordering::Relaxed);
        Alive(())
    }
}

impl Default for Alive {
    fn default() -> Self {
        Alive::new()
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        LIVE_ARENAS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The host engine: arenas and slabs are anonymous memory of the daemon, in
/// huge pages where the kernel gives them (a client reads an arena through
/// /proc/PID/mem); a lane's copies are memcpys run when the lane waits. For
/// tests and benchmarks: it runs the pipeline a CUDA load runs.
pub struct HostEngine;

struct HostLane {
    slab: memmap2::MmapMut,
    /// Copies submitted and not yet run: (the arena's base address, the copy).
    queued: Vec<(usize, Copy)>,
}

struct HostArena {
    map: memmap2::MmapRaw,
    size: u64,
    _alive: Alive,
}

/// Anonymous memory of `len` bytes (at least one), in huge pages where the
/// kernel gives them: with 4 KiB pages a copy into fresh memory runs at a
/// third of the speed here, most of it spent walking page tables.
fn anonymous(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let map = memmap2::MmapOptions::new().len(len.max(1)).map_anon()?;
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(map)
}

impl Engine for HostEngine {
    fn name(&self) -> String {
        "host".into()
    }

    fn new_lane(&self, slab: usize) -> Result<Box<dyn Lane>, LoadError> {
        let slab = anonymous(slab)
            .map_err(|e| LoadError::OutOfMemory(format!("a host slab of {slab} bytes: {e}")))?;
        Ok(Box::new(HostLane {
            slab,
            queued: Vec::new(),
        }))
    }

    fn new_arena(&self, size: u64) -> Result<Arc<dyn Arena>, LoadError> {
        let map = anonymous(size as usize)
            .map_err(|e| LoadError::OutOfMemory(format!("a host arena of {size} bytes: {e}")))?;
        Ok(Arc::new(HostArena {
            map: memmap2::MmapRaw::from(map),
            size,
            _alive: Alive::new(),
        }))
    }
}

impl Lane for HostLane {
    fn slab(&mut self) -> &mut [u8] {
        &mut self.slab
    }

    fn submit(&mut self, arena: &dyn Arena, copies: &[Copy]) -> Result<(), LoadError> {
        let arena = arena
            .as_any()
            .downcast_ref::<HostArena>()
            .ok_or_else(|| LoadError::Device("a host lane given another engine's arena".into()))?;
        for c in copies {
            let in_arena =
                c.to.checked_add(c.len as u64)
                    .is_some_and(|end| end <= arena.size);
            if !in_arena || c.from + c.len > self.slab.len() {
                return Err(LoadError::Device(format!("a copy out of bounds: {c:?}")));
            }
            self.queued.push((arena.map.as_mut_ptr() as usize, *c));
        }
        Ok(())
    }

    /// The copies run here, as a DMA engine runs them after `submit`
    /// returned: a pipeline that writes a slab before waiting for its copies
    /// gets wrong bytes, as it would on a GPU.
    fn wait(&mut self) -> Result<(), LoadError> {
        for (base, c) in self.queued.drain(..) {
            // SAFETY: the ranges were checked against the slab and the arena
            // at submit; the arena outlives its load's workers, who wait for
            // every copy before they end; each arena range is written once.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.slab.as_ptr().add(c.from),
                    (base as *mut u8).add(c.to as usize),
                    c.len,
                );
            }
        }
        Ok(())
    }
}

impl Arena for HostArena {
    fn size(&self) -> u64 {
        self.size
    }

    fn handle(&self) -> [u8; 64] {
        let mut h = [0; 64];
        h[..4].copy_from_slice(&(std::process::id() as i32).to_le_bytes());
        h[8..16].copy_from_slice(&(self.map.as_ptr() as u64).to_le_bytes());
        h
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn host_memory(&self) -> Option<*mut u8> {
        Some(self.map.as_mut_ptr())
    }
}

impl HostArena {
    /// The arena's bytes (tests and the benchmark).
    fn bytes(&self) -> &[u8] {
        // SAFETY: the map lives as long as self; readers look only after the
        // load is done, when no lane writes any more.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr(), self.size as usize) }
    }
}

/// The bytes of a host arena, or None for another engine's.
pub fn host_bytes(arena: &dyn Arena) -> Option<&[u8]> {
    arena
        .as_any()
        .downcast_ref::<HostArena>()
        .map(HostArena::bytes)
}
