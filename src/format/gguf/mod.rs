//! GGUF, llama.cpp's checkpoint format: read and validated with the same
//! accept/reject decisions as ggml's C reader (`gguf.cpp`), the reference
//! here as the `safetensors` crate is for safetensors. Little-endian, v2 and
//! v3 (identical): `"GGUF"`, u32 version, i64 tensor count, i64 key count,
//! the keys and values, the tensor infos, padding to `general.alignment`,
//! then the data, each tensor padded to the alignment. The rules are in
//! docs/FORMAT.md ("GGUF").
//!
//! The key-value section is walked, not copied: a 150,000-entry tokenizer
//! array is an offset and a length until someone asks for its items.

use super::Dtype;

mod parse;
mod show;
#[cfg(test)]
pub(crate) mod tests;
pub mod write;

pub use parse::*;
pub use show::*;

/// A ggml tensor type: its id in the file and the element type it is (whose
/// name is ggml's and whose block, `Dtype::block`, is ggml's: `block`
/// elements in `block_bytes` bytes, 1 element for plain types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub dtype: Dtype,
}

impl GgmlType {
    pub fn name(&self) -> &'static str {
        self.dtype.name()
    }

    /// Elements per block.
    pub fn block(&self) -> u64 {
        self.dtype.block().0
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.dtype.block().1 / 8
    }
}

const fn t(id: u32, dtype: Dtype) -> GgmlType {
    GgmlType { id, dtype }
}

/// ggml's type table (`ggml.c`, as of llama.cpp in node-llama-cpp 3.21.1).
/// Ids 4, 5, 31-33 and 36-38 were removed: files using them are refused.
pub const GGML_TYPES: &[GgmlType] = &[
    t(0, Dtype::F32),
    t(1, Dtype::F16),
    t(2, Dtype::Q4_0),
    t(3, Dtype::Q4_1),
    t(6, Dtype::Q5_0),
    t(7, Dtype::Q5_1),
    t(8, Dtype::Q8_0),
    t(9, Dtype::Q8_1),
    t(10, Dtype::Q2_K),
    t(11, Dtype::Q3_K),
    t(12, Dtype::Q4_K),
    t(13, Dtype::Q5_K),
    t(14, Dtype::Q6_K),
    t(15, Dtype::Q8_K),
    t(16, Dtype::IQ2_XXS),
    t(17, Dtype::IQ2_XS),
    t(18, Dtype::IQ3_XXS),
    t(19, Dtype::IQ1_S),
    t(20, Dtype::IQ4_NL),
    t(21, Dtype::IQ3_S),
    t(22, Dtype::IQ2_S),
    t(23, Dtype::IQ4_XS),
    t(24, Dtype::I8),
    t(25, Dtype::I16),
    t(26, Dtype::I32),
    t(27, Dtype::I64),
    t(28, Dtype::F64),
    t(29, Dtype::IQ1_M),
    t(30, Dtype::BF16),
    t(34, Dtype::TQ1_0),
    t(35, Dtype::TQ2_0),
    t(39, Dtype::MXFP4),
    t(40, Dtype::NVFP4),
    t(41, Dtype::Q1_0),
    t(42, Dtype::Q2_0),
];

/// The type of this id, if ggml has it (removed and unknown ids: None).
pub fn ggml_type(id: u32) -> Option<&'static GgmlType> {
    GGML_TYPES.iter().find(|t| t.id == id)
}

