"""Views (docs/SEMANTICS.md, "Views"): `MNT/__views__/` holds read-only safetensors files computed from the
staged state on every read: the checkpoint as `stfs commit --compact` would write it now,
and the same cast to BF16, F16 or F32. Judged with the official package, numpy and
ml_dtypes."""

import errno
import json
import mmap
import os
import random
import shutil
import time

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from stfs_fixtures import save_raw, sh, write_by_hand


def tensors():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((64, 33)).astype(np.float32)
    w[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    w[1, :3] = [1e-40, 3.4e38, -65519.0]  # a subnormal, one past BF16's range, F16's edge
    return {
        "w": w,
        "h": rng.standard_normal(100).astype(np.float16),
        # Halfway cases for a single rounding to F16 (numpy) and to BF16 (ml_dtypes) that
        # double rounding through F32 gets wrong.
        "d": np.concatenate([rng.standard_normal(9), [1 + 2**-11 + 2**-40, -(1 + 2**-11 + 2**-40), 2049.0000001,
                                                     1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 2**-134 + 2**-170]]).reshape(3, 5),
        "ids": np.arange(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
    }


def reference(t, metadata, path):
    save_file(t, str(path), metadata=metadata)
    return path.read_bytes()


def mounted_sample(tmp_path, mount):
    """The sample tensors saved by save_file (with metadata) and mounted: (source, tensors,
    its bytes, the mount, its export view)."""
    src = tmp_path / "m.safetensors"
    t = tensors()
    save_file(t, str(src), metadata={"format": "pt"})
    m = mount(src)
    return src, t, src.read_bytes(), m, os.path.join(m.path, "__views__", "model.safetensors")


def test_the_export_view_is_the_compact_commit_and_follows_edits(tmp_path, mount, run):
    src, t, before, m, view = mounted_sample(tmp_path, mount)
    assert sorted(os.listdir(os.path.join(m.path, "__views__"))) == ["bf16", "f16", "f32", "model.safetensors", "npy", "reshard"]
    # Reached by name, not listed: cp -r, rsync and find of the mount see the checkpoint only.
    assert "__views__" not in os.listdir(m.path)
    assert open(view, "rb").read() == before
    # Edits show at once, in the view's size and bytes; the source stays as it was.
    sh(f"mv {m.path}/w {m.path}/weight")
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump({"format": "np"}, f)
    with open(os.path.join(m.path, "ids.meta.json"), "w") as f:
        json.dump({"dtype": "I64", "shape": [7, 1]}, f)
    extra = np.arange(12, dtype=np.uint8)
    with open(os.path.join(m.path, "extra"), "wb") as f:
        f.write(extra.tobytes())
    with open(os.path.join(m.path, "extra.meta.json"), "w") as f:
        json.dump({"dtype": "U8", "shape": [3, 4]}, f)
    t["weight"] = t.pop("w")
    t["ids"] = t["ids"].reshape(7, 1)
    t["extra"] = extra.reshape(3, 4)
    want = reference(t, {"format": "np"}, tmp_path / "ref.safetensors")
    assert os.stat(view).st_size == len(want)
    assert open(view, "rb").read() == want
    assert src.read_bytes() == before
    got = load_file(view)
    assert all(got[k].tobytes() == v.tobytes() for k, v in t.items())
    # Any offset and size, as a loader's preads ask.
    fd = os.open(view, os.O_RDONLY)
    try:
        rnd = random.Random(5)
        for _ in range(200):
            off = rnd.randrange(len(want))
            n = rnd.randrange(1, 5000)
            assert os.pread(fd, n, off) == want[off:off + n], (off, n)
    finally:
        os.close(fd)
    # cp exports it; the commit then writes the same checkpoint.
    shutil.copyfile(view, tmp_path / "export.safetensors")
    assert (tmp_path / "export.safetensors").read_bytes() == want
    assert run("commit", "--compact", m.path).returncode == 0
    assert src.read_bytes() == want


def test_cast_views_match_ml_dtypes_and_numpy_bit_for_bit(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    t = tensors()
    save_file(t, str(src), metadata={"format": "pt"})
    m = mount(src)
    casts = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
    for folder, dtype in casts.items():
        path = os.path.join(m.path, "__views__", folder, "model.safetensors")
        with safe_open(path, framework="np") as f:
            assert f.metadata() == {"format": "pt"}
            names = sorted(f.keys())
        assert names == sorted(t)
        raw = open(path, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, v in t.items():
            info = header[name]
            data = raw[8 + n + info["data_offsets"][0]:8 + n + info["data_offsets"][1]]
            if v.dtype.kind == "f":
                # F64 rounds once, to BF16 as ml_dtypes (0.7 and later) does, to F16 as numpy does.
                with np.errstate(over="ignore"):  # past F16's range: infinity, as intended
                    expected = np.asarray(v).astype(dtype)
                assert info["dtype"] == folder.upper(), (folder, name)
                assert data == expected.tobytes(), (folder, name)
            else:
                assert info["dtype"] == {"int64": "I64", "bool": "BOOL"}[str(v.dtype)]
                assert data == v.tobytes(), (folder, name)
        assert info["shape"] == list(t["mask"].shape)
    # Specials are kept: NaN, infinities, the sign of zero.
    bf = load_file(os.path.join(m.path, "__views__", "f32", "model.safetensors"))["w"]
    assert np.isnan(bf[0, 0]) and bf[0, 1] == np.inf and bf[0, 2] == -np.inf and np.signbit(bf[0, 3])


def test_a_descriptor_of_a_view_keeps_its_bytes_across_edits(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    t = tensors()
    save_file(t, str(src))
    m = mount(src)
    view = os.path.join(m.path, "__views__", "model.safetensors")
    fd = os.open(view, os.O_RDONLY)
    try:
        before = os.pread(fd, 1 << 20, 0)
        with open(os.path.join(m.path, "grow"), "wb") as f:
            f.write(np.zeros(5000, np.uint16).tobytes())
        with open(os.path.join(m.path, "grow.meta.json"), "w") as f:
            json.dump({"dtype": "U16", "shape": [5000]}, f)
        assert os.stat(view).st_size > len(before)  # a new stat sees the edit
        # The descriptor reads the view as it opened it, to its end.
        got, off = b"", 0
        while chunk := os.pread(fd, 4096, off):
            got, off = got + chunk, off + len(chunk)
        assert got == before
    finally:
        os.close(fd)
    assert open(view, "rb").read() != before  # a new open reads the new view


def test_views_are_read_only_and_reserved(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    save_file({"__views__": np.zeros(3, np.uint8), "x": np.ones(2, np.float32)}, str(src))
    m = mount(src)
    # A tensor named __views__ is escaped, as __metadata__.json is.
    assert "%5F_views__" in os.listdir(m.path)
    assert open(os.path.join(m.path, "%5F_views__"), "rb").read() == b"\0\0\0"
    view = os.path.join(m.path, "__views__", "model.safetensors")
    for attempt in (lambda: open(view, "r+b"), lambda: os.unlink(view), lambda: os.truncate(view, 0),
                    lambda: open(os.path.join(m.path, "__views__", "new"), "wb"),
                    lambda: os.unlink(os.path.join(m.path, "__views__"))):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno in (errno.EROFS, errno.EACCES, errno.EISDIR, errno.EPERM), e.value
    # Folders, nodes and links: the views are read-only; elsewhere, not supported.
    for make in (lambda p: os.mkdir(p), lambda p: os.mkfifo(p), lambda p: os.symlink("x", p)):
        with pytest.raises(OSError) as e:
            make(os.path.join(m.path, "__views__", "made"))
        # (A user other than root meets the folder's mode first: EACCES.)
        assert e.value.errno == (errno.EROFS if os.geteuid() == 0 else errno.EACCES), e.value
        with pytest.raises(OSError) as e:
            make(os.path.join(m.path, "made"))
        assert e.value.errno == errno.EOPNOTSUPP, e.value
    assert os.stat(view).st_mode & 0o222 == 0
    # A state a commit would refuse has no view: EINVAL, and the log says why.
    with open(os.path.join(m.path, "x.meta.json"), "w") as f:
        json.dump({"dtype": "F32", "shape": [3]}, f)
    with pytest.raises(OSError) as e:
        open(view, "rb").read()
    assert e.value.errno == errno.EINVAL


def test_read_only_and_folder_mounts_have_views(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    t = tensors()
    save_file(t, str(src))
    m = mount(src, "-o", "ro")
    assert open(os.path.join(m.path, "__views__", "model.safetensors"), "rb").read() == src.read_bytes()
    folder = tmp_path / "model"
    folder.mkdir()
    parts = {"a": {k: t[k] for k in ("w", "h")}, "b": {k: t[k] for k in ("d", "ids", "mask")}}
    for name, part in parts.items():
        save_file(part, str(folder / f"{name}.safetensors"), metadata={"shard": name})
    (folder / "m.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f"{s}.safetensors" for s, p in parts.items() for k in p}}))
    f = mount(folder)
    views = os.path.join(f.path, "__views__")
    assert sorted(os.listdir(views)) == ["a.safetensors", "b.safetensors", "bf16", "f16", "f32", "m.safetensors.index.json",
                                         "merged.safetensors", "npy", "reshard"]
    for name in parts:
        assert open(os.path.join(views, f"{name}.safetensors"), "rb").read() == (folder / f"{name}.safetensors").read_bytes()
    # One file with every tensor of every shard; the first shard's metadata keys win.
    sh(f"mv {f.path}/b/ids {f.path}/a/ids && mv {f.path}/b/ids.meta.json {f.path}/a/ids.meta.json")
    merged = load_file(os.path.join(views, "merged.safetensors"))
    assert sorted(merged) == sorted(t) and all(merged[k].tobytes() == v.tobytes() for k, v in t.items())
    with safe_open(os.path.join(views, "merged.safetensors"), framework="np") as g:
        assert g.metadata() == {"shard": "a"}
    assert "ids" in load_file(os.path.join(views, "a.safetensors"))
    # The index as the commit would write it; the one on disk waits for the commit.
    index = json.loads(open(os.path.join(views, "m.safetensors.index.json")).read())
    assert index["weight_map"] == {"w": "a.safetensors", "h": "a.safetensors", "ids": "a.safetensors",
                                   "d": "b.safetensors", "mask": "b.safetensors"}
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in t.values())
    assert json.loads((folder / "m.safetensors.index.json").read_text())["weight_map"]["ids"] == "b.safetensors"
    # A cast folder is the model once: its shards and index, not the merged file too.
    assert sorted(os.listdir(os.path.join(views, "bf16"))) == ["a.safetensors", "b.safetensors",
                                                               "m.safetensors.index.json"]
    assert not os.path.exists(os.path.join(views, "bf16", "merged.safetensors"))
    cast = {k: v for s in ("a", "b") for k, v in load_file(os.path.join(views, "bf16", f"{s}.safetensors")).items()}
    assert sorted(cast) == sorted(t)


def test_npy_views_load_with_numpy_for_every_dtype_and_follow_edits(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    rng = np.random.default_rng(3)
    arrays = {
        "f32": rng.standard_normal((4, 5)).astype(np.float32),
        "f64": rng.standard_normal(3),
        "f16": rng.standard_normal((2, 2, 2)).astype(np.float16),
        "c64": (rng.standard_normal(3) + 1j).astype(np.complex64),
        "i64": np.arange(-3, 3, dtype=np.int64),
        "u16": np.arange(6, dtype=np.uint16).reshape(2, 3),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 3), np.int32),
        "a/b.c": np.ones(2, np.uint8),  # shown as a%2Fb.c.npy
        # Headers numpy grows past 64 or 128 bytes (room for the first axis, a full pad).
        "many": np.arange(1, dtype=np.uint8).reshape((1,) * 15),
        "deep": np.zeros((2,) * 12, np.int16),
        "wide": np.zeros((123456789, 0), np.float32),
    }
    bf16 = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    f8 = rng.standard_normal(8).astype(ml_dtypes.float8_e4m3fn)
    raw = {"bf16": ("BF16", [3, 4], bf16.tobytes()), "f8": ("F8_E4M3", [8], f8.tobytes())}
    save_raw(str(src), raw, arrays=arrays)
    m = mount(src)
    npy = os.path.join(m.path, "__views__", "npy")
    names = sorted(os.listdir(npy))
    assert names == sorted(["a%2Fb.c.npy"] + [k + ".npy" for k in arrays if k != "a/b.c"] + ["bf16.npy", "f8.npy"])
    for name, a in arrays.items():
        path = os.path.join(npy, name.replace("/", "%2F") + ".npy")
        got = np.load(path)
        assert got.dtype == a.dtype and got.shape == a.shape, name
        assert got.tobytes() == a.tobytes(), name
        assert os.stat(path).st_size == os.path.getsize(path) == len(open(path, "rb").read())
        # numpy's own writer: the same bytes (header padding, version, layout).
        ref = tmp_path / "ref.npy"
        np.save(ref, a)
        assert open(path, "rb").read() == ref.read_bytes(), name
    # No numpy name: BF16 as <u2 and F8 as |u1, to be viewed as ml_dtypes types.
    got = np.load(os.path.join(npy, "bf16.npy"))
    assert got.dtype == np.uint16 and got.shape == (3, 4)
    assert np.array_equal(got.view(ml_dtypes.bfloat16), bf16, equal_nan=True)
    got = np.load(os.path.join(npy, "f8.npy"))
    assert got.dtype == np.uint8 and got.view(ml_dtypes.float8_e4m3fn).tobytes() == f8.tobytes()
    # A memory-mapped load reads the same.
    assert np.array_equal(np.load(os.path.join(npy, "f32.npy"), mmap_mode="r"), arrays["f32"])
    # Edits show at once: a rename, a reshape, new bytes, a removal.
    sh(f"mv {m.path}/f32 {m.path}/weight && rm {m.path}/i64")
    with open(os.path.join(m.path, "u16.meta.json"), "w") as f:
        json.dump({"dtype": "U16", "shape": [6]}, f)
    new = np.arange(20, dtype=np.float32)[::-1].copy()
    with open(os.path.join(m.path, "weight"), "r+b") as f:
        f.write(new.tobytes())
    assert not os.path.exists(os.path.join(npy, "f32.npy")) and not os.path.exists(os.path.join(npy, "i64.npy"))
    assert np.array_equal(np.load(os.path.join(npy, "weight.npy")), new.reshape(4, 5))
    assert np.load(os.path.join(npy, "u16.npy")).shape == (6,)
    # A tensor whose bytes do not match its meta has no .npy view; read-only.
    with open(os.path.join(m.path, "weight"), "ab") as f:
        f.write(b"xx")
    assert "weight.npy" not in os.listdir(npy)
    with pytest.raises(OSError) as e:
        open(os.path.join(npy, "f64.npy"), "r+b")
    assert e.value.errno in (errno.EROFS, errno.EACCES)


def test_npy_views_of_packed_dtypes_and_folder_mounts(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    scalar = np.array(7.5, dtype=np.float32)
    write_by_hand(str(src), [("f6", "F6_E2M3", [4, 4], bytes(range(12))), ("s", "F32", [], scalar.tobytes())])
    m = mount(src)
    got = np.load(os.path.join(m.path, "__views__", "npy", "s.npy"))
    assert got.shape == () and got == scalar
    got = np.load(os.path.join(m.path, "__views__", "npy", "f6.npy"))
    assert got.dtype == np.uint8 and got.shape == (12,) and got.tobytes() == bytes(range(12))
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"x": np.ones(3, np.float32)}, str(folder / "a.safetensors"))
    save_file({"y": np.zeros(2, np.int16)}, str(folder / "b.safetensors"))
    f = mount(folder)
    npy = os.path.join(f.path, "__views__", "npy")
    assert sorted(os.listdir(npy)) == ["a", "b"]
    assert os.listdir(os.path.join(npy, "b")) == ["y.npy"]
    assert np.array_equal(np.load(os.path.join(npy, "a", "x.npy")), np.ones(3, np.float32))
    sh(f"mv {f.path}/a/x {f.path}/b/x && mv {f.path}/a/x.meta.json {f.path}/b/x.meta.json")
    assert sorted(os.listdir(os.path.join(npy, "b"))) == ["x.npy", "y.npy"] and os.listdir(os.path.join(npy, "a")) == []


def read_while_daemon_stopped(m, fd, n, off):
    """pread through a descriptor while the daemon is stopped (SIGSTOP): only
    a read the kernel serves without the daemon (passthrough) returns."""
    import signal
    import threading
    got = []
    os.kill(m.pid, signal.SIGSTOP)
    try:
        # (The signal takes effect a moment later: every thread stopped
        # first, or a busy machine lets the daemon answer in between.)
        def stopped():
            tasks = os.listdir(f"/proc/{m.pid}/task")
            return all(open(f"/proc/{m.pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] in "Tt"
                       for t in tasks)
        deadline = time.monotonic() + 10
        while not stopped():
            assert time.monotonic() < deadline, "the daemon did not stop"
            time.sleep(0.01)
        t = threading.Thread(target=lambda: got.append(os.pread(fd, n, off)), daemon=True)
        t.start()
        t.join(5)
        while_stopped = list(got)
    finally:
        os.kill(m.pid, signal.SIGCONT)
    t.join(30)
    assert not t.is_alive() and len(got) == 1
    return while_stopped, got[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="kernel passthrough needs CAP_SYS_ADMIN in the daemon")
def test_a_view_that_is_the_source_file_is_served_by_the_kernel(tmp_path, mount, run):
    src, t, before, m, view = mounted_sample(tmp_path, mount)
    # Unedited, written by save_file: the view is the source file, and the kernel reads it
    # without the daemon (a read answered while the daemon is stopped).
    fd = os.open(view, os.O_RDONLY)
    try:
        got, _ = read_while_daemon_stopped(m, fd, len(before), 0)
        assert got == [before]
        assert os.fstat(fd).st_size == len(before)
        # Loaders that map the file (safe_open, np.memmap) read the same through it.
        with safe_open(view, framework="np") as f:
            assert f.metadata() == {"format": "pt"} and np.array_equal(f.get_tensor("w"), t["w"], equal_nan=True)
        assert bytes(np.memmap(view, mode="r")) == before
        # An edit: new opens get the generated view; this descriptor keeps reading the file.
        with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
            json.dump({"format": "np"}, f)
        want = reference(t, {"format": "np"}, tmp_path / "ref.safetensors")
        assert open(view, "rb").read() == want
        assert os.pread(fd, len(before), 0) == before
        # A commit while the file is open through the view cannot write it in place
        # (the kernel's open of the source counts as another reader): it rewrites.
        p = run("commit", m.path)
        assert p.returncode == 0 and "committed by a rewrite (not in place:" in p.stdout, p.stdout + p.stderr
        assert os.pread(fd, len(before), 0) == before
        assert os.fstat(fd).st_size == len(before)
    finally:
        os.close(fd)
    assert src.read_bytes() != before and load_file(str(src))["w"].tobytes() == t["w"].tobytes()
    # After a commit with --compact the view is the (new) source file again.
    assert run("commit", "--compact", m.path).returncode == 0
    fd = os.open(view, os.O_RDONLY)
    try:
        got, _ = read_while_daemon_stopped(m, fd, 100, 0)
        assert got == [src.read_bytes()[:100]]
    finally:
        os.close(fd)


def test_a_generated_view_is_served_by_the_daemon(tmp_path, mount):
    """The control of the test above: a view that is not the source file is read through the
    daemon, so a read waits while the daemon is stopped."""
    src = tmp_path / "m.safetensors"
    save_file(tensors(), str(src))
    m = mount(src)
    fd = os.open(os.path.join(m.path, "__views__", "bf16", "model.safetensors"), os.O_RDONLY)
    try:
        while_stopped, got = read_while_daemon_stopped(m, fd, 100, 0)
        assert while_stopped == [] and len(got) == 100  # answered once the daemon went on
    finally:
        os.close(fd)


def test_views_of_a_source_cut_short_behind_the_mount(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    save_file(tensors(), str(src))
    m = mount(src)
    os.truncate(src, 16)  # another program cuts the file inside its header
    view = os.path.join(m.path, "__views__", "model.safetensors")
    # No longer the source file (so not served by it): the tensor bytes are gone, EIO.
    with pytest.raises(OSError) as e:
        open(view, "rb").read()
    assert e.value.errno == errno.EIO
    with pytest.raises(OSError) as e:
        np.load(os.path.join(m.path, "__views__", "npy", "w.npy"))
    assert e.value.errno == errno.EIO
    # The daemon is alive.
    assert "w.meta.json" in os.listdir(m.path)


def test_shards_named_like_views_do_not_hide_them(tmp_path, mount):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(folder / "__views__.safetensors"))
    save_file({"b": np.zeros(3, np.int8)}, str(folder / "merged.safetensors"))
    save_file({"c": np.arange(4, dtype=np.int64)}, str(folder / "npy.safetensors"))
    save_file({"d": np.ones(1, np.uint8)}, str(folder / "%5F_views__.safetensors"))
    f = mount(folder)
    # The shard __views__ is shown escaped, as a tensor of that name is, and a shard already
    # named like that gets a %25 more (no two shards share a directory); __views__ is the views.
    assert sorted(os.listdir(f.path)) == ["%25%5F_views__", "%5F_views__", "merged", "npy"]
    assert "d" in os.listdir(os.path.join(f.path, "%25%5F_views__"))
    assert {"a", "a.meta.json"} <= set(os.listdir(os.path.join(f.path, "%5F_views__")))
    views = os.path.join(f.path, "__views__")
    # The merged view steps aside for the shard named merged.
    assert sorted(os.listdir(views)) == ["%5F_views__.safetensors", "__views__.safetensors", "_merged.safetensors",
                                         "bf16", "f16", "f32", "merged.safetensors", "npy", "npy.safetensors", "reshard"]
    assert sorted(load_file(os.path.join(views, "_merged.safetensors"))) == ["a", "b", "c", "d"]
    assert sorted(load_file(os.path.join(views, "merged.safetensors"))) == ["b"]
    assert sorted(os.listdir(os.path.join(views, "npy"))) == ["%25%5F_views__", "%5F_views__", "merged", "npy"]
    assert np.array_equal(np.load(os.path.join(views, "npy", "%5F_views__", "a.npy")), np.ones(2, np.float32))
    # Over-long names: ENAMETOOLONG, as anywhere.
    with pytest.raises(OSError) as e:
        os.stat(os.path.join(views, "x" * 300))
    assert e.value.errno == errno.ENAMETOOLONG


def test_views_change_their_mtime_with_every_edit(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(16, np.uint8), "b": np.ones(4, np.float32)}, str(src))
    m = mount(src)
    views = os.path.join(m.path, "__views__")
    paths = [os.path.join(views, "model.safetensors"), os.path.join(views, "bf16", "model.safetensors"),
             os.path.join(views, "npy", "a.npy")]
    out = tmp_path / "out"
    sh(f"rsync -a {views}/ {out}/")
    for edit in range(2):  # the first write stages the tensor; the second writes into its staging file
        before = {p: os.stat(p) for p in paths}
        time.sleep(1.1)  # rsync's quick check compares whole seconds
        sh(f"printf 'XYZ{edit}' | dd of={m.path}/a bs=4 seek=1 conv=notrunc status=none")
        for p in paths:
            now = os.stat(p)
            assert now.st_size == before[p].st_size and now.st_mtime_ns > before[p].st_mtime_ns, p
        # rsync (size + mtime) sees the edit.
        sh(f"rsync -a {views}/ {out}/")
        assert (out / "npy" / "a.npy").read_bytes() == open(paths[2], "rb").read()
        assert (out / "npy" / "a.npy").read_bytes()[-12:-8] == f"XYZ{edit}".encode()


def test_a_view_descriptor_keeps_its_bytes_when_a_staged_tensor_is_written_again(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(8, np.uint8)}, str(src))
    m = mount(src)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(b"AAAA")  # staged now
    npy = os.path.join(m.path, "__views__", "npy", "a.npy")
    with open(npy, "rb") as held:
        with open(os.path.join(m.path, "a"), "r+b") as f:
            f.write(b"BBBB")  # into the staged tensor, while the view is open
        assert held.read()[-8:] == b"AAAA\0\0\0\0"
    assert open(npy, "rb").read()[-8:] == b"BBBB\0\0\0\0"


def test_cast_and_npy_views_can_be_mapped_with_the_page_cache_kept(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    t = tensors()
    save_file(t, str(src))
    m = mount(src, "-o", "cache=keep")
    assert np.array_equal(np.load(os.path.join(m.path, "__views__", "npy", "h.npy"), mmap_mode="r"), t["h"])
    with open(os.path.join(m.path, "__views__", "bf16", "model.safetensors"), "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        assert mm[:8] == f.read(8)
        mm.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="kernel passthrough needs CAP_SYS_ADMIN in the daemon")
def test_opens_racing_edits_that_switch_passthrough_never_fail(tmp_path, mount):
    """The export view switches between the source file (passthrough, an inode of its own)
    and a generated file with every edit of the metadata: readers opening it all the while
    never see an error (the kernel retries a stale inode once; an open racing an edit while
    another descriptor reads the file gets that file)."""
    import threading
    src = tmp_path / "m.safetensors"
    save_file(tensors(), str(src), metadata={"format": "pt"})
    original = src.read_bytes()
    m = mount(src)
    view = os.path.join(m.path, "__views__", "model.safetensors")
    meta = os.path.join(m.path, "__metadata__.json")
    stop, errors, opens = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            try:
                fd = os.open(view, os.O_RDONLY)
                try:
                    head = os.pread(fd, 8, 0)
                    assert len(head) == 8
                finally:
                    os.close(fd)
                opens[0] += 1
            except Exception as e:  # noqa: BLE001 - every error is a failure here
                errors.append(repr(e))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 4
        k = 0
        while time.monotonic() < deadline:
            with open(meta, "r+") as f:  # same length, applied whole at close
                f.write('{"format": "np"}' if k % 2 == 0 else '{"format": "pt"}')
            k += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == [] and opens[0] > 100, (errors[:5], opens[0])
    assert open(view, "rb").read() == (original if k % 2 == 0 else open(view, "rb").read())


def test_a_tensor_copied_into_a_second_shard_is_a_problem_not_a_silent_index(tmp_path, mount, run):
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": np.ones(2, np.float32)}, str(folder / "a.safetensors"))
    save_file({"v": np.zeros(3, np.int8)}, str(folder / "b.safetensors"))
    (folder / "m.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w": "a.safetensors", "v": "b.safetensors"}}))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    f = mount(folder)
    sh(f"cp {f.path}/a/w {f.path}/a/w.meta.json {f.path}/b/")
    p = run("status", f.path)
    assert p.returncode == 1 and 'tensor "w" is in two shards, a.safetensors and b.safetensors' in p.stdout, p.stdout
    p = run("commit", f.path)
    assert p.returncode != 0 and "is in two shards" in p.stderr, p.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")} == before
    views = os.path.join(f.path, "__views__")
    for name in ("merged.safetensors", "m.safetensors.index.json"):
        with pytest.raises(OSError) as e:
            open(os.path.join(views, name), "rb").read()
        assert e.value.errno == errno.EINVAL, name
    # Each shard on its own is still a valid file.
    assert sorted(load_file(os.path.join(views, "b.safetensors"))) == ["v", "w"]
    os.unlink(os.path.join(f.path, "a", "w"))
    assert run("commit", f.path).returncode == 0
    assert json.loads((folder / "m.safetensors.index.json").read_text())["weight_map"] == {"w": "b.safetensors",
                                                                                          "v": "b.safetensors"}


def test_every_view_reads_the_same_at_any_offset_and_size(tmp_path, mount):
    """Reads of every generated view (export, casts, npy, reshard, shards, merged, index) at
    random offsets with odd sizes (1-7 bytes, across element and tensor boundaries,
    and larger) give the same bytes as a whole read; views have no write bits."""
    folder = tmp_path / "f"
    folder.mkdir()
    t = tensors()
    save_file({k: t[k] for k in ("w", "ids")}, str(folder / "a.safetensors"), metadata={"k": "v"})
    save_file({k: t[k] for k in ("h", "d", "mask")}, str(folder / "b.safetensors"))
    weight_map = {"w": "a.safetensors", "ids": "a.safetensors", "h": "b.safetensors", "d": "b.safetensors",
                  "mask": "b.safetensors"}
    (folder / "m.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    m = mount(folder)
    # An edit: every view is generated by the daemon (none is the source file itself).
    for shard, name in (("a", "w"), ("b", "h")):
        with open(os.path.join(m.path, shard, name), "r+b") as f:
            f.write(b"\x00\x00\x80\x3f")
    views = os.path.join(m.path, "__views__")
    paths = sorted(os.path.join(d, f) for d, _, files in os.walk(views) for f in files)
    kinds = {os.path.relpath(p, views).split(os.sep)[0] for p in paths}
    assert {"bf16", "f16", "f32", "npy", "reshard", "merged.safetensors", "a.safetensors", "m.safetensors.index.json"} <= kinds, kinds
    rng = random.Random(7)
    for p in paths:
        whole = open(p, "rb").read()
        assert len(whole) == os.stat(p).st_size and os.stat(p).st_mode & 0o222 == 0, p
        fd = os.open(p, os.O_RDONLY)
        try:
            for _ in range(120):
                size = rng.choice([1, 2, 3, 5, 7, rng.randrange(1, 9000)])
                off = rng.randrange(0, len(whole) + 1)
                assert os.pread(fd, size, off) == whole[off:off + size], (p, off, size)
        finally:
            os.close(fd)


def test_a_write_that_changes_a_staged_tensors_length_changes_every_view(tmp_path, mount):
    """Appends to and truncations of a tensor already staged move no state version (its
    bytes stay where they are), yet every view must be laid out anew."""
    src = tmp_path / "m.safetensors"
    save_file({"big": np.arange(3000, dtype=np.float32), "x": np.ones(4, np.float32)}, str(src))
    m = mount(src)
    views = os.path.join(m.path, "__views__")
    big = os.path.join(m.path, "big")
    with open(big, "r+b") as f:
        f.write(np.full(3000, 2, np.float32).tobytes())
    assert load_file(os.path.join(views, "bf16", "model.safetensors"))["big"][0] == 2
    with open(big, "ab") as f:  # 4 bytes more than its meta says: no valid view
        f.write(b"ABCD")
    for v in ("model.safetensors", "bf16/model.safetensors"):
        with pytest.raises(OSError) as e:
            with open(os.path.join(views, v), "rb") as f:
                f.read()
        assert e.value.errno == errno.EINVAL, v
    os.truncate(big, 12000)  # valid again
    for v in ("model.safetensors", "bf16/model.safetensors", "f32/model.safetensors"):
        got = load_file(os.path.join(views, v))
        assert got["big"].shape == (3000,) and float(got["big"][-1]) == 2.0, v
    assert os.listdir(os.path.join(views, "reshard", "4KB")) != []


def test_a_shard_named_like_an_npy_file_has_its_npy_folder(tmp_path, mount):
    """`npy/SHARD/` is found by depth, not by name: a shard `w.npy.safetensors` (its
    folder `w.npy`) has its folder of `.npy` views like any other."""
    folder = tmp_path / "f"
    folder.mkdir()
    t = tensors()
    save_file({"w": t["w"]}, str(folder / "w.npy.safetensors"))
    save_file({"h": t["h"]}, str(folder / "b.safetensors"))
    m = mount(folder)
    npy = os.path.join(m.path, "__views__", "npy")
    assert sorted(os.listdir(npy)) == ["b", "w.npy"]
    assert os.path.isdir(os.path.join(npy, "w.npy"))
    assert os.listdir(os.path.join(npy, "w.npy")) == ["w.npy"]
    got = np.load(os.path.join(npy, "w.npy", "w.npy"))
    assert got.view(np.uint32).tobytes() == t["w"].view(np.uint32).tobytes()
