//! The client side: `stfs commit`, `stfs umount`, `stfs status` and
//! `stfs prefetch`, which talk to a mount's daemon through ioctls.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::fs::ioctl::{
    COMMIT_DISCARD, CommitArgs, DaemonArgs, IOC_COMMIT, IOC_DAEMON, IOC_LOAD, IOC_PREFETCH,
    IOC_PROGRESS, IOC_STATUS, LOAD_NAMES, LOAD_POLL, LOAD_START, LoadArgs, PrefetchArgs,
    ProgressArgs, STATUS_JSON, StatusArgs, TARGET_CUDA, TARGET_HOST, TARGET_PAGE_CACHE,
};

/// Why a request to a mount failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The path is not in a stfs mount.
    #[error("{}: not in a stfs mount", .0.display())]
    NotStfs(PathBuf),
    /// The mount's daemon is gone.
    #[error(
        "{}: the stfs daemon of this mount is gone; `stfs umount {}` cleans it up \
         (staged edits are kept and taken back by the next mount, which also finishes or \
         undoes a commit it was making)",
        .0.display(),
        .0.display()
    )]
    Dead(PathBuf),
    /// The daemon answered with an errno and a message.
    #[error("{message}")]
    Refused { errno: i32, message: String },
    #[error("{}: {}", .0.display(), .1)]
    Io(PathBuf, #[source] std::io::Error),
    #[error("{0}")]
    Other(String),
}

crate::failure_from!(ClientError);

impl crate::errno::ToErrno for ClientError {
    /// What the command met: the daemon's own errno where it answered.
    fn to_errno(&self) -> i32 {
        match self {
            ClientError::NotStfs(_) => libc::ENOTTY,
            ClientError::Dead(_) => libc::ENOTCONN,
            ClientError::Refused { errno, .. } => *errno,
            ClientError::Io(_, e) => e.to_errno(),
            ClientError::Other(_) => libc::EIO,
        }
    }
}

fn open(path: &Path) -> Result<File, ClientError> {
    File::open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ENOTCONN | libc::ECONNABORTED) => ClientError::Dead(path.to_path_buf()),
        _ => ClientError::Io(path.to_path_buf(), e),
    })
}

/// Sends an ioctl with a struct the daemon fills in.
fn ioctl<T>(file: &File, path: &Path, cmd: u32, args: &mut T) -> Result<(), ClientError> {
    // SAFETY: args is a properly sized, writable struct of the size `cmd` encodes.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), cmd as _, args as *mut T) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    Err(match e.raw_os_error() {
        Some(libc::ENOTTY | libc::ENOSYS | libc::EINVAL) => {
            ClientError::NotStfs(path.to_path_buf())
        }
        // (ECONNABORTED: the daemon died while it served this request.)
        Some(libc::ENOTCONN | libc::ECONNABORTED) => ClientError::Dead(path.to_path_buf()),
        _ => ClientError::Io(path.to_path_buf(), e),
    })
}

/// Sends STFS_IOC_COMMIT (with COMMIT_FORCE or COMMIT_DISCARD); returns the
/// daemon's message.
pub fn commit(path: &Path, flags: u32) -> Result<String, ClientError> {
    let dir = open(path)?;
    let mut args = CommitArgs::new(flags);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let progress = show_progress(path, done.clone());
    let result = ioctl(&dir, path, IOC_COMMIT, &mut args);
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(p) = progress {
        let _ = p.join();
    }
    result?;
    if args.result != 0 {
        return Err(ClientError::Refused {
            errno: args.result,
            message: args.message(),
        });
    }
    Ok(args.message())
}

/// `stfs status`: the report (as JSON with `json`), and whether a commit
/// would be refused.
pub fn status(path: &Path, json: bool) -> Result<(String, bool), ClientError> {
    let file = open(path)?;
    let mut report = String::new();
    let flags = if json { STATUS_JSON } else { 0 };
    // Each page is cut from the report as it is then: one that changed
    // length between pages is asked for again from its start, so that
    // pages of two reports are never joined (a few times at most).
    let mut length = None;
    let mut restarts = 0;
    loop {
        let mut args = StatusArgs::new(report.len() as u64, flags);
        ioctl(&file, path, IOC_STATUS, &mut *args)?;
        if args.result != 0 {
            return Err(ClientError::Refused {
                errno: args.result,
                message: args.page(),
            });
        }
        if length.is_some_and(|n| n != args.total) && restarts < 5 {
            (report, length, restarts) = (String::new(), None, restarts + 1);
            continue;
        }
        length = Some(args.total);
        let page = args.page();
        report.push_str(&page);
        if page.is_empty() || report.len() as u64 >= args.total {
            return Ok((report, args.refused != 0));
        }
    }
}

