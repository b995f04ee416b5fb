"""Real mounts of files written by the official Python `safetensors`, driven
with real tools (ls, cat, dd, stat) and real syscalls."""

import errno
import hashlib
import json
import os
import signal
import struct
import subprocess
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import stfs_fixtures as fx

DIR_ENTRIES = {"__metadata__.json"}


def file_name(tensor):
    """The documented escaping (docs/SEMANTICS.md), for short names."""
    f = tensor.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")
    if f == "":
        return "%"
    if f in (".", ".."):
        return f.replace(".", "%2E")
    if f == "__metadata__.json":
        return "%5F_metadata__.json"
    if f.endswith(".meta.json"):
        f = f[: -len(".meta.json")] + "%2Emeta.json"
    return f


def sha(b):
    return hashlib.sha256(b).hexdigest()


def check_listing_bytes_and_metas(mnt, src, expected):
    """A mount of checkpoint `src` ({name: bytes} `expected`): its listing,
    every tensor's bytes through `cat`, every meta, and __metadata__.json."""
    n, header = fx.read_header(src)
    listing = set(subprocess.run(["ls", "-a", mnt], capture_output=True, text=True, check=True).stdout.split("\n")) - {""}
    want = {".", ".."} | DIR_ENTRIES
    for name in expected:
        want |= {file_name(name), file_name(name) + ".meta.json"}
    assert listing == want

    for name, data in expected.items():
        path = os.path.join(mnt, file_name(name))
        out = subprocess.run(["cat", path], capture_output=True, check=True).stdout
        assert sha(out) == sha(data), name
        assert os.stat(path).st_size == len(data)
        with open(path + ".meta.json") as f:
            meta = json.load(f)
        entry = header[name]
        assert meta["dtype"] == entry["dtype"] and meta["shape"] == entry["shape"]
        assert meta["data_offsets"] == entry["data_offsets"]
        assert meta["nbytes"] == len(data) and meta["name"] == name
        assert meta["file_offset"] == 8 + n + entry["data_offsets"][0]

    with open(os.path.join(mnt, "__metadata__.json")) as f:
        assert json.load(f) == header.get("__metadata__", {})


def test_mixed_checkpoint_bytes_meta_and_listing(tmp_path, mount):
    src = tmp_path / "mixed.safetensors"
    expected = fx.mixed_checkpoint(str(src))
    m = mount(src)
    check_listing_bytes_and_metas(m.path, src, expected)
    assert fx.read_header(src)[1]["__metadata__"] == {"format": "np", "note": "stfs test"}

    # ls -l sizes match the header.
    for line in subprocess.run(["ls", "-l", m.path], capture_output=True, text=True, check=True).stdout.splitlines()[1:]:
        parts = line.split(None, 8)
        fname, size = parts[8], int(parts[4])
        if fname.endswith(".meta.json") or fname in DIR_ENTRIES:
            assert size == len(open(os.path.join(m.path, fname), "rb").read())
        else:
            tensor = [t for t in expected if file_name(t) == fname][0]
            assert size == len(expected[tensor])


