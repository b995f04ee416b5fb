//! The client side of the ioctls: `stfs commit`, `stfs umount`, `stfs prefetch`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::fs::ioctl::{PrefetchArgs, IOC_PREFETCH, TARGET_CUDA, TARGET_PAGE_CACHE};

/// Sends STFS_IOC_COMMIT to a mount; returns the daemon's message.
pub fn commit(path: &Path, flags: u32) -> Result<String, String> {
    use crate::fs::ioctl::{CommitArgs, IOC_COMMIT};
    let dir = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut args = CommitArgs::new(flags);
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let progress = show_progress(path, done.clone());
    // SAFETY: args is a properly sized, writable CommitArgs, as IOC_COMMIT encodes.
    let rc = unsafe {
        libc::ioctl(
            dir.as_raw_fd(),
            IOC_COMMIT as _,
            &mut args as *mut CommitArgs,
        )
    };
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(p) = progress {
        let _ = p.join();
    }
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOTTY | libc::ENOSYS) => format!("{}: not a stfs mount", path.display()),
            _ => format!("{}: {e}", path.display()),
        });
    }
    if args.result != 0 {
        return Err(args.message());
    }
    Ok(args.message())
}

/// On a terminal, shows how much of the new file the daemon has written: the
/// commit's temp file sits beside the source that the mount table names.
fn show_progress(
    path: &Path,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Option<std::thread::JoinHandle<()>> {
    use std::io::IsTerminal;
    use std::sync::atomic::Ordering;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let source = crate::mountinfo::mount_holding(path)
        .filter(|m| m.fstype.starts_with("fuse"))
        .map(|m| PathBuf::from(m.source))?;
    let dir = source.parent()?.to_path_buf();
    let prefix = format!(".{}.stfs-tmp-", source.file_name()?.to_string_lossy());
    let total = std::fs::metadata(&source)
        .map(|m| m.len())
        .unwrap_or(0)
        .max(1);
    std::thread::Builder::new()
        .spawn(move || {
            let mut shown = false;
            let start = std::time::Instant::now();
            while !done.load(Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(200));
                let written: u64 = std::fs::read_dir(&dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                    .filter_map(|e| e.metadata().ok().map(|m| m.len()))
                    .sum();
                if written > 0 && start.elapsed().as_millis() > 500 {
                    eprint!(
                        "\rstfs: committing {}: {} MiB written (~{}%)   ",
                        source.display(),
                        written >> 20,
                        written * 100 / total
                    );
                    shown = true;
                }
            }
            if shown {
                eprintln!();
            }
        })
        .ok()
}

/// Where `stfs prefetch` puts tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(i32),
}

pub fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "cpu" => Ok(Device::Cpu),
        _ => s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse().ok())
            .map(Device::Cuda)
            .ok_or_else(|| format!("{s:?} is not cpu or cuda:N")),
    }
}

/// Prefetches one tensor file; returns a line saying what was done.
pub fn prefetch(path: &Path, device: Device) -> Result<String, String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut args = match device {
        Device::Cpu => PrefetchArgs::new(TARGET_PAGE_CACHE, 0),
        Device::Cuda(n) => PrefetchArgs::new(TARGET_CUDA, n),
    };
    let started = std::time::Instant::now();
    // SAFETY: args is a properly sized, writable PrefetchArgs, as IOC_PREFETCH encodes.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            IOC_PREFETCH as _,
            &mut args as *mut PrefetchArgs,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENOTTY | libc::ENOSYS) => {
                format!("{}: not a file of a stfs mount", path.display())
            }
            _ => format!("{}: {e}", path.display()),
        });
    }
    if args.result != 0 {
        return Err(format!(
            "{}: {} ({})",
            path.display(),
            args.message(),
            std::io::Error::from_raw_os_error(args.result)
        ));
    }
    let secs = (args.elapsed_ns as f64 / 1e9).max(1e-9);
    let wall = started.elapsed().as_secs_f64();
    let what = match device {
        Device::Cpu => format!(
            "{} of {} bytes resident in the page cache",
            args.bytes, args.nbytes
        ),
        Device::Cuda(n) => format!("{} bytes copied to cuda:{n}", args.bytes),
    };
    Ok(format!(
        "{}: {what} in {:.3} s ({:.2} GB/s; {:.3} s with the request)",
        path.display(),
        secs,
        args.bytes as f64 / secs / 1e9,
        wall
    ))
}

/// Expands directories to the tensor files in them (skipping `*.meta.json`,
/// `__metadata__.json` and index files), recursively for folder mounts. Files
/// named on the command line are kept as they are.
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
                e.is_dir()
                    || !(name.ends_with(".meta.json")
                        || name == "__metadata__.json"
                        || name.ends_with(".index.json"))
            });
            out.extend(tensor_files(&entries));
        } else {
            out.push(p.clone());
        }
    }
    out
}
