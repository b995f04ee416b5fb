"""A write costs what it writes (docs/SEMANTICS.md, "Writes into a tensor"): a
write into a source tensor stages only the blocks it touches, the rest is
still read from the source; a write that covers the whole tensor copies
nothing first; an in-place commit writes back only the staged blocks. The
staged blocks are journaled, so they survive a killed daemon.
"""

import json
import os
import signal
import subprocess

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from stfs_fixtures import assert_checkpoint, fsync_path, resident, wait_for_exit

MIB = 1 << 20
GIB = 1 << 30


def staged_bytes(folder, name="m.safetensors"):
    """Bytes allocated on disk by the staging files of `name`'s mounts."""
    total = 0
    for d in folder.glob(f".{name}.stfs-*"):
        for f in d.iterdir():
            total += f.lstat().st_blocks * 512
    return total


def sparse_checkpoint(path, big):
    """A checkpoint with one `big`-byte U8 tensor (zeros, sparse on disk) and a small F32 one."""
    header = {
        "__metadata__": {"format": "pt"},
        "big": {"dtype": "U8", "shape": [big], "data_offsets": [0, big]},
        "small": {"dtype": "F32", "shape": [4], "data_offsets": [big, big + 16]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(8 + len(text) + big)
        f.seek(8 + len(text) + big)
        f.write(np.arange(4, dtype=np.float32).tobytes())


def pwrite(path, data, offset, fsync=False):
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, offset) == len(data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def test_a_4_byte_patch_of_a_2_gib_tensor_stages_a_block_and_commits_in_place(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    sparse_checkpoint(src, 2 * GIB)
    m = mount(src)
    big = os.path.join(m.path, "big")
    at = GIB + 4093  # across a block boundary of the data
    pwrite(big, b"\x01\x02\x03\x04", at)
    # One or two blocks staged, not 2 GiB.
    assert staged_bytes(tmp_path) <= 1 * MIB, staged_bytes(tmp_path)
    with open(big, "rb") as f:
        f.seek(at - 4)
        assert f.read(12) == b"\0" * 4 + b"\x01\x02\x03\x04" + b"\0" * 4
        f.seek(0)
        assert f.read(16) == b"\0" * 16
    assert "big" in run("status", m.path).stdout
    p = run("commit", m.path)
    assert p.returncode == 0 and "in place" in p.stdout and "written in part" in p.stdout, p.stdout + p.stderr
    # The source is still sparse: the commit wrote the blocks, not the tensor.
    assert src.stat().st_blocks * 512 <= 4 * MIB
    with safe_open(str(src), framework="np") as f:
        assert bytes(f.get_slice("big")[at - 4:at + 8]) == b"\0" * 4 + b"\x01\x02\x03\x04" + b"\0" * 4
        assert bytes(f.get_slice("big")[at + 8:at + 8192]) == b"\0" * 8184
        assert list(f.get_tensor("small")) == [0, 1, 2, 3]


def test_patches_anywhere_read_back_and_commit_as_written(tmp_path, mount, run):
    """Patches at the edges, across blocks, over each other, and one covering
    the whole tensor, read back exactly through the mount and commit."""
    rng = np.random.default_rng(5)
    src = tmp_path / "m.safetensors"
    tensors = {
        "a": rng.integers(0, 255, 3 * MIB + 17, dtype=np.uint8),
        "b": rng.integers(0, 255, 100, dtype=np.uint8),
        "c": rng.standard_normal((64, 1000)).astype(np.float32),
    }
    save_file(tensors, str(src))
    m = mount(src)
    expected = {k: bytearray(v.tobytes()) for k, v in tensors.items()}
    patches = [("a", 0, 1), ("a", len(expected["a"]) - 1, 1), ("a", 4090, 20), ("a", 4100, 5000),
               ("a", MIB - 3, 2 * MIB), ("b", 50, 50), ("c", 1000, 30000), ("c", 7, 3)]
    for name, at, n in patches:
        data = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        pwrite(os.path.join(m.path, name), data, at)
        expected[name][at:at + n] = data
        assert open(os.path.join(m.path, name), "rb").read() == bytes(expected[name]), (name, at, n)
    # "b" was written whole (in two writes): it is all staged now.
    got = {k: np.frombuffer(bytes(v), tensors[k].dtype).reshape(tensors[k].shape) for k, v in expected.items()}
    assert run("commit", m.path).returncode == 0
    assert_checkpoint(src, got)
    # And the mount shows the committed file.
    for k, v in expected.items():
        assert open(os.path.join(m.path, k), "rb").read() == bytes(v), k


def test_partly_staged_edits_survive_a_killed_daemon(tmp_path, mount, run):
    """Blocks staged by writes after the first (journaled one by one) come
    back after kill -9, and so does a tensor whose blocks ended up all staged."""
    rng = np.random.default_rng(9)
    src = tmp_path / "m.safetensors"
    tensors = {"a": rng.integers(0, 255, 2 * MIB, dtype=np.uint8),
               "b": rng.integers(0, 255, 9000, dtype=np.uint8)}
    save_file(tensors, str(src))
    before = src.read_bytes()
    m = mount(src)
    expected = {k: bytearray(v.tobytes()) for k, v in tensors.items()}
    for name, at, n in [("a", 10, 4), ("a", MIB, 70000), ("a", 2 * MIB - 5, 5), ("b", 0, 5000), ("b", 5000, 4000)]:
        data = rng.integers(0, 255, n, dtype=np.uint8).tobytes()
        pwrite(os.path.join(m.path, name), data, at, fsync=True)
        expected[name][at:at + n] = data
    os.kill(m.pid, signal.SIGKILL)
    wait_for_exit(m.pid, 20)
    assert run("umount", m.path).returncode == 0
    m.pid = None
    assert src.read_bytes() == before
    m2 = mount(src)
    assert "took back" in m2.result.stderr, m2.result.stderr
    for k, v in expected.items():
        assert open(os.path.join(m2.path, k), "rb").read() == bytes(v), k
    assert run("commit", m2.path).returncode == 0
    assert_checkpoint(src, {k: np.frombuffer(bytes(v), np.uint8) for k, v in expected.items()})


def test_a_write_over_the_whole_tensor_copies_nothing_first(tmp_path, mount, run):
    """dd over a whole tensor reads next to nothing of the source (it used to
    copy the whole tensor into staging first, then write over the copy): the
    source, dropped from the page cache before, is still out of it after."""
    rng = np.random.default_rng(1)
    src = tmp_path / "m.safetensors"
    save_file({"a": rng.integers(0, 255, 32 * MIB, dtype=np.uint8)}, str(src))
    fsync_path(src)
    m = mount(src)
    new = rng.integers(0, 255, 32 * MIB, dtype=np.uint8).tobytes()
    (tmp_path / "new.bin").write_bytes(new)
    fd = os.open(src, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert resident(src) <= 1 * MIB, "the source stays in the page cache: nothing to measure"
    subprocess.run(["dd", f"if={tmp_path / 'new.bin'}", f"of={m.path}/a", "bs=1M", "conv=notrunc,fsync",
                    "status=none"], check=True)
    # (At most the source's parts of the blocks each write ends in.)
    assert resident(src) <= 4 * MIB, f"{resident(src) / MIB:.1f} MiB of the source read for a whole overwrite"
    assert staged_bytes(tmp_path) <= 33 * MIB
    assert open(os.path.join(m.path, "a"), "rb").read() == new
    assert run("commit", m.path).returncode == 0
    assert_checkpoint(src, {"a": np.frombuffer(new, np.uint8)})
    fsync_path(src)


def test_a_failed_partial_write_changes_nothing(tmp_path, mount, run):
    """A write into a source tensor that fails (here: the staging write,
    by a fault) returns the error and leaves the tensor as it was; the next
    write goes through."""
    rng = np.random.default_rng(2)
    src = tmp_path / "m.safetensors"
    a = rng.integers(0, 255, 20000, dtype=np.uint8)
    save_file({"a": a}, str(src))
    m = mount(src, env={"STFS_FAULT_AT": "patch:write:ENOSPC:2"})
    path = os.path.join(m.path, "a")
    expected = bytearray(a.tobytes())
    pwrite(path, b"one", 5000)
    expected[5000:5003] = b"one"
    try:
        pwrite(path, b"two", 12000)
        raise AssertionError("the faulted write succeeded")
    except OSError as e:
        assert e.errno == 28, e
    assert open(path, "rb").read() == bytes(expected)
    pwrite(path, b"three", 12000)
    expected[12000:12005] = b"three"
    assert open(path, "rb").read() == bytes(expected)
    assert run("commit", m.path).returncode == 0
    assert_checkpoint(src, {"a": np.frombuffer(bytes(expected), np.uint8)})


def test_an_open_descriptor_does_not_stop_an_in_place_commit_a_view_does(tmp_path, mount, run):
    """A descriptor on the tensor reads what the tensor is, so its staged blocks
    go in place while it is open; a view opened before the write keeps the old
    bytes, so the commit is a rewrite then, and says why."""
    rng = np.random.default_rng(4)
    src = tmp_path / "m.safetensors"
    a = rng.integers(0, 255, 1 << 20, dtype=np.uint8)
    save_file({"a": a, "b": np.arange(10, dtype=np.uint8)}, str(src))
    m = mount(src)
    path = os.path.join(m.path, "a")
    reader = os.open(path, os.O_RDONLY)
    try:
        pwrite(path, b"held", 5000)
        p = run("commit", m.path)
        assert "committed in place" in p.stdout and "written in part" in p.stdout, p.stdout + p.stderr
        assert os.pread(reader, 4, 5000) == b"held"
    finally:
        os.close(reader)
    views = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(m.path, "__views__")) for f in fs
             if f == "model.safetensors"]
    view = os.open(views[0], os.O_RDONLY)
    try:
        before = os.pread(view, os.fstat(view).st_size, 0)
        pwrite(path, b"view", 9000)
        p = run("commit", m.path)
        assert "committed by a rewrite" in p.stdout and "still read" in p.stdout, p.stdout + p.stderr
        assert os.pread(view, len(before), 0) == before
    finally:
        os.close(view)
    want = a.copy()
    want[5000:5004] = np.frombuffer(b"held", np.uint8)
    want[9000:9004] = np.frombuffer(b"view", np.uint8)
    assert_checkpoint(src, {"a": want, "b": np.arange(10, dtype=np.uint8)})
