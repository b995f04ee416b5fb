//! The safetensors format: bytes <-> header. No I/O policy and no FUSE here.

mod dtype;
mod error;
mod header;
pub mod index;
mod serialize;
mod tensors;

pub use dtype::Dtype;
pub(crate) use error::ShapeDisplay;
pub use error::{FormatError, InFile};
pub use header::{
    byte_len, element_count, Header, Metadata, SizeError, MAX_HEADER_LEN, PREFIX_LEN,
};
pub use serialize::{header_bytes, layout, layout_of, write_entry, Layout, TensorSpec};
pub use tensors::{TensorInfo, TensorRef, Tensors};

#[cfg(test)]
mod tests;
