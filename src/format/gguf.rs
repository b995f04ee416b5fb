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

#[path = "gguf_write.rs"]
pub mod write;

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

/// Reads little-endian values from the file (or the first bytes of it that
/// `buf` holds), never past its end.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    /// The file's length (`buf` may hold only its start).
    file_len: u64,
    /// Set when a read needed bytes past `buf` that the file has.
    short: bool,
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8], file_len: u64) -> Reader<'a> {
        Reader {
            buf,
            at: 0,
            file_len,
            short: false,
        }
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        let end = (self.at as u64).saturating_add(n);
        if end > self.buf.len() as u64 && end <= self.file_len {
            self.short = true;
        }
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.at.checked_add(n))
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| refused(format!("the file ends inside {what} (at byte {})", self.at)))?;
        let out = &self.buf[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn i32(&mut self, what: &str) -> Result<i32, GgufError> {
        Ok(i32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn i64(&mut self, what: &str) -> Result<i64, GgufError> {
        Ok(i64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<&'a [u8], GgufError> {
        let len = self.u64(what)?;
        if len > MAX_STRING {
            return Err(refused(format!(
                "{what} is {len} bytes long, past ggml's limit of 1 GiB"
            )));
        }
        self.take(len, what)
    }

    /// A key's value of `ty`: as `value`, a long string left where it is.
    fn kv_value(&mut self, ty: ValueType, what: &str) -> Result<Value, GgufError> {
        if ty != ValueType::String {
            return self.value(ty, what);
        }
        let s = self.string(what)?;
        if s.len() as u64 <= LONG_STRING {
            return Ok(Value::String(s.to_vec()));
        }
        let at = (self.at - s.len()) as u64;
        Ok(Value::StringAt {
            at,
            len: s.len() as u64,
        })
    }

    /// A value of `ty`; arrays are walked (their strings checked) but not kept.
    fn value(&mut self, ty: ValueType, what: &str) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(what)?[0] as i8),
            ValueType::Bool => Value::Bool(self.array::<1>(what)?[0]),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.i32(what)?),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.i64(what)?),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            ValueType::String => Value::String(self.string(what)?.to_vec()),
            ValueType::Array => {
                let id = self.i32(what)?;
                let item = ValueType::from_id(id)
                    .ok_or_else(|| refused(format!("{what}: an array of unknown type {id}")))?;
                if item == ValueType::Array {
                    return Err(refused(format!(
                        "{what}: an array of arrays (ggml refuses nested arrays)"
                    )));
                }
                let len = self.u64(what)?;
                let at = self.at as u64;
                match item.size() {
                    Some(size) => {
                        let bytes = len.checked_mul(size).ok_or_else(|| {
                            refused(format!("{what}: an array of {len} items overflows"))
                        })?;
                        self.take(bytes, what)?;
                    }
                    None => {
                        for _ in 0..len {
                            self.string(what)?;
                        }
                    }
                }
                Value::Array(Array {
                    item,
                    len,
                    at,
                    bytes: self.at as u64 - at,
                })
            }
        })
    }
}

/// Parses and validates a GGUF file (`buf`: the whole file, as mapped).
pub fn parse(buf: &[u8]) -> Result<GgufHeader, GgufError> {
    parse_in(&mut Reader::new(buf, buf.len() as u64))
}

/// Why the start of a file is not a GGUF header.
#[derive(Debug)]
pub enum PrefixError {
    /// The header runs past the bytes given: ask again with more.
    NeedsMore,
    Refused(GgufError),
}

/// `parse` of a file of `file_len` bytes of which `prefix` holds the start
/// (a remote object, read by ranges).
pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<GgufHeader, PrefixError> {
    let mut r = Reader::new(prefix, file_len.max(prefix.len() as u64));
    parse_in(&mut r).map_err(|e| match r.short {
        true => PrefixError::NeedsMore,
        false => PrefixError::Refused(e),
    })
}

