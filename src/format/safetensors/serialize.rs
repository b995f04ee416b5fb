//! Writing a header exactly as the reference serializer does.

use std::collections::HashSet;

use crate::format::header::{MAX_HEADER_LEN, Metadata, PREFIX_LEN, byte_len, size_error};
use crate::format::tensors::{TensorRef, Tensors};
use crate::format::{Dtype, FormatError};

/// A tensor to be written: what the header says of it, before offsets exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// Where everything goes in a new file.
#[derive(Debug, Clone, Default)]
pub struct Layout {
    /// The 8-byte length prefix followed by the space-padded JSON header.
    pub header: Vec<u8>,
    /// The tensors in file order, with their data offsets.
    pub tensors: Tensors,
    /// For each entry of `tensors`, its index in the caller's input.
    pub source_index: Vec<usize>,
    /// Zero bytes after the last tensor (GGUF pads it to the alignment).
    pub end_pad: u64,
}

impl Layout {
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }

    /// Total length of the file this layout describes.
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len() + self.end_pad
    }
}

/// Lays out tensors as the reference `serialize` does: dtype descending (in the
/// dtype declaration order), then name ascending; `__metadata__` first with its
/// keys sorted; the JSON padded with spaces to a multiple of 8.
pub fn layout(tensors: &[TensorSpec], metadata: Option<&Metadata>) -> Result<Layout, FormatError> {
    layout_of(
        tensors.len(),
        |i| {
            (
                tensors[i].name.as_str(),
                tensors[i].dtype,
                tensors[i].shape.as_slice(),
            )
        },
        metadata,
    )
}

/// `layout` of `count` tensors that `spec(i)` describes (name, dtype, shape),
/// borrowed from wherever they are: nothing is copied but into the result.
pub fn layout_of<'a>(
    count: usize,
    spec: impl Fn(usize) -> (&'a str, Dtype, &'a [u64]),
    metadata: Option<&Metadata>,
) -> Result<Layout, FormatError> {
    let mut names = HashSet::with_capacity(count);
    for i in 0..count {
        let name = spec(i).0;
        if name == "__metadata__" {
            return Err(FormatError::ReservedName {
                tensor: name.to_string(),
            });
        }
        if !names.insert(name) {
            return Err(FormatError::DuplicateName {
                tensor: name.to_string(),
            });
        }
    }
    drop(names);
    let mut order: Vec<usize> = (0..count).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (spec(a), spec(b));
        b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0))
    });

    let mut placed = Tensors::with_capacity(count);
    let mut offset = 0u64;
    for &i in &order {
        let (name, dtype, shape) = spec(i);
        let len = byte_len(dtype, shape).map_err(|e| size_error(e, name, dtype, shape))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| FormatError::Overflow {
                tensor: name.to_string(),
                shape: shape.to_vec(),
            })?;
        placed
            .push(name, dtype, shape, (offset, end))
            .map_err(|_| FormatError::HeaderTooLarge {
                header_len: u64::MAX,
            })?;
        offset = end;
    }

    let header = header_bytes(&placed, metadata)?;
    Ok(Layout {
        header,
        tensors: placed,
        source_index: order,
        end_pad: 0,
    })
}

/// The prefix and padded JSON for tensors already in file order.
pub fn header_bytes(
    tensors: &Tensors,
    metadata: Option<&Metadata>,
) -> Result<Vec<u8>, FormatError> {
    let mut out = Vec::with_capacity(PREFIX_LEN as usize + 2 + tensors.len() * 80);
    out.extend_from_slice(&[0u8; PREFIX_LEN as usize]);
    out.push(b'{');
    let mut first = true;
    if let Some(meta) = metadata {
        out.extend_from_slice(b"\"__metadata__\":{");
        for (i, (k, v)) in meta.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            write_json_string(&mut out, k);
            out.push(b':');
            write_json_string(&mut out, v);
        }
        out.push(b'}');
        first = false;
    }
    for t in tensors.iter() {
        if !first {
            out.push(b',');
        }
        first = false;
        write_json_string(&mut out, t.name);
        out.push(b':');
        write_entry(&mut out, &t);
    }
    out.push(b'}');
    // Pad the JSON (not the prefix) with spaces to a multiple of 8.
    while (out.len() - PREFIX_LEN as usize) % 8 != 0 {
        out.push(b' ');
    }
    let header_len = (out.len() - PREFIX_LEN as usize) as u64;
    if header_len > MAX_HEADER_LEN {
        return Err(FormatError::HeaderTooLarge { header_len });
    }
    out[..PREFIX_LEN as usize].copy_from_slice(&header_len.to_le_bytes());
    Ok(out)
}

/// `{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}`, the reference's field order.
pub fn write_entry(out: &mut Vec<u8>, t: &TensorRef) {
    out.extend_from_slice(b"{\"dtype\":\"");
    out.extend_from_slice(t.dtype.name().as_bytes());
    out.extend_from_slice(b"\",\"shape\":[");
    for (i, d) in t.shape.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(d.to_string().as_bytes());
    }
    out.extend_from_slice(b"],\"data_offsets\":[");
    out.extend_from_slice(t.data_offsets.0.to_string().as_bytes());
    out.push(b',');
    out.extend_from_slice(t.data_offsets.1.to_string().as_bytes());
    out.extend_from_slice(b"]}");
}

/// A JSON string escaped exactly as serde_json (and so the reference) escapes it.
fn write_json_string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}
