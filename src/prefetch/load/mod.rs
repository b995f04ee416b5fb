//! Loading many tensors at once into one allocation on a device (the
//! arena): one plan across every file (`plan`), a pool of lanes per device
//! that lives as long as the daemon (`pool`), workers that stream the plan
//! through the lanes (`run`), and the seam to the device (`engine`: CUDA, or
//! host memory for tests and benchmarks). A load belongs to the descriptor
//! that started it (`Loads`): the arena lives until it is closed.

pub mod engine;
pub mod error;
pub mod plan;
pub mod pool;
pub mod run;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::checkpoint::view::ViewTensor;
use crate::sync::LockAnyway;

pub use error::LoadError;

use engine::Arena;
use plan::{Item, Plan};
use pool::Pool;
use run::{Progress, Seen};

/// Where a load goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// CUDA device N.
    Cuda(i32),
    /// Host memory through the same pipeline (tests and benchmarks).
    Host,
}

/// Which tensors a load takes.
pub enum Want {
    All,
    Names(Vec<String>),
    Glob(glob::Pattern),
}

/// The tensors of `all` that `want` names, as plan items. A name that is
/// not there is refused (ENOENT), naming it.
pub fn choose(all: Vec<ViewTensor>, want: &Want) -> Result<Vec<Item>, LoadError> {
    let chosen: Vec<ViewTensor> = match want {
        Want::All => all,
        Want::Glob(p) => all.into_iter().filter(|t| p.matches(&t.name)).collect(),
        Want::Names(names) => {
            let mut by_name: HashMap<String, ViewTensor> =
                all.into_iter().map(|t| (t.name.clone(), t)).collect();
            let mut chosen = Vec::new();
            for name in names {
                match by_name.remove(name) {
                    Some(t) => chosen.push(t),
                    None if chosen.iter().any(|t: &ViewTensor| &t.name == name) => {}
                    None => return Err(LoadError::NoSuchTensor(name.clone())),
                }
            }
            chosen
        }
    };
    chosen
        .into_iter()
        .map(|t| {
            let backing = t.bytes.backing().map_err(|e| LoadError::Read {
                tensor: t.name.clone(),
                at: 0,
                source: e,
            })?;
            Ok(Item {
                nbytes: t.bytes.len(),
                name: t.name,
                dtype: t.dtype,
                shape: t.shape,
                backing,
            })
        })
        .collect()
}

type Pools = Mutex<HashMap<Target, Arc<Pool>>>;

/// The lanes of each device, made at its first load, freed with the mount
/// or once idle for `idle`.
pub struct Devices {
    lanes: usize,
    slab: usize,
    idle: Option<Duration>,
    pools: Arc<Pools>,
    reaper: std::sync::Once,
}

impl Devices {
    pub fn new(lanes: usize, slab: usize, idle: Option<Duration>) -> Devices {
        Devices {
            lanes,
            slab,
            idle,
            pools: Arc::new(Mutex::new(HashMap::new())),
            reaper: std::sync::Once::new(),
        }
    }

    /// The pool of `target` (its engine started on first use).
    pub fn pool(&self, target: Target) -> Result<Arc<Pool>, LoadError> {
        let mut pools = self.pools.lock_anyway();
        if let Some(p) = pools.get(&target) {
            return Ok(p.clone());
        }
        let engine: Box<dyn engine::Engine> = match target {
            Target::Host => Box::new(engine::HostEngine),
            Target::Cuda(n) => Box::new(super::cuda::CudaEngine::new(n)?),
        };
        let pool = Arc::new(Pool::new(engine, self.lanes, self.slab));
        pools.insert(target, pool.clone());
        if let Some(idle) = self.idle {
            let pools = Arc::downgrade(&self.pools);
            self.reaper.call_once(|| {
                let spawned = std::thread::Builder::new()
                    .name("stfs-pool-reaper".into())
                    .spawn(move || free_idle_pools(pools, idle));
                if let Err(e) = spawned {
                    tracing::warn!(error = %e, "no thread to free idle pools: they stay until unmount");
                }
            });
        }
        Ok(pool)
    }
}

/// Frees the lanes of every pool idle for `idle`, looking a few times per
/// `idle`, until the mount's pools are gone.
fn free_idle_pools(pools: std::sync::Weak<Pools>, idle: Duration) {
    let tick = (idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(10));
    loop {
        std::thread::sleep(tick);
        let Some(pools) = pools.upgrade() else { return };
        let held: Vec<(Target, Arc<Pool>)> = pools
            .lock_anyway()
            .iter()
            .map(|(t, p)| (*t, p.clone()))
            .collect();
        drop(pools);
        for (target, pool) in held {
            if pool.release_if_idle(idle, Instant::now()) {
                tracing::info!(
                    ?target,
                    idle_s = idle.as_secs(),
                    "pool freed after its idle time"
                );
            }
        }
    }
}

/// A load under way or done: its plan, its arena, how far it got.
pub struct Load {
    pub plan: Plan,
    pub arena: Arc<dyn Arena>,
    pub progress: Progress,
    started: Instant,
    took: OnceLock<Duration>,
    table: OnceLock<Vec<u8>>,
}

