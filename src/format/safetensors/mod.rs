//! Safetensors: the header's JSON read with the reference's decisions
//! (`json`), the reference's layout and serialization (`serialize`), and the
//! Hugging Face index of a folder of shards (`index`). What both formats
//! share (`Header`, `Dtype`, `Tensors`, `FormatWriter`) is in `format`.

pub mod index;
pub(super) mod json;
mod serialize;

pub use serialize::*;
