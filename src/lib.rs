//! stfs: a safetensors checkpoint as a FUSE directory.

pub mod checkpoint;
pub mod cli;
pub mod client;
pub mod create;
pub mod daemon;
pub mod errno;
pub mod format;
pub mod fs;
pub mod generation;
pub mod inspect;
pub mod mountinfo;
pub mod prefetch;
pub mod progress;
pub mod source;
pub mod sync;
pub mod testpoint;
