//! Reading a GGUF header with ggml's accept/reject decisions: a reader
//! that never reads past the file (or asks for more of a prefix), and the
//! header step by step.

use super::*;

/// Reads little-endian values from the file (or the first bytes of it that
/// `buf` holds), never past its end.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    /// The file's length (`buf` may hold only its start).
    file_len: u64,
    /// Set when a read needed bytes past `buf` that the file has.
    short: bool,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8], file_len: u64) -> Reader<'a> {
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

    pub(super) fn i32(&mut self, what: &str) -> Result<i32, GgufError> {
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
    pub(super) fn value(&mut self, ty: ValueType, what: &str) -> Result<Value, GgufError> {
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

/// The first name that is not UTF-8: a key's, or (tensor, "") a tensor's.
type NotUtf8 = Option<(Option<String>, String)>;

/// The header, step by step: the preamble (magic, version, counts), the
/// keys, the alignment they set, the tensor infos, and their layout.
fn parse_in(r: &mut Reader) -> Result<GgufHeader, GgufError> {
    let (version, n_tensors, n_kv) = read_preamble(r)?;
    let mut not_utf8 = None;
    let kvs = read_keys(r, n_kv, &mut not_utf8)?;
    let alignment = alignment_of(&kvs)?;
    let tensors = read_tensor_infos(r, n_tensors, &mut not_utf8)?;
    let data_start = (r.at as u64).div_ceil(alignment) * alignment;
    let data_len = check_layout(&tensors, data_start, alignment, r.file_len)?;
    Ok(GgufHeader {
        version,
        kvs,
        tensors,
        alignment,
        data_start,
        data_len,
        not_utf8: not_utf8.map(|(tensor, key)| GgufError {
            key: tensor.is_none().then_some(key),
            tensor,
            rule: "the name is not UTF-8 (ggml accepts it; stfs shows names as file names, \
                   and cannot show this one without mixing it up with others)"
                .into(),
        }),
    })
}

/// The magic, the version (2 or 3, little-endian) and the tensor and key
/// counts, refused where the file cannot hold them (every key takes at
/// least 13 bytes and every tensor info 24), before anything is allocated.
fn read_preamble(r: &mut Reader) -> Result<(u32, i64, i64), GgufError> {
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
    let left = r.file_len.saturating_sub(r.at as u64).min(i64::MAX as u64) as i64;
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
    Ok((version, n_tensors, n_kv))
}

/// The keys and their values: none empty, none twice (as bytes: ggml does
/// not ask for UTF-8, so neither does equality), each of a known type.
fn read_keys(
    r: &mut Reader,
    n_kv: i64,
    not_utf8: &mut NotUtf8,
) -> Result<Vec<(String, Value)>, GgufError> {
    // (Reserved up to a bound: a sparse file may claim counts its size allows.)
    let mut kvs: Vec<(String, Value)> = Vec::with_capacity((n_kv as usize).min(4096));
    let mut keys = std::collections::HashSet::new();
    for k in 0..n_kv {
        let raw_key = r.string(&format!("key {k}"))?;
        let key = String::from_utf8_lossy(raw_key).into_owned();
        if not_utf8.is_none() && std::str::from_utf8(raw_key).is_err() {
            *not_utf8 = Some((None, key.clone()));
        }
        let in_key = |e: GgufError| GgufError {
            key: Some(key.clone()),
            ..e
        };
        if key.is_empty() {
            return Err(refused(format!("key {k} is empty")));
        }
        if !keys.insert(raw_key) {
            return Err(in_key(refused("the key appears twice")));
        }
        let id = r.i32("a value's type").map_err(in_key)?;
        let ty = ValueType::from_id(id)
            .ok_or_else(|| in_key(refused(format!("unknown value type {id}"))))?;
        let value = r.kv_value(ty, "its value").map_err(in_key)?;
        kvs.push((key, value));
    }
    Ok(kvs)
}

/// `general.alignment`: a UINT32 power of two, else ggml's default (32).
fn alignment_of(kvs: &[(String, Value)]) -> Result<u64, GgufError> {
    match kvs.iter().find(|(k, _)| k == "general.alignment") {
        None => Ok(DEFAULT_ALIGNMENT),
        Some((_, Value::U32(a))) if a.is_power_of_two() => Ok(*a as u64),
        Some((k, v)) => Err(GgufError {
            key: Some(k.clone()),
            ..refused(format!(
                "the alignment must be a UINT32 power of two, not {} {}",
                v.value_type().name(),
                show_value(v)
            ))
        }),
    }
}

/// The tensor infos, each named once.
fn read_tensor_infos(
    r: &mut Reader,
    n_tensors: i64,
    not_utf8: &mut NotUtf8,
) -> Result<Vec<TensorInfo>, GgufError> {
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity((n_tensors as usize).min(4096));
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let raw = r.string(&format!("the name of tensor {i}"))?;
        let name = String::from_utf8_lossy(raw).into_owned();
        if not_utf8.is_none() && std::str::from_utf8(raw).is_err() {
            *not_utf8 = Some((Some(name.clone()), String::new()));
        }
        if raw.len() > MAX_NAME {
            return Err(in_tensor(
                &name,
                format!("a name of {} bytes (ggml's limit is {MAX_NAME})", raw.len()),
            ));
        }
        if !names.insert(raw) {
            return Err(in_tensor(&name, "the name appears twice".into()));
        }
        tensors.push(read_tensor_info(r, name)?);
    }
    Ok(tensors)
}

fn in_tensor(name: &str, rule: String) -> GgufError {
    GgufError {
        tensor: Some(name.to_string()),
        ..refused(rule)
    }
}

/// One tensor's dimensions (at most 4, none negative, their product an
/// int64), type (known, its block dividing the innermost dimension) and
/// offset, and so its byte size.
fn read_tensor_info(r: &mut Reader, name: String) -> Result<TensorInfo, GgufError> {
    let bad = |rule: String| in_tensor(&name, rule);
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
    Ok(TensorInfo {
        name,
        ne,
        ggml_type,
        offset,
        nbytes,
    })
}

/// Offsets are exactly contiguous, each tensor padded to the alignment,
/// and every tensor ends within the file. Returns the data section's size.
fn check_layout(
    tensors: &[TensorInfo],
    data_start: u64,
    alignment: u64,
    file_len: u64,
) -> Result<u64, GgufError> {
    let mut size = 0u64;
    for ti in tensors {
        let bad = |rule: String| in_tensor(&ti.name, rule);
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
        if end > file_len {
            return Err(bad(format!(
                "its {} bytes end at byte {end}, past the end of the file ({file_len} bytes)",
                ti.nbytes,
            )));
        }
        size = size
            .checked_add(padded)
            .ok_or_else(|| bad("the data section's size overflows".into()))?;
    }
    Ok(size)
}
