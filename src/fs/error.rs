//! Filesystem errors, and the one place where every error of stfs becomes an
//! errno: lower layers keep their own typed errors (with their sources), and
//! `FsError::errno` maps them all.

use std::fmt;

use crate::checkpoint::{CommitError, EditError};
use crate::prefetch::cuda::CudaError;
use crate::source::staged::StagingError;

#[derive(Debug)]
pub enum FsError {
    /// No such entry (ENOENT).
    NotFound,
    /// A file where a directory was needed (ENOTDIR).
    NotADirectory,
    /// A directory where a file was needed (EISDIR).
    IsADirectory,
    /// The mount or the entry does not accept writes (EROFS).
    ReadOnly,
    /// A name that is not a valid escape, or a bad argument (EINVAL).
    Invalid(String),
    /// An operation stfs does not do: mkdir, symlink, mknod, xattrs (ENOTSUP).
    NotSupported(&'static str),
    /// A file name over 255 bytes (ENAMETOOLONG).
    NameTooLong,
    /// Refused for this entry: hard links, the root of a folder mount (EPERM).
    NotPermitted(&'static str),
    /// Only the user who mounted (or root) may (EACCES).
    Denied(&'static str),
    /// The target exists and the caller asked not to replace it (EEXIST).
    Exists,
    /// The ioctl is for tensor files (ENOTTY).
    NotATensor,
    /// The caller went away, or the time limit passed (EINTR).
    Interrupted,
    /// The file an inode stood for is another one now (ESTALE: the kernel
    /// looks the name up again and retries).
    Stale,
    /// A limit of the daemon's memory: what is buffered for open JSON files (ENOSPC).
    NoSpace(&'static str),
    Edit(EditError),
    Commit(CommitError),
    Staging(StagingError),
    Cuda(CudaError),
    /// An I/O error of the backing filesystem.
    Io(std::io::Error),
}

impl FsError {
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::NotADirectory => libc::ENOTDIR,
            FsError::IsADirectory => libc::EISDIR,
            FsError::ReadOnly => libc::EROFS,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::NotSupported(_) => libc::ENOTSUP,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::NotPermitted(_) => libc::EPERM,
            FsError::Denied(_) => libc::EACCES,
            FsError::Exists => libc::EEXIST,
            FsError::NotATensor => libc::ENOTTY,
            FsError::Interrupted => libc::EINTR,
            FsError::Stale => libc::ESTALE,
            FsError::NoSpace(_) => libc::ENOSPC,
            FsError::Edit(e) => match e {
                EditError::NotFound => libc::ENOENT,
                EditError::Exists => libc::EEXIST,
                EditError::Invalid(_) => libc::EINVAL,
                EditError::TooLarge(_) => libc::EFBIG,
                EditError::Staging(s) => staging_errno(s),
                EditError::Io(e) => io_errno(e),
            },
            FsError::Commit(e) => commit_errno(e),
            FsError::Staging(s) => staging_errno(s),
            FsError::Cuda(e) => match e {
                CudaError::NoDriver(_) | CudaError::NoDevice(_) => libc::ENODEV,
                CudaError::OutOfMemory(_) => libc::ENOMEM,
                CudaError::Driver(_) => libc::EIO,
                CudaError::Io(e) => io_errno(e),
            },
            FsError::Io(e) => io_errno(e),
        }
    }

    /// Expected refusals (a missing name) are logged quietly.
    pub fn is_routine(&self) -> bool {
        matches!(
            self,
            FsError::NotFound | FsError::Exists | FsError::NotATensor
        )
    }
}

fn io_errno(e: &std::io::Error) -> i32 {
    match e.raw_os_error() {
        Some(n) => n,
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => libc::EIO,
        None => libc::EIO,
    }
}

fn staging_errno(e: &StagingError) -> i32 {
    match e {
        StagingError::Io { source, .. } => io_errno(source),
        StagingError::Unsafe { .. } => libc::EACCES,
        StagingError::Busy { .. } => libc::EBUSY,
    }
}

impl From<std::io::Error> for FsError {
    fn from(e: std::io::Error) -> Self {
        FsError::Io(e)
    }
}

impl From<EditError> for FsError {
    fn from(e: EditError) -> Self {
        FsError::Edit(e)
    }
}

fn commit_errno(e: &CommitError) -> i32 {
    match e {
        CommitError::Refused { .. } => libc::EINVAL,
        CommitError::Conflict { .. } => libc::ESTALE,
        CommitError::Busy { .. } => libc::EBUSY,
        CommitError::Opened { .. } => libc::EAGAIN,
        CommitError::Tainted { .. } | CommitError::DiscardRefused { .. } => libc::EIO,
        CommitError::Io { source, .. } => io_errno(source),
        CommitError::Staging(s) => staging_errno(s),
        CommitError::ReadOnly { .. } => libc::EROFS,
        CommitError::NotLanded { source, .. } => commit_errno(source),
        CommitError::Discarded | CommitError::CommittedFirst => libc::ECANCELED,
    }
}

impl From<CommitError> for FsError {
    fn from(e: CommitError) -> Self {
        FsError::Commit(e)
    }
}

impl From<StagingError> for FsError {
    fn from(e: StagingError) -> Self {
        FsError::Staging(e)
    }
}

impl From<CudaError> for FsError {
    fn from(e: CudaError) -> Self {
        FsError::Cuda(e)
    }
}

impl fmt::Display for FsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FsError::NotFound => f.write_str("no such entry"),
            FsError::NotADirectory => f.write_str("not a directory"),
            FsError::IsADirectory => f.write_str("is a directory"),
            FsError::ReadOnly => f.write_str("read-only"),
            FsError::Invalid(why) => write!(f, "invalid: {why}"),
            FsError::NotSupported(op) => write!(f, "{op} is not supported"),
            FsError::NameTooLong => f.write_str("name too long"),
            FsError::NotPermitted(why) => f.write_str(why),
            FsError::Denied(what) => {
                write!(f, "{what} is for the user who mounted and for root")
            }
            FsError::Exists => f.write_str("exists"),
            FsError::NotATensor => {
                f.write_str("not a tensor file: prefetch works on a tensor's data file")
            }
            FsError::NoSpace(what) => write!(f, "no space: {what}"),
            FsError::Interrupted => {
                f.write_str("interrupted: the caller went away or time ran out")
            }
            FsError::Stale => f.write_str("stale: the view is another file now"),
            FsError::Edit(e) => write!(f, "{e}"),
            FsError::Commit(e) => write!(f, "{e}"),
            FsError::Staging(e) => write!(f, "{e}"),
            FsError::Cuda(e) => write!(f, "{e}"),
            FsError::Io(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for FsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FsError::Edit(e) => Some(e),
            FsError::Commit(e) => Some(e),
            FsError::Staging(e) => Some(e),
            FsError::Cuda(e) => Some(e),
            FsError::Io(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_errors_keep_their_errno() {
        let enospc = || std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(FsError::from(EditError::Io(enospc())).errno(), libc::ENOSPC);
        assert_eq!(
            FsError::from(CommitError::Io {
                what: "w".into(),
                source: enospc()
            })
            .errno(),
            libc::ENOSPC
        );
        assert_eq!(
            FsError::from(CommitError::Conflict { file: "f".into() }).errno(),
            libc::ESTALE
        );
        let eof = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "short");
        assert_eq!(FsError::from(eof).errno(), libc::EIO);
        assert_eq!(
            FsError::from(CudaError::NoDriver("x".into())).errno(),
            libc::ENODEV
        );
    }
}
