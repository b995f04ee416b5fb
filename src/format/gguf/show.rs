//! GGUF values as a person and `__kv__`/`__metadata__.json` show them:
//! short text, JSON, a key's file; long strings and arrays read from the
//! file when asked, within limits.

use super::*;

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
