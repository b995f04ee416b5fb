//! `__views__/reshard/SIZE/`: the checkpoint split as
//! `save_pretrained(max_shard_size=SIZE)` splits it (huggingface_hub's
//! `split_state_dict_into_shards_factory`): the tensors in the order
//! `load_file` gives them from the export view (`model.safetensors`, or
//! `merged.safetensors` of a folder mount: largest dtype first, then by
//! name, as `save_file` lays a file out), each added to the
//! current shard unless that would pass SIZE (then a new shard begins); a
//! tensor larger than SIZE alone in a shard of its own, placed when it is
//! met. The shards are `model-0000k-of-0000n.safetensors` with
//! `model.safetensors.index.json` (one shard: `model.safetensors`, no
//! index). Each shard carries the checkpoint's metadata. A folder mount's
//! shards are merged first, then split again.
//!
//! SIZE is written as Hugging Face writes it: a number and a unit, `KB`,
//! `MB`, `GB`, `TB` (powers of 1000: `5GB` is 5·10⁹ bytes; `0.5GB` too), or
//! `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024: `2GiB` is 2·2³⁰), or bytes
//! alone. Any such name works; the listing shows `5GB`, the default of
//! `save_pretrained`.

use super::export::tensors_of;
use super::{Draws, Entry, Found, ViewError, ViewFolder, model, numbered};
use crate::checkpoint::view::{GeneratedFile, ViewTensor};
use crate::fs::State;
use std::sync::Arc;

pub struct Reshard;

const DIR: &str = "reshard";
const LISTED: &str = "5GB";
const INDEX: &str = "model.safetensors.index.json";

/// Bytes of a SIZE folder name; None if it is not one.
pub fn parse_size(name: &str) -> Option<u64> {
    let upper = name.trim().to_ascii_uppercase();
    let units: [(&str, f64); 8] = [
        ("KIB", 1024.0),
        ("MIB", 1024f64.powi(2)),
        ("GIB", 1024f64.powi(3)),
        ("TIB", 1024f64.powi(4)),
        ("KB", 1e3),
        ("MB", 1e6),
        ("GB", 1e9),
        ("TB", 1e12),
    ];
    let (number, multiplier) = units
        .iter()
        .find_map(|(u, m)| upper.strip_suffix(u).map(|n| (n.trim(), *m)))
        .unwrap_or((upper.as_str(), 1.0));
    let value = python_float(number)?;
    let bytes = value * multiplier;
    (bytes.is_finite() && bytes < u64::MAX as f64).then_some(bytes as u64)
}

/// A number as Python's `float()` reads one (what Hugging Face parses a
/// size with): an optional `+`, digits with single `_` between them, a
/// point, an exponent with its sign. No infinity, no NaN, and (a size) no
/// minus sign.
fn python_float(s: &str) -> Option<f64> {
    let s = s.strip_prefix('+').unwrap_or(s);
    let b = s.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        let after_exponent = i > 0 && matches!(b[i - 1], b'E' | b'e');
        let between_digits =
            i > 0 && i + 1 < b.len() && b[i - 1].is_ascii_digit() && b[i + 1].is_ascii_digit();
        match c {
            b'0'..=b'9' | b'.' | b'E' | b'e' => {}
            b'+' | b'-' if after_exponent => {}
            b'_' if between_digits => {}
            _ => return None,
        }
    }
    s.replace('_', "").parse().ok()
}

/// A split: each shard's file name and tensors, in order; the index's text
/// (None without one); the metadata each shard carries.
struct Split {
    shards: Vec<(String, Vec<ViewTensor>)>,
    index: Option<Vec<u8>>,
    metadata: Option<crate::format::Metadata>,
}

/// The split at `max` of the state now, made once per state (every lookup,
/// `stat` and read of the folder's files asks for it).
fn split(st: &State, max: u64) -> Arc<Result<Split, ViewError>> {
    let version = super::version(st, Draws::All);
    st.view_memo
        .get(&format!("reshard/{max}"), version, || make_split(st, max))
}

