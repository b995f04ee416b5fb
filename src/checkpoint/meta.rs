//! The JSON files of a checkpoint directory: a tensor's `.meta.json` (its
//! dtype and shape) and `__metadata__.json`. What is written to them is kept
//! as written when it does not parse, so nothing is dropped silently; a
//! commit refuses it, naming the file and the parse error.

use serde::{Deserialize, Serialize};

use crate::format::{Dtype, FormatError, Metadata, SizeError, byte_len};

/// Largest `__metadata__.json` accepted.
pub const MAX_JSON: usize = 16 << 20;
/// Largest `.meta.json` accepted: a dtype and a shape (the meta of a tensor
/// of 64 dimensions is under 2 KiB), so that metas kept as written, in
/// memory and in the journal, stay small.
pub const MAX_META: usize = 64 << 10;

/// A name's dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Meta {
    /// No `.meta.json`: a file that is not (yet) a tensor.
    None,
    Valid {
        // (By name, so that the journal takes back a GGUF tensor's block
        // type, which a safetensors header may not name.)
        #[serde(with = "dtype_by_name")]
        dtype: Dtype,
        shape: Vec<u64>,
    },
    /// Written, but not a usable meta: kept as written, with the reason.
    Invalid { text: Vec<u8>, error: String },
}

/// A dtype by its name, any of stfs's (ggml's block types too).
mod dtype_by_name {
    use super::Dtype;

    pub fn serialize<S: serde::Serializer>(d: &Dtype, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.name())
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Dtype, D::Error> {
        let name = <std::borrow::Cow<str> as serde::Deserialize>::deserialize(d)?;
        Dtype::from_any_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown dtype {name:?}")))
    }
}

impl Meta {
    /// Reads what was written to a `.meta.json`: `dtype` and `shape` count,
    /// every other field is ignored (so `cp a.meta.json b.meta.json` works).
    pub fn parse(text: &[u8]) -> Meta {
        match parse_meta(text) {
            Ok((dtype, shape)) => Meta::Valid { dtype, shape },
            Err(error) => Meta::Invalid {
                text: text.to_vec(),
                error: error.to_string(),
            },
        }
    }

    pub fn exists(&self) -> bool {
        !matches!(self, Meta::None)
    }

    /// The byte size the dtype and shape call for.
    pub fn nbytes(&self) -> Option<u64> {
        match self {
            Meta::Valid { dtype, shape } => byte_len(*dtype, shape).ok(),
            _ => None,
        }
    }
}

/// The JSON of a file, without the NUL bytes a tool may have extended it with
/// (`ftruncate` to a length it read before the text changed).
fn json_part(text: &[u8]) -> &[u8] {
    let end = text.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
    &text[..end]
}

/// Why a written `.meta.json` or `__metadata__.json` is not usable.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("empty")]
    Empty,
    #[error("not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("needs \"dtype\", a string")]
    NoDtype,
    #[error("unknown dtype {name:?} (one of {})", Dtype::ALL.map(|d| d.name()).join(", "))]
    UnknownDtype { name: String },
    #[error("needs \"shape\", an array")]
    NoShape,
    #[error("\"shape\" must hold non-negative integers")]
    BadShape,
    /// The dtype and shape have no byte size (the format's words).
    #[error("{0}")]
    NoSize(String),
    #[error("must be a JSON object of string values: {0}")]
    NotMetadata(#[source] serde_json::Error),
}

impl crate::errno::ToErrno for MetaError {
    /// What was written is not a meta (or metadata) document.
    fn to_errno(&self) -> i32 {
        libc::EINVAL
    }
}

fn parse_meta(text: &[u8]) -> Result<(Dtype, Vec<u64>), MetaError> {
    let text = json_part(text);
    if text.iter().all(u8::is_ascii_whitespace) {
        return Err(MetaError::Empty);
    }
    let v: serde_json::Value = serde_json::from_slice(text).map_err(MetaError::NotJson)?;
    let dtype = v
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or(MetaError::NoDtype)?;
    let dtype = Dtype::from_any_name(dtype).ok_or_else(|| MetaError::UnknownDtype {
        name: dtype.to_string(),
    })?;
    let shape = v
        .get("shape")
        .and_then(|s| s.as_array())
        .ok_or(MetaError::NoShape)?
        .iter()
        .map(|d| d.as_u64())
        .collect::<Option<Vec<u64>>>()
        .ok_or(MetaError::BadShape)?;
    byte_len(dtype, &shape).map_err(|e| MetaError::NoSize(size_message("", dtype, &shape, e)))?;
    Ok((dtype, shape))
}

/// The format core's words for a dtype and shape without a byte size; with an
/// empty name, the rule alone.
pub fn size_message(name: &str, dtype: Dtype, shape: &[u64], e: SizeError) -> String {
    let (tensor, shape) = (name.to_string(), shape.to_vec());
    let full = match e {
        SizeError::Overflow => FormatError::Overflow { tensor, shape },
        SizeError::NotByteAligned => FormatError::NotByteAligned {
            tensor,
            dtype,
            shape,
        },
    }
    .to_string();
    if name.is_empty() {
        // Drop the `tensor "": ` prefix.
        full.split_once(": ")
            .map_or(full.clone(), |(_, rule)| rule.to_string())
    } else {
        full
    }
}

