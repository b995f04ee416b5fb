//! Every view, after every operation, against the model's own making of
//! it: the casts (`bf16/`, `f16/`, `f32/`), and for a folder mount the
//! merged file, the index and a reshard (`reshard/SIZE/`), made here from
//! the model's state with the reference crate's serializer and the Hugging
//! Face split rule, not with stfs's code.

use super::*;

/// The model's tensors of shard `dir` that a commit would write: (name,
/// dtype, shape, bytes).
fn tensors(model: &Model, dir: usize) -> Vec<(String, usize, Vec<u64>, Vec<u8>)> {
    model.dirs[dir]
        .entries
        .iter()
        .filter_map(|(name, e)| match (&e.meta, e.data, e.hidden) {
            (MMeta::Valid(dt, s), Some(o), false) => Some((
                name.clone(),
                *dt,
                s.clone(),
                model.objects[&o].bytes.clone(),
            )),
            _ => None,
        })
        .collect()
}

/// `bytes` of model dtype `dt` cast to `to` (round to nearest even), and
/// the dtype they are then; a dtype that is not a float stays as it is.
fn cast(dt: usize, bytes: &[u8], to: &str) -> (String, Vec<u8>) {
    let values: Vec<f64> = match DTYPES[dt].0 {
        "F32" => bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        "F64" => bytes
            .chunks(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        "BF16" => bytes
            .chunks(2)
            .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        "F16" => bytes
            .chunks(2)
            .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        other => return (other.to_string(), bytes.to_vec()),
    };
    // A cast to the dtype a tensor has is no cast: its bytes as they are
    // (a NaN's payload kept, signalling or not).
    if DTYPES[dt].0 == to {
        return (to.to_string(), bytes.to_vec());
    }
    // (From F32 and BF16 through f32, so that rounding is done once.)
    let wide = DTYPES[dt].0 == "F64";
    let out: Vec<u8> = match to {
        // (A NaN becomes BF16's quiet NaN of its sign, as ml_dtypes makes it.)
        "BF16" => values
            .iter()
            .flat_map(|&v| match (v.is_nan(), wide) {
                (true, _) => {
                    half::bf16::from_bits(if v.is_sign_negative() { 0xFFC0 } else { 0x7FC0 })
                        .to_le_bytes()
                }
                (false, true) => half::bf16::from_f64(v).to_le_bytes(),
                (false, false) => half::bf16::from_f32(v as f32).to_le_bytes(),
            })
            .collect(),
        "F16" => values
            .iter()
            .flat_map(|&v| match wide {
                true => half::f16::from_f64(v).to_le_bytes(),
                false => half::f16::from_f32(v as f32).to_le_bytes(),
            })
            .collect(),
        _ => values
            .iter()
            .flat_map(|&v| (v as f32).to_le_bytes())
            .collect(),
    };
    (to.to_string(), out)
}

/// The reference crate's file of `tensors` (dtype names), with `metadata`.
fn serialize(tensors: &[(String, String, Vec<u64>, Vec<u8>)], metadata: Option<Map>) -> Vec<u8> {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, dt, s, b)| {
            let dtype: safetensors::Dtype = serde_json::from_str(&format!("\"{dt}\"")).unwrap();
            let shape: Vec<usize> = s.iter().map(|&x| x as usize).collect();
            (
                name.clone(),
                safetensors::tensor::TensorView::new(dtype, shape, b).unwrap(),
            )
        })
        .collect();
    let meta: Option<HashMap<String, String>> = metadata.map(|m| m.into_iter().collect());
    safetensors::serialize(views, meta).unwrap()
}

fn metadata_of(model: &Model, dir: usize) -> Option<Map> {
    match &model.dirs[dir].metadata {
        MMetadata::Valid(m) => m.clone(),
        _ => None,
    }
}

/// A view's bytes at `path` below `__views__` (None: no such file).
fn read_view(m: &Mounted, path: &[&str]) -> Option<Vec<u8>> {
    let fs = m.fs();
    let mut ino = fs.lookup(ROOT_INO, "__views__").ok()?.ino;
    if !m.folder {
        // (A file mount's `__views__` is in its checkpoint's directory.)
        ino = fs.lookup(m.dir_ino(0), "__views__").ok()?.ino;
    }
    for part in path {
        ino = fs.lookup(ino, part).ok()?.ino;
    }
    let got = m.cat(ino).ok()?;
    assert_eq!(
        fs.getattr(ino, None).unwrap().size,
        got.len() as u64,
        "{path:?}: the size stat says"
    );
    Some(got)
}

/// The same tensors (names, dtypes, shapes, bytes) in two files.
fn same_tensors(got: &[u8], want: &[u8], what: &str) {
    let (a, b) = (
        safetensors::SafeTensors::deserialize(got)
            .unwrap_or_else(|e| panic!("{what}: refused ({e:?})")),
        safetensors::SafeTensors::deserialize(want).unwrap(),
    );
    let mut names = a.names();
    let mut expected = b.names();
    names.sort();
    expected.sort();
    assert_eq!(names, expected, "{what}: the tensors");
    for n in expected {
        let (x, y) = (a.tensor(n).unwrap(), b.tensor(n).unwrap());
        assert_eq!(
            (x.dtype(), x.shape(), x.data()),
            (y.dtype(), y.shape(), y.data()),
            "{what}: tensor {n:?}"
        );
    }
}

