"""Commits on a real XFS filesystem with reflink (a loop image made by the test, as
root): a header that outgrows its space grows in place (blocks inserted at the start),
and a tensor dropped from the middle is a rewrite that shares the old file's blocks
instead of copying them (docs/SEMANTICS.md, "The ways")."""

import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from stfs_fixtures import assert_checkpoint, sh, written_by

MIB = 1 << 20


@pytest.fixture
def xfs(tmp_path):
    """A 1 GiB XFS with reflink on a loop image, unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make and mount a loop image")
    if not shutil.which("mkfs.xfs"):
        pytest.skip("mkfs.xfs is missing (scripts/setup installs xfsprogs)")
    img, d = tmp_path / "xfs.img", tmp_path / "xfs"
    d.mkdir()
    with open(img, "wb") as f:
        f.truncate(1 << 30)
    subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(d)], check=True)
    yield d
    if subprocess.run(["umount", str(d)]).returncode != 0:
        subprocess.run(["umount", "-l", str(d)])


def used(path):
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_xfs_grows_headers_in_place_and_shares_extents_of_a_rewrite(xfs, mount, run):
    src = xfs / "m.safetensors"
    rng = np.random.default_rng(3)
    t = {f"t{i:02d}": np.frombuffer(rng.bytes(32 * MIB), np.uint8).copy() for i in range(8)}
    save_file(t, str(src))
    ino = os.stat(src).st_ino
    m = mount(src)
    # A header that outgrows its space: blocks inserted at the start, in place.
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump({"chat_template": "{{ messages }}" * 10}, f)
    p = run("commit", m.path)
    assert "committed in place (header grown by" in p.stdout, p.stdout
    assert os.stat(src).st_ino == ino
    meta = {"chat_template": "{{ messages }}" * 10}
    assert_checkpoint(src, t, meta)
    # A tensor dropped from the middle, and one added (so the last cannot
    # move into the hole): a new file that shares the old one's blocks.
    os.unlink(os.path.join(m.path, "t03"))
    del t["t03"]
    t["zz"] = np.arange(1024, dtype=np.uint8).astype(np.uint8)
    (xfs / "zz.bin").write_bytes(t["zz"].tobytes())
    sh(f"cp {xfs}/zz.bin {m.path}/zz && echo '{{\"dtype\":\"U8\",\"shape\":[1024]}}' > {m.path}/zz.meta.json")
    status = run("status", m.path).stdout
    assert "commit     by a rewrite that shares extents (not in place: tensor \"t03\" leaves a hole" in status, status
    os.sync()
    before_used, before_written = used(xfs), written_by(m.pid)
    p = run("commit", m.path)
    assert "committed by a rewrite that shares extents" in p.stdout and "224.0 MiB shared" in p.stdout, p.stdout
    os.sync()
    assert written_by(m.pid) - before_written < 4 * MIB, "the kept tensors' blocks were copied, not shared"
    # The dropped tensor's blocks are freed once the old file is closed (the daemon lets go
    # of it in the background, XFS frees inodes lazily); nothing else was allocated again.
    deadline = time.monotonic() + 20
    while used(xfs) >= before_used - 24 * MIB and time.monotonic() < deadline:
        os.sync()
        time.sleep(0.2)
    assert used(xfs) < before_used - 24 * MIB, (used(xfs), before_used)
    assert_checkpoint(src, t, meta)
    # The mount reads the new file.
    for name, v in t.items():
        assert open(os.path.join(m.path, name), "rb").read() == v.tobytes(), name
    # --compact is a plain rewrite in the reference layout.
    sh(f"mv {m.path}/t00 {m.path}/first")
    t["first"] = t.pop("t00")
    p = run("commit", "--compact", m.path)
    assert "committed by a rewrite (not in place: --compact;" in p.stdout, p.stdout
    assert_checkpoint(src, t, meta, compact=True)


def test_xfs_overwrites_appends_and_patches_share_blocks_instead_of_copying(xfs, mount, run):
    # save_file's layout: the data starts at an offset that is not block-aligned, and so
    # does every tensor; a staging file keeps its tensor at the same place within a block.
    src = xfs / "m.safetensors"
    rng = np.random.default_rng(4)
    t = {name: np.frombuffer(rng.bytes(32 * MIB + extra), np.uint8).copy()
         for name, extra in [("a", 0), ("b", 100), ("c", 12)]}
    save_file(t, str(src))
    with open(src, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % 4096 != 0, "the test needs unaligned tensors"
    m = mount(src)
    os.sync()
    # A 4-byte patch of a 32 MiB tensor stages one block, not the tensor.
    before = written_by(m.pid)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.seek(5 * MIB + 3)
        f.write(b"\x01\x02\x03\x04")
        os.fsync(f.fileno())
    t["a"][5 * MIB + 3:5 * MIB + 7] = [1, 2, 3, 4]
    assert written_by(m.pid) - before < 1 * MIB, "the patch copied the tensor into staging"
    # A whole overwrite (dd, in place) and an append (cp, then its meta).
    new_b = np.frombuffer(rng.bytes(t["b"].size), np.uint8).copy()
    (xfs / "new_b").write_bytes(new_b.tobytes())
    sh(f"dd if={xfs / 'new_b'} of={m.path}/b bs=1M conv=notrunc,fsync status=none")
    t["b"] = new_b
    d = np.frombuffer(rng.bytes(16 * MIB), np.uint8).copy()
    (xfs / "d").write_bytes(d.tobytes())
    sh(f"cp {xfs / 'd'} {m.path}/d && echo '{{\"dtype\":\"U8\",\"shape\":[{d.size}]}}' > {m.path}/d.meta.json")
    t["d"] = d
    status = run("status", m.path).stdout
    # (The new tensor's entry outgrows save_file's header: blocks inserted at the start,
    # which keeps every tensor's place within its block.)
    assert "1 tensor overwritten, 1 tensor written in part, 1 tensor appended; " in status, status
    copied, shared = re.search(r"; ([0-9.]+) KiB copied, ([0-9.]+) MiB shared with the staging files\)", status).groups()
    assert float(copied) < 100 and float(shared) == 48.0, status
    os.sync()
    before = written_by(m.pid)
    p = run("commit", m.path)
    os.sync()
    assert p.returncode == 0 and "committed in place" in p.stdout, p.stdout + p.stderr
    # 48 MiB staged (b, d, and a's one block); copied: the blocks at each tensor's edges
    # and the header.
    assert "KiB copied, 48.0 MiB shared with the staging files)" in p.stdout, p.stdout
    assert written_by(m.pid) - before < 1 * MIB, "the commit copied the staged bytes"
    assert_checkpoint(src, t)
    for name, v in t.items():
        assert open(os.path.join(m.path, name), "rb").read() == v.tobytes(), name


def test_xfs_gguf_commits_insert_blocks_and_share_extents(xfs, mount, run):
    """A GGUF file on XFS: a template past the header's room grows it in place (blocks
    inserted, in multiples of the alignment too), and a tensor dropped from the middle is
    a rewrite sharing the kept tensors' blocks; gguf-py reads every result."""
    gguf = pytest.importorskip("gguf")
    from gguf_models import write
    src = xfs / "m.gguf"
    rng = np.random.default_rng(4)
    t = {f"blk.{i}.w": np.frombuffer(rng.bytes(16 * MIB), np.float32).copy() for i in range(6)}

    def fill(w):
        w.add_chat_template("{{ short }}")
        w.add_custom_alignment(64)
        for name, a in t.items():
            w.add_tensor(name, a)
    write(src, fill)
    m = mount(src)
    (xfs / "big.txt").write_text("{{ x }}\n" * 5000)
    sh(f"cp {xfs}/big.txt {m.path}/__kv__/tokenizer.chat_template")
    p = run("commit", m.path)
    assert "committed in place (header grown by" in p.stdout, p.stdout
    r = gguf.GGUFReader(str(src))
    assert r.fields["tokenizer.chat_template"].contents() == "{{ x }}\n" * 4999 + "{{ x }}"
    assert r.data_offset % 64 == 0 and all(x.data.tobytes() == t[x.name].tobytes() for x in r.tensors)
    del r
    os.unlink(os.path.join(m.path, "blk.2.w"))
    del t["blk.2.w"]
    os.sync()
    before_written = written_by(m.pid)
    p = run("commit", m.path)
    assert "committed by a rewrite that shares extents" in p.stdout and "80.0 MiB shared" in p.stdout, p.stdout
    os.sync()
    assert written_by(m.pid) - before_written < 4 * MIB, "the kept tensors' blocks were copied, not shared"
    r = gguf.GGUFReader(str(src))
    assert [x.name for x in r.tensors] == list(t)
    assert all(x.data.tobytes() == t[x.name].tobytes() for x in r.tensors)
