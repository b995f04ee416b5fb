//! Parsing and validating a safetensors header, with the reference's accept/reject
//! decisions (see docs/FORMAT.md for every lenient case it keeps).

use std::collections::BTreeMap;
use std::fs::File;
use std::hash::BuildHasher;
use std::os::unix::fs::FileExt;

use hashbrown::{DefaultHashBuilder, HashTable};

use super::tensors::{TensorRef, Tensors};
use super::{Dtype, FormatError};

/// Length of the little-endian header size prefix.
pub const PREFIX_LEN: u64 = 8;
/// The reference refuses headers longer than this.
pub const MAX_HEADER_LEN: u64 = 100_000_000;

/// What an in-place commit writes over the length prefix while it changes a
/// file. As a length it is absurd (about 5.8e18), so every reader refuses the
/// file ("header too large") until stfs completes the commit.
pub const IN_PLACE_MARKER: [u8; 8] = *b"STFS-WIP";

/// Whether a file is one an in-place commit of stfs left half-done: the
/// marker at its start, or (just after blocks were inserted at its start,
/// which moved the marker) zeros there and the marker at a block boundary.
/// `read_at(buf, pos)` reads the file.
pub fn interrupted_in_place(
    len: u64,
    read_at: impl Fn(&mut [u8], u64) -> std::io::Result<usize>,
) -> bool {
    let mut prefix = [0u8; 8];
    if read_at(&mut prefix, 0).ok() != Some(8) {
        return false;
    }
    if prefix == IN_PLACE_MARKER {
        return true;
    }
    if prefix != [0; 8] {
        return false;
    }
    let mut at = 1024;
    while at + 8 <= len.min(2 * MAX_HEADER_LEN) {
        let mut here = [0u8; 8];
        if read_at(&mut here, at).ok() == Some(8) && here == IN_PLACE_MARKER {
            return true;
        }
        at += 1024;
    }
    false
}

/// The metadata map of a header (`__metadata__`), kept sorted as it is written.
pub type Metadata = BTreeMap<String, String>;

/// Why `byte_len` refused a dtype and shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeError {
    Overflow,
    NotByteAligned,
}

/// Number of elements of a shape (1 for a scalar), None on overflow.
pub fn element_count(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))
}

/// Bytes needed by `dtype` x `shape`, with checked arithmetic. A block type
/// needs a whole number of blocks.
pub fn byte_len(dtype: Dtype, shape: &[u64]) -> Result<u64, SizeError> {
    let (elements, block_bits) = dtype.block();
    let count = element_count(shape).ok_or(SizeError::Overflow)?;
    if count % elements != 0 {
        return Err(SizeError::NotByteAligned);
    }
    let bits = (count / elements)
        .checked_mul(block_bits)
        .ok_or(SizeError::Overflow)?;
    if bits % 8 != 0 {
        return Err(SizeError::NotByteAligned);
    }
    Ok(bits / 8)
}

/// A validated header.
#[derive(Debug, Clone)]
pub struct Header {
    /// N, the length of the JSON header including its padding.
    pub header_len: u64,
    /// `__metadata__`; None when absent or `null`.
    pub metadata: Option<Metadata>,
    /// Every tensor, in data-offset order (ties broken by name).
    pub tensors: Tensors,
    /// Indices into `tensors`, hashed by name: lookups without a second copy of every name.
    by_name: TensorsByName,
    /// A GGUF file's header as read (its typed keys and values, its
    /// alignment); None for safetensors. `tensors` holds the same tensors,
    /// their offsets relative to the GGUF data start.
    pub gguf: Option<std::sync::Arc<super::gguf::GgufHeader>>,
}

/// A hash index of tensor positions keyed by their names, which stay in `Tensors`.
#[derive(Debug, Clone, Default)]
struct TensorsByName {
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
}

impl TensorsByName {
    fn find(&self, tensors: &Tensors, name: &str) -> Option<usize> {
        let hash = self.hasher.hash_one(name);
        self.table
            .find(hash, |&i| tensors.name(i as usize) == name)
            .map(|&i| i as usize)
    }

    /// Indexes `tensors` in order; a repeated name keeps its last entry (as a
    /// HashMap insert does in the reference). Returns the positions replaced.
    fn build(tensors: &Tensors) -> (TensorsByName, Vec<usize>) {
        let mut index = TensorsByName {
            table: HashTable::with_capacity(tensors.len()),
            hasher: DefaultHashBuilder::default(),
        };
        let mut replaced = Vec::new();
        for i in 0..tensors.len() {
            let name = tensors.name(i);
            let hash = index.hasher.hash_one(name);
            let hasher = |&j: &u32| index.hasher.hash_one(tensors.name(j as usize));
            match index
                .table
                .entry(hash, |&j| tensors.name(j as usize) == name, hasher)
            {
                hashbrown::hash_table::Entry::Occupied(mut e) => {
                    replaced.push(std::mem::replace(e.get_mut(), i as u32) as usize)
                }
                hashbrown::hash_table::Entry::Vacant(e) => {
                    e.insert(i as u32);
                }
            }
        }
        (index, replaced)
    }
}

