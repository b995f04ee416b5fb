//! Why a header was refused. Every variant names the rule it broke and, where
//! one is involved, the tensor; `InFile` adds the file.

use std::fmt;
use std::path::PathBuf;

use super::Dtype;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The file is shorter than the 8-byte length prefix.
    #[error("file is {file_len} bytes, shorter than the 8-byte header length prefix")]
    TooShort { file_len: u64 },
    /// The header length prefix is above the 100,000,000-byte cap.
    #[error("header length {header_len} is above the 100000000-byte limit")]
    HeaderTooLarge { header_len: u64 },
    /// The header length prefix points past the end of the file.
    #[error("header length {header_len} runs past the end of the file ({file_len} bytes)")]
    HeaderTruncated { header_len: u64, file_len: u64 },
    /// The header bytes are not UTF-8.
    #[error("header is not valid UTF-8 (byte {at} of the header)")]
    HeaderNotUtf8 { at: usize },
    /// The header is not JSON of the expected shape (bad syntax, unknown dtype,
    /// missing field, non-string metadata value, ...).
    #[error("{}", match tensor {
        Some(t) => format!("tensor {t:?}: invalid header entry: {message}"),
        None => format!("header is not a valid safetensors JSON object: {message}"),
    })]
    HeaderJson {
        tensor: Option<String>,
        message: String,
    },
    /// Taken in offset order, tensors must start at 0, be contiguous and have end >= begin.
    #[error("tensor {tensor:?}: data_offsets [{begin}, {end}] {}", if end < begin {
        "end before they begin".to_string()
    } else {
        format!("should begin at {expected_begin} (tensors must be contiguous from offset 0, \
                 without gaps or overlaps)")
    })]
    InvalidOffsets {
        tensor: String,
        begin: u64,
        end: u64,
        expected_begin: u64,
    },
    /// elements x bits overflowed 64 bits.
    #[error(
        "tensor {tensor:?}: shape {} has a byte size that overflows 64 bits",
        ShapeDisplay(shape)
    )]
    Overflow { tensor: String, shape: Vec<u64> },
    /// A sub-byte dtype whose total bit count is not a multiple of 8.
    #[error(
        "tensor {tensor:?}: {dtype} {} is not a whole number of bytes",
        ShapeDisplay(shape)
    )]
    NotByteAligned {
        tensor: String,
        dtype: Dtype,
        shape: Vec<u64>,
    },
    /// data_offsets span a different byte count than dtype x shape needs.
    #[error(
        "tensor {tensor:?}: data_offsets [{begin}, {end}] span {} bytes but {dtype} {} needs {needed}",
        end - begin,
        ShapeDisplay(shape)
    )]
    SizeMismatch {
        tensor: String,
        dtype: Dtype,
        shape: Vec<u64>,
        begin: u64,
        end: u64,
        needed: u64,
    },
    /// 8 + header length + end of the last tensor must equal the file length.
    #[error(
        "file is {file_len} bytes but 8 + header {header_len} + tensor data {data_len} = {}",
        8u128 + *header_len as u128 + *data_len as u128
    )]
    LengthMismatch {
        header_len: u64,
        data_len: u64,
        file_len: u64,
    },
    /// Serializer input names one tensor twice.
    #[error("tensor {tensor:?} is given twice")]
    DuplicateName { tensor: String },
    /// A tensor may not be named `__metadata__`: that key is the metadata.
    #[error(
        "tensor {tensor:?}: a tensor cannot be named __metadata__ (the header keeps that key for \
         the metadata)"
    )]
    ReservedName { tensor: String },
    /// A GGUF file broke one of ggml's rules.
    #[error("{0}")]
    Gguf(#[from] super::gguf::GgufError),
}

impl crate::errno::ToErrno for FormatError {
    /// A file the reference refuses: invalid input.
    fn to_errno(&self) -> i32 {
        libc::EINVAL
    }
}

impl FormatError {
    /// The tensor the error is about, if any.
    pub fn tensor(&self) -> Option<&str> {
        use FormatError::*;
        match self {
            HeaderJson { tensor, .. } => tensor.as_deref(),
            InvalidOffsets { tensor, .. }
            | Overflow { tensor, .. }
            | NotByteAligned { tensor, .. }
            | SizeMismatch { tensor, .. }
            | DuplicateName { tensor }
            | ReservedName { tensor } => Some(tensor),
            Gguf(e) => e.tensor.as_deref(),
            _ => None,
        }
    }

    pub fn in_file(self, path: impl Into<PathBuf>) -> InFile {
        InFile {
            path: path.into(),
            error: self,
        }
    }
}

/// A shape as the header writes it: `[2, 3]`.
pub(crate) struct ShapeDisplay<'a>(pub &'a [u64]);

impl fmt::Display for ShapeDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// A format error with the file it was found in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {error}", path.display())]
pub struct InFile {
    pub path: PathBuf,
    pub error: FormatError,
}

crate::failure_from!(InFile);

impl crate::errno::ToErrno for InFile {
    fn to_errno(&self) -> i32 {
        self.error.to_errno()
    }
}
