//! The cases: random runs against the model, and tool patterns always run.

use super::*;

/// `count` runs of ops drawn from `strategy` by `runner`, each given to `run`.
fn runs_of<S: Strategy<Value = Vec<Op>>>(
    runner: &mut proptest::test_runner::TestRunner,
    strategy: &S,
    count: usize,
    run: impl Fn(&[Op]),
) {
    use proptest::strategy::ValueTree;
    for _ in 0..count {
        run(&strategy.new_tree(runner).unwrap().current());
    }
}

/// The commits of this thread's runs by way, printed after `what`: (in
/// place, rewrites, headers grown, in place as the model predicted).
fn ways_counted(what: &str) -> (usize, usize, usize, usize) {
    let (in_place, rewrites, grown, predicted) = WAYS.with(|w| *w.borrow());
    println!(
        "{what}{in_place} commits in place ({grown} growing the header, {predicted} predicted by the model), {rewrites} rewrites"
    );
    (in_place, rewrites, grown, predicted)
}

/// The model's random runs take both ways of committing, many times each,
/// and each one's bytes are checked (`commit`).
#[test]
fn random_runs_commit_both_in_place_and_by_rewrite() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    for folder in [false, true] {
        let strategy = prop::collection::vec(op(1 + folder as usize), 1..30);
        runs_of(&mut runner, &strategy, 400, |ops| run(folder, ops));
    }
    let (in_place, rewrites, grown, predicted) = ways_counted("");
    assert!(
        in_place >= 10 && rewrites >= 10 && grown >= 3,
        "{in_place} in place ({grown} grown), {rewrites} rewrites"
    );
    let here = tempfile::tempfile().unwrap();
    if stfs::source::local::inserts_blocks(&here).is_some() {
        assert!(predicted >= 3, "{predicted} commits predicted in place");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(250))]

    #[test]
    fn file_mount_matches_the_model(ops in prop::collection::vec(op(1), 1..30)) {
        run(false, &ops);
    }

    #[test]
    fn folder_mount_matches_the_model(ops in prop::collection::vec(op(2), 1..30)) {
        run(true, &ops);
    }

    #[test]
    fn read_only_mount_matches_the_model(ops in prop::collection::vec(op(2), 1..12)) {
        run_with(true, true, &ops);
    }

    #[test]
    fn gguf_mount_matches_the_model(ops in prop::collection::vec(op_gguf(), 1..30)) {
        run_gguf(false, &ops);
    }

    #[test]
    fn read_only_gguf_mount_matches_the_model(ops in prop::collection::vec(op_gguf(), 1..12)) {
        run_gguf(true, &ops);
    }
}

/// GGUF runs commit both in place and by rewrite too, and edit keys in
/// every way, many times each.
#[test]
fn random_gguf_runs_commit_both_in_place_and_by_rewrite() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = prop::collection::vec(op_gguf(), 1..30);
    runs_of(&mut runner, &strategy, 300, |ops| run_gguf(false, ops));
    let (in_place, rewrites, grown, predicted) = ways_counted("GGUF: ");
    // (Most GGUF runs edit tensors or hold a problem before their first
    // commit: fewer grow the header than safetensors runs do.)
    assert!(
        in_place >= 10 && rewrites >= 10 && grown >= 1 && predicted >= 5,
        "{in_place} in place ({grown} grown, {predicted} predicted), {rewrites} rewrites"
    );
}

/// A chat template fixed as an editor saves it (a temp key renamed over
/// the key: the key keeps its type and place), a number set with `echo`,
/// a key removed; committed, then a crash after more edits loses none.
#[test]
fn gguf_keys_edited_as_tools_do_survive_commit_and_crash() {
    run_gguf(
        false,
        &[
            Op::KvWrite {
                key: 8,
                text: KvText::Str("{% for m in messages %}\n{{ m }}\n{% endfor %}\n"),
            },
            Op::KvRename {
                from: 8,
                to: 0,
                no_replace: false,
            },
            Op::KvWrite {
                key: 2,
                text: KvText::Int(255),
            },
            Op::KvUnlink(6),
            Op::Status,
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::KvWrite {
                key: 2,
                text: KvText::Int(300),
            },
            Op::KvWrite {
                key: 3,
                text: KvText::Int(70000),
            },
            Op::Remount,
            Op::Status,
            Op::KvWrite {
                key: 2,
                text: KvText::Int(1),
            },
            Op::CompactCommit,
        ],
    );
}

