//! What `stfs status` says of a live checkpoint, and the problems that
//! make a commit refuse it.

use super::*;

impl Live {
    // ---- status ----

    /// Staged changes, and every problem a commit would refuse.
    pub fn status(&self) -> Status {
        let mut changes = Vec::new();
        let header = self.source.header();
        let mut renamed_from = std::collections::HashSet::new();
        for (id, e) in self.entries_from(0) {
            if e.data.is_none() && !e.meta.exists() {
                continue; // only a hidden meta: no part of the checkpoint
            }
            let origin = match &self.entries[id as usize] {
                EntrySlot::Source(i) => Some(*i),
                EntrySlot::Live(l) => l.origin,
                EntrySlot::Gone => None,
            };
            // Where its bytes came from, if a source tensor.
            let bytes_from = e.data.and_then(|d| match self.object(d)?.bytes {
                Bytes::Source(src, i) if Arc::ptr_eq(&src, &self.source) => Some(i),
                _ => None,
            });
            let shape_of = |m: &MetaView| match *m {
                MetaView::Valid(d, s) => format!("{d} {}", crate::format::ShapeDisplay(s)),
                _ => "no dtype".into(),
            };
            match (origin, bytes_from) {
                (_, Some(i)) if source_name(&self.source, i) != e.name => {
                    renamed_from.insert(i);
                    changes.push(format!(
                        "renamed    {} -> {}",
                        printable(source_name(&self.source, i)),
                        printable(e.name)
                    ));
                }
                (None, _) if e.data.is_some() => {
                    changes.push(format!(
                        "added      {} ({})",
                        printable(e.name),
                        shape_of(&e.meta)
                    ));
                    continue;
                }
                (None, _) => {
                    changes.push(format!(
                        "meta       {}.meta.json without a data file",
                        printable(e.name)
                    ));
                    continue;
                }
                _ => {}
            }
            let Some(i) = origin.or(bytes_from) else {
                continue;
            };
            let t = header.tensors.get(i as usize);
            let source_meta = MetaView::Valid(t.dtype, t.shape);
            if e.meta != source_meta {
                changes.push(format!(
                    "reshaped   {}: {} -> {}",
                    printable(e.name),
                    shape_of(&source_meta),
                    shape_of(&e.meta)
                ));
            }
            match e.data {
                None => changes.push(format!(
                    "removed    {} (its .meta.json stays until the commit)",
                    printable(e.name)
                )),
                Some(_) if bytes_from.is_none() => {
                    changes.push(format!("rewritten  {}", printable(e.name)))
                }
                Some(_) => {}
            }
        }
        for (i, &id) in self.source_ids.iter().enumerate() {
            let i = i as u32;
            let still_there = self.entry(id).is_some_and(|e| {
                e.name == source_name(&self.source, i) && (e.data.is_some() || e.meta.exists())
            });
            if !still_there && !renamed_from.contains(&i) {
                changes.push(format!(
                    "removed    {}",
                    printable(source_name(&self.source, i))
                ));
            }
        }
        match &self.metadata {
            MetadataDoc::Unchanged => {}
            MetadataDoc::Removed => changes.push("metadata   removed".into()),
            MetadataDoc::Set(m) => {
                let pairs: Vec<String> = m
                    .iter()
                    .flatten()
                    .map(|(k, v)| format!("{k:?}: {}", shown_value(v)))
                    .collect();
                changes.push(format!("metadata   {{{}}}", pairs.join(", ")))
            }
            MetadataDoc::Invalid { .. } => {}
        }
        changes.extend(self.kv_changes());
        Status {
            file: self.source.path().to_path_buf(),
            changes,
            problems: self.problems(),
        }
    }

    /// Everything a commit would refuse.
    pub fn problems(&self) -> Vec<Problem> {
        let mut problems = Vec::new();
        for (_, e) in self.entries_from(0) {
            if e.name == RESERVED && e.data.is_some() {
                problems.push(Problem {
                    tensor: Some(e.name.to_string()),
                    rule: "cannot be a tensor's name: the header keeps it for the metadata (rename it)"
                        .into(),
                });
                continue;
            }
            let rule = match (e.data, e.meta) {
                (Some(_), MetaView::None) => {
                    Some("has no dtype and shape: write its .meta.json, or remove the file".into())
                }
                (_, MetaView::Invalid(_, why)) => Some(format!("has an invalid .meta.json: {why}")),
                (Some(_), MetaView::Valid(dtype, _))
                    if dtype.is_quantized_block() && !self.source.header().is_gguf() =>
                {
                    Some(format!(
                        "{dtype} is a ggml block type: a safetensors file cannot hold it"
                    ))
                }
                (Some(d), MetaView::Valid(dtype, shape)) => {
                    let len = self.object_len(d).unwrap_or(0);
                    match crate::format::byte_len(dtype, shape) {
                        Ok(need) if need == len => None,
                        Ok(need) => Some(format!(
                            "holds {len} bytes but {dtype} {} needs {need}",
                            crate::format::ShapeDisplay(shape)
                        )),
                        Err(err) => Some(meta::size_message("", dtype, shape, err)),
                    }
                }
                (None, _) => None,
            };
            if let Some(rule) = rule {
                problems.push(Problem {
                    tensor: Some(e.name.to_string()),
                    rule,
                });
            }
        }
        if let MetadataDoc::Invalid { error, .. } = &self.metadata {
            problems.push(Problem {
                tensor: None,
                rule: format!("__metadata__.json {error}"),
            });
        }
        problems.extend(self.kv_problems());
        problems
    }
}

/// A metadata value as `stfs status` shows it: quoted, and cut after 60
/// characters (a chat template is kilobytes), saying how long it is.
fn shown_value(v: &str) -> String {
    const SHOWN: usize = 60;
    match v.char_indices().nth(SHOWN) {
        None => format!("{v:?}"),
        Some((cut, _)) => format!("{:?}... ({} bytes)", &v[..cut], v.len()),
    }
}
