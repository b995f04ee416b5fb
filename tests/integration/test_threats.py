"""Integrity and security, third round (issue 25): each row of the probe that
failed is a test here, driven deterministically. Races are made with the
daemon's pause points (STFS_PAUSE_AT: the daemon waits at a named step until
the test lets it go), faults with STFS_FAULT_AT, and the co-user is a real
second user made by the test. See "Who may do what" in docs/SEMANTICS.md."""

import errno
import hashlib
import json
import os
import pathlib
import pty
import re
import select
import shutil
import subprocess
import time

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from conftest import as_user
from stfs_fixtures import assert_checkpoint, base, wait_for, wait_for_exit, write_at

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: another user, or a loop filesystem")

# STFS_IOC_COMMIT (include/stfs.h): _IOWR('s', 2, struct stfs_commit), 4096 bytes.
IOC_COMMIT = (3 << 30) | (4096 << 16) | (ord("s") << 8) | 2
COMMIT_DISCARD = 2


class Pauses:
    """Pause points of the daemons mounted while it is active: `wait(step)`
    returns once a daemon stands at `step`, `go(step)` lets it on."""

    def __init__(self, folder, monkeypatch, steps):
        self.dir = folder
        self.dir.mkdir()
        monkeypatch.setenv("STFS_PAUSE_AT", ",".join(steps))
        monkeypatch.setenv("STFS_PAUSE_DIR", str(self.dir))

    def release_all(self):
        (self.dir / "go-all").touch()
        for f in self.dir.iterdir():
            if f.name != "go-all":
                f.unlink()

    def wait(self, step, proc=None):
        deadline = time.monotonic() + 60
        while not (self.dir / step).exists():
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"ended before pausing at {step}: {proc.communicate()}")
            assert time.monotonic() < deadline, f"the daemon never reached {step}"
            time.sleep(0.01)

    def go(self, step):
        os.unlink(self.dir / step)


@pytest.fixture
def pauses(mount, tmp_path, monkeypatch):
    """pauses(*steps) -> Pauses for the daemons mounted after it. At the end
    every pause is let go before the mounts are unmounted (a failed test
    leaves no daemon waiting)."""
    made = []

    def make(*steps):
        made.append(Pauses(tmp_path / f"pauses{len(made)}", monkeypatch, steps))
        return made[-1]

    yield make
    for p in made:
        p.release_all()


