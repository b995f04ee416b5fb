//! The safetensors format: bytes <-> header. No I/O policy and no FUSE here.

mod dtype;
mod error;
mod header;
pub mod index;
mod serialize;

pub use dtype::Dtype;
pub(crate) use error::ShapeDisplay;
pub use error::{FormatError, InFile};
pub use header::{
    byte_len, element_count, Header, Metadata, SizeError, TensorInfo, MAX_HEADER_LEN, PREFIX_LEN,
};
pub use serialize::{header_bytes, layout, write_entry, Layout, TensorSpec};

#[cfg(test)]
mod tests;
