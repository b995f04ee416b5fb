"""Commits on a real XFS filesystem with reflink (a loop image made by the test, as
root): a header that outgrows its space grows in place (blocks inserted at the start),
and a tensor dropped from the middle is a rewrite that shares the old file's blocks
instead of copying them (docs/SEMANTICS.md, "The ways")."""

import json
import os
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
    # A tensor dropped from the middle: a new file that shares the old one's blocks.
    os.unlink(os.path.join(m.path, "t03"))
    del t["t03"]
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
