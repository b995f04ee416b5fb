//! The model's GGUF side: the same operations on a GGUF source, and the
//! keys of `__kv__` and `__metadata__.json` (docs/SEMANTICS.md, "GGUF"),
//! decided from the model's own reading of the rules: its own value
//! types, its own parser of what a person writes into a key, its own
//! renderer of values, and its own GGUF reader and writer (after gguf-py's
//! `GGUFWriter`), never stfs's.

use super::*;

/// The key types the model's files use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum KTy {
    U8,
    U32,
    I32,
    F32,
    Bool,
    Str,
    ArrI32,
    ArrStr,
}

impl KTy {
    pub(super) const ALL: [KTy; 8] = [
        KTy::U8,
        KTy::U32,
        KTy::I32,
        KTy::F32,
        KTy::Bool,
        KTy::Str,
        KTy::ArrI32,
        KTy::ArrStr,
    ];

    /// The type as stfs names it (`__metadata__.json`, `stfs status`).
    pub(super) fn name(self) -> &'static str {
        match self {
            KTy::U8 => "UINT8",
            KTy::U32 => "UINT32",
            KTy::I32 => "INT32",
            KTy::F32 => "FLOAT32",
            KTy::Bool => "BOOL",
            KTy::Str => "STRING",
            KTy::ArrI32 => "ARRAY of INT32",
            KTy::ArrStr => "ARRAY of STRING",
        }
    }

    /// GGUF's type id (and an array's item type id).
    fn ids(self) -> (u32, Option<u32>) {
        match self {
            KTy::U8 => (0, None),
            KTy::U32 => (4, None),
            KTy::I32 => (5, None),
            KTy::F32 => (6, None),
            KTy::Bool => (7, None),
            KTy::Str => (8, None),
            KTy::ArrI32 => (9, Some(5)),
            KTy::ArrStr => (9, Some(8)),
        }
    }

    /// `__metadata__.json`'s `"type"` (and `"item_type"`) of this type.
    fn doc_names(self) -> (&'static str, Option<&'static str>) {
        match self {
            KTy::ArrI32 => ("ARRAY", Some("INT32")),
            KTy::ArrStr => ("ARRAY", Some("STRING")),
            t => (t.name(), None),
        }
    }
}

/// A value of one of the model's types.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum MVal {
    U8(u8),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(Vec<u8>),
    ArrI32(Vec<i32>),
    ArrStr(Vec<String>),
}

impl MVal {
    pub(super) fn ty(&self) -> KTy {
        match self {
            MVal::U8(_) => KTy::U8,
            MVal::U32(_) => KTy::U32,
            MVal::I32(_) => KTy::I32,
            MVal::F32(_) => KTy::F32,
            MVal::Bool(_) => KTy::Bool,
            MVal::Str(_) => KTy::Str,
            MVal::ArrI32(_) => KTy::ArrI32,
            MVal::ArrStr(_) => KTy::ArrStr,
        }
    }

    /// The value as GGUF stores it after its type id.
    pub(super) fn payload(&self) -> Vec<u8> {
        let string = |s: &[u8]| [&(s.len() as u64).to_le_bytes()[..], s].concat();
        match self {
            MVal::U8(x) => vec![*x],
            MVal::U32(x) => x.to_le_bytes().to_vec(),
            MVal::I32(x) => x.to_le_bytes().to_vec(),
            MVal::F32(x) => x.to_le_bytes().to_vec(),
            MVal::Bool(x) => vec![*x as u8],
            MVal::Str(s) => string(s),
            MVal::ArrI32(v) => {
                let mut out = 5u32.to_le_bytes().to_vec();
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| out.extend(x.to_le_bytes()));
                out
            }
            MVal::ArrStr(v) => {
                let mut out = 8u32.to_le_bytes().to_vec();
                out.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| out.extend(string(s.as_bytes())));
                out
            }
        }
    }

    /// The value in `__metadata__.json`.
    pub(super) fn json(&self) -> serde_json::Value {
        match self {
            MVal::U8(x) => (*x).into(),
            MVal::U32(x) => (*x).into(),
            MVal::I32(x) => (*x).into(),
            // (A float by its shortest text: 0.5, 7.0.)
            MVal::F32(x) => serde_json::Number::from_f64(x.to_string().parse().unwrap())
                .unwrap()
                .into(),
            MVal::Bool(x) => (*x).into(),
            MVal::Str(s) => String::from_utf8_lossy(s).into_owned().into(),
            MVal::ArrI32(v) => v.clone().into(),
            MVal::ArrStr(v) => v.clone().into(),
        }
    }

    /// What `__kv__/KEY` shows: a string as it is, the rest as JSON; a
    /// final newline after each.
    pub(super) fn file_text(&self) -> Vec<u8> {
        let mut text = match self {
            MVal::Str(s) => s.clone(),
            v => v.json().to_string().into_bytes(),
        };
        text.push(b'\n');
        text
    }
}

