"""Security and resource limits (issue 9), probed as a local attacker and as a
heavy user would, with the daemon running as root: another user created by
the test (and removed after) reads and edits through `-o allow_other`, plants
links and folders where staging and logs go, and the kernel, not luck, keeps
them out. See "Who may do what" in docs/SEMANTICS.md."""

import errno
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import as_user
from stfs_fixtures import assert_checkpoint, base, wait_for_exit

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it creates a user and mounts as root")


def test_allow_other_shows_and_enforces_the_sources_permissions(shared, user, mount, run, stfs):
    src = os.path.join(shared, "s.safetensors")
    t = base(src)
    os.chmod(src, 0o600)  # root:root 0600: the other user may not even read it
    m = mount(src, "-o", "allow_other", at=shared)
    st = os.stat(os.path.join(m.path, "a"))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, 0, 0o600)
    assert os.stat(m.path).st_mode & 0o777 == 0o700
    a = os.path.join(m.path, "a")
    for cmd in (["cat", a], ["ls", m.path],
                ["dd", "if=/dev/zero", f"of={a}", "bs=1", "count=1", "conv=notrunc"], ["rm", a]):
        p = as_user(user, *cmd)
        assert p.returncode != 0 and "Permission denied" in p.stderr, (cmd, p.stderr)
    # The owner stages an edit; the other user can neither commit nor drop it.
    with open(os.path.join(m.path, "c"), "r+b") as f:
        f.write(b"\x07")
    p = as_user(user, stfs, "commit", m.path)
    assert p.returncode != 0
    p = as_user(user, stfs, "umount", "--discard", m.path)
    assert p.returncode != 0
    assert m.is_mounted() and open(os.path.join(m.path, "c"), "rb").read()[0] == 7
    assert run("umount", m.path).returncode == 0
    m.close()
    t["c"][0] = 7
    assert_checkpoint(src, t)
    assert (os.stat(src).st_mode & 0o777, os.stat(src).st_uid) == (0o600, 0)

    # Readable by others (0644): reads work, writes and removals do not, nor commits.
    os.chmod(src, 0o644)
    m = mount(src, "-o", "allow_other", at=shared)
    p = as_user(user, "cat", f"{m.path}/a")
    assert p.returncode == 0, p.stderr
    for cmd in (["dd", "if=/dev/zero", f"of={m.path}/a", "bs=1", "count=1", "conv=notrunc"],
                ["rm", f"{m.path}/a"], ["touch", f"{m.path}/new"],
                ["bash", "-c", f"echo '{{}}' > {m.path}/__metadata__.json"]):
        p = as_user(user, *cmd)
        assert p.returncode != 0 and "Permission denied" in p.stderr, (cmd, p.stderr)
    # Staged edits are the mounting user's business (issue 18).
    p = as_user(user, stfs, "status", m.path)
    assert p.returncode != 0 and "for the user who mounted" in p.stderr, p.stderr

    # Writable by its group: a member edits, but only the owner (or root) commits,
    # and the commit keeps owner, group and mode.
    _, uid, gid = user
    os.chown(src, 0, gid)
    os.chmod(src, 0o660)
    m2 = mount(src, "-o", "allow_other", at=shared)
    p = as_user(user, "dd", "if=/dev/zero", f"of={m2.path}/c", "bs=1", "count=1", "conv=notrunc")
    assert p.returncode == 0, p.stderr
    p = as_user(user, stfs, "commit", m2.path)
    assert p.returncode != 0 and "for the user who mounted" in p.stderr, p.stderr
    assert run("commit", m2.path).returncode == 0
    t["c"][0] = 0
    assert_checkpoint(src, t)
    st = os.stat(src)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, gid, 0o660)


def test_staging_cannot_be_redirected(shared, user, mount, run):
    src = os.path.join(shared, "m.safetensors")
    t = base(src)
    victim = os.path.join(shared, "victim")
    with open(victim, "wb") as f:
        f.write(b"precious")
    victim_dir = os.path.join(shared, "victim-dir")
    os.mkdir(victim_dir)
    open(os.path.join(victim_dir, "keep"), "w").close()
    # The attacker plants, where staging folders go: a folder of its own with
    # a journal pointing at the victim and a link named like a staging file,
    # and a link to a root-owned folder.
    own = os.path.join(shared, ".m.safetensors.stfs-aaaaaaaa")
    as_user(user, "mkdir", "-m", "0700", own)
    as_user(user, "ln", "-s", victim, os.path.join(own, "s1"))
    as_user(user, "bash", "-c", f"echo '[{{}}]' > {own}/m.safetensors.journal")
    as_user(user, "ln", "-s", victim_dir, os.path.join(shared, ".m.safetensors.stfs-bbbbbbbb"))
    m = mount(src)
    assert "ignored" in m.result.stderr and "owned by uid" in m.result.stderr, m.result.stderr
    for i in range(3):
        with open(os.path.join(m.path, "c"), "r+b") as f:
            f.write(bytes([i]))
    assert run("commit", m.path).returncode == 0
    assert run("umount", m.path).returncode == 0
    m.close()
    t["c"][0] = 2
    assert_checkpoint(src, t)
    assert open(victim, "rb").read() == b"precious"
    assert os.listdir(victim_dir) == ["keep"] and os.path.islink(os.path.join(shared, ".m.safetensors.stfs-bbbbbbbb"))
    assert os.path.isdir(own) and os.path.islink(os.path.join(own, "s1")), "others' files are never removed"
    ours = [n for n in os.listdir(shared) if n.startswith(".m.safetensors.stfs-") and n[-8:] not in ("aaaaaaaa", "bbbbbbbb")]
    assert ours == [], ours


