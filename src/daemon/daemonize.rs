//! Becoming a daemon: detached from the terminal, with a pipe back to the
//! `stfs mount` that waits for it to say it serves (or why it cannot).

use super::*;

/// Forks; the child prepares what it serves (`prepare`), then serves the
/// mount and reports through a pipe once the mount answers (or why it
/// failed); the parent returns only then, and prints the child's notes. Must
/// be called before any thread is started.
pub(super) fn daemonize(
    req: &MountRequest,
    options: MountOptions,
    prepare: impl FnOnce() -> Prepared,
) -> Result<(), crate::errno::Failure> {
    let (read_end, write_end) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: stfs has started no threads yet, so the child may run Rust code freely.
    match unsafe { libc::fork() } {
        -1 => Err(format!("fork: {}", std::io::Error::last_os_error()).into()),
        0 => {
            drop(read_end);
            let _ = rustix::process::setsid();
            detach_stdio();
            let mut ready = Some(write_end);
            // As in `launch`: before any thread starts.
            blocked_signals();
            let prepared = logging::init(req.log_file.as_deref(), false).and_then(|note| {
                let (fs, mut report) = prepare()?;
                report.extend(note);
                Ok((fs, report))
            });
            let code = match prepared {
                Err(e) => {
                    error!("{e}");
                    say(&mut ready, &e.why);
                    1
                }
                Ok((fs, report)) => match serve(fs, req, options, &report, ready) {
                    Ok(()) => 0,
                    Err(e) => {
                        error!("{e}");
                        1
                    }
                },
            };
            std::process::exit(code);
        }
        _child => {
            drop(write_end);
            // The parent only waits and exits: skip freeing a large state.
            std::mem::forget(prepare);
            let spinner = crate::progress::spinner(&format!(
                "mounting {} (waiting for the mount to answer)",
                req.source.display()
            ));
            let mut answer = String::new();
            let read = File::from(read_end).read_to_string(&mut answer);
            crate::progress::clear(spinner);
            read.map_err(|e| format!("waiting for the daemon: {e}"))?;
            match answer.strip_prefix("ok\n") {
                Some(notes) => {
                    for line in notes.lines() {
                        eprintln!("stfs: {line}");
                    }
                    Ok(())
                }
                None if answer.is_empty() => {
                    Err("the daemon exited before the mount was ready (see its log)".into())
                }
                None => Err(answer.trim_end().to_string().into()),
            }
        }
    }
}

pub(super) fn detach_stdio() {
    if let Ok(null) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let _ = rustix::stdio::dup2_stdin(&null);
        let _ = rustix::stdio::dup2_stdout(&null);
        let _ = rustix::stdio::dup2_stderr(&null);
    }
}

pub(super) fn say(ready: &mut Option<OwnedFd>, message: &str) {
    if let Some(fd) = ready.take() {
        let _ = File::from(fd).write_all(message.as_bytes());
    }
}

/// Raises the soft limit of open files to the hard one: staging files are
/// opened on use, but a busy mount still holds many.
pub(super) fn raise_open_files() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let Rlimit { current, maximum } = getrlimit(Resource::Nofile);
    if let (Some(old), Some(max)) = (current, maximum) {
        let raised = Rlimit {
            current: maximum,
            maximum,
        };
        if old < max && setrlimit(Resource::Nofile, raised).is_ok() {
            info!("open file limit raised from {old} to {max}");
        }
    }
}

pub(super) fn blocked_signals() -> libc::sigset_t {
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