/// The model's reading of what a person writes into a key of type `ty`:
/// a string less one final newline; a number or bool as its text, spaces
/// around it ignored; an array as a JSON array of its items.
pub(super) fn parse_text(ty: KTy, text: &[u8]) -> Option<MVal> {
    if ty == KTy::Str {
        return Some(MVal::Str(text.strip_suffix(b"\n").unwrap_or(text).to_vec()));
    }
    let s = std::str::from_utf8(text).ok()?;
    let items = || match serde_json::from_str::<serde_json::Value>(s).ok()? {
        serde_json::Value::Array(items) => Some(items),
        _ => None,
    };
    let t = s.trim();
    Some(match ty {
        KTy::U8 => MVal::U8(t.parse().ok()?),
        KTy::U32 => MVal::U32(t.parse().ok()?),
        KTy::I32 => MVal::I32(t.parse().ok()?),
        KTy::F32 => MVal::F32(t.parse::<f32>().ok().filter(|x| x.is_finite())?),
        KTy::Bool => MVal::Bool(match t {
            "true" | "1" => true,
            "false" | "0" => false,
            _ => return None,
        }),
        KTy::ArrI32 => MVal::ArrI32(
            items()?
                .iter()
                .map(|x| x.as_number()?.to_string().parse().ok())
                .collect::<Option<_>>()?,
        ),
        KTy::ArrStr => MVal::ArrStr(
            items()?
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()?,
        ),
        KTy::Str => unreachable!(),
    })
}

/// A key of the model: its type, and its value (None: text that is not
/// one of its type) with what its file shows.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct MKey {
    pub(super) name: String,
    pub(super) ty: KTy,
    pub(super) value: Option<MVal>,
    pub(super) shown: Vec<u8>,
    /// Identity of its `__kv__` file (its inode) until the next commit,
    /// discard or crash.
    pub(super) kid: u64,
    /// Its value is the committed file's (under this name or another):
    /// read from the file when needed.
    pub(super) from_file: bool,
}

impl MKey {
    /// An array the committed file holds: read from it when shown (EIO
    /// once it is rewritten in place).
    pub(super) fn array_from_file(&self) -> bool {
        self.from_file && matches!(self.ty, KTy::ArrI32 | KTy::ArrStr)
    }
}

/// The keys of the GGUF checkpoint, and what the model knows of them.
#[derive(Debug, Clone)]
pub(super) struct GState {
    pub(super) keys: Vec<MKey>,
    /// The keys of the file on disk, as committed.
    pub(super) committed: Vec<MKey>,
    /// The type a name had when its key was removed or moved away.
    pub(super) gone: HashMap<String, KTy>,
    /// The tensor order `__views__/model.gguf` showed at the last check:
    /// every way of committing writes that order.
    pub(super) view_order: Option<Vec<String>>,
    /// Inode identities of key files seen in this epoch.
    pub(super) ino_of: HashMap<u64, Ino>,
    pub(super) key_of: HashMap<Ino, u64>,
    /// A `__metadata__.json` written that is not a document of keys: kept
    /// as written (shown, a problem, a commit refused) until a document of
    /// keys or an edit of a key replaces it.
    pub(super) invalid_document: Option<Vec<u8>>,
}

