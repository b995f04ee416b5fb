//! What makes a view folder a model folder: beside its safetensors files,
//! the mount's index files (cast folders: as the cast's shards hold them)
//! and the folder's other files (`config.json` naming the cast's dtype in
//! a cast folder), so that `from_pretrained(view)` and `cp -r view out/`
//! give a whole model. The export (`__views__/` itself), each cast folder and
//! each reshard folder show them; a file mount has none.

use super::{Draws, Found, ViewError};
use crate::checkpoint::view::GeneratedFile;
use crate::format::Dtype;
use crate::fs::model_files::config_cast;
use crate::fs::{FsError, State};

/// A file of a model-folder view beside the safetensors files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Companion {
    Index(usize),
    ModelFile(usize),
}

/// The companions of a view folder, in listing order: the indexes (if
/// `indexes`), then the model files.
pub fn companions(st: &State, indexes: bool, top: bool) -> Vec<(String, Companion)> {
    let ix = st
        .indexes
        .iter()
        .enumerate()
        .filter(|_| indexes)
        .map(|(i, (ix, _))| (ix.name.clone(), Companion::Index(i)));
    let files = st
        .model_files
        .shown()
        .filter(|(_, f)| !(top && super::is_folder_name(st, &f.name)))
        .map(|(i, f)| (f.name.clone(), Companion::ModelFile(i)));
    ix.chain(files).collect()
}

/// Companion `name` of a view folder, if it is one.
pub fn named(st: &State, name: &str, indexes: bool, top: bool) -> Option<Companion> {
    companions(st, indexes, top)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, c)| c)
}

/// What a companion draws on.
pub fn found(c: Companion) -> Found {
    Found::File(match c {
        Companion::Index(i) => Draws::Index(i),
        Companion::ModelFile(i) => Draws::ModelFile(i),
    })
}

/// A companion's file in a view cast to `cast` (None: as it is).
pub fn make(st: &State, c: Companion, cast: Option<Dtype>) -> Result<GeneratedFile, ViewError> {
    match c {
        Companion::Index(i) => match index_view(st, i, cast) {
            Ok(bytes) => Ok(GeneratedFile::text(bytes)),
            Err(FsError::Invalid(why)) => Err(ViewError::Invalid(why)),
            Err(e) => Err(ViewError::Invalid(e.to_string())),
        },
        Companion::ModelFile(i) => {
            let f = st
                .model_files
                .get(i)
                .ok_or_else(|| ViewError::Invalid("removed".into()))?;
            Ok(GeneratedFile::text(match cast {
                Some(dtype) if f.name == "config.json" => config_cast(&f.bytes, dtype),
                _ => f.bytes.to_vec(),
            }))
        }
    }
}

/// Index file `i` as a commit would rewrite it now: every shard's
/// tensors in `weight_map`, their bytes in `metadata.total_size` (as the
/// view cast to `cast` holds them).
pub fn index_view(st: &State, i: usize, cast: Option<Dtype>) -> Result<Vec<u8>, FsError> {
    let mut weight_map = serde_json::Map::new();
    let mut total = 0;
    for m in &st.checkpoints {
        let (tensors, _) = m
            .live
            .view_tensors()
            .map_err(|p| FsError::Invalid(p.to_string()))?;
        for t in tensors {
            let shown = crate::checkpoint::view::cast_dtype(t.dtype, cast);
            total += match shown == t.dtype {
                true => t.bytes.len(),
                // (Only 16-, 32- and 64-bit floats are cast: whole bytes.)
                false => t.bytes.len() * shown.bits() / t.dtype.bits(),
            };
            weight_map.insert(t.name, format!("{}.safetensors", m.dir_name).into());
        }
    }
    if let Some(p) = st.in_two_shards().first() {
        return Err(FsError::Invalid(p.to_string()));
    }
    let ix = &st.indexes[i].0;
    match crate::checkpoint::transaction::rewrite_index(&ix.bytes, &weight_map, total) {
        Ok(Some(bytes)) => Ok(bytes),
        Ok(None) => Ok(ix.bytes.clone()), // (a commit leaves it as it is)
        Err(why) => Err(FsError::Invalid(format!("{}: {why}", ix.name))),
    }
}
