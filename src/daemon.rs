//! `stfs mount` and `stfs umount`: validate the source, daemonize with a
//! readiness pipe, serve the FUSE session, unmount cleanly on signals.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use fuser::{Config, MountOption, SessionACL};
use tracing::{error, info, warn};

use crate::checkpoint::Checkpoint;
use crate::format::{index, Header};
use crate::fs::fuse::FuseAdapter;
use crate::fs::{Fs, Settings, Source};
use crate::inspect::list_dir;

/// Everything `stfs mount` was asked for.
#[derive(Debug, Clone)]
pub struct MountRequest {
    pub source: PathBuf,
    pub mountpoint: PathBuf,
    pub foreground: bool,
    pub options: Vec<String>,
    pub threads: Option<usize>,
    pub log_file: Option<PathBuf>,
    pub pid_file: Option<PathBuf>,
    pub staging_dir: Option<PathBuf>,
    pub resume: Option<PathBuf>,
}

/// Parsed `-o` options.
#[derive(Debug, Default, Clone)]
struct MountOptions {
    read_only: bool,
    acl: SessionACL,
    kernel: Vec<MountOption>,
}

fn parse_options(list: &[String]) -> Result<MountOptions, String> {
    let mut o = MountOptions::default();
    for opt in list
        .iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
    {
        match opt {
            "ro" => o.read_only = true,
            "rw" => o.read_only = false,
            "allow_other" => o.acl = SessionACL::All,
            "allow_root" => o.acl = SessionACL::RootAndOwner,
            "default_permissions" => o.kernel.push(MountOption::DefaultPermissions),
            "nodev" => o.kernel.push(MountOption::NoDev),
            "nosuid" => o.kernel.push(MountOption::NoSuid),
            "noexec" => o.kernel.push(MountOption::NoExec),
            "noatime" => o.kernel.push(MountOption::NoAtime),
            other => {
                return Err(format!(
                    "unknown mount option {other:?} (known: ro, rw, allow_other, allow_root, \
                     default_permissions, nodev, nosuid, noexec, noatime)"
                ))
            }
        }
    }
    Ok(o)
}

/// Opens and validates what is to be mounted. Index problems are warnings:
/// the shards themselves are valid, and the index is shown as it is.
pub fn open_source(path: &Path) -> Result<(Source, Vec<String>), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_dir() {
        return Ok((Source::File(Checkpoint::open(path)?), Vec::new()));
    }
    let listing = list_dir(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if listing.checkpoints.is_empty() {
        return Err(format!(
            "{}: no *.safetensors files in this folder",
            path.display()
        ));
    }
    let mut checkpoints = Vec::new();
    for (name, file) in &listing.checkpoints {
        let stem = name
            .strip_suffix(".safetensors")
            .unwrap_or(name)
            .to_string();
        checkpoints.push((stem, Checkpoint::open(file)?));
    }
    let mut indexes = Vec::new();
    let mut warnings = Vec::new();
    let shards: BTreeMap<String, &Header> = listing
        .checkpoints
        .iter()
        .zip(&checkpoints)
        .map(|((file, _), (_, c))| (file.clone(), c.header()))
        .collect();
    for ix in &listing.indexes {
        let bytes = std::fs::read(ix).map_err(|e| format!("{}: {e}", ix.display()))?;
        let problems = match index::parse_index(&bytes) {
            Ok(parsed) => index::check_index(&parsed, &shards),
            Err(e) => vec![e],
        };
        warnings.extend(
            problems
                .into_iter()
                .map(|p| format!("{}: {p}", ix.display())),
        );
        let name = ix
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        indexes.push((name, bytes));
    }
    Ok((
        Source::Folder {
            checkpoints,
            indexes,
        },
        warnings,
    ))
}

pub fn mount(req: MountRequest) -> Result<(), String> {
    let options = parse_options(&req.options)?;
    let (source, warnings) = open_source(&req.source)?;
    for w in &warnings {
        eprintln!("stfs: warning: {w}");
    }
    if !req.mountpoint.is_dir() {
        return Err(format!(
            "{}: mount point is not a directory",
            req.mountpoint.display()
        ));
    }
    if req.foreground {
        init_logging(req.log_file.as_deref(), true)?;
        return serve(source, &req, options, &warnings, None);
    }
    daemonize(source, &req, options, &warnings)
}

/// Forks; the child serves the mount and reports through a pipe once the mount
/// answers (or why it failed); the parent returns only then. Must be called
/// before any thread is started.
fn daemonize(
    source: Source,
    req: &MountRequest,
    options: MountOptions,
    warnings: &[String],
) -> Result<(), String> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: pipe2 returned two fresh descriptors that we now own.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: stfs has started no threads yet, so the child may run Rust code freely.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error())),
        0 => {
            drop(read_end);
            // SAFETY: plain syscalls in the child.
            unsafe { libc::setsid() };
            detach_stdio();
            let code = match init_logging(req.log_file.as_deref(), false)
                .and_then(|()| serve(source, req, options, warnings, Some(write_end)))
            {
                Ok(()) => 0,
                Err(e) => {
                    error!("{e}");
                    1
                }
            };
            std::process::exit(code);
        }
        _child => {
            drop(write_end);
            // The parent only waits and exits: skip freeing a large header.
            std::mem::forget(source);
            let mut answer = String::new();
            File::from(read_end)
                .read_to_string(&mut answer)
                .map_err(|e| format!("waiting for the daemon: {e}"))?;
            match answer.strip_prefix("ok") {
                Some(_) => Ok(()),
                None if answer.is_empty() => {
                    Err("the daemon exited before the mount was ready (see its log)".into())
                }
                None => Err(answer.trim_end().to_string()),
            }
        }
    }
}

fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        use std::os::fd::AsRawFd;
        for fd in 0..3 {
            // SAFETY: replacing the standard descriptors with /dev/null.
            unsafe { libc::dup2(null.as_raw_fd(), fd) };
        }
    }
}

/// Where the daemon logs when no --log-file is given.
pub fn default_log_file() -> PathBuf {
    // SAFETY: getuid cannot fail.
    std::env::temp_dir().join(format!("stfs-{}.log", unsafe { libc::getuid() }))
}

fn init_logging(log_file: Option<&Path>, foreground: bool) -> Result<(), String> {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,fuser=error"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_thread_names(true);
    let path = match (log_file, foreground) {
        (Some(p), _) => p.to_path_buf(),
        (None, true) => {
            let _ = builder.with_writer(std::io::stderr).try_init();
            return Ok(());
        }
        (None, false) => default_log_file(),
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(|e| format!("log file {}: {e}", path.display()))?;
    // A daemon's stderr is /dev/null: panics must reach the log too.
    std::panic::set_hook(Box::new(|info| {
        error!(
            "panic: {info}\n{}",
            std::backtrace::Backtrace::force_capture()
        );
    }));
    let _ = builder
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .try_init();
    Ok(())
}

fn report(ready: &mut Option<OwnedFd>, message: &str) {
    if let Some(fd) = ready.take() {
        let _ = File::from(fd).write_all(message.as_bytes());
    }
}

/// Mounts and serves until unmounted (by `umount`, `stfs umount`, or a signal).
fn serve(
    source: Source,
    req: &MountRequest,
    options: MountOptions,
    warnings: &[String],
    mut ready: Option<OwnedFd>,
) -> Result<(), String> {
    for w in warnings {
        warn!("{w}");
    }
    // SAFETY: getuid/getgid cannot fail.
    let settings = Settings {
        read_only: options.read_only,
        uid: unsafe { libc::getuid() },
        gid: unsafe { libc::getgid() },
        staging_dir: req.staging_dir.clone(),
        resume: req.resume.clone(),
    };
    let threads = req
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)));
    let mut mount_options = vec![
        MountOption::FSName(req.source.display().to_string()),
        MountOption::Subtype("stfs".into()),
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

    // Signals are taken by one thread (below): block them before fuser starts its threads.
    let signals = blocked_signals();
    let built = std::time::Instant::now();
    let fs = match Fs::with_resume(source, settings) {
        Ok(fs) => fs,
        Err(msg) => {
            report(&mut ready, &msg);
            return Err(msg);
        }
    };
    info!(elapsed = ?built.elapsed(), "filesystem state built");
    // SAFETY: geteuid cannot fail.
    let as_root = unsafe { libc::geteuid() } == 0;
    let session = if as_root {
        fuser::Session::new(FuseAdapter::new(fs), &req.mountpoint, &config)
    } else {
        // fuser opens /dev/fuse itself before it tries fusermount, which fails
        // where /dev/fuse is not world-accessible: ask fusermount3 directly.
        mount_with_fusermount(&req.mountpoint, &fusermount_options(&req.source, &options)).and_then(
            |fd| fuser::Session::from_fd(FuseAdapter::new(fs), fd, options.acl, config.clone()),
        )
    };
    let mut session = match session {
        Ok(s) => s,
        Err(e) => {
            let msg = format!(
                "cannot mount {} on {}: {e}",
                req.source.display(),
                req.mountpoint.display()
            );
            report(&mut ready, &msg);
            return Err(msg);
        }
    };
    raise_read_ahead(&req.mountpoint);
    if let Some(pid_file) = &req.pid_file {
        if let Err(e) = std::fs::write(pid_file, format!("{}\n", std::process::id())) {
            warn!("pid file {}: {e}", pid_file.display());
        }
    }
    info!(
        source = %req.source.display(),
        mountpoint = %req.mountpoint.display(),
        threads,
        read_only = options.read_only,
        "mounted"
    );
    report(&mut ready, "ok\n");

    let mut unmounter = session.unmount_callable();
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
                    unmounter.unmount()
                } else {
                    fusermount_unmount(&mountpoint, true)
                };
                if let Err(e) = result {
                    error!("unmount of {} failed: {e}", mountpoint.display());
                }
            }
        })
        .map_err(|e| e.to_string())?;

    let result = session.run();
    if let Some(pid_file) = &req.pid_file {
        let _ = std::fs::remove_file(pid_file);
    }
    info!(mountpoint = %req.mountpoint.display(), "unmounted");
    result.map_err(|e| {
        format!(
            "FUSE session on {} ended with an error: {e}",
            req.mountpoint.display()
        )
    })
}

