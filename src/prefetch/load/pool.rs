//! The lanes of one device, made at its first load and kept for every later
//! one (pinned allocations cost milliseconds each), freed with the pool at
//! unmount. A load's workers each take a lane and give it back when done;
//! two loads at once share the lanes.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use crate::sync::LockAnyway;

use super::engine::{Engine, Lane};
use super::error::LoadError;

/// Slabs made since the daemon started, of every pool (after the first
/// load of a device, no load makes one).
pub static SLABS_MADE: AtomicU64 = AtomicU64::new(0);

pub struct Pool {
    engine: Box<dyn Engine>,
    slab: usize,
    lanes: usize,
    free: Mutex<Option<Vec<Box<dyn Lane>>>>,
    returned: Condvar,
    /// Slabs this pool made.
    made: AtomicU64,
}

impl Pool {
    /// A pool of `lanes` lanes with slabs of `slab` bytes, made at first use.
    pub fn new(engine: Box<dyn Engine>, lanes: usize, slab: usize) -> Pool {
        Pool {
            engine,
            slab,
            lanes: lanes.max(1),
            free: Mutex::new(None),
            returned: Condvar::new(),
            made: AtomicU64::new(0),
        }
    }

    pub fn engine(&self) -> &dyn Engine {
        &*self.engine
    }

    pub fn lanes(&self) -> usize {
        self.lanes
    }

    /// Slabs this pool has made (all of them at its first load).
    pub fn made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }

    pub fn slab(&self) -> usize {
        self.slab
    }

    /// A free lane, once one is (all are made on the first call).
    pub fn take(&self) -> Result<Taken<'_>, LoadError> {
        let mut free = self.free.lock_anyway();
        if free.is_none() {
            *free = Some(self.make_lanes()?);
        }
        loop {
            if let Some(lane) = free.as_mut().and_then(Vec::pop) {
                return Ok(Taken {
                    pool: self,
                    lane: Some(lane),
                });
            }
            free = self.returned.wait(free).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn make_lanes(&self) -> Result<Vec<Box<dyn Lane>>, LoadError> {
        (0..self.lanes)
            .map(|_| {
                let lane = self.engine.new_lane(self.slab)?;
                SLABS_MADE.fetch_add(1, Ordering::Relaxed);
                self.made.fetch_add(1, Ordering::Relaxed);
                Ok(lane)
            })
            .collect()
    }
}

/// A lane taken from a pool; given back when dropped.
pub struct Taken<'a> {
    pool: &'a Pool,
    lane: Option<Box<dyn Lane>>,
}

impl Deref for Taken<'_> {
    type Target = Box<dyn Lane>;
    fn deref(&self) -> &Self::Target {
        self.lane.as_ref().expect("held until dropped")
    }
}

impl DerefMut for Taken<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.lane.as_mut().expect("held until dropped")
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some(lane) = self.lane.take() {
            if let Some(free) = self.pool.free.lock_anyway().as_mut() {
                free.push(lane);
            }
            self.pool.returned.notify_one();
        }
    }
}
