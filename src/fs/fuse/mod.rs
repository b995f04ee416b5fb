//! The fuser adapter: convert the request, call `Fs`, reply or map the error.
//! No filesystem logic lives here; what it decides is only *where* a request
//! runs. Reads, lookups and namespace edits run on fuser's worker threads;
//! requests that may wait on disk I/O (writes, truncations, flush, fsync)
//! run on a small pool of edit threads, and commits and prefetches on threads
//! of their own, so that no edit, commit or prefetch ever holds a worker a
//! read needs. A handler that panics taints the mount (it will not commit)
//! and its request gets EIO.

use crate::errno::{ToErrno, with_causes};
use crate::sync::LockAnyway;
use std::ffi::OsStr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl,
    ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use tracing::{debug, error, warn};

use super::ioctl::{
    COMMIT_COMPACT, COMMIT_DISCARD, COMMIT_FORCE, CommitArgs, DaemonArgs, IOC_COMMIT, IOC_DAEMON,
    IOC_LOAD, IOC_PREFETCH, IOC_PROGRESS, IOC_STATUS, IoctlStruct, LoadArgs, PrefetchArgs,
    ProgressArgs, STATUS_JSON, StatusArgs, TARGET_CUDA, TARGET_PAGE_CACHE,
};
use super::kernel_cache::NAME_TTL;
use super::{
    Attr, CacheMode, Fs, FsError, Kind, Opened, PREFETCH_SLICE, PrefetchRequest, PrefetchTarget,
};

#[macro_use]
mod reply;
mod ioctls;
use reply::*;

/// Attributes of files whose content only changes through the mount.
const ATTR_TTL: Duration = Duration::from_secs(1);
/// Names not kept by the kernel (views, index files, and every name where
/// the kernel cannot take names back: `kernel_cache`).
const ENTRY_TTL: Duration = Duration::ZERO;
/// Preferred I/O size shown in stat: tools such as cat and cp size their buffers by it.
const BLKSIZE: u32 = 1 << 20;
/// Threads serving requests that may wait on disk I/O.
const EDIT_THREADS: usize = 2;

type Job = Box<dyn FnOnce() + Send>;

pub struct FuseAdapter {
    fs: Arc<Fs>,
    edits: mpsc::Sender<Job>,
    backings: Mutex<Backings>,
}

/// The backing files of opens served by kernel passthrough. The kernel wants
/// one backing id per inode while any open of it uses one: the id is shared
/// by the inode's opens and closed with the last (held by each handle).
#[derive(Default)]
struct Backings {
    by_ino: std::collections::HashMap<u64, std::sync::Weak<fuser::BackingId>>,
    by_fh: std::collections::HashMap<u64, Arc<fuser::BackingId>>,
}