def background(stfs, *args):
    return subprocess.Popen([stfs, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc):
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err


def commit_paused_at(stfs, pause, step, *args):
    """`stfs commit ARGS...` in the background, returned once its daemon stands at `step`."""
    commit = background(stfs, "commit", *args)
    pause.wait(step, commit)
    return commit


def let_finish(pause, step, commit):
    """Lets the daemon on from `step`: the commit's (returncode, stdout, stderr)."""
    pause.go(step)
    return finished(commit)


def mounted_with_pauses(tmp_path, mount, pauses, *steps):
    """base() in tmp_path/m.safetensors, mounted with its daemon pausing at
    `steps`: (source, its tensors, the Pauses, the mount)."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    pause = pauses(*steps)
    return src, t, pause, mount(src)


def set_metadata(m, **kv):
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump(kv, f)


def write_a(m, value):
    """Writes tensor "a" of base() (8 F32) all `value` through mount `m`: its new value."""
    new_a = np.full(8, value, np.float32)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(new_a.tobytes())
    return new_a


def metadata_of(path):
    with safe_open(str(path), framework="np") as f:
        return f.metadata() or {}


def refused_by_readers(path):
    try:
        load_file(str(path))
    except Exception:
        return True
    return False


# Row 1 -------------------------------------------------------------------

def test_a_write_just_after_an_in_place_commit_is_not_taken_for_the_commits(tmp_path, mount, pauses, run, stfs):
    """A program whose open waited on the commit's lease writes as soon as it
    returns: the commit lands, and the next commit is refused (ESTALE), never
    written over that program's change."""
    src = tmp_path / "m.safetensors"
    t = base(src, metadata={"k": "v0"})
    pause = pauses("in-place:unleased")
    m = mount(src)
    set_metadata(m, k="v1")
    commit = commit_paused_at(stfs, pause, "in-place:unleased", m.path)
    # The commit wrote in place and let its lease go; another program writes now.
    data = src.read_bytes()
    assert b'"k":"v1"' in data
    with open(src, "r+b") as f:
        f.seek(data.index(b'"k":"v1"'))
        f.write(b'"k":"WW"')
    rc, out, err = let_finish(pause, "in-place:unleased", commit)
    assert rc == 0 and "committed in place" in out, out + err
    assert metadata_of(src) == {"k": "WW"}
    set_metadata(m, k="v2")
    p = run("commit", m.path)
    assert p.returncode != 0 and "changed since it was mounted" in p.stderr, p.stdout + p.stderr
    assert metadata_of(src) == {"k": "WW"}, "the other program's change was overwritten"
    assert run("umount", "--discard", m.path).returncode == 0


# Row 2 -------------------------------------------------------------------

@pytest.fixture
def small_ext4(tmp_path):
    """A 32 MiB ext4 on a loop image (no blocks reserved for root), unmounted at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make and mount a loop image")
    img, d = tmp_path / "ext4.img", tmp_path / "small"
    d.mkdir()
    subprocess.run(["truncate", "-s", "32M", str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(img)], check=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(d)], check=True)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(folder):
    """Fills the filesystem of `folder` to the last byte it gives."""
    fd = os.open(os.path.join(folder, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        size = 1 << 20
        while size >= 512:
            try:
                os.write(fd, b"\xff" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
                size //= 2
        os.fsync(fd)
    finally:
        os.close(fd)


@ROOT_ONLY
def test_a_commit_on_a_full_filesystem_says_so_and_loses_nothing(small_ext4, tmp_path, mount, run):
    src = small_ext4 / "m.safetensors"
    rng = np.random.default_rng(1)
    t = {f"w{i}": rng.standard_normal(4096).astype(np.float32) for i in range(64)}
    save_file(t, str(src))
    before = src.read_bytes()
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    fill(small_ext4)
    m = mount(src, "--staging-dir", staging)
    # A header that outgrows its space: blocks must be inserted at the start.
    set_metadata(m, note="x" * 20000)
    p = run("commit", m.path)
    assert p.returncode != 0 and "No space left" in p.stderr, p.stdout + p.stderr
    assert src.read_bytes() == before, "a failed commit changed the file"
    st = run("status", m.path)
    assert "metadata" in st.stdout, st.stdout
    # With room made, the same mount commits the kept edits.
    os.unlink(small_ext4 / "filler")
    p = run("commit", m.path)
    assert p.returncode == 0 and "committed in place" in p.stdout, p.stdout + p.stderr
    assert_checkpoint(src, t, {"note": "x" * 20000})


@ROOT_ONLY
def test_an_edit_a_full_staging_filesystem_cannot_journal_fails_and_changes_nothing(small_ext4, tmp_path, mount):
    """rm and mv of a tensor, a meta written, when the staging folder's
    filesystem is full: each fails with ENOSPC and changes nothing, and after
    a kill -9 nothing comes back that was refused (rm once returned 0 while
    its journal line was lost, and kill -9 brought the tensor back)."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    staging = small_ext4 / "staging"
    staging.mkdir(mode=0o700)
    fill(small_ext4)
    m = mount(src, "--staging-dir", staging)
    before = sorted(os.listdir(m.path))
    attempts = [lambda: os.unlink(os.path.join(m.path, "a")),
                lambda: os.rename(os.path.join(m.path, "b"), os.path.join(m.path, "z"))]
    for attempt in attempts:
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.ENOSPC, e.value
        assert sorted(os.listdir(m.path)) == before
    os.kill(m.pid, 9)
    m.close()
    os.unlink(small_ext4 / "filler")
    m2 = mount(src, "--staging-dir", staging)
    assert sorted(os.listdir(m2.path)) == before
    # With room, the same edit is journaled and kept.
    os.unlink(os.path.join(m2.path, "a"))
    os.kill(m2.pid, 9)
    m2.close()
    m3 = mount(src, "--staging-dir", staging)
    assert "a" not in os.listdir(m3.path)
    assert_checkpoint(src, t)  # (nothing committed: the source as it was)


@pytest.mark.parametrize("how", ["rsync --inplace -t", "os.utime", "chmod alone"])
def test_a_source_written_behind_the_mount_with_its_time_put_back_is_seen(tmp_path, mount, run, how):
    """Another program rewrites the source in place and puts its size and
    mtime back, while a tensor is written in part: the commit is refused
    (ESTALE), where it once wrote back one stale block over the other
    program's bytes. A chmod alone changes no byte: the commit goes on."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    m = mount(src)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(b"\x07")
    before = os.stat(src)
    theirs = bytearray(src.read_bytes())
    theirs[-4:] = b"\xee" * 4
    if how == "rsync --inplace -t":
        other = tmp_path / "other.safetensors"
        other.write_bytes(bytes(theirs))
        os.utime(other, ns=(before.st_atime_ns, before.st_mtime_ns))
        subprocess.run(["rsync", "--inplace", "-t", "-I", str(other), str(src)], check=True)
    elif how == "os.utime":
        with open(src, "r+b") as f:
            f.write(bytes(theirs))
        os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        os.chmod(src, 0o640)
    now = os.stat(src)
    assert (now.st_size, now.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    p = run("commit", m.path)
    if how == "chmod alone":
        assert p.returncode == 0, p.stderr
        t["a"] = t["a"].copy()
        t["a"].view(np.uint8)[0] = 7
        assert_checkpoint(src, t)
    else:
        assert p.returncode != 0 and "changed" in p.stderr, p.stdout + p.stderr
        assert src.read_bytes() == bytes(theirs), "the commit wrote over the other program's file"


@ROOT_ONLY
def test_a_source_whose_folder_cannot_hold_a_private_staging_folder(tmp_path, mount, run):
    """A source inside another FUSE filesystem that shows every folder 0755
    (bindfs here, rclone in the wild): the mount says where edits are staged
    instead (the user's state folder), journals them there, leaves nothing
    beside the source, and a kill -9 loses none (edits once returned success
    with nothing journaled, and each try left a .NAME.stfs-* folder)."""
    if shutil.which("bindfs") is None:
        pytest.fail("bindfs is missing: scripts/setup installs it")
    real, seen = tmp_path / "real", tmp_path / "seen"
    real.mkdir()
    seen.mkdir()
    subprocess.run(["bindfs", "-p", "0755", str(real), str(seen)], check=True)
    staged_in = None
    try:
        src = seen / "m.safetensors"
        base(src)
        m = mount(src)
        [note] = [line for line in m.result.stdout.splitlines() + m.result.stderr.splitlines()
                  if "edits are staged in" in line]
        staged_in = pathlib.Path(note.split("edits are staged in ")[1].split(" (")[0])
        os.rename(os.path.join(m.path, "a"), os.path.join(m.path, "z"))
        fd = os.open(m.path, os.O_RDONLY)
        os.fsync(fd)  # (a rename is durable once its folder is synced)
        os.close(fd)
        assert [n for n in os.listdir(real) if ".stfs-" in n] == []
        os.kill(m.pid, 9)
        m.close()
        m2 = mount(src)
        assert "z" in os.listdir(m2.path) and "a" not in os.listdir(m2.path)
        p = run("commit", m2.path)
        assert p.returncode == 0, p.stderr
        m2.close()
        assert [n for n in os.listdir(real) if ".stfs-" in n] == []
    finally:
        subprocess.run(["umount", str(seen)], check=False)
        if staged_in is not None:
            shutil.rmtree(staged_in, ignore_errors=True)


def inserts_blocks(folder):
    """Whether the filesystem of `folder` inserts blocks at a file's start (ext4, XFS)."""
    probe = os.path.join(folder, ".insert-probe")
    with open(probe, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        return subprocess.run(["fallocate", "-i", "-o", "0", "-l", "4096", probe], capture_output=True).returncode == 0
    finally:
        os.unlink(probe)


@pytest.mark.parametrize("step", ["in-place:reserve-header", "in-place:insert", "in-place:reserve", "in-place:mark"])
def test_a_fault_before_anything_changed_leaves_the_old_file_and_the_edits(tmp_path, mount, run, step):
    if not inserts_blocks(tmp_path):
        pytest.skip("the header grows by inserting blocks: needs ext4 or XFS")
    src = tmp_path / "m.safetensors"
    t = base(src)
    before = src.read_bytes()
    m = mount(src, env={"STFS_FAULT_AT": f"{step}:ENOSPC"})
    set_metadata(m, note="y" * 9000)  # grows the header: blocks inserted
    with open(os.path.join(m.path, "c"), "ab") as f:  # and an append
        f.write(b"\x01" * 3)
    with open(os.path.join(m.path, "c.meta.json"), "w") as f:
        json.dump({"dtype": "U8", "shape": [8]}, f)
    p = run("commit", m.path)
    assert p.returncode != 0 and "No space left" in p.stderr and "did not land" not in p.stderr, p.stderr
    assert src.read_bytes() == before
    # The fault was for once: the edits are there, and the next commit lands.
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    t["c"] = np.concatenate([t["c"], np.ones(3, np.uint8)])
    assert_checkpoint(src, t, {"note": "y" * 9000})


def append_staged(tmp_path, m, data):
    """Appends tensor "new" holding `data` through mount `m` of
    tmp_path/m.safetensors: (its staging folder, its staging file)."""
    with open(os.path.join(m.path, "new"), "wb") as f:
        f.write(data)
    with open(os.path.join(m.path, "new.meta.json"), "w") as f:
        json.dump({"dtype": "U8", "shape": [len(data)]}, f)
    [staging] = tmp_path.glob(".m.safetensors.stfs-*")
    [staged] = [f for f in staging.iterdir() if re.fullmatch(r"s\d+(\+\d+)?", f.name)]
    return staging, staged


def test_a_commit_returns_before_the_staging_files_it_read_are_removed(tmp_path, mount, run, pauses):
    """Removing a large staging file frees its blocks and page cache (27 ms for
    64 MiB on ext4, a third of that append's commit): the commit returns first,
    the file goes after, and the mount answers meanwhile (no lock is held)."""
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(4, np.float32)}, str(src))
    pause = pauses("commit:spent")
    m = mount(src)
    data = os.urandom(1 << 20)
    _, staged = append_staged(tmp_path, m, data)
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    pause.wait("commit:spent")
    assert staged.exists()
    assert pathlib.Path(m.path, "new").read_bytes() == data
    assert {"new", "new.meta.json", "w", "w.meta.json"} <= set(os.listdir(m.path))
    assert_checkpoint(src, {"w": np.ones(4, np.float32), "new": np.frombuffer(data, np.uint8)})
    pause.go("commit:spent")
    wait_for(lambda: not staged.exists(), "the spent staging file removed")


def test_a_staging_folder_removed_while_a_spent_file_goes_is_removed_whole(tmp_path, mount, run, pauses):
    """The unmount removes the staging folder while the commit's spent staging
    file is being let go on its own thread: a file gone between the listing
    and its unlink is no error (the folder was left behind, seen in CI)."""
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(4, np.float32)}, str(src))
    pause = pauses("commit:spent", "staging:remove")
    m = mount(src)
    staging, staged = append_staged(tmp_path, m, b"\x01" * 4096)
    assert run("commit", m.path).returncode == 0
    pause.wait("commit:spent")
    # (stfs umount returns once the daemon has exited: it waits meanwhile.)
    umount = background(m.stfs, "umount", m.path)
    pause.wait("staging:remove", umount)  # the folder listed, the spent file in the list
    pause.go("commit:spent")
    wait_for(lambda: not staged.exists(), "the spent staging file removed")
    pause.go("staging:remove")
    assert umount.wait(timeout=60) == 0, umount.communicate()
    wait_for_exit(m.pid, 20)
    m.pid = None
    assert not staging.exists(), os.listdir(staging)
    assert_checkpoint(src, {"w": np.ones(4, np.float32), "new": np.ones(4096, np.uint8)})


