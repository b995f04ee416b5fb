//! In-place commits (docs/SEMANTICS.md, "Commit"; docs/ARCHITECTURE.md): when the
//! edits keep the data section as it is except at its end, the file is
//! changed where it is instead of rewritten. The header is rewritten in its
//! own space (padded with spaces), new tensors are appended, dropped tail
//! tensors truncated, and tensors of the same size overwritten.
//!
//! Only while no other program has the file open or mapped: a write lease on
//! the daemon's own descriptor (the one it maps through) is refused while any
//! other exists, and makes any later open wait until the commit is done.
//!
//! Crash safety, as a redo journal: a record of everything to write (the
//! new header, every range and where its bytes come from, the file's version
//! before and after) is made durable in the staging folder first. Then the
//! length prefix is overwritten with `IN_PLACE_MARKER`, which every reader
//! refuses; the data and header are written and synced; the real prefix goes
//! in last, one aligned 8-byte write. A kill at any moment leaves the old
//! file, the new one, or one every reader refuses until the next mount
//! completes it from the record (`InPlaceRecord::complete`). Every step can
//! be done again, so completing is doing it all again.

mod apply;
mod complete;
mod lease;
mod plan;
mod record;
pub use apply::*;
pub use lease::Lease;
pub use plan::layout;
pub use record::*;

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::checkpoint::recovery_error::RecoveryError;
use crate::format::{Header, IN_PLACE_MARKER, Layout, PREFIX_LEN};
use crate::source::Folder;
use crate::source::staged::{STAGING_ALIGN, staged_pad};
use crate::source::{FileStat, copy_range, copy_sharing};
use crate::testpoint::point;

/// Why a redo record cannot be trusted: checked before anything is written.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadRecord(pub(crate) String);

impl crate::errno::ToErrno for BadRecord {
    /// A redo record that does not hold is damaged data.
    fn to_errno(&self) -> i32 {
        libc::EIO
    }
}

/// A range of the new file and where its bytes come from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RangeWrite {
    /// Offset in the file.
    pub at: u64,
    pub len: u64,
    pub from: WriteFrom,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub enum WriteFrom {
    /// A staging file (by its name in the staging folder), from `offset`
    /// bytes into its tensor (a block of a partly staged tensor; else 0).
    Staged {
        file: String,
        #[serde(default, skip_serializing_if = "is_zero")]
        offset: u64,
    },
    /// Another range of the same file, which this commit does not change.
    Here { offset: u64 },
    /// Zeros: the padding after a tensor placed where other bytes were (a
    /// GGUF file's alignment), so that no old bytes stay in the file.
    Zeros,
}

/// How a checkpoint's new state fits in its file: the layout (header padded
/// to the old header's length, tensors in file order) and what to write.
pub struct InPlaceLayout {
    pub layout: Layout,
    /// Bytes inserted at the file's start to grow the header (whole blocks).
    pub inserted: u64,
    /// The part of the header written: from `header_from` (at least 8:
    /// the first 8 bytes go in last) to `header_write`.
    pub header_from: u64,
    pub header_write: u64,
    /// For each write, the input (index into the plan's inputs) it copies.
    pub writes: Vec<(RangeWrite, usize)>,
    pub file_len: u64,
    /// Bytes written, header included.
    pub bytes: u64,
    /// Of `bytes`, those a filesystem that clones ranges can share with the
    /// staging files (whole blocks at the same place within a block): set by
    /// the planner when the file's filesystem clones (`expect_sharing`).
    pub shareable: u64,
    /// What changes, in words ("header, 1 tensor appended").
    pub summary: String,
}

impl InPlaceLayout {
    /// The file's filesystem clones ranges: the bytes of staging files that
    /// sit at the same place within a block as their target are expected
    /// to be shared, not copied.
    pub fn expect_sharing(&mut self) {
        self.shareable = self
            .writes
            .iter()
            .filter_map(|(w, _)| match &w.from {
                WriteFrom::Staged { file, offset } => {
                    Some(shareable_blocks(staged_pad(file) + offset, w.at, w.len))
                }
                WriteFrom::Here { .. } | WriteFrom::Zeros => None,
            })
            .sum();
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The whole blocks of `len` bytes at `from` copied to `to` that a clone can
/// share (none unless both lie at the same place within a block).
pub fn shareable_blocks(from: u64, to: u64, len: u64) -> u64 {
    if from % STAGING_ALIGN != to % STAGING_ALIGN {
        return 0;
    }
    let head = ((STAGING_ALIGN - to % STAGING_ALIGN) % STAGING_ALIGN).min(len);
    (len - head) / STAGING_ALIGN * STAGING_ALIGN
}

#[cfg(test)]
mod tests;
