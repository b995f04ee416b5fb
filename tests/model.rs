//! Reference-model property test of the write path, without a mount: random
//! sequences of edits and commits applied both to the filesystem logic and to
//! a plain model (name -> dtype, shape, bytes). After every commit the file
//! must equal the reference `safetensors` serialization of the model, and a
//! refused commit must leave the file as it was.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use stfs::checkpoint::Checkpoint;
use stfs::format::{byte_len, layout, Dtype, Metadata, TensorSpec};
use stfs::fs::names::tensor_file_name;
use stfs::fs::{Fs, Settings, Source, ROOT_INO};

#[derive(Debug, Clone)]
enum Op {
    Create(usize),
    Write(usize, u64, Vec<u8>),
    Truncate(usize, u64),
    Meta(usize, Dtype, Vec<u64>),
    Rename(usize, usize),
    Unlink(usize),
    SetMetadata(Option<(String, String)>),
    Commit,
}

const NAMES: [&str; 5] = ["a", "b", "c/d", "x.meta.json", ""];
const DTYPES: [Dtype; 4] = [Dtype::U8, Dtype::I16, Dtype::F32, Dtype::BF16];

fn op() -> impl Strategy<Value = Op> {
    let n = 0..NAMES.len();
    prop_oneof![
        n.clone().prop_map(Op::Create),
        (
            n.clone(),
            0u64..24,
            prop::collection::vec(any::<u8>(), 1..12)
        )
            .prop_map(|(i, o, d)| Op::Write(i, o, d)),
        (n.clone(), 0u64..24).prop_map(|(i, l)| Op::Truncate(i, l)),
        (
            n.clone(),
            0..DTYPES.len(),
            prop::collection::vec(0u64..4, 0..3)
        )
            .prop_map(|(i, d, s)| Op::Meta(i, DTYPES[d], s)),
        (n.clone(), n.clone()).prop_map(|(a, b)| Op::Rename(a, b)),
        n.prop_map(Op::Unlink),
        prop::option::of(("[a-z]{1,3}", "[a-z]{0,3}")).prop_map(Op::SetMetadata),
        Just(Op::Commit),
    ]
}

