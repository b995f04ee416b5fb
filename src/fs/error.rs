//! Filesystem errors: the refusals of the FUSE layer, and the errors of the
//! layers below it (with their sources), each of which says its own errno.

use crate::checkpoint::{CommitError, EditError};
pub use crate::errno::ToErrno;
use crate::prefetch::load::LoadError;
use crate::source::staged::StagingError;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    /// No such entry (ENOENT).
    #[error("no such entry")]
    NotFound,
    /// A file where a directory was needed (ENOTDIR).
    #[error("not a directory")]
    NotADirectory,
    /// A directory where a file was needed (EISDIR).
    #[error("is a directory")]
    IsADirectory,
    /// The mount or the entry does not accept writes (EROFS).
    #[error("read-only")]
    ReadOnly,
    /// A file that only stfs writes, and why (EROFS).
    #[error("read-only: {0}")]
    ReadOnlyFile(&'static str),
    /// A name that is not a valid escape, or a bad argument (EINVAL).
    #[error("invalid: {0}")]
    Invalid(String),
    /// An operation stfs does not do: mkdir, symlink, mknod, xattrs (ENOTSUP).
    #[error("{0} is not supported")]
    NotSupported(&'static str),
    /// A file name over 255 bytes (ENAMETOOLONG).
    #[error("name too long")]
    NameTooLong,
    /// Refused for this entry: hard links, the root of a folder mount (EPERM).
    #[error("{0}")]
    NotPermitted(&'static str),
    /// Only the user who mounted (or root) may (EACCES).
    #[error("{0} is for the user who mounted and for root")]
    Denied(&'static str),
    /// The target exists and the caller asked not to replace it (EEXIST).
    #[error("exists")]
    Exists,
    /// A name that is not UTF-8, where one is made (EINVAL).
    #[error("a name that is not UTF-8")]
    NotUtf8,
    /// An ioctl stfs does not know (ENOTTY).
    #[error("unknown ioctl {0:#x}")]
    UnknownIoctl(u32),
    /// Extended attributes are not kept (ENOSYS: the kernel stops asking).
    #[error("no extended attributes")]
    NoXattrs,
    /// The ioctl is for tensor files (ENOTTY).
    #[error("not a tensor file: prefetch works on a tensor's data file")]
    NotATensor,
    /// The caller went away, or the time limit passed (EINTR).
    #[error("interrupted: the caller went away or time ran out")]
    Interrupted,
    /// The file an inode stood for is another one now (ESTALE: the kernel
    /// looks the name up again and retries).
    #[error("stale: the view is another file now")]
    Stale,
    /// A limit of the daemon's memory: what is buffered for open JSON files (ENOSPC).
    #[error("no space: {0}")]
    NoSpace(&'static str),
    #[error("{0}")]
    Edit(#[from] EditError),
    #[error("{0}")]
    Commit(#[from] CommitError),
    #[error("{0}")]
    Staging(#[from] StagingError),
    #[error("{0}")]
    Load(#[from] LoadError),
    /// An I/O error of the backing filesystem.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// A commit at unmount that failed; the edits are kept on disk.
#[derive(Debug, thiserror::Error)]
#[error(
    "commit at unmount failed: {source}. The source is unchanged; the staged edits are kept in \
     {kept} and the next `stfs mount` of this source takes them back (`stfs status` then lists \
     them)"
)]
pub struct UnmountError {
    // Boxed: FsError is large, and this travels in a Result.
    #[source]
    pub source: Box<FsError>,
    /// The staging folder that keeps them.
    pub kept: String,
}

/// An index is rewritten by commits to match the shards, never edited.
pub(crate) const INDEX_READ_ONLY: FsError =
    FsError::ReadOnlyFile("index files are rewritten by commits, not edited");

impl ToErrno for FsError {
    fn to_errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotADirectory => libc::ENOTDIR,
            FsError::IsADirectory => libc::EISDIR,
            FsError::ReadOnly | FsError::ReadOnlyFile(_) => libc::EROFS,
            FsError::Invalid(_) | FsError::NotUtf8 => libc::EINVAL,
            FsError::NotSupported(_) => libc::ENOTSUP,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::NotPermitted(_) => libc::EPERM,
            FsError::Denied(_) => libc::EACCES,
            FsError::Exists => libc::EEXIST,
            FsError::NotATensor | FsError::UnknownIoctl(_) => libc::ENOTTY,
            FsError::NoXattrs => libc::ENOSYS,
            FsError::Interrupted => libc::EINTR,
            FsError::Stale => libc::ESTALE,
            FsError::NoSpace(_) => libc::ENOSPC,
            FsError::Edit(e) => e.to_errno(),
            FsError::Commit(e) => e.to_errno(),
            FsError::Staging(e) => e.to_errno(),
            FsError::Load(e) => e.to_errno(),
            FsError::Io(e) => e.to_errno(),
        }
    }
}

impl FsError {
    /// Expected refusals (a missing name) are logged quietly.
    pub fn is_routine(&self) -> bool {
        // (`cp -a`, `rsync -X` and `tar --xattrs` try setxattr on every file.)
        matches!(
            self,
            FsError::NotFound
                | FsError::Exists
                | FsError::NotATensor
                | FsError::UnknownIoctl(_)
                | FsError::NotUtf8
                | FsError::NoXattrs
                | FsError::NotSupported("setxattr")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_expected_refusals_are_routine() {
        assert!(FsError::NotSupported("setxattr").is_routine());
        assert!(!FsError::NotSupported("rmdir").is_routine());
        assert!(!FsError::ReadOnly.is_routine());
    }

    #[test]
    fn nested_errors_keep_their_errno() {
        let enospc = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(
            FsError::from(EditError::Io(enospc())).to_errno(),
            libc::ENOSPC
        );
        assert_eq!(
            FsError::from(CommitError::Io {
                what: "w".into(),
                source: enospc()
            })
            .to_errno(),
            libc::ENOSPC
        );
        assert_eq!(
            FsError::from(CommitError::Conflict { file: "f".into() }).to_errno(),
            libc::ESTALE
        );
        let eof = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short");
        assert_eq!(FsError::from(eof).to_errno(), libc::EIO);
        assert_eq!(
            FsError::from(LoadError::NoDevice("x".into())).to_errno(),
            libc::ENODEV
        );
        use crate::fs::views::ViewError;
        for (e, want) in [
            (ViewError::NotAView, libc::ENOENT),
            (ViewError::Invalid("x".into()), libc::EINVAL),
        ] {
            assert_eq!(e.to_errno(), want);
            assert_eq!(
                FsError::from(e).to_errno(),
                want,
                "the same through the mount"
            );
        }
    }
}
