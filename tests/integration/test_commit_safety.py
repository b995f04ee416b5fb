"""What a commit guarantees when things go wrong: ENOSPC leaves the source and
the edits intact; a daemon killed mid-commit leaves the source old or new,
never a mix; readers during a commit see old or new bytes."""

import hashlib
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from stfs_fixtures import wait_for_exit

MIB = 1 << 20


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MIB):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture
def small_fs(tmp_path):
    """A 40 MiB tmpfs, unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_enospc_keeps_source_and_edits_then_retry_succeeds(tmp_path, small_fs, mount, run):
    src = small_fs / "m.safetensors"
    rng = np.random.default_rng(0)
    t = {"a": rng.integers(0, 255, 6 * MIB, dtype=np.uint8), "b": rng.integers(0, 255, 6 * MIB, dtype=np.uint8)}
    save_file(t, str(src))
    # A first commit (a rewrite, with room) leaves space in the header for the ones below.
    m = mount(src)
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        f.write('{"step": "1"}')
    p = run("commit", m.path)
    # tmpfs cannot insert blocks at a file's start: a rewrite, which says so.
    assert "committed by a rewrite (not in place: the header grows past its space" in p.stdout, p.stdout
    assert "this filesystem cannot insert blocks" in p.stdout, p.stdout
    m.close()
    before = src.read_bytes()
    filler = small_fs / "filler"
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    with open(filler, "wb") as f:
        f.write(b"\1" * (free - 4 * MIB))  # room for less than one new copy
    staging = tmp_path / "staging"
    m = mount(src, "--staging-dir", str(staging))
    new_a = np.full(6 * MIB, 7, np.uint8)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(new_a.tobytes())
    # A rewrite needs room for a second copy.
    p = run("commit", "--compact", m.path)
    assert p.returncode != 0 and "No space left on device" in p.stderr, p.stderr
    assert src.read_bytes() == before
    assert [x for x in os.listdir(small_fs) if x.startswith(".")] == [], "temp file left behind"
    assert open(os.path.join(m.path, "a"), "rb").read() == new_a.tobytes()  # still staged
    # In place, the same edit needs none.
    p = run("commit", m.path)
    assert p.returncode == 0 and "committed in place (header, 1 tensor overwritten" in p.stdout, p.stdout + p.stderr
    got = load_file(str(src))
    assert got["a"].tobytes() == new_a.tobytes() and got["b"].tobytes() == t["b"].tobytes()
    # An appended tensor needs its own size: refused before anything changed.
    before = src.read_bytes()
    with open(os.path.join(m.path, "c"), "wb") as f:
        f.write(b"\3" * 6 * MIB)
    with open(os.path.join(m.path, "c.meta.json"), "w") as f:
        f.write('{"dtype": "U8", "shape": [%d]}' % (6 * MIB))
    p = run("commit", m.path)
    assert p.returncode != 0 and "writing in place: No space left on device" in p.stderr, p.stdout + p.stderr
    assert src.read_bytes() == before
    assert open(os.path.join(m.path, "c"), "rb").read() == b"\3" * 6 * MIB  # still staged
    os.unlink(filler)
    p = run("commit", m.path)
    assert p.returncode == 0 and "committed in place" in p.stdout, p.stdout + p.stderr
    got = load_file(str(src))
    assert got["c"].tobytes() == b"\3" * 6 * MIB and got["a"].tobytes() == new_a.tobytes()


# Each step of each way, with what a kill -9 there leaves before the next mount:
# the old file, the new one, or (in place) one every reader refuses.
KILL_STEPS = {
    "in place": [("land:recorded", "old"), ("in-place:recorded", "old"), ("in-place:marked", "refused"),
                 ("in-place:data", "refused"), ("in-place:written", "refused"), ("in-place:prefix", "new"),
                 ("in-place:landed", "new")],
    "by a rewrite": [("rewrite:copying", "old"), ("rewrite:written", "old"), ("land:recorded", "old"),
                     ("land:renamed", "new"), ("in-place:landed", "new")],
}


@pytest.mark.parametrize("way", ["in place", "by a rewrite"])
def test_kill_9_mid_commit_leaves_old_or_new(tmp_path, stfs, run, monkeypatch, way):
    """A kill -9 at every step of the commit (STFS_CRASH_AT, not a timed kill): old,
    new, or (in place) a file every reader refuses; the next mount completes a
    commit whose record was made, and leaves nothing behind."""
    args = ["--compact"] if way == "by a rewrite" else []
    pristine = tmp_path / "pristine.safetensors"
    rng = np.random.default_rng(1)
    save_file({"big": rng.integers(0, 255, 24 * MIB, dtype=np.uint8),
               "small": rng.integers(0, 255, 4 * MIB, dtype=np.uint8)}, str(pristine))
    src = tmp_path / "m.safetensors"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    old = sha(pristine)

    def mounted():
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == str(mnt) for line in f)

    def trial(step):
        shutil.copyfile(pristine, src)
        pid_file = tmp_path / "pid"
        if step:
            monkeypatch.setenv("STFS_CRASH_AT", step)
        subprocess.run([stfs, "mount", "--pid-file", str(pid_file), "--log-file", str(tmp_path / "log"), str(src), str(mnt)], check=True)
        monkeypatch.delenv("STFS_CRASH_AT", raising=False)
        pid = int(pid_file.read_text())
        try:
            with open(mnt / "small", "r+b") as f:
                f.write(b"new!" * 1024)
            p = subprocess.run([stfs, "commit", *args, str(mnt)], capture_output=True, text=True, timeout=120)
            if step is None:
                assert p.returncode == 0 and f"committed {way}" in p.stdout, p.stdout + p.stderr
            else:
                assert p.returncode != 0, f"the daemon did not stop at {step}: {p.stdout}"
        finally:
            if mounted():
                subprocess.run(["umount", "-l", str(mnt)], check=False)
            try:
                wait_for_exit(pid, 20)
            except ProcessLookupError:
                pass

    trial(None)
    new = sha(src)
    assert new != old
    for step, expected in KILL_STEPS[way]:
        trial(step)
        h = sha(src)
        outcome = "old" if h == old else "new" if h == new else "refused"
        assert outcome == expected, (step, outcome)
        if outcome == "refused":
            with pytest.raises(Exception, match="too large|TooLarge"):
                load_file(str(src))  # the official reader refuses it
        # A later mount is not confused by what the killed daemon left, and
        # completes a commit whose landing was recorded.
        later_pid = tmp_path / "later.pid"
        subprocess.run([stfs, "mount", "--pid-file", str(later_pid), str(src), str(mnt)], check=True)
        later = int(later_pid.read_text())
        try:
            assert sorted(os.listdir(mnt)) == ["__metadata__.json", "big", "big.meta.json", "small", "small.meta.json"]
        finally:
            subprocess.run([stfs, "umount", str(mnt)], check=True)
            # (Its staging folder goes as the daemon exits, after the unmount.)
            wait_for_exit(later, 20)
        # (The mount took the edit back from the journal, or found it landed; the unmount committed it.)
        assert sha(src) == new, (step, "the edit did not end in the file")
    # The later mounts removed what the killed daemons left: temp files and staging folders.
    leftovers = [p.name for p in tmp_path.iterdir() if ".stfs-tmp-" in p.name]
    assert leftovers == [], leftovers
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.safetensors.stfs-")]


def test_readers_during_a_commit_see_old_or_new(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    rng = np.random.default_rng(2)
    old = {f"t{i}": rng.integers(0, 255, 8 * MIB, dtype=np.uint8) for i in range(4)}
    save_file(old, str(src))
    m = mount(src)
    new_t0 = np.full(8 * MIB, 3, np.uint8)
    with open(os.path.join(m.path, "t0"), "r+b") as f:
        f.write(new_t0.tobytes())
    allowed = {k: {v.tobytes()} for k, v in old.items()}
    allowed["t0"].add(new_t0.tobytes())
    stop = threading.Event()
    errors, reads = [], [0]

    def reader():
        while not stop.is_set():
            for name in old:
                data = open(os.path.join(m.path, name), "rb").read()
                if data not in allowed[name]:
                    errors.append(name)
                reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for th in threads:
        th.start()
    # Readers in another process, too.
    other = subprocess.Popen(["sh", "-c", f"for i in 1 2 3 4 5; do cat {m.path}/t1 {m.path}/t2 | sha256sum; done"],
                             stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):
            assert run("commit", m.path).returncode == 0
            with open(os.path.join(m.path, "t1"), "r+b") as f:  # a new edit, rewriting the same bytes
                f.write(old["t1"].tobytes()[:4096])
    finally:
        stop.set()
        for th in threads:
            th.join()
    out = other.communicate(timeout=60)[0].split("\n")
    want = hashlib.sha256(old["t1"].tobytes() + old["t2"].tobytes()).hexdigest()
    assert all(line.split()[0] == want for line in out if line), out
    assert not errors, errors
    assert reads[0] > 0
