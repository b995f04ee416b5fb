//! Running a plan: workers, each with a lane from the pool, take the next
//! chunk in plan order, read it into the lane's slab (once the slab's last
//! copies are done), and queue its copies into the arena. A tensor has
//! landed when every copy of its bytes has finished.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

use crate::sync::LockAnyway;

use super::engine::{Arena, Lane};
use super::error::LoadError;
use super::plan::Plan;
use super::pool::Pool;

/// How far a load got; shared by the workers and whoever polls.
pub struct Progress {
    /// Bytes of each tensor (plan order) not landed yet.
    remaining: Vec<AtomicU64>,
    landed_bytes: AtomicU64,
    cancelled: AtomicBool,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// The tensors of the plan's first `prefix` entries have all landed.
    prefix: usize,
    finished: bool,
    failed: Option<LoadError>,
}

/// What a poll sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub landed_tensors: usize,
    pub landed_bytes: u64,
    pub done: bool,
    /// Why it failed (then `done` is true too).
    pub failed: Option<(i32, String)>,
}

impl Progress {
    pub fn new(plan: &Plan) -> Progress {
        Progress {
            remaining: plan
                .entries
                .iter()
                .map(|e| AtomicU64::new(e.nbytes))
                .collect(),
            landed_bytes: AtomicU64::new(0),
            cancelled: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    }

    /// Stops the workers at their next chunk (the caller went away).
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    fn cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Counts the bytes of a chunk whose copies finished.
    fn landed(&self, plan: &Plan, chunk: usize) {
        let c = &plan.chunks[chunk];
        for (copy, &entry) in c.copies.iter().zip(&c.entries) {
            self.remaining[entry].fetch_sub(copy.len as u64, Ordering::AcqRel);
            self.landed_bytes
                .fetch_add(copy.len as u64, Ordering::Relaxed);
        }
        let mut st = self.state.lock_anyway();
        self.advance(&mut st);
        self.changed.notify_all();
    }

    fn advance(&self, st: &mut State) {
        while st.prefix < self.remaining.len()
            && self.remaining[st.prefix].load(Ordering::Acquire) == 0
        {
            st.prefix += 1;
        }
    }

    fn finish(&self, failed: Option<LoadError>) {
        let mut st = self.state.lock_anyway();
        self.advance(&mut st);
        st.finished = true;
        if st.failed.is_none() {
            st.failed = failed;
        }
        self.changed.notify_all();
    }

    /// How far it got, after waiting up to `wait` for a change.
    pub fn seen(&self, wait: std::time::Duration) -> Seen {
        let mut st = self.state.lock_anyway();
        self.advance(&mut st); // (empty tensors have landed before any chunk)
        if !st.finished && !wait.is_zero() {
            let before = st.prefix;
            st = self
                .changed
                .wait_timeout_while(st, wait, |s| !s.finished && s.prefix == before)
                .map(|(st, _)| st)
                .unwrap_or_else(|p| p.into_inner().0);
        }
        let failed = st
            .failed
            .as_ref()
            .map(|e| (crate::errno::ToErrno::to_errno(e), e.to_string()));
        Seen {
            // A failed load hands out no tensor.
            landed_tensors: if failed.is_some() { 0 } else { st.prefix },
            landed_bytes: self.landed_bytes.load(Ordering::Relaxed),
            done: st.finished,
            failed,
        }
    }
}

/// How chunks reach the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// Straight into the arena where it is host memory, else through slabs.
    Direct,
    /// Always read into a lane's slab, then copied (what a device without a
    /// registered page cache does; tests run it on the host engine too).
    ThroughSlabs,
}

/// Runs `plan` into `arena` with lanes of `pool`, until done, failed or
/// cancelled; the outcome is in `progress`.
pub fn run(plan: &Plan, arena: &dyn Arena, pool: &Pool, progress: &Progress, way: Way) {
    let next = AtomicUsize::new(0);
    let workers = pool.lanes().min(plan.chunks.len());
    let failed: Mutex<Option<LoadError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                if let Err(e) = work(plan, arena, pool, progress, &next, way) {
                    failed.lock_anyway().get_or_insert(e);
                    progress.cancel(); // the other workers stop too
                }
            });
        }
    });
    let mut failed = failed.into_inner().unwrap_or_else(|p| p.into_inner());
    if failed.is_none() && progress.cancelled() {
        failed = Some(LoadError::Cancelled);
    }
    progress.finish(failed);
}

