//! In-place commits, step by step: redo records that do not hold, crashes
//! between the steps, and the planner case by case.

use super::*;

/// A file, its record for a commit that grows its header by one block,
/// and the bytes the commit ends with.
fn setup(dir: &std::path::Path) -> (std::path::PathBuf, InPlaceRecord, Vec<u8>, Vec<u8>) {
    let json = br#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    let mut old = (json.len() as u64).to_le_bytes().to_vec();
    old.extend_from_slice(json);
    old.extend_from_slice(b"DATA");
    let path = dir.join("m.safetensors");
    std::fs::write(&path, &old).unwrap();
    let room = json.len() as u64 + 4096;
    let mut header = room.to_le_bytes().to_vec();
    header.extend_from_slice(
        br#"{"__metadata__":{"k":"v"},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
    );
    header.resize(8 + room as usize, b' ');
    let mut new = header.clone();
    new.extend_from_slice(b"DATA");
    let stat = FileStat::of(&File::open(&path).unwrap()).unwrap();
    let mut record = InPlaceRecord {
        folder: std::fs::canonicalize(dir).unwrap(),
        name: "m.safetensors".into(),
        before: stat,
        old_prefix: json.len() as u64,
        after_len: new.len() as u64,
        after_mtime: (stat.mtime.0 + 10, 0),
        header_file: "in-place-1-1-1.header".into(),
        inserted: 4096,
        header_write: 0,
        header_from: 0,
        header_len: 0,
        old_start: None,
        writes: Vec::new(),
        old_header_sum: sha256_hex(&[&old]),
        sum: String::new(),
    };
    record.seal(&header);
    std::fs::write(dir.join("staging").join(&record.header_file), &header).unwrap();
    (path, record, old, new)
}

fn can_insert(dir: &std::path::Path) -> bool {
    let f = File::open(dir).unwrap();
    crate::source::local::inserts_blocks(&f) == Some(4096)
}

#[test]
fn a_commit_killed_while_writing_the_header_is_not_inserted_twice() {
    let dir = tempfile::tempdir().unwrap();
    if !can_insert(dir.path()) {
        return; // (tmpfs and others: nothing to insert)
    }
    std::fs::create_dir(dir.path().join("staging")).unwrap();
    let (path, record, _, new) = setup(dir.path());
    // Killed mid-header: inserted (and recorded so), marker at the start,
    // the page with the moved marker already overwritten by header bytes.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    file.write_all_at(&IN_PLACE_MARKER, 0).unwrap();
    crate::source::local::insert_range(&file, 4096).unwrap();
    std::fs::write(dir.path().join("staging").join(record.inserted_flag()), b"").unwrap();
    file.write_all_at(&IN_PLACE_MARKER, 0).unwrap();
    file.write_all_at(&new[4090..4110], 4090).unwrap();
    drop(file);
    let staging = Folder::open(&dir.path().join("staging")).unwrap();
    let note = record.complete(&staging).unwrap();
    assert!(note.is_some());
    assert_eq!(std::fs::read(&path).unwrap(), new);
    // And again (a crash during the recovery): the same file.
    record.complete(&staging).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), new);
}

#[test]
fn a_commit_killed_before_its_marker_is_completed_and_a_changed_file_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    if !can_insert(dir.path()) {
        return;
    }
    std::fs::create_dir(dir.path().join("staging")).unwrap();
    let (path, record, old, new) = setup(dir.path());
    assert_eq!(std::fs::read(&path).unwrap(), old);
    let staging = Folder::open(&dir.path().join("staging")).unwrap();
    // Not started: rolled forward (the journal already names the new version).
    record.complete(&staging).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), new);
    let st = FileStat::of(&File::open(&path).unwrap()).unwrap();
    assert_eq!(st.mtime, record.after_mtime);
    // Done: nothing to do.
    assert_eq!(record.complete(&staging).unwrap(), None);
    // Changed by another program since: left alone, and said so.
    std::fs::write(&path, b"someone else's bytes").unwrap();
    let other = record.complete(&staging);
    assert!(other.is_err());
    assert_eq!(std::fs::read(&path).unwrap(), b"someone else's bytes");
}

