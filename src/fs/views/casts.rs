//! `__views__/bf16/`, `f16/`, `f32/`: the export views with every
//! floating-point tensor cast (round to nearest even), so converting a
//! checkpoint is a `cp`.

use super::export::{draws, make_view, name_of, target_named, targets};
use super::{Draws, Entry, Found, ViewError, ViewFolder, numbered};
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

impl ViewFolder for Casts {
    fn top(&self, _: &State) -> Vec<String> {
        CASTS.iter().map(|(_, n)| n.to_string()).collect()
    }

    fn find(&self, st: &State, path: &[&str]) -> Option<Found> {
        match path {
            [cast] => cast_named(cast).map(|_| Found::Folder(Draws::All)),
            [cast, name] => {
                cast_named(cast)?;
                target_named(st, name).map(|t| Found::File(draws(t)))
            }
            _ => None,
        }
    }

    fn list(&self, st: &State, _: &[&str], _: u64) -> Vec<Entry> {
        numbered(targets(st).into_iter().map(|t| (name_of(st, t), false)))
    }

    fn make(&self, st: &State, path: &[&str]) -> Result<GeneratedFile, ViewError> {
        let [cast, name] = path else {
            return Err(ViewError::NotAView);
        };
        let cast = cast_named(cast).ok_or(ViewError::NotAView)?;
        let t = target_named(st, name).ok_or(ViewError::NotAView)?;
        make_view(st, t, Some(cast))
    }
}