def test_a_rewrite_that_fails_before_landing_leaves_no_temp_file(tmp_path, mount, run):
    """A fault after the new file is written and before it lands (recording
    the commit): the old file stays, the edits stay, and no temp file is left
    beside the source."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    before = src.read_bytes()
    m = mount(src, env={"STFS_FAULT_AT": "land:recorded:EIO"})
    os.unlink(os.path.join(m.path, "a"))
    del t["a"]
    p = run("commit", "--compact", m.path)
    assert p.returncode != 0, p.stdout
    assert src.read_bytes() == before
    assert [f for f in os.listdir(tmp_path) if ".stfs-tmp-" in f] == []
    p = run("commit", "--compact", m.path)
    assert p.returncode == 0, p.stderr
    assert_checkpoint(src, t, compact=True)


def test_a_failure_after_the_marker_is_reported_and_completed_by_the_next_mount(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    m = mount(src, env={"STFS_FAULT_AT": "in-place:write:EIO"})
    new_a = write_a(m, 7)
    p = run("commit", m.path)
    assert p.returncode != 0 and "did not land" in p.stderr and "Input/output error" in p.stderr, p.stdout + p.stderr
    assert refused_by_readers(src)
    st = run("status", m.path)
    assert st.returncode == 1 and "did not land" in st.stdout, st.stdout
    # Nothing may drop the record that completes the file.
    p = run("umount", "--discard", m.path)
    assert p.returncode != 0 and m.is_mounted()
    subprocess.run(["umount", m.path], check=True)
    wait_for_exit(m.pid, 20)
    m2 = mount(src)
    assert "completed a commit that was interrupted" in m2.result.stdout + m2.result.stderr
    t["a"] = new_a
    assert_checkpoint(src, t)


# Row 3 -------------------------------------------------------------------

def killed_mid_commit(tmp_path, mount, run, monkeypatch):
    """A checkpoint whose in-place commit (tensor "a" overwritten) was killed
    halfway (STFS_CRASH_AT=in-place:data): (source, its tensors, a's new value)."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    m = mount(src, env={"STFS_CRASH_AT": "in-place:data"})
    new_a = write_a(m, 5)
    assert run("commit", m.path).returncode != 0  # the daemon died mid-commit
    m.close()
    assert refused_by_readers(src)
    return src, t, new_a


@pytest.mark.parametrize("tamper", ["offset past the end", "record cut short", "a path for a name",
                                    "a staging file gone"])
def test_a_tampered_redo_record_is_not_applied(tmp_path, mount, run, monkeypatch, tamper):
    src, _, _ = killed_mid_commit(tmp_path, mount, run, monkeypatch)
    [staging] = [p for p in tmp_path.iterdir() if p.name.startswith(".m.safetensors.stfs-")]
    record = staging / "commit.json"
    body, _, _ = record.read_bytes().rpartition(b"\nsha256:")
    r = json.loads(body)

    def resealed(r):
        # (Sealed again as stfs seals it: the redo record's own sum must refuse it.)
        body = json.dumps(r).encode()
        return body + b"\nsha256:" + hashlib.sha256(body).hexdigest().encode() + b"\n"

    if tamper == "offset past the end":
        r["in_place"][0]["writes"][0]["at"] = 1 << 40
        record.write_bytes(resealed(r))
    elif tamper == "a path for a name":
        r["in_place"][0]["writes"][0]["from"] = {"Staged": {"file": "../../etc/passwd"}}
        record.write_bytes(resealed(r))
    elif tamper == "a staging file gone":
        os.unlink(staging / r["in_place"][0]["writes"][0]["from"]["Staged"]["file"])
    else:
        record.write_bytes(record.read_bytes()[:40])
    damaged = src.read_bytes()
    m2 = mount(src, expect_ok=False)
    assert not m2.ok
    err = m2.result.stderr
    assert ("does not hold" in err or "cannot be used" in err), err
    assert "completes it from the record" not in err.split("\n")[0], err
    assert src.read_bytes() == damaged, "recovery changed the file"
    assert refused_by_readers(src)
    assert record.exists(), "the record was dropped"


# Row 4 -------------------------------------------------------------------

DISCARD_BY_IOCTL = f"""
import fcntl, json, os, struct, sys
buf = bytearray(4096)
struct.pack_into("<IIiI", buf, 0, 4096, {COMMIT_DISCARD}, 0, 0)
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.ioctl(fd, {IOC_COMMIT}, buf)
print(json.dumps([struct.unpack_from("<i", buf, 8)[0], bytes(buf[16:]).split(b"\\0")[0].decode()]))
"""


def discard_in_background(path):
    """STFS_IOC_COMMIT with STFS_COMMIT_DISCARD, as `stfs umount --discard`
    sends it but without the unmount, in a process of its own (the ioctl
    holds Python's lock while it waits)."""
    return subprocess.Popen(["python3", "-c", DISCARD_BY_IOCTL, path], stdout=subprocess.PIPE, text=True)


def discard_result(proc):
    _, out, _ = finished(proc)
    return json.loads(out)


def test_a_commit_that_waited_for_a_discard_says_nothing_was_committed(tmp_path, mount, pauses, run, stfs):
    src, t, pause, m = mounted_with_pauses(tmp_path, mount, pauses, "discard:locked", "commit:waiting")
    set_metadata(m, k="v")
    discard = discard_in_background(m.path)
    pause.wait("discard:locked", discard)
    commit = commit_paused_at(stfs, pause, "commit:waiting", m.path)
    pause.go("commit:waiting")  # the commit now waits for the discard
    pause.go("discard:locked")
    got = discard_result(discard)
    rc, out, err = finished(commit)
    assert got[0] == 0 and "discarded" in got[1], got
    assert rc != 0 and "discarded" in err, out + err
    assert_checkpoint(src, t)


def test_a_discard_that_waited_for_a_commit_says_the_edits_were_committed(tmp_path, mount, pauses, run, stfs):
    src, t, pause, m = mounted_with_pauses(tmp_path, mount, pauses, "commit:locked", "discard:waiting")
    set_metadata(m, k="v")
    commit = commit_paused_at(stfs, pause, "commit:locked", m.path)
    discard = discard_in_background(m.path)
    pause.wait("discard:waiting", discard)
    pause.go("discard:waiting")
    rc, out, err = let_finish(pause, "commit:locked", commit)
    got = discard_result(discard)
    assert rc == 0 and "committed" in out, out + err
    assert got[0] == errno.ECANCELED and "a commit" in got[1], got
    assert_checkpoint(src, t, {"k": "v"})


# Row 5 -------------------------------------------------------------------

def test_two_shard_names_of_one_file_are_refused_before_anything_is_written(tmp_path, mount, run):
    hub = tmp_path / "hub"
    (hub / "blobs").mkdir(parents=True)
    snap = hub / "snap"
    snap.mkdir()
    blob = hub / "blobs" / "0123"
    base(blob)
    for name in ("a", "b"):
        os.symlink("../blobs/0123", snap / f"{name}.safetensors")
    index = {"metadata": {"total_size": 0}, "weight_map": {"a": "a.safetensors", "b": "a.safetensors", "c": "a.safetensors"}}
    (snap / "m.safetensors.index.json").write_text(json.dumps(index))
    before = blob.read_bytes()
    m = mount(snap)
    for shard in ("a", "b"):
        with open(os.path.join(m.path, shard, "c"), "r+b") as f:
            f.write(b"\x09")
    st = run("status", m.path)
    assert st.returncode == 1 and "are one file" in st.stdout, st.stdout
    p = run("commit", m.path)
    assert p.returncode != 0 and "are one file" in p.stderr, p.stdout + p.stderr
    assert blob.read_bytes() == before
    assert not [n for n in os.listdir(hub / "blobs") if n != "0123"], "a temp file was left"
    assert run("umount", "--discard", m.path).returncode == 0


# Row 6 -------------------------------------------------------------------

def test_a_cast_view_read_as_the_source_is_cut_short_is_eio_and_the_daemon_lives(tmp_path, mount, pauses):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.arange(1 << 16, dtype=np.float32)}, str(src))
    pause = pauses("view:read-source")
    m = mount(src)
    view = os.path.join(m.path, "__views__", "bf16", "model.safetensors")
    size = os.stat(view).st_size
    import threading
    got = {}

    def read():
        try:
            with open(view, "rb") as f:
                f.seek(size - 4096)
                got["data"] = f.read(4096)
        except OSError as e:
            got["error"] = e.errno

    reader = threading.Thread(target=read)
    reader.start()
    pause.wait("view:read-source")  # checked the source, about to read it
    os.truncate(src, 4096)
    pause.go("view:read-source")
    reader.join(60)
    assert got.get("error") == errno.EIO, got
    assert os.path.exists(f"/proc/{m.pid}"), "the daemon died"
    assert "w" in os.listdir(m.path)


