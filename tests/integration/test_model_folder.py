"""A model folder mounts as a model folder: the files beside the shards
(config, tokenizer, card...) are shown at the root with their bytes, owner,
mode and times, and every view folder (the export, each cast, each reshard)
holds them beside its safetensors files and index, `config.json` naming the
cast's dtype; so `cp -r` of a view gives a whole model. Checked against what
the test wrote: bytes, the official safetensors loader, ml_dtypes' casts."""

import json
import os
import shutil
import subprocess

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from test_remote import BUCKET, moto, s3  # noqa: F401 (fixtures)

CONFIG = """{
  "architectures": [
    "LlamaForCausalLM"
  ],
  "hidden_size": 64,
  "torch_dtype": "float32",
  "transformers_version": "4.57.0",
  "vocab_size": 1000
}
"""
OTHER_FILES = {
    "config.json": CONFIG,
    "generation_config.json": '{"bos_token_id": 1, "eos_token_id": 2}\n',
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}),
    "tokenizer_config.json": '{"chat_template": null, "model_max_length": 2048}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}\n",
    "README.md": "# tiny\n\nA model card: \u00e9\n",
}


def model_folder(folder, shard_count=2):
    """A folder as save_pretrained lays one out: F32 shards with their
    index, and the other files; returns the tensors."""
    folder.mkdir()
    rng = np.random.default_rng(5)
    tensors = {f"model.layers.{i}.w": rng.standard_normal((8, 16)).astype(np.float32) for i in range(4)}
    tensors["model.embed.ids"] = np.arange(12, dtype=np.int64)
    names = sorted(tensors)
    weight_map = {}
    for k in range(shard_count):
        shard = f"model-{k + 1:05d}-of-{shard_count:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shard_count]}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.nbytes for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    for name, text in OTHER_FILES.items():
        (folder / name).write_text(text)
    (folder / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    os.chmod(folder / "README.md", 0o640)
    return tensors


def bf16(a):
    return a.astype(ml_dtypes.bfloat16) if a.dtype == np.float32 else a


def assert_model_files(folder, cast=None):
    for name, text in OTHER_FILES.items():
        got = open(os.path.join(folder, name), "rb").read()
        want = text.encode()
        if name == "config.json" and cast:
            want = want.replace(b'"torch_dtype": "float32"', f'"torch_dtype": "{cast}"'.encode())
        assert got == want, name


def test_the_other_files_are_shown_at_the_root_as_they_are(tmp_path, mount):
    folder = tmp_path / "model"
    model_folder(folder)
    m = mount(folder)
    listed = sorted(os.listdir(m.path))
    assert listed == sorted(["model-00001-of-00002", "model-00002-of-00002", "model.safetensors.index.json",
                             *OTHER_FILES]), listed
    assert_model_files(m.path)
    for name in OTHER_FILES:
        st, src = os.stat(os.path.join(m.path, name)), os.stat(folder / name)
        assert (st.st_size, st.st_uid, st.st_gid, st.st_mtime_ns) == (src.st_size, src.st_uid, src.st_gid,
                                                                       src.st_mtime_ns), name
        assert st.st_mode & 0o777 == src.st_mode & 0o777, name
    # (Editing them is tests/integration/test_model_edits.py's.)


def test_every_view_folder_is_a_model_folder(tmp_path, mount):
    folder = tmp_path / "model"
    tensors = model_folder(folder)
    m = mount(folder)
    views = os.path.join(m.path, "__views__")
    assert set(OTHER_FILES) <= set(os.listdir(views))
    assert_model_files(views)
    # A cast: shards, index and other files; config.json names the dtype.
    out = tmp_path / "out-bf16"
    subprocess.run(["cp", "-r", os.path.join(views, "bf16"), str(out)], check=True)
    assert_model_files(out, cast="bfloat16")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(out / shard)))
    assert sorted(loaded) == sorted(tensors) == sorted(index["weight_map"])
    for name, t in tensors.items():
        assert loaded[name].tobytes() == bf16(t).tobytes(), name
    assert index["metadata"]["total_size"] == sum(bf16(t).nbytes for t in tensors.values())
    # f32 of an f32 model: the config says so as it did.
    assert_model_files(os.path.join(views, "f32"), cast="float32")
    # A reshard: its own index beside the other files (the config as it is).
    re = os.path.join(views, "reshard", "1KB")
    assert_model_files(re)
    assert "model.safetensors.index.json" in os.listdir(re)
    resharded = {}
    for shard in sorted(set(json.load(open(os.path.join(re, "model.safetensors.index.json")))["weight_map"].values())):
        resharded.update(load_file(os.path.join(re, shard)))
    assert {k: v.tobytes() for k, v in resharded.items()} == {k: v.tobytes() for k, v in tensors.items()}


