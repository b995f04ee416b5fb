//! One live checkpoint: the validated, mapped source file. Plain Rust, no FUSE.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use memmap2::{Advice, Mmap, UncheckedAdvice};

use crate::format::{FormatError, Header};

mod live;

pub use live::{
    CommitError, CommitPlan, Live, StagingCopy, Tensor, TensorBytes, TensorId, Written,
};

/// What identifies the file a checkpoint was opened from, to detect a source
/// replaced or rewritten behind the mount.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
}

impl FileIdentity {
    pub fn of(meta: &std::fs::Metadata) -> FileIdentity {
        use std::os::unix::fs::MetadataExt;
        FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
        }
    }
}

pub struct Checkpoint {
    path: PathBuf,
    /// Kept open: commits copy unchanged bytes from it with copy_file_range.
    file: File,
    identity: FileIdentity,
    mode: u32,
    /// The whole source file, mapped read-only and shared with the page cache.
    map: Mmap,
    header: Header,
    modified: SystemTime,
}

impl Checkpoint {
    /// Maps and validates a checkpoint. The error names the file and the rule.
    pub fn open(path: &Path) -> Result<Checkpoint, String> {
        let what = |e: std::io::Error| format!("{}: {e}", path.display());
        let file = File::open(path).map_err(what)?;
        let meta = file.metadata().map_err(what)?;
        if !meta.is_file() {
            return Err(format!("{}: not a regular file", path.display()));
        }
        if meta.len() < 8 {
            return Err(FormatError::TooShort {
                file_len: meta.len(),
            }
            .in_file(path)
            .to_string());
        }
        // SAFETY: the mapping is read-only; stfs never writes the source in place
        // (commits replace it by rename), so its bytes do not change under us
        // unless another program rewrites the file, which commit detects.
        let map = unsafe { Mmap::map(&file) }.map_err(what)?;
        let header = Header::parse(&map).map_err(|e| e.in_file(path).to_string())?;
        use std::os::unix::fs::PermissionsExt;
        Ok(Checkpoint {
            path: path.to_path_buf(),
            identity: FileIdentity::of(&meta),
            mode: meta.permissions().mode() & 0o7777,
            file,
            map,
            header,
            modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// Permission bits of the source, kept by commits.
    pub fn mode(&self) -> u32 {
        self.mode
    }

    pub fn header(&self) -> &Header {
        &self.header
    }

    pub fn modified(&self) -> SystemTime {
        self.modified
    }

    /// Byte range of tensor `index` in the file.
    pub fn tensor_range(&self, index: usize) -> Range<u64> {
        let t = &self.header.tensors[index];
        let start = self.header.data_start();
        start + t.data_offsets.0..start + t.data_offsets.1
    }

    /// Serves bytes `offset..offset+size` of tensor `index` (clamped to its end)
    /// straight from the mapping. The range is faulted in with one
    /// MADV_POPULATE_READ first (measured faster than a fault per page), and the
    /// daemon's page-table references are dropped after: the pages stay in the
    /// page cache, but not in the daemon's RSS.
    pub fn serve_tensor<R>(
        &self,
        index: usize,
        offset: u64,
        size: u32,
        serve: impl FnOnce(&[u8]) -> R,
    ) -> R {
        let range = self.tensor_range(index);
        let start = range.start.saturating_add(offset).min(range.end);
        let end = start.saturating_add(size as u64).min(range.end);
        let (start, end) = (start as usize, end as usize);
        if end > start {
            // Best effort: kernels before 5.14 refuse the advice; reads still work.
            let _ = self
                .map
                .advise_range(Advice::PopulateRead, start, end - start);
        }
        let result = serve(&self.map[start..end]);
        self.release(start..end);
        result
    }

    fn release(&self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        // memmap2 rounds the start down to a page; madvise rounds the length up.
        // SAFETY: the mapping is shared, read-only and file-backed: dropping its
        // pages only makes a later access fault them in again from the page
        // cache with the same contents, so concurrent readers are unaffected.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, range.start, range.len())
        };
    }
}