/// Shard `dir`'s casts: byte for byte the reference's file of its tensors cast.
pub(super) fn check_casts(m: &Mounted, model: &Model, dir: usize, after: &Op) {
    let name = match m.folder {
        true => format!("s{dir}.safetensors"),
        false => "model.safetensors".to_string(),
    };
    for (folder, to) in [("bf16", "BF16"), ("f16", "F16"), ("f32", "F32")] {
        let cast: Vec<_> = tensors(model, dir)
            .into_iter()
            .map(|(n, dt, s, b)| {
                let (dt, b) = cast(dt, &b, to);
                (n, dt, s, b)
            })
            .collect();
        let want = serialize(&cast, metadata_of(model, dir));
        let got = read_view(m, &[folder, &name]).expect("a cast view");
        assert!(
            got == want,
            "__views__/{folder}/{name} after {after:?}: not the reference's file of the cast tensors"
        );
    }
}

/// A folder mount's views of all its shards: the merged file, the index as
/// a commit would write it, and a reshard at a size that splits it.
pub(super) fn check_folder_views(m: &Mounted, model: &Model, after: &Op) {
    let mut all = Vec::new();
    let mut metadata: Option<Map> = None;
    let mut weight_map = serde_json::Map::new();
    for dir in 0..model.dirs.len() {
        for (n, dt, s, b) in tensors(model, dir) {
            weight_map.insert(n.clone(), format!("s{dir}.safetensors").into());
            all.push((n, DTYPES[dt].0.to_string(), s, b));
        }
        for (k, v) in metadata_of(model, dir).into_iter().flatten() {
            metadata
                .get_or_insert_with(Default::default)
                .entry(k)
                .or_insert(v);
        }
    }
    let merged = serialize(&all, metadata.clone());
    let got = read_view(m, &["merged.safetensors"]).expect("the merged view");
    same_tensors(
        &got,
        &merged,
        &format!("__views__/merged.safetensors after {after:?}"),
    );
    let total: u64 = all.iter().map(|t| t.3.len() as u64).sum();
    let index: serde_json::Value =
        serde_json::from_slice(&read_view(m, &[INDEX]).expect("the index view")).unwrap();
    assert_eq!(
        (&index["weight_map"], &index["metadata"]["total_size"]),
        (&serde_json::Value::Object(weight_map), &total.into()),
        "__views__/{INDEX} after {after:?}"
    );
    // The split: tensors in the merged file's order, each to the current
    // shard unless that passes the size (then a new one), a larger one alone.
    let max = 40u64;
    let st = safetensors::SafeTensors::deserialize(&merged).unwrap();
    let mut order: Vec<(usize, String)> = st
        .tensors()
        .into_iter()
        .map(|(n, _)| (offset_of(&merged, &n), n))
        .collect();
    order.sort();
    let mut shards: Vec<Vec<String>> = Vec::new();
    let mut current: Vec<String> = Vec::new();
    let mut size = 0u64;
    for (_, n) in order {
        let len = st.tensor(&n).unwrap().data().len() as u64;
        if len > max {
            shards.push(vec![n]);
            continue;
        }
        if size + len > max {
            shards.push(std::mem::take(&mut current));
            size = 0;
        }
        size += len;
        current.push(n);
    }
    if !current.is_empty() {
        shards.push(current);
    }
    let folder = format!("{max}");
    let names: Vec<String> = match shards.len() {
        0 => Vec::new(),
        1 => vec!["model.safetensors".into()],
        k => (1..=k)
            .map(|i| format!("model-{i:05}-of-{k:05}.safetensors"))
            .collect(),
    };
    for (file, shard) in names.iter().zip(&shards) {
        let got = read_view(m, &["reshard", &folder, file])
            .unwrap_or_else(|| panic!("reshard/{folder}/{file} after {after:?}: missing"));
        let want: Vec<_> = all
            .iter()
            .filter(|t| shard.contains(&t.0))
            .cloned()
            .collect();
        same_tensors(
            &got,
            &serialize(&want, None),
            &format!("__views__/reshard/{folder}/{file} after {after:?}"),
        );
    }
    if names.len() > 1 {
        let index: serde_json::Value =
            serde_json::from_slice(&read_view(m, &["reshard", &folder, INDEX]).unwrap()).unwrap();
        for (file, shard) in names.iter().zip(&shards) {
            for n in shard {
                assert_eq!(
                    index["weight_map"][n],
                    file.as_str(),
                    "reshard/{folder}/{INDEX} after {after:?}: {n:?}"
                );
            }
        }
    }
}

/// Where tensor `name`'s bytes start in a safetensors file (its place in
/// the file's order).
fn offset_of(file: &[u8], name: &str) -> usize {
    let (_, meta) = safetensors::SafeTensors::read_metadata(file).unwrap();
    meta.info(name).unwrap().data_offsets.0
}