impl Header {
    /// Parses and validates a whole file held in memory (typically an mmap).
    /// A whole file of either format: GGUF when it starts with GGUF's
    /// magic, safetensors otherwise.
    pub fn parse_any(file: &[u8]) -> Result<Header, FormatError> {
        if super::gguf::is_gguf(file) {
            return Header::from_gguf(super::gguf::parse(file)?);
        }
        Header::parse(file)
    }

    /// `parse_prefix` of either format (GGUF when `prefix` starts with its
    /// magic; `prefix` then holds its whole header).
    pub fn parse_any_prefix(prefix: &[u8], file_len: u64) -> Result<Header, FormatError> {
        use super::gguf::{PrefixError, is_gguf, parse_prefix};
        if !is_gguf(prefix) {
            return Header::parse_prefix(prefix, file_len);
        }
        match parse_prefix(prefix, file_len) {
            Ok(g) => Header::from_gguf(g),
            Err(PrefixError::Refused(e)) => Err(e.into()),
            Err(PrefixError::NeedsMore) => Err(super::gguf::GgufError {
                tensor: None,
                key: None,
                rule: "the header runs past the bytes given".into(),
            }
            .into()),
        }
    }

    pub fn parse(file: &[u8]) -> Result<Header, FormatError> {
        Header::parse_prefix(file, file.len() as u64)
    }

    /// Parses a header from the first bytes of a file of `file_len` bytes.
    /// `prefix` must hold at least the 8-byte prefix and the JSON header.
    pub fn parse_prefix(prefix: &[u8], file_len: u64) -> Result<Header, FormatError> {
        let header_len = header_len_of(prefix, file_len)?;
        let end = (PREFIX_LEN + header_len) as usize;
        let json = prefix
            .get(PREFIX_LEN as usize..end)
            .ok_or(FormatError::HeaderTruncated {
                header_len,
                file_len: prefix.len() as u64,
            })?;
        Header::from_json(json, header_len, file_len)
    }

    /// Reads and validates the header of an open file without reading its data.
    pub fn read(file: &File) -> std::io::Result<Result<Header, FormatError>> {
        let file_len = file.metadata()?.len();
        let mut prefix = [0u8; PREFIX_LEN as usize];
        let got = read_full_at(file, &mut prefix, 0)?;
        let header_len = match header_len_of(&prefix[..got], file_len) {
            Ok(n) => n,
            Err(e) => return Ok(Err(e)),
        };
        // header_len is checked against the cap and the file length above.
        let mut json = vec![0u8; header_len as usize];
        let got = read_full_at(file, &mut json, PREFIX_LEN)?;
        if got < json.len() {
            return Ok(Err(FormatError::HeaderTruncated {
                header_len,
                file_len: PREFIX_LEN + got as u64,
            }));
        }
        Ok(Header::from_json(&json, header_len, file_len))
    }