# Rows 7, 8 ---------------------------------------------------------------

@ROOT_ONLY
def test_views_of_a_folder_need_every_shard_they_draw_on(shared, user, mount):
    folder = os.path.join(shared, "f")
    os.mkdir(folder)
    os.chmod(folder, 0o755)
    save_file({"pub": np.ones(4, np.float32)}, os.path.join(folder, "a.safetensors"))
    save_file({"secret": np.ones(4, np.float32)}, os.path.join(folder, "b.safetensors"))
    os.chmod(os.path.join(folder, "a.safetensors"), 0o644)
    os.chmod(os.path.join(folder, "b.safetensors"), 0o600)
    m = mount(folder, "-o", "allow_other", at=shared)
    views = os.path.join(m.path, "__views__")
    assert as_user(user, "cat", os.path.join(m.path, "a", "pub")).returncode == 0
    assert as_user(user, "cat", os.path.join(views, "a.safetensors")).returncode == 0
    for path in ("merged.safetensors", "bf16/b.safetensors", "b.safetensors"):
        p = as_user(user, "cat", os.path.join(views, path))
        assert p.returncode != 0 and "Permission denied" in p.stderr, (path, p.stdout[:100], p.stderr)
    p = as_user(user, "ls", os.path.join(views, "npy", "b"))
    assert p.returncode != 0 and "secret" not in p.stdout, p.stdout
    assert as_user(user, "ls", os.path.join(views, "npy", "a")).stdout.split() == ["pub.npy"]


