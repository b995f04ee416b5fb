//! The baseline of `scripts/bench_read.py`: the least a FUSE server can do to
//! serve a byte range of another file. One file, `t`, whose bytes are
//! `LEN` bytes at `OFFSET` of `SOURCE`, replied straight from a populated
//! mmap with direct I/O; nothing else. It mounts the way stfs does (same
//! threads, read-ahead and request size), so that the ratio of stfs to it
//! measures what stfs adds, not the kernel's FUSE path.
//!
//! Usage (as root; runs until unmounted):
//!   cargo run --release --example minimal_server SOURCE OFFSET LEN MOUNTPOINT

use std::ffi::OsStr;
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyEntry, ReplyOpen, Request,
};

const TTL: Duration = Duration::from_secs(3600);

struct OneFile {
    map: memmap2::Mmap,
    offset: usize,
    len: usize,
}

fn attr(ino: u64, kind: FileType, size: u64) -> FileAttr {
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind,
        perm: if kind == FileType::Directory {
            0o555
        } else {
            0o444
        },
        nlink: 1,
        uid: 0,
        gid: 0,
        rdev: 0,
        flags: 0,
        blksize: 4096,
    }
}

impl Filesystem for OneFile {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_readahead(u32::MAX) {
            let _ = config.set_max_readahead(max);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        if u64::from(parent) == 1 && name == "t" {
            reply.entry(
                &TTL,
                &attr(2, FileType::RegularFile, self.len as u64),
                fuser::Generation(0),
            );
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match u64::from(ino) {
            1 => reply.attr(&TTL, &attr(1, FileType::Directory, 0)),
            2 => reply.attr(&TTL, &attr(2, FileType::RegularFile, self.len as u64)),
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let start = (offset as usize).min(self.len);
        let end = (start + size as usize).min(self.len);
        reply.data(&self.map[self.offset + start..self.offset + end]);
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let [_, source, offset, len, mountpoint] = &args[..] else {
        eprintln!("usage: minimal_server SOURCE OFFSET LEN MOUNTPOINT");
        std::process::exit(2);
    };
    let (offset, len): (usize, usize) = (offset.parse().unwrap(), len.parse().unwrap());
    let file = std::fs::File::open(source)?;
    // SAFETY: a benchmark's own file, not changed while it runs.
    let map = unsafe { memmap2::MmapOptions::new().populate().map(&file)? };
    assert!(
        offset + len <= map.len(),
        "the range passes the end of {source}"
    );
    let mut config = Config::default();
    config.mount_options = vec![MountOption::FSName("minimal".into()), MountOption::RO];
    // As many threads as stfs runs on this machine.
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    config.n_threads = Some(threads);
    fuser::mount(OneFile { map, offset, len }, mountpoint, &config)
}
