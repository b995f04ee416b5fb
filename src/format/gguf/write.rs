//! Writing GGUF: values encoded as the file stores them, what a person
//! writes into `__kv__/KEY` read by the key's type, and the header a commit
//! writes: with room for later edits in a filler key (`ROOM_KEY`), or laid
//! out exactly as gguf-py's `GGUFWriter` lays it out (`--compact`).
//!
//! GGUF has no slack between the tensor infos and the data: readers compute
//! where the data starts from the end of the infos. So the room is a key of
//! its own, an array of u8 that readers keep as any unknown key; a header
//! that grows shrinks it by as many bytes, and the data start and every
//! tensor offset stay where they are.

#[cfg(test)]
use super::{Array, array_items};
use super::{GgufError, MAGIC, ReadRange, Reader, Value, ValueType};
use crate::format::{Dtype, FormatError, Layout, Tensors, byte_len};
use serde::{Deserialize, Serialize};

/// The key that holds a header's room (an array of zero bytes). stfs
/// writes it and hides it: `__kv__` does not show it, and a commit sizes it.
pub const ROOM_KEY: &str = "stfs.room";

/// Its bytes besides its items: the key (length and bytes), the value type,
/// the item type and the item count.
pub const ROOM_OVERHEAD: u64 = 8 + ROOM_KEY.len() as u64 + 4 + 4 + 8;

/// The version gguf-py's writer writes (and a `--compact` commit).
pub const WRITER_VERSION: u32 = 3;

/// A key's type: its value type, and an array's item type. A key keeps it
/// through every edit of its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvType {
    pub value: ValueType,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<ValueType>,
}

impl KvType {
    /// What a new key is (docs/SEMANTICS.md, "GGUF").
    pub const STRING: KvType = KvType {
        value: ValueType::String,
        item: None,
    };

    pub fn of(v: &Value) -> KvType {
        KvType {
            value: v.value_type(),
            item: match v {
                Value::Array(a) => Some(a.item),
                _ => None,
            },
        }
    }

    /// "UINT32", "ARRAY of STRING".
    pub fn name(&self) -> String {
        match self.item {
            Some(item) => format!("ARRAY of {}", item.name()),
            None => self.value.name().to_string(),
        }
    }
}

/// The id GGUF stores for a value type.
pub fn type_id(t: ValueType) -> i32 {
    use ValueType::*;
    match t {
        U8 => 0,
        I8 => 1,
        U16 => 2,
        I16 => 3,
        U32 => 4,
        I32 => 5,
        F32 => 6,
        Bool => 7,
        String => 8,
        Array => 9,
        U64 => 10,
        I64 => 11,
        F64 => 12,
    }
}

/// ggml's id of a tensor type, if ggml has the type.
pub fn ggml_id(dtype: Dtype) -> Option<u32> {
    super::GGML_TYPES
        .iter()
        .find(|t| t.dtype == dtype)
        .map(|t| t.id)
}

fn put_string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend_from_slice(s);
}

/// A scalar's bytes (not its type id).
fn put_scalar(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::Bool(x) => out.push(*x),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::String(s) => put_string(out, s),
        Value::StringAt { .. } | Value::Array(_) => unreachable!("read from the file by `encode`"),
    }
}

/// A value as the file stores it after its key: its type id, then its
/// bytes (an array's items read through `read`, as they are).
pub fn encode(v: &Value, read: ReadRange) -> std::io::Result<Vec<u8>> {
    let mut out = type_id(v.value_type()).to_le_bytes().to_vec();
    match v {
        Value::Array(a) => {
            out.extend(type_id(a.item).to_le_bytes());
            out.extend(a.len.to_le_bytes());
            out.extend(read(a.at, a.bytes)?);
        }
        Value::StringAt { at, len } => {
            out.extend(len.to_le_bytes());
            out.extend(read(*at, *len)?);
        }
        v => put_scalar(&mut out, v),
    }
    Ok(out)
}

