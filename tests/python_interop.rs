//! Files written by stfs's serializer load in the official Python package with
//! equal values, and are byte-identical to what its `save_file` writes.
//! Needs python3 with `safetensors` and `numpy` (installed by .ci/run).

use std::process::Command;

use stfs::format::{Dtype, Metadata, TensorSpec, layout};

/// Deterministic content: byte i of tensor k. Python computes the same.
fn byte_at(k: usize, i: u64) -> u8 {
    ((i * 31 + k as u64 * 7) % 251) as u8
}

fn python_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import safetensors, numpy"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok && std::env::var_os("CI").is_some() {
        panic!("python3 with safetensors and numpy is required in CI");
    }
    ok
}

const CHECK: &str = r#"
import sys, json, numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
path, spec = sys.argv[1], json.loads(sys.argv[2])
expected_meta = spec["metadata"]
np_types = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
            "F16": np.float16, "I32": np.int32, "U32": np.uint32, "F32": np.float32, "C64": np.complex64,
            "F64": np.float64, "I64": np.int64, "U64": np.uint64}
arrays = {}
with safe_open(path, framework="numpy") as f:
    assert f.metadata() == expected_meta, (f.metadata(), expected_meta)
    assert sorted(f.keys()) == sorted(t["name"] for t in spec["tensors"])
    for k, t in enumerate(spec["tensors"]):
        want = bytes(((i * 31 + t["k"] * 7) % 251) for i in range(t["nbytes"]))
        sl = f.get_slice(t["name"])
        assert sl.get_dtype() == t["dtype"], (sl.get_dtype(), t)
        assert list(sl.get_shape()) == t["shape"], (sl.get_shape(), t)
        if t["dtype"] in np_types:
            a = f.get_tensor(t["name"])
            assert a.dtype == np_types[t["dtype"]] and list(a.shape) == t["shape"]
            assert a.tobytes() == want, t["name"]
            arrays[t["name"]] = a
if spec["compare_save_file"]:
    # The reference's own writer, for the same tensors, must give the same bytes.
    import tempfile, os
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "ref.safetensors")
        save_file(arrays, p, metadata=expected_meta)
        assert open(p, "rb").read() == open(path, "rb").read(), "not byte-identical to save_file"
print("ok")
"#;

fn write_and_check(specs: Vec<TensorSpec>, meta: Option<Metadata>, compare_save_file: bool) {
    let l = layout(&specs, meta.as_ref()).unwrap();
    let mut bytes = l.header.clone();
    for (t, &k) in l.tensors.iter().zip(&l.source_index) {
        bytes.extend((0..t.nbytes()).map(|i| byte_at(k, i)));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stfs.safetensors");
    std::fs::write(&path, &bytes).unwrap();
    let tensors: Vec<_> = l
        .tensors
        .iter()
        .zip(&l.source_index)
        .map(|(t, &k)| {
            serde_json::json!({"name": t.name, "dtype": t.dtype.name(), "shape": t.shape, "nbytes": t.nbytes(), "k": k})
        })
        .collect();
    let spec = serde_json::json!({"metadata": meta, "tensors": tensors, "compare_save_file": compare_save_file});
    let out = Command::new("python3")
        .args(["-c", CHECK, path.to_str().unwrap(), &spec.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python check failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

#[test]
fn numpy_dtypes_load_with_equal_values_and_match_save_file() {
    if !python_available() {
        eprintln!("skipped: python3 with safetensors and numpy not found");
        return;
    }
    // What numpy has: every dtype but BF16 and the floats under 16 bits.
    let numpy: Vec<Dtype> = Dtype::ALL
        .into_iter()
        .filter(|&d| d != Dtype::BF16 && !(d.name().starts_with('F') && d.bits() < 16))
        .collect();
    assert_eq!(numpy.len(), 13);
    let mut specs: Vec<_> = numpy
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            spec(
                &format!("layer.{i}.{}", d.name().to_lowercase()),
                d,
                &[3, 2],
            )
        })
        .collect();
    specs.push(spec("scalar", Dtype::F32, &[]));
    specs.push(spec("empty", Dtype::F64, &[0, 4]));
    specs.push(spec("ünï/códe \"q\"", Dtype::U8, &[5]));
    let mut meta = Metadata::new();
    meta.insert("format".into(), "np".into());
    write_and_check(specs.clone(), Some(meta), true);
    write_and_check(specs, None, true);
}

#[test]
fn every_dtype_loads_in_the_reference() {
    if !python_available() {
        eprintln!("skipped: python3 with safetensors and numpy not found");
        return;
    }
    let specs: Vec<_> = Dtype::ALL
        .iter()
        .map(|&d| spec(&format!("t_{}", d.name()), d, &[2, 4]))
        .collect();
    let mut meta = Metadata::new();
    meta.insert("a".into(), "1".into());
    meta.insert("b".into(), "2".into());
    write_and_check(specs, Some(meta), false);
}