def test_stat_modes_owner_and_times(tmp_path, mount):
    src = tmp_path / "s.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, str(src))
    m = mount(src)
    st = os.stat(os.path.join(m.path, "w"))
    src_st = os.stat(src)
    # Files show the source's owner, group and mode; the directory gets x where it has r.
    mode = src_st.st_mode & 0o777
    assert (st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_size) == (mode, src_st.st_uid, src_st.st_gid, 64)
    assert os.stat(os.path.join(m.path, "w.meta.json")).st_mode & 0o777 == mode
    assert int(st.st_mtime) == int(src_st.st_mtime)
    assert os.stat(m.path).st_mode & 0o7777 == mode | ((mode & 0o444) >> 2)
    out = subprocess.run(["stat", "-c", "%s %F", os.path.join(m.path, "w")], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "64 regular file"
    vfs, back = os.statvfs(m.path), os.statvfs(tmp_path)
    assert (vfs.f_blocks, vfs.f_bsize, vfs.f_namemax) == (back.f_blocks, back.f_bsize, 255)

    ro = mount(src, "-o", "ro")
    assert os.stat(os.path.join(ro.path, "w")).st_mode & 0o777 == mode & ~0o222


def test_dd_skip_count_and_reads_at_any_offset(tmp_path, mount):
    src = tmp_path / "d.safetensors"
    a = np.arange(1 << 20, dtype=np.uint32)  # 4 MiB
    save_file({"a": a, "b": np.ones(3, np.int8)}, str(src))
    m = mount(src)
    path = os.path.join(m.path, "a")
    out = subprocess.run(["dd", f"if={path}", "bs=4096", "skip=3", "count=5", "status=none"], capture_output=True, check=True).stdout
    assert out == a.tobytes()[3 * 4096 : 8 * 4096]
    out = subprocess.run(["dd", f"if={path}", "bs=1M", "status=none"], capture_output=True, check=True).stdout
    assert out == a.tobytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, size in [(0, 1), (1, 7), (4095, 2), (12345, 70000), (len(a) * 4 - 3, 100), (len(a) * 4, 10), (1 << 40, 10)]:
            assert os.pread(fd, size, off) == a.tobytes()[off : off + size]
    finally:
        os.close(fd)


def test_np_memmap_and_concurrent_readers(tmp_path, mount):
    src = tmp_path / "c.safetensors"
    tensors = {f"t{i}": np.random.default_rng(i).standard_normal((256, 257)).astype(np.float32) for i in range(8)}
    save_file(tensors, str(src))
    m = mount(src)
    mm = np.memmap(os.path.join(m.path, "t3"), dtype=np.float32, mode="r", shape=(256, 257))
    assert np.array_equal(mm, tensors["t3"])
    del mm

    errors = []

    def reader(k):
        try:
            for _ in range(5):
                for name, arr in tensors.items():
                    with open(os.path.join(m.path, name), "rb") as f:
                        f.seek((k * 4096) % arr.nbytes)
                        rest = f.read()
                    assert rest == arr.tobytes()[(k * 4096) % arr.nbytes :]
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_scalar_zero_size_f6_and_empty(tmp_path, mount):
    src = tmp_path / "h.safetensors"
    fx.write_by_hand(src, [
        ("scalar", "F64", [], struct.pack("<d", 2.5)),
        ("zero", "BF16", [0, 3], b""),
        ("f6", "F6_E3M2", [8], bytes([1, 2, 3, 4, 5, 6])),
    ], metadata={"k": "v"})
    m = mount(src)
    assert open(os.path.join(m.path, "scalar"), "rb").read() == struct.pack("<d", 2.5)
    assert json.load(open(os.path.join(m.path, "scalar.meta.json")))["shape"] == []
    assert open(os.path.join(m.path, "zero"), "rb").read() == b""
    assert os.stat(os.path.join(m.path, "zero")).st_size == 0
    assert open(os.path.join(m.path, "f6"), "rb").read() == bytes([1, 2, 3, 4, 5, 6])

    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    e = mount(empty)
    assert sorted(os.listdir(e.path)) == ["__metadata__.json"]
    assert open(os.path.join(e.path, "__metadata__.json")).read() == "{}\n"


def test_escaped_and_long_names(tmp_path, mount):
    src = tmp_path / "names.safetensors"
    long_name = "layer." + "x" * 300
    names = ["", ".", "..", "a/b", "100%", "nul\0", "x.meta.json", "__metadata__.json", "~tilde", long_name]
    fx.write_by_hand(src, [(n, "U8", [1], bytes([i])) for i, n in enumerate(names)])
    m = mount(src)
    entries = os.listdir(m.path)
    assert len(entries) == 1 + 2 * len(names)
    for i, n in enumerate(names[:-1]):
        assert open(os.path.join(m.path, file_name(n)), "rb").read() == bytes([i]), n
        assert json.load(open(os.path.join(m.path, file_name(n) + ".meta.json")))["name"] == n
    hashed = [e for e in entries if e.startswith("layer.x") and not e.endswith(".meta.json")]
    assert len(hashed) == 1 and "~" in hashed[0] and len(hashed[0] + ".meta.json") <= 255
    assert json.load(open(os.path.join(m.path, hashed[0] + ".meta.json")))["name"] == long_name
    assert open(os.path.join(m.path, hashed[0]), "rb").read() == bytes([len(names) - 1])
    # Non-canonical spellings do not exist.
    for bad in ["a%2fb", "%2E%2E%2E", "100%"]:
        assert not os.path.exists(os.path.join(m.path, bad)), bad


def test_twenty_thousand_tensors(tmp_path, mount):
    src = tmp_path / "many.safetensors"
    tensors = {f"blk.{i}.w": np.full(2, i, np.int32) for i in range(20_000)}
    save_file(tensors, str(src))
    m = mount(src)
    out = subprocess.run(["ls", m.path], capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 40_001
    for i in (0, 9_999, 19_999):
        assert np.frombuffer(open(os.path.join(m.path, f"blk.{i}.w"), "rb").read(), np.int32).tolist() == [i, i]


def test_output_cut_short_by_its_reader_ends_quietly(tmp_path, mount, stfs):
    """`stfs status | head -1` and the like: when the reader goes, the
    command ends by SIGPIPE as shell tools do (it panicked, exit 101), and
    the daemon serves on."""
    src = tmp_path / "many.safetensors"
    save_file({f"blk.{i}.weight": np.zeros(1, np.int8) for i in range(5_000)}, str(src))
    m = mount(src)
    for i in range(5_000):  # a status report of about 200 KB
        os.unlink(os.path.join(m.path, f"blk.{i}.weight"))
    for args in (["inspect", src], ["inspect", "--json", src], ["status", m.path], ["status", "--json", m.path]):
        p = subprocess.run(["bash", "-c", 'set -o pipefail; "$@" | head -c 10 >/dev/null', "-", stfs, *map(str, args)],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 128 + signal.SIGPIPE and p.stderr == "", (args, p.returncode, p.stderr)
    assert "removed    blk.4999.weight" in subprocess.run([stfs, "status", m.path], capture_output=True, text=True).stdout


def test_sharded_folder_with_index(tmp_path, mount):
    folder = tmp_path / "model"
    a, b, index = fx.two_shards(folder)
    m = mount(folder)
    assert sorted(os.listdir(m.path)) == ["model-00001-of-00002", "model-00002-of-00002", "model.safetensors.index.json"]
    assert open(os.path.join(m.path, "model-00002-of-00002", "b"), "rb").read() == b.tobytes()
    assert open(os.path.join(m.path, "model-00001-of-00002", "a"), "rb").read() == a.tobytes()
    assert json.load(open(os.path.join(m.path, "model.safetensors.index.json"))) == index
    assert m.result.stderr == ""

    # A wrong index still mounts (the shards are valid) but is reported.
    index["weight_map"]["b"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    m2 = mount(folder)
    assert "weight_map says" in m2.result.stderr


def test_an_index_file_is_read_only_through_the_mount(tmp_path, mount):
    """A commit rewrites the index; writing it by hand is refused with EROFS
    ("Read-only file system", what a shell user expects), not EPERM, and the
    index is as it was."""
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": np.arange(4, dtype=np.float32)}, str(folder / "model-00001-of-00001.safetensors"))
    index = {"metadata": {"total_size": 16}, "weight_map": {"a": "model-00001-of-00001.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    m = mount(folder)
    shown = os.path.join(m.path, "model.safetensors.index.json")
    before = open(shown, "rb").read()
    # (Its mode shows no write bit: a user other than root is refused by the
    # kernel first, EACCES; root passes that check and stfs says EROFS.)
    writable_mode = os.stat(shown).st_mode & 0o222 != 0
    want = errno.EROFS if os.geteuid() == 0 or writable_mode else errno.EACCES
    for how in (lambda: open(shown, "r+b"), lambda: open(shown, "wb"), lambda: os.truncate(shown, 0)):
        with pytest.raises(OSError) as e:
            how()
        assert e.value.errno == want, e.value
    assert open(shown, "rb").read() == before


def test_a_commit_with_nothing_staged_rewrites_an_index_that_disagrees(tmp_path, mount, run):
    folder = tmp_path / "model"
    folder.mkdir()
    a, b = np.arange(6, dtype=np.float16), np.arange(10, dtype=np.int64)
    save_file({"a": a}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(folder / "model-00002-of-00002.safetensors"))
    wrong = {"metadata": {"total_size": 1, "format": "kept"},
             "weight_map": {"a": "model-00002-of-00002.safetensors", "gone": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(wrong))
    shards = {p.name: p.read_bytes() for p in folder.glob("*.safetensors")}
    m = mount(folder)
    assert "weight_map" in m.result.stderr
    status = run("status", m.path).stdout
    assert "model.safetensors.index.json: a commit rewrites it to match the shards" in status, status
    p = run("commit", m.path)
    assert p.returncode == 0 and "model.safetensors.index.json: rewritten" in p.stdout, p.stdout + p.stderr
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": a.nbytes + b.nbytes, "format": "kept"},
                     "weight_map": {"a": "model-00001-of-00002.safetensors",
                                    "b": "model-00002-of-00002.safetensors"}}
    assert {p.name: p.read_bytes() for p in folder.glob("*.safetensors")} == shards
    assert "a commit rewrites" not in run("status", m.path).stdout
    assert "nothing to commit" in run("commit", m.path).stdout
    m.close(check=True)
    assert "weight_map" not in mount(folder).result.stderr


def test_invalid_files_are_refused_and_nothing_is_mounted(tmp_path, mount):
    good = tmp_path / "good.safetensors"
    save_file({"w": np.zeros(4, np.float32)}, str(good))
    data = good.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    bad_header = b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}'
    cases = {
        "short": (data[:4], "shorter than the 8-byte"),
        "trailing": (data + b"\0", "file is"),
        "size": (struct.pack("<Q", len(bad_header)) + bad_header + data[8 + n:],
                 'tensor "w": data_offsets [0, 16] span 16 bytes but F32 [3] needs 12'),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        m = mount(path, expect_ok=False)
        assert m.result.returncode != 0
        assert str(path) in m.result.stderr and message in m.result.stderr, m.result.stderr
        assert not m.is_mounted()
    m = mount(tmp_path / "missing.safetensors", expect_ok=False)
    assert m.result.returncode != 0 and "No such file" in m.result.stderr


def test_foreground_mount_unmounts_on_sigterm(tmp_path, stfs):
    src = tmp_path / "f.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(src))
    mnt = tmp_path / "fg"
    mnt.mkdir()
    proc = subprocess.Popen([stfs, "mount", "-f", str(src), str(mnt)], stderr=subprocess.PIPE, text=True)
    try:
        import time
        deadline = time.monotonic() + 20
        while not os.path.exists(mnt / "w"):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "foreground mount never answered"
            time.sleep(0.05)
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        assert not os.path.exists(mnt / "w")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with open("/proc/self/mountinfo") as f:
            if any(line.split()[4] == str(mnt) for line in f):
                subprocess.run(["umount", "-l", str(mnt)])


def test_sparse_file_over_4gib_reads_above_2_pow_32(tmp_path, mount):
    src = tmp_path / "big.safetensors"
    big = (4 << 30) + (512 << 20)  # 4.5 GiB, sparse on disk
    header = {"big": {"dtype": "U8", "shape": [big], "data_offsets": [0, big]},
              "tail": {"dtype": "U8", "shape": [4096], "data_offsets": [big, big + 4096]}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    marks = {(1 << 32) - 2: b"ACROSS", (1 << 32) + 12345: b"above-4GiB", big - 5: b"END!!"}
    with open(src, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(start + big + 4096)
        for off, mark in marks.items():
            os.pwrite(f.fileno(), mark, start + off)
        os.pwrite(f.fileno(), b"tail-bytes", start + big)
    m = mount(src)
    path = os.path.join(m.path, "big")
    assert os.stat(path).st_size == big
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, mark in marks.items():
            assert os.pread(fd, len(mark), off) == mark, off
        assert os.pread(fd, 4, (1 << 32) + 100) == bytes(4)
    finally:
        os.close(fd)
    out = subprocess.run(["dd", f"if={path}", "bs=4096", f"skip={((1 << 32) + 12288) // 4096}", "count=1", "status=none"],
                         capture_output=True, check=True).stdout
    assert out[12345 - 12288:12345 - 12288 + 10] == b"above-4GiB"
    assert open(os.path.join(m.path, "tail"), "rb").read(10) == b"tail-bytes"
    assert json.load(open(path + ".meta.json"))["file_offset"] == start


def test_a_mount_that_is_hard_to_misuse(tmp_path, mount, run, stfs):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(2, np.float32)}, str(src))
    # Mount points that are missing, files, or not empty: refused, saying what to do.
    p = run("mount", src, tmp_path / "missing")
    assert p.returncode != 0 and "no such folder to mount on" in p.stderr and "mkdir -p" in p.stderr, p.stderr
    p = run("mount", src, src)
    assert p.returncode != 0 and "not a folder" in p.stderr, p.stderr
    full = tmp_path / "full"
    full.mkdir()
    (full / "precious").write_text("x")
    p = run("mount", src, full)
    assert p.returncode != 0 and "not empty" in p.stderr and "-o nonempty" in p.stderr, p.stderr
    # A relative mount point works, and the mount table shows absolute paths.
    rel = tmp_path / "rel"
    rel.mkdir()
    p = subprocess.run([stfs, "mount", "--log-file", str(tmp_path / "rel.log"), "m.safetensors", "rel"],
                       cwd=tmp_path, capture_output=True, text=True)
    try:
        assert p.returncode == 0, p.stderr
        [line] = [l for l in open("/proc/self/mountinfo") if l.split()[4] == str(rel)]
        assert line.split(" - ")[1].split()[:2] == ["fuse.stfs", str(src)], line
        if os.geteuid() == 0:  # only root may raise a mount's read-ahead
            assert "read-ahead of this mount raised" in (tmp_path / "rel.log").read_text()
        # Mounting again on a live mount: refused, no stacking.
        p = run("mount", src, rel)
        assert p.returncode != 0 and "already a mount point" in p.stderr, p.stderr
    finally:
        assert run("umount", rel).returncode == 0
    # -o nonempty mounts over a non-empty folder.
    m = mount(src, "-o", "nonempty")
    assert m.ok
    # stfs umount leaves other filesystems alone, and says what is wrong
    # (a tmpfs to try it on needs root).
    if os.geteuid() == 0:
        tmpfs = tmp_path / "tmpfs"
        tmpfs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(tmpfs)], check=True)
        try:
            p = run("umount", tmpfs)
            assert p.returncode != 0 and "not a stfs mount" in p.stderr, p.stderr
            assert any(l.split()[4] == str(tmpfs) for l in open("/proc/self/mountinfo"))
        finally:
            subprocess.run(["umount", str(tmpfs)], check=True)
    p = run("umount", tmp_path / "nowhere")
    assert p.returncode != 0 and "no such file or folder" in p.stderr, p.stderr
    p = run("umount", full)
    assert p.returncode != 0 and "not a mount point" in p.stderr, p.stderr
    # A file of another format gets a hint.
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04" + os.urandom(100))
    p = run("mount", other, tmp_path / "rel")
    assert p.returncode != 0 and "not a safetensors file?" in p.stderr, p.stderr
    # A dead mount is recognised by mount and by umount, and cleaned up.
    m = mount(src)
    os.kill(m.pid, 9)
    from stfs_fixtures import wait_for_exit
    wait_for_exit(m.pid, 20)
    m.pid = None
    p = run("mount", src, m.path)
    assert p.returncode != 0 and "daemon is gone" in p.stderr and "stfs umount" in p.stderr, p.stderr
    p = run("status", m.path)
    assert p.returncode != 0 and "daemon of this mount is gone" in p.stderr, p.stderr
    p = run("umount", m.path)
    assert p.returncode == 0 and "daemon was gone" in p.stdout, p.stdout + p.stderr
    assert not m.is_mounted()


def test_discard_with_the_mount_up_keeps_paths_working(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = {"a": np.arange(4, dtype=np.int32), "b": np.ones(3, np.uint8)}
    save_file(t, str(src))
    m = mount(src)
    a, b = os.path.join(m.path, "a"), os.path.join(m.path, "b")
    ino_a = os.stat(a).st_ino
    held = open(a, "rb")  # keeps the mount busy: --discard cannot unmount it
    with open(b, "r+b") as f:
        f.write(b"\x09")
    os.rename(a, os.path.join(m.path, "z"))
    p = run("umount", "--discard", m.path)
    assert p.returncode != 0 and "busy" in p.stderr, p.stderr
    assert f"the staged edits were dropped already; {m.path} stays mounted" in p.stderr, p.stderr
    # At once, no sleep: every path of the source works again, a's inode is kept.
    assert os.stat(a).st_ino == ino_a
    assert open(a, "rb").read() == t["a"].tobytes() and open(b, "rb").read() == t["b"].tobytes()
    assert not os.path.exists(os.path.join(m.path, "z"))
    # A commit that got done before the unmount found the mount busy says so.
    with open(b, "r+b") as f:
        f.write(b"\x07")
    p = run("umount", m.path)
    assert p.returncode != 0 and "busy" in p.stderr, p.stderr
    assert f"{src}: committed" in p.stderr and "the edits above are committed already" in p.stderr, p.stderr
    assert load_file(str(src))["b"][0] == 7
    held.close()
    assert run("umount", m.path).returncode == 0


def test_what_tools_try_on_every_file_is_not_logged_as_a_refusal(tmp_path, mount):
    """cp -a, rsync -X and tar --xattrs ask every file for its xattrs, lsattr
    sends an ioctl stfs does not know, and a shell globbing a folder may
    look up a name that is not UTF-8: each gets its errno, and the log keeps
    quiet about them (debug only), while a refusal a user should hear of
    (rmdir of a checkpoint's view folder) is logged at warn."""
    src = tmp_path / "s.safetensors"
    fx.base(src)
    m = mount(src)
    a = os.path.join(m.path, "a")
    with pytest.raises(OSError) as e:
        os.setxattr(a, "user.x", b"1")
    assert e.value.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
    with pytest.raises(OSError) as e:
        os.listxattr(a)
    assert e.value.errno in (errno.ENOTSUP, errno.EOPNOTSUPP)
    with pytest.raises(OSError):
        os.getxattr(a, "user.x")
    p = subprocess.run(["lsattr", a], capture_output=True, text=True)
    assert p.returncode != 0, p.stdout
    with pytest.raises(FileNotFoundError):
        os.stat(os.path.join(os.fsencode(m.path), b"\xff\xfe"))
    subprocess.run(["cp", "-a", a, str(tmp_path / "copy")], check=True)
    quiet = open(m.log).read()
    assert " WARN " not in quiet, quiet
    with pytest.raises(OSError):
        os.rmdir(os.path.join(m.path, "__views__"))
    assert " WARN " in open(m.log).read(), "a refusal that is not routine is logged"


def test_stfs_umount_returns_once_the_daemon_is_gone_and_its_staging_folder_too(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    fx.base(src)
    m = mount(src)
    with open(os.path.join(m.path, "a"), "r+b") as f:
        f.write(b"\0" * 4)  # an edit: a staging folder beside the source
    assert list(tmp_path.glob(".m.safetensors.stfs-*"))
    p = run("umount", "--discard", m.path)
    assert p.returncode == 0, p.stderr
    # At once, without waiting: the daemon has exited (a zombie at most,
    # until init reaps it) and its staging folder is gone.
    try:
        state = open(f"/proc/{m.pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state
    assert not list(tmp_path.glob(".m.safetensors.stfs-*")), list(tmp_path.iterdir())