/// The value an encoded value holds (an array's `at` is within `encoded`).
pub fn decode(encoded: &[u8]) -> Option<Value> {
    let mut r = Reader::new(encoded, encoded.len() as u64);
    let ty = ValueType::from_id(r.i32("a type").ok()?)?;
    r.value(ty, "a value").ok()
}

/// What `__kv__/KEY` shows of an encoded value (`gguf::kv_file_text`).
pub fn encoded_text(encoded: &[u8]) -> Vec<u8> {
    let read = |at: u64, len: u64| Ok(encoded[at as usize..(at + len) as usize].to_vec());
    decode(encoded)
        .and_then(|v| super::kv_file_text(&v, &read).ok())
        .unwrap_or_default()
}

/// An encoded value as `__metadata__.json` shows it: its type, an array's
/// item type, and its value.
pub fn encoded_entry(encoded: &[u8]) -> serde_json::Value {
    let read = |at: u64, len: u64| Ok(encoded[at as usize..(at + len) as usize].to_vec());
    let Some(v) = decode(encoded) else {
        return serde_json::Value::Null;
    };
    super::entry_json(&v, &read).unwrap_or(serde_json::Value::Null)
}

/// Why a text is not a value of a key's type (EINVAL: `__kv__/KEY` closes
/// with it, `stfs status` lists it, a commit refuses it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ValueError(pub String);

impl From<String> for ValueError {
    fn from(why: String) -> ValueError {
        ValueError(why)
    }
}

impl From<&str> for ValueError {
    fn from(why: &str) -> ValueError {
        ValueError(why.to_string())
    }
}

impl crate::errno::ToErrno for ValueError {
    fn to_errno(&self) -> i32 {
        libc::EINVAL
    }
}