/// The `__metadata__` of a checkpoint, as `__metadata__.json` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetadataDoc {
    /// As in the source.
    Unchanged,
    /// Written: `None` for `{}`.
    Set(Option<Metadata>),
    Invalid {
        text: Vec<u8>,
        error: String,
    },
    /// `__metadata__.json` was removed: the checkpoint gets no metadata, and
    /// the file is absent until it is written again or the next commit.
    Removed,
}

impl MetadataDoc {
    pub fn parse(text: &[u8]) -> MetadataDoc {
        match parse_metadata(text) {
            Ok(m) => MetadataDoc::Set(m),
            Err(error) => MetadataDoc::Invalid {
                text: text.to_vec(),
                error: error.to_string(),
            },
        }
    }
}

/// An object of string values; `{}` means none.
pub fn parse_metadata(text: &[u8]) -> Result<Option<Metadata>, MetaError> {
    let meta: Metadata = serde_json::from_slice(json_part(text)).map_err(MetaError::NotMetadata)?;
    Ok((!meta.is_empty()).then_some(meta))
}

/// `__metadata__.json` as shown: the map with sorted keys and a newline.
pub fn render_metadata(meta: Option<&Metadata>) -> Vec<u8> {
    let mut out = match meta {
        Some(m) => serde_json::to_vec(m).expect("a string map serializes"),
        None => b"{}".to_vec(),
    };
    out.push(b'\n');
    out
}

/// What a `.meta.json` shows for a valid dtype and shape: the documented
/// field order, then the derived fields (offsets only while the bytes are the
/// source's), and a newline. A GGUF tensor's also shows its dims as ggml
/// stores them (`ne`, innermost first).
pub fn render_meta(
    dtype: Dtype,
    shape: &[u64],
    offsets: Option<((u64, u64), u64)>,
    nbytes: u64,
    name: &str,
    gguf: bool,
) -> Vec<u8> {
    let mut out = format!(
        "{{\"dtype\":\"{dtype}\",\"shape\":{}",
        serde_json::to_string(shape).expect("integers serialize")
    );
    if gguf {
        let ne: Vec<u64> = shape.iter().rev().copied().collect();
        out.push_str(&format!(
            ",\"ne\":{}",
            serde_json::to_string(&ne).expect("integers serialize")
        ));
    }
    if let Some(((begin, end), file_offset)) = offsets {
        out.push_str(&format!(
            ",\"data_offsets\":[{begin},{end}],\"file_offset\":{file_offset}"
        ));
    }
    out.push_str(&format!(
        ",\"nbytes\":{nbytes},\"name\":{}}}\n",
        serde_json::to_string(name).expect("a string serializes")
    ));
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_parses_or_keeps_the_text_and_the_reason() {
        assert_eq!(
            Meta::parse(br#"{"dtype":"BF16","shape":[2,3],"nbytes":1,"x":null}"#),
            Meta::Valid {
                dtype: Dtype::BF16,
                shape: vec![2, 3]
            }
        );
        for (text, why) in [
            (&b""[..], "empty"),
            (b"{", "not JSON"),
            (br#"{"dtype":"f32","shape":[1]}"#, "unknown dtype \"f32\""),
            (br#"{"dtype":"F32"}"#, "needs \"shape\""),
            (br#"{"dtype":"F32","shape":[-1]}"#, "non-negative"),
            (
                br#"{"dtype":"F4","shape":[3]}"#,
                "not a whole number of bytes",
            ),
            (
                br#"{"dtype":"F64","shape":[4294967296,4294967296]}"#,
                "overflows",
            ),
        ] {
            match Meta::parse(text) {
                Meta::Invalid { text: kept, error } => {
                    assert_eq!(kept, text);
                    assert!(error.contains(why), "{error:?} should say {why:?}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn metadata_is_an_object_of_strings() {
        assert_eq!(MetadataDoc::parse(b"{}"), MetadataDoc::Set(None));
        assert!(matches!(
            MetadataDoc::parse(br#"{"a":1}"#),
            MetadataDoc::Invalid { .. }
        ));
        assert_eq!(render_metadata(None), b"{}\n");
    }

    #[test]
    fn rendered_meta_reads_back() {
        let text = render_meta(Dtype::I16, &[2], Some(((0, 4), 80)), 4, "a/b", false);
        assert_eq!(
            std::str::from_utf8(&text).unwrap(),
            "{\"dtype\":\"I16\",\"shape\":[2],\"data_offsets\":[0,4],\"file_offset\":80,\"nbytes\":4,\"name\":\"a/b\"}\n"
        );
        assert_eq!(
            Meta::parse(&text),
            Meta::Valid {
                dtype: Dtype::I16,
                shape: vec![2]
            }
        );
    }
}
