//! The keys in the journal and around a commit: the table as records, taken
//! back by the next mount, its generation and changes, and what a commit
//! leaves of it.

use super::*;

impl Live {
    /// The table as the journal keeps it (None: no table).
    pub(in crate::checkpoint) fn kv_records(&self) -> Vec<KeyRecord> {
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
    pub(in crate::checkpoint) fn kv_replay(&mut self, keys: Vec<KeyRecord>) -> Vec<String> {
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

    /// The keys' generation (a commit's plan notes it).
    pub(in crate::checkpoint) fn kv_generation(&self) -> u64 {
        self.kv().map_or(0, |t| t.generation)
    }

    /// What changed in the keys, for `stfs status`.
    pub(in crate::checkpoint) fn kv_changes(&self) -> Vec<String> {
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
    pub(in crate::checkpoint) fn kv_ids(&self) -> Vec<u64> {
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
    pub(in crate::checkpoint) fn kv_after_commit(&mut self, planned: u64, written: &[u64]) {
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
