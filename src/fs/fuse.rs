//! The fuser adapter: convert the request, call `Fs`, reply or map the error.
//! No filesystem logic lives here.

use std::ffi::OsStr;
use std::time::Duration;

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    KernelConfig, LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use tracing::{debug, warn};

use super::{Attr, Fs, FsError, Kind};

/// Entries and attributes do not change behind the kernel's back on a read-only mount.
const TTL: Duration = Duration::from_secs(60);
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

impl Filesystem for FuseAdapter {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Ask for the largest read-ahead the kernel allows for this mount.
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        Ok(())
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
        let write = flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0;
        match self.fs.open(ino.0, write) {
            Ok(mode) => {
                let mut f = FopenFlags::empty();
                if mode.keep_cache {
                    f |= FopenFlags::FOPEN_KEEP_CACHE;
                }
                if mode.direct_io {
                    f |= FopenFlags::FOPEN_DIRECT_IO;
                }
                reply.opened(FileHandle(0), f)
            }
            Err(e) => reply.error(errno("open", &e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        // The reply is sent from inside the call, while the mapped bytes are borrowed.
        let mut reply = Some(reply);
        let result = self.fs.read(ino.0, offset, size, |bytes| {
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
        match nix_statvfs(self.fs.backing_dir()) {
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
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok()
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Nothing is buffered in the daemon.
        reply.ok()
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

    // ---- Writes: refused until the write path lands (EROFS), and operations
    // stfs never supports (ENOTSUP / EPERM).

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(refuse("setattr", FsError::ReadOnly))
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        reply.error(refuse("write", FsError::ReadOnly))
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: fuser::ReplyCreate,
    ) {
        reply.error(refuse("create", FsError::ReadOnly))
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(refuse("unlink", FsError::ReadOnly))
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(refuse("rename", FsError::ReadOnly))
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
        reply.error(refuse("link", FsError::NotSupported("link")))
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