#[test]
fn recovery_reads_a_padded_staging_file_from_its_pad() {
    let dir = tempfile::tempdir().unwrap();
    if !can_insert(dir.path()) {
        return;
    }
    std::fs::create_dir(dir.path().join("staging")).unwrap();
    let (path, mut record, old, new) = setup(dir.path());
    let header_len = new.len() - 4;
    // The tensor's new bytes, 1234 bytes into their staging file (a hole before).
    let mut padded = vec![0u8; 1234];
    padded.extend_from_slice(b"NEWD");
    std::fs::write(dir.path().join("staging").join("s1+1234"), &padded).unwrap();
    // And one whose bytes past its pad are fewer than its write.
    let mut short = vec![9u8; 1234];
    short.extend_from_slice(b"NE");
    std::fs::write(dir.path().join("staging").join("s2+1234"), &short).unwrap();
    let header = std::fs::read(dir.path().join("staging").join(&record.header_file)).unwrap();
    let staging = Folder::open(&dir.path().join("staging")).unwrap();
    let mut short_record = record.clone();
    short_record.writes = vec![RangeWrite {
        at: header_len as u64,
        len: 4,
        from: WriteFrom::Staged {
            file: "s2+1234".into(),
            offset: 0,
        },
    }];
    short_record.seal(&header);
    let e = short_record
        .complete(&staging)
        .expect_err("short past its pad");
    assert!(e.0.to_string().contains("holds 2 bytes"), "{}", e.0);
    assert_eq!(std::fs::read(&path).unwrap(), old);
    record.writes = vec![RangeWrite {
        at: header_len as u64,
        len: 4,
        from: WriteFrom::Staged {
            file: "s1+1234".into(),
            offset: 0,
        },
    }];
    record.seal(&header);
    record.complete(&staging).unwrap();
    let mut want = new[..header_len].to_vec();
    want.extend_from_slice(b"NEWD");
    assert_eq!(std::fs::read(&path).unwrap(), want);
}

#[test]
fn recovery_writes_the_zeros_a_record_names() {
    let dir = tempfile::tempdir().unwrap();
    if !can_insert(dir.path()) {
        return;
    }
    std::fs::create_dir(dir.path().join("staging")).unwrap();
    let (path, mut record, _, new) = setup(dir.path());
    let header_len = new.len() - 4;
    let header = std::fs::read(dir.path().join("staging").join(&record.header_file)).unwrap();
    let staging = Folder::open(&dir.path().join("staging")).unwrap();
    // The padding after a tensor placed over another's bytes: zeroed.
    record.writes = vec![RangeWrite {
        at: header_len as u64 + 1,
        len: 2,
        from: WriteFrom::Zeros,
    }];
    record.seal(&header);
    record.complete(&staging).unwrap();
    let mut want = new[..header_len].to_vec();
    want.extend_from_slice(b"D\0\0A");
    assert_eq!(std::fs::read(&path).unwrap(), want);
}

