//! The GGUF file of a GGUF mount as a file of `__views__`: `model.gguf` (or
//! `PART.gguf` for each part of a split file), byte for byte what the file
//! holds now: its keys and tensor infos, then each tensor at its offset,
//! padded to the alignment with zeros: while nothing is edited, the source
//! file itself (served by kernel passthrough where allowed); once edited,
//! the edited state as `--compact` writes it.

use super::{Draws, Entry, Formats, Found, ViewError, ViewFolder};
use crate::checkpoint::view::{GeneratedFile, ViewTensor};
use crate::fs::State;
use crate::source::Bytes;

pub struct GgufFile;

/// A view's file name: `model.gguf` of a file mount, each part's own name
/// of a folder mount.
fn name_of(st: &State, c: usize) -> String {
    match st.folder {
        None => "model.gguf".into(),
        Some(_) => format!("{}.gguf", st.checkpoints[c].dir_name),
    }
}

fn checkpoint_named(st: &State, name: &str) -> Option<usize> {
    (0..st.checkpoints.len()).find(|&c| name_of(st, c) == name)
}

impl ViewFolder for GgufFile {
    fn formats(&self) -> Formats {
        Formats::Gguf
    }

    fn top(&self, st: &State) -> Vec<String> {
        (0..st.checkpoints.len()).map(|c| name_of(st, c)).collect()
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        let [name] = path else { return None };
        checkpoint_named(st, name).map(|c| Found::File(Draws::Checkpoint(c)))
    }

    /// (Only files: nothing to list.)
    fn list(&self, _: &State, _: &[&str], _: u64) -> Vec<Entry> {
        Vec::new()
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let [name] = path else {
            return Err(ViewError::NotAView);
        };
        let c = checkpoint_named(st, name).ok_or(ViewError::NotAView)?;
        if st.live(c).is_dirty() {
            return st
                .live(c)
                .gguf_file()
                .map_err(|p| ViewError::Invalid(p.to_string()));
        }
        let source = st.live(c).source();
        let h = source.header();
        let g = h.gguf.as_ref().ok_or(ViewError::NotAView)?;
        // (A file of no tensors may end before its data start: its padding
        // is zeros, as a writer writes it.)
        let stored = g.data_start.min(source.stat().len);
        let mut head = source
            .read_range(0, stored)
            .map_err(|e| ViewError::Invalid(format!("{}: {e}", source.path().display())))?;
        head.resize(g.data_start as usize, 0);
        let tensors = (0..h.tensors.len())
            .map(|i| {
                let t = h.tensors.get(i);
                let tensor = ViewTensor {
                    name: t.name.to_string(),
                    dtype: t.dtype,
                    shape: t.shape.to_vec(),
                    bytes: Bytes::Source(source.clone(), i as u32),
                };
                (g.data_start + t.data_offsets.0, tensor)
            })
            .collect();
        // Each tensor padded to the alignment, the last one too, as ggml
        // and gguf-py write them.
        let len = g.data_start.saturating_add(g.data_len);
        Ok(GeneratedFile::placed(head, tensors, len))
    }
}
