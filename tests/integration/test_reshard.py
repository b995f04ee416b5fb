"""The resharded view (docs/SEMANTICS.md, "Views"): `__views__/reshard/SIZE/` holds the
checkpoint split as `save_pretrained(max_shard_size=SIZE)` splits it. Judged against
huggingface_hub's own `split_state_dict_into_shards_factory` over the tensors in the order
`load_file` gives them from the export view, and read back with the official package."""

import errno
import json
import os
import shutil

import numpy as np
import pytest
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.numpy import load_file, save_file


def sample():
    """Layers that repeat shapes, a tensor larger than the small sizes, several dtypes."""
    rng = np.random.default_rng(5)
    t = {"embed": rng.standard_normal((40, 64)).astype(np.float32)}  # 10240 bytes
    for i in range(6):
        t[f"layers.{i}.w"] = rng.standard_normal((16, 16)).astype(np.float32)  # 1024
        t[f"layers.{i}.b"] = rng.standard_normal(16).astype(np.float16)  # 32
        t[f"layers.{i}.n"] = np.arange(i + 1, dtype=np.int64)
    t["empty"] = np.zeros((0, 3), np.float32)
    t["ünïcode"] = np.ones(3, np.uint8)
    return t


def hf_split(state_dict, size):
    """What huggingface_hub decides (sizes it cannot parse, KiB and plain bytes, as ints)."""
    units = {"KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}
    limit = size
    for u, m in units.items():
        if size.upper().endswith(u):
            limit = int(float(size[:-3]) * m)
    if size.isdigit():
        limit = int(size)
    return split_state_dict_into_shards_factory(
        state_dict, get_storage_size=lambda a: a.nbytes,
        filename_pattern="model{suffix}.safetensors", max_shard_size=limit)


def check_split(folder, export, size, metadata):
    """Folder `folder` (a reshard view, or a copy of one) holds `export` split at `size`."""
    sd = load_file(export)
    split = hf_split(sd, size)
    files = sorted(split.filename_to_tensors)
    want = files + (["model.safetensors.index.json"] if split.is_sharded else [])
    assert sorted(os.listdir(folder)) == sorted(want), size
    for name, keys in split.filename_to_tensors.items():
        path = os.path.join(folder, name)
        got = load_file(path)
        assert sorted(got) == sorted(keys), (size, name)
        for k in keys:
            assert got[k].dtype == sd[k].dtype and got[k].shape == sd[k].shape and got[k].tobytes() == sd[k].tobytes()
        with safe_open(path, "np") as f:
            assert f.metadata() == metadata
        # Laid out as save_file lays it out.
        with open(path, "rb") as f:
            assert f.read() == _saved(got, metadata)
    if split.is_sharded:
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            text = f.read()
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        assert text == json.dumps(index, indent=2, sort_keys=True) + "\n", size
    return split


def _saved(tensors, metadata):
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        save_file(tensors, f.name, metadata=metadata)
        with open(f.name, "rb") as g:
            return g.read()


SIZES = ["4KB", "3KiB", "0.0025MB", "2000", "11KB", "5GB", "0KB", "1e+1KB"]


def test_reshard_matches_hugging_face_and_follows_edits(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    meta = {"format": "pt"}
    save_file(sample(), str(src), metadata=meta)
    m = mount(src)
    views = os.path.join(m.path, "__views__")
    reshard = os.path.join(views, "reshard")
    assert os.listdir(reshard) == ["5GB"]
    export = os.path.join(views, "model.safetensors")
    counts = {}
    for size in SIZES:
        split = check_split(os.path.join(reshard, size), export, size, meta)
        counts[size] = len(split.filename_to_tensors)
    # The sizes tried give one shard, a few, and one per tensor (0KB: the empty tensor joins).
    assert counts["5GB"] == 1 and counts["4KB"] > 2 and counts["0KB"] >= len(sample()) - 1, counts
    # A name that is not a size is nothing; view files are read-only.
    for bad in ["5XB", "GB", "-1GB", "five"]:
        assert not os.path.exists(os.path.join(reshard, bad))
    with pytest.raises(OSError) as e:
        open(os.path.join(reshard, "4KB", "model-00001-of-00005.safetensors"), "r+b")
    assert e.value.errno in (errno.EROFS, errno.EACCES, errno.ENOENT)
    # It follows staged edits: a tensor dropped, another renamed, one rewritten.
    os.unlink(os.path.join(m.path, "embed"))
    os.rename(os.path.join(m.path, "layers.0.w"), os.path.join(m.path, "layers.9.w"))
    with open(os.path.join(m.path, "layers.1.w"), "r+b") as f:
        f.write(b"\x01" * 64)
    for size in SIZES:
        check_split(os.path.join(reshard, size), export, size, meta)
    # `cp -r` makes a sharded checkpoint that loads.
    out = tmp_path / "out"
    shutil.copytree(os.path.join(reshard, "4KB"), out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    merged = {}
    for f in set(index["weight_map"].values()):
        merged.update(load_file(str(out / f)))
    assert sorted(merged) == sorted(load_file(export))
    assert sorted(index["weight_map"]) == sorted(merged)


def test_reshard_of_a_folder_mount_merges_then_splits(tmp_path, mount):
    folder = tmp_path / "f"
    folder.mkdir()
    t = sample()
    names = sorted(t)
    parts = {"a": names[: len(names) // 2], "b": names[len(names) // 2:]}
    for shard, keys in parts.items():
        save_file({k: t[k] for k in keys}, str(folder / f"{shard}.safetensors"), metadata={"format": "pt"})
    (folder / "m.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f"{s}.safetensors" for s, ks in parts.items() for k in ks}}))
    m = mount(folder)
    views = os.path.join(m.path, "__views__")
    merged = os.path.join(views, "merged.safetensors")
    for size in ["4KB", "5GB", "2KiB"]:
        check_split(os.path.join(views, "reshard", size), merged, size, {"format": "pt"})


def test_reshard_of_a_checkpoint_without_tensors_is_empty(tmp_path, mount, run):
    """No tensors: no shard and no index, as save_pretrained writes nothing for them."""
    src = tmp_path / "m.safetensors"
    save_file({}, str(src))
    m = mount(src)
    for size in ["5GB", "1KB"]:
        assert os.listdir(os.path.join(m.path, "__views__", "reshard", size)) == []


def test_reshard_of_a_state_a_commit_would_refuse_is_einval_not_empty(tmp_path, mount):
    """A state that is no checkpoint (a meta that disagrees with its bytes): listing a
    split fails with EINVAL, as reading the other views does, so `cp -r` fails instead
    of copying an empty folder."""
    src = tmp_path / "m.safetensors"
    save_file(sample(), str(src))
    m = mount(src)
    with open(os.path.join(m.path, "embed.meta.json"), "w") as f:
        json.dump({"dtype": "F32", "shape": [41, 64]}, f)  # one row more than its bytes
    split = os.path.join(m.path, "__views__", "reshard", "4KB")
    with pytest.raises(OSError) as e:
        os.listdir(split)
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError):
        shutil.copytree(split, tmp_path / "out")
    with open(os.path.join(m.path, "embed.meta.json"), "w") as f:
        json.dump({"dtype": "F32", "shape": [40, 64]}, f)
    assert len(os.listdir(split)) > 2