fn parse_in(r: &mut Reader) -> Result<GgufHeader, GgufError> {
    let buf_len = r.file_len;
    if r.take(4, "the magic").ok() != Some(MAGIC.as_slice()) {
        return Err(refused("not a GGUF file (no \"GGUF\" magic at its start)"));
    }
    let version = r.u32("the version")?;
    if version & 0xFFFF == 0 {
        return Err(refused(format!(
            "version {version:#x}: a big-endian file (stfs reads little-endian GGUF, as ggml does)"
        )));
    }
    if !(2..=3).contains(&version) {
        return Err(refused(format!(
            "version {version}: ggml reads versions 2 and 3"
        )));
    }
    let n_tensors = r.i64("the tensor count")?;
    let n_kv = r.i64("the key count")?;
    // Every key takes at least 13 bytes and every tensor info 24: counts the
    // file cannot hold are refused before anything is allocated for them.
    let left = buf_len.saturating_sub(r.at as u64).min(i64::MAX as u64) as i64;
    if n_tensors < 0 || n_tensors > left / 24 {
        return Err(refused(format!(
            "a tensor count of {n_tensors}, which the file cannot hold"
        )));
    }
    if n_kv < 0 || n_kv > left / 13 {
        return Err(refused(format!(
            "a key count of {n_kv}, which the file cannot hold"
        )));
    }
    // (Reserved up to a bound: a sparse file may claim counts its size allows.)
    let mut not_utf8 = None;
    let mut kvs: Vec<(String, Value)> = Vec::with_capacity((n_kv as usize).min(4096));
    let mut keys = std::collections::HashSet::new();
    for k in 0..n_kv {
        let raw_key = r.string(&format!("key {k}"))?;
        let key = String::from_utf8_lossy(raw_key).into_owned();
        if not_utf8.is_none() && std::str::from_utf8(raw_key).is_err() {
            not_utf8 = Some((None, key.clone()));
        }
        let in_key = |e: GgufError| GgufError {
            key: Some(key.clone()),
            ..e
        };
        if key.is_empty() {
            return Err(refused(format!("key {k} is empty")));
        }
        // (As bytes: ggml does not ask for UTF-8, so neither does equality.)
        if !keys.insert(raw_key) {
            return Err(in_key(refused("the key appears twice")));
        }
        let id = r.i32("a value's type").map_err(in_key)?;
        let ty = ValueType::from_id(id)
            .ok_or_else(|| in_key(refused(format!("unknown value type {id}"))))?;
        let value = r.kv_value(ty, "its value").map_err(in_key)?;
        kvs.push((key, value));
    }
    let alignment = match kvs.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if a.is_power_of_two() => *a as u64,
        Some((k, v)) => {
            return Err(GgufError {
                key: Some(k.clone()),
                ..refused(format!(
                    "the alignment must be a UINT32 power of two, not {} {}",
                    v.value_type().name(),
                    show_value(v)
                ))
            });
        }
    };
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity((n_tensors as usize).min(4096));
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let raw = r.string(&format!("the name of tensor {i}"))?;
        let name = String::from_utf8_lossy(raw).into_owned();
        if not_utf8.is_none() && std::str::from_utf8(raw).is_err() {
            not_utf8 = Some((Some(name.clone()), String::new()));
        }
        let bad = |rule: String| GgufError {
            tensor: Some(name.clone()),
            ..refused(rule)
        };
        if raw.len() > MAX_NAME {
            return Err(bad(format!(
                "a name of {} bytes (ggml's limit is {MAX_NAME})",
                raw.len()
            )));
        }
        if !names.insert(raw) {
            return Err(bad("the name appears twice".into()));
        }
        let n_dims = r.u32("its dimension count").map_err(|e| bad(e.rule))?;
        if n_dims > 4 {
            return Err(bad(format!("{n_dims} dimensions (ggml has at most 4)")));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let n = r.i64("its dimensions").map_err(|e| bad(e.rule))?;
            if n < 0 {
                return Err(bad(format!("a negative dimension ({n})")));
            }
            ne.push(n as u64);
        }
        let id = r.i32("its type").map_err(|e| bad(e.rule))?;
        let ggml_type = u32::try_from(id)
            .ok()
            .and_then(ggml_type)
            .ok_or_else(|| bad(format!("ggml type {id} is unknown or was removed")))?;
        let offset = r.u64("its offset").map_err(|e| bad(e.rule))?;
        // ggml's check: the element count must fit an int64.
        let elements = ne
            .iter()
            .try_fold(1i64, |acc, &n| acc.checked_mul(n as i64))
            .ok_or_else(|| bad(format!("{ne:?} elements overflow")))?;
        let ne0 = ne.first().copied().unwrap_or(1);
        if ne0 % ggml_type.block() != 0 {
            return Err(bad(format!(
                "its innermost dimension {ne0} is not a multiple of {}'s block of {} elements",
                ggml_type.name(),
                ggml_type.block()
            )));
        }
        let rows = (elements as u64).checked_div(ne0).unwrap_or(0);
        let nbytes = (ne0 / ggml_type.block())
            .checked_mul(ggml_type.block_bytes())
            .and_then(|b| b.checked_mul(rows))
            .ok_or_else(|| bad("its byte size overflows".into()))?;
        tensors.push(TensorInfo {
            name,
            ne,
            ggml_type,
            offset,
            nbytes,
        });
    }
    let data_start = (r.at as u64).div_ceil(alignment) * alignment;
    // Offsets are exactly contiguous, each tensor padded to the alignment.
    let mut size = 0u64;
    for ti in &tensors {
        let bad = |rule: String| GgufError {
            tensor: Some(ti.name.clone()),
            ..refused(rule)
        };
        if ti.offset != size {
            return Err(bad(format!(
                "its offset is {}, where the tensors before it end at {size} (ggml wants them \
                 contiguous, each padded to {alignment} bytes)",
                ti.offset
            )));
        }
        let padded = ti
            .nbytes
            .checked_add(alignment - 1)
            .map(|n| n / alignment * alignment)
            .ok_or_else(|| bad("its byte size overflows".into()))?;
        let end = data_start
            .checked_add(ti.offset)
            .and_then(|o| o.checked_add(ti.nbytes))
            .ok_or_else(|| bad("its byte range overflows".into()))?;
        if end > buf_len {
            return Err(bad(format!(
                "its {} bytes end at byte {end}, past the end of the file ({buf_len} bytes)",
                ti.nbytes,
            )));
        }
        size = size
            .checked_add(padded)
            .ok_or_else(|| bad("the data section's size overflows".into()))?;
    }
    Ok(GgufHeader {
        version,
        kvs,
        tensors,
        alignment,
        data_start,
        data_len: size,
        not_utf8: not_utf8.map(|(tensor, key)| GgufError {
            key: tensor.is_none().then_some(key),
            tensor,
            rule: "the name is not UTF-8 (ggml accepts it; stfs shows names as file names, \
                   and cannot show this one without mixing it up with others)"
                .into(),
        }),
    })
}

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