/// One worker: chunks until none is left, on one lane.
fn work(
    plan: &Plan,
    arena: &dyn Arena,
    pool: &Pool,
    progress: &Progress,
    next: &AtomicUsize,
    way: Way,
) -> Result<(), LoadError> {
    let direct = arena.host_memory().filter(|_| way == Way::Direct);
    let mut lane = pool.take()?;
    let mut pending = None;
    let result = (|| {
        loop {
            if progress.cancelled() {
                return Ok(());
            }
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(chunk) = plan.chunks.get(i) else {
                return Ok(());
            };
            if let Some(memory) = direct {
                read_into_arena(plan, i, memory)?;
                progress.landed(plan, i);
                continue;
            }
            settle(&mut **lane, &mut pending, plan, progress)?;
            read_chunk(plan, i, lane.slab())?;
            lane.submit(arena, &chunk.copies)?;
            pending = Some(i);
        }
    })();
    // The slab goes back to the pool only once no copy reads it.
    let settled = settle(&mut **lane, &mut pending, plan, progress);
    result.and(settled)
}

/// Waits for the lane's copies; the chunk they were is counted as landed.
fn settle(
    lane: &mut dyn Lane,
    pending: &mut Option<usize>,
    plan: &Plan,
    progress: &Progress,
) -> Result<(), LoadError> {
    if let Some(i) = pending.take() {
        lane.wait()?;
        progress.landed(plan, i);
    }
    Ok(())
}

/// Reads chunk `i` whole into `slab`; an error names the tensor it was in.
fn read_chunk(plan: &Plan, i: usize, slab: &mut [u8]) -> Result<(), LoadError> {
    let chunk = &plan.chunks[i];
    read_full(plan, i, 0, &mut slab[..chunk.len])
}

/// Reads each tensor piece of chunk `i` straight to its place in the arena
/// at `memory` (host memory).
fn read_into_arena(plan: &Plan, i: usize, memory: *mut u8) -> Result<(), LoadError> {
    for copy in &plan.chunks[i].copies {
        // SAFETY: the plan gives every copy its own range of the arena
        // (tensors do not overlap there, and each piece of a tensor is in one
        // chunk), inside the arena's size; the arena outlives the load's
        // workers.
        let to = unsafe { std::slice::from_raw_parts_mut(memory.add(copy.to as usize), copy.len) };
        read_full(plan, i, copy.from, to)?;
    }
    Ok(())
}

/// Fills `buf` from byte `from` of chunk `i` on; an error names the tensor
/// the byte it failed at belongs to.
fn read_full(plan: &Plan, i: usize, from: usize, buf: &mut [u8]) -> Result<(), LoadError> {
    let chunk = &plan.chunks[i];
    let backing = &plan.sources[chunk.source];
    let failed = |done: usize, e: std::io::Error| LoadError::Read {
        tensor: tensor_at(plan, i, from + done).to_string(),
        at: chunk.pos + (from + done) as u64,
        source: e,
    };
    crate::testpoint::point("load:read").map_err(|e| failed(0, e))?;
    let mut done = 0;
    while done < buf.len() {
        match backing.read_at(&mut buf[done..], chunk.pos + (from + done) as u64) {
            Ok(0) => {
                let eof = std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the file ended before the tensor did",
                );
                return Err(failed(done, eof));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(failed(done, e)),
        }
    }
    Ok(())
}

/// The name of the tensor byte `at` of chunk `i` belongs to (or the
/// chunk's first tensor, when `at` falls between tensors).
fn tensor_at(plan: &Plan, i: usize, at: usize) -> &str {
    let chunk = &plan.chunks[i];
    let hit = chunk
        .copies
        .iter()
        .zip(&chunk.entries)
        .find(|(c, _)| (c.from..c.from + c.len).contains(&at))
        .or(chunk.copies.iter().zip(&chunk.entries).next());
    hit.map_or("", |(_, &e)| plan.entries[e].name.as_str())
}