/// `-o` for fusermount3: it adds nosuid and nodev itself.
fn fusermount_options(source: &Path, options: &MountOptions) -> String {
    let mut o = vec![
        format!("fsname={}", source.display().to_string().replace(',', "_")),
        "subtype=stfs".into(),
    ];
    o.push(if options.read_only { "ro" } else { "rw" }.into());
    match options.acl {
        SessionACL::All | SessionACL::RootAndOwner => o.push("allow_other".into()),
        SessionACL::Owner => {}
    }
    for k in &options.kernel {
        if *k == MountOption::DefaultPermissions {
            o.push("default_permissions".into());
        }
    }
    o.join(",")
}

/// Mounts through the setuid fusermount3, which passes back the /dev/fuse
/// descriptor over a socket (the libfuse protocol: `_FUSE_COMMFD`, SCM_RIGHTS).
fn mount_with_fusermount(mountpoint: &Path, options: &str) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let mut sv = [0; 2];
    // SAFETY: sv is a valid out-array of two ints.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, sv.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two fresh descriptors that we now own.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    // Only fusermount3's end may be inherited.
    // SAFETY: setting a descriptor flag on our own fd.
    unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    let output = std::process::Command::new("fusermount3")
        .env("_FUSE_COMMFD", theirs.as_raw_fd().to_string())
        .arg("-o")
        .arg(options)
        .arg("--")
        .arg(mountpoint)
        .output()
        .map_err(|e| std::io::Error::new(e.kind(), format!("fusermount3: {e}")))?;
    drop(theirs);
    if !output.status.success() {
        return Err(std::io::Error::other(format!(
            "fusermount3: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    receive_fd(&ours)
}

/// Receives one descriptor sent with SCM_RIGHTS.
fn receive_fd(socket: &OwnedFd) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for one cmsghdr carrying one int, suitably aligned.
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; zeroed is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a pure size computation.
    msg.msg_controllen =
        unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    loop {
        // SAFETY: msg points at live buffers of the sizes it states.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n > 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if n < 0 && e.kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        return Err(if n == 0 {
            std::io::Error::other("fusermount3 sent no descriptor")
        } else {
            e
        });
    }
    // SAFETY: msg was filled by recvmsg; CMSG_* walk its control buffer.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null()
            || (*cmsg).cmsg_level != libc::SOL_SOCKET
            || (*cmsg).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(std::io::Error::other("fusermount3 sent no descriptor"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::c_int);
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

fn fusermount_unmount(mountpoint: &Path, lazy: bool) -> std::io::Result<()> {
    let mut cmd = std::process::Command::new("fusermount3");
    cmd.arg("-u");
    if lazy {
        cmd.arg("-z");
    }
    let out = cmd.arg("--").arg(mountpoint).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

fn blocked_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a zeroed, then emptied set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// The kernel caps a FUSE mount's read-ahead at 128 KiB; root can raise it
/// through the mount's backing device info, which makes buffered reads
/// arrive as 1 MiB requests (../shared/PERF-NOTES.md).
fn raise_read_ahead(mountpoint: &Path) {
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
    match std::fs::write(&knob, "1024") {
        Ok(()) => info!("read-ahead raised to 1024 KiB ({knob})"),
        Err(e) => info!("read-ahead left at the kernel default: {knob}: {e}"),
    }
}

/// `stfs umount`: commits staged edits (or drops them with `discard`), then
/// unmounts; as a normal user through fusermount3. A failed commit leaves the
/// mount and its edits in place.
pub fn umount_with_commit(mountpoint: &Path, lazy: bool, discard: bool) -> Result<(), String> {
    use crate::fs::ioctl::COMMIT_DISCARD;
    match crate::client::commit(mountpoint, if discard { COMMIT_DISCARD } else { 0 }) {
        Ok(message) => {
            for line in message.lines().filter(|l| !l.ends_with("nothing to commit")) {
                eprintln!("stfs: {line}");
            }
        }
        Err(e) if e.ends_with("not a stfs mount") => {}
        Err(e) => {
            return Err(format!(
                "{e}\nstfs: {} is still mounted with its edits staged: fix them and run stfs umount again, \
                 or drop them with stfs umount --discard",
                mountpoint.display()
            ))
        }
    }
    umount(mountpoint, lazy)
}

/// Unmounts; as a normal user through fusermount3.
pub fn umount(mountpoint: &Path, lazy: bool) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mountpoint.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: c is a valid path string.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EPERM) => fusermount_unmount(mountpoint, lazy)
            .map_err(|e| format!("{}: fusermount3 -u: {e}", mountpoint.display())),
        Some(libc::EBUSY) => Err(format!(
            "{}: busy (files are open in it); close them, or unmount lazily with --lazy",
            mountpoint.display()
        )),
        Some(libc::EINVAL) => Err(format!("{}: not a mount point", mountpoint.display())),
        _ => Err(format!("{}: {err}", mountpoint.display())),
    }
}
