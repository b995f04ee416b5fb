"""GGUF files read as ggml reads them (`stfs inspect`, `stfs verify`): written by
gguf-py's GGUFWriter (the `gguf` package, the writer llama.cpp's converters use), read
back by its GGUFReader, and bent byte by byte to break each rule ggml's C reader
enforces (docs/FORMAT.md, "GGUF")."""

import json
import os
import struct

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


def write_model(path, alignment=None):
    """A tiny GGUF: a template with newlines, a 3-token vocabulary, an F32 and an F16
    tensor, and Q8_0 and Q4_K blocks stored as raw bytes."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_chat_template("{% for m in messages %}\n{{ m.content }}\n{% endfor %}")
    w.add_token_list(["<s>", "</s>", "hello"])
    w.add_eos_token_id(1)
    if alignment:
        w.add_custom_alignment(alignment)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 8)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(8, np.float16))
    w.add_tensor("blk.0.attn_q.weight", rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", rng.integers(0, 255, (2, 144), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def inspect(run, path):
    p = run("inspect", "--json", path)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("alignment", [None, 64])
def test_inspect_agrees_with_gguf_py(tmp_path, run, alignment):
    path = tmp_path / "tiny.gguf"
    write_model(path, alignment)
    got = inspect(run, path)
    reader = gguf.GGUFReader(str(path))
    assert got["format"] == "gguf" and got["version"] == 3
    assert got["alignment"] == (alignment or 32)
    assert [t["name"] for t in got["tensors"]] == [t.name for t in reader.tensors]
    for mine, theirs in zip(got["tensors"], reader.tensors):
        assert mine["ggml_type"] == theirs.tensor_type.name, mine
        assert mine["ne"] == [int(n) for n in theirs.shape], mine
        assert mine["nbytes"] == int(theirs.n_bytes), mine
        assert mine["file_offset"] == int(theirs.data_offset), mine
    # Block-quantized sizes from ggml's table: Q8_0 34 bytes per 32, Q4_K 144 per 256.
    q = {t["name"]: t for t in got["tensors"]}
    assert (q["blk.0.attn_q.weight"]["ne"], q["blk.0.attn_q.weight"]["nbytes"]) == ([64, 4], 4 * 2 * 34)
    assert (q["blk.0.ffn_up.weight"]["shape"], q["blk.0.ffn_up.weight"]["nbytes"]) == ([2, 256], 2 * 144)
    meta = got["metadata"]
    assert meta["general.name"] == {"type": "STRING", "value": "tiny"}
    assert meta["tokenizer.chat_template"]["value"].count("\n") == 2
    assert meta["tokenizer.ggml.tokens"] == {"type": "ARRAY", "value": {"item_type": "STRING", "len": 3}}
    assert meta["tokenizer.ggml.eos_token_id"] == {"type": "UINT32", "value": 1}
    text = run("inspect", path).stdout
    assert "GGUF v3, 4 tensors" in text and "Q4_K" in text and "tokenizer.ggml.tokens (ARRAY): \"[3 x STRING]\"" in text
    v = run("verify", path)
    assert v.returncode == 0 and f"{path}: ok (GGUF v3, 4 tensors" in v.stdout, v.stdout


def field_value_offset(path, key):
    """Byte offset of a key's value (after its type) in the file, by gguf-py's reader."""
    f = gguf.GGUFReader(str(path)).fields[key]
    return int(f.offset) + sum(p.nbytes for p in f.parts[:3])


def bent(tmp_path, run, change, expect):
    path = tmp_path / "bent.gguf"
    write_model(path)
    data = bytearray(path.read_bytes())
    change(data, path)
    path.write_bytes(bytes(data))
    p = run("verify", path)
    assert p.returncode == 1 and expect in p.stdout + p.stderr, p.stdout + p.stderr
    assert run("inspect", path).returncode == 1


def test_refusals_name_the_rule(tmp_path, run):
    def version(v):
        return lambda d, _: d.__setitem__(slice(4, 8), struct.pack("<I", v))
    bent(tmp_path, run, version(1), "ggml reads versions 2 and 3")
    bent(tmp_path, run, version(3 << 24), "big-endian")

    def retype(key, new_type):
        def go(d, path):
            f = gguf.GGUFReader(str(path)).fields[key]
            at = int(f.offset) + f.parts[0].nbytes + f.parts[1].nbytes
            d[at:at + 4] = struct.pack("<i", new_type)
        return go
    bent(tmp_path, run, retype("general.name", 13), 'key "general.name": unknown value type 13')

    def tensor_type(d, path):
        t = gguf.GGUFReader(str(path)).tensors[2]  # Q8_0
        at = int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:-2])
        assert struct.unpack("<i", d[at:at + 4])[0] == 8
        d[at:at + 4] = struct.pack("<i", 4)  # Q4_2, removed
    bent(tmp_path, run, tensor_type, 'tensor "blk.0.attn_q.weight": ggml type 4 is unknown or was removed')

    def offset(d, path):
        t = gguf.GGUFReader(str(path)).tensors[1]
        at = int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:-1])
        d[at:at + 8] = struct.pack("<Q", struct.unpack("<Q", d[at:at + 8])[0] + 32)
    bent(tmp_path, run, offset, 'tensor "output_norm.weight": its offset is')

    def cut(d, _):
        del d[len(d) - 100:]
    bent(tmp_path, run, cut, "past the end of the file")
