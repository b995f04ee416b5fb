//! `__views__/bf16/`, `f16/`, `f32/`: the export views with every
//! floating-point tensor cast (round to nearest even), so converting a
//! checkpoint is a `cp` (a model folder's, with its index and other files,
//! `config.json` naming the cast's dtype, a `cp -r`). A folder mount's cast
//! folders hold its shards, not the merged file beside them: `cp -r` of one
//! copies the model once.

use super::export::{Target, draws, make_view, name_of, target_named, targets};
use super::{Draws, Entry, Found, ViewError, ViewFolder, model, numbered};
use crate::checkpoint::view::GeneratedFile;
use crate::format::Dtype;
use crate::fs::State;

pub struct Casts;

/// The folders of cast views.
const CASTS: [(Dtype, &str); 3] = [
    (Dtype::BF16, "bf16"),
    (Dtype::F16, "f16"),
    (Dtype::F32, "f32"),
];

fn cast_named(name: &str) -> Option<Dtype> {
    CASTS.iter().find(|(_, n)| *n == name).map(|(d, _)| *d)
}

/// The views a cast folder holds: each checkpoint's (not the merged one).
fn cast_targets(st: &State) -> Vec<Target> {
    targets(st).into_iter().filter(Option::is_some).collect()
}

fn cast_target_named(st: &State, name: &str) -> Option<Target> {
    target_named(st, name).filter(Option::is_some)
}

impl ViewFolder for Casts {
    fn top(&self, _: &State) -> Vec<String> {
        CASTS.iter().map(|(_, n)| n.to_string()).collect()
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        match path {
            [cast] => cast_named(cast).map(|_| Found::Folder(Draws::All)),
            [cast, name] => {
                cast_named(cast)?;
                match cast_target_named(st, name) {
                    Some(t) => Some(Found::File(draws(t))),
                    None => model::named(st, name, true, false).map(model::found),
                }
            }
            _ => None,
        }
    }

    fn list(&self, st: &State, _: &[&str], _: u64) -> Vec<Entry> {
        let views = cast_targets(st)
            .into_iter()
            .map(|t| (name_of(st, t), false));
        let companions = model::companions(st, true, false)
            .into_iter()
            .map(|(n, _)| (n, false));
        numbered(views.chain(companions))
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let [cast, name] = path else {
            return Err(ViewError::NotAView);
        };
        let cast = cast_named(cast).ok_or(ViewError::NotAView)?;
        if let Some(t) = cast_target_named(st, name) {
            return make_view(st, t, Some(cast));
        }
        let c = model::named(st, name, true, false).ok_or(ViewError::NotAView)?;
        model::make(st, c, Some(cast))
    }
}
