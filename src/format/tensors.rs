//! The tensors of a header, stored compactly: every name in one buffer, every
//! shape in another, and 32 bytes per tensor. A header of a million tensors
//! takes about as much memory as its JSON, not several times it.

use std::fmt;

use super::Dtype;

/// One tensor, borrowed from a `Tensors`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [u64],
    /// Byte range relative to the start of the data section.
    pub data_offsets: (u64, u64),
}

impl TensorRef<'_> {
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }

    pub fn to_info(&self) -> TensorInfo {
        TensorInfo {
            name: self.name.to_string(),
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            data_offsets: self.data_offsets,
        }
    }
}

impl fmt::Debug for TensorRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("name", &self.name)
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("data_offsets", &self.data_offsets)
            .finish()
    }
}

/// One tensor, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Item {
    name_start: u32,
    name_len: u32,
    shape_start: u32,
    /// The dtype in the top byte, the number of dimensions below.
    dtype_ndim: u32,
    data_offsets: (u64, u64),
}

const NDIM_BITS: u32 = 24;

/// Tensors in an order of the caller's (file order, for a header).
#[derive(Clone, Default)]
pub struct Tensors {
    names: String,
    shapes: Vec<u64>,
    items: Vec<Item>,
}

/// Why a tensor did not fit the compact form (only absurd headers hit this:
/// a 100,000,000-byte header cannot reach these limits with valid entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooBig;

impl Tensors {
    pub fn with_capacity(n: usize) -> Tensors {
        Tensors {
            names: String::new(),
            shapes: Vec::new(),
            items: Vec::with_capacity(n),
        }
    }

    pub fn push(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[u64],
        data_offsets: (u64, u64),
    ) -> Result<(), TooBig> {
        let small = |n: usize| u32::try_from(n).map_err(|_| TooBig);
        let item = Item {
            name_start: small(self.names.len())?,
            name_len: small(name.len())?,
            shape_start: small(self.shapes.len())?,
            dtype_ndim: ((dtype.index() as u32) << NDIM_BITS)
                | small(shape.len()).and_then(|n| {
                    if n < 1 << NDIM_BITS {
                        Ok(n)
                    } else {
                        Err(TooBig)
                    }
                })?,
            data_offsets,
        };
        self.names.push_str(name);
        self.shapes.extend_from_slice(shape);
        self.items.push(item);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn get(&self, i: usize) -> TensorRef<'_> {
        let it = &self.items[i];
        let name = &self.names[it.name_start as usize..(it.name_start + it.name_len) as usize];
        let ndim = (it.dtype_ndim & ((1 << NDIM_BITS) - 1)) as usize;
        let shape = &self.shapes[it.shape_start as usize..it.shape_start as usize + ndim];
        TensorRef {
            name,
            dtype: Dtype::from_index((it.dtype_ndim >> NDIM_BITS) as usize)
                .expect("pushed as a Dtype's index"),
            shape,
            data_offsets: it.data_offsets,
        }
    }

    /// The name of tensor `i` (the hot path of lookups).
    pub fn name(&self, i: usize) -> &str {
        let it = &self.items[i];
        &self.names[it.name_start as usize..(it.name_start + it.name_len) as usize]
    }

    pub fn nbytes(&self, i: usize) -> u64 {
        let (b, e) = self.items[i].data_offsets;
        e - b
    }

    pub fn last(&self) -> Option<TensorRef<'_>> {
        (!self.is_empty()).then(|| self.get(self.len() - 1))
    }

    pub fn iter(&self) -> impl ExactSizeIterator<Item = TensorRef<'_>> + '_ {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Reorders the tensors: position `k` gets tensor `order[k]`. The names
    /// and shapes stay where they are.
    pub fn reorder(&mut self, order: &[usize]) {
        self.items = order.iter().map(|&i| self.items[i]).collect();
    }

    /// Keeps the tensors whose flag is true (names and shapes of the others
    /// stay in the buffers: this only happens for repeated names).
    pub fn retain_flags(&mut self, keep: &[bool]) {
        let mut flags = keep.iter();
        self.items.retain(|_| *flags.next().unwrap_or(&true));
    }

    /// Sets the data offsets of tensor `i`.
    pub fn set_offsets(&mut self, i: usize, data_offsets: (u64, u64)) {
        self.items[i].data_offsets = data_offsets;
    }
}

impl PartialEq for Tensors {
    fn eq(&self, other: &Tensors) -> bool {
        self.len() == other.len() && self.iter().zip(other.iter()).all(|(a, b)| a == b)
    }
}

impl Eq for Tensors {}

impl fmt::Debug for Tensors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<'a> IntoIterator for &'a Tensors {
    type Item = TensorRef<'a>;
    type IntoIter = Box<dyn Iterator<Item = TensorRef<'a>> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_storage_round_trips() {
        let mut t = Tensors::default();
        t.push("a", Dtype::BF16, &[2, 3], (0, 12)).unwrap();
        t.push("", Dtype::BOOL, &[], (12, 13)).unwrap();
        t.push("ünï", Dtype::U64, &[1], (13, 21)).unwrap();
        assert_eq!(t.len(), 3);
        let b = t.get(1);
        assert_eq!(
            (b.name, b.dtype, b.shape, b.nbytes()),
            ("", Dtype::BOOL, &[][..], 1)
        );
        assert_eq!(t.get(2).name, "ünï");
        assert_eq!(t.get(2).dtype, Dtype::U64);
        t.reorder(&[2, 0, 1]);
        assert_eq!(
            t.iter().map(|x| x.name).collect::<Vec<_>>(),
            ["ünï", "a", ""]
        );
        t.retain_flags(&[true, false, true]);
        assert_eq!(t.iter().map(|x| x.name).collect::<Vec<_>>(), ["ünï", ""]);
        assert_eq!(t.last().unwrap().data_offsets, (12, 13));
        assert_eq!(std::mem::size_of::<Item>(), 32);
    }
}