@ROOT_ONLY
def test_permissions_follow_the_source_now_and_a_rewrite_keeps_them(shared, user, mount, run):
    src = os.path.join(shared, "s.safetensors")
    t = base(src)
    os.chmod(src, 0o644)
    m = mount(src, "-o", "allow_other", at=shared)
    a = os.path.join(m.path, "a")
    assert as_user(user, "cat", a).returncode == 0
    os.chmod(src, 0o600)
    time.sleep(1.2)  # past the kernel's attribute timeout (1 s)
    p = as_user(user, "cat", a)
    assert p.returncode != 0 and "Permission denied" in p.stderr, p.stderr
    assert os.stat(a).st_mode & 0o777 == 0o600
    # A rewrite (--compact) gives the new file the mode the source has now.
    set_metadata(m, k="v")
    p = run("commit", "--compact", m.path)
    assert p.returncode == 0 and "rewrite" in p.stdout, p.stdout + p.stderr
    assert os.stat(src).st_mode & 0o7777 == 0o600
    assert_checkpoint(src, t, {"k": "v"}, compact=True)


def have_acl():
    return shutil.which("setfacl") is not None


@ROOT_ONLY
@pytest.mark.skipif(not have_acl(), reason="setfacl is missing (scripts/setup installs acl)")
@pytest.mark.parametrize("acl,group_bits", [
    ("g::---,u:nobody:r--,o::---", 0o040),  # a named user: the mask r shows as the group's
    ("g::---,m::rw-,o::---", 0o060),  # a mask alone
])
def test_an_acl_that_denies_a_user_is_enforced_through_the_mount_and_kept_by_a_rewrite(shared, user, mount, run,
                                                                                    acl, group_bits):
    name, uid, gid = user
    src = os.path.join(shared, "s.safetensors")
    t = base(src)
    os.chown(src, 0, gid)  # the user is in the file's group...
    # ...which the ACL denies, while the mode shows the mask as the group's bits.
    subprocess.run(["setfacl", "-m", acl, src], check=True)
    os.setxattr(src, "user.origin", b"hub")
    assert os.stat(src).st_mode & 0o070 == group_bits
    assert as_user(user, "cat", src).returncode != 0  # the ACL, on the source itself
    m = mount(src, "-o", "allow_other", at=shared)
    p = as_user(user, "cat", os.path.join(m.path, "a"))
    assert p.returncode != 0 and "Permission denied" in p.stderr, p.stderr
    acl_before = subprocess.run(["getfacl", "-cp", src], capture_output=True, text=True).stdout
    set_metadata(m, k="v")
    p = run("commit", "--compact", m.path)
    assert p.returncode == 0 and "rewrite" in p.stdout, p.stdout + p.stderr
    assert subprocess.run(["getfacl", "-cp", src], capture_output=True, text=True).stdout == acl_before
    assert os.getxattr(src, "user.origin") == b"hub"
    assert_checkpoint(src, t, {"k": "v"}, compact=True)