impl Load {
    /// Plans `items`, makes the arena and starts streaming into it on a
    /// thread of its own; returns at once.
    pub fn start(items: Vec<Item>, pool: Arc<Pool>, way: run::Way) -> Result<Arc<Load>, LoadError> {
        let plan = plan::plan(items, pool.slab());
        let arena = pool.engine().new_arena(plan.arena_size)?;
        let load = Arc::new(Load {
            progress: Progress::new(&plan),
            plan,
            arena,
            started: Instant::now(),
            took: OnceLock::new(),
            table: OnceLock::new(),
        });
        let running = load.clone();
        std::thread::Builder::new()
            .name("stfs-load".into())
            .spawn(move || {
                run::run(
                    &running.plan,
                    &*running.arena,
                    &pool,
                    &running.progress,
                    way,
                );
                let _ = running.took.set(running.started.elapsed());
                let seen = running.progress.seen(Duration::ZERO);
                match &seen.failed {
                    None => tracing::info!(
                        engine = %pool.engine().name(),
                        tensors = running.plan.entries.len(),
                        bytes = running.plan.bytes(),
                        seconds = running.started.elapsed().as_secs_f64(),
                        "load done"
                    ),
                    Some((errno, why)) => tracing::warn!(errno, "load failed: {why}"),
                }
            })
            .map_err(|e| LoadError::OutOfMemory(format!("a load thread: {e}")))?;
        Ok(load)
    }

    /// Runs a load to its end on this thread's watch (a one-tensor prefetch).
    pub fn wait(&self, keep_going: &dyn Fn() -> bool) -> Result<(), LoadError> {
        loop {
            let seen = self.progress.seen(Duration::from_millis(100));
            if let Some((errno, why)) = seen.failed {
                return Err(LoadError::Failed(errno, why));
            }
            if seen.done {
                return Ok(());
            }
            if !keep_going() {
                self.progress.cancel();
            }
        }
    }

    pub fn seen(&self, wait: Duration) -> Seen {
        self.progress.seen(wait)
    }

    /// Time from the start to the end (so far, while it runs).
    pub fn elapsed(&self) -> Duration {
        self.took
            .get()
            .copied()
            .unwrap_or_else(|| self.started.elapsed())
    }

    /// The table of the arena: one JSON object per line, in landing order.
    pub fn table(&self) -> &[u8] {
        self.table.get_or_init(|| {
            let mut out = Vec::new();
            for e in &self.plan.entries {
                serde_json::to_writer(&mut out, e).expect("plain data");
                out.push(b'\n');
            }
            out
        })
    }
}

/// Names sent ahead of a start are bounded (a client cannot grow the
/// daemon without end).
const MAX_PENDING_NAME_BYTES: usize = 64 << 20;

/// The loads of each open descriptor, and the names sent for its next one.
#[derive(Default)]
pub struct Loads {
    by_fh: Mutex<HashMap<u64, Held>>,
    next_id: AtomicU64,
}

#[derive(Default)]
struct Held {
    names: Vec<String>,
    name_bytes: usize,
    glob: Option<String>,
    loads: HashMap<u64, Arc<Load>>,
}

impl Loads {
    /// Adds names for the next load of `fh`.
    pub fn add_names(
        &self,
        fh: u64,
        names: impl IntoIterator<Item = String>,
    ) -> Result<(), LoadError> {
        let mut all = self.by_fh.lock_anyway();
        let held = all.entry(fh).or_default();
        for n in names {
            held.name_bytes += n.len() + 1;
            if held.name_bytes > MAX_PENDING_NAME_BYTES {
                all.remove(&fh);
                return Err(LoadError::Invalid(format!(
                    "more than {} MiB of tensor names for one load",
                    MAX_PENDING_NAME_BYTES >> 20
                )));
            }
            held.names.push(n);
        }
        Ok(())
    }

    pub fn set_glob(&self, fh: u64, glob: String) -> Result<(), LoadError> {
        glob::Pattern::new(&glob)
            .map_err(|e| LoadError::Invalid(format!("the glob {glob:?}: {e}")))?;
        self.by_fh.lock_anyway().entry(fh).or_default().glob = Some(glob);
        Ok(())
    }

    /// What the next load of `fh` takes (names sent, else the glob, else
    /// all); forgets them.
    pub fn take_want(&self, fh: u64) -> Want {
        let mut all = self.by_fh.lock_anyway();
        let Some(held) = all.get_mut(&fh) else {
            return Want::All;
        };
        let names = std::mem::take(&mut held.names);
        held.name_bytes = 0;
        let glob = held.glob.take();
        match (names.is_empty(), glob) {
            (false, _) => Want::Names(names),
            (true, Some(g)) => Want::Glob(glob::Pattern::new(&g).expect("checked when set")),
            (true, None) => Want::All,
        }
    }

    /// Keeps `load` for `fh`; its id.
    pub fn insert(&self, fh: u64, load: Arc<Load>) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        self.by_fh
            .lock_anyway()
            .entry(fh)
            .or_default()
            .loads
            .insert(id, load);
        id
    }

    pub fn get(&self, fh: u64, id: u64) -> Result<Arc<Load>, LoadError> {
        self.by_fh
            .lock_anyway()
            .get(&fh)
            .and_then(|h| h.loads.get(&id).cloned())
            .ok_or_else(|| LoadError::Invalid(format!("no load {id} on this descriptor")))
    }

    /// Stops and drops load `id` of `fh` (its arena goes once its workers stop).
    pub fn free(&self, fh: u64, id: u64) -> Result<(), LoadError> {
        let load = self
            .by_fh
            .lock_anyway()
            .get_mut(&fh)
            .and_then(|h| h.loads.remove(&id))
            .ok_or_else(|| LoadError::Invalid(format!("no load {id} on this descriptor")))?;
        load.progress.cancel();
        Ok(())
    }

    /// The descriptor closed: every load it started stops and goes.
    pub fn release(&self, fh: u64) {
        let held = self.by_fh.lock_anyway().remove(&fh);
        for load in held.into_iter().flat_map(|h| h.loads.into_values()) {
            load.progress.cancel();
        }
    }
}

#[cfg(test)]
mod tests;
