//! The keys of a GGUF checkpoint as edited (docs/SEMANTICS.md, "GGUF"):
//! one file per key in `__kv__/`, whose text is the value as a person edits
//! it. A key keeps its type through every edit (a number written into a
//! UINT32 key is read as one); a value that does not fit the type is kept as
//! written, refused at close (EINVAL) and listed by `stfs status`, and a
//! commit refuses it. A new key takes its name's type (the source's, or
//! the one the name had during the mount), else is a string.
//! `__metadata__.json` shows the same state, every key with its type.
//!
//! The table is `Live`'s (`Live::kv`); its journal record is the whole
//! table (`Record::Keys`), self-contained: a key whose value is the
//! source's under the same name says so, any other carries its text.

use std::sync::OnceLock;
use std::time::SystemTime;

use serde::Deserialize;

use super::journal::{KeyRecord, Record, Text};
use super::{EditError, Live, Problem, next_gen};
use crate::format::gguf::write::{self, KvType, ROOM_KEY};
use crate::format::gguf::{GgufHeader, Value, ValueType};
use crate::source::SourceFile;
use tracing::info;

/// A key's value: the source's key `i` as the file has it, or text written.
#[derive(Clone)]
enum Content {
    Source(usize),
    Written {
        text: Vec<u8>,
        /// The value encoded, or why the text is not one of the key's type.
        value: Result<Vec<u8>, write::ValueError>,
    },
}

#[derive(Clone)]
struct KvEntry {
    /// Its file's id (the inode's), for the life of the mount.
    id: u64,
    key: String,
    ty: KvType,
    content: Content,
    edited: Option<SystemTime>,
}

/// The keys of a GGUF checkpoint, in file order.
pub struct KvTable {
    entries: Vec<KvEntry>,
    next_id: u64,
    /// Moves with every edit: a commit keeps the edits made after its plan.
    generation: u64,
    /// What `__kv__` shows of each source key, made when first read.
    shown: Vec<OnceLock<Vec<u8>>>,
    /// The type each name had when its key was removed or moved away: a
    /// key made again under that name has it (a tool that keeps a backup
    /// renames the file, then writes a new one).
    gone: std::collections::HashMap<String, KvType>,
}

fn header(source: &SourceFile) -> &GgufHeader {
    source
        .header()
        .gguf
        .as_deref()
        .expect("a key table is a GGUF file's")
}

impl KvTable {
    /// The keys of `source` as it is (its room key left out).
    pub fn of(source: &SourceFile) -> KvTable {
        let h = header(source);
        let entries = h
            .kvs
            .iter()
            .enumerate()
            .filter(|(_, (key, _))| key != ROOM_KEY)
            .map(|(i, (key, v))| KvEntry {
                id: i as u64,
                key: key.clone(),
                ty: KvType::of(v),
                content: Content::Source(i),
                edited: None,
            })
            .collect();
        KvTable {
            entries,
            next_id: h.kvs.len() as u64,
            generation: 0,
            shown: (0..h.kvs.len()).map(|_| OnceLock::new()).collect(),
            gone: Default::default(),
        }
    }

    fn position(&self, key: &str) -> Option<usize> {
        self.entries.iter().position(|e| e.key == key)
    }

    fn by_id(&self, id: u64) -> Option<&KvEntry> {
        self.entries.iter().find(|e| e.id == id)
    }
}

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

/// Names no key may have: empty, stfs's room, and those gguf-py's reader
/// gives its own fields (a file with one is a file it cannot read).
fn refuse_name(key: &str) -> Result<(), EditError> {
    const GGUF_PY: [&str; 3] = ["GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"];
    let why = match key {
        "" => "a key has a name",
        ROOM_KEY => "stfs keeps it for the header's room",
        k if GGUF_PY.contains(&k) => "gguf-py reads the file's own counts under that name",
        _ => return Ok(()),
    };
    Err(EditError::Invalid(format!(
        "{key:?} cannot be a key: {why}"
    )))
}

