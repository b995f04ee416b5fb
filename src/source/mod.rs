//! Where tensor bytes come from. `Bytes` is the one type the rest of stfs asks
//! to measure, read, copy or prefetch a tensor's bytes: a source file (the
//! validated, mapped local file of `local`, or a remote object read through a
//! local disk cache, `remote`), a private staging file (`staged`), or nothing
//! yet.

pub mod access;
mod aws_profile;
pub mod folder;
pub mod local;
pub mod patched;
pub mod remote;
pub mod staged;
pub mod store;

use std::fs::File;
use std::sync::Arc;

pub use folder::{FileStat, Folder, FolderError};
pub use local::{SourceError, SourceFile};
pub use patched::Patched;
pub use staged::{StagedFile, StagingDir};

/// A tensor's bytes, wherever they are now. Cheap to clone.
#[derive(Clone)]
pub enum Bytes {
    /// A new, empty file: nothing staged yet.
    Empty,
    /// Tensor `index` of a mapped source file, unchanged.
    Source(Arc<SourceFile>, u32),
    /// A (possibly sparse) staging file.
    Staged(Arc<StagedFile>),
    /// A source tensor with some blocks written (in a staging file).
    Patched(Arc<Patched>),
}

/// Where the bytes a prefetch reads are: a range of a local file, or of a
/// remote source (fetched into its cache first, in parallel).
#[derive(Clone)]
pub enum Backing {
    File {
        file: Arc<File>,
        offset: u64,
        len: u64,
        /// Holes may exist (a sparse staging file): skip them instead of reading zeros.
        sparse: bool,
        /// A source whose in-place commits may insert bytes at its start,
        /// and how many it had when `offset` was taken: reads follow.
        moves_with: Option<(Arc<SourceFile>, u64)>,
    },
    Remote {
        source: Arc<SourceFile>,
        offset: u64,
        len: u64,
    },
    /// A source tensor with some blocks staged: read through both.
    Patched(Arc<Patched>),
}

impl Backing {
    /// (offset in the file, length) of the bytes.
    pub fn range(&self) -> (u64, u64) {
        match self {
            Backing::File { offset, len, .. } | Backing::Remote { offset, len, .. } => {
                (*offset, *len)
            }
            Backing::Patched(p) => (0, p.len()),
        }
    }

    /// Reads at `pos` (absolute, in the file) into `buf`; fewer bytes at its end.
    pub fn read_at(&self, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        match self {
            Backing::File {
                moves_with: Some((source, seen)),
                ..
            } => source.read_shifted(buf, pos, *seen),
            Backing::File { file, .. } => file.read_at(buf, pos),
            Backing::Remote { source, .. } => source.read_at(buf, pos),
            Backing::Patched(p) => {
                let n = (buf.len() as u64).min(p.len().saturating_sub(pos)) as usize;
                p.read_exact_at(pos, &mut buf[..n]).map(|()| n)
            }
        }
    }
}

impl Bytes {
    pub fn len(&self) -> u64 {
        match self {
            Bytes::Empty => 0,
            Bytes::Source(s, i) => s.header().tensors.nbytes(*i as usize),
            Bytes::Staged(s) => s.len(),
            Bytes::Patched(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All the bytes, copied (small files: a data file renamed onto a meta).
    pub fn to_vec(&self) -> std::io::Result<Vec<u8>> {
        let mut out = vec![0u8; self.len() as usize];
        self.read_exact_at(0, &mut out)?;
        Ok(out)
    }

    /// Fills `out` with the bytes at `offset` (EIO past the end). A local
    /// source's are read from the file (pread), not copied out of its
    /// mapping in the daemon: a file cut short behind the mount gives EIO
    /// here, where a copy from the mapping would kill the daemon (SIGBUS).
    pub fn read_exact_at(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        match self {
            Bytes::Source(s, i) if s.file().is_some() => {
                return s.read_tensor_exact(*i as usize, offset, out);
            }
            Bytes::Patched(p) => return p.read_exact_at(offset, out),
            _ => {}
        }
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(u32::MAX as usize) as u32;
            let got = self.read(offset + done as u64, want, |b| {
                out[done..done + b.len()].copy_from_slice(b);
                b.len()
            })?;
            if got == 0 {
                return Err(std::io::Error::from_raw_os_error(libc::EIO));
            }
            done += got;
        }
        Ok(())
    }

    /// Serves up to `size` bytes at `offset` (fewer at the end) to `reply`.
    /// Source bytes go out straight from the mapping; staged bytes through a buffer.
    pub fn read<R>(
        &self,
        offset: u64,
        size: u32,
        reply: impl FnOnce(&[u8]) -> R,
    ) -> std::io::Result<R> {
        match self {
            Bytes::Empty => Ok(reply(&[])),
            Bytes::Source(s, i) => s.serve(*i as usize, offset, size, reply),
            Bytes::Staged(_) | Bytes::Patched(_) => {
                let want = (size as u64).min(self.len().saturating_sub(offset)) as usize;
                // A buffer kept by the thread: a fresh 1 MiB buffer per read
                // costs its page faults, which cost more than the copy here.
                thread_local! {
                    static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
                }
                BUF.with(|cell| {
                    let mut fresh = Vec::new();
                    let mut kept = cell.try_borrow_mut();
                    let buf = match kept.as_deref_mut() {
                        Ok(buf) => buf,
                        Err(_) => &mut fresh, // (a read inside a reply: not shared)
                    };
                    if buf.len() < want {
                        buf.resize(want, 0);
                    }
                    let got = match self {
                        Bytes::Staged(s) => s.read_at(&mut buf[..want], offset)?,
                        _ => self
                            .read_exact_at(offset, &mut buf[..want])
                            .map(|()| want)?,
                    };
                    Ok(reply(&buf[..got]))
                })
            }
        }
    }

    /// Copies bytes `from..from+len` into `to` at `to_off`. Running out of
    /// bytes early is an error (EIO): a copy never pads with zeros.
    pub fn copy_to(&self, from: u64, to: &File, to_off: u64, len: u64) -> std::io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if from.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(short_read("the tensor is shorter than the range copied"));
        }
        match self {
            Bytes::Empty => Ok(()),
            Bytes::Source(s, i) => {
                s.check_unchanged()?;
                s.copy_tensor(*i as usize, from, to, to_off, len)
            }
            Bytes::Staged(s) => copy_range(&*s.file()?, s.pad() + from, to, to_off, len),
            Bytes::Patched(p) if from == 0 => p.copy_to(to, to_off, len, None).map(|_| ()),
            Bytes::Patched(p) => {
                p.check_source()?;
                copy_through(
                    |buf, pos| p.read_exact_at(pos, buf).map(|()| buf.len()),
                    from,
                    to,
                    to_off,
                    len,
                )
            }
        }
    }