def test_a_rewrite_keeps_user_xattrs(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    try:
        os.setxattr(src, "user.origin", b"hub")
    except OSError:
        pytest.skip("this filesystem has no user xattrs")
    m = mount(src)
    set_metadata(m, k="v")
    p = run("commit", "--compact", m.path)
    assert p.returncode == 0 and "rewrite" in p.stdout, p.stdout
    assert os.getxattr(src, "user.origin") == b"hub"
    assert_checkpoint(src, t, {"k": "v"}, compact=True)


# Row 10 ------------------------------------------------------------------

@ROOT_ONLY
def test_a_co_users_lock_on_the_source_does_not_hold_commits_up(shared, user, mount, run):
    src = os.path.join(shared, "s.safetensors")
    t = base(src)
    os.chmod(src, 0o644)
    _, uid, gid = user
    holder = subprocess.Popen(
        ["python3", "-c", "import fcntl,sys,time; f=open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); print('locked', flush=True); time.sleep(120)", src],
        user=uid, group=gid, extra_groups=[], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        m = mount(src, at=shared)
        set_metadata(m, k="v")
        p = run("commit", m.path, timeout=30)
        assert p.returncode == 0 and "committed" in p.stdout, p.stdout + p.stderr
        assert_checkpoint(src, t, {"k": "v"})
    finally:
        holder.kill()
        holder.wait()


@ROOT_ONLY
def test_temp_names_made_in_advance_by_a_co_user_do_not_stop_a_rewrite(shared, user, mount, run):
    src = os.path.join(shared, "s.safetensors")
    t = base(src)
    m = mount(src, at=shared)
    # Every name the old scheme (pid, then a counter) would have tried.
    names = [f".s.safetensors.stfs-tmp-{m.pid}-{n:x}" for n in range(2048)]
    script = "import sys,os\nfor n in sys.argv[1:]: open(os.path.join(%r, n), 'w').close()" % shared
    p = as_user(user, "python3", "-c", script, *names)
    assert p.returncode == 0, p.stderr
    set_metadata(m, k="v")
    p = run("commit", "--compact", m.path)
    assert p.returncode == 0 and "rewrite" in p.stdout, p.stdout + p.stderr
    assert_checkpoint(src, t, {"k": "v"}, compact=True)
    assert all(os.path.exists(os.path.join(shared, n)) for n in names[:5]), "a co-user's files were removed"


# Row 11 ------------------------------------------------------------------

def test_set_id_bits_are_kept_by_an_in_place_commit(tmp_path, mount, run, stfs):
    """The kernel clears set-id bits when a writer without CAP_FSETID writes
    the file: an owner (scripts/test_as_user), or here root without it."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    os.chmod(src, 0o6754)
    binary = stfs
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("setpriv is missing")
        binary = tmp_path / "stfs-without-fsetid"
        binary.write_text(f"#!/bin/sh\nexec setpriv --bounding-set=-fsetid -- {stfs} \"$@\"\n")
        binary.chmod(0o755)
    m = mount(src, binary=binary)
    set_metadata(m, k="v")
    p = run("commit", m.path)
    assert p.returncode == 0 and "in place" in p.stdout, p.stdout
    assert os.stat(src).st_mode & 0o7777 == 0o6754
    assert_checkpoint(src, t, {"k": "v"})


@pytest.mark.parametrize("step", ["rewrite:copying", "rewrite:written"])
def test_a_rewrite_that_fails_before_landing_leaves_nothing_behind(tmp_path, mount, run, step):
    """A commit failing while it writes its new file (an I/O error at `step`): the temp
    file is removed, the source is unchanged, and the edits stay for the next commit."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    before = src.read_bytes()
    m = mount(src, env={"STFS_FAULT_AT": f"{step}:EIO"})
    os.unlink(os.path.join(m.path, "b"))
    new_a = write_a(m, 3)
    p = run("commit", "--compact", m.path)  # (a rewrite)
    assert p.returncode != 0 and "Input/output error" in p.stderr, p.stdout + p.stderr
    assert src.read_bytes() == before
    assert not [n for n in os.listdir(tmp_path) if ".stfs-tmp-" in n], os.listdir(tmp_path)
    # The edits stay, more follow, and the next commit lands them all.
    with open(os.path.join(m.path, "c"), "r+b") as f:
        f.write(b"\x09")
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    del t["b"]
    t["a"] = new_a
    t["c"] = np.concatenate([[9], np.ones(4, np.uint8)]).astype(np.uint8)
    assert_checkpoint(src, t)
    assert not [n for n in os.listdir(tmp_path) if ".stfs-tmp-" in n]


def test_a_folder_commit_that_fails_after_a_file_was_written_removes_it(tmp_path, mount, run):
    """Two new files to write (a shard and the index): the second fails (the second time
    `rewrite:written` is reached), so the first, written already, is removed too."""
    folder = tmp_path / "f"
    folder.mkdir()
    t = base(folder / "s0.safetensors")
    before = (folder / "s0.safetensors").read_bytes()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: "s0.safetensors" for k in t}}))
    index_before = (folder / "model.safetensors.index.json").read_bytes()
    m = mount(folder, env={"STFS_FAULT_AT": "rewrite:written:EIO:2"})
    os.unlink(os.path.join(m.path, "s0", "b"))
    p = run("commit", "--compact", m.path)  # a rewrite of the shard, and of the index
    assert p.returncode != 0 and "Input/output error" in p.stderr, p.stdout + p.stderr
    assert (folder / "s0.safetensors").read_bytes() == before
    assert (folder / "model.safetensors.index.json").read_bytes() == index_before
    assert not [n for n in os.listdir(folder) if ".stfs-tmp-" in n], os.listdir(folder)
    p = run("commit", "--compact", m.path)
    assert p.returncode == 0, p.stderr
    del t["b"]
    assert_checkpoint(folder / "s0.safetensors", t)
    assert json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"] == {
        "a": "s0.safetensors", "c": "s0.safetensors"}


# Faults in recovery (issue 26) -------------------------------------------

@pytest.mark.parametrize("step", ["in-place:write", "in-place:header", "in-place:sync", "in-place:mark"])
def test_a_recovery_that_fails_keeps_its_record_and_the_next_mount_completes_it(tmp_path, mount, run, monkeypatch, step):
    src, t, new_a = killed_mid_commit(tmp_path, mount, run, monkeypatch)
    # The next mount's completion fails at `step`: it says why, keeps the record, and
    # the file stays refused.
    m2 = mount(src, expect_ok=False, env={"STFS_FAULT_AT": f"{step}:EIO"})
    assert not m2.ok and "Input/output error" in m2.result.stderr, m2.result.stderr
    assert refused_by_readers(src)
    [staging] = [p for p in tmp_path.iterdir() if p.name.startswith(".m.safetensors.stfs-")]
    assert (staging / "commit.json").exists()
    # The one after completes it, with the edit.
    m3 = mount(src)
    assert "completed a commit that was interrupted" in m3.result.stdout + m3.result.stderr
    t["a"] = new_a
    assert_checkpoint(src, t)


# Deterministic races (issue 26) -------------------------------------------

def write_small(path, byte):
    """Writes `byte` over the whole of tensor "small" (4096 bytes) at `path`."""
    with open(path, "r+b") as f:
        f.write(byte * 4096)


def small_written_after_a_big(tmp_path, mount, pauses, big):
    """tmp_path/m.safetensors holding "big" (`big` bytes), then "small", mounted with
    its daemon pausing at "rewrite:copying", and "small" written (all 0x01) through
    the mount: (source, the Pauses, the mount, small's path)."""
    src = tmp_path / "m.safetensors"
    save_file({"big": np.zeros(big, np.uint8), "small": np.zeros(4096, np.uint8)}, str(src))
    pause = pauses("rewrite:copying")
    m = mount(src)
    small = os.path.join(m.path, "small")
    write_small(small, b"\x01")
    return src, pause, m, small


def test_a_write_into_a_staged_tensor_while_a_commit_copies_it_stays_for_the_next(tmp_path, mount, pauses, run, stfs):
    src, pause, m, small = small_written_after_a_big(tmp_path, mount, pauses, 1 << 20)
    commit = commit_paused_at(stfs, pause, "rewrite:copying", "--compact", m.path)  # "big" copied, "small" next
    write_small(small, b"\x02")
    rc, out, err = let_finish(pause, "rewrite:copying", commit)
    assert rc == 0 and "rewrite" in out, out + err
    assert load_file(str(src))["small"].tobytes() == b"\x01" * 4096, "the commit took bytes written after its plan"
    st = run("status", m.path)
    assert "small" in st.stdout, st.stdout
    assert run("commit", m.path).returncode == 0
    assert load_file(str(src))["small"].tobytes() == b"\x02" * 4096


