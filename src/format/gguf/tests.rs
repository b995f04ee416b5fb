use super::*;

/// A GGUF file: keys (raw values given with their type id), then
/// tensors (name, ne, type id, offset), padded, then `data` bytes.
pub(crate) fn file(
    version: u32,
    kvs: &[(&str, i32, Vec<u8>)],
    tensors: &[(&str, &[i64], i32, u64)],
    alignment: u64,
    data: usize,
) -> Vec<u8> {
    let mut f = b"GGUF".to_vec();
    f.extend(version.to_le_bytes());
    f.extend((tensors.len() as i64).to_le_bytes());
    f.extend((kvs.len() as i64).to_le_bytes());
    let string = |f: &mut Vec<u8>, s: &[u8]| {
        f.extend((s.len() as u64).to_le_bytes());
        f.extend(s);
    };
    for (k, ty, v) in kvs {
        string(&mut f, k.as_bytes());
        f.extend(ty.to_le_bytes());
        f.extend(v);
    }
    for (name, ne, ty, offset) in tensors {
        string(&mut f, name.as_bytes());
        f.extend((ne.len() as u32).to_le_bytes());
        for n in *ne {
            f.extend(n.to_le_bytes());
        }
        f.extend(ty.to_le_bytes());
        f.extend(offset.to_le_bytes());
    }
    f.resize(f.len().div_ceil(alignment as usize) * alignment as usize, 0);
    f.resize(f.len() + data, 7);
    f
}

fn str_value(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend(s.as_bytes());
    v
}

#[test]
fn reads_keys_tensors_and_block_sizes() {
    let mut tokens = 8i32.to_le_bytes().to_vec(); // an array of strings
    tokens.extend(2u64.to_le_bytes());
    tokens.extend(str_value("<s>"));
    tokens.extend(str_value("</s>"));
    let f = file(
        3,
        &[
            ("general.name", 8, str_value("tiny")),
            ("tokenizer.ggml.tokens", 9, tokens),
            (
                "tokenizer.ggml.eos_token_id",
                4,
                2u32.to_le_bytes().to_vec(),
            ),
        ],
        // Q4_K: 144 bytes per 256 elements; F32 [3] padded to 32.
        &[("blk.0.w", &[512, 2], 12, 0), ("b", &[3], 0, 576)],
        32,
        576 + 12,
    );
    let h = parse(&f).unwrap();
    assert_eq!((h.version, h.alignment, h.tensors.len()), (3, 32, 2));
    assert_eq!(h.tensors[0].nbytes, 2 * 2 * 144);
    assert_eq!(h.tensors[0].shape(), vec![2, 512]);
    assert_eq!(h.tensors[0].ggml_type.name(), "Q4_K");
    assert_eq!(h.data_start % 32, 0);
    assert_eq!(h.data_len, 576 + 32);
    assert_eq!(show_value(&h.kvs[0].1), "tiny");
    assert!(matches!(&h.kvs[1].1, Value::Array(a) if a.len == 2 && a.item == ValueType::String));
    assert_eq!(show_value(&h.kvs[2].1), "2");
}

#[test]
fn refuses_what_ggml_refuses() {
    let ok = |kvs: &[(&str, i32, Vec<u8>)], tensors: &[(&str, &[i64], i32, u64)]| {
        parse(&file(3, kvs, tensors, 32, 4096))
    };
    let rule = |r: Result<GgufHeader, GgufError>| r.unwrap_err().to_string();
    assert!(ok(&[], &[("a", &[4], 0, 0)]).is_ok());
    for v in [0u32, 1, 4, 0x0300_0000] {
        assert!(parse(&file(v, &[], &[], 32, 0)).is_err(), "version {v}");
    }
    assert!(
        rule(ok(
            &[("k", 4, vec![1, 0, 0, 0]), ("k", 4, vec![1, 0, 0, 0])],
            &[]
        ))
        .contains("twice")
    );
    assert!(rule(ok(&[("", 4, vec![1, 0, 0, 0])], &[])).contains("empty"));
    let mut nested = 9i32.to_le_bytes().to_vec();
    nested.extend(0u64.to_le_bytes());
    assert!(rule(ok(&[("k", 9, nested)], &[])).contains("nested"));
    assert!(
        rule(ok(
            &[("general.alignment", 4, 48u32.to_le_bytes().to_vec())],
            &[]
        ))
        .contains("power of two")
    );
    assert!(
        rule(ok(
            &[("general.alignment", 10, 64u64.to_le_bytes().to_vec())],
            &[]
        ))
        .contains("UINT32")
    );
    let long = "x".repeat(64);
    assert!(rule(ok(&[], &[(&long, &[4], 0, 0)])).contains("64 bytes"));
    assert!(ok(&[], &[(&long[..63], &[4], 0, 0)]).is_ok());
    assert!(rule(ok(&[], &[("a", &[4], 0, 0), ("a", &[4], 0, 32)])).contains("twice"));
    assert!(rule(ok(&[], &[("a", &[1, 1, 1, 1, 1], 0, 0)])).contains("5 dimensions"));
    assert!(rule(ok(&[], &[("a", &[-1], 0, 0)])).contains("negative"));
    assert!(rule(ok(&[], &[("a", &[i64::MAX, 2], 0, 0)])).contains("overflow"));
    for removed in [4, 5, 31, 36, 99, -1] {
        assert!(rule(ok(&[], &[("a", &[32], removed, 0)])).contains("unknown or was removed"));
    }
    assert!(rule(ok(&[], &[("a", &[100], 12, 0)])).contains("multiple of Q4_K's block of 256"));
    // Offsets: contiguous, each padded to the alignment.
    assert!(rule(ok(&[], &[("a", &[4], 0, 0), ("b", &[4], 0, 16)])).contains("contiguous"));
    assert!(rule(ok(&[], &[("a", &[4], 0, 8)])).contains("contiguous"));
    // Past the end of the file.
    assert!(rule(parse(&file(3, &[], &[("a", &[4096], 0, 0)], 32, 100))).contains("past the end"));
    // Strings past the end, and counts the file cannot hold.
    let mut cut = file(3, &[("general.name", 8, str_value("tiny"))], &[], 32, 0);
    cut.truncate(58); // inside the value "tiny"
    assert!(rule(parse(&cut)).contains("ends inside"));
    let mut huge = file(3, &[], &[], 32, 0);
    huge[8..16].copy_from_slice(&i64::MAX.to_le_bytes());
    assert!(rule(parse(&huge)).contains("cannot hold"));
    assert!(rule(parse(b"GGML")).contains("not a GGUF file"));
}

