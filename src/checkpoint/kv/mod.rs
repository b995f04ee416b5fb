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

mod document;
mod records;

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
}
