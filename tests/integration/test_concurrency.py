"""Many readers at once, and reads while commits and edits are in flight
(issue 11): parallel state-dict loaders read and mmap tensor files from many
threads; a read of an unrelated tensor never waits for a commit, a copy into
staging, or another request's disk I/O."""

import os
import subprocess
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

MIB = 1 << 20


@pytest.mark.parametrize("cache", ["direct", "keep"])
def test_parallel_readers_and_mmappers(tmp_path, mount, cache):
    src = tmp_path / "p.safetensors"
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal(256 * 1024 + i).astype(np.float32) for i in range(16)}
    save_file(tensors, str(src))
    m = mount(src, "-o", f"cache={cache}")
    errors = []

    def read(name):
        try:
            for _ in range(5):
                got = np.fromfile(os.path.join(m.path, name), dtype=np.float32)
                assert np.array_equal(got, tensors[name]), name
        except Exception as e:  # reported below
            errors.append(e)

    def touch(name):
        try:
            for _ in range(5):
                a = np.memmap(os.path.join(m.path, name), dtype=np.float32, mode="r")
                assert float(a[::1024].sum()) == float(tensors[name][::1024].sum()), name
                assert np.array_equal(np.asarray(a), tensors[name]), name
                del a
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=read, args=(f"t{i}",)) for i in range(8)]
    threads += [threading.Thread(target=touch, args=(f"t{i}",)) for i in range(8, 16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    assert not errors, errors


@pytest.mark.parametrize("way", ["in place", "by a rewrite"])
def test_reads_never_wait_for_commits_or_edits(tmp_path, mount, run, stfs, way):
    src = tmp_path / "m.safetensors"
    big = np.zeros(768 * MIB, np.uint8)
    small = np.arange(1024, dtype=np.int32)
    save_file({"big": big, "small": small, "other": np.ones(16 * MIB, np.uint8)}, str(src))
    del big
    m = mount(src)
    p = lambda n: os.path.join(m.path, n)
    with open(p("big"), "r+b") as f:
        f.write(b"\x01")  # staged: the commit copies it from staging
    args = ["--compact"] if way == "by a rewrite" else []
    commit = subprocess.Popen([stfs, "commit", *args, m.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def writing():
        if way == "by a rewrite":  # its new file
            return bool(list(tmp_path.glob(".m.safetensors.stfs-tmp-*")))
        # Its write lease (an open of the file would wait for the commit to end).
        ino = os.stat(src).st_ino
        with open("/proc/locks") as f:
            return any("LEASE" in line and line.split()[5].endswith(f":{ino}") for line in f)

    # Once it writes (its plan is taken) ...
    deadline = time.monotonic() + 30
    while not writing() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert commit.poll() is None, "the commit ended before it could be watched"
    # ... edits while it runs: a write into the tensor being committed (its bytes
    # are copied aside, not written under the commit), namespace edits, and a
    # big write to another tensor.
    def edits():
        with open(p("big"), "r+b") as f:
            f.write(b"\x02")
        with open(p("new"), "wb") as f:
            f.write(b"\x00" * 8)
        os.rename(p("new"), p("renamed"))
        subprocess.run(["dd", "if=/dev/zero", f"of={p('other')}", "bs=1M", "count=16", "conv=notrunc",
                        "status=none"], check=True)

    editor = threading.Thread(target=edits)
    editor.start()
    slowest, reads = 0.0, 0
    while commit.poll() is None or editor.is_alive():
        reads += 1
        t = time.monotonic()
        got = np.fromfile(p("small"), dtype=np.int32)  # a fresh open: lookup, open, read
        slowest = max(slowest, time.monotonic() - t)
        assert np.array_equal(got, small)
    editor.join()
    out, err = commit.communicate()
    assert commit.returncode == 0 and f"committed {way}" in out, out + err
    # A generous bound: what matters is that no read queued behind the commit
    # or the edits (which take seconds here).
    print(f"{reads} reads during the commit and the edits, the slowest {slowest:.3f} s")
    assert reads > 10, "the reads did not overlap the commit"
    assert slowest < 2.0, f"a read of an unrelated tensor took {slowest:.2f} s"
    assert open(p("big"), "rb").read(2) == b"\x02\x00"
    assert run("commit", m.path).returncode != 0  # "renamed" has no meta yet: refused, named