#[test]
fn a_record_that_does_not_hold_is_not_applied_and_the_file_is_left_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("staging")).unwrap();
    let (path, record, old, new) = setup(dir.path());
    let header = &new[..new.len() - 4];
    let staging = Folder::open(&dir.path().join("staging")).unwrap();
    std::fs::write(dir.path().join("staging").join("short"), b"xy").unwrap();
    let data_at = header.len() as u64;
    type Tamper = Box<dyn Fn(&mut InPlaceRecord)>;
    let tampered: Vec<(&str, Tamper)> = vec![
        (
            "a write far past the end",
            Box::new(move |r| {
                r.writes = vec![RangeWrite {
                    at: 1 << 40,
                    len: 4,
                    from: WriteFrom::Here { offset: 4096 + 8 },
                }];
            }),
        ),
        (
            "a copy from past the old data",
            Box::new(move |r| {
                r.writes = vec![RangeWrite {
                    at: data_at,
                    len: 4,
                    from: WriteFrom::Here { offset: 1 << 30 },
                }];
            }),
        ),
        (
            "a new length the header does not describe",
            Box::new(move |r| r.after_len += 4096),
        ),
        (
            "a file of a length no step of the commit leaves",
            Box::new(move |r| r.before.len += 1 << 20),
        ),
        (
            "a staging file shorter than its write",
            Box::new(move |r| {
                r.writes = vec![RangeWrite {
                    at: data_at,
                    len: 4,
                    from: WriteFrom::Staged {
                        file: "short".into(),
                        offset: 0,
                    },
                }];
            }),
        ),
        (
            "a staging file by a path",
            Box::new(move |r| {
                r.writes = vec![RangeWrite {
                    at: data_at,
                    len: 4,
                    from: WriteFrom::Staged {
                        file: "../short".into(),
                        offset: 0,
                    },
                }];
            }),
        ),
    ];
    for (what, change) in &tampered {
        let mut r = record.clone();
        change(&mut r);
        // Sealed again (as whoever changed it could), and not: both refused.
        let unsealed = r.clone();
        r.seal(header);
        for r in [r, unsealed] {
            let e = r.complete(&staging).expect_err(what);
            assert!(e.0.to_string().contains("does not hold"), "{what}: {}", e.0);
            assert_eq!(
                std::fs::read(&path).unwrap(),
                old,
                "{what}: the file changed"
            );
        }
    }
    // Names that are not plain (a path out of the folder, a relative
    // folder, a header file elsewhere) are refused before anything is read.
    type Rename = Box<dyn Fn(&mut InPlaceRecord)>;
    let renamed: Vec<Rename> = vec![
        Box::new(|r| r.name = "../m.safetensors".into()),
        Box::new(|r| r.name = "x/m.safetensors".into()),
        Box::new(|r| r.name = String::new()),
        Box::new(|r| r.name = ".".into()),
        Box::new(|r| r.name = "..".into()),
        Box::new(|r| r.folder = "relative".into()),
        Box::new(|r| r.header_file = "../in-place.header".into()),
    ];
    for change in &renamed {
        let mut r = record.clone();
        change(&mut r);
        r.seal(header);
        let e = r.complete(&staging).expect_err("not plain");
        assert!(
            e.0.to_string().contains("not a plain name"),
            "{r:?}: {}",
            e.0
        );
        assert_eq!(std::fs::read(&path).unwrap(), old);
    }
    // A header file cut short: its checksum no longer matches.
    std::fs::write(
        dir.path().join("staging").join(&record.header_file),
        &header[..header.len() - 1],
    )
    .unwrap();
    let e = record.complete(&staging).expect_err("cut short");
    assert!(
        e.0.to_string().contains("does not hold") || e.0.to_string().contains("without a header"),
        "{}",
        e.0
    );
    assert_eq!(std::fs::read(&path).unwrap(), old);
}

/// The planner, case by case: which edits it writes in place, where, and
/// why it refuses the others (a planner that falls back to a rewrite, or
/// places bytes elsewhere, fails here).
mod planner {
    use super::*;
    use crate::format::Dtype;
    use crate::source::StagingDir;
    use crate::source::{Bytes, SourceFile};

    struct Case {
        _dir: tempfile::TempDir,
        source: Arc<SourceFile>,
        staging: Arc<StagingDir>,
        data_start: u64,
        len: u64,
    }

    /// a 16, b 32, c 16, d 8 bytes (U8), a header with 400 bytes of room.
    fn case() -> Case {
        case_of(&[("a", 16), ("b", 32), ("c", 16), ("d", 8)])
    }