/// The key names the operations use: the source's, and two new ones.
pub(super) const KEYS: [&str; 10] = [
    "general.architecture",
    "general.alignment",
    "t.u8",
    "t.i32",
    "t.f32",
    "t.bool",
    "t.arr",
    "t.strs",
    "new.a",
    "new.b",
];

/// The source's keys: name and value (each value its type's only one).
pub(super) fn source_keys() -> Vec<(&'static str, MVal)> {
    vec![
        ("general.architecture", MVal::Str(b"llama".to_vec())),
        ("general.alignment", MVal::U32(64)),
        ("t.u8", MVal::U8(7)),
        ("t.i32", MVal::I32(-5)),
        ("t.f32", MVal::F32(0.5)),
        ("t.bool", MVal::Bool(true)),
        ("t.arr", MVal::ArrI32(vec![1, 2, 3])),
        ("t.strs", MVal::ArrStr(vec!["a".into(), "b\nc".into()])),
    ]
}

/// A source tensor of the GGUF setup: name, dtype, bytes, shape.
pub(super) fn source_tensors() -> Vec<Tensor<'static>> {
    vec![
        ("a", 5, vec![1, 2, 3], &[3]),
        ("b", 1, big_bytes(), &[BIG / 2]),
        ("c/d", 6, (0..34).collect(), &[32]),
    ]
}

impl GState {
    pub(super) fn new(next: &mut u64) -> GState {
        let keys: Vec<MKey> = source_keys()
            .into_iter()
            .map(|(name, v)| MKey {
                name: name.into(),
                ty: v.ty(),
                shown: v.file_text(),
                value: Some(v),
                kid: fresh(next),
                from_file: true,
            })
            .collect();
        GState {
            committed: keys.clone(),
            keys,
            gone: HashMap::new(),
            view_order: None,
            ino_of: HashMap::new(),
            key_of: HashMap::new(),
            invalid_document: None,
        }
    }

    pub(super) fn position(&self, name: &str) -> Option<usize> {
        self.keys.iter().position(|k| k.name == name)
    }

    /// The type a key made under `name` takes: the committed file's under
    /// that name, else the one the name had when it was removed or moved away.
    pub(super) fn name_type(&self, name: &str) -> Option<KTy> {
        let committed = self.committed.iter().find(|k| k.name == name);
        committed
            .map(|k| k.ty)
            .or_else(|| self.gone.get(name).copied())
            // (ggml's own type for a key it reads.)
            .or((name == "general.alignment").then_some(KTy::U32))
    }

    /// A written value that is the committed one under the same name and
    /// type shows as the file's value again (an array only while the file
    /// can be read: not once `rewritten` in place).
    pub(super) fn settle(&mut self, rewritten: bool) {
        for k in &mut self.keys {
            if rewritten && matches!(k.ty, KTy::ArrI32 | KTy::ArrStr) {
                continue;
            }
            let same = self.committed.iter().find(|c| c.name == k.name);
            if let Some(c) =
                same.filter(|c| c.ty == k.ty && k.value.is_some() && c.value == k.value)
            {
                k.shown = c.shown.clone();
                k.from_file = true;
            }
        }
    }

    /// Whether the keys are the committed ones, in order.
    pub(super) fn unchanged(&self) -> bool {
        self.keys.len() == self.committed.len()
            && self.keys.iter().zip(&self.committed).all(|(k, c)| {
                k.from_file
                    && (&k.name, k.ty, &k.value, &k.shown) == (&c.name, c.ty, &c.value, &c.shown)
            })
    }

    /// Whether a key's value is an array the file holds: after the file is
    /// rewritten in place, reading it may fail (EIO), and a commit must.
    pub(super) fn reads_file_arrays(&self) -> bool {
        self.keys.iter().any(MKey::array_from_file)
    }

    /// A new epoch of key files (after a commit, discard or crash): each
    /// key's file is a new one.
    pub(super) fn renew(&mut self, next: &mut u64) {
        for k in &mut self.keys {
            k.kid = fresh(next);
        }
        self.ino_of.clear();
        self.key_of.clear();
    }