/// A value as a person reads it: numbers and bools as text, strings as
/// they are (lossy UTF-8), arrays as their type and length.
pub fn show_value(v: &Value) -> String {
    match v {
        Value::U8(x) => x.to_string(),
        Value::I8(x) => x.to_string(),
        Value::U16(x) => x.to_string(),
        Value::I16(x) => x.to_string(),
        Value::U32(x) => x.to_string(),
        Value::I32(x) => x.to_string(),
        Value::F32(x) => x.to_string(),
        Value::Bool(x) => (*x != 0).to_string(),
        Value::String(s) => String::from_utf8_lossy(s).into_owned(),
        Value::StringAt { len, .. } => format!("({len} bytes)"),
        Value::Array(a) => format!("[{} x {}]", a.len, a.item.name()),
        Value::U64(x) => x.to_string(),
        Value::I64(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
    }
}

/// Reads `len` bytes of the file at `at` (the items of an array value).
pub type ReadRange<'a> = &'a dyn Fn(u64, u64) -> std::io::Result<Vec<u8>>;

/// The items of array `a`, read from the file through `read`.
pub fn array_items(a: &Array, read: ReadRange) -> std::io::Result<Vec<Value>> {
    let bytes = read(a.at, a.bytes)?;
    let mut r = Reader::new(&bytes, bytes.len() as u64);
    let bad = |e: GgufError| std::io::Error::new(std::io::ErrorKind::InvalidData, e.rule);
    (0..a.len)
        .map(|_| r.value(a.item, "an array item").map_err(bad))
        .collect()
}

/// A scalar as JSON: a float by its shortest text (0.1, not
/// 0.10000000149011612), strings as lossy UTF-8, non-finite floats (which
/// JSON has not) as the strings "NaN", "inf" and "-inf", which a write reads
/// back (`write::parse_text`).
fn scalar_json(v: &Value) -> serde_json::Value {
    use serde_json::Value as J;
    let float = |text: String| {
        text.parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map_or(J::String(text), J::Number)
    };
    match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        Value::F32(x) => float(x.to_string()),
        Value::F64(x) => float(x.to_string()),
        Value::Bool(x) => J::Bool(*x != 0),
        Value::String(s) => J::String(String::from_utf8_lossy(s).into_owned()),
        Value::StringAt { .. } | Value::Array(_) => J::Null,
    }
}

