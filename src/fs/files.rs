//! The files a tensor name shows in a checkpoint directory, defined once:
//! each kind has a file-name suffix and a slot (its place among the inodes
//! and the listing positions of the name). A new view of a tensor (a `.npy`
//! file, a slice) is a new variant here.

use super::names::{tensor_file_name, tensor_name};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorFile {
    /// The tensor's raw bytes.
    Data,
    /// `<name>.meta.json`: its dtype and shape.
    Meta,
}

impl TensorFile {
    /// Every kind, in slot order.
    pub const ALL: [TensorFile; 2] = [TensorFile::Data, TensorFile::Meta];
    /// Inodes and listing positions per tensor id.
    pub const STRIDE: u64 = TensorFile::ALL.len() as u64;

    pub fn suffix(self) -> &'static str {
        match self {
            TensorFile::Data => "",
            TensorFile::Meta => ".meta.json",
        }
    }

    pub fn slot(self) -> u64 {
        self as u64
    }

    pub fn from_slot(slot: u64) -> Option<TensorFile> {
        TensorFile::ALL.get(slot as usize).copied()
    }

    /// The file name of this kind of file of a tensor.
    pub fn file_name(self, tensor: &str) -> String {
        tensor_file_name(tensor) + self.suffix()
    }

    /// Which file of which tensor a file name is: None if the name is not a
    /// canonical escape (see `names`). Hashed long names come back as
    /// `Err(stem)` for the caller to look up.
    pub fn parse(file_name: &str) -> Option<(TensorFile, Result<String, &str>)> {
        // The longest suffix first: "" matches everything.
        let mut kinds = TensorFile::ALL;
        kinds.sort_by_key(|k| std::cmp::Reverse(k.suffix().len()));
        for kind in kinds {
            // Escaping keeps every suffix off other kinds' names: the first
            // suffix that matches decides.
            if let Some(stem) = file_name.strip_suffix(kind.suffix()) {
                return Some(match tensor_name(stem) {
                    Some(name) => (kind, Ok(name)),
                    None if super::names::maybe_hashed(stem) => (kind, Err(stem)),
                    None => return None,
                });
            }
        }
        None
    }

    /// Generated JSON, always current: read without the page cache.
    pub fn is_generated(self) -> bool {
        matches!(self, TensorFile::Meta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_split_into_kind_and_tensor() {
        assert_eq!(
            TensorFile::parse("a%2Fb.meta.json"),
            Some((TensorFile::Meta, Ok("a/b".to_string())))
        );
        assert_eq!(
            TensorFile::parse("x%2Emeta.json"),
            Some((TensorFile::Data, Ok("x.meta.json".to_string())))
        );
        assert_eq!(
            TensorFile::parse("x%2Emeta.json.meta.json"),
            Some((TensorFile::Meta, Ok("x.meta.json".to_string())))
        );
        assert_eq!(
            TensorFile::parse("%.meta.json"),
            Some((TensorFile::Meta, Ok(String::new())))
        );
        assert_eq!(TensorFile::parse(".meta.json"), None);
        assert_eq!(TensorFile::parse("%zz"), None);
        for kind in TensorFile::ALL {
            assert_eq!(TensorFile::from_slot(kind.slot()), Some(kind));
            let f = kind.file_name("w/1");
            assert_eq!(TensorFile::parse(&f), Some((kind, Ok("w/1".to_string()))));
        }
    }
}