    /// Whether the alignment the keys set (ggml's default 32) is another
    /// than the committed file's.
    pub(super) fn alignment_changed(&self) -> bool {
        let of = |keys: &[MKey]| match keys.iter().find(|k| k.name == "general.alignment") {
            Some(MKey {
                value: Some(MVal::U32(a)),
                ..
            }) => *a,
            _ => 32,
        };
        of(&self.keys) != of(&self.committed)
    }

    /// What `stfs status` lists of the keys: changes, then problems (a
    /// problem's own words cut after the key's name).
    pub(super) fn status_lines(&self) -> (Vec<String>, Vec<String>) {
        let mut changes = Vec::new();
        let mut problems = Vec::new();
        for k in &self.keys {
            match self.committed.iter().find(|c| c.name == k.name) {
                Some(c)
                    if k.from_file && (c.ty, &c.value, &c.shown) == (k.ty, &k.value, &k.shown) => {}
                Some(c) if c.ty != k.ty => changes.push(format!(
                    "key        {}: set, its type changed from {} to {}",
                    k.name,
                    c.ty.name(),
                    k.ty.name()
                )),
                Some(_) => changes.push(format!("key        {}: set", k.name)),
                None => changes.push(format!("key        {}: added ({})", k.name, k.ty.name())),
            }
            if k.value.is_none() {
                problems.push(format!("problem    __kv__/{}:", k.name));
            }
            if k.name == "general.alignment"
                && !matches!(k.value, Some(MVal::U32(a)) if a.is_power_of_two())
            {
                problems.push(format!("problem    __kv__/{}:", k.name));
            }
        }
        for c in &self.committed {
            if self.position(&c.name).is_none() {
                changes.push(format!("key        {}: removed", c.name));
            }
        }
        if self.invalid_document.is_some() {
            problems.push("problem    __metadata__.json".to_string());
        }
        let in_both = |a: &[MKey], b: &[MKey]| -> Vec<String> {
            let names = a.iter().map(|k| k.name.clone());
            names.filter(|n| b.iter().any(|k| k.name == *n)).collect()
        };
        if in_both(&self.keys, &self.committed) != in_both(&self.committed, &self.keys) {
            changes.push("keys       in another order".into());
        }
        (changes, problems)
    }

    /// `__metadata__.json`: every key with its type and value, one per
    /// line; a value that is not one of its type says why (the words cut
    /// off here, as `metadata_cut` cuts what the mount shows).
    pub(super) fn metadata_text(&self) -> Vec<u8> {
        if let Some(text) = &self.invalid_document {
            return text.clone();
        }
        let mut out = b"{".to_vec();
        for (n, k) in self.keys.iter().enumerate() {
            out.extend_from_slice(if n == 0 { b"\n" } else { b",\n" });
            out.extend(serde_json::to_vec(&k.name).unwrap());
            out.extend_from_slice(b": ");
            let (ty, item) = k.ty.doc_names();
            let mut entry = serde_json::Map::new();
            entry.insert("type".into(), ty.into());
            match &k.value {
                Some(v) => {
                    if let Some(item) = item {
                        entry.insert("item_type".into(), item.into());
                    }
                    entry.insert("value".into(), v.json());
                }
                None => {
                    entry.insert("invalid".into(), "".into());
                }
            }
            out.extend(serde_json::to_vec(&entry).unwrap());
        }
        out.extend_from_slice(b"\n}\n");
        metadata_cut(&out)
    }
}

/// `__metadata__.json` with the words of each `"invalid"` reason left out.
pub(super) fn metadata_cut(text: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(text);
    let lines: Vec<String> = text
        .split('\n')
        .map(|l| match l.find("\"invalid\":") {
            Some(k) => l[..k + "\"invalid\":".len()].to_string(),
            None => l.to_string(),
        })
        .collect();
    lines.join("\n").into_bytes()
}