impl FuseAdapter {
    pub fn new(fs: Arc<Fs>) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for k in 0..EDIT_THREADS {
            let rx = rx.clone();
            let _ = std::thread::Builder::new()
                .name(format!("stfs-edit-{k}"))
                .spawn(move || {
                    loop {
                        let job = match rx.lock_anyway().recv() {
                            Ok(job) => job,
                            Err(_) => return,
                        };
                        job();
                    }
                });
        }
        FuseAdapter {
            fs,
            edits: tx,
            backings: Mutex::default(),
        }
    }

    /// Runs `f` on an edit thread.
    fn edit(&self, req: Req, f: impl FnOnce(&Fs) + Send + 'static) {
        let fs = self.fs.clone();
        let _ = self
            .edits
            .send(Box::new(move || guarded(&fs, req, || f(&fs))));
    }

    /// The backing id of `file` for an open of `ino` by handle `fh`: the
    /// inode's own if one of its opens has one, else a new one. When the
    /// kernel refuses (a daemon without CAP_SYS_ADMIN), passthrough is
    /// turned off for the mount and the open is served by the daemon.
    fn backing(
        &self,
        ino: u64,
        fh: u64,
        file: &std::fs::File,
        reply: &ReplyOpen,
    ) -> Result<Arc<fuser::BackingId>, ()> {
        let mut b = self.backings.lock_anyway();
        let id = match b.by_ino.get(&ino).and_then(std::sync::Weak::upgrade) {
            Some(id) => id,
            None => match reply.open_backing(file) {
                Ok(id) => Arc::new(id),
                // Not allowed (no CAP_SYS_ADMIN): off for the mount. Other
                // errors (a file on a stacked filesystem, EMFILE): this open.
                Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                    warn!("kernel passthrough refused ({e}): views are served by the daemon");
                    self.fs.set_passthrough(false);
                    return Err(());
                }
                Err(e) => {
                    warn!("kernel passthrough refused for this open ({e}): served by the daemon");
                    return Err(());
                }
            },
        };
        b.by_ino.retain(|_, w| w.strong_count() > 0);
        b.by_ino.insert(ino, Arc::downgrade(&id));
        b.by_fh.insert(fh, id.clone());
        Ok(id)
    }

    /// Runs `f` on a thread of its own (commits, prefetches).
    fn spawn(&self, req: Req, f: impl FnOnce(&Fs) + Send + 'static) {
        let fs = self.fs.clone();
        let _ = std::thread::Builder::new()
            .name(format!("stfs-{}", req.op))
            .spawn(move || guarded(&fs, req, || f(&fs)));
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // The largest read-ahead the kernel allows for this mount.
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        // O_TRUNC arrives with open, so a truncating open is one request.
        let _ = config.add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC);
        // Lookups of a directory run in parallel with each other.
        let _ = config.add_capabilities(InitFlags::FUSE_PARALLEL_DIROPS);
        // Names and attributes are kept by the kernel where it can take them
        // back; then listings give attributes (READDIRPLUS, the kernel's
        // choice when lookups follow a listing).
        if self.fs.kernel_cache().start(config.kernel_abi().1) {
            let plus = InitFlags::FUSE_DO_READDIRPLUS | InitFlags::FUSE_READDIRPLUS_AUTO;
            if config.add_capabilities(plus).is_err() {
                self.fs.kernel_cache().stop();
            }
        }
        // Views that are a source file, served by the kernel from that file
        // (backing files need CAP_SYS_ADMIN; sources may be on overlayfs).
        if rustix::process::geteuid().as_raw() == 0
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(2).is_ok()
        {
            self.fs.set_passthrough(true);
        }
        // Readers that mmap a file opened with direct I/O keep working: a
        // tensor file with -o cache=direct, a generated view in every mode.
        if config
            .add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP)
            .is_err()
        {
            match self.fs.settings().cache {
                CacheMode::Direct => warn!(
                    "this kernel cannot mmap files opened with direct I/O (Linux 6.6+ can): use -o cache=keep to mmap tensor files; views cannot be mapped"
                ),
                CacheMode::Keep => warn!(
                    "this kernel cannot mmap files opened with direct I/O (Linux 6.6+ can): views cannot be mapped"
                ),
            }
        }
        Ok(())
    }

    /// Unmount: the mount's policy decides (commit, or keep the edits).
    fn destroy(&mut self) {
        // (Unmounted: a commit now has nothing to take back from the kernel.)
        self.fs.kernel_cache().stop();
        if let Err(e) = self.fs.unmount() {
            error!("{e}");
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        guarded_read(request!("lookup", parent.0), || {
            let Some(name) = name.to_str() else {
                return reply.error(failed(&FsError::NotFound));
            };
            match self.fs.lookup(parent.0, name) {
                Ok(a) => reply.entry_with_ttls(
                    &attr_ttl(&a),
                    &entry_ttl(&self.fs, &a),
                    &file_attr(&a),
                    Generation(0),
                ),
                Err(e) => reply.error(failed(&e)),
            }
        })
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        guarded_read(request!("getattr", ino.0, fh.map(|f| f.0)), || {
            reply!(reply, self.fs.getattr(ino.0, fh.map(|f| f.0)), |a| reply
                .attr(&attr_ttl(&a), &file_attr(&a)))
        })
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        guarded(&self.fs, request!("open", ino.0), || {
            let write = flags.acc_mode() != OpenAccMode::O_RDONLY;
            match self.fs.open(ino.0, write, flags.0 & libc::O_TRUNC != 0) {
                Ok(o) => match o
                    .passthrough
                    .as_ref()
                    .map(|f| self.backing(ino.0, o.fh, f, &reply))
                {
                    Some(Ok(id)) => {
                        reply.opened_passthrough(FileHandle(o.fh), FopenFlags::empty(), &id)
                    }
                    // (Served by the daemon: `o` says how.)
                    Some(Err(())) | None => reply.opened(FileHandle(o.fh), fopen_flags(&o)),
                },
                Err(e) => reply.error(failed(&e)),
            }
        })
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        guarded(&self.fs, request!("create", parent.0), || {
            let Some(name) = name.to_str() else {
                return reply.error(failed(&FsError::NotUtf8));
            };
            let (truncate, exclusive) = (flags & libc::O_TRUNC != 0, flags & libc::O_EXCL != 0);
            match self
                .fs
                .create(parent.0, name, (truncate, exclusive), mode & !umask)
            {
                Ok((a, o)) => reply.created(
                    &ENTRY_TTL,
                    &file_attr(&a),
                    Generation(0),
                    FileHandle(o.fh),
                    fopen_flags(&o),
                ),
                Err(e) => reply.error(failed(&e)),
            }
        })
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // A handle of its own: loads started on a directory belong to it.
        reply.opened(FileHandle(self.fs.open_dir()), FopenFlags::empty());
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.fs.release_dir(fh.0);
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some(id) = self.backings.lock_anyway().by_fh.remove(&fh.0) {
            drop(id); // (the last handle of its inode closes the backing id)
        }
        // An error here reaches nobody (close already returned): release logs it.
        self.edit(request!("release", ino.0, fh.0), move |fs| {
            let _ = fs.release(fh.0);
            reply.ok()
        })
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        guarded_read(request!("read", ino.0, fh.0), || {
            // The reply is sent from inside the call, while the mapped bytes are borrowed.
            let mut reply = Some(reply);
            let result = self.fs.read(ino.0, fh.0, offset, size, |slices| {
                if let Some(r) = reply.take() {
                    match slices {
                        [one] => r.data(one),
                        many => r.data(&many.concat()),
                    }
                }
            });
            if let (Err(e), Some(r)) = (result, reply) {
                r.error(failed(&e));
            }
        })
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        guarded_read(request!("readdir", ino.0), || {
            let result = self.fs.readdir(ino.0, offset, |e| {
                let kind = match e.kind {
                    Kind::Directory => FileType::Directory,
                    Kind::File => FileType::RegularFile,
                };
                reply.add(INodeNo(e.ino), e.next_offset, kind, &e.name)
            });
            reply!(reply, result, |()| reply.ok())
        })
    }

    /// A listing with each entry's attributes, so that `ls -l` of a
    /// checkpoint asks nothing more (the kernel keeps the names and, for as
    /// long, the attributes: edits take both back, `kernel_cache`).
    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        guarded_read(request!("readdirplus", ino.0), || {
            let result = self.fs.readdir_plus(ino.0, offset, |e, a| {
                let ttl = entry_ttl(&self.fs, &a);
                let ino = INodeNo(e.ino);
                reply.add(
                    ino,
                    e.next_offset,
                    &e.name,
                    &ttl,
                    &file_attr(&a),
                    Generation(0),
                )
            });
            reply!(reply, result, |()| reply.ok())
        })
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match rustix::fs::statvfs(self.fs.backing_dir()) {
            Ok(s) => reply.statfs(
                s.f_blocks,
                s.f_bfree,
                s.f_bavail,
                s.f_files,
                s.f_ffree,
                s.f_bsize as u32,
                super::names::NAME_MAX as u32,
                s.f_frsize as u32,
            ),
            Err(e) => reply.error(failed(&FsError::from(std::io::Error::from(e)))),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        self.edit(request!("flush", ino.0, fh.0), move |fs| {
            reply!(reply, fs.flush(fh.0), |()| reply.ok())
        })
    }

    /// fsync makes edits durable; it does not commit.
    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.edit(request!("fsync", ino.0, fh.0), move |fs| {
            reply!(reply, fs.fsync(Some(fh.0)), |()| reply.ok())
        })
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.edit(request!("fsyncdir", ino.0), move |fs| {
            reply!(reply, fs.fsync(None), |()| reply.ok())
        })
    }

    fn ioctl(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        let uid = req.uid();
        match cmd {
            IOC_PREFETCH => self.prefetch(req, ino, fh, in_data, reply),
            IOC_LOAD => self.load(req, ino, fh, in_data, reply),
            IOC_DAEMON => match DaemonArgs::from_caller(in_data) {
                Some(_) => {
                    let args = DaemonArgs {
                        pid: std::process::id(),
                        ..DaemonArgs::new()
                    };
                    reply.ioctl(0, args.as_bytes())
                }
                None => reply.error(failed(&FsError::Invalid(
                    "STFS_IOC_DAEMON with a bad struct size".into(),
                ))),
            },
            IOC_PROGRESS => {
                let Some(args) = ProgressArgs::from_caller(in_data) else {
                    return reply.error(failed(&FsError::Invalid(
                        "STFS_IOC_PROGRESS with a bad struct size".into(),
                    )));
                };
                // Only a count of bytes and the source's own path: no permission asked.
                // (Every output field answered: a caller may reuse its struct.)
                let mut args = ProgressArgs {
                    size: args.size,
                    ..ProgressArgs::default()
                };
                if let Some(p) = self.fs.commit_progress() {
                    args.active = 1;
                    args.done = p.done;
                    args.total = p.total;
                    args.set_file(&p.file);
                }
                reply.ioctl(0, args.as_bytes())
            }
            IOC_STATUS => {
                let Some(mut args) = StatusArgs::from_caller(in_data).map(Box::new) else {
                    return reply.error(failed(&FsError::Invalid(
                        "STFS_IOC_STATUS with a bad struct size".into(),
                    )));
                };
                // Staged edits may name tensors of a source the caller cannot read.
                let request = request!("status", ino.0, fh.0);
                if let Err(e) = self.fs.allowed(uid, "status") {
                    args.result = request.span.in_scope(|| failed(&e)).code();
                    args.set_page(&e.to_string());
                    return reply.ioctl(0, args.as_bytes());
                }
                guarded_read(request, || {
                    let report = self.fs.status();
                    args.refused = report.refused as u32;
                    args.set_page(&if args.flags & STATUS_JSON != 0 {
                        serde_json::to_string(&report).expect("plain data")
                    } else {
                        report.text()
                    });
                    reply.ioctl(0, args.as_bytes())
                })
            }
            IOC_COMMIT => {
                let Some(mut args) = CommitArgs::from_caller(in_data) else {
                    return reply.error(failed(&FsError::Invalid(
                        "STFS_IOC_COMMIT with a bad struct size".into(),
                    )));
                };
                let what = if args.flags & COMMIT_DISCARD != 0 {
                    "discard"
                } else {
                    "commit"
                };
                let request = request!("commit", ino.0, fh.0);
                if let Err(e) = self.fs.allowed(uid, what) {
                    args.result = request.span.in_scope(|| failed(&e)).code();
                    args.set_message(&e.to_string());
                    return reply.ioctl(0, args.as_bytes());
                }
                self.spawn(request, move |fs| {
                    let result = if args.flags & COMMIT_DISCARD != 0 {
                        fs.discard(uid)
                    } else {
                        let options = crate::checkpoint::commit::CommitOptions {
                            force: args.flags & COMMIT_FORCE != 0,
                            compact: args.flags & COMMIT_COMPACT != 0,
                        };
                        fs.commit(options, uid)
                    };
                    match result {
                        Ok(lines) => args.set_message(&lines.join("\n")),
                        Err(e) => {
                            args.result = failed(&e).code();
                            args.set_message(&e.to_string());
                        }
                    }
                    reply.ioctl(0, args.as_bytes())
                })
            }
            _ => reply.error(failed(&FsError::UnknownIoctl(cmd))),
        }
    }

    // ENOSYS tells the kernel once and for all that stfs keeps no extended
    // attributes; callers see EOPNOTSUPP.
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(failed(&FsError::NoXattrs))
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(failed(&FsError::NoXattrs))
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        // Only the size is stfs's to change; mode, owner and times are the
        // source's (a change is accepted and ignored, so `cp -p` and rsync work;
        // the kernel has checked the caller may make it).
        let fh = fh.map(|f| f.0);
        match size {
            Some(size) => self.edit(request!("setattr", ino.0, fh), move |fs| {
                reply!(reply, fs.set_size(ino.0, fh, size), |a| reply
                    .attr(&attr_ttl(&a), &file_attr(&a)))
            }),
            None => guarded(&self.fs, request!("setattr", ino.0, fh), || {
                reply!(reply, self.fs.getattr(ino.0, fh), |a| reply
                    .attr(&attr_ttl(&a), &file_attr(&a)))
            }),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let data = data.to_vec();
        self.edit(request!("write", ino.0, fh.0), move |fs| {
            reply!(reply, fs.write(ino.0, fh.0, offset, &data), |n| reply
                .written(n))
        })
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        guarded(&self.fs, request!("unlink", parent.0), || {
            let Some(name) = name.to_str() else {
                return reply.error(failed(&FsError::NotFound));
            };
            reply!(reply, self.fs.unlink(parent.0, name), |()| reply.ok())
        })
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        guarded(&self.fs, request!("rename", parent.0), || {
            let (Some(name), Some(newname)) = (name.to_str(), newname.to_str()) else {
                return reply.error(failed(&FsError::NotUtf8));
            };
            if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
                let flags = "rename with RENAME_EXCHANGE or RENAME_WHITEOUT";
                return reply.error(failed(&FsError::NotSupported(flags)));
            }
            let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
            let renamed = self
                .fs
                .rename(parent.0, name, newparent.0, newname, no_replace);
            reply!(reply, renamed, |()| reply.ok())
        })
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(failed(&FsError::NotSupported("rmdir")))
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(failed(&self.fs.refuse_node(parent.0, "mkdir")))
    }

    fn mknod(
        &self,
        _req: &Request,
        parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(failed(&self.fs.refuse_node(parent.0, "mknod")))
    }

    fn symlink(
        &self,
        _req: &Request,
        parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(failed(&self.fs.refuse_node(parent.0, "symlink")))
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(failed(&FsError::NotPermitted(
            "hard links are not supported",
        )))
    }

    fn setxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        reply.error(failed(&FsError::NotSupported("setxattr")))
    }
}
