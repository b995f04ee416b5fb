//! STFS_IOC_LOAD: many tensors of the mount into one arena on a device
//! (`prefetch::load`), each load belonging to the descriptor that started it.

use std::time::Duration;

use super::ioctl::{
    LOAD_FREE, LOAD_GLOB, LOAD_NAMES, LOAD_POLL, LOAD_START, LOAD_TABLE, LOAD_THROUGH_SLABS,
    LoadArgs, TARGET_CUDA, TARGET_HOST,
};
use super::{Fs, FsError};
use crate::prefetch::load::run::Way;
use crate::prefetch::load::{self, Load, Target};

/// A poll waits at most this long for a tensor to land (a FUSE request
/// cannot be interrupted).
const MAX_WAIT: Duration = Duration::from_secs(1);

impl Fs {
    /// Answers one STFS_IOC_LOAD request made on descriptor `fh`.
    pub fn load(&self, fh: u64, caller: u32, args: &mut LoadArgs) -> Result<(), FsError> {
        self.allowed(caller, "load")?;
        match args.op {
            LOAD_NAMES => {
                let names = args
                    .names()
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| FsError::NotUtf8)?;
                self.loads.add_names(fh, names)?;
            }
            LOAD_GLOB => self.loads.set_glob(fh, args.text())?,
            LOAD_START => self.start_load(fh, args)?,
            // Poll of no load: the daemon's counts only.
            LOAD_POLL if args.id == 0 => counts(args),
            LOAD_POLL => {
                let load = self.loads.get(fh, args.id)?;
                let wait = Duration::from_millis(args.wait_ms.into()).min(MAX_WAIT);
                answer(args, &load, wait);
            }
            LOAD_TABLE => {
                let load = self.loads.get(fh, args.id)?;
                args.set_page(load.table());
            }
            LOAD_FREE => self.loads.free(fh, args.id)?,
            other => {
                return Err(FsError::Invalid(format!(
                    "unknown STFS_IOC_LOAD op {other}"
                )));
            }
        }
        Ok(())
    }

    /// Plans the tensors asked for, makes the arena and starts the load.
    fn start_load(&self, fh: u64, args: &mut LoadArgs) -> Result<(), FsError> {
        let target = match args.target {
            TARGET_CUDA => Target::Cuda(args.device),
            TARGET_HOST => Target::Host,
            other => return Err(FsError::Invalid(format!("unknown load target {other}"))),
        };
        let want = self.loads.take_want(fh);
        let tensors = {
            let st = self.read_state();
            super::views::export::tensors_of(&st, None)?.0
        };
        let items = load::choose(tensors, &want)?;
        let pool = self.devices.pool(target)?;
        let way = match args.flags & LOAD_THROUGH_SLABS {
            0 => Way::Direct,
            _ => Way::ThroughSlabs,
        };
        let load = Load::start(items, pool, way)?;
        args.id = self.loads.insert(fh, load.clone());
        answer(args, &load, Duration::ZERO);
        Ok(())
    }
}

/// Fills `args` with how far `load` got (after waiting up to `wait`).
fn answer(args: &mut LoadArgs, load: &Load, wait: Duration) {
    let seen = load.seen(wait);
    args.done = seen.done.into();
    args.tensors = load.plan.entries.len() as u64;
    args.bytes = load.plan.bytes();
    args.landed_tensors = seen.landed_tensors as u64;
    args.landed_bytes = seen.landed_bytes;
    args.arena_size = load.arena.size();
    args.elapsed_ns = load.elapsed().as_nanos() as u64;
    counts(args);
    args.handle = load.arena.handle();
    if let Some((errno, why)) = seen.failed {
        args.result = errno;
        args.set_text(&why);
    }
}

/// Slabs made and freed since the daemon started, and arenas alive now.
fn counts(args: &mut LoadArgs) {
    use std::sync::atomic::Ordering::Relaxed;
    args.slabs_made = load::pool::SLABS_MADE.load(Relaxed);
    args.slabs_freed = load::pool::SLABS_FREED.load(Relaxed);
    args.live_arenas = load::engine::LIVE_ARENAS.load(Relaxed);
}
