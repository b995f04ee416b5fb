//! `__views__/npy/`: each tensor as a `.npy` file, so `np.load` works (one
//! folder per shard on a folder mount). A tensor is listed while it has
//! bytes and a valid meta that agree.

use super::{Draws, Entry, Formats, Found, ViewError, ViewFolder, checkpoint_of, numbered};
use crate::checkpoint::Id;
use crate::checkpoint::view::{GeneratedFile, ViewTensor};
use crate::fs::files::TensorFile;
use crate::fs::{Name, State};

pub struct Npy;

const NPY_DIR: &str = "npy";
const SUFFIX: &str = ".npy";

/// Entry `id` of checkpoint `c` as a `.npy` view's tensor: if it has
/// bytes, a valid meta, and as many bytes as its meta says, and is not of
/// ggml's quantized block types (which numpy has no dtype for).
fn tensor(st: &State, c: usize, id: Id) -> Option<ViewTensor> {
    let t = st.live(c).view_tensor(id)?;
    let want = crate::format::byte_len(t.dtype, &t.shape).ok()?;
    (t.bytes.len() == want && !t.dtype.is_quantized_block()).then_some(t)
}

/// The tensor of file `name` in checkpoint `c`'s folder.
fn file_named(st: &State, c: usize, name: &str) -> Option<(Id, ViewTensor)> {
    let stem = name.strip_suffix(SUFFIX)?;
    let Ok(Name::Tensor(TensorFile::Data, tensor_name)) = st.decode(c, stem) else {
        return None;
    };
    let id = st.live(c).find(&tensor_name)?;
    tensor(st, c, id).map(|t| (id, t))
}

impl ViewFolder for Npy {
    fn formats(&self) -> Formats {
        Formats::Both
    }

    fn top(&self, _: &State) -> Vec<String> {
        vec![NPY_DIR.to_string()]
    }

    /// By depth, never by a name's suffix (a shard may be named `x.npy`):
    /// a file mount's files are `npy/FILE`; a folder mount's, `npy/SHARD/FILE`.
    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        if let Some(c) = checkpoint_of(st, path) {
            return Some(Found::Folder(match (c, path.len()) {
                (Some(c), 2) => Draws::Checkpoint(c),
                _ => Draws::All,
            }));
        }
        let (name, folder) = path.split_last()?;
        let c = checkpoint_of(st, folder).flatten()?;
        file_named(st, c, name).map(|_| Found::File(Draws::Checkpoint(c)))
    }

    fn list(&self, st: &State, path: &[&str], from: u64) -> Vec<Entry> {
        match checkpoint_of(st, path) {
            Some(None) => numbered(st.checkpoints.iter().map(|m| (m.shown_name(), true))),
            // Tensor `id` lists at offset 3 + id, in id order like its data
            // file, so that a listing resumes correctly across edits.
            Some(Some(c)) => st
                .live(c)
                .entries_from(from.saturating_sub(3))
                .filter(|(id, _)| tensor(st, c, *id).is_some())
                .map(|(id, e)| Entry {
                    name: TensorFile::Data.file_name(e.name) + SUFFIX,
                    folder: false,
                    offset: 3 + id + 1,
                })
                .collect(),
            None => Vec::new(),
        }
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let (name, folder) = path.split_last().ok_or(ViewError::NotAView)?;
        let c = checkpoint_of(st, folder)
            .flatten()
            .ok_or(ViewError::NotAView)?;
        let (_, t) = file_named(st, c, name).ok_or(ViewError::NotAView)?;
        Ok(GeneratedFile::npy(t))
    }

    fn cached(&self) -> bool {
        false
    }
}