#[derive(Debug, Clone, PartialEq)]
struct ModelTensor {
    dtype: Option<Dtype>,
    shape: Option<Vec<u64>>,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Model {
    tensors: BTreeMap<String, ModelTensor>,
    metadata: Option<Metadata>,
}

impl Model {
    /// The reference crate's serialization of the model, or None if a commit must refuse it.
    fn serialized(&self) -> Option<Vec<u8>> {
        let mut views = Vec::new();
        for (name, t) in &self.tensors {
            let (dtype, shape) = (t.dtype?, t.shape.clone()?);
            if byte_len(dtype, &shape).ok()? != t.bytes.len() as u64 {
                return None;
            }
            let dtype: safetensors::Dtype = serde_json::from_str(&format!("\"{dtype}\"")).unwrap();
            let shape: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            views.push((
                name.clone(),
                safetensors::tensor::TensorView::new(dtype, shape, &t.bytes).unwrap(),
            ));
        }
        let meta: Option<HashMap<String, String>> =
            self.metadata.clone().map(|m| m.into_iter().collect());
        Some(safetensors::serialize(views, meta).unwrap())
    }
}

fn initial(dir: &std::path::Path) -> (std::path::PathBuf, Model) {
    let mut model = Model::default();
    model.tensors.insert(
        "a".into(),
        ModelTensor {
            dtype: Some(Dtype::U8),
            shape: Some(vec![3]),
            bytes: vec![1, 2, 3],
        },
    );
    model.tensors.insert(
        "b".into(),
        ModelTensor {
            dtype: Some(Dtype::I16),
            shape: Some(vec![2]),
            bytes: vec![9, 8, 7, 6],
        },
    );
    let specs: Vec<TensorSpec> = model
        .tensors
        .iter()
        .map(|(n, t)| TensorSpec {
            name: n.clone(),
            dtype: t.dtype.unwrap(),
            shape: t.shape.clone().unwrap(),
        })
        .collect();
    let l = layout(&specs, None).unwrap();
    let mut bytes = l.header.clone();
    for (_, &i) in l.tensors.iter().zip(&l.source_index) {
        bytes.extend_from_slice(&model.tensors[&specs[i].name].bytes);
    }
    let path = dir.join("m.safetensors");
    std::fs::write(&path, bytes).unwrap();
    (path, model)
}

fn ino(fs: &Fs, file: &str) -> Option<u64> {
    fs.lookup(ROOT_INO, file).ok().map(|a| a.ino)
}

fn apply(fs: &Fs, model: &mut Model, path: &std::path::Path, op: &Op) {
    let file = |i: usize| tensor_file_name(NAMES[i]);
    match op {
        Op::Create(i) => {
            let (_, o) = fs.create(ROOT_INO, &file(*i), false).unwrap();
            fs.release(o.fh).unwrap();
            model
                .tensors
                .entry(NAMES[*i].to_string())
                .or_insert(ModelTensor {
                    dtype: None,
                    shape: None,
                    bytes: vec![],
                });
        }
        Op::Write(i, off, data) => {
            let Some(ino) = ino(fs, &file(*i)) else {
                return;
            };
            let o = fs.open(ino, true, false).unwrap();
            fs.write(ino, o.fh, *off, data).unwrap();
            fs.release(o.fh).unwrap();
            let b = &mut model.tensors.get_mut(NAMES[*i]).unwrap().bytes;
            let end = *off as usize + data.len();
            if b.len() < end {
                b.resize(end, 0);
            }
            b[*off as usize..end].copy_from_slice(data);
        }
        Op::Truncate(i, len) => {
            let Some(ino) = ino(fs, &file(*i)) else {
                return;
            };
            fs.set_size(ino, None, *len).unwrap();
            model
                .tensors
                .get_mut(NAMES[*i])
                .unwrap()
                .bytes
                .resize(*len as usize, 0);
        }
        Op::Meta(i, dtype, shape) => {
            let meta_file = format!("{}.meta.json", file(*i));
            let (_, o) = fs.create(ROOT_INO, &meta_file, true).unwrap();
            let doc = serde_json::json!({"dtype": dtype.name(), "shape": shape}).to_string();
            let meta_ino = ino(fs, &meta_file).unwrap();
            fs.write(meta_ino, o.fh, 0, doc.as_bytes()).unwrap();
            fs.release(o.fh).unwrap();
            let t = model
                .tensors
                .entry(NAMES[*i].to_string())
                .or_insert(ModelTensor {
                    dtype: None,
                    shape: None,
                    bytes: vec![],
                });
            if t.dtype.is_none() && t.bytes.is_empty() {
                t.bytes = vec![0; byte_len(*dtype, shape).unwrap() as usize];
            }
            t.dtype = Some(*dtype);
            t.shape = Some(shape.clone());
        }
        Op::Rename(a, b) => {
            if ino(fs, &file(*a)).is_none() {
                return;
            }
            fs.rename(ROOT_INO, &file(*a), ROOT_INO, &file(*b), false)
                .unwrap();
            if a != b {
                let t = model.tensors.remove(NAMES[*a]).unwrap();
                model.tensors.insert(NAMES[*b].to_string(), t);
            }
        }
        Op::Unlink(i) => {
            if fs.unlink(ROOT_INO, &file(*i)).is_ok() {
                model.tensors.remove(NAMES[*i]).unwrap();
            } else {
                assert!(!model.tensors.contains_key(NAMES[*i]));
            }
        }
        Op::SetMetadata(kv) => {
            let meta_ino = ino(fs, "__metadata__.json").unwrap();
            let o = fs.open(meta_ino, true, true).unwrap();
            let map: Metadata = kv.iter().cloned().collect();
            fs.write(
                meta_ino,
                o.fh,
                0,
                serde_json::to_string(&map).unwrap().as_bytes(),
            )
            .unwrap();
            fs.release(o.fh).unwrap();
            model.metadata = (!map.is_empty()).then_some(map);
        }
        Op::Commit => {
            let before = std::fs::read(path).unwrap();
            match (fs.commit(ROOT_INO, false), model.serialized()) {
                (Ok(_), Some(expected)) => assert_eq!(
                    std::fs::read(path).unwrap(),
                    expected,
                    "committed file differs from the model"
                ),
                (Err(e), None) => {
                    assert_eq!(e.errno(), libc::EINVAL, "{e}");
                    assert_eq!(
                        std::fs::read(path).unwrap(),
                        before,
                        "a refused commit changed the source"
                    );
                }
                (Ok(_), None) => panic!("commit accepted an invalid model"),
                (Err(e), Some(_)) => panic!("commit refused a valid model: {e}"),
            }
        }
    }
    // The listing and every tensor's bytes always match the model.
    for (name, t) in &model.tensors {
        let ino = ino(fs, &tensor_file_name(name)).unwrap_or_else(|| panic!("{name:?} missing"));
        let got = fs.read(ino, 0, 0, 1 << 20, |b| b.to_vec()).unwrap();
        assert_eq!(got, t.bytes, "{name:?} after {op:?}");
    }
    let mut listed = 0;
    fs.readdir(ROOT_INO, 0, |_| {
        listed += 1;
        false
    })
    .unwrap();
    assert_eq!(listed, 3 + 2 * model.tensors.len());
}

fn run(ops: &[Op]) {
    let dir = tempfile::tempdir().unwrap();
    let (path, mut model) = initial(dir.path());
    let fs = Fs::new(
        Source::File(Checkpoint::open(&path).unwrap()),
        Settings {
            read_only: false,
            uid: 0,
            gid: 0,
            staging_dir: None,
            resume: None,
        },
    );
    for op in ops {
        apply(&fs, &mut model, &path, op);
    }
    apply(&fs, &mut model, &path, &Op::Commit);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn edits_and_commits_match_the_model(ops in prop::collection::vec(op(), 1..25)) {
        run(&ops);
    }
}

/// Fixed sequences that always run: a tensor created by its meta alone, and a
/// rename over an existing tensor followed by a truncation to zero.
#[test]
fn meta_alone_then_commit_then_unlink() {
    run(&[
        Op::Meta(2, Dtype::F32, vec![2]),
        Op::Commit,
        Op::Unlink(2),
        Op::Commit,
    ]);
}

#[test]
fn rename_over_existing_then_truncate() {
    run(&[
        Op::Rename(0, 1),
        Op::Truncate(1, 0),
        Op::Meta(1, Dtype::U8, vec![0]),
        Op::Commit,
    ]);
}
