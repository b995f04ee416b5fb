//! The checkpoint formats: bytes <-> header. No I/O policy and no FUSE
//! here. This top names the seam both formats share: `Header` (the tensors
//! and metadata a mount shows, whatever the format), `Dtype`, `Tensors`,
//! `FormatWriter` (a commit's writer of either format) and `read_checkpoint`;
//! each format's own reading and writing is in its room, `safetensors/` and
//! `gguf/`. A new format is a room beside them, a `FormatWriter`, and a
//! case in `read_checkpoint`.

mod dtype;
mod error;
pub mod gguf;
mod header;
pub mod safetensors;
mod tensors;
pub mod writer;

pub use dtype::Dtype;
pub(crate) use error::ShapeDisplay;
pub use error::{FormatError, InFile};
pub use header::{
    Header, IN_PLACE_MARKER, MAX_HEADER_LEN, Metadata, PREFIX_LEN, SizeError, byte_len,
    element_count, interrupted_in_place,
};
pub use safetensors::index;
pub use safetensors::{Layout, TensorSpec, header_bytes, layout, layout_of, write_entry};
pub use tensors::{TensorInfo, TensorRef, Tensors};
pub use writer::{FormatWriter, NoFit};

/// A whole checkpoint file (`bytes`, typically mapped) as a mount reads it:
/// a file named `*.gguf` as GGUF (and refused as one) whatever it holds,
/// else GGUF when it starts with GGUF's magic, else safetensors. Commits
/// read what they are about to land through it too.
pub fn read_checkpoint(bytes: &[u8], name: &std::ffi::OsStr) -> Result<Header, FormatError> {
    match gguf::named_gguf(name) {
        true => gguf::parse(bytes)
            .map_err(FormatError::from)
            .and_then(Header::from_gguf),
        false => Header::parse_any(bytes),
    }
}

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
