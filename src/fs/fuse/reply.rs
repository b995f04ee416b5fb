//! The reply path of every request: its span, the guard that turns a panic
//! into EIO and a tainted mount, the errno and the log line of a failure,
//! and the kernel's view of an attribute.

use super::*;

/// One request, for the log: a span with its op, inode and handle around
/// everything logged while it is served (on whichever thread serves it).
pub(super) struct Req {
    pub(super) op: &'static str,
    pub(super) span: tracing::Span,
}

macro_rules! request {
    ($op:literal, $ino:expr) => {
        Req {
            op: $op,
            span: tracing::warn_span!("request", op = $op, ino = $ino),
        }
    };
    ($op:literal, $ino:expr, $fh:expr) => {
        Req {
            op: $op,
            span: tracing::warn_span!("request", op = $op, ino = $ino, fh = $fh),
        }
    };
}

/// Answers a request from a handler's result: `$ok` with the value, or the
/// error's errno (logged once by `failed`).
macro_rules! reply {
    ($reply:ident, $result:expr, |$value:pat_param| $ok:expr) => {
        match $result {
            Ok($value) => $ok,
            Err(e) => $reply.error(failed(&e)),
        }
    };
}

/// Runs a handler; a panic taints the mount (the reply, dropped while
/// unwinding, sends EIO).
pub(super) fn guarded(fs: &Fs, req: Req, f: impl FnOnce()) {
    let _in = req.span.enter();
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        error!("request handler panicked");
        fs.taint(format!(
            "a request of this mount ({}) panicked, so its state is not trusted",
            req.op
        ));
    }
}

/// Runs a handler that changes nothing: a panic answers EIO (and is logged),
/// but leaves the state trusted, so that no reader can stop commits.
pub(super) fn guarded_read(req: Req, f: impl FnOnce()) {
    let _in = req.span.enter();
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        error!("request handler panicked (a read: the mount still commits)");
    }
}

/// The errno of a failed request; the failure is logged once, in the
/// request's span, with its errno and the chain of its causes.
pub(super) fn failed(e: &FsError) -> Errno {
    let n = e.to_errno();
    if e.is_routine() {
        debug!(errno = n, "{e}");
    } else {
        refused(format_args!("{} (errno {n})", with_causes(e)));
    }
    Errno::from_i32(n)
}

/// How many refusals may be logged at once, and then one a second.
pub(super) const REFUSALS_BURST: f64 = 20.0;

/// Logs a refused request at warn, rate-limited: any caller can cause these
/// at will (a loop of bad ioctls by another user), and the log is the
/// mounting user's. What is left out is counted and said with the next line.
pub(super) fn refused(what: std::fmt::Arguments) {
    static LIMIT: Mutex<Option<(f64, Instant, u64)>> = Mutex::new(None);
    let mut limit = LIMIT.lock_anyway();
    let now = Instant::now();
    let (tokens, last, suppressed) = limit.get_or_insert((REFUSALS_BURST, now, 0));
    *tokens = (*tokens + now.duration_since(*last).as_secs_f64()).min(REFUSALS_BURST);
    *last = now;
    if *tokens < 1.0 {
        *suppressed += 1;
        return;
    }
    *tokens -= 1.0;
    match std::mem::take(suppressed) {
        0 => warn!("{what}"),
        n => warn!("{what} ({n} similar lines left out of the log)"),
    }
}

pub(super) fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: match a.kind {
            Kind::Directory => FileType::Directory,
            Kind::File => FileType::RegularFile,
        },
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: BLKSIZE,
        flags: 0,
    }
}

/// How long the kernel may keep the name of `a` (until an edit takes it back).
pub(super) fn entry_ttl(fs: &Fs, a: &Attr) -> Duration {
    match a.cached_name && fs.kernel_cache().names_cached() {
        true => NAME_TTL,
        false => ENTRY_TTL,
    }
}

pub(super) fn attr_ttl(a: &Attr) -> Duration {
    if a.volatile { Duration::ZERO } else { ATTR_TTL }
}

pub(super) fn fopen_flags(o: &Opened) -> FopenFlags {
    let mut f = FopenFlags::empty();
    if o.keep_cache {
        f |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if o.direct_io {
        f |= FopenFlags::FOPEN_DIRECT_IO;
    }
    f
}
