//! Named points in the commit and recovery code where a test takes control
//! of the daemon, so that crashes, faults and races are chosen, not timed:
//!
//! - `STFS_CRASH_AT=STEP`: the daemon kills itself (SIGKILL) there, as a
//!   `kill -9` at that moment would;
//! - `STFS_PAUSE_AT=STEP[,STEP...]` with `STFS_PAUSE_DIR=DIR`: the first time
//!   it gets there, the daemon creates `DIR/STEP` and waits until the test
//!   removes it (at most 120 s, then it goes on and says so; no pause at all
//!   once `DIR/go-all` exists);
//! - `STFS_FAULT_AT=STEP:ERRNO[:always|:N]`: the step fails with that error
//!   (`ENOSPC`, `EIO`, `EAGAIN`, `ENOENT`, `EDQUOT` or a number), the first
//!   time it is reached, every time, or the N-th time.
//!
//! The steps are listed in docs/SEMANTICS.md ("Testing the commit"). The
//! variables are read once per process; without them a point costs a load.

use crate::sync::{LockAnyway, RwLockAnyway};
use std::collections::HashSet;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

use tracing::warn;

struct Plan {
    crash: Option<String>,
    pause: Vec<String>,
    pause_dir: Option<std::path::PathBuf>,
    fault: Option<(String, i32, Fault)>,
    /// Times the faulted step was reached.
    reached: AtomicU64,
    /// Pauses already taken.
    spent: Mutex<HashSet<String>>,
}

/// When a faulted step fails.
#[derive(Debug, PartialEq, Eq)]
enum Fault {
    Always,
    /// The N-th time it is reached (from 1).
    Nth(u64),
}

fn errno_of(name: &str) -> Option<i32> {
    Some(match name {
        "ENOSPC" => libc::ENOSPC,
        "EIO" => libc::EIO,
        "EAGAIN" => libc::EAGAIN,
        "ENOENT" => libc::ENOENT,
        "EDQUOT" => libc::EDQUOT,
        "EROFS" => libc::EROFS,
        other => other.parse().ok()?,
    })
}

/// `STEP:ERRNO[:always|:N]`. (Step names have colons: the errno and when
/// are read from the end; a number last is N only if an errno stands
/// before it.)
fn parse_fault(v: &str) -> Option<(String, i32, Fault)> {
    let step_errno = |v: &str| {
        let (step, errno) = v.rsplit_once(':')?;
        Some((step.to_string(), errno_of(errno)?))
    };
    if let Some(rest) = v.strip_suffix(":always") {
        let (step, errno) = step_errno(rest)?;
        return Some((step, errno, Fault::Always));
    }
    if let Some((rest, n)) = v.rsplit_once(':') {
        if let (Ok(n @ 1..), Some((step, errno))) = (n.parse::<u64>(), step_errno(rest)) {
            return Some((step, errno, Fault::Nth(n)));
        }
    }
    let (step, errno) = step_errno(v)?;
    Some((step, errno, Fault::Nth(1)))
}

fn plan() -> &'static Plan {
    static PLAN: OnceLock<Plan> = OnceLock::new();
    PLAN.get_or_init(|| {
        let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
        let fault = var("STFS_FAULT_AT").and_then(|v| parse_fault(&v));
        Plan {
            crash: var("STFS_CRASH_AT"),
            pause: var("STFS_PAUSE_AT")
                .map(|v| v.split(',').map(str::to_string).collect())
                .unwrap_or_default(),
            pause_dir: var("STFS_PAUSE_DIR").map(Into::into),
            fault,
            reached: AtomicU64::new(0),
            spent: Mutex::new(HashSet::new()),
        }
    })
}

/// Marks step `step`: crashes, pauses or fails there if a test asked to.
pub fn point(step: &str) -> std::io::Result<()> {
    if POINT_HOOKED.load(Ordering::Relaxed) {
        if let Some(hook) = &*POINT_HOOK.read_anyway() {
            hook(step);
        }
    }
    let plan = plan();
    if plan.crash.as_deref() == Some(step) {
        warn!("STFS_CRASH_AT={step}: killing the daemon here");
        let me = rustix::process::getpid();
        let _ = rustix::process::kill_process(me, rustix::process::Signal::KILL);
    }
    let first = |key: String| plan.spent.lock_anyway().insert(key);
    if let (true, Some(dir)) = (plan.pause.iter().any(|p| p == step), &plan.pause_dir) {
        if first(format!("pause {step}")) {
            pause(&dir.join(step), step);
        }
    }
    if let Some((at, errno, when)) = &plan.fault {
        let fails = at == step && {
            let reached = plan.reached.fetch_add(1, Ordering::SeqCst) + 1;
            match when {
                Fault::Always => true,
                Fault::Nth(n) => reached == *n,
            }
        };
        if fails {
            warn!("STFS_FAULT_AT={step}: failing this step with errno {errno}");
            return Err(std::io::Error::from_raw_os_error(*errno));
        }
    }
    Ok(())
}