/// A key removed and made again under its name (a tool keeping a backup)
/// keeps its type; `__metadata__.json` gives a new key another type.
#[test]
fn gguf_key_types_follow_names_and_the_document() {
    run_gguf(
        false,
        &[
            // A name the file has not keeps the type its key had, whether
            // its file or the document removed it.
            Op::KvDocument(DocEdit::Put(8, KTy::I32, serde_json::json!(7))),
            Op::KvDocument(DocEdit::Drop(8)),
            Op::KvWrite {
                key: 8,
                text: KvText::Str("x"),
            },
            Op::KvWrite {
                key: 8,
                text: KvText::Int(-7),
            },
            Op::KvUnlink(8),
            Op::KvWrite {
                key: 8,
                text: KvText::Str("x"),
            },
            Op::Status,
            Op::KvWrite {
                key: 8,
                text: KvText::Int(-7),
            },
            Op::KvRename {
                from: 2,
                to: 9,
                no_replace: true,
            },
            Op::KvWrite {
                key: 2,
                text: KvText::Int(300),
            },
            Op::KvWrite {
                key: 2,
                text: KvText::Int(9),
            },
            Op::KvDocument(DocEdit::Put(8, KTy::ArrI32, serde_json::json!([1, 2]))),
            Op::KvDocument(DocEdit::Retype(0, KTy::U8)),
            Op::Status,
            Op::Commit {
                force: false,
                other_user: false,
            },
            // A name the file has keeps the file's type.
            Op::KvUnlink(8),
            Op::KvWrite {
                key: 8,
                text: KvText::Str("x"),
            },
            Op::Status,
        ],
    );
}