/// A value as JSON (an array's items, a long string read through `read`):
/// EFBIG past `SHOWN_AT_MOST` bytes of the file.
pub fn value_json(v: &Value, read: ReadRange) -> std::io::Result<serde_json::Value> {
    Ok(match v {
        Value::Array(a) => {
            too_large(a.bytes)?;
            serde_json::Value::Array(array_items(a, read)?.iter().map(scalar_json).collect())
        }
        Value::StringAt { at, len } => {
            too_large(*len)?;
            serde_json::Value::String(String::from_utf8_lossy(&read(*at, *len)?).into_owned())
        }
        v => scalar_json(v),
    })
}

/// A key's string longer than this is left in the file (`Value::StringAt`).
pub const LONG_STRING: u64 = 4 << 10;

/// The most bytes of a value that `__kv__/KEY` or `__metadata__.json`
/// shows (each file is made whole when opened): a longer one is EFBIG, so
/// that the daemon's memory stays bounded whatever a file's keys hold.
pub const SHOWN_AT_MOST: u64 = 16 << 20;

fn too_large(bytes: u64) -> std::io::Result<()> {
    match bytes > SHOWN_AT_MOST {
        true => Err(std::io::Error::from_raw_os_error(libc::EFBIG)),
        false => Ok(()),
    }
}

/// What `__kv__/KEY` shows: a string's bytes as they are (a chat template
/// is a text file), a number or bool as its text, an array as JSON; each
/// with a final newline, which a write takes off again (`write::parse_text`).
pub fn kv_file_text(v: &Value, read: ReadRange) -> std::io::Result<Vec<u8>> {
    Ok(match v {
        Value::String(s) => [s.as_slice(), b"\n"].concat(),
        Value::StringAt { at, len } => {
            too_large(*len)?;
            [read(*at, *len)?.as_slice(), b"\n"].concat()
        }
        v => {
            // A finite float as in JSON (shortest: 0.1, 1e-45, 2.0); NaN
            // and the infinities, which JSON has not, as NaN, inf, -inf.
            let mut text = match v {
                Value::Array(_) => value_json(v, read)?.to_string(),
                Value::F32(x) if !x.is_finite() => x.to_string(),
                Value::F64(x) if !x.is_finite() => x.to_string(),
                Value::F32(_) | Value::F64(_) => scalar_json(v).to_string(),
                v => show_value(v),
            };
            text.push('\n');
            text.into_bytes()
        }
    })
}