    /// Tensors of these names and sizes (U8, byte k of tensor i is i + 1),
    /// in this order, a header with 400 bytes of room.
    fn case_of(sizes: &[(&str, usize)]) -> Case {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<Vec<u8>> = (0..sizes.len())
            .map(|i| vec![i as u8 + 1; sizes[i].1])
            .collect();
        let tensors: Vec<(&str, &[u8])> = (0..sizes.len())
            .map(|i| (sizes[i].0, data[i].as_slice()))
            .collect();
        let (_, file) = crate::checkpoint::explore::checkpoint(&tensors, "v0", 400);
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, &file).unwrap();
        let source = Arc::new(SourceFile::open(&path).unwrap());
        let parent = Arc::new(Folder::open(dir.path()).unwrap());
        let staging = Arc::new(StagingDir::create(parent, "m.safetensors").unwrap());
        Case {
            _dir: dir,
            source,
            staging,
            data_start: PREFIX_LEN + 400,
            len: file.len() as u64,
        }
    }

    enum In {
        Old(u32),
        /// Source tensor i, retyped (same bytes).
        OldAs(u32, Dtype),
        New(usize),
    }

    fn plan(
        c: &Case,
        new: &[(&str, In)],
        metadata: Option<&str>,
        held: &[bool],
        block: Option<u64>,
    ) -> Result<InPlaceLayout, crate::checkpoint::Declined> {
        let old = c.source.header();
        let mut shapes = Vec::new();
        let mut dtypes = Vec::new();
        let mut inputs = Vec::new();
        for (_, input) in new {
            dtypes.push(Dtype::U8);
            match input {
                In::Old(i) => {
                    shapes.push(vec![old.tensors.nbytes(*i as usize)]);
                    inputs.push(Bytes::Source(c.source.clone(), *i));
                }
                In::OldAs(i, dtype) => {
                    shapes.push(vec![old.tensors.nbytes(*i as usize) * 8 / dtype.bits()]);
                    *dtypes.last_mut().unwrap() = *dtype;
                    inputs.push(Bytes::Source(c.source.clone(), *i));
                }
                In::New(n) => {
                    shapes.push(vec![*n as u64]);
                    let staged = c.staging.file_with(&vec![9u8; *n]).unwrap();
                    inputs.push(Bytes::Staged(staged));
                }
            }
        }
        let names: Vec<&str> = new.iter().map(|(n, _)| *n).collect();
        let meta: Option<crate::format::Metadata> =
            metadata.map(|v| [("k".to_string(), v.to_string())].into());
        let spec = |k: usize| (names[k], dtypes[k], shapes[k].as_slice());
        layout(
            &c.source,
            new.len(),
            spec,
            &inputs,
            &crate::format::writer::Safetensors {
                metadata: meta.as_ref(),
            },
            held,
            held,
            block,
        )
    }

    const NONE_HELD: [bool; 4] = [false; 4];

    /// The plan of `new`, the metadata as it was, nothing held, nothing inserted.
    fn planned(c: &Case, new: &[(&str, In)]) -> InPlaceLayout {
        let none = vec![false; c.source.header().tensors.len()];
        plan(c, new, Some("v0"), &none, None).unwrap()
    }

    /// Why `new` cannot be laid out in place while `held` is read.
    fn declined(c: &Case, new: &[(&str, In)], held: &[bool]) -> crate::checkpoint::Declined {
        plan(c, new, Some("v0"), held, None).err().unwrap()
    }
    use In::{New, Old, OldAs};

    #[test]
    fn header_edits_and_renames_write_the_header_alone() {
        let c = case();
        let l = plan(
            &c,
            &[("a", Old(0)), ("b", Old(1)), ("c", Old(2)), ("d", Old(3))],
            Some("v1"),
            &NONE_HELD,
            None,
        )
        .unwrap();
        assert!(l.writes.is_empty() && l.inserted == 0 && l.file_len == c.len);
        assert_eq!(l.summary, "header");
        let l = planned(
            &c,
            &[("z", Old(0)), ("b", Old(1)), ("c", Old(2)), ("d", Old(3))],
        );
        assert!(l.writes.is_empty() && l.file_len == c.len);
        assert_eq!(
            l.layout.tensors.get(0).name,
            "z",
            "the renamed tensor keeps its place"
        );
    }

    #[test]
    fn new_bytes_of_a_tensors_size_overwrite_it_where_it_is() {
        let c = case();
        let l = planned(
            &c,
            &[("a", Old(0)), ("b", New(32)), ("c", Old(2)), ("d", Old(3))],
        );
        assert_eq!(l.writes.len(), 1);
        assert_eq!(
            (l.writes[0].0.at, l.writes[0].0.len),
            (c.data_start + 16, 32)
        );
        assert_eq!(l.summary, "header, 1 tensor overwritten");
        assert_eq!(l.file_len, c.len);
        // A new tensor takes the place of a removed one of its size.
        let l = planned(
            &c,
            &[("e", New(16)), ("b", Old(1)), ("c", Old(2)), ("d", Old(3))],
        );
        assert_eq!((l.writes[0].0.at, l.writes[0].0.len), (c.data_start, 16));
        assert_eq!(l.file_len, c.len);
    }

    #[test]
    fn appends_and_tail_drops_change_only_the_end() {
        let c = case();
        let l = planned(
            &c,
            &[
                ("a", Old(0)),
                ("b", Old(1)),
                ("c", Old(2)),
                ("d", Old(3)),
                ("e", New(40)),
            ],
        );
        assert_eq!((l.writes[0].0.at, l.writes[0].0.len), (c.len, 40));
        assert_eq!(l.file_len, c.len + 40);
        assert_eq!(l.summary, "header, 1 tensor appended");
        let l = planned(&c, &[("a", Old(0)), ("b", Old(1)), ("c", Old(2))]);
        assert!(l.writes.is_empty());
        assert_eq!(l.file_len, c.len - 8);
        assert_eq!(l.summary, "header, 1 tensor dropped at the end");
        // A copy of a tensor goes at the end, copied from where it is.
        let l = planned(
            &c,
            &[
                ("a", Old(0)),
                ("a2", Old(0)),
                ("b", Old(1)),
                ("c", Old(2)),
                ("d", Old(3)),
            ],
        );
        assert_eq!(l.writes.len(), 1);
        assert_eq!(
            l.writes[0].0.from,
            WriteFrom::Here {
                offset: c.data_start
            }
        );
        assert_eq!((l.writes[0].0.at, l.file_len), (c.len, c.len + 16));
    }

    #[test]
    fn a_hole_is_filled_exactly_by_the_tensors_moved_from_the_end() {
        // Two layers of (w 16, b 8) and a norm; layer 0 dropped: layer 1's
        // tensors move into its place, the norm stays, the end is cut.
        let c = case_of(&[("0.w", 16), ("0.b", 8), ("n", 4), ("1.w", 16), ("1.b", 8)]);
        let l = planned(&c, &[("n", Old(2)), ("1.w", Old(3)), ("1.b", Old(4))]);
        let ds = c.data_start;
        let mut writes: Vec<_> = l
            .writes
            .iter()
            .map(|(w, _)| (w.at, w.len, w.from.clone()))
            .collect();
        writes.sort_by_key(|w| w.0);
        assert_eq!(
            writes,
            vec![
                (ds, 16, WriteFrom::Here { offset: ds + 28 }),
                (ds + 16, 8, WriteFrom::Here { offset: ds + 44 }),
            ]
        );
        assert_eq!(l.file_len, c.len - 24);
        assert_eq!(
            l.summary,
            "header, 2 tensors dropped, 2 tensors moved up from the end"
        );
        let names: Vec<_> = l
            .layout
            .tensors
            .iter()
            .map(|t| (t.name.to_string(), t.data_offsets))
            .collect();
        assert_eq!(
            names,
            [("1.w", (0, 16)), ("1.b", (16, 24)), ("n", (24, 28))]
                .map(|(n, o)| (n.to_string(), o))
                .to_vec()
        );
        // 0.w alone (16): 1.w would straddle the new end (36); a tensor at
        // the end still read; or new bytes to append: refused.
        let e = declined(
            &c,
            &[
                ("0.b", Old(1)),
                ("n", Old(2)),
                ("1.w", Old(3)),
                ("1.b", Old(4)),
            ],
            &[false; 5],
        );
        assert!(e.0.to_string().contains("\"0.w\" leaves a hole"), "{e}");
        let e = declined(
            &c,
            &[("n", Old(2)), ("1.w", Old(3)), ("1.b", Old(4))],
            &[false, false, false, false, true],
        );
        assert!(e.0.to_string().contains("leaves a hole"), "{e}");
        let e = declined(
            &c,
            &[
                ("n", Old(2)),
                ("1.w", Old(3)),
                ("1.b", Old(4)),
                ("z", New(4)),
            ],
            &[false; 5],
        );
        assert!(e.0.to_string().contains("leaves a hole"), "{e}");
    }

    #[test]
    fn a_tensor_moved_into_a_hole_keeps_its_alignment() {
        // h (8) dropped: m (8, at 16) fills it at 4, fine for bytes, not
        // for an F64, whose readers need it at a multiple of 8.
        let c = case_of(&[("a", 4), ("h", 8), ("t", 4), ("m", 8)]);
        let keep = |m: In| [("a", Old(0)), ("t", Old(2)), ("m", m)];
        let l = plan(&c, &keep(Old(3)), Some("v0"), &[false; 4], None).unwrap();
        assert_eq!(l.writes[0].0.at, c.data_start + 4);
        let e = declined(&c, &keep(OldAs(3, Dtype::F64)), &[false; 4]);
        assert!(e.0.to_string().contains("\"h\" leaves a hole"), "{e}");
    }

    #[test]
    fn holes_held_bytes_and_foreign_bytes_are_refused_with_the_reason() {
        let c = case();
        // c's hole (16) is filled by half: d (8) moves into it, the end is cut.
        let l = planned(&c, &[("a", Old(0)), ("b", Old(1)), ("d", Old(3))]);
        assert_eq!(l.file_len, c.len - 16);
        assert_eq!(l.writes.len(), 1);
        // a's (16) is not: c (16) would straddle the new end.
        let e = declined(
            &c,
            &[("b", Old(1)), ("c", Old(2)), ("d", Old(3))],
            &NONE_HELD,
        );
        assert!(e.0.to_string().contains("\"a\" leaves a hole"), "{e}");
        let e = declined(
            &c,
            &[("a", Old(0)), ("b", New(8)), ("c", Old(2)), ("d", Old(3))],
            &NONE_HELD,
        );
        assert!(e.0.to_string().contains("\"b\" leaves a hole"), "{e}");
        let held = [false, true, false, false];
        let e = declined(
            &c,
            &[("a", Old(0)), ("b", New(32)), ("c", Old(2)), ("d", Old(3))],
            &held,
        );
        assert!(e.0.to_string().contains("still read"), "{e}");
        // Held bytes at the end are not cut either.
        let held = [false, false, false, true];
        let e = declined(&c, &[("a", Old(0)), ("b", Old(1)), ("c", Old(2))], &held);
        assert!(e.0.to_string().contains("still read"), "{e}");
    }

    #[test]
    fn a_header_past_its_room_grows_by_whole_blocks_or_is_refused() {
        let c = case();
        let big = "x".repeat(600);
        let all = [("a", Old(0)), ("b", Old(1)), ("c", Old(2)), ("d", Old(3))];
        let e = plan(&c, &all, Some(&big), &NONE_HELD, None).err().unwrap();
        assert!(e.0.to_string().contains("cannot insert blocks"), "{e}");
        let l = plan(&c, &all, Some(&big), &NONE_HELD, Some(4096)).unwrap();
        // The JSON (about 900 bytes) and room to spare (a quarter of it, at
        // least 64 KiB), past the 400 there: 64 KiB and a block, in whole blocks.
        let grown = (64 << 10) + 4096;
        assert_eq!(l.inserted, grown);
        assert_eq!(l.file_len, c.len + grown);
        assert_eq!(l.summary, "header grown by 68 KiB at the start");
        assert_eq!(l.layout.header.len() as u64 - PREFIX_LEN, 400 + grown);
        // Written: up to the end of the old JSON (moved by the insertion), not
        // the spaces after it.
        assert_eq!(l.header_write, grown + c.source.header_json_end());
    }
}
