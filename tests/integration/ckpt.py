"""Helpers that write checkpoints with the official `safetensors` package (and,
for dtypes it cannot write, by hand) for the integration tests and the demo."""

import json
import os
import struct
import subprocess

import numpy as np
from safetensors import TensorSpec, safe_open, serialize_file
from safetensors.numpy import load_file, save_file

# numpy dtypes the official numpy API writes, with their header names.
NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "F16": np.float16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "C64": np.complex64, "F64": np.float64, "I64": np.int64, "U64": np.uint64,
}

# Dtypes the official writer takes only as raw bytes (its TensorSpec names).
RAW_DTYPES = {
    "BF16": ("bfloat16", 16), "F8_E4M3": ("float8_e4m3fn", 8), "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8), "F4": ("float4_e2m1fn_x2", 4),
}


def sample_array(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    t = NUMPY_DTYPES[dtype]
    if t is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(t, np.integer):
        info = np.iinfo(t)
        return rng.integers(info.min, info.max, size=shape, dtype=t, endpoint=True)
    if t is np.complex64:
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(t)
    return rng.standard_normal(shape).astype(t)


def save_raw(path, raw, metadata=None, arrays=None):
    """Writes numpy arrays plus raw-byte tensors {name: (dtype, shape, bytes)}
    with the official writer's TensorSpec."""
    arrays = arrays or {}
    keep = []
    specs = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        keep.append(a)
        specs[name] = TensorSpec(dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
    for name, (dtype, shape, data) in raw.items():
        buf = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, np.uint8)
        keep.append(buf)
        st_name, bits = RAW_DTYPES[dtype]
        # The F4 spec takes the packed storage shape (two values a byte).
        spec_shape = list(shape[:-1]) + [shape[-1] // 2] if dtype == "F4" else list(shape)
        specs[name] = TensorSpec(dtype=st_name, shape=spec_shape, data_ptr=buf.ctypes.data, data_len=len(data))
    serialize_file(specs, path, metadata=metadata)


def write_by_hand(path, entries, metadata=None):
    """Writes a file the way the format describes it, for dtypes (F6_*) or
    layouts the official writer does not produce. entries: [(name, dtype, shape, bytes)]
    in file order."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in entries:
            f.write(data)


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def tensor_bytes(path, name):
    """A tensor's bytes, read straight from the file by its header."""
    n, header = read_header(path)
    b, e = header[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + n + b)
        return f.read(e - b)


def mixed_checkpoint(path, seed=0):
    """Every numpy dtype, the raw dtypes, a scalar, a zero-size tensor, names
    that need escaping, and metadata. Returns the expected {name: bytes}."""
    arrays = {}
    for i, dtype in enumerate(NUMPY_DTYPES):
        arrays[f"model.layers.{i}.{dtype.lower()}"] = sample_array(dtype, (3, 5), seed + i)
    arrays["scalar"] = np.array(3.5, dtype=np.float32)
    arrays["empty"] = np.zeros((0, 7), dtype=np.float16)
    arrays["a/b/c"] = sample_array("U8", (4,), seed + 50)
    arrays["100%"] = sample_array("I16", (2,), seed + 51)
    arrays["x.meta.json"] = sample_array("F32", (2,), seed + 52)
    arrays["__metadata__.json"] = sample_array("U8", (3,), seed + 53)
    arrays["ünïcødé ✓"] = sample_array("F64", (2, 2), seed + 54)
    rng = np.random.default_rng(seed)
    raw = {}
    for dtype, (_, bits) in RAW_DTYPES.items():
        shape = (4, 6)
        raw[f"raw.{dtype}"] = (dtype, shape, rng.bytes(24 * bits // 8))
    save_raw(path, raw, metadata={"format": "np", "note": "stfs test"}, arrays=arrays)
    _, header = read_header(path)
    return {name: tensor_bytes(path, name) for name in header if name != "__metadata__"}


def base(path, metadata=None):
    """Three tensors written by the official package; returns them."""
    tensors = {
        "a": np.arange(8, dtype=np.float32),
        "b": np.arange(6, dtype=np.int64).reshape(2, 3),
        "c": np.ones(5, np.uint8),
    }
    save_file(tensors, str(path), metadata=metadata)
    return tensors


def assert_checkpoint(path, expected, metadata=None, compact=False):
    """Loads with the official package and compares values and metadata, then the layout.

    With `compact` (a `stfs commit --compact`, or a file stfs never wrote), byte-identical to
    the package's save_file. Otherwise (a commit in place, or a rewrite that leaves room in
    the header): the header is save_file's JSON but for data offsets, then only spaces.
    """
    got = load_file(str(path))
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k
    with safe_open(str(path), framework="np") as f:
        assert (f.metadata() or None) == (metadata or None)
    ref = str(path) + ".ref"
    save_file(expected, ref, metadata=metadata)
    try:
        if compact:
            assert open(path, "rb").read() == open(ref, "rb").read(), "not byte-identical to save_file"
        else:
            assert header_without_offsets(path) == header_without_offsets(ref)
    finally:
        os.unlink(ref)


def header_of(path):
    """(JSON header as a dict, header length, the header's bytes) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(n)
    text = raw.decode()
    end = text.rindex("}") + 1
    assert set(text[end:]) <= {" "}, f"{path}: not only spaces after the header's JSON"
    return json.loads(text[:end]), n, raw


def header_without_offsets(path):
    h, _, _ = header_of(path)
    return {k: ({f: x for f, x in v.items() if f != "data_offsets"} if k != "__metadata__" else v) for k, v in h.items()}


def sh(cmd, cwd=None, check=True):
    """Runs a shell command line; with `check`, a failure says what it printed."""
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd!r} failed ({p.returncode}): {p.stdout}{p.stderr}")
    return p


def committed(run, m):
    """`stfs commit` of mount `m`, which must succeed."""
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    return p
