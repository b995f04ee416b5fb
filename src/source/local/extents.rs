//! What the filesystem under a file can do with its blocks: insert and
//! collapse ranges at its start (ext4, XFS), share extents between files
//! (XFS, btrfs).

use super::*;

/// FALLOC_FL_INSERT_RANGE of `len` bytes at offset 0 (ext4 and XFS, whole blocks).
pub fn insert_range(file: &File, len: u64) -> std::io::Result<()> {
    shift_range(file, rustix::fs::FallocateFlags::INSERT_RANGE, len)
}

/// Takes `len` bytes (whole blocks) off the start of `file`, moving the
/// rest down: the undoing of `insert_range`.
pub fn collapse_range(file: &File, len: u64) -> std::io::Result<()> {
    shift_range(file, rustix::fs::FallocateFlags::COLLAPSE_RANGE, len)
}

fn shift_range(file: &File, mode: rustix::fs::FallocateFlags, len: u64) -> std::io::Result<()> {
    Ok(rustix::fs::fallocate(file, mode, 0, len)?)
}

pub(super) const EXT4: i64 = 0xEF53;

pub(super) const XFS: i64 = 0x5846_5342;

pub(super) const BTRFS: i64 = 0x9123_683E;

/// The type (statfs magic) and block size of the filesystem holding `file`.
pub(super) fn filesystem(file: &File) -> Option<(i64, u64)> {
    let st = rustix::fs::fstatfs(file).ok()?;
    Some((st.f_type as i64, st.f_bsize as u64))
}

/// Whether the filesystem holding `file` may share blocks between files
/// (XFS with reflink, btrfs), and its block size.
pub fn shares_extents(file: &File) -> Option<u64> {
    filesystem(file).and_then(|(kind, block)| matches!(kind, XFS | BTRFS).then_some(block))
}

/// Whether the filesystem holding `file` inserts blocks (FALLOC_FL_INSERT_RANGE):
/// ext4 and XFS; and its block size.
pub fn inserts_blocks(file: &File) -> Option<u64> {
    filesystem(file).and_then(|(kind, block)| matches!(kind, EXT4 | XFS).then_some(block))
}