def test_a_hub_snapshot_of_links_into_blobs_mounts_the_same(tmp_path, mount):
    """huggingface_hub's cache: snapshots/REV/ holds links into blobs/."""
    src = tmp_path / "src"
    model_folder(src)
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for f in src.iterdir():
        blob = repo / "blobs" / f"blob{abs(hash(f.name))}"
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    m = mount(snap)
    assert set(OTHER_FILES) <= set(os.listdir(m.path))
    assert_model_files(m.path)
    assert_model_files(os.path.join(m.path, "__views__", "f16"), cast="float16")


def test_big_files_are_left_out_and_said(tmp_path, mount):
    folder = tmp_path / "model"
    model_folder(folder)
    with open(folder / "merges.txt", "wb") as f:
        f.truncate((64 << 20) + 1)  # sparse: over the limit of one file
    m = mount(folder)
    assert "merges.txt" not in os.listdir(m.path)
    assert "merges.txt: not shown in the mount" in m.result.stderr, m.result.stderr
    assert_model_files(m.path)


def test_subfolders_and_weights_of_other_formats_are_left_out_and_said(tmp_path, mount):
    """A view is the safetensors model: an export in bf16 carries no fp32
    pytorch_model.bin, and what is left out is said at mount (hidden files
    are left out quietly)."""
    folder = tmp_path / "model"
    model_folder(folder)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"onnx")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text("{}")
    for name in ("pytorch_model.bin", "training_args.bin", "model.pt"):
        (folder / name).write_bytes(b"pickle")
    m = mount(folder)
    for where in (m.path, os.path.join(m.path, "__views__"), os.path.join(m.path, "__views__", "bf16")):
        shown = set(os.listdir(where))
        assert not shown & {"onnx", "1_Pooling", "pytorch_model.bin", "training_args.bin", "model.pt",
                            ".gitattributes"}, (where, shown)
    assert_model_files(os.path.join(m.path, "__views__", "bf16"), cast="bfloat16")
    said = [line for line in m.result.stderr.splitlines() if "not shown in the mount" in line]
    assert len(said) == 1, m.result.stderr
    for name in ("1_Pooling/ (a subfolder)", "onnx/ (a subfolder)", "pytorch_model.bin (weights of another format)",
                 "training_args.bin (weights", "model.pt (weights"):
        assert name in said[0], said
    assert ".gitattributes" not in said[0]


def test_a_single_file_mount_shows_no_model_files(tmp_path, mount):
    folder = tmp_path / "model"
    model_folder(folder, shard_count=1)
    m = mount(folder / "model-00001-of-00001.safetensors")
    assert not set(OTHER_FILES) & set(os.listdir(m.path))
    assert not set(OTHER_FILES) & set(os.listdir(os.path.join(m.path, "__views__", "bf16")))


def test_an_s3_prefix_with_a_config_beside_its_shards(tmp_path, s3, mount):  # noqa: F811
    folder = tmp_path / "model"
    tensors = model_folder(folder)
    for f in folder.iterdir():
        s3.upload(f, f"modelfolder/{f.name}")
    m = mount(f"s3://{BUCKET}/modelfolder/", *s3.options)
    assert set(OTHER_FILES) <= set(os.listdir(m.path))
    assert_model_files(m.path)
    out = tmp_path / "out"
    subprocess.run(["cp", "-r", os.path.join(m.path, "__views__", "bf16"), str(out)], check=True)
    assert_model_files(out, cast="bfloat16")
    shards = sorted(p for p in out.iterdir() if p.name.startswith("model-"))
    loaded = {k: v for p in shards for k, v in load_file(str(p)).items()}
    assert {k: v.tobytes() for k, v in loaded.items()} == {k: bf16(v).tobytes() for k, v in tensors.items()}


def test_verify_takes_an_export_beside_the_shards_for_a_copy_not_a_stray_shard(tmp_path, mount, run):
    """`stfs verify` of a mount's __views__ (the shards, their index and the merged
    export) and of its `cp -r`: the merged file is a copy of tensors the index maps to
    other files, not a shard it forgot; a file with a tensor the index lacks still is."""
    folder = tmp_path / "model"
    model_folder(folder)
    p = run("inspect", folder)  # (one file's header: it says what checks a folder)
    assert p.returncode != 0 and f"stfs verify {folder}" in p.stderr, p.stderr
    m = mount(folder)
    views = os.path.join(m.path, "__views__")
    p = run("verify", views)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "merged.safetensors: not a shard of model.safetensors.index.json" in p.stdout, p.stdout
    out = tmp_path / "out"
    shutil.copytree(views, out)
    assert run("verify", out).returncode == 0
    os.chmod(out, 0o755)  # (a view's folder has no write bit, nor has its copy)
    save_file({"stray": np.zeros(2, np.float32)}, str(out / "extra.safetensors"))
    p = run("verify", out)
    assert p.returncode != 0 and "tensor \"stray\" of \"extra.safetensors\" is missing from weight_map" in p.stdout + p.stderr, p.stdout + p.stderr
