"""Files written by the official Python package verify and inspect correctly;
invalid files are refused with a message naming the file, tensor and rule."""

import json
import struct

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

import stfs_fixtures as fx


def test_reference_files_inspect_like_the_reference(tmp_path, run):
    path = tmp_path / "mixed.safetensors"
    expected = fx.mixed_checkpoint(str(path))
    p = run("verify", path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"ok ({len(expected)} tensors" in p.stdout

    doc = json.loads(run("inspect", "--json", path, check=True).stdout)
    n, header = fx.read_header(path)
    assert doc["header_len"] == n and doc["data_start"] == 8 + n
    assert doc["metadata"] == {"format": "np", "note": "stfs test"}
    assert doc["tensor_count"] == len(expected)
    with safe_open(str(path), framework="numpy") as f:
        assert sorted(t["name"] for t in doc["tensors"]) == sorted(f.keys())
        for t in doc["tensors"]:
            sl = f.get_slice(t["name"])
            assert t["dtype"] == sl.get_dtype()
            assert t["shape"] == list(sl.get_shape())
            assert t["data_offsets"] == header[t["name"]]["data_offsets"]
            assert t["nbytes"] == len(expected[t["name"]])
            assert t["file_offset"] == 8 + n + t["data_offsets"][0]
    assert doc["total_bytes"] == sum(map(len, expected.values()))

    table = run("inspect", path, check=True).stdout
    assert "BF16" in table and "model.layers.0.bool" in table


def test_hand_written_f6_and_empty_checkpoint(tmp_path, run):
    path = tmp_path / "f6.safetensors"
    fx.write_by_hand(path, [("a", "F6_E2M3", [4], b"\x01\x02\x03"), ("b", "F6_E3M2", [2, 4], bytes(6))])
    assert run("verify", path).returncode == 0
    with safe_open(str(path), framework="numpy") as f:
        assert f.get_slice("b").get_dtype() == "F6_E3M2"

    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    assert run("verify", empty).returncode == 0
    made = tmp_path / "made.safetensors"
    run("create", made, "--metadata", "format=pt", check=True)
    with safe_open(str(made), framework="numpy") as f:
        assert list(f.keys()) == [] and f.metadata() == {"format": "pt"}
    # Same bytes as the reference's writer for the same (empty) content.
    ref = tmp_path / "ref.safetensors"
    save_file({}, str(ref), metadata={"format": "pt"})
    assert made.read_bytes() == ref.read_bytes()
    assert run("create", made).returncode != 0, "create must not overwrite"


def _corrupt(tmp_path, name, mutate):
    path = tmp_path / name
    save_file({"w": np.arange(4, dtype=np.float32)}, str(path))
    data = bytearray(path.read_bytes())
    path.write_bytes(mutate(data))
    return path


def _set_header(data, text):
    n = struct.unpack("<Q", data[:8])[0]
    body = data[8 + n:]
    text = text.encode()
    return struct.pack("<Q", len(text)) + text + body


def test_invalid_files_are_refused_with_clear_messages(tmp_path, run):
    cases = {
        "short.safetensors": (lambda d: d[:5], "shorter than the 8-byte"),
        "huge.safetensors": (lambda d: struct.pack("<Q", 100_000_001) + d[8:], "100000000-byte limit"),
        "truncated.safetensors": (lambda d: d[:20], "runs past the end"),
        "trailing.safetensors": (lambda d: d + b"x", "file is"),
        "dtype.safetensors": (lambda d: _set_header(d, '{"w":{"dtype":"F33","shape":[4],"data_offsets":[0,16]}}'), 'tensor "w"'),
        "size.safetensors": (lambda d: _set_header(d, '{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}'),
                             'tensor "w": data_offsets [0, 16] span 16 bytes but F32 [3] needs 12'),
        "gap.safetensors": (lambda d: _set_header(d, '{"w":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}}'), "should begin at 0"),
        "utf8.safetensors": (lambda d: struct.pack("<Q", 2) + b"\xff\xfe" + d[8:], "UTF-8"),
    }
    for name, (mutate, message) in cases.items():
        path = _corrupt(tmp_path, name, mutate)
        p = run("verify", path)
        assert p.returncode == 1, name
        assert str(path) in p.stdout and message in p.stdout, (name, p.stdout)
        p = run("inspect", path)
        assert p.returncode == 1 and message in p.stderr, (name, p.stderr)


def test_sharded_folder_with_index(tmp_path, run):
    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.ones(5, np.int64)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 52},
             "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    p = run("verify", tmp_path)
    assert p.returncode == 0, p.stdout
    assert "index agrees" in p.stdout

    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    index["metadata"]["total_size"] = 1
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    p = run("verify", tmp_path)
    assert p.returncode == 1
    assert 'tensor "b" is in "model-00002-of-00002.safetensors" but weight_map says' in p.stdout
    assert "total_size is 1 but the shards hold 52" in p.stdout
