//! The lanes of one device, made at its first load and kept for every later
//! one (pinned allocations cost milliseconds each), freed with the pool at
//! unmount or once no load has used them for the mount's idle time (pinned
//! memory is memory the machine's own work cannot have). A load's workers
//! each take a lane and give it back when done; two loads at once share the
//! lanes.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::sync::LockAnyway;

use super::engine::{Engine, Lane};
use super::error::LoadError;

/// Slabs made since the daemon started, of every pool (after the first
/// load of a device, no load makes one).
pub static SLABS_MADE: AtomicU64 = AtomicU64::new(0);
/// Slabs given back to the system, of every pool (idle, or at unmount).
pub static SLABS_FREED: AtomicU64 = AtomicU64::new(0);

pub struct Pool {
    engine: Box<dyn Engine>,
    slab: usize,
    lanes: usize,
    free: Mutex<Free>,
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
            free: Mutex::new(Free {
                lanes: None,
                since: Instant::now(),
            }),
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
        loop {
            // (Made again if they were freed while this load waited.)
            if free.lanes.is_none() {
                free.lanes = Some(self.make_lanes()?);
            }
            if let Some(lane) = free.lanes.as_mut().and_then(Vec::pop) {
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

    /// Frees the lanes if every one has been back for `idle` at `now`
    /// (the next load makes them again); says whether it did.
    pub fn release_if_idle(&self, idle: Duration, now: Instant) -> bool {
        let mut free = self.free.lock_anyway();
        let all_back = free.lanes.as_ref().is_some_and(|l| l.len() == self.lanes);
        if !all_back || now.saturating_duration_since(free.since) < idle {
            return false;
        }
        // (Freed under the lock: a load that comes meanwhile waits for the
        // old slabs to go before it makes new ones.)
        free.give_back();
        true
    }

    /// Whether the lanes are made now.
    pub fn holds_lanes(&self) -> bool {
        self.free.lock_anyway().lanes.is_some()
    }
}

/// The lanes not taken (all of them made at once, or none), and since when
/// none has been taken or given back.
struct Free {
    lanes: Option<Vec<Box<dyn Lane>>>,
    since: Instant,
}

impl Free {
    /// Frees the lanes' slabs (counted in SLABS_FREED).
    fn give_back(&mut self) {
        if let Some(lanes) = self.lanes.take() {
            SLABS_FREED.fetch_add(lanes.len() as u64, Ordering::Relaxed);
        }
    }
}

impl Drop for Free {
    fn drop(&mut self) {
        self.give_back();
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
            let mut free = self.pool.free.lock_anyway();
            free.since = Instant::now();
            if let Some(lanes) = free.lanes.as_mut() {
                lanes.push(lane);
            }
            drop(free);
            self.pool.returned.notify_one();
        }
    }
}