/// Every truncation, and every byte of a valid file set to each of a
/// few values: Ok or Err, never a panic, and what is accepted holds
/// together. (The fuzz target `parse_gguf` does the same at random.)
#[test]
fn bent_files_never_panic() {
    let mut tokens = 8i32.to_le_bytes().to_vec();
    tokens.extend(1u64.to_le_bytes());
    tokens.extend(str_value("a"));
    let f = file(
        3,
        &[
            ("general.alignment", 4, 64u32.to_le_bytes().to_vec()),
            ("t", 9, tokens),
        ],
        &[("w", &[32, 2], 8, 0), ("b", &[3], 0, 128)],
        64,
        128 + 12,
    );
    assert!(parse(&f).is_ok());
    for n in 0..f.len() {
        let _ = parse(&f[..n]);
    }
    for i in 0..f.len() {
        for v in [0u8, 1, 0x7f, 0x80, 0xff] {
            let mut g = f.clone();
            g[i] = v;
            if let Ok(h) = parse(&g) {
                let mut next = 0;
                for t in &h.tensors {
                    assert_eq!(t.offset, next);
                    assert!(h.data_start + t.offset + t.nbytes <= g.len() as u64);
                    next += t.nbytes.div_ceil(h.alignment) * h.alignment;
                }
            }
        }
    }
}

/// A remote object's header is read from its first bytes: each prefix
/// short of the tensor infos' end asks for more, each that holds them
/// gives the header the whole file gives; a refusal is the whole file's.
#[test]
fn prefixes_ask_for_more_or_agree_with_the_whole_file() {
    let f = file(
        3,
        &[("general.name", 8, str_value("prefix"))],
        &[("w", &[32, 2], 8, 0), ("b", &[3], 0, 96)],
        32,
        96 + 12,
    );
    let whole = parse(&f).unwrap();
    for n in 0..=f.len() {
        match parse_prefix(&f[..n], f.len() as u64) {
            Ok(h) => {
                assert_eq!(
                    (h.kvs, h.tensors),
                    (whole.kvs.clone(), whole.tensors.clone())
                );
                assert_eq!(h.data_start, whole.data_start);
            }
            Err(PrefixError::NeedsMore) => assert!((n as u64) < whole.data_start, "{n}"),
            Err(PrefixError::Refused(e)) => panic!("prefix {n}: {e}"),
        }
    }
    // A file cut short is refused as the whole file is, not asked again.
    let cut = &f[..f.len() - 20];
    let e = parse(cut).unwrap_err();
    match parse_prefix(&cut[..40], cut.len() as u64) {
        Err(PrefixError::NeedsMore) => {}
        other => panic!("{other:?}"),
    }
    match parse_prefix(cut, cut.len() as u64) {
        Err(PrefixError::Refused(p)) => assert_eq!(p, e),
        other => panic!("{other:?}"),
    }
}

#[test]
fn every_type_has_a_block_and_removed_ids_have_none() {
    for id in 0..64u32 {
        let removed = [4, 5, 31, 32, 33, 36, 37, 38].contains(&id) || id > 42;
        assert_eq!(ggml_type(id).is_none(), removed, "id {id}");
    }
    assert!(
        GGML_TYPES
            .iter()
            .all(|t| t.block() > 0 && t.block_bytes() > 0)
    );
}
