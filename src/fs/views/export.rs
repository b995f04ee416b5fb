//! The top of `__views__`: each checkpoint as `stfs commit --compact` would
//! write it now (`model.safetensors` of a file mount; each shard under its
//! own name and `merged.safetensors`, all shards in one file, on a folder
//! mount), and a folder mount's index files as a commit would rewrite them.

use super::{Draws, Entry, Found, ViewError, ViewFolder, model};
use crate::checkpoint::view::GeneratedFile;
use crate::format::Dtype;
use crate::fs::State;

pub struct Export;

/// What a view file shows: checkpoint `c`, or (None) every shard merged.
pub type Target = Option<usize>;

/// The views of one cast, in listing order: each checkpoint, then (folder
/// mounts) the merged one.
pub fn targets(st: &State) -> Vec<Target> {
    let mut out: Vec<Target> = (0..st.checkpoints.len()).map(Some).collect();
    if st.folder.is_some() {
        out.push(None);
    }
    out
}

/// A view's file name: `model.safetensors` of a file mount; of a folder
/// mount, each shard's own name, and `merged.safetensors`.
pub fn name_of(st: &State, target: Target) -> String {
    match (target, &st.folder) {
        (Some(_), None) => "model.safetensors".into(),
        (Some(c), Some(_)) => format!("{}.safetensors", st.checkpoints[c].dir_name),
        (None, _) => merged_name(st),
    }
}

/// `merged.safetensors`, with `_` before it as long as a shard has that name.
fn merged_name(st: &State) -> String {
    let mut stem = "merged".to_string();
    while st.checkpoints.iter().any(|m| m.dir_name == stem) {
        stem.insert(0, '_');
    }
    stem + ".safetensors"
}

/// The target of view file `name`.
pub fn target_named(st: &State, name: &str) -> Option<Target> {
    targets(st).into_iter().find(|&t| name_of(st, t) == name)
}

pub fn draws(target: Target) -> Draws {
    target.map_or(Draws::All, Draws::Checkpoint)
}

/// The tensors and metadata of `target` now (None: every shard's tensors
/// in one list, metadata keys of the first shard that has them).
pub fn tensors_of(
    st: &State,
    target: Target,
) -> Result<
    (
        Vec<crate::checkpoint::view::ViewTensor>,
        Option<crate::format::Metadata>,
    ),
    ViewError,
> {
    if let Some(c) = target {
        return st
            .live(c)
            .view_tensors()
            .map_err(|p| ViewError::Invalid(p.to_string()));
    }
    let mut all = Vec::new();
    let mut metadata: Option<crate::format::Metadata> = None;
    for m in &st.checkpoints {
        let (tensors, meta) = m
            .live
            .view_tensors()
            .map_err(|e| format!("{}: {e}", m.live.source().path().display()))?;
        all.extend(tensors);
        for (k, v) in meta.into_iter().flatten() {
            metadata
                .get_or_insert_with(Default::default)
                .entry(k)
                .or_insert(v);
        }
    }
    if let Some(p) = st.in_two_shards().first() {
        return Err(ViewError::Invalid(p.to_string()));
    }
    Ok((all, metadata))
}

/// The view of `target`, cast.
pub fn make_view(
    st: &State,
    target: Target,
    cast: Option<Dtype>,
) -> Result<GeneratedFile, ViewError> {
    let (tensors, metadata) = tensors_of(st, target)?;
    Ok(GeneratedFile::safetensors(tensors, metadata.as_ref(), cast).map_err(|e| e.to_string())?)
}

impl ViewFolder for Export {
    fn top(&self, st: &State) -> Vec<String> {
        let views = targets(st).into_iter().map(|t| name_of(st, t));
        let companions = model::companions(st, true, true)
            .into_iter()
            .map(|(n, _)| n);
        views.chain(companions).collect()
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        let [name] = path else { return None };
        if let Some(t) = target_named(st, name) {
            return Some(Found::File(draws(t)));
        }
        model::named(st, name, true, true).map(model::found)
    }

    fn list(&self, _: &State, _: &[&str], _: u64) -> Vec<Entry> {
        Vec::new() // (files only)
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let [name] = path else {
            return Err(ViewError::NotAView);
        };
        if let Some(t) = target_named(st, name) {
            return make_view(st, t, None);
        }
        let c = model::named(st, name, true, true).ok_or(ViewError::NotAView)?;
        model::make(st, c, None)
    }
}
