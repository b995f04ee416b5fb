#![no_main]
//! Any bytes: the GGUF reader answers Ok or Err, never panics, and what it
//! accepts holds together (tensors inside the file, contiguous offsets). Read
//! from a prefix (a remote object's first bytes, `parse_prefix`), it gives the
//! same verdict and header as from the whole file, or asks for more bytes.

use libfuzzer_sys::fuzz_target;
use stfs::format::gguf::{PrefixError, parse, parse_prefix};

fuzz_target!(|input: &[u8]| {
    // The first two bytes choose where the prefix ends.
    let (cut, data) = match input {
        [a, b, rest @ ..] => (u16::from_le_bytes([*a, *b]) as usize, rest),
        _ => return,
    };
    let whole = parse(data);
    if let Ok(h) = &whole {
        let mut next = 0;
        for t in &h.tensors {
            assert_eq!(t.offset, next);
            assert!(h.data_start + t.offset + t.nbytes <= data.len() as u64);
            next += t.nbytes.div_ceil(h.alignment) * h.alignment;
        }
        assert_eq!(next, h.data_len);
    }
    let prefix = &data[..cut.min(data.len())];
    match (parse_prefix(prefix, data.len() as u64), &whole) {
        // (Compared as printed: a NaN value is not equal to itself.)
        (Ok(p), Ok(h)) => assert_eq!(
            format!("{:?}", (&p.kvs, &p.tensors, p.data_start)),
            format!("{:?}", (&h.kvs, &h.tensors, h.data_start))
        ),
        (Err(PrefixError::Refused(p)), Err(h)) => assert_eq!(&p, h),
        (Err(PrefixError::NeedsMore), _) => assert!(prefix.len() < data.len()),
        (p, h) => panic!("prefix of {} bytes: {p:?}, whole file: {h:?}", prefix.len()),
    }
});
