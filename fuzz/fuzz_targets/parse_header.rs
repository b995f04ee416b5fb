#![no_main]
//! Any bytes: the parser answers Ok or Err, never panics; what it accepts
//! re-serializes to a file it accepts again with the same tensors.

use libfuzzer_sys::fuzz_target;
use stfs::format::{layout, Header, TensorSpec};

fuzz_target!(|data: &[u8]| {
    let Ok(h) = Header::parse(data) else { return };
    let specs: Vec<TensorSpec> = h
        .tensors
        .iter()
        .map(|t| TensorSpec { name: t.name.to_string(), dtype: t.dtype, shape: t.shape.to_vec() })
        .collect();
    let l = layout(&specs, h.metadata.as_ref()).expect("an accepted header re-serializes");
    let mut bytes = l.header.clone();
    bytes.resize(l.file_len() as usize, 0);
    let again = Header::parse(&bytes).expect("a serialized header parses");
    assert_eq!(again.tensors.len(), h.tensors.len());
    for t in h.tensors.iter() {
        let u = again.get(t.name).expect("same names");
        assert_eq!((u.dtype, u.shape, u.nbytes()), (t.dtype, t.shape, t.nbytes()));
    }
});
