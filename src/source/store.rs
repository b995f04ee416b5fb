//! Where a checkpoint's bytes live. A `SourceFile` is a validated header
//! over a `Store`: a local file (`local::LocalFile`: mapped, its version
//! checked by length and time, written in place by commits, with clones and
//! block insertion where the filesystem has them) or a remote object
//! (`remote::RemoteObject`: ranged reads through the disk cache, its
//! version an ETag). Reads and version checks go through the trait; what
//! only one kind can do (an in-place commit, a multipart upload) is reached
//! through `as_any` (a `LocalFile`, downcast where it is defined) and
//! `remote`, and each commit way asks for the one it needs.

use std::ops::Range;
use std::path::Path;

use super::FileStat;
use super::remote::RemoteObject;

pub trait Store: Send + Sync {
    /// Hands bytes `range` of the file (offsets as the source's header
    /// knows them) to `serve`, once. `tensor` (index, name, byte range) is
    /// the tensor they are of: named in the log if the read fails, and read
    /// ahead where the store fetches. `path` names the source in the log.
    fn serve(
        &self,
        range: Range<u64>,
        tensor: (u32, &str, Range<u64>),
        path: &Path,
        serve: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()>;

    /// Reads bytes at `pos` into `buf` (fewer at the end): `pos` taken when
    /// `seen` bytes had been inserted at the file's start (see `shift`).
    fn read_at(&self, buf: &mut [u8], pos: u64, seen: u64, path: &Path) -> std::io::Result<usize>;

    /// EIO (the reason logged once) if the bytes are no longer the version
    /// validated: changed or cut behind the mount.
    fn check_unchanged(&self, path: &Path) -> std::io::Result<()>;

    /// `stat` (the source as validated) with its owner, group and mode as
    /// they are now: what the mount shows and the kernel enforces.
    fn owner_now(&self, stat: &FileStat) -> FileStat;

    /// Bytes inserted at the file's start since this source was made.
    fn shift(&self) -> u64 {
        0
    }

    /// The store itself, for what only one kind can do: a `LocalFile`
    /// (in-place commits and clones) is found by downcasting.
    fn as_any(&self) -> &dyn std::any::Any;

    /// A remote object: what remote commits need.
    fn remote(&self) -> Option<&RemoteObject> {
        None
    }
}

impl Store for RemoteObject {
    fn serve(
        &self,
        range: Range<u64>,
        tensor: (u32, &str, Range<u64>),
        _path: &Path,
        serve: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()> {
        RemoteObject::serve(self, range, Some(tensor), serve)
    }

    fn read_at(
        &self,
        buf: &mut [u8],
        pos: u64,
        _seen: u64,
        _path: &Path,
    ) -> std::io::Result<usize> {
        let kept = self.head().and_then(|h| h.get(pos as usize..));
        if let Some(kept) = kept.filter(|k| !k.is_empty()) {
            let n = kept.len().min(buf.len());
            buf[..n].copy_from_slice(&kept[..n]);
            return Ok(n);
        }
        let end = pos.saturating_add(buf.len() as u64).min(self.data_end());
        if end <= pos {
            return Ok(0);
        }
        let bytes = self.read(pos..end)?;
        buf[..bytes.len()].copy_from_slice(&bytes);
        Ok(bytes.len())
    }

    fn check_unchanged(&self, _path: &Path) -> std::io::Result<()> {
        RemoteObject::check_unchanged(self)
    }

    /// The user who mounted it (a store has no owners stfs could show).
    fn owner_now(&self, stat: &FileStat) -> FileStat {
        *stat
    }

    fn remote(&self) -> Option<&RemoteObject> {
        Some(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