/// On a terminal, shows how much of the new file the daemon has written,
/// asking the mount (STFS_IOC_PROGRESS) until `done` is set.
fn show_progress(
    path: &Path,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Option<std::thread::JoinHandle<()>> {
    use std::sync::atomic::Ordering;
    if !crate::progress::on_terminal() {
        return None;
    }
    let file = open(path).ok()?;
    let path = path.to_path_buf();
    std::thread::Builder::new()
        .spawn(move || {
            let mut bar: Option<indicatif::ProgressBar> = None;
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let mut args = ProgressArgs::default();
                if ioctl(&file, &path, IOC_PROGRESS, &mut args).is_err() {
                    break;
                }
                if args.active == 0 {
                    continue;
                }
                let file = args.file();
                let name = Path::new(&file).file_name().unwrap_or_default();
                let what = format!("committing {}", name.to_string_lossy());
                let bar = bar.get_or_insert_with(|| crate::progress::bytes(args.total, &what));
                bar.set_length(args.total);
                bar.set_message(what);
                bar.set_position(args.done);
            }
            if let Some(bar) = bar {
                crate::progress::clear(bar);
            }
        })
        .ok()
}

/// `stfs umount`: commits the staged edits (or drops them with `discard`),
/// then unmounts; as a normal user through fusermount3. It refuses anything
/// that is not a stfs mount; a mount whose daemon died is cleaned up. A
/// failed commit leaves the mount and its edits in place. Returns the lines
/// to print.
pub fn umount(
    mountpoint: &Path,
    lazy: bool,
    discard: bool,
) -> Result<Vec<String>, crate::errno::Failure> {
    let shown = mountpoint.display();
    let abs = std::path::absolute(mountpoint).map_err(|e| format!("{shown}: {e}"))?;
    let Some(m) = crate::mountinfo::mount_at(&abs) else {
        return Err(match std::fs::symlink_metadata(&abs) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                format!("{shown}: no such file or folder").into()
            }
            _ => format!("{shown}: not a mount point").into(),
        });
    };
    if m.fstype != "fuse.stfs" {
        return Err(format!(
            "{shown} is a {} mount, not a stfs mount: stfs umount leaves it alone",
            m.fstype
        )
        .into());
    }
    let mut lines = Vec::new();
    let gone = |lines: &mut Vec<String>| -> Result<(), crate::errno::Failure> {
        // Nothing can be served any more: a program that still holds a file
        // of it must not keep the dead mount in place.
        unmount(&abs, true)?;
        // (A remote source's edits are in the cache folder, not beside it.)
        let kept = match crate::source::remote::is_url(&m.source) {
            true => "in the cache folder's edits/",
            false => "beside it (or in its --staging-dir)",
        };
        lines.push(format!(
            "{}: its daemon was gone; unmounted. Staged edits of {}, if any, are kept {kept} \
             and taken back by the next `stfs mount`",
            abs.display(),
            m.source
        ));
        Ok(())
    };
    if crate::daemon::dead(&abs) {
        gone(&mut lines)?;
        return Ok(lines);
    }
    // The daemon, to wait for once unmounted (None: it cannot be told).
    let daemon = daemon_of(&abs);
    match commit(&abs, if discard { COMMIT_DISCARD } else { 0 }) {
        Ok(message) => lines.extend(
            message
                .lines()
                .filter(|l| !l.ends_with("nothing to commit"))
                .map(str::to_string),
        ),
        Err(ClientError::Dead(_)) => {
            gone(&mut lines)?;
            return Ok(lines);
        }
        // Lost a race with another commit or discard, which did what it did:
        // say so, and unmount as asked.
        Err(ClientError::Refused {
            errno: libc::ECANCELED,
            message,
        }) => {
            unmount(&abs, lazy)?;
            return Err(format!("{message}\nstfs: {} unmounted", abs.display()).into());
        }
        Err(e) if e.to_string().contains("commits no more") => {
            return Err(format!(
                "{e}\nstfs: {} is still mounted: unmount it with `umount {}` (its staged edits \
                 stay on disk) and mount the source again with stfs",
                abs.display(),
                abs.display()
            )
            .into());
        }
        Err(e) => {
            return Err(format!(
                "{e}\nstfs: {} is still mounted with its edits staged: fix them (stfs status lists \
                 the problems) and run stfs umount again, or drop them with stfs umount --discard",
                abs.display()
            )
            .into());
        }
    }
    if let Err(e) = unmount(&abs, lazy) {
        // (Busy, most likely: the commit or discard is done all the same.)
        let done = match discard {
            true => "the staged edits were dropped already",
            false if lines.is_empty() => "nothing was staged",
            false => "the edits above are committed already",
        };
        lines.push(format!(
            "{e}\nstfs: {done}; {} stays mounted",
            abs.display()
        ));
        return Err(lines.join("\n").into());
    }
    if let Some(pidfd) = daemon.filter(|_| !lazy) {
        wait_for_exit(&pidfd, &abs, &mut lines);
    }
    Ok(lines)
}