/// Tool patterns from docs/SEMANTICS.md, always run.
#[test]
fn install_unlinks_then_creates_and_the_meta_stays() {
    run(
        false,
        &[
            Op::SetMeta {
                dir: 0,
                name: 2,
                text: Text::Meta(0, vec![2]),
            },
            Op::Create {
                dir: 0,
                name: 2,
                exclusive: true,
            },
            Op::Unlink(data(0, 2)),
            Op::Create {
                dir: 0,
                name: 2,
                exclusive: true,
            },
            Op::Write {
                dir: 0,
                name: 2,
                offset: 0,
                data: vec![1, 2],
            },
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

#[test]
fn sed_renames_a_temp_file_over_the_meta() {
    run(
        false,
        &[
            Op::WriteJson {
                dir: 0,
                name: 2,
                text: Text::Meta(0, vec![4]),
            },
            Op::Rename {
                from: data(0, 2),
                to: meta(0, 1),
                no_replace: false,
            },
            Op::Truncate {
                dir: 0,
                name: 1,
                len: 4,
            },
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

#[test]
fn a_moved_tensor_takes_its_meta_across_shards() {
    run(
        true,
        &[
            Op::Open {
                file: data(0, 0),
                write: true,
                truncate: false,
            },
            Op::Rename {
                from: data(0, 0),
                to: data(1, 4),
                no_replace: true,
            },
            Op::HandleWrite(0, 0, vec![9]),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::HandleRead(0, 0, 10),
            Op::Fstat(0),
            Op::Discard,
        ],
    );
}

#[test]
fn a_replaced_source_refuses_until_forced() {
    run(
        false,
        &[
            Op::Truncate {
                dir: 0,
                name: 0,
                len: 3,
            },
            Op::Write {
                dir: 0,
                name: 0,
                offset: 0,
                data: vec![7],
            },
            Op::ReplaceSource {
                dir: 0,
                in_place: false,
            },
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::Commit {
                force: true,
                other_user: false,
            },
        ],
    );
}

#[test]
fn a_source_rewritten_in_place_fails_reads_not_listings() {
    run(
        true,
        &[
            Op::Rename {
                from: data(0, 0),
                to: data(1, 0),
                no_replace: false,
            },
            Op::ReplaceSource {
                dir: 0,
                in_place: true,
            },
            Op::Status,
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::Commit {
                force: true,
                other_user: false,
            },
            Op::Unlink(data(1, 0)),
            Op::Commit {
                force: true,
                other_user: false,
            },
        ],
    );
}

#[test]
fn discard_then_edit_then_commit() {
    run(
        false,
        &[
            Op::Rename {
                from: data(0, 0),
                to: data(0, 2),
                no_replace: false,
            },
            Op::Write {
                dir: 0,
                name: 1,
                offset: 0,
                data: vec![1],
            },
            Op::Discard,
            Op::Unlink(meta(0, 0)),
            Op::Status,
            Op::SetMeta {
                dir: 0,
                name: 0,
                text: Text::Meta(0, vec![3]),
            },
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

/// `ruby -i.bak -pe ... __metadata__.json`: open, rename to the backup,
/// create the file again, read the old descriptor, write the new one.
#[test]
fn ruby_in_place_keeps_the_old_metadata_readable() {
    run(
        false,
        &[
            Op::SetMetadata {
                dir: 0,
                text: Text::Metadata(Some(("format".into(), "pt".into()))),
            },
            Op::Open {
                file: metadata(0),
                write: false,
                truncate: false,
            },
            Op::Rename {
                from: metadata(0),
                to: data(0, 4),
                no_replace: false,
            },
            Op::SetMetadata {
                dir: 0,
                text: Text::Metadata(Some(("format".into(), "np".into()))),
            },
            Op::HandleRead(0, 0, 100),
            Op::Fstat(0),
            Op::Unlink(data(0, 4)),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::HandleRead(0, 0, 100),
        ],
    );
}

/// `ruby -i -pe ... x.meta.json`: open, unlink, create, read the old descriptor.
#[test]
fn ruby_in_place_keeps_the_old_meta_readable() {
    run(
        false,
        &[
            Op::Open {
                file: meta(0, 0),
                write: false,
                truncate: false,
            },
            Op::Unlink(meta(0, 0)),
            Op::SetMeta {
                dir: 0,
                name: 0,
                text: Text::Meta(0, vec![3]),
            },
            Op::HandleRead(0, 0, 200),
            Op::Fstat(0),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::HandleRead(0, 0, 200),
        ],
    );
}

/// A descriptor held across `os.replace` and `rm` of its tensor: reads and
/// fstat answer for the old file, before and after the commit.
#[test]
fn a_descriptor_outlives_its_name() {
    run(
        false,
        &[
            Op::Open {
                file: data(0, 1),
                write: false,
                truncate: false,
            },
            Op::Open {
                file: meta(0, 1),
                write: true,
                truncate: false,
            },
            Op::WriteJson {
                dir: 0,
                name: 2,
                text: Text::Meta(1, vec![1]),
            },
            Op::Rename {
                from: data(0, 2),
                to: data(0, 1),
                no_replace: false,
            },
            Op::Fstat(0),
            Op::HandleRead(0, 1, 3),
            Op::Rename {
                from: meta(0, 0),
                to: meta(0, 1),
                no_replace: false,
            },
            Op::HandleSetText(1, Text::Meta(0, vec![9])),
            Op::Fstat(1),
            Op::Close(1),
            Op::Unlink(data(0, 1)),
            Op::Commit {
                force: false,
                other_user: false,
            },
            Op::Fstat(0),
            Op::HandleRead(0, 0, 8),
        ],
    );
}

/// `mmv 'a' 'b'` plans both renames, then does the data's (which takes the
/// meta) and the meta's: the meta still answers at its old name.
#[test]
fn a_meta_renamed_after_its_data_follows_it() {
    run(
        true,
        &[
            Op::Rename {
                from: data(0, 0),
                to: data(0, 2),
                no_replace: false,
            },
            Op::Rename {
                from: meta(0, 0),
                to: meta(0, 2),
                no_replace: false,
            },
            Op::Rename {
                from: data(0, 1),
                to: data(1, 3),
                no_replace: false,
            },
            Op::Rename {
                from: meta(0, 1),
                to: meta(1, 3),
                no_replace: false,
            },
            Op::Status,
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

/// Commit and discard are the mounting user's; a crash gives back every edit.
#[test]
fn another_user_cannot_commit_and_a_crash_loses_nothing() {
    run(
        true,
        &[
            Op::SetMeta {
                dir: 0,
                name: 0,
                text: Text::Meta(0, vec![1, 3]),
            },
            Op::Rename {
                from: data(1, 2),
                to: data(0, 3),
                no_replace: false,
            },
            Op::SetMetadata {
                dir: 1,
                text: Text::Metadata(None),
            },
            Op::Commit {
                force: false,
                other_user: true,
            },
            Op::Remount,
            Op::Status,
            Op::Discard,
            Op::Write {
                dir: 0,
                name: 1,
                offset: 0,
                data: vec![1],
            },
            Op::Remount,
            Op::Commit {
                force: false,
                other_user: false,
            },
        ],
    );
}

// ---- convergence: the same files in any order ----

/// One copy of a file: stat, create (or open O_TRUNC if it exists, and
/// after an EEXIST), write in pieces, close.
#[derive(Debug, Clone)]
struct Copy {
    file: String,
    bytes: Vec<u8>,
    step: usize,
    fh: Option<(Ino, u64)>,
    exists: bool,
}

const PIECE: usize = 3;

impl Copy {
    fn done(&self) -> bool {
        self.step == usize::MAX
    }

    /// One step of `cp`; returns nothing, panics on an unexpected error.
    fn advance(&mut self, fs: &Fs) {
        match (self.step, self.fh) {
            (0, _) => {
                self.exists = fs.lookup(ROOT_INO, &self.file).is_ok();
                self.step = 1;
            }
            (1, None) => {
                let opened = if self.exists {
                    let ino = fs.lookup(ROOT_INO, &self.file).unwrap().ino;
                    fs.open(ino, true, true).map(|o| (ino, o.fh))
                } else {
                    match fs.create(ROOT_INO, &self.file, (true, true), 0o644) {
                        Ok((a, o)) => Ok((a.ino, o.fh)),
                        Err(e) => panic!("{}: create O_EXCL: {e}", self.file),
                    }
                };
                self.fh = Some(opened.unwrap());
                self.step = 2;
            }
            (k, Some((ino, fh))) => {
                let at = (k - 2) * PIECE;
                if at < self.bytes.len() {
                    let end = (at + PIECE).min(self.bytes.len());
                    fs.write(ino, fh, at as u64, &self.bytes[at..end]).unwrap();
                    self.step += 1;
                } else {
                    let flush = fs.flush(fh);
                    fs.release(fh).unwrap();
                    flush.unwrap();
                    self.step = usize::MAX;
                }
            }
            _ => unreachable!(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// `xargs -P cp`, `cp -r` twice at once, `tar x`: each file copied by
    /// one or two workers, in any order and interleaving, ends as one checkpoint.
    #[test]
    fn copies_in_any_order_converge(
        twice in any::<bool>(),
        schedule in prop::collection::vec(0usize..12, 200),
    ) {
        let tensors = copied();
        let (dir, fs) = empty_mount();
        let mut copies: Vec<Copy> = copy_set(&tensors)
            .into_iter()
            .flat_map(|(file, bytes)| {
                let c = Copy { file, bytes, step: 0, fh: None, exists: false };
                if twice { vec![c.clone(), c] } else { vec![c] }
            })
            .collect();
        let mut turns = schedule.into_iter().chain(std::iter::repeat(0));
        while copies.iter().any(|c| !c.done()) {
            let live: Vec<usize> = (0..copies.len()).filter(|&k| !copies[k].done()).collect();
            let k = live[turns.next().unwrap() % live.len()];
            // A second copier whose O_EXCL lost the race opens the file instead.
            if copies[k].step == 1 && !copies[k].exists
                && fs.lookup(ROOT_INO, &copies[k].file).is_ok()
            {
                if !twice {
                    panic!("{}: appeared before it was copied", copies[k].file);
                }
                copies[k].exists = true;
            }
            copies[k].advance(&fs);
        }
        fs.commit(Default::default(), 0).unwrap();
        let want = tensors_of(&write_file(&dir.path().join("want"), &tensors));
        let got = tensors_of(&std::fs::read(dir.path().join("s0.safetensors")).unwrap());
        prop_assert_eq!(got, want);
    }

    /// `mmv`, a glob of `mv`s, a renamer that plans first: each tensor's data
    /// and meta renamed in either order (or the data alone), interleaved,
    /// ends as `mv` of each tensor.
    #[test]
    fn renames_in_any_order_converge(
        orders in prop::collection::vec(0u8..3, 3),
        schedule in prop::collection::vec(0usize..6, 12),
    ) {
        let tensors = copied();
        let (dir, fs) = empty_mount();
        for (file, bytes) in copy_set(&tensors) {
            let mut c = Copy { file, bytes, step: 0, fh: None, exists: false };
            while !c.done() {
                c.advance(&fs);
            }
        }
        fs.commit(Default::default(), 0).unwrap();
        // Per tensor: 0 data then meta, 1 meta then data, 2 data alone.
        let mut plans: Vec<Vec<(String, String)>> = tensors
            .iter()
            .zip(&orders)
            .map(|((name, ..), &order)| {
                let new = format!("n{name}");
                let data = (TensorFile::Data.file_name(name), TensorFile::Data.file_name(&new));
                let meta = (TensorFile::Meta.file_name(name), TensorFile::Meta.file_name(&new));
                match order {
                    0 => vec![data, meta],
                    1 => vec![meta, data],
                    _ => vec![data],
                }
            })
            .collect();
        // Every source exists when the renamer plans.
        for (from, _) in plans.iter().flatten() {
            prop_assert!(fs.lookup(ROOT_INO, from).is_ok(), "{} before the renames", from);
        }
        let mut turns = schedule.into_iter().chain(std::iter::repeat(0));
        while plans.iter().any(|p| !p.is_empty()) {
            let live: Vec<usize> = (0..plans.len()).filter(|&k| !plans[k].is_empty()).collect();
            let k = live[turns.next().unwrap() % live.len()];
            let (from, to) = plans[k].remove(0);
            fs.rename(ROOT_INO, &from, ROOT_INO, &to, false)
                .unwrap_or_else(|e| panic!("rename {from} -> {to}: {e}"));
        }
        fs.commit(Default::default(), 0).unwrap();
        let renamed: Vec<(String, usize, Vec<u8>, &[u64])> = tensors
            .iter()
            .map(|(n, d, b, s)| (format!("n{n}"), *d, b.clone(), *s))
            .collect();
        let renamed: Vec<Tensor> = renamed.iter().map(|(n, d, b, s)| (n.as_str(), *d, b.clone(), *s)).collect();
        let want = tensors_of(&write_file(&dir.path().join("want"), &renamed));
        let got = tensors_of(&std::fs::read(dir.path().join("s0.safetensors")).unwrap());
        prop_assert_eq!(got, want);
        // Nothing of the old names is left.
        for (name, ..) in &tensors {
            prop_assert!(fs.lookup(ROOT_INO, &TensorFile::Meta.file_name(name)).is_err());
        }
    }
}

/// New tensors of a GGUF file go last in the order they were made, by every
/// way of committing (an in-place append once wrote them in name order,
/// unlike the `model.gguf` view and a rewrite).
#[test]
fn gguf_tensors_added_keep_the_order_they_were_made_in() {
    let mut ops = Vec::new();
    for name in [3, 4] {
        ops.push(Op::Create {
            dir: 0,
            name,
            exclusive: true,
        });
        ops.push(Op::SetMeta {
            dir: 0,
            name,
            text: Text::Meta(1, vec![2]),
        });
    }
    ops.push(Op::Commit {
        force: false,
        other_user: false,
    });
    run_gguf(false, &ops);
}

/// A GGUF tensor written in part, then renamed, then committed in place
/// (proptest found it: the in-place commit's tensor order against the
/// model's view order).
#[test]
fn gguf_a_tensor_written_in_part_then_renamed_keeps_its_place() {
    let ops = vec![
        Op::Write {
            dir: 0,
            name: 0,
            offset: 0,
            data: vec![7],
        },
        Op::Rename {
            from: FileRef {
                dir: 0,
                name: 0,
                part: Part::Data,
            },
            to: FileRef {
                dir: 0,
                name: 2,
                part: Part::Data,
            },
            no_replace: false,
        },
        Op::Commit {
            force: false,
            other_user: false,
        },
    ];
    run_gguf(false, &ops);
}
