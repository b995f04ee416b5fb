#![no_main]
//! Any bytes: the GGUF reader answers Ok or Err, never panics, and what it
//! accepts holds together (tensors inside the file, contiguous offsets).

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = stfs::format::gguf::parse(data) {
        let mut next = 0;
        for t in &h.tensors {
            assert_eq!(t.offset, next);
            assert!(h.data_start + t.offset + t.nbytes <= data.len() as u64);
            next += t.nbytes.div_ceil(h.alignment) * h.alignment;
        }
        assert_eq!(next, h.data_len);
    }
});
