//! Filesystem errors and the one place they become errno values.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// An operation stfs does not do: mkdir, symlink, link, mknod, xattrs (ENOTSUP or EPERM).
    NotSupported(&'static str),
    /// A file name over 255 bytes (ENAMETOOLONG).
    NameTooLong,
    /// Refused for this entry: removing a `.meta.json`, hard links (EPERM).
    NotPermitted(&'static str),
    /// A rename between two checkpoints: mv then copies (EXDEV).
    CrossDevice,
    /// The target exists and the caller asked not to replace it (EEXIST).
    Exists,
    /// A JSON edit over the size limit (EFBIG).
    TooLarge,
    /// An I/O error from the backing filesystem, with its errno.
    Io(i32),
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
            FsError::CrossDevice => libc::EXDEV,
            FsError::Exists => libc::EEXIST,
            FsError::TooLarge => libc::EFBIG,
            FsError::Io(errno) => *errno,
        }
    }
}

impl From<std::io::Error> for FsError {
    fn from(e: std::io::Error) -> Self {
        FsError::Io(e.raw_os_error().unwrap_or(libc::EIO))
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
            FsError::CrossDevice => {
                f.write_str("rename between two checkpoints (mv copies instead)")
            }
            FsError::Exists => f.write_str("exists"),
            FsError::TooLarge => f.write_str("JSON edit over 16 MiB"),
            FsError::Io(errno) => write!(f, "{}", std::io::Error::from_raw_os_error(*errno)),
        }
    }
}