/// The type of a value of the key-value section.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    /// Every type, in id order.
    pub const ALL: [ValueType; 13] = [
        ValueType::U8,
        ValueType::I8,
        ValueType::U16,
        ValueType::I16,
        ValueType::U32,
        ValueType::I32,
        ValueType::F32,
        ValueType::Bool,
        ValueType::String,
        ValueType::Array,
        ValueType::U64,
        ValueType::I64,
        ValueType::F64,
    ];

    fn from_id(id: i32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// GGUF's name of the type, as gguf-py spells it.
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "UINT8",
            I8 => "INT8",
            U16 => "UINT16",
            I16 => "INT16",
            U32 => "UINT32",
            I32 => "INT32",
            F32 => "FLOAT32",
            Bool => "BOOL",
            String => "STRING",
            Array => "ARRAY",
            U64 => "UINT64",
            I64 => "INT64",
            F64 => "FLOAT64",
        }
    }

    /// Bytes of one value of a fixed-size type.
    fn size(self) -> Option<u64> {
        use ValueType::*;
        Some(match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            String | Array => return None,
        })
    }
}

/// A value of the key-value section. Strings are bytes (ggml does not ask
/// for UTF-8); an array is where its items are in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    /// Stored as one byte (ggml reads an int8).
    Bool(u8),
    String(Vec<u8>),
    /// A string of a key longer than `LONG_STRING` bytes, left in the file
    /// (where its bytes are): a file whose keys hold a gigabyte costs a
    /// mount no more memory than one whose keys hold little.
    StringAt {
        at: u64,
        len: u64,
    },
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// An array value: `len` items of `item` type, starting at byte `at` of the
/// file and taking `bytes` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Array {
    pub item: ValueType,
    pub len: u64,
    pub at: u64,
    pub bytes: u64,
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) | Value::StringAt { .. } => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }
}

/// A tensor info: its name, dims as stored (`ne`, innermost first, 1 to 4 of
/// them), type, offset from the data start, and bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub ne: Vec<u64>,
    pub ggml_type: &'static GgmlType,
    pub offset: u64,
    pub nbytes: u64,
}

impl TensorInfo {
    /// The shape in row-major order (outermost first), as numpy shows it.
    pub fn shape(&self) -> Vec<u64> {
        self.ne.iter().rev().copied().collect()
    }
}

/// A validated GGUF file's header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub kvs: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_start: u64,
    /// Bytes of the data section the tensors span (with their padding).
    pub data_len: u64,
    /// The first tensor name or key that is not UTF-8 (shown lossily, so
    /// two such names may look the same): why the file cannot be mounted.
    pub not_utf8: Option<GgufError>,
}

/// What a file breaks: the rule, and the tensor or key it is about.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{rule}", match (tensor, key) {
    (Some(t), _) => format!("tensor {t:?}: "),
    (None, Some(k)) => format!("key {k:?}: "),
    (None, None) => String::new(),
})]
pub struct GgufError {
    pub tensor: Option<String>,
    pub key: Option<String>,
    pub rule: String,
}

fn refused(rule: impl Into<String>) -> GgufError {
    GgufError {
        tensor: None,
        key: None,
        rule: rule.into(),
    }
}

/// The GGUF magic, at the file's start.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// Longest tensor name: ggml's GGML_MAX_NAME (64) less its NUL.
pub const MAX_NAME: usize = 63;
/// Longest string ggml reads.
const MAX_STRING: u64 = 1 << 30;
const DEFAULT_ALIGNMENT: u64 = 32;

/// Whether the file starts with the GGUF magic.
pub fn is_gguf(start: &[u8]) -> bool {
    start.starts_with(MAGIC)
}

/// Whether a file's name says it is GGUF (`.gguf`): such a file is read as
/// GGUF whatever it holds, so that a damaged one is refused as GGUF.
pub fn named_gguf(name: &std::ffi::OsStr) -> bool {
    name.as_encoded_bytes().ends_with(b".gguf")
}

/// Whether `path` is a regular file that starts with the GGUF magic (opened
/// without blocking, so a FIFO named by mistake does not hang the caller).
pub fn is_gguf_file(path: &std::path::Path) -> bool {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let mut start = [0u8; 4];
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .and_then(|f| {
            if !f.metadata()?.is_file() {
                return Err(std::io::ErrorKind::InvalidInput.into());
            }
            f.read_exact_at(&mut start, 0)
        })
        .is_ok_and(|()| is_gguf(&start))
}
