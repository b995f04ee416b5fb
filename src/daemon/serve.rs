//! Serving: the FUSE session mounted (directly as root, else through
//! fusermount3), run until unmounted, and what is left cleaned up.

use super::*;

/// Mounts and serves until unmounted (by `umount`, `stfs umount`, or a signal).
pub(super) fn serve(
    fs: Fs,
    req: &MountRequest,
    options: MountOptions,
    report: &[String],
    mut ready: Option<OwnedFd>,
) -> Result<(), crate::errno::Failure> {
    // The filesystem may be read-only where the options did not say so (a
    // GGUF source found to be one only once opened): the kernel mount too.
    let mut options = options;
    options.read_only |= fs.settings().read_only;
    for w in report {
        warn!("{w}");
    }
    // The pid file before the mount: refused (the mount with it) if it is
    // not a regular file of this user's; written once the mount answers.
    let pid_file = match &req.pid_file {
        Some(path) => match logging::open_private(path, false, true) {
            Ok(f) => Some((path.clone(), f)),
            Err(e) => {
                let msg = format!("--pid-file {e}");
                say(&mut ready, &msg);
                return Err(msg.into());
            }
        },
        None => None,
    };
    raise_open_files();
    let threads = req
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)));
    let mut mount_options = vec![
        MountOption::FSName(req.source.display().to_string()),
        MountOption::Subtype("stfs".into()),
        // The kernel enforces the modes and owners shown (the source's).
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    if options.read_only {
        mount_options.push(MountOption::RO);
    }
    mount_options.extend(options.kernel.iter().cloned());
    let mut config = Config::default();
    config.mount_options = mount_options;
    config.acl = options.acl;
    config.n_threads = Some(threads.max(1));

    // Signals are taken by one thread (below); every other thread has them
    // blocked (they were blocked before any was started).
    let signals = blocked_signals();
    let mut fs = fs;
    let as_root = rustix::process::geteuid().as_raw() == 0;
    let fd = if as_root {
        mount_direct(&req.mountpoint, &req.source, &options)
    } else {
        fusermount::mount(&req.mountpoint, &fusermount_options(&req.source, &options))
    };
    // A second descriptor of the connection, for the notifications that
    // take back what the kernel caches.
    if let Some(channel) = fd.as_ref().ok().and_then(|fd| fd.try_clone().ok()) {
        fs.set_kernel_cache(crate::fs::kernel_cache::KernelCache::new(channel));
    }
    let fs = Arc::new(fs);
    let adapter = FuseAdapter::new(fs.clone());
    let session =
        fd.and_then(|fd| fuser::Session::from_fd(adapter, fd, options.acl, config.clone()));
    let session = match session {
        Ok(s) => s,
        Err(e) => {
            let msg = format!(
                "cannot mount {} on {}: {e}",
                req.source.display(),
                req.mountpoint.display()
            );
            say(&mut ready, &msg);
            return Err(msg.into());
        }
    };
    raise_read_ahead(&req.mountpoint);
    // The pid, and what the pid file is, so that only that file is removed at exit.
    let pid_file = pid_file.and_then(|(path, mut f)| {
        if let Err(e) = writeln!(f, "{}", std::process::id()) {
            warn!("pid file {}: {e}", path.display());
        }
        FileStat::of(&f).ok().map(|st| (path, st))
    });
    info!(
        source = %req.source.display(),
        mountpoint = %req.mountpoint.display(),
        threads,
        read_only = options.read_only,
        cache = ?options.cache,
        "mounted"
    );
    let mut answer = String::from("ok\n");
    for line in report {
        answer.push_str(&format!("{}\n", line.replace('\n', " ")));
    }
    say(&mut ready, &answer);

    let mountpoint = req.mountpoint.clone();
    std::thread::Builder::new()
        .name("stfs-signals".into())
        .spawn(move || {
            let mut sig = 0;
            // SAFETY: signals is a valid, initialized set; sig an out-parameter.
            if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                info!(
                    signal = sig,
                    "unmounting {} on signal",
                    mountpoint.display()
                );
                let result = if as_root {
                    detach(&mountpoint)
                } else {
                    fusermount::unmount(&mountpoint, true)
                };
                if let Err(e) = result {
                    error!("unmount of {} failed: {e}", mountpoint.display());
                }
            }
        })
        .map_err(|e| e.to_string())?;

    let result = session.run();
    if let Some((path, written)) = pid_file {
        remove_if_same(&path, &written);
    }
    info!(mountpoint = %req.mountpoint.display(), "unmounted");
    result.map_err(|e| {
        format!(
            "FUSE session on {} ended with an error: {e}",
            req.mountpoint.display()
        )
        .into()
    })
}

/// Mounts as root: the filesystem type is `fuse.stfs`, so that the mount
/// table says what it is, and `default_permissions` is always on.
pub(super) fn mount_direct(
    mountpoint: &Path,
    source: &Path,
    options: &MountOptions,
) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;

    let dev = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")?;
    let (uid, gid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
    );
    let mut data = format!(
        "fd={},rootmode=40000,user_id={uid},group_id={gid},default_permissions",
        dev.as_raw_fd()
    );
    if options.acl != SessionACL::Owner {
        data.push_str(",allow_other");
    }
    use rustix::mount::MountFlags;
    let mut flags = MountFlags::NOSUID | MountFlags::NODEV;
    if options.read_only {
        flags |= MountFlags::RDONLY;
    }
    for k in &options.kernel {
        match k {
            MountOption::NoExec => flags |= MountFlags::NOEXEC,
            MountOption::NoAtime => flags |= MountFlags::NOATIME,
            _ => {}
        }
    }
    let data = std::ffi::CString::new(data)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    rustix::mount::mount(source, mountpoint, "fuse.stfs", flags, data.as_c_str())?;
    Ok(OwnedFd::from(dev))
}

/// Detaches a mount now; the session ends once its files are closed.
pub(super) fn detach(mountpoint: &Path) -> std::io::Result<()> {
    Ok(rustix::mount::unmount(
        mountpoint,
        rustix::mount::UnmountFlags::DETACH,
    )?)
}

/// Removes `path` if it is still the file `written` describes.
pub(super) fn remove_if_same(path: &Path, written: &FileStat) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    if let Ok(folder) = Folder::open(dir) {
        if folder
            .stat_at(name)
            .is_ok_and(|st| st.dev == written.dev && st.ino == written.ino)
        {
            folder.unlink_spent(name);
        }
    }
}

/// The kernel caps a FUSE mount's read-ahead at 128 KiB; root can raise it
/// through the mount's backing device info, which makes buffered reads
/// arrive as 1 MiB requests (../shared/PERF-NOTES.md). The log says what changed.
pub(super) fn raise_read_ahead(mountpoint: &Path) {
    // The mount's device number comes from mountinfo: a stat of the mount point
    // would be a FUSE request, and nothing serves requests yet.
    let Some(dev) = crate::mountinfo::mount_at(mountpoint).map(|m| m.device) else {
        info!(
            "read-ahead left at the kernel default: {} not found in mountinfo",
            mountpoint.display()
        );
        return;
    };
    let knob = format!("/sys/class/bdi/{dev}/read_ahead_kb");
    let before = std::fs::read_to_string(&knob).unwrap_or_default();
    match std::fs::write(&knob, "1024") {
        Ok(()) => info!(
            "read-ahead of this mount raised from {} to 1024 KiB ({knob})",
            before.trim()
        ),
        Err(e) => info!("read-ahead left at the kernel default: {knob}: {e}"),
    }
}