/// What `__metadata__.json` shows for a GGUF file: every key in file order,
/// one per line, with its type and value:
/// `"general.name": {"type": "STRING", "value": "tiny"}`; an array also has
/// `"item_type"`.
pub fn metadata_json(h: &GgufHeader, read: ReadRange) -> std::io::Result<Vec<u8>> {
    let entries = h
        .kvs
        .iter()
        .filter(|(key, _)| key != write::ROOM_KEY)
        .map(|(key, v)| Ok((key.as_str(), entry_json(v, read)?)));
    metadata_json_of(entries)
}

/// `__metadata__.json` of keys and their entries (`entry_json`), in order.
pub fn metadata_json_of<'a>(
    entries: impl Iterator<Item = std::io::Result<(&'a str, serde_json::Value)>>,
) -> std::io::Result<Vec<u8>> {
    let mut out = b"{".to_vec();
    for (k, entry) in entries.enumerate() {
        let (key, entry) = entry?;
        out.extend_from_slice(if k == 0 { b"\n" } else { b",\n" });
        serde_json::to_writer(&mut out, key).map_err(std::io::Error::other)?;
        out.extend_from_slice(b": ");
        serde_json::to_writer(&mut out, &entry).map_err(std::io::Error::other)?;
        // (Each value is bounded; so is the whole: a cached file.)
        too_large(out.len() as u64 / 4)?;
    }
    out.extend_from_slice(b"\n}\n");
    Ok(out)
}