    fn from_json(json: &[u8], header_len: u64, file_len: u64) -> Result<Header, FormatError> {
        let text = std::str::from_utf8(json).map_err(|e| FormatError::HeaderNotUtf8 {
            at: e.valid_up_to(),
        })?;
        let raw = super::safetensors::json::parse_json(text)?;

        let mut tensors = raw.tensors;
        let (mut by_name, replaced) = TensorsByName::build(&tensors);
        if !replaced.is_empty() {
            // Rare: drop the entries a repeated name overrode, and index again.
            let mut keep = vec![true; tensors.len()];
            replaced.iter().for_each(|&i| keep[i] = false);
            tensors.retain_flags(&keep);
            by_name = TensorsByName::build(&tensors).0;
        }
        // Offset order, as the reference validates; the name makes ties deterministic.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_unstable_by(|&a, &b| {
            let (a, b) = (tensors.get(a), tensors.get(b));
            a.data_offsets
                .cmp(&b.data_offsets)
                .then_with(|| a.name.cmp(b.name))
        });
        let mut new_position = vec![0u32; tensors.len()];
        for (new, &old) in order.iter().enumerate() {
            new_position[old] = new as u32;
        }
        by_name
            .table
            .iter_mut()
            .for_each(|i| *i = new_position[*i as usize]);
        tensors.reorder(&order);
        let data_len = validate_layout(&tensors)?;
        let expected = PREFIX_LEN as u128 + header_len as u128 + data_len as u128;
        if expected != file_len as u128 {
            return Err(FormatError::LengthMismatch {
                header_len,
                data_len,
                file_len,
            });
        }
        Ok(Header {
            header_len,
            metadata: raw.metadata,
            tensors,
            by_name,
            gguf: None,
        })
    }

    /// The header of a file a commit wrote from a layout: its tensors are
    /// already validated and in file order.
    pub fn from_parts(header_len: u64, tensors: Tensors, metadata: Option<Metadata>) -> Header {
        let (by_name, _) = TensorsByName::build(&tensors);
        Header {
            gguf: None,
            header_len,
            metadata,
            tensors,
            by_name,
        }
    }

    /// The tensor table of a validated GGUF file: each tensor's bytes as
    /// stored (its padding to the alignment lies between them), offsets
    /// relative to the data start, which `header_len` places (8 + header_len).
    pub fn from_gguf(g: super::gguf::GgufHeader) -> Result<Header, FormatError> {
        if let Some(e) = g.not_utf8 {
            return Err(e.into());
        }
        // (In file order, which the parser checked is offset order.)
        let mut tensors = Tensors::with_capacity(g.tensors.len());
        for t in &g.tensors {
            tensors
                .push(
                    &t.name,
                    t.ggml_type.dtype,
                    &t.shape(),
                    (t.offset, t.offset + t.nbytes),
                )
                .map_err(|_| super::gguf::GgufError {
                    tensor: None,
                    key: None,
                    rule: "too many tensors to hold".into(),
                })?;
        }
        let (by_name, _) = TensorsByName::build(&tensors);
        Ok(Header {
            header_len: g.data_start - PREFIX_LEN,
            metadata: None,
            tensors,
            by_name,
            gguf: Some(std::sync::Arc::new(g)),
        })
    }

    /// Whether this is a GGUF file's header.
    pub fn is_gguf(&self) -> bool {
        self.gguf.is_some()
    }

    /// File offset of the first data byte.
    pub fn data_start(&self) -> u64 {
        PREFIX_LEN + self.header_len
    }

    /// Length of the data section.
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }

    pub fn get(&self, name: &str) -> Option<TensorRef<'_>> {
        self.index_of(name).map(|i| self.tensors.get(i))
    }

    /// Position of a tensor in `tensors`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.by_name.find(&self.tensors, name)
    }
}

fn read_full_at(file: &File, buf: &mut [u8], mut offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset) {
            Ok(0) => break,
            Ok(n) => {
                done += n;
                offset += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Reads and checks the 8-byte prefix against the cap and the file length.
fn header_len_of(prefix: &[u8], file_len: u64) -> Result<u64, FormatError> {
    let bytes: [u8; 8] = prefix
        .get(..PREFIX_LEN as usize)
        .and_then(|b| b.try_into().ok())
        .ok_or(FormatError::TooShort { file_len })?;
    let header_len = u64::from_le_bytes(bytes);
    if header_len > MAX_HEADER_LEN {
        return Err(FormatError::HeaderTooLarge { header_len });
    }
    if PREFIX_LEN + header_len > file_len {
        return Err(FormatError::HeaderTruncated {
            header_len,
            file_len,
        });
    }
    Ok(header_len)
}

/// Checks offsets and sizes of tensors sorted by offset; returns the data length.
fn validate_layout(tensors: &Tensors) -> Result<u64, FormatError> {
    let mut next = 0u64;
    for t in tensors.iter() {
        let (begin, end) = t.data_offsets;
        if begin != next || end < begin {
            return Err(FormatError::InvalidOffsets {
                tensor: t.name.to_string(),
                begin,
                end,
                expected_begin: next,
            });
        }
        next = end;
        let needed =
            byte_len(t.dtype, t.shape).map_err(|e| size_error(e, t.name, t.dtype, t.shape))?;
        if end - begin != needed {
            return Err(FormatError::SizeMismatch {
                tensor: t.name.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                begin,
                end,
                needed,
            });
        }
    }
    Ok(next)
}

pub(crate) fn size_error(e: SizeError, name: &str, dtype: Dtype, shape: &[u64]) -> FormatError {
    match e {
        SizeError::Overflow => FormatError::Overflow {
            tensor: name.to_string(),
            shape: shape.to_vec(),
        },
        SizeError::NotByteAligned => FormatError::NotByteAligned {
            tensor: name.to_string(),
            dtype,
            shape: shape.to_vec(),
        },
    }
}
