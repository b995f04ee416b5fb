//! stfs: a safetensors checkpoint as a FUSE directory.

pub mod cli;
pub mod create;
pub mod format;
pub mod inspect;