/// How long `stfs umount` waits for the daemon to exit once unmounted (it
/// removes its staging folder and closes its log).
const DAEMON_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// A pidfd of the daemon serving `mountpoint` (no pid reuse can fool it).
fn daemon_of(mountpoint: &Path) -> Option<std::os::fd::OwnedFd> {
    let file = open(mountpoint).ok()?;
    let mut args = DaemonArgs::new();
    ioctl(&file, mountpoint, IOC_DAEMON, &mut args).ok()?;
    let pid = rustix::process::Pid::from_raw(args.pid as i32)?;
    rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
}

/// Waits until the daemon has exited; says so if it does not in time.
fn wait_for_exit(pidfd: &std::os::fd::OwnedFd, mountpoint: &Path, lines: &mut Vec<String>) {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(pidfd, PollFlags::IN)];
    let timeout = Timespec {
        tv_sec: DAEMON_EXIT_WAIT.as_secs() as i64,
        tv_nsec: 0,
    };
    // (A pidfd is readable once its process has exited.)
    if !matches!(poll(&mut fds, Some(&timeout)), Ok(1..)) {
        lines.push(format!(
            "{}: unmounted; its daemon is still finishing after {} s (its log says why)",
            mountpoint.display(),
            DAEMON_EXIT_WAIT.as_secs()
        ));
    }
}

/// Unmounts; as a normal user through fusermount3.
fn unmount(mountpoint: &Path, lazy: bool) -> Result<(), crate::errno::Failure> {
    use rustix::mount::UnmountFlags;
    let flags = if lazy {
        UnmountFlags::DETACH
    } else {
        UnmountFlags::empty()
    };
    let Err(err) = rustix::mount::unmount(mountpoint, flags) else {
        return Ok(());
    };
    let err = std::io::Error::from(err);
    let busy = || {
        format!(
            "{}: busy (files are open in it, or a shell is in it); close them, or unmount lazily with --lazy",
            mountpoint.display()
        )
        .into()
    };
    match err.raw_os_error() {
        // (fusermount3 says EBUSY only in words.)
        Some(libc::EPERM) => {
            crate::daemon::fusermount_unmount(mountpoint, lazy).map_err(|e| {
                match e.to_string().ends_with(": Device or resource busy") {
                    true => busy(),
                    false => format!("{}: fusermount3 -u: {e}", mountpoint.display()).into(),
                }
            })
        }
        Some(libc::EBUSY) => Err(busy()),
        _ => Err(format!("{}: {err}", mountpoint.display()).into()),
    }
}

/// Where `stfs prefetch` puts tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
    /// The load pipeline into the daemon's own memory (tests, benchmarks).
    Host,
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "the page cache"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
            Device::Host => write!(f, "host memory"),
        }
    }
}

pub fn parse_device(s: &str) -> Result<Device, crate::errno::Failure> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "host" => Ok(Device::Host),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("{s:?} is not cpu or cuda:N").into()),
    }
}

/// Prefetches one tensor file; returns a line saying what was done. Into the
/// page cache it asks for a range at a time (each answer comes within a few
/// seconds), so that the command can be interrupted; `advanced` is told the
/// bytes of each range done.
pub fn prefetch(
    path: &Path,
    device: Device,
    advanced: &dyn Fn(u64),
) -> Result<String, ClientError> {
    let file = open(path)?;
    let started = std::time::Instant::now();
    let (mut offset, mut resident, mut daemon_ns) = (0u64, 0u64, 0u64);
    loop {
        let mut args = match device {
            Device::Cpu | Device::Host => PrefetchArgs::new(TARGET_PAGE_CACHE, 0),
            Device::Cuda(n) => PrefetchArgs::new(TARGET_CUDA, n),
        };
        args.offset = offset;
        ioctl(&file, path, IOC_PREFETCH, &mut args)?;
        if args.result != 0 {
            return Err(ClientError::Refused {
                errno: args.result,
                message: format!(
                    "{}: {} ({})",
                    path.display(),
                    args.message(),
                    std::io::Error::from_raw_os_error(args.result)
                ),
            });
        }
        resident += args.bytes;
        daemon_ns += args.elapsed_ns;
        advanced(match device {
            Device::Cuda(_) => args.nbytes,
            Device::Cpu | Device::Host => args.next.saturating_sub(offset),
        });
        let secs = (daemon_ns as f64 / 1e9).max(1e-9);
        let what = match device {
            Device::Cuda(n) => format!("{} bytes copied to cuda:{n}", args.bytes),
            Device::Host => unreachable!("a load, not a prefetch"),
            Device::Cpu if args.next < args.nbytes && args.next > offset => {
                offset = args.next;
                continue;
            }
            Device::Cpu if args.next < args.nbytes => {
                return Err(ClientError::Other(format!(
                    "{}: prefetch made no progress at byte {offset}",
                    path.display()
                )));
            }
            Device::Cpu => format!(
                "{resident} of {} bytes resident in the page cache",
                args.nbytes
            ),
        };
        if resident == 0 && args.nbytes > 0 {
            return Err(ClientError::Other(format!(
                "{}: {what}: nothing was brought in",
                path.display()
            )));
        }
        return Ok(format!(
            "{}: {what} in {:.3} s ({:.2} GB/s; {:.3} s with the requests)",
            path.display(),
            secs,
            resident as f64 / secs / 1e9,
            started.elapsed().as_secs_f64()
        ));
    }
}