fn pause(flag: &std::path::Path, step: &str) {
    // A test that ends lets every pause go at once (`DIR/go-all`).
    if flag.with_file_name("go-all").exists() {
        return;
    }
    use std::os::unix::fs::OpenOptionsExt;
    let made = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(flag);
    if let Err(e) = made {
        warn!("STFS_PAUSE_AT={step}: cannot make {}: {e}", flag.display());
        return;
    }
    warn!(
        "STFS_PAUSE_AT={step}: waiting until {} is removed",
        flag.display()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while flag.exists() {
        if std::time::Instant::now() > deadline {
            warn!(
                "STFS_PAUSE_AT={step}: nobody removed {}; going on",
                flag.display()
            );
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// What the crash explorer of commits (`tests/crash_explorer.rs`) sees of
/// the file system: every change to a folder's names, and every sync, in
/// the order the code does them. A change is told before it is done (the
/// explorer may stop the process there, or keep what it removes so as to
/// build the states a crash may leave); a creation and a sync after.
pub enum FsEvent<'a> {
    Created {
        folder: &'a Path,
        name: &'a OsStr,
    },
    Renaming {
        folder: &'a Path,
        from: &'a OsStr,
        to: &'a OsStr,
    },
    Exchanging {
        folder: &'a Path,
        a: &'a OsStr,
        b: &'a OsStr,
    },
    Unlinking {
        folder: &'a Path,
        name: &'a OsStr,
    },
    SyncedFolder {
        folder: &'a Path,
    },
    SyncedFile {
        file: &'a std::fs::File,
    },
}

type FsHook = Box<dyn Fn(&FsEvent) + Send + Sync>;

type PointHook = Box<dyn Fn(&str) + Send + Sync>;

static POINT_HOOKED: AtomicBool = AtomicBool::new(false);
static POINT_HOOK: RwLock<Option<PointHook>> = RwLock::new(None);

/// Sets (or takes away) the function called at every named point, on the
/// thread that reaches it: the explorers make an edit there, during a commit.
pub fn set_point_hook(hook: Option<PointHook>) {
    POINT_HOOKED.store(hook.is_some(), Ordering::SeqCst);
    *POINT_HOOK.write_anyway() = hook;
}

static FS_HOOKED: AtomicBool = AtomicBool::new(false);
static FS_HOOK: RwLock<Option<FsHook>> = RwLock::new(None);

/// Sets (or takes away) the function told of every `FsEvent`.
pub fn set_fs_hook(hook: Option<FsHook>) {
    FS_HOOKED.store(hook.is_some(), Ordering::SeqCst);
    *FS_HOOK.write_anyway() = hook;
}

/// Whether a hook listens (the callers skip the work of telling it).
pub fn fs_hooked() -> bool {
    FS_HOOKED.load(Ordering::Relaxed)
}

pub fn fs_event(event: FsEvent) {
    if fs_hooked() {
        if let Some(hook) = &*FS_HOOK.read_anyway() {
            hook(&event);
        }
    }
}

/// A sync of `file` done (`result`), told to the hook.
pub fn synced(file: &std::fs::File, result: std::io::Result<()>) -> std::io::Result<()> {
    let result = result.and_then(|()| io("sync"));
    if result.is_ok() {
        fs_event(FsEvent::SyncedFile { file });
    }
    result
}

// ---- A fault at every file operation ----
//
// Each file operation of the daemon's own (its staging folder and journal,
// a commit's writes, syncs and renames, recovery's reads) passes one of
// `io` or `io_best_effort` first. A fault runner (`tests/fault_runner.rs`)
// arms a count on its thread, runs a scenario once to learn how many
// operations it makes, then again failing the N-th, for every N (SQLite's
// I/O-error tests are the model). Operations on other threads (the
// background let-go of spent files) are not counted.

/// Whether a failed operation must reach the caller as an error
/// (`Reported`), or may be logged and passed over (`BestEffort`: removing
/// what is no longer needed, a cache of the kernel's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Reported,
    BestEffort,
}

/// The operations counted since `arm_io_faults`, and the one that failed.
#[derive(Debug, Default, Clone)]
pub struct IoCount {
    /// Operations counted (the failed one included).
    pub count: u64,
    /// The one that failed: its number, name and kind.
    pub fired: Option<(u64, &'static str, IoKind)>,
    /// The name of every operation counted, in order (the first 100,000).
    pub ops: Vec<&'static str>,
}

struct IoFaults {
    thread: std::thread::ThreadId,
    fail_at: Option<u64>,
    errno: i32,
    seen: IoCount,
}

static IO_ARMED: AtomicBool = AtomicBool::new(false);
static IO_FAULTS: Mutex<Option<IoFaults>> = Mutex::new(None);

/// Counts the file operations of this thread from now on, failing the
/// `fail_at`-th (from 1) with `errno`, if given.
pub fn arm_io_faults(fail_at: Option<u64>, errno: i32) {
    *IO_FAULTS.lock_anyway() = Some(IoFaults {
        thread: std::thread::current().id(),
        fail_at,
        errno,
        seen: IoCount::default(),
    });
    IO_ARMED.store(true, Ordering::SeqCst);
}

/// Stops counting; what was counted.
pub fn disarm_io_faults() -> IoCount {
    IO_ARMED.store(false, Ordering::SeqCst);
    IO_FAULTS
        .lock_anyway()
        .take()
        .map(|f| f.seen)
        .unwrap_or_default()
}

/// What was counted so far (the count goes on).
pub fn io_count() -> IoCount {
    IO_FAULTS
        .lock_anyway()
        .as_ref()
        .map(|f| f.seen.clone())
        .unwrap_or_default()
}

thread_local! {
    static PASSED_OVER: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// While held, this thread's file operations are ones whose failure may be
/// passed over (the work after a commit landed: a failure there costs room
/// or a later retry, never an edit).
pub struct BestEffort(());

pub fn best_effort() -> BestEffort {
    PASSED_OVER.with(|d| d.set(d.get() + 1));
    BestEffort(())
}

impl Drop for BestEffort {
    fn drop(&mut self) {
        PASSED_OVER.with(|d| d.set(d.get() - 1));
    }
}

fn io_op(op: &'static str, kind: IoKind) -> std::io::Result<()> {
    if !IO_ARMED.load(Ordering::Relaxed) {
        return Ok(());
    }
    let kind = match PASSED_OVER.with(|d| d.get()) {
        0 => kind,
        _ => IoKind::BestEffort,
    };
    let mut faults = IO_FAULTS.lock_anyway();
    let Some(f) = faults.as_mut() else {
        return Ok(());
    };
    if f.thread != std::thread::current().id() {
        return Ok(());
    }
    f.seen.count += 1;
    if f.seen.ops.len() < 100_000 {
        f.seen.ops.push(op);
    }
    if f.fail_at == Some(f.seen.count) {
        f.seen.fired = Some((f.seen.count, op, kind));
        warn!(
            "fault runner: failing file operation {} ({op})",
            f.seen.count
        );
        if std::env::var_os("STFS_FAULT_BACKTRACE").is_some() {
            warn!("at {}", std::backtrace::Backtrace::force_capture());
        }
        return Err(std::io::Error::from_raw_os_error(f.errno));
    }
    Ok(())
}

/// A file operation whose failure the caller must report.
pub fn io(op: &'static str) -> std::io::Result<()> {
    io_op(op, IoKind::Reported)
}

/// A file operation whose failure may be passed over (logged), never
/// losing anything: removing a spent file, a cache.
pub fn io_best_effort(op: &'static str) -> std::io::Result<()> {
    io_op(op, IoKind::BestEffort)
}

#[cfg(test)]
mod tests {
    use super::{Fault, parse_fault};

    #[test]
    fn faults_are_read_from_the_end() {
        let f = parse_fault;
        assert_eq!(
            f("in-place:write:EIO"),
            Some(("in-place:write".into(), libc::EIO, Fault::Nth(1)))
        );
        assert_eq!(
            f("in-place:write:5"),
            Some(("in-place:write".into(), 5, Fault::Nth(1)))
        );
        assert_eq!(
            f("rewrite:written:EIO:2"),
            Some(("rewrite:written".into(), libc::EIO, Fault::Nth(2)))
        );
        assert_eq!(
            f("in-place:write:5:3"),
            Some(("in-place:write".into(), 5, Fault::Nth(3)))
        );
        assert_eq!(
            f("a:ENOSPC:always"),
            Some(("a".into(), libc::ENOSPC, Fault::Always))
        );
        assert_eq!(f("a:NOPE"), None);
    }
}