/// The value of source key `i`, encoded (arrays read from the file: EIO
/// once it changed behind the mount).
fn source_value(source: &SourceFile, i: usize) -> std::io::Result<Vec<u8>> {
    let value = &header(source).kvs[i].1;
    if matches!(value, Value::Array(_)) {
        source.check_unchanged()?;
    }
    let read = |at, len| source.read_range(at, len);
    write::encode(value, &read)
}

/// What was written to a key's file: a value of its type shows as the
/// file will after a commit (`printf abc` reads back `abc` and a newline,
/// before the commit as after); text that is not one is kept as written.
fn parse(ty: KvType, text: &[u8]) -> Content {
    let value = write::parse_text(ty, text);
    let text = match &value {
        Ok(encoded) => write::encoded_text(encoded),
        Err(_) => text.to_vec(),
    };
    Content::Written { value, text }
}

impl Live {
    fn kv(&self) -> Option<&KvTable> {
        self.kv.as_ref()
    }

    fn kv_mut(&mut self) -> Result<&mut KvTable, EditError> {
        self.kv
            .as_mut()
            .ok_or_else(|| EditError::Invalid("only a GGUF file has keys".into()))
    }

    /// The keys' file ids and names, by id (a listing's stable order).
    pub fn kv_keys(&self) -> Vec<(u64, String)> {
        let mut keys: Vec<(u64, String)> = self
            .kv()
            .map(|t| t.entries.iter().map(|e| (e.id, e.key.clone())).collect())
            .unwrap_or_default();
        keys.sort_unstable();
        keys
    }

    /// The file id of `key`.
    pub fn kv_find(&self, key: &str) -> Option<u64> {
        let t = self.kv()?;
        t.position(key).map(|p| t.entries[p].id)
    }

    pub fn kv_key(&self, id: u64) -> Option<&str> {
        self.kv()?.by_id(id).map(|e| e.key.as_str())
    }

    /// What `__kv__/KEY` shows: the value's text (`gguf::kv_file_text`,
    /// strings with a final newline), or what was written; an error when
    /// the value is an array in a file that cannot be read now (rewritten
    /// in place since the mount, say).
    pub fn kv_text(&self, id: u64) -> Option<std::io::Result<Vec<u8>>> {
        let t = self.kv()?;
        match &t.by_id(id)?.content {
            Content::Written { text, .. } => Some(Ok(text.clone())),
            Content::Source(i) => Some(self.shown_source_key(t, *i).map(<[u8]>::to_vec)),
        }
    }

    /// (0 when it cannot be read now: reads fail.)
    pub fn kv_len(&self, id: u64) -> Option<u64> {
        let t = self.kv()?;
        Some(match &t.by_id(id)?.content {
            Content::Written { text, .. } => text.len() as u64,
            Content::Source(i) => self.shown_source_key(t, *i).map_or(0, |s| s.len() as u64),
        })
    }

    /// When key `id` was last written (None: as the source has it).
    pub fn kv_edited(&self, id: u64) -> Option<SystemTime> {
        self.kv()?.by_id(id)?.edited
    }

