//! The fuser adapter: convert the request, call `Fs`, reply or map the error.
//! No filesystem logic lives here.

use std::ffi::OsStr;
use std::time::Duration;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags,
    IoctlFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl, ReplyOpen,
    ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use tracing::{debug, error, info, warn};

use super::ioctl::{
    CommitArgs, IoctlStruct, PrefetchArgs, COMMIT_DISCARD, COMMIT_FORCE, IOC_COMMIT, IOC_PREFETCH,
    TARGET_CUDA, TARGET_PAGE_CACHE,
};
use super::{Attr, Fs, FsError, Kind, Opened, PrefetchTarget};

/// Edits go through the mount, so the kernel learns of them; commits change
/// only derived fields (offsets, mtime), which a short TTL keeps fresh.
const TTL: Duration = Duration::from_secs(1);
/// Preferred I/O size shown in stat: tools such as cat and cp size their buffers by it.
const BLKSIZE: u32 = 1 << 20;

pub struct FuseAdapter {
    fs: Fs,
}

impl FuseAdapter {
    pub fn new(fs: Fs) -> Self {
        FuseAdapter { fs }
    }
}

fn errno(op: &str, e: &FsError) -> Errno {
    match e {
        FsError::NotFound => debug!(op, "{e}"),
        _ => warn!(op, "{e}"),
    }
    Errno::from_i32(e.errno())
}