def test_a_reader_that_opens_the_source_mid_commit_waits_and_reads_the_new_file(tmp_path, mount, pauses, run, stfs):
    src, t, pause, m = mounted_with_pauses(tmp_path, mount, pauses, "in-place:data")
    new_a = write_a(m, 9)
    commit = commit_paused_at(stfs, pause, "in-place:data", m.path)  # marked, half written, under the lease
    reader = subprocess.Popen(
        ["python3", "-c", "import mmap,sys; f=open(sys.argv[1],'rb'); m=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ); "
                          "sys.stdout.buffer.write(m[:])", str(src)], stdout=subprocess.PIPE)
    # Its open waits: the kernel shows the commit's lease being broken.
    deadline = time.monotonic() + 60
    while "BREAKING" not in open("/proc/locks").read():
        assert reader.poll() is None, "the reader's open did not wait for the commit's lease"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rc, out, err = let_finish(pause, "in-place:data", commit)
    seen = reader.communicate(timeout=60)[0]
    assert rc == 0 and "in place" in out, out + err
    assert seen == src.read_bytes(), "the reader saw another file than the one the commit left"
    t["a"] = new_a
    assert_checkpoint(src, t)


def test_a_second_mounts_cleanup_leaves_a_live_commits_temp_file(tmp_path, mount, pauses, run, stfs):
    src, t, pause, m = mounted_with_pauses(tmp_path, mount, pauses, "rewrite:written")
    set_metadata(m, k="v")
    commit = commit_paused_at(stfs, pause, "rewrite:written", "--compact", m.path)  # its temp file is beside the source
    temps = [p for p in tmp_path.iterdir() if ".stfs-tmp-" in p.name]
    assert len(temps) == 1
    m2 = mount(src)  # removes the temp files of dead daemons, not of live ones
    assert temps[0].exists(), "a second mount removed a live commit's temp file"
    rc, out, err = let_finish(pause, "rewrite:written", commit)
    assert rc == 0 and "rewrite" in out, out + err
    assert_checkpoint(src, t, {"k": "v"}, compact=True)
    m2.close()


def test_a_lazy_unmount_during_a_commit_lets_it_finish(tmp_path, mount, pauses, run, stfs):
    src, t, pause, m = mounted_with_pauses(tmp_path, mount, pauses, "rewrite:copying")
    set_metadata(m, k="v")
    commit = commit_paused_at(stfs, pause, "rewrite:copying", "--compact", m.path)
    p = subprocess.run(["umount", m.path], capture_output=True, text=True)
    assert p.returncode != 0 and m.is_mounted(), "a plain umount went through a running commit"
    subprocess.run(["umount", "-l", m.path], check=True)
    rc, out, err = let_finish(pause, "rewrite:copying", commit)
    assert rc == 0 and "rewrite" in out, out + err
    wait_for_exit(m.pid, 20)
    assert_checkpoint(src, t, {"k": "v"}, compact=True)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".m.safetensors.stfs-")], "staging left"


@ROOT_ONLY
def test_a_commit_that_outlives_its_lease_makes_the_next_commit_refuse(tmp_path, mount, pauses, run, stfs):
    """An open that waited past /proc/sys/fs/lease-break-time gets in while the
    commit still writes: that program may write, so the next commit is refused."""
    src = tmp_path / "m.safetensors"
    base(src)
    knob = "/proc/sys/fs/lease-break-time"
    saved = open(knob).read().strip()
    pause = pauses("in-place:data")
    m = mount(src)
    write_a(m, 4)
    try:
        with open(knob, "w") as f:
            f.write("1")
        commit = commit_paused_at(stfs, pause, "in-place:data", m.path)
        # This open waits a second for the lease, then gets in mid-commit.
        opened = subprocess.run(["python3", "-c", "import sys; open(sys.argv[1], 'rb').close()", str(src)], timeout=60)
        assert opened.returncode == 0
        rc, out, err = let_finish(pause, "in-place:data", commit)
    finally:
        with open(knob, "w") as f:
            f.write(saved)
    assert rc == 0, out + err
    set_metadata(m, k="v")
    p = run("commit", m.path)
    assert p.returncode != 0 and "changed since it was mounted" in p.stderr, p.stdout + p.stderr
    assert run("commit", "--force", m.path).returncode == 0


def read_pty(fd, until=None, timeout=30):
    """What a terminal shows, up to `until` (or the end of the program)."""
    out, deadline = b"", time.monotonic() + timeout
    while until is None or until not in out:
        assert time.monotonic() < deadline, f"{until!r} never shown; shown: {out!r}"
        ready, _, _ = select.select([fd], [], [], 0.1)
        if not ready:
            continue
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the program and every holder of the terminal are gone
            break
        if not chunk:
            break
        out += chunk
    return out


def test_a_commit_shows_its_progress_on_a_terminal_and_nothing_in_a_pipe(tmp_path, mount, pauses, stfs):
    src, pause, m, _ = small_written_after_a_big(tmp_path, mount, pauses, 4 << 20)
    terminal, screen = pty.openpty()
    commit = subprocess.Popen([stfs, "commit", "--compact", m.path], stdin=screen, stdout=screen, stderr=screen,
                              env={**os.environ, "TERM": "xterm"})
    os.close(screen)
    try:
        pause.wait("rewrite:copying", commit)  # "big" copied, "small" next
        shown = read_pty(terminal, until=b"committing m.safetensors")
        assert b"4.00 MiB" in shown or b"4.00 MiB" in read_pty(terminal, until=b"4.00 MiB"), shown
        pause.go("rewrite:copying")
        shown += read_pty(terminal)
        assert commit.wait(timeout=60) == 0, shown
    finally:
        os.close(terminal)
    assert b"committed by a rewrite" in shown, shown
    # Scripts see only the result. (A daemon pauses once at a step: a second mount.)
    pause = pauses("rewrite:copying")
    m = mount(src)
    write_small(os.path.join(m.path, "small"), b"\x02")
    commit = commit_paused_at(stfs, pause, "rewrite:copying", "--compact", m.path)
    time.sleep(1)  # (a bar would have asked for the progress 5 times by now)
    rc, out, err = let_finish(pause, "rewrite:copying", commit)
    assert (rc, err) == (0, "") and out.count("\n") == 1 and "committed by a rewrite" in out, out + err


def test_progress_with_no_commit_running_answers_every_field(tmp_path, mount):
    import fcntl
    import struct
    src = tmp_path / "m.safetensors"
    base(src)
    m = mount(src)
    ioc_progress = (3 << 30) | (4096 << 16) | (ord("s") << 8) | 4  # include/stfs.h
    # A caller that reuses its struct: what it put there must not come back.
    buf = bytearray(struct.pack("<IIQQ", 4096, 1, 5, 7) + b"stale\0".ljust(4072, b"\0"))
    fd = os.open(m.path, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, ioc_progress, buf, True)
    finally:
        os.close(fd)
    size, active, done, total = struct.unpack_from("<IIQQ", buf)
    assert (size, active, done, total, bytes(buf[24:29])) == (4096, 0, 0, 0, b"\0" * 5)