fn make_split(st: &State, max: u64) -> Result<Split, ViewError> {
    let (tensors, metadata) = tensors_of(st, if st.folder.is_some() { None } else { Some(0) })?;
    // In file order of the export view (`model.safetensors`, or
    // `merged.safetensors`): the order `load_file` gives of it.
    let order = crate::format::layout_of(
        tensors.len(),
        |i| {
            (
                tensors[i].name.as_str(),
                tensors[i].dtype,
                tensors[i].shape.as_slice(),
            )
        },
        metadata.as_ref(),
    )
    .map_err(|e| e.to_string())?
    .source_index;
    let mut slots: Vec<Option<ViewTensor>> = tensors.into_iter().map(Some).collect();
    let tensors = order.iter().map(|&k| slots[k].take().expect("each once"));
    let mut shards: Vec<Vec<ViewTensor>> = Vec::new();
    let mut current: Vec<ViewTensor> = Vec::new();
    let (mut current_size, mut total) = (0u64, 0u64);
    for t in tensors {
        let size = t.bytes.len();
        total += size;
        if size > max {
            shards.push(vec![t]);
            continue;
        }
        if current_size + size > max {
            shards.push(std::mem::take(&mut current));
            current_size = 0;
        }
        current_size += size;
        current.push(t);
    }
    if !current.is_empty() {
        shards.push(current);
    }
    // One shard: `model.safetensors`, no index; no tensors: nothing (as
    // save_pretrained: a split of fewer than two files has no index).
    if shards.len() <= 1 {
        let shards = shards
            .pop()
            .map(|only| vec![("model.safetensors".to_string(), only)])
            .unwrap_or_default();
        return Ok(Split {
            shards,
            index: None,
            metadata,
        });
    }
    let n = shards.len();
    let named: Vec<(String, Vec<ViewTensor>)> = shards
        .into_iter()
        .enumerate()
        .map(|(k, s)| (format!("model-{:05}-of-{n:05}.safetensors", k + 1), s))
        .collect();
    let mut weight_map = serde_json::Map::new();
    for (file, tensors) in &named {
        for t in tensors {
            weight_map.insert(t.name.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_size": total},
        "weight_map": weight_map,
    });
    // As transformers writes it: json.dumps(index, indent=2, sort_keys=True) + "\n".
    let mut text = ascii_json(&serde_json::to_string_pretty(&index).expect("serializes"));
    text.push('\n');
    Ok(Split {
        shards: named,
        index: Some(text.into_bytes()),
        metadata,
    })
}

/// Python's `ensure_ascii`: every character past ASCII as `\uXXXX` (a
/// surrogate pair past the first plane).
fn ascii_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for u in c.encode_utf16(&mut units) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// The file names of split `max` now, in listing order.
fn files(st: &State, max: u64) -> Vec<String> {
    let split = split(st, max);
    let Ok(split) = &*split else {
        return Vec::new();
    };
    let mut names: Vec<String> = split.shards.iter().map(|(n, _)| n.clone()).collect();
    if split.index.is_some() {
        names.push(INDEX.to_string());
    }
    // (The split's own index, not the mount's: only the other files.)
    names.extend(
        model::companions(st, false, false)
            .into_iter()
            .map(|(n, _)| n),
    );
    names
}

impl ViewFolder for Reshard {
    fn top(&self, _: &State) -> Vec<String> {
        vec![DIR.to_string()]
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        match path {
            [_] => Some(Found::Folder(Draws::All)),
            [_, size] => parse_size(size).map(|_| Found::Folder(Draws::All)),
            [_, size, name] => {
                let split = split(st, parse_size(size)?);
                let split = split.as_ref().as_ref().ok()?;
                let is_index = *name == INDEX && split.index.is_some();
                if is_index || split.shards.iter().any(|(n, _)| n == name) {
                    return Some(Found::File(Draws::All));
                }
                model::named(st, name, false, false).map(model::found)
            }
            _ => None,
        }
    }

    fn list(&self, st: &State, path: &[&str], _: u64) -> Vec<Entry> {
        match path {
            [_] => numbered([(LISTED.to_string(), true)]),
            [_, size] => match parse_size(size) {
                Some(max) => numbered(files(st, max).into_iter().map(|n| (n, false))),
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    fn refuses(&self, st: &State, path: &[&str]) -> Option<String> {
        let [_, size] = path else { return None };
        split(st, parse_size(size)?)
            .as_ref()
            .as_ref()
            .err()
            .map(ViewError::to_string)
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let [_, size, name] = path else {
            return Err(ViewError::NotAView);
        };
        let max = parse_size(size).ok_or(ViewError::NotAView)?;
        let split = split(st, max);
        let split = split.as_ref().as_ref().map_err(Clone::clone)?;
        if *name == INDEX {
            let index = split.index.clone().ok_or(ViewError::NotAView)?;
            return Ok(GeneratedFile::text(index));
        }
        let Some((_, tensors)) = split.shards.iter().find(|(n, _)| n == name) else {
            let c = model::named(st, name, false, false).ok_or(ViewError::NotAView)?;
            return model::make(st, c, None);
        };
        GeneratedFile::safetensors(tensors.clone(), split.metadata.as_ref(), None)
            .map_err(|e| ViewError::Invalid(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_as_hugging_face_writes_them() {
        assert_eq!(parse_size("5GB"), Some(5_000_000_000));
        assert_eq!(parse_size("5gb"), Some(5_000_000_000));
        assert_eq!(parse_size("0.5GB"), Some(500_000_000));
        assert_eq!(parse_size("2GiB"), Some(2 << 30));
        assert_eq!(parse_size("100KB"), Some(100_000));
        assert_eq!(parse_size("3MiB"), Some(3 << 20));
        assert_eq!(parse_size("1000"), Some(1000));
        // As Python's float() reads the number.
        assert_eq!(parse_size("1e+3KB"), Some(1_000_000));
        assert_eq!(parse_size("1.2e-3KB"), Some(1));
        assert_eq!(parse_size("+1KB"), Some(1000));
        assert_eq!(parse_size("1_000KB"), Some(1_000_000));
        assert_eq!(parse_size(" 5 GB"), Some(5_000_000_000));
        for bad in [
            "", "GB", "-1GB", "inf", "nanGB", "5 G B", "5XB", "1e400GB", "1__0KB", "_1KB",
            "1e+-3KB",
        ] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }
}
