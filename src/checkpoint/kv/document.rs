//! `__metadata__.json` of a GGUF checkpoint: every key with its type and
//! value, as shown, and as written back (the whole document at once).

use super::*;

/// `__metadata__.json` as written: each key, its type, its value, in order.
/// (Its error says which key and why, as a value's does.)
fn parse_document(
    text: &[u8],
) -> Result<Vec<(String, KvType, serde_json::Value)>, write::ValueError> {
    struct Ordered(Vec<(String, serde_json::Value)>);
    impl<'de> Deserialize<'de> for Ordered {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Ordered;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object of keys")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut m: A,
                ) -> Result<Ordered, A::Error> {
                    let mut out = Vec::new();
                    while let Some(entry) = m.next_entry()? {
                        out.push(entry);
                    }
                    Ok(Ordered(out))
                }
            }
            d.deserialize_map(V)
        }
    }
    let Ordered(keys) = serde_json::from_slice(text).map_err(|e| format!("not JSON: {e}"))?;
    let type_named = |v: Option<&serde_json::Value>| {
        let name = v.and_then(|v| v.as_str())?;
        ValueType::ALL.into_iter().find(|t| t.name() == name)
    };
    let mut seen = std::collections::HashSet::new();
    keys.into_iter()
        .map(|(key, entry)| {
            if !seen.insert(key.clone()) {
                return Err(format!("key {key:?} appears twice").into());
            }
            let bad = || {
                write::ValueError(format!(
                    "key {key:?}: not {{\"type\": TYPE, \"value\": VALUE}} (arrays also \"item_type\")"
                ))
            };
            let value = type_named(entry.get("type")).ok_or_else(bad)?;
            let item = match value {
                ValueType::Array => Some(
                    type_named(entry.get("item_type"))
                        .filter(|t| *t != ValueType::Array)
                        .ok_or_else(bad)?,
                ),
                _ => None,
            };
            let v = entry.get("value").cloned().ok_or_else(bad)?;
            Ok((key, KvType { value, item }, v))
        })
        .collect()
}

impl Live {
    /// `__metadata__.json` of the keys as edited.
    pub(in crate::checkpoint) fn kv_metadata_json(&self) -> std::io::Result<Vec<u8>> {
        let t = self.kv().expect("a GGUF file");
        let entries = t
            .entries
            .iter()
            .map(|e| Ok((e.key.as_str(), self.kv_entry_json(e)?)));
        crate::format::gguf::metadata_json_of(entries)
    }

    /// A key's entry in `__metadata__.json`.
    fn kv_entry_json(&self, e: &KvEntry) -> std::io::Result<serde_json::Value> {
        let read = |at, len| self.source.read_range(at, len);
        Ok(match &e.content {
            Content::Source(i) => {
                let value = &header(&self.source).kvs[*i].1;
                if matches!(value, Value::Array(_)) {
                    self.source.check_unchanged()?;
                }
                crate::format::gguf::entry_json(value, &read)?
            }
            Content::Written { value: Ok(v), .. } => write::encoded_entry(v),
            Content::Written {
                value: Err(why), ..
            } => serde_json::json!({
                "type": e.ty.value.name(),
                "invalid": why.to_string(),
            }),
        })
    }

    /// `__metadata__.json` written: every key with its type and value
    /// (`{"KEY": {"type": "UINT32", "value": 7}, ...}`; an array also
    /// `"item_type"`), in order. The keys become those: a key not there is
    /// removed, a type there is the key's type from now on (how a new key
    /// gets a type other than STRING). Text that is not such a document is
    /// refused (EINVAL), and nothing changes.
    pub fn kv_set_document(&mut self, text: &[u8]) -> Result<(), EditError> {
        let doc = parse_document(text).map_err(|e| EditError::Invalid(e.0))?;
        let mut entries = Vec::with_capacity(doc.len());
        for (key, ty, value) in doc {
            if key == ROOM_KEY {
                continue; // (stfs's own: sized by each commit)
            }
            refuse_name(&key)?;
            // A value as shown stays as it is (a string that is not UTF-8
            // shows lossily, and must not become what it shows).
            let current = self
                .kv()
                .and_then(|t| t.position(&key).map(|p| t.entries[p].clone()))
                .filter(|e| e.ty == ty);
            if let Some(e) = current {
                let shown = self.kv_entry_json(&e).ok();
                if shown.and_then(|j| j.get("value").cloned()).as_ref() == Some(&value) {
                    entries.push(e);
                    continue;
                }
            }
            let content = match value {
                // (Floats JSON has not: "NaN", "inf", "-inf".)
                serde_json::Value::String(s)
                    if matches!(
                        ty.value,
                        ValueType::String | ValueType::F32 | ValueType::F64
                    ) =>
                {
                    parse(ty, s.as_bytes())
                }
                v if ty.value == ValueType::Array => parse(ty, v.to_string().as_bytes()),
                serde_json::Value::Bool(b) => parse(ty, b.to_string().as_bytes()),
                serde_json::Value::Number(n) => parse(ty, n.to_string().as_bytes()),
                v => Content::Written {
                    text: v.to_string().into_bytes(),
                    value: Err(format!("{v} is not a {}", ty.name()).into()),
                },
            };
            let content = match content {
                Content::Written {
                    value: Err(why), ..
                } => {
                    return Err(EditError::Invalid(format!("key {key:?}: {why}")));
                }
                // (`__kv__` shows it as it shows any value.)
                Content::Written { value: Ok(v), .. } => Content::Written {
                    text: write::encoded_text(&v),
                    value: Ok(v),
                },
                source => source,
            };
            let id = match self.kv_find(&key) {
                Some(id) => id,
                None => {
                    let t = self.kv_mut()?;
                    t.next_id += 1;
                    t.next_id - 1
                }
            };
            entries.push(KvEntry {
                id,
                key,
                ty,
                content,
                edited: Some(SystemTime::now()),
            });
        }
        let t = self.kv_mut()?;
        // (A key the document left out keeps its type for its name, as `rm`
        // of its file does.)
        for e in &t.entries {
            if !entries.iter().any(|n| n.key == e.key) {
                t.gone.insert(e.key.clone(), e.ty);
            }
        }
        t.entries = entries;
        self.kv_settle();
        self.kv_changed()
    }
}