/// What a person wrote into `__kv__/KEY`, read as the key's type: a
/// string's bytes as they are, less one final newline (which `echo` and
/// editors add, and which `__kv__` shows after every value); a number or a
/// bool as its text (`true`/`false`/`1`/`0`; floats also `NaN`, `inf`,
/// `-inf`); an array as a JSON array of its items. Returns the value
/// encoded, or why it does not fit the type.
pub fn parse_text(ty: KvType, text: &[u8]) -> Result<Vec<u8>, ValueError> {
    let mut out = type_id(ty.value).to_le_bytes().to_vec();
    match (ty.value, ty.item) {
        (ValueType::String, _) => {
            let s = text.strip_suffix(b"\n").unwrap_or(text);
            put_string(&mut out, s);
        }
        (ValueType::Array, Some(item)) => {
            let json: serde_json::Value = std::str::from_utf8(text)
                .ok()
                .and_then(|t| serde_json::from_str(t).ok())
                .ok_or_else(|| format!("not a JSON array (the key is an {})", ty.name()))?;
            let serde_json::Value::Array(items) = json else {
                return Err(format!("not a JSON array (the key is an {})", ty.name()).into());
            };
            out.extend(type_id(item).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for (i, x) in items.iter().enumerate() {
                let v = match (item, x) {
                    (ValueType::String, serde_json::Value::String(s)) => {
                        Value::String(s.as_bytes().to_vec())
                    }
                    (ValueType::String, _) => Err(format!("item {i} is not a JSON string"))?,
                    (ValueType::Bool, serde_json::Value::Bool(b)) => Value::Bool(*b as u8),
                    (_, serde_json::Value::Number(n)) => {
                        scalar(item, &n.to_string()).map_err(|e| format!("item {i}: {e}"))?
                    }
                    // (NaN and the infinities, which JSON has not, as strings.)
                    (ValueType::F32 | ValueType::F64, serde_json::Value::String(s)) => {
                        scalar(item, s).map_err(|e| format!("item {i}: {e}"))?
                    }
                    _ => Err(format!("item {i} is not a valid {}", item.name()))?,
                };
                put_scalar(&mut out, &v);
            }
        }
        (ValueType::Array, None) => return Err("an array without an item type".into()),
        (t, _) => {
            let s = std::str::from_utf8(text)
                .map_err(|_| format!("not text (the key is a {})", t.name()))?;
            put_scalar(&mut out, &scalar(t, s.trim())?);
        }
    }
    Ok(out)
}

/// A float of type `t` (FLOAT32 or FLOAT64) from its text: a number within
/// the type's range, or NaN, inf, -inf (an overflow to infinity is refused,
/// and so is a number too small for the type, which would become 0).
fn float(s: &str, t: ValueType) -> Result<f64, ValueError> {
    let bad = || format!("{s:?} is not a valid {}", t.name());
    let x: f64 = match t {
        ValueType::F32 => s.parse::<f32>().map_err(|_| bad())? as f64,
        _ => s.parse::<f64>().map_err(|_| bad())?,
    };
    let named = matches!(
        s.trim_start_matches(['+', '-'])
            .to_ascii_lowercase()
            .as_str(),
        "inf" | "infinity" | "nan"
    );
    if !x.is_finite() && !named {
        return Err(format!("{s:?} is past the range of a {}", t.name()).into());
    }
    let mantissa = s.split(['e', 'E']).next().unwrap_or("");
    if x == 0.0 && mantissa.bytes().any(|b| matches!(b, b'1'..=b'9')) {
        return Err(format!("{s:?} is too small for a {} (it would be 0)", t.name()).into());
    }
    Ok(x)
}

/// A number or bool of type `t` from its text.
fn scalar(t: ValueType, s: &str) -> Result<Value, ValueError> {
    fn int<T: std::str::FromStr>(
        s: &str,
        t: ValueType,
        range: &str,
    ) -> Result<T, std::string::String> {
        s.parse::<T>().map_err(|_| {
            format!(
                "{s:?} is not a valid {} (whole numbers from {range})",
                t.name()
            )
        })
    }
    use ValueType::*;
    Ok(match t {
        U8 => Value::U8(int(s, t, "0 to 255")?),
        I8 => Value::I8(int(s, t, "-128 to 127")?),
        U16 => Value::U16(int(s, t, "0 to 65535")?),
        I16 => Value::I16(int(s, t, "-32768 to 32767")?),
        U32 => Value::U32(int(s, t, "0 to 4294967295")?),
        I32 => Value::I32(int(s, t, "-2147483648 to 2147483647")?),
        U64 => Value::U64(int(s, t, "0 to 18446744073709551615")?),
        I64 => Value::I64(int(s, t, "-9223372036854775808 to 9223372036854775807")?),
        F32 => Value::F32(float(s, t)? as f32),
        F64 => Value::F64(float(s, t)?),
        Bool => Value::Bool(match s {
            "true" | "1" => 1,
            "false" | "0" => 0,
            _ => return Err(format!("{s:?} is not a valid BOOL (true, false, 1 or 0)").into()),
        }),
        String | Array => unreachable!("not scalars"),
    })
}

/// How much room a header leaves for later edits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Room {
    /// None, and no filler key: as gguf-py's writer writes it.
    Compact,
    /// The data starts exactly here (an in-place commit keeps it; a new
    /// file's is chosen with room to spare).
    Exactly(u64),
}

/// What a commit writes before the tensor infos.
pub struct HeaderOut<'a> {
    pub version: u32,
    /// Keys in file order, each with its encoded value (`encode`).
    pub kvs: &'a [(String, Vec<u8>)],
    pub alignment: u64,
}