/// Loads tensors of the mount `path` is in onto `device` in one load
/// (STFS_IOC_LOAD): `names`, or every tensor of the mount; waits until they
/// have landed, telling `landed` the bytes that have and of how many, and frees them
/// (a measure and a check: a program keeps its load with stfs.cuda).
pub fn load(
    path: &Path,
    device: Device,
    names: &[String],
    landed: &dyn Fn(u64, u64),
) -> Result<String, ClientError> {
    let (target, ordinal) = match device {
        Device::Cuda(n) => (TARGET_CUDA, n),
        Device::Host => (TARGET_HOST, 0),
        Device::Cpu => return Err(ClientError::Other("a load goes to a device".into())),
    };
    let file = open(path)?;
    let started = std::time::Instant::now();
    for page in name_pages(names) {
        let mut a = LoadArgs::new(LOAD_NAMES);
        a.text[..page.len()].copy_from_slice(&page);
        ask_load(&file, path, &mut a)?;
    }
    let mut a = LoadArgs::new(LOAD_START);
    (a.target, a.device) = (target, ordinal);
    ask_load(&file, path, &mut a)?;
    let id = a.id;
    loop {
        landed(a.landed_bytes, a.bytes);
        if a.done != 0 {
            break;
        }
        a = LoadArgs::new(LOAD_POLL);
        (a.id, a.wait_ms) = (id, 200);
        ask_load(&file, path, &mut a)?;
    }
    let secs = (a.elapsed_ns as f64 / 1e9).max(1e-9);
    Ok(format!(
        "{}: {} tensors, {} bytes loaded into {device} in {secs:.3} s ({:.2} GB/s; {:.3} s with the requests)",
        path.display(),
        a.tensors,
        a.bytes,
        a.bytes as f64 / secs / 1e9,
        started.elapsed().as_secs_f64()
    ))
}

/// Sends a load request; the daemon's refusal as an error.
fn ask_load(file: &File, path: &Path, a: &mut LoadArgs) -> Result<(), ClientError> {
    ioctl(file, path, IOC_LOAD, a)?;
    if a.result != 0 {
        return Err(ClientError::Refused {
            errno: a.result,
            message: format!(
                "{}: {} ({})",
                path.display(),
                a.text(),
                std::io::Error::from_raw_os_error(a.result)
            ),
        });
    }
    Ok(())
}

/// Names as the daemon takes them: NUL-terminated, in pages that fit a request.
fn name_pages(names: &[String]) -> Vec<Vec<u8>> {
    let mut pages: Vec<Vec<u8>> = Vec::new();
    for name in names {
        let fits = pages
            .last()
            .is_some_and(|p| p.len() + name.len() + 1 < crate::fs::ioctl::LOAD_TEXT_LEN);
        if !fits {
            pages.push(Vec::new());
        }
        let page = pages.last_mut().expect("pushed");
        page.extend_from_slice(name.as_bytes());
        page.push(0);
    }
    pages
}

/// Expands directories to the tensor files in them (skipping `*.meta.json`,
/// `__metadata__.json`, index files and a GGUF file's `__kv__`), recursively
/// for folder mounts. Files named on the command line are kept as they are.
pub fn tensor_files(paths: &[PathBuf]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect();
            entries.sort();
            entries.retain(|e| {
                let name = e.file_name().unwrap_or_default().to_string_lossy();
                if e.is_dir() {
                    // (A GGUF file's keys; a shard's folder of that name has
                    // its __metadata__.json.)
                    return name != crate::fs::names::KV_DIR
                        || e.join(crate::fs::names::METADATA_FILE).exists();
                }
                !(name.ends_with(crate::fs::TensorFile::Meta.suffix())
                    || name == crate::fs::names::METADATA_FILE
                    || name.ends_with(".index.json"))
            });
            out.extend(tensor_files(&entries));
        } else {
            out.push(p.clone());
        }
    }
    out
}
