//! `__kv__/` of a GGUF file (a view folder whose paths are `kv/KEY`, or
//! `kv/SHARD/KEY` for each part of a split GGUF file, reached only from each
//! checkpoint's folder, not listed in `__views__`): one file per key of the
//! file's key-value section, in file order, its value as a person reads it
//! (`gguf::kv_file_text`): a chat template is a text file, a token id its
//! digits. File names are the keys, escaped as tensor names are
//! (docs/SEMANTICS.md, "Names"). Read-only for now: GGUF mounts are.

use super::{Draws, Entry, Formats, Found, ViewError, ViewFolder, checkpoint_of, numbered};
use crate::checkpoint::view::GeneratedFile;
use crate::format::gguf::{self, GgufHeader, Value};
use crate::fs::State;
use crate::fs::names::tensor_file_name;

pub struct Kv;

/// The first part of its paths (a GGUF checkpoint's folder shows the
/// folder as `__kv__`).
const KV_PATH: &str = "kv";

/// The path below `__views__` of checkpoint `c`'s keys.
pub fn kv_path(st: &State, c: usize) -> String {
    match st.folder {
        None => KV_PATH.to_string(),
        Some(_) => format!("{KV_PATH}/{}", st.checkpoints[c].shown_name()),
    }
}

fn header(st: &State, c: usize) -> Option<&GgufHeader> {
    st.live(c).source().header().gguf.as_deref()
}

/// The key and value of file `name`.
fn entry<'a>(h: &'a GgufHeader, name: &str) -> Option<&'a (String, Value)> {
    h.kvs.iter().find(|(key, _)| tensor_file_name(key) == name)
}

/// The checkpoint and key of file `path`.
fn file_of<'a>(st: &'a State, path: &[&str]) -> Option<(usize, &'a (String, Value))> {
    let (name, folder) = path.split_last()?;
    let c = checkpoint_of(st, folder).flatten()?;
    Some((c, entry(header(st, c)?, name)?))
}

impl ViewFolder for Kv {
    fn formats(&self) -> Formats {
        Formats::Gguf
    }

    fn in_views(&self) -> bool {
        false
    }

    fn top(&self, _: &State) -> Vec<String> {
        vec![KV_PATH.to_string()]
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        if let Some(c) = checkpoint_of(st, path) {
            return Some(Found::Folder(c.map_or(Draws::All, Draws::Checkpoint)));
        }
        file_of(st, path).map(|(c, _)| Found::File(Draws::Checkpoint(c)))
    }

    fn list(&self, st: &State, path: &[&str], _from: u64) -> Vec<Entry> {
        match checkpoint_of(st, path) {
            Some(None) => numbered(st.checkpoints.iter().map(|m| (m.shown_name(), true))),
            Some(Some(c)) => header(st, c).map_or_else(Vec::new, |h| {
                numbered(h.kvs.iter().map(|(k, _)| (tensor_file_name(k), false)))
            }),
            None => Vec::new(),
        }
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let (c, (_, value)) = file_of(st, path).ok_or(ViewError::NotAView)?;
        let source = st.live(c).source();
        let read = |at, len| source.read_range(at, len);
        let text = gguf::kv_file_text(value, &read)
            .map_err(|e| ViewError::Invalid(format!("{}: {e}", source.path().display())))?;
        Ok(GeneratedFile::text(text))
    }
}