impl HeaderOut<'_> {
    /// The header (everything before the data, padded) for `tensors` in
    /// file order (offsets relative to the data start); `Err(least)`: with
    /// `Room::Exactly`, it does not fit, and needs at least `least` bytes.
    pub fn header(&self, tensors: &Tensors, room: Room) -> Result<Vec<u8>, u64> {
        let align = |n: u64| n.div_ceil(self.alignment) * self.alignment;
        let body = |room_items: Option<u64>| {
            let mut out = MAGIC.to_vec();
            out.extend(self.version.to_le_bytes());
            out.extend((tensors.len() as u64).to_le_bytes());
            let n_kv = self.kvs.len() as u64 + room_items.is_some() as u64;
            out.extend(n_kv.to_le_bytes());
            for (key, value) in self.kvs {
                put_string(&mut out, key.as_bytes());
                out.extend_from_slice(value);
            }
            if let Some(n) = room_items {
                put_string(&mut out, ROOM_KEY.as_bytes());
                out.extend(type_id(ValueType::Array).to_le_bytes());
                out.extend(type_id(ValueType::U8).to_le_bytes());
                out.extend(n.to_le_bytes());
                out.resize(out.len() + n as usize, 0);
            }
            for t in tensors.iter() {
                put_string(&mut out, t.name.as_bytes());
                out.extend((t.shape.len() as u32).to_le_bytes());
                for d in t.shape.iter().rev() {
                    out.extend(d.to_le_bytes());
                }
                out.extend(ggml_id(t.dtype).unwrap_or(u32::MAX).to_le_bytes());
                out.extend(t.data_offsets.0.to_le_bytes());
            }
            out
        };
        let mut out = body(None);
        let bare = out.len() as u64;
        let data_start = match room {
            Room::Compact => align(bare),
            Room::Exactly(d) if bare <= d && align(bare) == d => d,
            Room::Exactly(d) if bare + ROOM_OVERHEAD <= d => {
                out = body(Some(d - bare - ROOM_OVERHEAD));
                d
            }
            Room::Exactly(_) => return Err(bare + ROOM_OVERHEAD),
        };
        out.resize(data_start as usize, 0);
        Ok(out)
    }
}

/// Why ggml would refuse a tensor of this name, type and shape, if it would.
pub fn tensor_rule(name: &str, dtype: Dtype, shape: &[u64]) -> Option<String> {
    if name.len() > super::MAX_NAME {
        return Some(format!(
            "a name of {} bytes (ggml's limit is {})",
            name.len(),
            super::MAX_NAME
        ));
    }
    if ggml_id(dtype).is_none() {
        return Some(format!(
            "{} is not a ggml type (GGUF cannot hold it)",
            dtype.name()
        ));
    }
    if shape.len() > 4 {
        return Some(format!(
            "has {} dimensions (ggml holds at most 4)",
            shape.len()
        ));
    }
    let ne0 = shape.last().copied().unwrap_or(1);
    let (block, _) = dtype.block();
    if ne0 % block != 0 {
        return Some(format!(
            "its innermost dimension {ne0} is not a multiple of {}'s block of {block} elements",
            dtype.name()
        ));
    }
    None
}

/// Lays out a new GGUF file: the tensors `spec(k)` (name, dtype, shape) in
/// the order given, each at an offset that is a multiple of the alignment,
/// each padded to it (the last too, as gguf-py pads), the header without
/// room (`Room::Compact`). Refuses what ggml's reader would, naming the tensor.
pub fn layout<'a>(
    out: &HeaderOut,
    count: usize,
    spec: impl Fn(usize) -> (&'a str, Dtype, &'a [u64]),
) -> Result<Layout, FormatError> {
    let bad = |name: &str, rule: String| {
        FormatError::Gguf(GgufError {
            tensor: Some(name.to_string()),
            key: None,
            rule,
        })
    };
    let mut names = std::collections::HashSet::with_capacity(count);
    let mut tensors = Tensors::with_capacity(count);
    let mut offset = 0u64;
    for k in 0..count {
        let (name, dtype, shape) = spec(k);
        if let Some(rule) = tensor_rule(name, dtype, shape) {
            return Err(bad(name, rule));
        }
        if !names.insert(name) {
            return Err(bad(name, "the name appears twice".into()));
        }
        let fits_i64 = shape
            .iter()
            .try_fold(1i64, |acc, &n| acc.checked_mul(i64::try_from(n).ok()?))
            .is_some();
        let len = byte_len(dtype, shape)
            .ok()
            .filter(|_| fits_i64)
            .ok_or_else(|| bad(name, format!("{shape:?} elements overflow")))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| bad(name, "the data section's size overflows".into()))?;
        tensors
            .push(name, dtype, shape, (offset, end))
            .map_err(|_| bad(name, "too many tensors to hold".into()))?;
        offset = end
            .checked_next_multiple_of(out.alignment)
            .ok_or_else(|| bad(name, "the data section's size overflows".into()))?;
    }
    let header = out
        .header(&tensors, Room::Compact)
        .expect("only Room::Exactly fails");
    let data_len = tensors.last().map_or(0, |t| t.data_offsets.1);
    Ok(Layout {
        header,
        tensors,
        source_index: (0..count).collect(),
        end_pad: offset - data_len,
    })
}

