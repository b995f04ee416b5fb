use std::collections::BTreeMap;

use super::*;

/// A file: prefix, `json` unpadded, then `data_len` zero bytes.
fn file(json: &str, data_len: usize) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.resize(out.len() + data_len, 0);
    out
}

/// A file that says its header is `header_len` bytes, followed by `rest`.
fn prefixed(header_len: u64, rest: &[u8]) -> Vec<u8> {
    [&header_len.to_le_bytes()[..], rest].concat()
}

fn err(bytes: &[u8]) -> FormatError {
    Header::parse(bytes).expect_err("must be refused")
}

#[test]
fn every_dtype_parses_with_its_size() {
    for d in Dtype::ALL {
        // 16 elements is a whole number of bytes for every dtype.
        let n = (16 * d.bits() / 8) as usize;
        let json = format!(r#"{{"t":{{"dtype":"{d}","shape":[4,4],"data_offsets":[0,{n}]}}}}"#);
        let h = Header::parse(&file(&json, n)).unwrap();
        let t = h.get("t").unwrap();
        assert_eq!((t.dtype, t.nbytes()), (d, n as u64));
    }
}

#[test]
fn scalars_zero_size_and_empty_files() {
    let json = r#"{"s":{"dtype":"F64","shape":[],"data_offsets":[0,8]},"z":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]}}"#;
    let h = Header::parse(&file(json, 8)).unwrap();
    assert_eq!(h.get("s").unwrap().shape, Vec::<u64>::new());
    assert_eq!(h.get("z").unwrap().nbytes(), 0);
    assert_eq!(h.data_len(), 8);

    let h = Header::parse(&file("{}", 0)).unwrap();
    assert!(h.tensors.is_empty() && h.metadata.is_none());
    assert_eq!(h.data_start(), 10);
}

#[test]
fn names_with_slashes_unicode_escapes_and_empty() {
    let json = r#"{"a/b.c":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"ünï€😀":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"q\"\\\n\u0000":{"dtype":"U8","shape":[1],"data_offsets":[2,3]},"":{"dtype":"U8","shape":[1],"data_offsets":[3,4]}}"#;
    let h = Header::parse(&file(json, 4)).unwrap();
    for name in ["a/b.c", "ünï€😀", "q\"\\\n\0", ""] {
        assert!(h.get(name).is_some(), "{name:?}");
    }
}

#[test]
fn metadata_is_read_and_null_means_absent() {
    let json = r#"{"__metadata__":{"format":"pt","b":"2"}}"#;
    let h = Header::parse(&file(json, 0)).unwrap();
    assert_eq!(h.metadata.unwrap()["format"], "pt");
    let h = Header::parse(&file(r#"{"__metadata__":null}"#, 0)).unwrap();
    assert!(h.metadata.is_none());
}

#[test]
fn lenient_cases_of_the_reference_are_kept() {
    // Padding whitespace, unknown fields, a repeated tensor (last wins).
    let json = r#"  {"t":{"dtype":"U8","shape":[9],"data_offsets":[0,9]},"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"extra":[1]}}   "#;
    let h = Header::parse(&file(json, 2)).unwrap();
    assert_eq!(h.tensors.len(), 1);
    assert_eq!(h.get("t").unwrap().shape, vec![2]);
}

#[test]
fn too_short() {
    assert_eq!(err(b"\x01\x00"), FormatError::TooShort { file_len: 2 });
    assert_eq!(err(b""), FormatError::TooShort { file_len: 0 });
}

#[test]
fn header_too_large() {
    let header_len = 100_000_001;
    assert_eq!(
        err(&prefixed(header_len, b"{}")),
        FormatError::HeaderTooLarge { header_len }
    );
    assert!(matches!(
        err(&u64::MAX.to_le_bytes()),
        FormatError::HeaderTooLarge { .. }
    ));
}

#[test]
fn header_truncated() {
    assert_eq!(
        err(&prefixed(50, b"{}")),
        FormatError::HeaderTruncated {
            header_len: 50,
            file_len: 10
        }
    );
}

#[test]
fn header_not_utf8() {
    assert_eq!(
        err(&prefixed(4, b"{\xff}}")),
        FormatError::HeaderNotUtf8 { at: 1 }
    );
}

#[test]
fn header_json_errors() {
    for json in [
        "",
        "[]",
        "{",
        "{}x",
        "null",
        r#"{"__metadata__":{"a":1}}"#,
        r#"{"__metadata__":{},"__metadata__":{}}"#,
    ] {
        match err(&file(json, 0)) {
            FormatError::HeaderJson { tensor: None, .. } => {}
            other => panic!("{json}: {other:?}"),
        }
    }
    for json in [
        r#"{"t":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}"#,
        r#"{"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
        r#"{"t":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}"#,
        r#"{"t":{"dtype":"F32","data_offsets":[0,4]}}"#,
        r#"{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#,
        r#"{"t":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        r#"{"t":5}"#,
    ] {
        match err(&file(json, 4)) {
            FormatError::HeaderJson {
                tensor: Some(t),
                message,
            } => {
                assert_eq!(t, "t", "{json}: {message}")
            }
            other => panic!("{json}: {other:?}"),
        }
    }
}

#[test]
fn invalid_offsets() {
    let gap = r#"{"t":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#;
    assert_eq!(
        err(&file(gap, 2)),
        FormatError::InvalidOffsets {
            tensor: "t".into(),
            begin: 1,
            end: 2,
            expected_begin: 0
        }
    );
    let backwards = r#"{"t":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"u":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"v":{"dtype":"U8","shape":[1],"data_offsets":[4,3]}}"#;
    let e = err(&file(backwards, 4));
    assert_eq!(e.tensor(), Some("v"));
    assert!(e.to_string().contains("end before they begin"), "{e}");
    let overlap = r#"{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"u":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    assert!(matches!(
        err(&file(overlap, 4)),
        FormatError::InvalidOffsets { .. }
    ));
}

#[test]
fn overflow() {
    let json = r#"{"t":{"dtype":"U64","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#;
    assert!(
        matches!(err(&file(json, 0)), FormatError::Overflow { ref tensor, .. } if tensor == "t")
    );
    let json = r#"{"t":{"dtype":"U64","shape":[2305843009213693952],"data_offsets":[0,0]}}"#;
    assert!(matches!(err(&file(json, 0)), FormatError::Overflow { .. }));
}

#[test]
fn not_byte_aligned() {
    let json = r#"{"t":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#;
    assert_eq!(
        err(&file(json, 2)),
        FormatError::NotByteAligned {
            tensor: "t".into(),
            dtype: Dtype::F4,
            shape: vec![3]
        }
    );
    let json = r#"{"t":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}"#;
    assert!(Header::parse(&file(json, 3)).is_ok());
}

#[test]
fn size_mismatch_message_names_everything() {
    let json = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#;
    let e = err(&file(json, 4));
    assert_eq!(
        e.clone().in_file("m.safetensors").to_string(),
        "m.safetensors: tensor \"x\": data_offsets [0, 4] span 4 bytes but F32 [2] needs 8"
    );
    assert!(matches!(e, FormatError::SizeMismatch { needed: 8, .. }));
}

#[test]
fn length_mismatch() {
    let json = r#"{"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    assert!(matches!(
        err(&file(json, 3)),
        FormatError::LengthMismatch { data_len: 2, .. }
    ));
    assert!(matches!(
        err(&file(json, 1)),
        FormatError::LengthMismatch { .. }
    ));
    // Huge offsets must not overflow the length check.
    let json = format!(
        r#"{{"t":{{"dtype":"U8","shape":[{m}],"data_offsets":[0,{m}]}}}}"#,
        m = 1u64 << 60
    );
    assert!(matches!(
        err(&file(&json, 0)),
        FormatError::LengthMismatch { .. }
    ));
}