    /// `copy_to`, sharing blocks where the bytes lie at the same place
    /// modulo `block` in their file (the source, or a staging file: its pad)
    /// and in `to` (`copy_sharing`). Returns the bytes shared.
    pub fn copy_sharing_to(&self, to: &File, to_off: u64, block: u64) -> std::io::Result<u64> {
        match self {
            Bytes::Source(s, i) if s.file().is_some() => {
                s.check_unchanged()?;
                s.share_tensor(*i as usize, to, to_off, block)
            }
            Bytes::Staged(s) => copy_sharing(&*s.file()?, s.pad(), to, to_off, s.len(), block),
            Bytes::Patched(p) => p.copy_to(to, to_off, p.len(), Some(block)),
            _ => self.copy_to(0, to, to_off, self.len()).map(|_| 0),
        }
    }

    /// Where byte 0 of these bytes sits within a `STAGING_ALIGN` block of
    /// their file: the pad a staging copy of them takes, so that a commit
    /// that puts them back where they are shares its blocks.
    pub fn pad_in_block(&self) -> u64 {
        match self {
            Bytes::Source(s, i) if s.file().is_some() => {
                (s.tensor_range(*i as usize).start + s.shift()) % staged::STAGING_ALIGN
            }
            Bytes::Staged(s) => s.pad(),
            Bytes::Patched(p) => p.staged().pad(),
            _ => 0,
        }
    }

    /// The file and range holding the bytes, for prefetch.
    pub fn backing(&self) -> std::io::Result<Option<Backing>> {
        Ok(match self {
            Bytes::Empty => None,
            Bytes::Source(s, i) => {
                s.check_unchanged()?;
                let r = s.tensor_range(*i as usize);
                let shift = s.shift();
                let (offset, len) = (r.start + shift, r.end - r.start);
                Some(match s.file() {
                    Some(file) => Backing::File {
                        file: file.clone(),
                        offset,
                        len,
                        sparse: false,
                        moves_with: Some((s.clone(), shift)),
                    },
                    None => Backing::Remote {
                        source: s.clone(),
                        offset,
                        len,
                    },
                })
            }
            Bytes::Staged(s) => Some(Backing::File {
                file: s.file()?,
                offset: s.pad(),
                len: s.len(),
                sparse: true,
                moves_with: None,
            }),
            Bytes::Patched(p) => Some(Backing::Patched(p.clone())),
        })
    }

    /// The source tensor these bytes are, or lie over (written in part).
    pub fn source_tensor(&self) -> Option<(&Arc<SourceFile>, u32)> {
        match self {
            Bytes::Source(src, i) => Some((src, *i)),
            Bytes::Patched(p) => Some(p.base()),
            _ => None,
        }
    }

    /// The staging file holding (some of) the bytes: pinned by a commit or
    /// a view that reads it, synced on fsync.
    pub fn staging_file(&self) -> Option<&Arc<StagedFile>> {
        match self {
            Bytes::Staged(s) => Some(s),
            Bytes::Patched(p) => Some(p.staged()),
            _ => None,
        }
    }