fn file_attr(a: &Attr) -> FileAttr {
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

fn refuse(op: &'static str, e: FsError) -> Errno {
    debug!(op, "refused: {e}");
    Errno::from_i32(e.errno())
}

fn fopen_flags(o: &Opened) -> FopenFlags {
    let mut f = FopenFlags::empty();
    if o.keep_cache {
        f |= FopenFlags::FOPEN_KEEP_CACHE;
    }
    if o.direct_io {
        f |= FopenFlags::FOPEN_DIRECT_IO;
    }
    f
}

impl FuseAdapter {
    fn prefetch(&self, ino: INodeNo, fh: FileHandle, in_data: &[u8], reply: ReplyIoctl) {
        let Some(mut args) = PrefetchArgs::from_bytes(in_data) else {
            warn!("STFS_IOC_PREFETCH with a bad struct size");
            return reply.error(Errno::EINVAL);
        };
        let target = match args.target {
            TARGET_PAGE_CACHE => PrefetchTarget::PageCache,
            TARGET_CUDA => PrefetchTarget::Cuda(args.device),
            other => {
                args.result = libc::EINVAL;
                args.set_message(&format!("unknown prefetch target {other}"));
                return reply.ioctl(0, args.as_bytes());
            }
        };
        let started = std::time::Instant::now();
        match self.fs.prefetch(ino.0, fh.0, target) {
            Ok(p) => {
                args.bytes = p.bytes;
                args.nbytes = p.nbytes;
                if let Some(d) = p.dtype {
                    args.set_dtype(d.name());
                }
                if let Some(shape) = &p.shape {
                    args.ndim = shape.len() as u32;
                    for (dst, &d) in args.shape.iter_mut().zip(shape) {
                        *dst = d;
                    }
                }
                if let Some((handle, size)) = p.ipc {
                    args.ipc_handle = handle;
                    args.alloc_size = size;
                    args.ipc_offset = 0;
                }
            }
            Err((errno, message)) => {
                args.result = errno;
                args.set_message(&message);
            }
        }
        args.elapsed_ns = started.elapsed().as_nanos() as u64;
        reply.ioctl(0, args.as_bytes())
    }
}

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Ask for the largest read-ahead the kernel allows for this mount.
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        // O_TRUNC arrives with open, so a truncating open of a .meta.json is one request.
        let _ = config.add_capabilities(InitFlags::FUSE_ATOMIC_O_TRUNC);
        Ok(())
    }

    /// Unmount: commit what is staged. On failure the edits stay on disk.
    fn destroy(&mut self) {
        if !self.fs.is_dirty() {
            return;
        }
        match self.fs.commit(super::ROOT_INO, false) {
            Ok(lines) => lines.iter().for_each(|l| info!("at unmount: {l}")),
            Err(e) => error!(
                "commit at unmount failed: {e}. The source is unchanged; the staged edits are kept in {:?} \
                 (manifest.json says which file holds which tensor). To finish: stfs mount --resume DIR \
                 SOURCE MOUNTPOINT takes them back; fix the edit and commit (stfs umount, unlike plain \
                 umount, refuses to unmount while a commit fails)",
                self.fs.keep_edits()
            ),
        }
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        match self.fs.lookup(parent.0, name) {
            Ok(a) => reply.entry(&TTL, &file_attr(&a), Generation(0)),
            Err(e) => reply.error(errno("lookup", &e)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.fs.getattr(ino.0) {
            Ok(a) => reply.attr(&TTL, &file_attr(&a)),
            Err(e) => reply.error(errno("getattr", &e)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let write = flags.acc_mode() != OpenAccMode::O_RDONLY;
        match self.fs.open(ino.0, write, flags.0 & libc::O_TRUNC != 0) {
            Ok(o) => reply.opened(FileHandle(o.fh), fopen_flags(&o)),
            Err(e) => reply.error(errno("open", &e)),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let Some(name) = name.to_str() else {
            return reply.error(Errno::EINVAL);
        };
        match self.fs.create(parent.0, name, flags & libc::O_TRUNC != 0) {
            Ok((a, o)) => reply.created(
                &TTL,
                &file_attr(&a),
                Generation(0),
                FileHandle(o.fh),
                fopen_flags(&o),
            ),
            Err(e) => reply.error(errno("create", &e)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        // An error here reaches nobody (close already returned): it is logged.
        let _ = self.fs.release(fh.0);
        reply.ok()
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
        // The reply is sent from inside the call, while the mapped bytes are borrowed.
        let mut reply = Some(reply);
        let result = self.fs.read(ino.0, fh.0, offset, size, |bytes| {
            if let Some(r) = reply.take() {
                r.data(bytes)
            }
        });
        if let (Err(e), Some(r)) = (result, reply) {
            r.error(errno("read", &e));
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let result = self.fs.readdir(ino.0, offset, |e| {
            let kind = match e.kind {
                Kind::Directory => FileType::Directory,
                Kind::File => FileType::RegularFile,
            };
            reply.add(INodeNo(e.ino), e.next_offset, kind, &e.name)
        });
        match result {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("readdir", &e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        match nix_statvfs(&self.fs.backing_dir()) {
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
            Err(e) => reply.error(errno("statfs", &FsError::from(e))),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        match self.fs.flush(fh.0) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("flush", &e)),
        }
    }

    /// fsync of any file commits its checkpoint.
    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if let Err(e) = self.fs.flush(fh.0) {
            return reply.error(errno("fsync", &e));
        }
        match self.fs.commit(ino.0, false) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e.errno())),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        match self.fs.commit(ino.0, false) {
            Ok(_) => reply.ok(),
            Err(e) => reply.error(Errno::from_i32(e.errno())),
        }
    }

    fn ioctl(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        if cmd == IOC_PREFETCH {
            return self.prefetch(ino, _fh, in_data, reply);
        }
        if cmd != IOC_COMMIT {
            debug!(cmd, "unknown ioctl");
            return reply.error(Errno::ENOTTY);
        }
        let Some(mut args) = CommitArgs::from_bytes(in_data) else {
            warn!("STFS_IOC_COMMIT with a bad struct size");
            return reply.error(Errno::EINVAL);
        };
        if args.flags & COMMIT_DISCARD != 0 {
            self.fs.discard();
            args.set_message("staged edits discarded");
        } else {
            match self.fs.commit(ino.0, args.flags & COMMIT_FORCE != 0) {
                Ok(lines) => args.set_message(&lines.join("\n")),
                Err(e) => {
                    args.result = e.errno();
                    args.set_message(&e.to_string());
                }
            }
        }
        reply.ioctl(0, args.as_bytes())
    }

    // ENOSYS tells the kernel once and for all that stfs keeps no extended
    // attributes and leaves permission checks to it; callers see EOPNOTSUPP.
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: fuser::ReplyXattr,
    ) {
        reply.error(Errno::ENOSYS)
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, _size: u32, reply: fuser::ReplyXattr) {
        reply.error(Errno::ENOSYS)
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
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
        // Only the size is stfs's to change; mode, owner and times are derived
        // (a mode change is accepted and ignored, so `cp -p` works).
        let result = match size {
            Some(size) => self.fs.set_size(ino.0, fh.map(|f| f.0), size),
            None => self.fs.getattr(ino.0),
        };
        match result {
            Ok(a) => reply.attr(&TTL, &file_attr(&a)),
            Err(e) => reply.error(errno("setattr", &e)),
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
        match self.fs.write(ino.0, fh.0, offset, data) {
            Ok(n) => reply.written(n),
            Err(e) => reply.error(errno("write", &e)),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        match self.fs.unlink(parent.0, name) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("unlink", &e)),
        }
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
        let (Some(name), Some(newname)) = (name.to_str(), newname.to_str()) else {
            return reply.error(Errno::EINVAL);
        };
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return reply.error(refuse(
                "rename",
                FsError::NotSupported("rename with RENAME_EXCHANGE or RENAME_WHITEOUT"),
            ));
        }
        let no_replace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        match self
            .fs
            .rename(parent.0, name, newparent.0, newname, no_replace)
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno("rename", &e)),
        }
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(refuse("rmdir", FsError::NotSupported("rmdir")))
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(refuse("mkdir", FsError::NotSupported("mkdir")))
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(refuse("mknod", FsError::NotSupported("mknod")))
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(refuse("symlink", FsError::NotSupported("symlink")))
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(refuse(
            "link",
            FsError::NotPermitted("hard links are not supported"),
        ))
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
        reply.error(refuse("setxattr", FsError::NotSupported("setxattr")))
    }
}

fn nix_statvfs(path: &std::path::Path) -> std::io::Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path and s a properly sized out-parameter.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(s)
}