#[test]
fn read_from_file_matches_parse() {
    let json = r#"{"t":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#;
    let bytes = file(json, 3);
    let mut f = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut f, &bytes).unwrap();
    let h = Header::read(&f).unwrap().unwrap();
    assert_eq!(h.tensors, Header::parse(&bytes).unwrap().tensors);
    f.set_len(20).unwrap();
    assert!(matches!(
        Header::read(&f).unwrap(),
        Err(FormatError::HeaderTruncated { .. })
    ));
}

#[test]
fn serializer_orders_pads_and_round_trips() {
    let specs = vec![
        TensorSpec {
            name: "b".into(),
            dtype: Dtype::U8,
            shape: vec![3],
        },
        TensorSpec {
            name: "a".into(),
            dtype: Dtype::U8,
            shape: vec![1],
        },
        TensorSpec {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![2, 2],
        },
        TensorSpec {
            name: "z".into(),
            dtype: Dtype::BOOL,
            shape: vec![],
        },
    ];
    let mut meta = Metadata::new();
    meta.insert("k".into(), "v\"".into());
    meta.insert("a".into(), "1".into());
    let l = layout(&specs, Some(&meta)).unwrap();
    let names: Vec<_> = l.tensors.iter().map(|t| t.name).collect();
    assert_eq!(names, ["w", "a", "b", "z"]);
    assert_eq!(l.source_index, [2, 1, 0, 3]);
    assert_eq!(l.header.len() % 8, 0);
    let json = std::str::from_utf8(&l.header[8..]).unwrap();
    assert!(json.starts_with(r#"{"__metadata__":{"a":"1","k":"v\""},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"a""#), "{json}");
    let mut bytes = l.header.clone();
    bytes.resize(l.file_len() as usize, 0);
    let h = Header::parse(&bytes).unwrap();
    assert_eq!(h.metadata.as_ref(), Some(&meta));
    assert_eq!(h.tensors, l.tensors);
}

#[test]
fn serializer_refuses_duplicates_and_bad_sizes() {
    let t = |name: &str, dtype, shape: Vec<u64>| TensorSpec {
        name: name.into(),
        dtype,
        shape,
    };
    assert!(matches!(
        layout(
            &[t("a", Dtype::U8, vec![1]), t("a", Dtype::U8, vec![2])],
            None
        ),
        Err(FormatError::DuplicateName { .. })
    ));
    assert!(matches!(
        layout(&[t("a", Dtype::F4, vec![1])], None),
        Err(FormatError::NotByteAligned { .. })
    ));
    assert!(matches!(
        layout(
            &[
                t("a", Dtype::U8, vec![u64::MAX]),
                t("b", Dtype::U8, vec![2])
            ],
            None
        ),
        Err(FormatError::Overflow { .. })
    ));
    let empty = layout(&[], None).unwrap();
    assert_eq!(&empty.header[8..], b"{}      ");
}

#[test]
fn shard_index_checks() {
    let one = file(
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        2,
    );
    let two = file(
        r#"{"b":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#,
        3,
    );
    let (h1, h2) = (Header::parse(&one).unwrap(), Header::parse(&two).unwrap());
    let shards: BTreeMap<String, &Header> = [
        ("m-1.safetensors".to_string(), &h1),
        ("m-2.safetensors".to_string(), &h2),
    ]
    .into();
    let good = index::parse_index(br#"{"metadata":{"total_size":5},"weight_map":{"a":"m-1.safetensors","b":"m-2.safetensors"}}"#).unwrap();
    assert_eq!(index::check_index(&good, &shards), Vec::<String>::new());
    let bad = index::parse_index(br#"{"metadata":{"total_size":6.0},"weight_map":{"a":"m-2.safetensors","c":"m-3.safetensors"}}"#).unwrap();
    let problems = index::check_index(&bad, &shards);
    assert_eq!(problems.len(), 5, "{problems:#?}");
    assert!(
        index::parse_index(b"{\"weight_map\":{\"a\":1}}")
            .unwrap_err()
            .to_string()
            .contains("\"a\"")
    );
    assert!(index::parse_index(b"[]").is_err());
}
