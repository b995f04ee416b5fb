//! The safetensors format: bytes <-> header. No I/O policy and no FUSE here.

mod dtype;
mod error;
pub mod gguf;
mod header;
pub mod index;
mod serialize;
mod tensors;
pub mod writer;

pub use dtype::Dtype;
pub(crate) use error::ShapeDisplay;
pub use error::{FormatError, InFile};
pub use header::{
    Header, IN_PLACE_MARKER, MAX_HEADER_LEN, Metadata, PREFIX_LEN, SizeError, byte_len,
    element_count, interrupted_in_place,
};
pub use serialize::{Layout, TensorSpec, header_bytes, layout, layout_of, write_entry};
pub use tensors::{TensorInfo, TensorRef, Tensors};
pub use writer::{FormatWriter, NoFit};

/// A tensor name as it may be printed to a terminal: control characters,
/// quotes and backslashes escaped (as Rust's `{:?}` does), without quotes.
/// Every listing of names for a person (`inspect`, `stfs status`) uses it,
/// so that a name cannot move the cursor, retitle the terminal or forge a line.
pub fn printable(name: &str) -> String {
    let quoted = format!("{name:?}");
    quoted[1..quoted.len() - 1].to_string()
}

#[cfg(test)]
mod tests;