def test_logs_and_pid_files_are_not_redirected(shared, user, tmp_path, stfs):
    src = tmp_path / "m.safetensors"
    base(src)
    victim = os.path.join(shared, "victim")
    with open(victim, "w") as f:
        f.write("precious")
    link = os.path.join(shared, "stfs.log")
    as_user(user, "ln", "-s", victim, link)
    theirs = os.path.join(shared, "theirs.log")
    as_user(user, "bash", "-c", f"umask 0; touch {theirs}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for log in (link, theirs):
        p = subprocess.run([stfs, "mount", "--log-file", log, str(src), str(mnt)], capture_output=True, text=True)
        assert p.returncode != 0 and "refused" in p.stderr, p.stderr
        assert not any(line.split()[4] == str(mnt) for line in open("/proc/self/mountinfo"))
    # A pid file that is a link, another user's file, or a FIFO (at the log's
    # path too): the mount is refused at once, before it mounts, and nothing
    # is written through (a FIFO once hung the mount, or left it answering
    # nothing until someone opened the FIFO; another user's file was emptied).
    fifo = os.path.join(shared, "fifo")
    as_user(user, "mkfifo", fifo)
    os.chmod(theirs, 0o666)
    with open(theirs, "w") as f:
        f.write("theirs")
    for flag, path in (("--pid-file", link), ("--pid-file", theirs), ("--pid-file", fifo), ("--log-file", fifo)):
        args = ["--log-file", str(tmp_path / "ok.log")] if flag == "--pid-file" else []
        p = subprocess.run([stfs, "mount", *args, flag, path, str(src), str(mnt)],
                           capture_output=True, text=True, timeout=30)
        try:
            assert p.returncode != 0 and "refused" in p.stderr, (flag, path, p.stderr)
            assert not any(line.split()[4] == str(mnt) for line in open("/proc/self/mountinfo"))
        finally:
            if p.returncode == 0:
                subprocess.run([stfs, "umount", str(mnt)], capture_output=True)
    assert open(victim).read() == "precious"
    assert open(theirs).read() == "theirs"
    # The default log is private to the user.
    home = tmp_path / "home"
    env = dict(os.environ, HOME=str(home))
    env.pop("XDG_STATE_HOME", None)
    p = subprocess.run([stfs, "mount", str(src), str(mnt)], capture_output=True, text=True, env=env)
    try:
        assert p.returncode == 0, p.stderr
        log = home / ".local/state/stfs/stfs.log"
        assert (log.stat().st_mode & 0o777, log.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        assert "mounted" in log.read_text()
    finally:
        subprocess.run([stfs, "umount", str(mnt)], capture_output=True)


def test_kept_edits_are_taken_only_by_staging_file_names(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    m = mount(src)
    with open(os.path.join(m.path, "c"), "r+b") as f:
        f.write(b"\x09")
    os.kill(m.pid, signal.SIGKILL)
    wait_for_exit(m.pid, 20)
    assert run("umount", m.path).returncode == 0
    m.pid = None
    [kept] = tmp_path.glob(".m.safetensors.stfs-*")
    journal = kept / "m.safetensors.journal"
    lines = journal.read_text().splitlines()
    forged = [{"op": "entry", "name": "c", "meta": {"Valid": {"dtype": "U8", "shape": [5]}},
               "data": {"Staged": {"file": "/etc/hostname"}}},
              {"op": "entry", "name": "b", "meta": {"Valid": {"dtype": "I64", "shape": [2, 3]}},
               "data": {"Staged": {"file": "../../etc/hostname"}}}]
    journal.write_text("\n".join([lines[0], json.dumps(forged)]) + "\n")
    m2 = mount(src)
    assert m2.result.stderr.count("not restored") == 2, m2.result.stderr
    hostname = open("/etc/hostname", "rb").read()
    for n in ("b", "c"):
        assert open(os.path.join(m2.path, n), "rb").read() != hostname
    # --resume takes only a staging folder of this source.
    m3 = mount(src, "--resume", "/etc", expect_ok=False)
    assert not m3.ok and "not a staging folder" in m3.result.stderr


def test_staging_is_private_whatever_the_umask(tmp_path, mount, stfs):
    src = tmp_path / "m.safetensors"
    base(src)
    os.chmod(src, 0o644)
    old = os.umask(0)
    try:
        m = mount(src)
    finally:
        os.umask(old)
    with open(os.path.join(m.path, "c"), "r+b") as f:
        f.write(b"\x01")
    [staging] = tmp_path.glob(".m.safetensors.stfs-*")
    assert staging.stat().st_mode & 0o777 == 0o700
    files = list(staging.iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files), [(f, oct(f.stat().st_mode)) for f in files]


def test_commit_keeps_the_owner_and_follows_a_link(tmp_path, user, mount, run):
    _, uid, gid = user
    src = tmp_path / "owned.safetensors"
    t = base(src)
    os.chown(src, uid, gid)
    os.chmod(src, 0o640)
    m = mount(src)
    os.unlink(os.path.join(m.path, "c"))
    assert run("commit", m.path).returncode == 0
    del t["c"]
    assert_checkpoint(src, t)
    st = os.stat(src)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o640)

    # A Hugging Face cache: snapshots/main/model.safetensors -> ../../blobs/<sha>.
    cache = tmp_path / "hub"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snapshots" / "main").mkdir(parents=True)
    blob = cache / "blobs" / "0123abcd"
    t2 = base(blob)
    link = cache / "snapshots" / "main" / "model.safetensors"
    os.symlink("../../blobs/0123abcd", link)
    m2 = mount(link)
    os.unlink(os.path.join(m2.path, "a"))
    assert run("commit", m2.path).returncode == 0
    del t2["a"]
    assert os.path.islink(link) and os.readlink(link) == "../../blobs/0123abcd"
    assert_checkpoint(blob, t2)
    assert not any(n.name.startswith(".") for n in (cache / "snapshots" / "main").iterdir())


def test_thousands_of_staged_tensors_under_a_low_descriptor_limit(tmp_path, run, stfs):
    src = tmp_path / "many.safetensors"
    n = 3000
    tensors = {f"t{i:05}": np.full(4, i % 251, np.uint8) for i in range(n)}
    save_file(tensors, str(src))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "log"
    # Soft and hard limit 1024: the daemon cannot raise it, and must not need to.
    p = subprocess.run(["bash", "-c", f"ulimit -n 1024 && exec {stfs} mount --log-file {log} --pid-file {log}.pid {src} {mnt}"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    pid = int(open(f"{log}.pid").read())
    try:
        for i in range(n):
            with open(mnt / f"t{i:05}", "r+b") as f:
                f.write(bytes([(i + 1) % 251]))
        assert len(os.listdir(f"/proc/{pid}/fd")) < 1024
        p = run("commit", mnt)
        assert p.returncode == 0, p.stderr
    finally:
        subprocess.run([stfs, "umount", str(mnt)], capture_output=True)
        wait_for_exit(pid, 30)
    got = load_file(str(src))
    for i in range(n):
        assert got[f"t{i:05}"][0] == (i + 1) % 251 and got[f"t{i:05}"][1] == i % 251


def test_a_hundred_thousand_edited_tensors_commit(tmp_path, mount, run):
    src = tmp_path / "huge.safetensors"
    n = 100_000
    save_file({f"t{i}": np.zeros(2, np.uint8) for i in range(n)}, str(src))
    m = mount(src)
    for i in range(n):
        # Cut and extend: the bytes move to a staging file each (zeros, a hole).
        p = os.path.join(m.path, f"t{i}")
        os.truncate(p, 1)
        os.truncate(p, 2)
    p = run("commit", m.path, timeout=600)
    assert p.returncode == 0, p.stderr
    got = load_file(str(src))
    assert len(got) == n and all(not v.any() and v.shape == (2,) for v in got.values())


def test_prefetch_skips_holes_and_its_client_can_be_killed(tmp_path, mount, run, stfs):
    src = tmp_path / "p.safetensors"
    big = np.random.default_rng(0).integers(0, 255, 256 << 20, dtype=np.uint8)
    save_file({"big": big, "x": np.zeros(4, np.uint8)}, str(src))
    m = mount(src)
    x = os.path.join(m.path, "x")
    subprocess.run(["truncate", "-s", "1T", x], check=True)
    started = time.monotonic()
    p = run("prefetch", x, timeout=120)
    assert p.returncode == 0 or "nothing was brought in" in p.stderr, p.stderr
    assert time.monotonic() - started < 60, "holes must not be read"
    # A client killed mid-prefetch is gone within a request's time slice.
    with open(src, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    client = subprocess.Popen([stfs, "prefetch", os.path.join(m.path, "big")])
    time.sleep(0.2)
    client.kill()
    client.wait(timeout=10)
    assert m.is_mounted() and open(os.path.join(m.path, "x"), "rb").read(4) == bytes(4)


def test_a_source_truncated_behind_the_mount(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    tensors = {"first": np.arange(1 << 16, dtype=np.float32), "last": np.ones(1 << 16, np.float32)}
    save_file(tensors, str(src))
    m = mount(src)
    # An edit staged before: it is kept whatever happens to the source.
    os.truncate(os.path.join(m.path, "first"), 4)
    with open(os.path.join(m.path, "first.meta.json"), "w") as f:
        f.write('{"dtype":"F32","shape":[1]}')
    os.truncate(src, os.path.getsize(src) // 2)  # another program cuts "last" off
    before = src.read_bytes()
    with pytest.raises(OSError) as e:
        open(os.path.join(m.path, "last"), "rb").read()
    assert e.value.errno == errno.EIO
    # A write needs the tensor's bytes copied to staging: EIO, nothing invented.
    with pytest.raises(OSError) as e:
        with open(os.path.join(m.path, "last"), "r+b") as f:
            f.write(b"\x00")
    assert e.value.errno == errno.EIO
    # A commit refuses (the source changed); forced, it cannot read "last": EIO.
    p = run("commit", m.path)
    assert p.returncode != 0 and "changed since it was mounted" in p.stderr
    p = run("commit", "--force", m.path)
    assert p.returncode != 0 and "Input/output error" in p.stderr, p.stderr
    assert src.read_bytes() == before
    p = run("prefetch", os.path.join(m.path, "last"))
    assert p.returncode != 0
    assert "the source was truncated behind the mount" in open(m.log).read()
    # The daemon is alive, the listing and the staged edit still there.
    assert open(os.path.join(m.path, "first"), "rb").read() == tensors["first"][:1].tobytes()
    assert sorted(os.listdir(m.path)) == ["__metadata__.json", "first", "first.meta.json", "last", "last.meta.json"]
    assert run("umount", "--discard", m.path).returncode == 0


def test_a_source_rewritten_or_replaced_behind_the_mount(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    tensors = {"a": np.arange(1024, dtype=np.int32), "b": np.ones(1024, np.int32)}
    save_file(tensors, str(src))
    m = mount(src)
    # Rewritten in place, same size: its bytes can no longer be trusted.
    with open(src, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    with pytest.raises(OSError) as e:
        open(os.path.join(m.path, "b"), "rb").read()
    assert e.value.errno == errno.EIO
    assert run("umount", m.path).returncode == 0
    m.close()
    # Replaced by rename: the mount keeps serving the file it validated.
    save_file(tensors, str(src))
    m = mount(src)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(b"\0\0\0\1")
    save_file({"other": np.zeros(1, np.int8)}, str(src))
    assert open(os.path.join(m.path, "b"), "rb").read() == tensors["b"].tobytes()
    p = run("commit", m.path)
    assert p.returncode != 0 and "changed since it was mounted" in p.stderr
    assert sorted(load_file(str(src))) == ["other"]
    assert run("umount", "--discard", m.path).returncode == 0


def test_a_user_without_a_home_still_mounts_and_is_told_where_the_log_went(tmp_path, stfs):
    """Logging is never the reason a mount fails (issue 20): no writable home,
    the log goes to $XDG_RUNTIME_DIR/stfs, else /var/tmp/stfs-<uid>, and
    `stfs mount` says so."""
    src = tmp_path / "m.safetensors"
    base(src)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, HOME="/proc/no-home", XDG_RUNTIME_DIR=str(runtime))
    env.pop("XDG_STATE_HOME", None)
    p = subprocess.run([stfs, "mount", str(src), str(mnt)], capture_output=True, text=True, env=env)
    try:
        assert p.returncode == 0, p.stderr
        log = runtime / "stfs" / "stfs.log"
        assert f"logging to {log}" in p.stderr, p.stderr
        assert (log.stat().st_mode & 0o777, log.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        assert "mounted" in log.read_text()
    finally:
        subprocess.run([stfs, "umount", str(mnt)], capture_output=True)
    # No runtime folder either: /var/tmp/stfs-<uid>, private.
    env.pop("XDG_RUNTIME_DIR")
    p = subprocess.run([stfs, "mount", str(src), str(mnt)], capture_output=True, text=True, env=env)
    try:
        assert p.returncode == 0, p.stderr
        assert f"logging to /var/tmp/stfs-{os.geteuid()}/stfs.log" in p.stderr, p.stderr
        assert os.stat(f"/var/tmp/stfs-{os.geteuid()}").st_mode & 0o777 == 0o700
    finally:
        subprocess.run([stfs, "umount", str(mnt)], capture_output=True)
