//! Why a header was refused. Every variant names the rule it broke and, where
//! one is involved, the tensor; `InFile` adds the file.

use std::fmt;
use std::path::PathBuf;

use super::Dtype;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    /// The file is shorter than the 8-byte length prefix.
    TooShort { file_len: u64 },
    /// The header length prefix is above the 100,000,000-byte cap.
    HeaderTooLarge { header_len: u64 },
    /// The header length prefix points past the end of the file.
    HeaderTruncated { header_len: u64, file_len: u64 },
    /// The header bytes are not UTF-8.
    HeaderNotUtf8 { at: usize },
    /// The header is not JSON of the expected shape (bad syntax, unknown dtype,
    /// missing field, non-string metadata value, ...).
    HeaderJson {
        tensor: Option<String>,
        message: String,
    },
    /// Taken in offset order, tensors must start at 0, be contiguous and have end >= begin.
    InvalidOffsets {
        tensor: String,
        begin: u64,
        end: u64,
        expected_begin: u64,
    },
    /// elements x bits overflowed 64 bits.
    Overflow { tensor: String, shape: Vec<u64> },
    /// A sub-byte dtype whose total bit count is not a multiple of 8.
    NotByteAligned {
        tensor: String,
        dtype: Dtype,
        shape: Vec<u64>,
    },
    /// data_offsets span a different byte count than dtype x shape needs.
    SizeMismatch {
        tensor: String,
        dtype: Dtype,
        shape: Vec<u64>,
        begin: u64,
        end: u64,
        needed: u64,
    },
    /// 8 + header length + end of the last tensor must equal the file length.
    LengthMismatch {
        header_len: u64,
        data_len: u64,
        file_len: u64,
    },
    /// Serializer input names one tensor twice.
    DuplicateName { tensor: String },
    /// A tensor may not be named `__metadata__`: that key is the metadata.
    ReservedName { tensor: String },
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

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use FormatError::*;
        match self {
            TooShort { file_len } => write!(
                f,
                "file is {file_len} bytes, shorter than the 8-byte header length prefix"
            ),
            HeaderTooLarge { header_len } => write!(
                f,
                "header length {header_len} is above the 100000000-byte limit"
            ),
            HeaderTruncated {
                header_len,
                file_len,
            } => write!(
                f,
                "header length {header_len} runs past the end of the file ({file_len} bytes)"
            ),
            HeaderNotUtf8 { at } => write!(f, "header is not valid UTF-8 (byte {at} of the header)"),
            HeaderJson {
                tensor: Some(t),
                message,
            } => write!(f, "tensor {t:?}: invalid header entry: {message}"),
            HeaderJson {
                tensor: None,
                message,
            } => write!(f, "header is not a valid safetensors JSON object: {message}"),
            InvalidOffsets {
                tensor,
                begin,
                end,
                expected_begin,
            } => {
                if end < begin {
                    write!(f, "tensor {tensor:?}: data_offsets [{begin}, {end}] end before they begin")
                } else {
                    write!(
                        f,
                        "tensor {tensor:?}: data_offsets [{begin}, {end}] should begin at {expected_begin} \
                         (tensors must be contiguous from offset 0, without gaps or overlaps)"
                    )
                }
            }
            Overflow { tensor, shape } => write!(
                f,
                "tensor {tensor:?}: shape {} has a byte size that overflows 64 bits",
                ShapeDisplay(shape)
            ),
            NotByteAligned {
                tensor,
                dtype,
                shape,
            } => write!(
                f,
                "tensor {tensor:?}: {dtype} {} is not a whole number of bytes",
                ShapeDisplay(shape)
            ),
            SizeMismatch {
                tensor,
                dtype,
                shape,
                begin,
                end,
                needed,
            } => write!(
                f,
                "tensor {tensor:?}: data_offsets [{begin}, {end}] span {} bytes but {dtype} {} needs {needed}",
                end - begin,
                ShapeDisplay(shape)
            ),
            LengthMismatch {
                header_len,
                data_len,
                file_len,
            } => write!(
                f,
                "file is {file_len} bytes but 8 + header {header_len} + tensor data {data_len} = {}",
                8u128 + *header_len as u128 + *data_len as u128
            ),
            DuplicateName { tensor } => write!(f, "tensor {tensor:?} is given twice"),
            ReservedName { tensor } => write!(
                f,
                "tensor {tensor:?}: a tensor cannot be named __metadata__ (the header keeps that key for the metadata)"
            ),
        }
    }
}

impl std::error::Error for FormatError {}

/// A format error with the file it was found in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFile {
    pub path: PathBuf,
    pub error: FormatError,
}

impl fmt::Display for InFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.error)
    }
}

impl std::error::Error for InFile {}