    /// A source key's text; an array's (read from the file when first
    /// shown) fails with EIO once the file changed behind the mount, as its
    /// tensors' bytes do, shown before or not.
    fn shown_source_key<'t>(&self, t: &'t KvTable, i: usize) -> std::io::Result<&'t [u8]> {
        let value = &header(&self.source).kvs[i].1;
        if matches!(value, Value::Array(_)) {
            self.source.check_unchanged()?;
        }
        if let Some(shown) = t.shown[i].get() {
            return Ok(shown);
        }
        let read = |at, len| self.source.read_range(at, len);
        match crate::format::gguf::kv_file_text(value, &read) {
            Ok(text) => Ok(t.shown[i].get_or_init(|| text)),
            Err(e) => {
                // (Asked at every stat: the source logs the cause once.)
                tracing::debug!(file = %self.source.path().display(), "reading a key's value: {e}");
                Err(e)
            }
        }
    }

    /// A new key named `key`, empty until written: of the type the source
    /// has under that name, or the name had when it was removed or moved
    /// away during the mount (a tool keeping a backup: `sed -i.bak`,
    /// `install`, `rsync --backup`), else a string.
    pub fn kv_create(&mut self, key: &str) -> Result<u64, EditError> {
        refuse_name(key)?;
        let ty = self.kv_name_type(key).unwrap_or(KvType::STRING);
        let t = self.kv_mut()?;
        if t.position(key).is_some() {
            return Err(EditError::Exists);
        }
        let id = t.next_id;
        t.next_id += 1;
        t.entries.push(KvEntry {
            id,
            key: key.to_string(),
            ty,
            content: parse(ty, b""),
            edited: Some(SystemTime::now()),
        });
        self.kv_changed()?;
        Ok(id)
    }

    /// Key `id`'s value is `text` now, read as its type; returns why it is
    /// not one (kept as written all the same, and refused by a commit).
    pub fn kv_set(&mut self, id: u64, text: &[u8]) -> Result<Option<String>, EditError> {
        let t = self.kv_mut()?;
        let e = t
            .entries
            .iter_mut()
            .find(|e| e.id == id)
            .ok_or(EditError::NotFound)?;
        e.content = parse(e.ty, text);
        e.edited = Some(SystemTime::now());
        let why = match &e.content {
            Content::Written {
                value: Err(why), ..
            } => Some(why.to_string()),
            _ => None,
        };
        self.kv_settle();
        self.kv_changed()?;
        Ok(why)
    }

    pub fn kv_remove(&mut self, key: &str) -> Result<(), EditError> {
        let t = self.kv_mut()?;
        let p = t.position(key).ok_or(EditError::NotFound)?;
        let gone = t.entries.remove(p);
        t.gone.insert(gone.key, gone.ty);
        self.kv_changed()
    }

    /// `mv FROM TO` in `__kv__`: the value moves to TO, which keeps its own
    /// type and place if it was there (a tool's temp file renamed over a
    /// key gives it a new value); a TO the source has, or that was a key
    /// during the mount, takes that type (a tool that moved the key to a
    /// backup first); else FROM's type stays. Fails (EINVAL, nothing
    /// changed) when the value does not fit the type.
    pub fn kv_rename(&mut self, from: &str, to: &str) -> Result<(), EditError> {
        refuse_name(to)?;
        let id = self.kv_find(from).ok_or(EditError::NotFound)?;
        if from == to {
            return Ok(());
        }
        let shown = self.kv_text(id).ok_or(EditError::NotFound)??;
        let name_type = self.kv_name_type(to);
        let t = self.kv_mut()?;
        let p = t.position(from).ok_or(EditError::NotFound)?;
        let target = t.position(to);
        let mut moved = t.entries[p].clone();
        // The type is the name's: the key there, or the one the name had.
        let ty = target
            .map(|q| t.entries[q].ty)
            .or(name_type)
            .unwrap_or(moved.ty);
        if ty != moved.ty {
            let content = parse(ty, &shown);
            if let Content::Written {
                value: Err(why), ..
            } = &content
            {
                return Err(EditError::Invalid(format!(
                    "{from:?} cannot become {to:?} (of type {}): {why}",
                    ty.name()
                )));
            }
            moved.ty = ty;
            moved.content = content;
        } else if let Content::Source(_) = moved.content {
            // The file's value under another name is text from now on (the
            // journal keeps it without reading the file again).
            moved.content = parse(ty, &shown);
        }
        t.gone.insert(from.to_string(), t.entries[p].ty);
        moved.key = to.to_string();
        moved.edited = Some(SystemTime::now());
        match target {
            Some(q) => {
                t.entries[q] = moved;
                t.entries.remove(p);
            }
            None => t.entries[p] = moved,
        }
        self.kv_settle();
        self.kv_changed()
    }

    /// The type a key made under `name` takes: the source's under that
    /// name, or the one the name had when its key was removed or moved away.
    /// (Else a key ggml reads with a type of its own has that type.)
    fn kv_name_type(&self, name: &str) -> Option<KvType> {
        let source = header(&self.source)
            .kvs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| KvType::of(v));
        let known = || {
            (name == "general.alignment").then_some(KvType {
                value: ValueType::U32,
                item: None,
            })
        };
        source
            .or_else(|| self.kv()?.gone.get(name).copied())
            .or_else(known)
    }

    /// After an edit: a written value that is the source's own under the
    /// same key is the source's again (`stfs status` shows no change).
    fn kv_settle(&mut self) {
        let Some(t) = self.kv.as_ref() else { return };
        let h = header(&self.source);
        let same: Vec<(usize, usize)> = t
            .entries
            .iter()
            .enumerate()
            .filter_map(|(p, e)| {
                let Content::Written { value: Ok(v), .. } = &e.content else {
                    return None;
                };
                let i = h.kvs.iter().position(|(k, _)| *k == e.key)?;
                let ours = KvType::of(&h.kvs[i].1) == e.ty
                    && source_value(&self.source, i).is_ok_and(|s| s == *v);
                ours.then_some((p, i))
            })
            .collect();
        let t = self.kv.as_mut().expect("checked");
        for (p, i) in same {
            t.entries[p].content = Content::Source(i);
        }
    }

    fn kv_changed(&mut self) -> Result<(), EditError> {
        if let Some(t) = self.kv.as_mut() {
            t.generation = next_gen();
        }
        self.dirty = true;
        let keys = self.kv_records();
        let mut records = vec![Record::Keys { keys }];
        // (A key edited: `__metadata__.json` shows the keys again, not a
        // document that was not one.)
        if matches!(self.metadata, super::meta::MetadataDoc::Invalid { .. }) {
            self.metadata = super::meta::MetadataDoc::Unchanged;
            self.metadata_gen = next_gen();
            records.push(Record::Metadata {
                doc: super::meta::MetadataDoc::Unchanged,
            });
        }
        self.log(records)
    }

    /// Whether the keys are the source's, in its order.
    pub fn kv_unchanged(&self) -> bool {
        let Some(t) = self.kv() else { return true };
        let source: Vec<usize> = (0..header(&self.source).kvs.len())
            .filter(|&i| header(&self.source).kvs[i].0 != ROOM_KEY)
            .collect();
        t.entries.len() == source.len()
            && t.entries.iter().zip(&source).all(|(e, &i)| {
                matches!(e.content, Content::Source(j) if j == i)
                    && e.key == header(&self.source).kvs[i].0
            })
    }

    /// The table as the journal keeps it (None: no table).
    pub(super) fn kv_records(&self) -> Vec<KeyRecord> {
        let Some(t) = self.kv() else {
            return Vec::new();
        };
        let h = header(&self.source);
        t.entries
            .iter()
            .map(|e| KeyRecord {
                key: e.key.clone(),
                ty: e.ty,
                text: match &e.content {
                    Content::Source(i) if h.kvs[*i].0 == e.key => None,
                    // (A source key is under its own name: a move makes its
                    // value text, so this reads no file.)
                    _ => Some(Text::of(
                        &self.kv_text(e.id).and_then(Result::ok).unwrap_or_default(),
                    )),
                },
            })
            .collect()
    }

    /// Takes back a journaled table; notes what could not be.
    pub(super) fn kv_replay(&mut self, keys: Vec<KeyRecord>) -> Vec<String> {
        let mut notes = Vec::new();
        let Some(t) = self.kv.as_ref() else {
            return vec!["the journal has keys, but the file is not GGUF now; not restored".into()];
        };
        let h = header(&self.source);
        let mut next_id = t.next_id;
        let mut entries = Vec::new();
        for k in keys {
            let content = match k.text {
                Some(text) => parse(k.ty, &text.into_bytes()),
                None => match h.kvs.iter().position(|(key, _)| *key == k.key) {
                    Some(i) => Content::Source(i),
                    None => {
                        notes.push(format!(
                            "key {:?}: its value was the file's, which has it no longer; not restored",
                            k.key
                        ));
                        continue;
                    }
                },
            };
            let id = match &content {
                Content::Source(i) => *i as u64,
                _ => {
                    next_id += 1;
                    next_id - 1
                }
            };
            entries.push(KvEntry {
                id,
                key: k.key,
                ty: k.ty,
                content,
                edited: Some(SystemTime::now()),
            });
        }
        let t = self.kv.as_mut().expect("checked");
        t.entries = entries;
        t.next_id = next_id;
        t.generation = next_gen();
        notes
    }

    /// What a commit would refuse of the keys.
    pub(super) fn kv_problems(&self) -> Vec<Problem> {
        let Some(t) = self.kv() else {
            return Vec::new();
        };
        let mut problems: Vec<Problem> = t
            .entries
            .iter()
            .filter_map(|e| match &e.content {
                Content::Written {
                    value: Err(why), ..
                } => Some(Problem {
                    tensor: None,
                    rule: format!("__kv__/{}: {why}", crate::format::printable(&e.key)),
                }),
                // (ggml takes any bytes, but gguf-py and JSON readers of the
                // file do not: an editor's swap file is not a key.)
                Content::Written { text, value: Ok(_) }
                    if e.ty.value == ValueType::String && std::str::from_utf8(text).is_err() =>
                {
                    Some(Problem {
                        tensor: None,
                        rule: format!(
                            "__kv__/{}: a string that is not UTF-8 (gguf-py cannot read it; an \
                             editor's swap file?): remove the key or write text",
                            crate::format::printable(&e.key)
                        ),
                    })
                }
                _ => None,
            })
            .collect();
        // The tensors, as ggml would read them.
        for (_, e) in self.entries_from(0) {
            if let (Some(_), super::MetaView::Valid(dtype, shape)) = (e.data, e.meta) {
                if let Some(rule) = write::tensor_rule(e.name, dtype, shape) {
                    problems.push(Problem {
                        tensor: Some(e.name.to_string()),
                        rule,
                    });
                }
            }
        }
        if let Some(e) = t.entries.iter().find(|e| e.key == "general.alignment") {
            let ok = e.ty.value == ValueType::U32
                && self
                    .kv_encoded(e)
                    .ok()
                    .and_then(|v| write::decode(&v))
                    .is_some_and(|v| matches!(v, Value::U32(a) if a.is_power_of_two()));
            if !ok {
                problems.push(Problem {
                    tensor: None,
                    rule:
                        "__kv__/general.alignment: it must be a UINT32 power of two (ggml refuses \
                           the file otherwise)"
                            .into(),
                });
            }
        }
        problems
    }

    fn kv_encoded(&self, e: &KvEntry) -> std::io::Result<Vec<u8>> {
        match &e.content {
            Content::Source(i) => source_value(&self.source, *i),
            Content::Written { value: Ok(v), .. } => Ok(v.clone()),
            Content::Written {
                value: Err(why), ..
            } => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                why.clone(),
            )),
        }
    }

    /// The keys in file order, encoded, with the alignment they set: what
    /// a commit writes (`format::writer::Gguf`).
    pub(super) fn gguf_writer(&self) -> std::io::Result<Option<crate::format::writer::Gguf>> {
        let Some(t) = self.kv() else { return Ok(None) };
        let kvs = t
            .entries
            .iter()
            .map(|e| Ok((e.key.clone(), self.kv_encoded(e)?)))
            .collect::<std::io::Result<Vec<_>>>()?;
        let alignment = kvs
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| write::decode(v))
            .and_then(|v| match v {
                Value::U32(a) if a.is_power_of_two() => Some(a as u64),
                _ => None,
            })
            .unwrap_or(32);
        Ok(Some(crate::format::writer::Gguf {
            version: header(&self.source).version,
            kvs,
            alignment,
        }))
    }

    /// `__metadata__.json` of the keys as edited.
    pub(super) fn kv_metadata_json(&self) -> std::io::Result<Vec<u8>> {
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

    /// The tensors of the state: names with bytes and a valid meta.
    pub fn tensor_count(&self) -> u64 {
        self.entries_from(0)
            .filter(|(_, e)| e.data.is_some() && matches!(e.meta, super::MetaView::Valid(..)))
            .count() as u64
    }

    /// A part of a split GGUF file: its `split.tensors.count` set to
    /// `total` (the tensors of all parts) where it says otherwise, as an
    /// edit of the key (its type kept).
    pub fn kv_set_split_count(&mut self, total: u64) {
        let Some(id) = self.kv_find("split.tensors.count") else {
            return;
        };
        if self
            .kv_text(id)
            .and_then(Result::ok)
            .is_some_and(|t| t.trim_ascii() == total.to_string().as_bytes())
        {
            return;
        }
        match self.kv_set(id, format!("{total}\n").as_bytes()) {
            Ok(None) => {
                info!(file = %self.source.path().display(), total, "split.tensors.count set")
            }
            Ok(Some(why)) | Err(EditError::Invalid(why)) => {
                tracing::warn!(file = %self.source.path().display(), "split.tensors.count: {why}")
            }
            Err(e) => {
                tracing::warn!(file = %self.source.path().display(), "split.tensors.count: {e}")
            }
        }
    }

    /// The keys' generation (a commit's plan notes it).
    pub(super) fn kv_generation(&self) -> u64 {
        self.kv().map_or(0, |t| t.generation)
    }

    /// What changed in the keys, for `stfs status`.
    pub(super) fn kv_changes(&self) -> Vec<String> {
        let Some(t) = self.kv() else {
            return Vec::new();
        };
        let h = header(&self.source);
        let mut out = Vec::new();
        for e in &t.entries {
            let shown = crate::format::printable(&e.key);
            match (&e.content, h.kvs.iter().position(|(k, _)| *k == e.key)) {
                (Content::Source(i), Some(j)) if *i == j => {}
                (_, Some(j)) if KvType::of(&h.kvs[j].1) != e.ty => out.push(format!(
                    "key        {shown}: set, its type changed from {} to {}",
                    KvType::of(&h.kvs[j].1).name(),
                    e.ty.name()
                )),
                (_, Some(_)) => out.push(format!("key        {shown}: set")),
                (_, None) => out.push(format!("key        {shown}: added ({})", e.ty.name())),
            }
        }
        for (key, _) in &h.kvs {
            if key != ROOM_KEY && t.position(key).is_none() {
                out.push(format!(
                    "key        {}: removed",
                    crate::format::printable(key)
                ));
            }
        }
        // (An order is an edit too: `__metadata__.json` written so, or a
        // key removed and made again, which puts it last.)
        let in_file: std::collections::HashSet<&str> =
            h.kvs.iter().map(|(k, _)| k.as_str()).collect();
        let file_order = h
            .kvs
            .iter()
            .map(|(k, _)| k)
            .filter(|k| t.position(k).is_some());
        let order_now = t
            .entries
            .iter()
            .map(|e| &e.key)
            .filter(|k| in_file.contains(k.as_str()));
        if !file_order.eq(order_now) {
            out.push("keys       in another order".into());
        }
        out
    }

    /// The ids of the keys in order: a commit's plan notes which key it
    /// writes where.
    pub(super) fn kv_ids(&self) -> Vec<u64> {
        self.kv()
            .map(|t| t.entries.iter().map(|e| e.id).collect())
            .unwrap_or_default()
    }

    /// After a commit: the table of the new file, keeping the edits made
    /// since the plan (`planned`: the generation the plan wrote; `written`:
    /// the ids of the keys it wrote, in the new file's order). A key whose
    /// value is still the old file's is the new file's key written in its
    /// place: the old file is never read again (an in-place commit has
    /// rewritten it, and its bytes there are others now).
    pub(super) fn kv_after_commit(&mut self, planned: u64, written: &[u64]) {
        let Some(t) = self.kv.take() else { return };
        let mut fresh = KvTable::of(&self.source);
        if t.generation != planned {
            fresh.next_id = fresh.next_id.max(t.next_id);
            fresh.entries = t
                .entries
                .into_iter()
                .map(|mut e| {
                    if let Content::Source(_) = e.content {
                        e.content = match written.iter().position(|&id| id == e.id) {
                            Some(k) => Content::Source(k),
                            // (Not reached: a key the old file had was in the plan.)
                            None => Content::Written {
                                text: Vec::new(),
                                value: Err("its value was in the file a commit replaced; \
                                            write it again"
                                    .into()),
                            },
                        };
                    }
                    e
                })
                .collect();
            fresh.generation = next_gen();
        }
        self.kv = Some(fresh);
        self.kv_settle();
    }
}