/// The in-file array behind a value, if it is one (for tests).
#[cfg(test)]
pub(crate) fn array_of(v: &Value) -> Option<&Array> {
    match v {
        Value::Array(a) => Some(a),
        _ => None,
    }
}

/// An encoded array's items (for tests).
#[cfg(test)]
pub(crate) fn items(encoded: &[u8]) -> Vec<Value> {
    let read = |at: u64, len: u64| Ok(encoded[at as usize..(at + len) as usize].to_vec());
    let v = decode(encoded).unwrap();
    array_items(array_of(&v).unwrap(), &read).unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::gguf;

    fn kvs() -> Vec<(String, Vec<u8>)> {
        let none = |_, _| -> std::io::Result<Vec<u8>> { unreachable!() };
        vec![
            (
                "general.name".into(),
                encode(&Value::String(b"tiny".to_vec()), &none).unwrap(),
            ),
            (
                "tokenizer.ggml.eos_token_id".into(),
                encode(&Value::U32(2), &none).unwrap(),
            ),
        ]
    }

    fn tensors() -> Tensors {
        let mut t = Tensors::default();
        t.push("a", Dtype::F32, &[2, 3], (0, 24)).unwrap();
        t.push("b", Dtype::Q4_K, &[1, 256], (32, 32 + 144)).unwrap();
        t
    }

    #[test]
    fn a_header_with_room_parses_and_keeps_its_data_start() {
        let kvs = kvs();
        let out = HeaderOut {
            version: 3,
            kvs: &kvs,
            alignment: 32,
        };
        let h = out.header(&tensors(), Room::Exactly(2048)).unwrap();
        let d = h.len() as u64;
        assert_eq!(d % 32, 0);
        let mut file = h.clone();
        file.resize(d as usize + 32 + 160, 0);
        let g = gguf::parse(&file).unwrap();
        assert_eq!(g.data_start, d);
        assert_eq!(g.kvs.last().unwrap().0, ROOM_KEY);
        assert_eq!(g.tensors[1].ne, vec![256, 1]);
        // A longer name fits the same start, the room shrinking.
        let mut kvs2 = kvs.clone();
        kvs2[0].1 = parse_text(KvType::STRING, &[b'x'; 500]).unwrap();
        let out2 = HeaderOut { kvs: &kvs2, ..out };
        let h2 = out2.header(&tensors(), Room::Exactly(d)).unwrap();
        assert_eq!(h2.len() as u64, d);
        let mut file = h2;
        file.resize(d as usize + 32 + 160, 0);
        assert_eq!(gguf::parse(&file).unwrap().data_start, d);
        // Past the room: how much it needs.
        kvs2[0].1 = parse_text(KvType::STRING, &[b'x'; 2000]).unwrap();
        let out3 = HeaderOut { kvs: &kvs2, ..out };
        let least = out3.header(&tensors(), Room::Exactly(d)).unwrap_err();
        assert!(least > d, "{least} {d}");
    }

    #[test]
    fn text_is_read_by_the_keys_type() {
        let u8t = KvType {
            value: ValueType::U8,
            item: None,
        };
        assert!(parse_text(u8t, b"300\n").unwrap_err().0.contains("UINT8"));
        assert_eq!(
            decode(&parse_text(u8t, b" 7\n").unwrap()),
            Some(Value::U8(7))
        );
        let i32t = KvType {
            value: ValueType::I32,
            item: None,
        };
        assert!(parse_text(i32t, b"abc").is_err());
        let f32t = KvType {
            value: ValueType::F32,
            item: None,
        };
        assert!(
            matches!(decode(&parse_text(f32t, b"NaN").unwrap()), Some(Value::F32(x)) if x.is_nan())
        );
        // Past the range either way: refused, not made infinite or 0.
        assert!(
            parse_text(f32t, b"1e39")
                .unwrap_err()
                .0
                .contains("past the range")
        );
        assert!(
            parse_text(f32t, b"1e-50")
                .unwrap_err()
                .0
                .contains("too small")
        );
        assert!(
            matches!(decode(&parse_text(f32t, b"1e-40").unwrap()), Some(Value::F32(x)) if x > 0.0)
        );
        assert!(
            matches!(decode(&parse_text(f32t, b"-0.0e-9").unwrap()), Some(Value::F32(x)) if x == 0.0)
        );
        let s = parse_text(KvType::STRING, b"{{ x }}\n").unwrap();
        assert_eq!(decode(&s), Some(Value::String(b"{{ x }}".to_vec())));
        // Shown with the newline that writing takes off again.
        assert_eq!(encoded_text(&s), b"{{ x }}\n");
        let strings = KvType {
            value: ValueType::Array,
            item: Some(ValueType::String),
        };
        let a = parse_text(strings, br#"["a", "bc"]"#).unwrap();
        assert_eq!(
            items(&a),
            vec![Value::String(b"a".to_vec()), Value::String(b"bc".to_vec())]
        );
        assert!(parse_text(strings, b"[1]").is_err());
        let floats = KvType {
            value: ValueType::Array,
            item: Some(ValueType::F32),
        };
        assert_eq!(
            items(&parse_text(floats, b"[1, 0.5]").unwrap())[1],
            Value::F32(0.5)
        );
        assert_eq!(
            encoded_text(&parse_text(floats, b"[1, 0.5]").unwrap()),
            b"[1.0,0.5]\n"
        );
    }

    #[test]
    fn layouts_refuse_what_ggml_refuses() {
        let kvs = kvs();
        let out = HeaderOut {
            version: 3,
            kvs: &kvs,
            alignment: 32,
        };
        let shape = [3u64, 100];
        let specs = [("q", Dtype::Q4_K, &shape[..])];
        let e = layout(&out, 1, |k| specs[k]).unwrap_err();
        assert!(e.to_string().contains("multiple of Q4_K"), "{e}");
        let specs = [("b", Dtype::BOOL, &shape[..])];
        let e = layout(&out, 1, |k| specs[k]).unwrap_err();
        assert!(e.to_string().contains("not a ggml type"), "{e}");
        let long = "x".repeat(64);
        let specs = [(long.as_str(), Dtype::F32, &shape[..])];
        assert!(layout(&out, 1, |k| specs[k]).is_err());
        let specs = [("a", Dtype::F32, &shape[..]), ("b", Dtype::F16, &shape[..])];
        let l = layout(&out, 2, |k| specs[k]).unwrap();
        assert_eq!(l.tensors.get(1).data_offsets, (1216, 1816));
        assert_eq!(l.file_len() % 32, 0);
        let mut file = l.header.clone();
        file.resize(l.file_len() as usize, 0);
        gguf::parse(&file).unwrap();
    }
}