/// What a person writes into a key.
#[derive(Debug, Clone)]
pub(super) enum KvText {
    Int(i64),
    Float(f32),
    Bool(bool),
    Str(&'static str),
    Ints(Vec<i64>),
    Strs(Vec<&'static str>),
    Garbage,
}

impl KvText {
    pub(super) fn bytes(&self) -> Vec<u8> {
        match self {
            KvText::Int(i) => format!("{i}\n"),
            KvText::Float(f) => format!("{f}\n"),
            KvText::Bool(b) => format!("{b}\n"),
            KvText::Str(s) => s.to_string(),
            KvText::Ints(v) => format!("{}\n", serde_json::to_string(v).unwrap()),
            KvText::Strs(v) => serde_json::to_string(v).unwrap(),
            KvText::Garbage => "not a value\n".to_string(),
        }
        .into_bytes()
    }
}

pub(super) fn kv_text() -> impl Strategy<Value = KvText> {
    prop_oneof![
        3 => prop::sample::select(vec![0i64, 1, 7, 32, 64, 48, 255, 300, -5, 70000]).prop_map(KvText::Int),
        1 => prop::sample::select(vec![0.5f32, -2.25]).prop_map(KvText::Float),
        1 => any::<bool>().prop_map(KvText::Bool),
        2 => prop::sample::select(vec!["llama", "{% for m in messages %}\n{{ m }}\n{% endfor %}\n", "", "7"])
            .prop_map(KvText::Str),
        1 => prop::collection::vec(-3i64..3, 0..3).prop_map(KvText::Ints),
        1 => prop::collection::vec(prop::sample::select(vec!["x", "y z"]), 0..3).prop_map(KvText::Strs),
        1 => Just(KvText::Garbage),
    ]
}

/// An edit of `__metadata__.json`: the document of the keys as the model
/// has them, changed so.
#[derive(Debug, Clone)]
pub(super) enum DocEdit {
    /// Written back as shown.
    Same,
    Drop(usize),
    /// Key `n` (of the document's) given another value.
    SetValue(usize, serde_json::Value),
    /// Key `n` given another type, its value kept.
    Retype(usize, KTy),
    /// A key (of `KEYS`) added or replaced, last.
    Put(usize, KTy, serde_json::Value),
}

pub(super) fn json_value() -> impl Strategy<Value = serde_json::Value> {
    prop::sample::select(vec![
        serde_json::json!(7),
        serde_json::json!(300),
        serde_json::json!(-5),
        serde_json::json!(1),
        serde_json::json!(0.5),
        serde_json::json!(true),
        serde_json::json!("text\n"),
        serde_json::json!([1, 2]),
        serde_json::json!(["a"]),
        serde_json::json!(null),
    ])
}

pub(super) fn doc_edit() -> impl Strategy<Value = DocEdit> {
    let ty = prop::sample::select(KTy::ALL.to_vec());
    prop_oneof![
        1 => Just(DocEdit::Same),
        1 => (0..10usize).prop_map(DocEdit::Drop),
        2 => (0..10usize, json_value()).prop_map(|(n, v)| DocEdit::SetValue(n, v)),
        1 => (0..10usize, ty.clone()).prop_map(|(n, t)| DocEdit::Retype(n, t)),
        2 => (0..KEYS.len(), ty, json_value()).prop_map(|(k, t, v)| DocEdit::Put(k, t, v)),
    ]
}

impl GState {
    /// The document a `DocEdit` writes: (key, type, value or None for a
    /// key shown as invalid).
    pub(super) fn document(&self, edit: &DocEdit) -> Vec<(String, KTy, Option<serde_json::Value>)> {
        let mut doc: Vec<(String, KTy, Option<serde_json::Value>)> = self
            .keys
            .iter()
            .map(|k| (k.name.clone(), k.ty, k.value.as_ref().map(MVal::json)))
            .collect();
        let n = doc.len().max(1);
        match edit {
            DocEdit::Same => {}
            DocEdit::Drop(i) if !doc.is_empty() => {
                doc.remove(i % n);
            }
            DocEdit::SetValue(i, v) if !doc.is_empty() => doc[i % n].2 = Some(v.clone()),
            DocEdit::Retype(i, t) if !doc.is_empty() => doc[i % n].1 = *t,
            DocEdit::Put(k, t, v) => {
                doc.retain(|(name, ..)| name != KEYS[*k]);
                doc.push((KEYS[*k].into(), *t, Some(v.clone())));
            }
            _ => {}
        }
        doc
    }

    /// Applies a written document; false (nothing changed) when the mount
    /// must refuse it.
    pub(super) fn set_document(
        &mut self,
        doc: &[(String, KTy, Option<serde_json::Value>)],
        next: &mut u64,
        rewritten: bool,
    ) -> bool {
        let mut keys = Vec::new();
        for (name, ty, value) in doc {
            let Some(value) = value else { return false };
            // A value as shown stays as it is (an array the file holds, as
            // long as the file can be read).
            let readable = |k: &MKey| !(rewritten && k.array_from_file());
            let same = self.keys.iter().find(|k| k.name == *name && k.ty == *ty);
            if let Some(k) = same.filter(|k| readable(k)) {
                if k.value.as_ref().map(MVal::json).as_ref() == Some(value) {
                    keys.push(k.clone());
                    continue;
                }
            }
            use serde_json::Value as J;
            let text = match (ty, value) {
                (KTy::Str | KTy::F32, J::String(s)) => s.clone(),
                (KTy::ArrI32 | KTy::ArrStr, v) => v.to_string(),
                (_, J::Bool(b)) => b.to_string(),
                (_, J::Number(x)) => x.to_string(),
                _ => return false,
            };
            let Some(v) = parse_text(*ty, text.as_bytes()) else {
                return false;
            };
            let kid = match self.keys.iter().find(|k| k.name == *name) {
                Some(k) => k.kid,
                None => fresh(next),
            };
            keys.push(MKey {
                name: name.clone(),
                ty: *ty,
                shown: v.file_text(),
                value: Some(v),
                kid,
                from_file: false,
            });
        }
        for k in &self.keys {
            if !keys.iter().any(|n: &MKey| n.name == k.name) {
                self.gone.insert(k.name.clone(), k.ty);
            }
        }
        self.keys = keys;
        self.settle(rewritten);
        true
    }
}

/// The document's text as a person writes it: one object, keys in order.
pub(super) fn document_text(doc: &[(String, KTy, Option<serde_json::Value>)]) -> Vec<u8> {
    let mut out = b"{".to_vec();
    for (n, (name, ty, value)) in doc.iter().enumerate() {
        if n > 0 {
            out.push(b',');
        }
        let (t, item) = ty.doc_names();
        let mut entry = serde_json::Map::new();
        entry.insert("type".into(), t.into());
        if let Some(item) = item {
            entry.insert("item_type".into(), item.into());
        }
        match value {
            Some(v) => entry.insert("value".into(), v.clone()),
            None => entry.insert("invalid".into(), "shown as invalid".into()),
        };
        out.extend(serde_json::to_vec(name).unwrap());
        out.push(b':');
        out.extend(serde_json::to_vec(&entry).unwrap());
    }
    out.extend_from_slice(b"}\n");
    out
}

// ---- the model's own GGUF reader and writer ----

/// A GGUF file as the model reads it.
#[derive(Debug)]
pub(super) struct GgufFile {
    /// Key, type id, the value's bytes after its type id.
    pub(super) keys: Vec<(String, u32, Vec<u8>)>,
    /// Name, dims innermost first, ggml type id, offset in the data.
    pub(super) tensors: Vec<(String, Vec<u64>, u32, u64)>,
    pub(super) data_start: u64,
}

/// The model's ggml type id of a dtype of its table.
pub(super) fn ggml_id(dtype: usize) -> Option<u32> {
    DTYPES[dtype].3
}

pub(super) fn read_gguf(f: &[u8]) -> Result<GgufFile, String> {
    struct R<'a>(&'a [u8], usize);
    impl R<'_> {
        fn take(&mut self, n: usize) -> Result<&[u8], String> {
            let end = self.1.checked_add(n).filter(|&e| e <= self.0.len());
            let end = end.ok_or_else(|| format!("truncated at {}", self.1))?;
            let s = &self.0[self.1..end];
            self.1 = end;
            Ok(s)
        }
        fn u32(&mut self) -> Result<u32, String> {
            Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
        }
        fn u64(&mut self) -> Result<u64, String> {
            Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
        }
        fn string(&mut self) -> Result<Vec<u8>, String> {
            let n = self.u64()?;
            Ok(self.take(n as usize)?.to_vec())
        }
        /// A value of type `t`, as its bytes.
        fn value(&mut self, t: u32) -> Result<Vec<u8>, String> {
            let start = self.1;
            match t {
                0 | 1 | 7 => drop(self.take(1)?),
                2 | 3 => drop(self.take(2)?),
                4..=6 => drop(self.take(4)?),
                10..=12 => drop(self.take(8)?),
                8 => drop(self.string()?),
                9 => {
                    let item = self.u32()?;
                    if item == 9 {
                        return Err("a nested array".into());
                    }
                    for _ in 0..self.u64()? {
                        self.value(item)?;
                    }
                }
                t => return Err(format!("value type {t}")),
            }
            Ok(self.0[start..self.1].to_vec())
        }
    }
    let mut r = R(f, 0);
    if r.take(4)? != b"GGUF" {
        return Err("not GGUF".into());
    }
    if r.u32()? != 3 {
        return Err("not version 3".into());
    }
    let (n_tensors, n_kv) = (r.u64()?, r.u64()?);
    let mut keys = Vec::new();
    for _ in 0..n_kv {
        let key = String::from_utf8(r.string()?).map_err(|_| "a key not UTF-8")?;
        let t = r.u32()?;
        keys.push((key, t, r.value(t)?));
    }
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = String::from_utf8(r.string()?).map_err(|_| "a name not UTF-8")?;
        let dims = r.u32()?;
        let ne = (0..dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
        let (t, offset) = (r.u32()?, r.u64()?);
        tensors.push((name, ne, t, offset));
    }
    let alignment = match keys.iter().find(|k| k.0 == "general.alignment") {
        Some((_, 4, v)) => u32::from_le_bytes(v[..4].try_into().unwrap()) as u64,
        _ => 32,
    };
    let data_start = (r.1 as u64).div_ceil(alignment) * alignment;
    Ok(GgufFile {
        keys,
        tensors,
        data_start,
    })
}

