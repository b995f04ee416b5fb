"""Checkpoint surgery from the shell: staged edits through a real mount, then a
commit, judged by loading the result with the official package and by byte
equality with its save_file of the expected tensors."""

import errno
import json
import os
import signal
import subprocess

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from conftest import assert_every_write_is_erofs
from stfs_fixtures import assert_checkpoint, base, sh, wait_for_exit


def commit(run, path, *flags):
    return run("commit", *flags, path)


def test_overwrite_pwrite_truncate_extend(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    m = mount(src)
    a = os.path.join(m.path, "a")
    fd = os.open(a, os.O_WRONLY)
    os.pwrite(fd, np.array([100, 200], np.float32).tobytes(), 8)
    os.close(fd)
    t["a"][2:4] = [100, 200]
    assert open(a, "rb").read() == t["a"].tobytes()  # staged bytes are visible before commit

    # Extend c to 8 bytes and cut b to one row, then describe both.
    subprocess.run(["truncate", "-s", "8", os.path.join(m.path, "c")], check=True)
    os.truncate(os.path.join(m.path, "b"), 24)
    with open(os.path.join(m.path, "b.meta.json"), "w") as f:
        f.write('{"dtype":"I64","shape":[1,3]}')
    with open(os.path.join(m.path, "c.meta.json"), "w") as f:
        json.dump({"dtype": "U8", "shape": [8]}, f)
    t["b"] = t["b"][:1]
    t["c"] = np.concatenate([t["c"], np.zeros(3, np.uint8)])
    p = commit(run, m.path)
    assert p.returncode == 0, p.stderr
    assert_checkpoint(src, t)
    # The mount shows the committed file, with the new offsets.
    n = int.from_bytes(open(src, "rb").read(8), "little")
    header = json.loads(open(src, "rb").read()[8:8 + n])
    assert json.load(open(os.path.join(m.path, "c.meta.json")))["data_offsets"] == header["c"]["data_offsets"]


def test_create_rm_mv_reshape_retype_metadata(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src, metadata={"format": "np"})
    m = mount(src)
    p = lambda *n: os.path.join(m.path, *n)
    # bytes first, then meta
    new = np.arange(12, dtype=np.int16).reshape(3, 4)
    with open(p("new"), "wb") as f:
        f.write(new.tobytes())
    with open(p("new.meta.json"), "w") as f:
        f.write('{"dtype":"I16","shape":[3,4]}\n')
    # meta first, then bytes
    with open(p("w2.meta.json"), "w") as f:
        f.write('{"dtype":"F64","shape":[2]}')
    with open(p("w2"), "wb") as f:
        f.write(np.array([1.5, -2.5]).tobytes())
    # meta alone: no data file (a copy of the meta first must not make the
    # data's O_EXCL create fail); a commit drops it
    with open(p("lone.meta.json"), "w") as f:
        f.write('{"dtype":"BOOL","shape":[2,2]}')
    assert not os.path.exists(p("lone"))
    # an empty file, then its meta: zero-filled to the meta's size
    os.close(os.open(p("zeros"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    with open(p("zeros.meta.json"), "w") as f:
        f.write('{"dtype":"BOOL","shape":[2,2]}')
    assert open(p("zeros"), "rb").read() == bytes(4)
    os.unlink(p("c"))
    os.rename(p("a"), p("b"))  # replaces b
    subprocess.run(["mv", p("new"), p("renamed")], check=True)
    # reshape and retype b (was a: 8 x F32) to 2 x 4 I32, same bytes
    with open(p("b.meta.json"), "w") as f:
        f.write('{"dtype":"I32","shape":[2,4],"data_offsets":[9,9],"name":"ignored"}')
    with open(p("__metadata__.json"), "w") as f:
        f.write('{"format":"pt"}')
    assert sorted(x for x in os.listdir(m.path) if not x.endswith(".meta.json")) == \
        ["__metadata__.json", "b", "renamed", "w2", "zeros"]
    assert commit(run, m.path).returncode == 0
    expected = {
        "b": t["a"].view(np.int32).reshape(2, 4),
        "renamed": new,
        "w2": np.array([1.5, -2.5]),
        "zeros": np.zeros((2, 2), np.bool_),
    }
    assert_checkpoint(src, expected, metadata={"format": "pt"})


def test_status_shows_a_long_metadata_value_cut_with_its_length(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    base(src)
    m = mount(src)
    template = "{% for m in messages %}" + "x" * 20000 + "{% endfor %}"
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump({"chat_template": template, "format": "pt"}, f)
    line = [l for l in run("status", m.path).stdout.splitlines() if l.strip().startswith("metadata")][0]
    assert len(line) < 200, line
    assert f'"chat_template": "{{% for m in messages %}}xx' in line and f"... ({len(template)} bytes)" in line, line
    assert '"format": "pt"' in line, line


def test_cp_between_checkpoints_and_mounts(tmp_path, mount, run):
    folder = tmp_path / "f"
    folder.mkdir()
    t1 = base(folder / "one.safetensors")
    save_file({"z": np.zeros(2, np.float16)}, str(folder / "two.safetensors"))
    other = tmp_path / "other.safetensors"
    save_file({"q": np.ones(3, np.float64)}, str(other))
    m = mount(folder)
    m2 = mount(other)
    one, two = os.path.join(m.path, "one"), os.path.join(m.path, "two")
    subprocess.run(["cp", os.path.join(one, "a"), os.path.join(one, "a.meta.json"), two + "/"], check=True)
    subprocess.run(["cp", os.path.join(one, "b"), os.path.join(one, "b.meta.json"), m2.path + "/"], check=True)
    # mv between two checkpoints of one mount: a copy, then an unlink.
    subprocess.run(["mv", os.path.join(one, "c"), two + "/c"], check=True)
    subprocess.run(["cp", os.path.join(one, "c.meta.json"), two + "/c.meta.json"], check=False)
    with open(os.path.join(two, "c.meta.json"), "w") as f:
        f.write('{"dtype":"U8","shape":[5]}')
    assert run("commit", m.path).returncode == 0
    assert run("commit", m2.path).returncode == 0
    assert_checkpoint(folder / "two.safetensors", {"z": np.zeros(2, np.float16), "a": t1["a"], "c": t1["c"]})
    assert_checkpoint(folder / "one.safetensors", {"a": t1["a"], "b": t1["b"]})
    assert_checkpoint(other, {"q": np.ones(3, np.float64), "b": t1["b"]})


def test_invalid_edit_is_refused_and_kept(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    before = src.read_bytes()
    m = mount(src)
    with open(os.path.join(m.path, "a"), "ab") as f:
        f.write(b"\0" * 4)  # 36 bytes, meta still says F32 [8]
    p = run("commit", m.path)
    assert p.returncode != 0
    assert 'tensor "a" holds 36 bytes but F32 [8] needs 32' in p.stderr, p.stderr
    assert src.read_bytes() == before
    assert os.stat(os.path.join(m.path, "a")).st_size == 36  # still staged
    # fsync makes edits durable; it does not commit.
    fd = os.open(os.path.join(m.path, "a"), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert src.read_bytes() == before
    # A meta that does not parse is kept as written (close says EINVAL), and named by status.
    bad = '{"dtype":"F99","shape":[1]}'
    with pytest.raises(OSError) as e:
        with open(os.path.join(m.path, "b.meta.json"), "w") as f:
            f.write(bad)
    assert e.value.errno == errno.EINVAL
    assert open(os.path.join(m.path, "b.meta.json")).read() == bad
    p = run("status", m.path)
    assert p.returncode == 1 and 'tensor "b" has an invalid .meta.json: unknown dtype "F99"' in p.stdout, p.stdout
    # A file name that is not a valid escape cannot be created.
    with pytest.raises(OSError) as e:
        open(os.path.join(m.path, "bad%zz"), "wb")
    assert e.value.errno == errno.EINVAL
    # stfs umount refuses to drop the edits on a failed commit.
    p = run("umount", m.path)
    assert p.returncode != 0 and "still mounted" in p.stderr
    # Fix both: the new length of a, b's meta back; the commit goes through.
    with open(os.path.join(m.path, "a.meta.json"), "w") as f:
        f.write('{"dtype":"F32","shape":[9]}')
    with open(os.path.join(m.path, "b.meta.json"), "w") as f:
        f.write('{"dtype":"I64","shape":[2,3]}')
    assert run("status", m.path).returncode == 0
    assert run("commit", m.path).returncode == 0
    t["a"] = np.concatenate([t["a"], np.zeros(1, np.float32)])
    assert_checkpoint(src, t)


def staging_folders(folder, name="m.safetensors"):
    return sorted(folder.glob(f".{name}.stfs-*"))


def test_fsync_is_durable_and_commits_happen_on_commit_and_unmount(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    before = src.read_bytes()
    m = mount(src)
    fd = os.open(os.path.join(m.path, "c"), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x07", 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert src.read_bytes() == before, "fsync must not commit"
    assert run("commit", m.path).returncode == 0
    t["c"][0] = 7
    assert_checkpoint(src, t)

    os.unlink(os.path.join(m.path, "c"))
    subprocess.run(["umount", m.path], check=True)  # plain umount commits
    m.close()
    del t["c"]
    assert_checkpoint(src, t)
    assert staging_folders(tmp_path) == [], "a clean unmount leaves no staging folder"

    m = mount(src)
    os.unlink(os.path.join(m.path, "a"))
    before = src.read_bytes()
    p = run("umount", "--discard", m.path)
    assert p.returncode == 0, p.stderr
    m.close()
    assert src.read_bytes() == before
    assert staging_folders(tmp_path) == []


def test_open_fds_and_inodes_survive_a_commit(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = base(src)
    m = mount(src)
    ino_b = os.stat(os.path.join(m.path, "b")).st_ino
    old_a = open(os.path.join(m.path, "a"), "rb")
    old_c = open(os.path.join(m.path, "c"), "rb")
    os.unlink(os.path.join(m.path, "c"))
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(b"\xff" * 4)
    assert run("commit", m.path).returncode == 0
    assert old_c.read() == t["c"].tobytes()  # removed and committed, still readable
    assert os.stat(os.path.join(m.path, "b")).st_ino == ino_b
    assert open(os.path.join(m.path, "a"), "rb").read()[:4] == b"\xff" * 4
    old_a.close()
    old_c.close()


def test_conflict_with_a_source_changed_behind_the_mount(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    base(src)
    m = mount(src)
    os.unlink(os.path.join(m.path, "c"))
    replacement = {"x": np.ones(2, np.float32)}
    save_file(replacement, str(src))  # another program replaces the source
    # stfs status says what the commit will say, and exits 1 as for any refusal.
    st = run("status", m.path)
    assert st.returncode == 1 and "1 problem (a commit would refuse)" in st.stdout, st.stdout
    assert "problem    " + str(src) + ": the source changed since it was mounted" in st.stdout, st.stdout
    p = run("commit", m.path)
    assert p.returncode != 0 and "changed since it was mounted" in p.stderr
    assert_checkpoint(src, replacement)
    assert run("commit", "--force", m.path).returncode == 0
    got = load_file(str(src))
    assert sorted(got) == ["a", "b"]


def test_read_only_mount_refuses_every_write(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    base(src)
    before = src.read_bytes()
    m = mount(src, "-o", "ro")
    assert_every_write_is_erofs(m.path, "n", "__metadata__.json")
    assert src.read_bytes() == before


def test_refused_operations(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    base(src)
    m = mount(src)
    a = os.path.join(m.path, "a")
    for op, err in [(lambda: os.mkdir(os.path.join(m.path, "d")), errno.EOPNOTSUPP),
                    (lambda: os.symlink("a", os.path.join(m.path, "s")), errno.EOPNOTSUPP),
                    (lambda: os.link(a, os.path.join(m.path, "h")), errno.EPERM),
                    (lambda: os.mknod(os.path.join(m.path, "p")), errno.EOPNOTSUPP),
                    (lambda: os.setxattr(a, "user.x", b"1"), errno.EOPNOTSUPP),
                    (lambda: os.rename(a, os.path.join(m.path, "bad%zz")), errno.EINVAL)]:
        with pytest.raises(OSError) as e:
            op()
        assert e.value.errno == err, (e.value, err)


def test_the_changes_taken_back_are_counted_as_status_lists_them(tmp_path, mount, run):
    """A tensor moved between shards is two journal records (one per shard)
    and one change per shard in `stfs status`; the note at the next mount
    counts what status lists."""
    folder = tmp_path / "f"
    folder.mkdir()
    base(folder / "s0.safetensors")
    save_file({"z": np.zeros(3, np.float32)}, str(folder / "s1.safetensors"))
    m = mount(folder)
    sh(f"mv {m.path}/s0/a {m.path}/s1/ && mv {m.path}/s0/b {m.path}/s0/b2")
    os.kill(m.pid, signal.SIGKILL)
    wait_for_exit(m.pid, 20)
    m.close()
    m2 = mount(folder)
    listed = [line for line in run("status", m2.path).stdout.splitlines() if line.startswith("  ")
              and not line.startswith("  commit") and not line.startswith("  problem")]
    assert f"took back {len(listed)} staged changes" in m2.result.stderr, (listed, m2.result.stderr)


def test_failed_commit_at_unmount_keeps_the_edits_for_the_next_mount(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    base(src)
    before = src.read_bytes()
    m = mount(src)
    with open(os.path.join(m.path, "a"), "ab") as f:
        f.write(b"\x01\x02")  # no longer F32 [8]: the commit at unmount must fail
    subprocess.run(["umount", m.path], check=True)
    m.close()
    assert src.read_bytes() == before
    [kept] = staging_folders(tmp_path)
    assert (kept.stat().st_mode & 0o777) == 0o700
    log = open(m.log).read()
    assert "commit at unmount failed" in log and str(kept) in log

    # The next mount takes the edits back and says so.
    m2 = mount(src)
    assert "took back 1 staged change" in m2.result.stderr, m2.result.stderr
    assert os.path.getsize(os.path.join(m2.path, "a")) == 34
    p = run("status", m2.path)
    assert p.returncode == 1 and "holds 34 bytes" in p.stdout
    with open(os.path.join(m2.path, "a"), "r+b") as f:
        f.truncate(32)
    p = run("commit", m2.path)
    assert p.returncode == 0, p.stderr
    assert_checkpoint(src, base(tmp_path / "expected.safetensors"))
    assert run("umount", m2.path).returncode == 0
    m2.close()
    assert staging_folders(tmp_path) == []


def test_kept_edits_of_another_version_are_not_taken_back(tmp_path, mount):
    src = tmp_path / "m.safetensors"
    base(src)
    m = mount(src)
    with open(os.path.join(m.path, "a"), "ab") as f:
        f.write(b"\x01")
    subprocess.run(["umount", m.path], check=True)
    m.close()
    [kept] = staging_folders(tmp_path)
    other = {"other": np.ones(1, np.float32)}
    save_file(other, str(src))  # the source changed since
    m2 = mount(src)
    assert "made on another version" in m2.result.stderr, m2.result.stderr
    assert sorted(os.listdir(m2.path)) == ["__metadata__.json", "other", "other.meta.json"]
    assert kept.exists(), "edits that do not apply are left on disk"
    m3 = mount(src, "--resume", str(kept), expect_ok=False)
    assert not m3.ok and "another version" in m3.result.stderr


def test_no_resume_leaves_kept_edits_and_removes_a_spent_staging_folder(tmp_path, mount, run):
    """--no-resume leaves the edits of a daemon that died where they are (the
    next plain mount takes them back), but a staging folder whose edits are
    all in the source (a commit killed and completed by this mount) goes."""
    src = tmp_path / "m.safetensors"
    t = base(src)
    before = src.read_bytes()
    m = mount(src)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(b"\x07" * 4)
    os.kill(m.pid, signal.SIGKILL)
    wait_for_exit(m.pid, 20)
    m.pid = None
    m.close()
    [kept] = staging_folders(tmp_path)
    m2 = mount(src, "--no-resume")
    said = m2.result.stdout + m2.result.stderr
    assert f"{kept}: edits of an earlier mount, left as they are (--no-resume)" in said, said
    assert open(os.path.join(m2.path, "a"), "rb").read() == t["a"].tobytes()
    m2.close()
    assert kept.exists() and src.read_bytes() == before
    m3 = mount(src)
    assert "took back 1 staged change" in m3.result.stderr, m3.result.stderr
    assert open(os.path.join(m3.path, "a"), "rb").read()[:4] == b"\x07" * 4
    m3.close(discard=True)
    # A commit killed half-way, then a --no-resume mount: it completes the
    # commit, and the folder holds nothing more.
    m4 = mount(src, env={"STFS_CRASH_AT": "in-place:data"})
    with open(os.path.join(m4.path, "a"), "r+b") as f:
        f.write(b"\x09" * 4)
    assert run("commit", m4.path).returncode != 0
    m4.pid = None
    m4.close()
    [spent] = staging_folders(tmp_path)
    m5 = mount(src, "--no-resume")
    said = m5.result.stdout + m5.result.stderr
    assert "completed a commit that was interrupted" in said, said
    assert f"{spent}: the staging folder of an earlier mount, all of whose edits are in the source now" in said, said
    assert not spent.exists()
    assert open(os.path.join(m5.path, "a"), "rb").read()[:4] == b"\x09" * 4
    m5.close()
    assert staging_folders(tmp_path) == []


def test_shards_of_a_folder_mount_share_a_staging_dir(tmp_path, mount, run):
    folder = tmp_path / "f"
    folder.mkdir()
    save_file({"w": np.zeros(4, np.uint8)}, str(folder / "s1.safetensors"))
    save_file({"w": np.zeros(4, np.uint8)}, str(folder / "s2.safetensors"))
    staging = tmp_path / "staging"
    staging.mkdir()
    m = mount(folder, "--staging-dir", str(staging))
    for shard, value in (("s1", 1), ("s2", 2)):
        with open(os.path.join(m.path, shard, "w"), "r+b") as f:
            f.write(bytes([value] * 4))
    assert open(os.path.join(m.path, "s1", "w"), "rb").read() == b"\x01" * 4
    assert run("commit", m.path).returncode == 0  # the root commits every shard
    assert_checkpoint(folder / "s1.safetensors", {"w": np.full(4, 1, np.uint8)})
    assert_checkpoint(folder / "s2.safetensors", {"w": np.full(4, 2, np.uint8)})
    assert not any(p.name.startswith(".") for p in folder.iterdir()), "staging went beside the sources"
    assert run("umount", m.path).returncode == 0
    m.close()
    assert list(staging.iterdir()) == [], "a clean unmount leaves no staging folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes any folder: runs in the unprivileged pass")
def test_a_folder_the_user_cannot_write_is_said_at_mount_and_status_not_at_commit(tmp_path, mount, run):
    """Edits of a file in a folder its user cannot write are staged in the
    user's own state folder, said at mount; an edit that commits in place
    commits, one that needs a new file beside the source is refused by
    `stfs status` before a commit tries it; the same with --staging-dir."""
    folder, staging = tmp_path / "ro", tmp_path / "staging"
    folder.mkdir()
    staging.mkdir(mode=0o700)
    src = folder / "m.safetensors"
    base(src)
    os.chmod(folder, 0o555)
    try:
        for extra in ((), ("--staging-dir", str(staging))):
            m = mount(src, *extra)
            if not extra:
                err = m.result.stderr
                assert f"{folder}: that folder is not writable by you" in err and "edits are staged in" in err, err
            # (A hole, and a tensor added, which the end cannot fill around.)
            os.unlink(os.path.join(m.path, "a"))
            with open(os.path.join(m.path, "d"), "wb") as f:
                f.write(b"1234")
            with open(os.path.join(m.path, "d.meta.json"), "w") as f:
                f.write('{"dtype": "U8", "shape": [4]}')
            st = run("status", m.path)
            assert st.returncode == 1 and f"a rewrite puts a new file in {folder}, which this mount's user cannot" \
                in st.stdout, st.stdout
            before = src.read_bytes()
            p = run("commit", m.path)
            assert p.returncode != 0 and src.read_bytes() == before, p.stdout + p.stderr
            assert run("umount", "--discard", m.path).returncode == 0
            m = mount(src, *extra)
            with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
                f.write('{"x": "y"}')
            assert run("status", m.path).returncode == 0
            p = run("commit", m.path)
            assert p.returncode == 0 and "committed in place" in p.stdout, p.stdout + p.stderr
            assert safe_open(str(src), "np").metadata() == {"x": "y"}
            with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
                f.write('{}')
            assert run("commit", m.path).returncode == 0
            assert run("umount", m.path).returncode == 0
            m.close()
        assert not any(p.name.startswith(".") for p in folder.iterdir()), "nothing is left beside the source"
    finally:
        os.chmod(folder, 0o755)
