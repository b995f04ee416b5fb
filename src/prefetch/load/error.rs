//! Why a load failed or was refused, and the errno each reason gets.

/// Why a load failed or was refused.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No driver library, no such device, or the driver did not start (ENODEV).
    #[error("{0}")]
    NoDevice(String),
    /// The device or host allocation failed (ENOMEM).
    #[error("{0}")]
    OutOfMemory(String),
    /// Another driver call failed (EIO).
    #[error("{0}")]
    Device(String),
    /// Reading a tensor's bytes failed.
    #[error("reading tensor {tensor:?} (byte {at} of its file): {source}")]
    Read {
        tensor: String,
        at: u64,
        #[source]
        source: std::io::Error,
    },
    /// The descriptor that asked was closed before the load finished.
    #[error("the load was cancelled")]
    Cancelled,
    #[error("no tensor {0:?} in this mount")]
    NoSuchTensor(String),
    /// A bad request: a glob that does not parse, too many names, an
    /// unknown load.
    #[error("{0}")]
    Invalid(String),
    /// A load's failure as its progress keeps it: the errno, and why.
    #[error("{1}")]
    Failed(i32, String),
}

impl crate::errno::ToErrno for LoadError {
    fn to_errno(&self) -> i32 {
        match self {
            LoadError::NoDevice(_) => libc::ENODEV,
            LoadError::OutOfMemory(_) => libc::ENOMEM,
            LoadError::Device(_) => libc::EIO,
            LoadError::Read { source, .. } => source.to_errno(),
            LoadError::Cancelled => libc::ECANCELED,
            LoadError::NoSuchTensor(_) => libc::ENOENT,
            LoadError::Invalid(_) => libc::EINVAL,
            LoadError::Failed(errno, _) => *errno,
        }
    }
}