/// What gguf-py's `GGUFWriter` writes for these keys and tensors (name,
/// dtype, shape, bytes), in this order: no room, every tensor padded to
/// the alignment (the last too).
pub(super) fn write_gguf(
    keys: &[(String, MVal)],
    tensors: &[(String, usize, Vec<u64>, Vec<u8>)],
) -> Vec<u8> {
    let alignment = match keys.iter().find(|k| k.0 == "general.alignment") {
        Some((_, MVal::U32(a))) => *a as u64,
        _ => 32,
    };
    let pad = |out: &mut Vec<u8>| {
        let len = (out.len() as u64).div_ceil(alignment) * alignment;
        out.resize(len as usize, 0);
    };
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((keys.len() as u64).to_le_bytes());
    for (key, v) in keys {
        out.extend((key.len() as u64).to_le_bytes());
        out.extend(key.as_bytes());
        out.extend(v.ty().ids().0.to_le_bytes());
        out.extend(v.payload());
    }
    let mut offset = 0u64;
    for (name, dtype, shape, bytes) in tensors {
        out.extend((name.len() as u64).to_le_bytes());
        out.extend(name.as_bytes());
        out.extend((shape.len() as u32).to_le_bytes());
        shape.iter().rev().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(ggml_id(*dtype).unwrap().to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset = (offset + bytes.len() as u64).div_ceil(alignment) * alignment;
    }
    pad(&mut out);
    for (.., bytes) in tensors {
        out.extend(bytes);
        pad(&mut out);
    }
    out
}

/// Where tensor `name` lies in a GGUF file: (begin, end, absolute offset).
pub(super) fn gguf_offsets_in(file: &[u8], name: &str) -> (u64, u64, u64) {
    let g = read_gguf(file).unwrap();
    let (_, ne, t, offset) = g.tensors.iter().find(|t| t.0 == name).unwrap();
    let dtype = DTYPES.iter().position(|d| d.3 == Some(*t)).unwrap();
    let shape: Vec<u64> = ne.iter().rev().copied().collect();
    let len = byte_len(dtype, &shape);
    (*offset, offset + len, g.data_start + offset)
}

impl Model {
    /// Writes the GGUF setup's source: its keys and tensors.
    pub(super) fn write_gguf_source(path: &Path, tensors: &[Tensor]) -> Vec<u8> {
        let keys: Vec<(String, MVal)> = source_keys()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let tensors: Vec<_> = tensors
            .iter()
            .map(|(n, d, b, s)| (n.to_string(), *d, s.to_vec(), b.clone()))
            .collect();
        let bytes = write_gguf(&keys, &tensors);
        std::fs::write(path, &bytes).unwrap();
        bytes
    }

    /// A GGUF file (committed, or the export view) holds exactly the
    /// model's state of `dir`: its keys in order (and stfs's room key last
    /// unless `compact`), and its tensors (names, types, dims, bytes); with
    /// `compact`, byte for byte what `GGUFWriter` writes for them in the
    /// file's tensor order.
    /// Returns the file's tensor names in order.
    pub(super) fn assert_same_gguf(
        &self,
        got: &[u8],
        dir: usize,
        compact: bool,
        what: &str,
    ) -> Vec<String> {
        let g = self.gguf.as_ref().unwrap();
        let file = read_gguf(got).unwrap_or_else(|e| panic!("{what}: not a GGUF file: {e}"));
        let mut keys = file.keys.clone();
        if !compact && keys.last().is_some_and(|k| k.0 == "stfs.room") {
            let room = keys.pop().unwrap();
            assert_eq!(room.1, 9, "{what}: the room key is an array");
        }
        let want: Vec<(String, u32, Vec<u8>)> = g
            .keys
            .iter()
            .map(|k| {
                let v = k.value.as_ref().expect("a committed key is valid");
                (k.name.clone(), k.ty.ids().0, v.payload())
            })
            .collect();
        assert_eq!(keys, want, "{what}: keys");
        let mut tensors = BTreeMap::new();
        let mut order = Vec::new();
        for (name, ne, t, offset) in &file.tensors {
            let dtype = DTYPES
                .iter()
                .position(|d| d.3 == Some(*t))
                .unwrap_or_else(|| panic!("{what}: tensor {name}: ggml type {t}"));
            let shape: Vec<u64> = ne.iter().rev().copied().collect();
            let at = (file.data_start + offset) as usize;
            let bytes = got[at..at + byte_len(dtype, &shape) as usize].to_vec();
            order.push(name.clone());
            tensors.insert(name.clone(), (dtype, shape, bytes));
        }
        let d = &self.dirs[dir];
        let mut want = BTreeMap::new();
        for (name, e) in &d.entries {
            if let (MMeta::Valid(dt, s), Some(o), false) = (&e.meta, e.data, e.hidden) {
                want.insert(
                    name.clone(),
                    (*dt, s.clone(), self.objects[&o].bytes.clone()),
                );
            }
        }
        assert_eq!(tensors, want, "{what}: tensors");
        if compact {
            let keys: Vec<(String, MVal)> = g
                .keys
                .iter()
                .map(|k| (k.name.clone(), k.value.clone().unwrap()))
                .collect();
            let tensors: Vec<_> = order
                .iter()
                .map(|n| {
                    let (d, s, b) = want.remove(n).unwrap();
                    (n.clone(), d, s, b)
                })
                .collect();
            assert!(
                got == write_gguf(&keys, &tensors),
                "{what}: not what GGUFWriter writes for the model's state"
            );
        }
        order
    }
}