/// A key's entry in `__metadata__.json`: `{"type": "STRING", "value":
/// "tiny"}`; an array also has `"item_type"`.
pub fn entry_json(v: &Value, read: ReadRange) -> std::io::Result<serde_json::Value> {
    let mut entry = serde_json::Map::new();
    entry.insert("type".into(), v.value_type().name().into());
    if let Value::Array(a) = v {
        entry.insert("item_type".into(), a.item.name().into());
    }
    entry.insert("value".into(), value_json(v, read)?);
    Ok(serde_json::Value::Object(entry))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF file: keys (raw values given with their type id), then
    /// tensors (name, ne, type id, offset), padded, then `data` bytes.
    pub(crate) fn file(
        version: u32,
        kvs: &[(&str, i32, Vec<u8>)],
        tensors: &[(&str, &[i64], i32, u64)],
        alignment: u64,
        data: usize,
    ) -> Vec<u8> {
        let mut f = b"GGUF".to_vec();
        f.extend(version.to_le_bytes());
        f.extend((tensors.len() as i64).to_le_bytes());
        f.extend((kvs.len() as i64).to_le_bytes());
        let string = |f: &mut Vec<u8>, s: &[u8]| {
            f.extend((s.len() as u64).to_le_bytes());
            f.extend(s);
        };
        for (k, ty, v) in kvs {
            string(&mut f, k.as_bytes());
            f.extend(ty.to_le_bytes());
            f.extend(v);
        }
        for (name, ne, ty, offset) in tensors {
            string(&mut f, name.as_bytes());
            f.extend((ne.len() as u32).to_le_bytes());
            for n in *ne {
                f.extend(n.to_le_bytes());
            }
            f.extend(ty.to_le_bytes());
            f.extend(offset.to_le_bytes());
        }
        f.resize(f.len().div_ceil(alignment as usize) * alignment as usize, 0);
        f.resize(f.len() + data, 7);
        f
    }

    fn str_value(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend(s.as_bytes());
        v
    }

    #[test]
    fn reads_keys_tensors_and_block_sizes() {
        let mut tokens = 8i32.to_le_bytes().to_vec(); // an array of strings
        tokens.extend(2u64.to_le_bytes());
        tokens.extend(str_value("<s>"));
        tokens.extend(str_value("</s>"));
        let f = file(
            3,
            &[
                ("general.name", 8, str_value("tiny")),
                ("tokenizer.ggml.tokens", 9, tokens),
                (
                    "tokenizer.ggml.eos_token_id",
                    4,
                    2u32.to_le_bytes().to_vec(),
                ),
            ],
            // Q4_K: 144 bytes per 256 elements; F32 [3] padded to 32.
            &[("blk.0.w", &[512, 2], 12, 0), ("b", &[3], 0, 576)],
            32,
            576 + 12,
        );
        let h = parse(&f).unwrap();
        assert_eq!((h.version, h.alignment, h.tensors.len()), (3, 32, 2));
        assert_eq!(h.tensors[0].nbytes, 2 * 2 * 144);
        assert_eq!(h.tensors[0].shape(), vec![2, 512]);
        assert_eq!(h.tensors[0].ggml_type.name(), "Q4_K");
        assert_eq!(h.data_start % 32, 0);
        assert_eq!(h.data_len, 576 + 32);
        assert_eq!(show_value(&h.kvs[0].1), "tiny");
        assert!(
            matches!(&h.kvs[1].1, Value::Array(a) if a.len == 2 && a.item == ValueType::String)
        );
        assert_eq!(show_value(&h.kvs[2].1), "2");
    }

    #[test]
    fn refuses_what_ggml_refuses() {
        let ok = |kvs: &[(&str, i32, Vec<u8>)], tensors: &[(&str, &[i64], i32, u64)]| {
            parse(&file(3, kvs, tensors, 32, 4096))
        };
        let rule = |r: Result<GgufHeader, GgufError>| r.unwrap_err().to_string();
        assert!(ok(&[], &[("a", &[4], 0, 0)]).is_ok());
        for v in [0u32, 1, 4, 0x0300_0000] {
            assert!(parse(&file(v, &[], &[], 32, 0)).is_err(), "version {v}");
        }
        assert!(
            rule(ok(
                &[("k", 4, vec![1, 0, 0, 0]), ("k", 4, vec![1, 0, 0, 0])],
                &[]
            ))
            .contains("twice")
        );
        assert!(rule(ok(&[("", 4, vec![1, 0, 0, 0])], &[])).contains("empty"));
        let mut nested = 9i32.to_le_bytes().to_vec();
        nested.extend(0u64.to_le_bytes());
        assert!(rule(ok(&[("k", 9, nested)], &[])).contains("nested"));
        assert!(
            rule(ok(
                &[("general.alignment", 4, 48u32.to_le_bytes().to_vec())],
                &[]
            ))
            .contains("power of two")
        );
        assert!(
            rule(ok(
                &[("general.alignment", 10, 64u64.to_le_bytes().to_vec())],
                &[]
            ))
            .contains("UINT32")
        );
        let long = "x".repeat(64);
        assert!(rule(ok(&[], &[(&long, &[4], 0, 0)])).contains("64 bytes"));
        assert!(ok(&[], &[(&long[..63], &[4], 0, 0)]).is_ok());
        assert!(rule(ok(&[], &[("a", &[4], 0, 0), ("a", &[4], 0, 32)])).contains("twice"));
        assert!(rule(ok(&[], &[("a", &[1, 1, 1, 1, 1], 0, 0)])).contains("5 dimensions"));
        assert!(rule(ok(&[], &[("a", &[-1], 0, 0)])).contains("negative"));
        assert!(rule(ok(&[], &[("a", &[i64::MAX, 2], 0, 0)])).contains("overflow"));
        for removed in [4, 5, 31, 36, 99, -1] {
            assert!(rule(ok(&[], &[("a", &[32], removed, 0)])).contains("unknown or was removed"));
        }
        assert!(rule(ok(&[], &[("a", &[100], 12, 0)])).contains("multiple of Q4_K's block of 256"));
        // Offsets: contiguous, each padded to the alignment.
        assert!(rule(ok(&[], &[("a", &[4], 0, 0), ("b", &[4], 0, 16)])).contains("contiguous"));
        assert!(rule(ok(&[], &[("a", &[4], 0, 8)])).contains("contiguous"));
        // Past the end of the file.
        assert!(
            rule(parse(&file(3, &[], &[("a", &[4096], 0, 0)], 32, 100))).contains("past the end")
        );
        // Strings past the end, and counts the file cannot hold.
        let mut cut = file(3, &[("general.name", 8, str_value("tiny"))], &[], 32, 0);
        cut.truncate(58); // inside the value "tiny"
        assert!(rule(parse(&cut)).contains("ends inside"));
        let mut huge = file(3, &[], &[], 32, 0);
        huge[8..16].copy_from_slice(&i64::MAX.to_le_bytes());
        assert!(rule(parse(&huge)).contains("cannot hold"));
        assert!(rule(parse(b"GGML")).contains("not a GGUF file"));
    }

    /// Every truncation, and every byte of a valid file set to each of a
    /// few values: Ok or Err, never a panic, and what is accepted holds
    /// together. (The fuzz target `parse_gguf` does the same at random.)
    #[test]
    fn bent_files_never_panic() {
        let mut tokens = 8i32.to_le_bytes().to_vec();
        tokens.extend(1u64.to_le_bytes());
        tokens.extend(str_value("a"));
        let f = file(
            3,
            &[
                ("general.alignment", 4, 64u32.to_le_bytes().to_vec()),
                ("t", 9, tokens),
            ],
            &[("w", &[32, 2], 8, 0), ("b", &[3], 0, 128)],
            64,
            128 + 12,
        );
        assert!(parse(&f).is_ok());
        for n in 0..f.len() {
            let _ = parse(&f[..n]);
        }
        for i in 0..f.len() {
            for v in [0u8, 1, 0x7f, 0x80, 0xff] {
                let mut g = f.clone();
                g[i] = v;
                if let Ok(h) = parse(&g) {
                    let mut next = 0;
                    for t in &h.tensors {
                        assert_eq!(t.offset, next);
                        assert!(h.data_start + t.offset + t.nbytes <= g.len() as u64);
                        next += t.nbytes.div_ceil(h.alignment) * h.alignment;
                    }
                }
            }
        }
    }

    /// A remote object's header is read from its first bytes: each prefix
    /// short of the tensor infos' end asks for more, each that holds them
    /// gives the header the whole file gives; a refusal is the whole file's.
    #[test]
    fn prefixes_ask_for_more_or_agree_with_the_whole_file() {
        let f = file(
            3,
            &[("general.name", 8, str_value("prefix"))],
            &[("w", &[32, 2], 8, 0), ("b", &[3], 0, 96)],
            32,
            96 + 12,
        );
        let whole = parse(&f).unwrap();
        for n in 0..=f.len() {
            match parse_prefix(&f[..n], f.len() as u64) {
                Ok(h) => {
                    assert_eq!(
                        (h.kvs, h.tensors),
                        (whole.kvs.clone(), whole.tensors.clone())
                    );
                    assert_eq!(h.data_start, whole.data_start);
                }
                Err(PrefixError::NeedsMore) => assert!((n as u64) < whole.data_start, "{n}"),
                Err(PrefixError::Refused(e)) => panic!("prefix {n}: {e}"),
            }
        }
        // A file cut short is refused as the whole file is, not asked again.
        let cut = &f[..f.len() - 20];
        let e = parse(cut).unwrap_err();
        match parse_prefix(&cut[..40], cut.len() as u64) {
            Err(PrefixError::NeedsMore) => {}
            other => panic!("{other:?}"),
        }
        match parse_prefix(cut, cut.len() as u64) {
            Err(PrefixError::Refused(p)) => assert_eq!(p, e),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_type_has_a_block_and_removed_ids_have_none() {
        for id in 0..64u32 {
            let removed = [4, 5, 31, 32, 33, 36, 37, 38].contains(&id) || id > 42;
            assert_eq!(ggml_type(id).is_none(), removed, "id {id}");
        }
        assert!(
            GGML_TYPES
                .iter()
                .all(|t| t.block() > 0 && t.block_bytes() > 0)
        );
    }
}
