//! A safetensors header's JSON, read in one pass with the reference's
//! decisions.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};

use crate::format::{Dtype, FormatError, Metadata, Tensors};

// ---- JSON ----
//
// The reference deserializes into a struct with a `__metadata__` field and a
// flattened HashMap of tensors, which buffers the whole document in serde's
// `Content` tree first. This visitor makes the same decisions in one pass:
// a repeated `__metadata__` is an error, a repeated tensor name keeps the last
// entry (each entry must still be valid; see TensorsByName::build), unknown fields inside an entry are
// ignored (serde's derive skips them, as the reference's does), and JSON that
// is not an object is refused.

pub(in crate::format) struct RawHeader {
    pub(in crate::format) metadata: Option<Metadata>,
    pub(in crate::format) tensors: Tensors,
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: Dtype,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Parses the JSON text; an error inside a tensor entry names that tensor.
pub(in crate::format) fn parse_json(text: &str) -> Result<RawHeader, FormatError> {
    let mut failed_entry = None;
    let mut de = serde_json::Deserializer::from_str(text);
    de.deserialize_map(HeaderVisitor {
        failed_entry: &mut failed_entry,
    })
    .and_then(|raw| de.end().map(|()| raw))
    .map_err(|e| FormatError::HeaderJson {
        tensor: failed_entry,
        message: e.to_string(),
    })
}

struct HeaderVisitor<'a> {
    failed_entry: &'a mut Option<String>,
}

impl<'de> Visitor<'de> for HeaderVisitor<'_> {
    type Value = RawHeader;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
        let mut metadata: Option<Option<Metadata>> = None;
        let mut tensors = Tensors::default();
        while let Some(key) = map.next_key::<String>()? {
            if key == "__metadata__" {
                if metadata.is_some() {
                    return Err(de::Error::duplicate_field("__metadata__"));
                }
                metadata = Some(map.next_value()?);
                continue;
            }
            let entry: RawEntry = match map.next_value() {
                Ok(entry) => entry,
                Err(e) => {
                    *self.failed_entry = Some(key);
                    return Err(e);
                }
            };
            // Repeated names are resolved by TensorsByName::build.
            tensors
                .push(&key, entry.dtype, &entry.shape, entry.data_offsets)
                .map_err(|_| de::Error::custom("header too large to hold"))?;
        }
        Ok(RawHeader {
            metadata: metadata.flatten(),
            tensors,
        })
    }
}