def test_a_gguf_key_edited_during_an_in_place_commit_leaves_the_others_as_they_were(
        tmp_path, mount, pauses, run, stfs):
    """A key edited while an in-place commit runs stays an edit, and the keys nobody
    touched are the new file's. (They were read again from the old file, which the
    commit had rewritten: the vocabulary read back empty, and the next commit planned
    it as garbage.)"""
    import gguf
    from gguf_models import write_model
    path = tmp_path / "tiny.gguf"
    write_model(path)
    p = pauses("in-place:recorded")
    m = mount(path)
    kv = pathlib.Path(m.path) / "__kv__"
    (kv / "tokenizer.chat_template").write_text("{{ first }}\n")
    commit = commit_paused_at(stfs, p, "in-place:recorded", m.path)
    (kv / "tokenizer.chat_template").write_text("{{ second }}\n")
    rc, out, err = let_finish(p, "in-place:recorded", commit)
    assert rc == 0 and "in place" in out, out + err
    assert json.loads((kv / "tokenizer.ggml.tokens").read_text()) == ["<s>", "</s>", "hello"]
    status = run("status", m.path).stdout
    assert "tokenizer.chat_template: set" in status and "tokens" not in status, status
    assert run("commit", m.path).returncode == 0
    r = gguf.GGUFReader(str(path))
    tokens = r.fields["tokenizer.ggml.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data] == ["<s>", "</s>", "hello"]
    template = r.fields["tokenizer.chat_template"]
    assert bytes(template.parts[template.data[0]]).decode() == "{{ second }}"
    del r, tokens, template


def test_a_tensor_written_in_part_during_its_in_place_commit_keeps_both_writes(tmp_path, mount, pauses, run, stfs):
    """A write into a tensor written in part while a commit writes its blocks
    back goes to a copy of its staged blocks: the commit writes what it took,
    the mount shows both writes, and the next commit (in place again: the
    copy lies over the new file's tensor) writes the second."""
    rng = np.random.default_rng(3)
    src = tmp_path / "m.safetensors"
    a = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    save_file({"a": a, "b": np.arange(10, dtype=np.uint8)}, str(src))
    p = pauses("in-place:recorded")
    m = mount(src)
    path = os.path.join(m.path, "a")
    first, second = a.copy(), a.copy()

    def patch(at, data, expected):
        write_at(path, data, at)
        for e in expected:
            e[at:at + len(data)] = np.frombuffer(data, np.uint8)

    patch(100, b"first", [first, second])
    commit = commit_paused_at(stfs, p, "in-place:recorded", m.path)
    patch(2 << 20, b"second", [second])
    patch(102, b"XY", [second])
    code, out, err = let_finish(p, "in-place:recorded", commit)
    assert code == 0 and "in place" in out and "written in part" in out, out + err
    assert load_file(str(src))["a"].tobytes() == first.tobytes()
    assert open(path, "rb").read() == second.tobytes()
    # Still the file's tensor "a", written since: not a new one.
    st = run("status", m.path).stdout
    assert "rewritten  a" in st and "added" not in st, st
    out = run("commit", m.path)
    assert out.returncode == 0 and "in place" in out.stdout, out.stdout + out.stderr
    assert load_file(str(src))["a"].tobytes() == second.tobytes()


def test_a_tensor_written_during_its_commit_then_removed_is_said_removed(tmp_path, mount, pauses, run, stfs):
    """After a commit that a write into the tensor raced, `rm` of it is a
    removal (status said "meta ... without a data file" and no removal)."""
    src = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(1 << 20, np.uint8), "b": np.ones(4, np.float32)}, str(src))
    p = pauses("in-place:data")
    m = mount(src)
    path = os.path.join(m.path, "a")
    with open(path, "r+b") as f:
        f.write(b"first")
    commit = commit_paused_at(stfs, p, "in-place:data", m.path)
    with open(path, "r+b") as f:
        f.seek(300000)
        f.write(b"second")
    code, out, err = let_finish(p, "in-place:data", commit)
    assert code == 0 and "written in part" in out, out + err
    st = run("status", m.path).stdout
    assert "rewritten  a" in st and "added" not in st, st
    os.unlink(path)
    st = run("status", m.path).stdout
    assert "removed    a" in st and "without a data file" not in st, st
    assert run("commit", m.path).returncode == 0
    assert list(load_file(str(src))) == ["b"]


def test_a_write_during_a_commit_that_lands_then_crashes_comes_back(tmp_path, mount, pauses, run, stfs):
    """A tensor written in part, written again while its in-place commit runs,
    and the daemon killed once the file landed, before the journal was
    rewritten: the next mount takes the second write back over the tensor in
    the new file (it was dropped as "not in the committed file")."""
    rng = np.random.default_rng(8)
    src = tmp_path / "m.safetensors"
    a = rng.integers(0, 255, 3 << 20, dtype=np.uint8)
    save_file({"a": a, "b": np.arange(10, dtype=np.uint8)}, str(src))
    p = pauses("in-place:recorded")
    m = mount(src, env={"STFS_CRASH_AT": "in-place:landed"})
    path = os.path.join(m.path, "a")
    want = a.copy()
    for at, data in [(100, b"first"), (2 << 20, b"second")]:
        if at != 100:
            commit = commit_paused_at(stfs, p, "in-place:recorded", m.path)
        # (No fsync: it would wait for the commit; a killed daemon's edits
        # are in the journal's page cache.)
        write_at(path, data, at)
        want[at:at + len(data)] = np.frombuffer(data, np.uint8)
    code, out, err = let_finish(p, "in-place:recorded", commit)
    assert code != 0, out + err
    wait_for_exit(m.pid, 20)
    assert run("umount", m.path).returncode == 0
    m.pid = None
    first = a.copy()
    first[100:105] = np.frombuffer(b"first", np.uint8)
    assert load_file(str(src))["a"].tobytes() == first.tobytes(), "the commit landed"
    p.release_all()  # (no pause in the next mount)
    m2 = mount(src)
    assert "took back" in m2.result.stderr and "not restored" not in m2.result.stderr, m2.result.stderr
    assert open(os.path.join(m2.path, "a"), "rb").read() == want.tobytes()
    assert run("commit", m2.path).returncode == 0
    assert load_file(str(src))["a"].tobytes() == want.tobytes()
