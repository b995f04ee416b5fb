//! `__kv__/` of a GGUF mount (also reached as `__views__/kv/`): one file per
//! key of the file's key-value section, in file order, its value as a
//! person reads it (`gguf::kv_file_text`): a chat template is a text file, a
//! token id its digits. File names are the keys, escaped as tensor names
//! are (docs/SEMANTICS.md, "Names"). Read-only for now: GGUF mounts are.

use super::{Draws, Entry, Formats, Found, ViewError, ViewFolder, numbered};
use crate::checkpoint::view::GeneratedFile;
use crate::format::gguf::{self, GgufHeader, Value};
use crate::fs::State;
use crate::fs::names::tensor_file_name;

pub struct Kv;

/// Its name in `__views__`; a GGUF checkpoint's folder shows it as `__kv__`.
pub const KV_DIR: &str = "kv";

fn header(st: &State) -> Option<&GgufHeader> {
    st.folder.is_none().then_some(())?;
    st.live(0).source().header().gguf.as_deref()
}

/// The key and value of file `name`.
fn entry<'a>(h: &'a GgufHeader, name: &str) -> Option<&'a (String, Value)> {
    h.kvs.iter().find(|(key, _)| tensor_file_name(key) == name)
}

impl ViewFolder for Kv {
    fn formats(&self) -> Formats {
        Formats::Gguf
    }

    fn top(&self, st: &State) -> Vec<String> {
        header(st).map(|_| KV_DIR.to_string()).into_iter().collect()
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        let h = header(st)?;
        match path {
            [_] => Some(Found::Folder(Draws::Checkpoint(0))),
            [_, name] => entry(h, name).map(|_| Found::File(Draws::Checkpoint(0))),
            _ => None,
        }
    }

    fn list(&self, st: &State, path: &[&str], _from: u64) -> Vec<Entry> {
        match (header(st), path) {
            (Some(h), [_]) => numbered(h.kvs.iter().map(|(k, _)| (tensor_file_name(k), false))),
            _ => Vec::new(),
        }
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let [_, name] = path else {
            return Err(ViewError::NotAView);
        };
        let h = header(st).ok_or(ViewError::NotAView)?;
        let (_, value) = entry(h, name).ok_or(ViewError::NotAView)?;
        let source = st.live(0).source();
        let read = |at, len| source.read_range(at, len);
        let text = gguf::kv_file_text(value, &read)
            .map_err(|e| ViewError::Invalid(format!("{}: {e}", source.path().display())))?;
        Ok(GeneratedFile::text(text))
    }
}