    /// Whether both are the same bytes (the same source tensor or staging file).
    pub fn same(&self, other: &Bytes) -> bool {
        match (self, other) {
            (Bytes::Empty, Bytes::Empty) => true,
            (Bytes::Source(a, i), Bytes::Source(b, j)) => Arc::ptr_eq(a, b) && i == j,
            (Bytes::Staged(a), Bytes::Staged(b)) => Arc::ptr_eq(a, b),
            (Bytes::Patched(a), Bytes::Patched(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

fn short_read(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, why.to_string())
}

/// Copies `len` bytes between files at offsets with copy_file_range (which can
/// share extents), falling back to pread/pwrite across filesystems. Reaching
/// the end of `from` early is an error: a copy never invents bytes.
pub fn copy_range(
    from: &File,
    mut from_off: u64,
    to: &File,
    mut to_off: u64,
    len: u64,
) -> std::io::Result<()> {
    if len > 0 {
        crate::testpoint::io("copy")?;
    }
    let mut left = len;
    while left > 0 {
        let mut off_in = from_off;
        let mut off_out = to_off;
        let chunk = left.min(1 << 30) as usize;
        let err = match rustix::fs::copy_file_range(
            from,
            Some(&mut off_in),
            to,
            Some(&mut off_out),
            chunk,
        ) {
            Ok(0) => {
                return Err(short_read(
                    "the file ended before the tensor did (truncated behind the mount?)",
                ));
            }
            Ok(n) => {
                let n = n as u64;
                left -= n;
                from_off += n;
                to_off += n;
                continue;
            }
            Err(e) => std::io::Error::from(e),
        };
        match err.raw_os_error() {
            Some(libc::EXDEV | libc::ENOSYS | libc::EOPNOTSUPP | libc::EINVAL) => {
                return copy_by_buffer(from, from_off, to, to_off, left);
            }
            Some(libc::EINTR) => continue,
            _ => return Err(err),
        }
    }
    Ok(())
}

fn copy_by_buffer(
    from: &File,
    from_off: u64,
    to: &File,
    to_off: u64,
    left: u64,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    copy_through(
        |buf, pos| from.read_at(buf, pos),
        from_off,
        to,
        to_off,
        left,
    )
}

/// Copies by a buffer from whatever `read_at` reads; running out early is an error.
/// Copies as `copy_range` does, but shares the blocks (FICLONERANGE) of the
/// part of the range that lies on whole blocks of `block` bytes at the same
/// place in both files, where the filesystem allows (XFS, btrfs). Returns the
/// bytes shared.
pub fn copy_sharing(
    from: &File,
    from_off: u64,
    to: &File,
    to_off: u64,
    len: u64,
    block: u64,
) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    if block == 0 || from_off % block != to_off % block {
        copy_range(from, from_off, to, to_off, len)?;
        return Ok(0);
    }
    let head = ((block - from_off % block) % block).min(len);
    let body = (len - head) / block * block;
    copy_range(from, from_off, to, to_off, head)?;
    let mut shared = 0;
    if body > 0 {
        crate::testpoint::io("clone")?;
        let range = libc::file_clone_range {
            src_fd: from.as_raw_fd() as i64,
            src_offset: from_off + head,
            src_length: body,
            dest_offset: to_off + head,
        };
        // SAFETY: ioctl on valid descriptors with a sized argument.
        if unsafe { libc::ioctl(to.as_raw_fd(), libc::FICLONERANGE, &range) } == 0 {
            shared = body;
        } else {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY) => {
                    copy_range(from, from_off + head, to, to_off + head, body)?
                }
                _ => return Err(e),
            }
        }
    }
    let done = head + body;
    copy_range(from, from_off + done, to, to_off + done, len - done)?;
    Ok(shared)
}

pub(crate) fn copy_through(
    read_at: impl Fn(&mut [u8], u64) -> std::io::Result<usize>,
    mut from_off: u64,
    to: &File,
    mut to_off: u64,
    mut left: u64,
) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    if left > 0 {
        crate::testpoint::io("copy")?;
    }
    let mut buf = vec![0u8; (8 << 20).min(left as usize)];
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = read_at(&mut buf[..want], from_off)?;
        if n == 0 {
            return Err(short_read(
                "the file ended before the tensor did (truncated behind the mount?)",
            ));
        }
        to.write_all_at(&buf[..n], to_off)?;
        left -= n as u64;
        from_off += n as u64;
        to_off += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn copy_range_refuses_to_pad() {
        let mut from = tempfile::tempfile().unwrap();
        from.write_all(&[7u8; 100]).unwrap();
        let to = tempfile::tempfile().unwrap();
        copy_range(&from, 10, &to, 0, 90).unwrap();
        assert_eq!(to.metadata().unwrap().len(), 90);
        let e = copy_range(&from, 10, &to, 0, 91).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        let e = copy_by_buffer(&from, 50, &to, 0, 60).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
