"""The kernel keeps names and attributes of a checkpoint's files (listings
give attributes, READDIRPLUS; lookups have a timeout), and every edit takes
them back before it is answered: the next `stat` of any process, right after
the edit, sees it. Each test first lists the folder with `ls -l` (which fills
the kernel's caches), then edits with a real tool, then asks other processes
(`stat`, `test -e`) and compares with what reading the files gives."""

import json
import os
import subprocess

import numpy as np
import pytest
from safetensors.numpy import save_file


def listed(path):
    """`ls -l` of `path`: fills the kernel's name and attribute caches."""
    out = subprocess.run(["ls", "-l", path], check=True, capture_output=True, text=True).stdout
    return out


def exists(path):
    """Asked by another process (a fresh path walk through the kernel's cache)."""
    return subprocess.run(["test", "-e", path]).returncode == 0


def stat_size(path):
    out = subprocess.run(["stat", "-c", "%s", path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


def shown_and_read_agree(path):
    """The size the kernel gives for `path` is the length of its content, both asked
    while the file is open. (After the close, a JSON file written through a descriptor
    may still show the writer's text until the daemon gets the close, which FUSE sends
    without waiting; then its text as stfs writes it. A stat after the close may see
    either: this asked it after, and failed now and then.)"""
    with open(path, "rb") as f:
        content = f.read()
        size = stat_size(path)
    assert size == len(content), (path, content)
    return content


@pytest.fixture
def ckpt(tmp_path, mount):
    """Six tensors of six shapes (so that each meta says whose it is)."""
    src = tmp_path / "m.safetensors"
    save_file({f"layer.{i}": np.arange(8 * (i + 1), dtype=np.float32) for i in range(6)}, str(src),
              metadata={"format": "pt"})
    # An old source: a file edited now has another time than the listing gave.
    os.utime(src, (946684800, 946684800))
    m = mount(src)
    listed(m.path)
    return m


def shape_of(path):
    return json.loads(shown_and_read_agree(path))["shape"]


def test_a_rename_moves_the_meta_for_every_process(ckpt, run):
    p = ckpt.path
    assert shape_of(f"{p}/layer.1.meta.json") == [16]
    subprocess.run(["mv", f"{p}/layer.0", f"{p}/renamed"], check=True)
    assert not exists(f"{p}/layer.0")
    assert shape_of(f"{p}/renamed.meta.json") == [8]
    # The old meta answers at its old name, unlisted, until the next commit.
    assert "layer.0.meta.json" not in listed(p)
    # Renamed over an existing tensor: the meta at that name is another file
    # now (the moved one's), not the one the kernel listed.
    subprocess.run(["mv", f"{p}/renamed", f"{p}/layer.1"], check=True)
    assert not exists(f"{p}/renamed")
    assert shape_of(f"{p}/layer.1.meta.json") == [8]
    assert exists(f"{p}/layer.0.meta.json")
    assert run("commit", p).returncode == 0
    # The commit dropped the metas left behind.
    assert not exists(f"{p}/layer.0.meta.json")
    assert not exists(f"{p}/renamed.meta.json")
    assert shape_of(f"{p}/layer.1.meta.json") == [8]


def test_a_removed_tensor_s_meta_goes_with_the_commit(ckpt, run):
    p = ckpt.path
    assert b"data_offsets" in shown_and_read_agree(f"{p}/layer.2.meta.json")
    listed(p)  # (its attributes kept again: the read above asked the daemon)
    subprocess.run(["rm", f"{p}/layer.2"], check=True)
    assert not exists(f"{p}/layer.2")
    # Its meta stays, without the offsets of bytes that are gone.
    assert b"data_offsets" not in shown_and_read_agree(f"{p}/layer.2.meta.json")
    assert "layer.2.meta.json" in listed(p)  # a meta without data, until the commit
    assert run("commit", p).returncode == 0
    assert not exists(f"{p}/layer.2.meta.json")


def test_a_tensor_made_by_copy_shows_its_meta_for_every_process(ckpt):
    p = ckpt.path
    assert not exists(f"{p}/new.meta.json")
    subprocess.run(["cp", f"{p}/layer.3.meta.json", f"{p}/new.meta.json"], check=True)
    subprocess.run(["cp", f"{p}/layer.3", f"{p}/new"], check=True)
    assert shape_of(f"{p}/new.meta.json") == [32]
    listed(p)
    # A meta copied over another name's: that name shows the new one.
    subprocess.run(["cp", f"{p}/layer.4.meta.json", f"{p}/new.meta.json"], check=True)
    assert shape_of(f"{p}/new.meta.json") == [40]


def mtime(path):
    out = subprocess.run(["stat", "-c", "%Y", path], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_writes_and_the_sizes_and_times_shown_agree(ckpt):
    p = ckpt.path
    assert mtime(f"{p}/layer.3.meta.json") == 946684800
    subprocess.run(["dd", "if=/dev/zero", f"of={p}/layer.3", "bs=4", "count=1", "conv=notrunc",
                    "status=none"], check=True)
    shown_and_read_agree(f"{p}/layer.3.meta.json")
    # A meta's time is its data's.
    assert mtime(f"{p}/layer.3.meta.json") == mtime(f"{p}/layer.3") > 946684800
    listed(p)
    with open(f"{p}/layer.3", "ab") as f:
        f.write(b"\0" * 256)
    assert stat_size(f"{p}/layer.3") == 128 + 256
    shown_and_read_agree(f"{p}/layer.3")
    shown_and_read_agree(f"{p}/layer.3.meta.json")
    listed(p)
    subprocess.run(["truncate", "-s", "128", f"{p}/layer.3"], check=True)
    assert stat_size(f"{p}/layer.3") == 128


def test_a_meta_written_for_an_empty_file_sizes_it_for_every_process(ckpt):
    p = ckpt.path
    subprocess.run(["touch", f"{p}/w"], check=True)
    listed(p)
    assert stat_size(f"{p}/w") == 0
    with open(f"{p}/w.meta.json", "w") as f:
        f.write('{"dtype":"F32","shape":[4]}')
    assert stat_size(f"{p}/w") == 16
    shown_and_read_agree(f"{p}/w")


def test_a_meta_written_with_an_editor_shows_its_new_text(ckpt):
    p = ckpt.path
    subprocess.run(["sed", "-i", 's/"shape":\\[40\\]/"shape":[5,8]/', f"{p}/layer.4.meta.json"],
                   check=True)
    assert shape_of(f"{p}/layer.4.meta.json") == [5, 8]
    # __metadata__.json is shown as parsed and written again.
    with open(f"{p}/__metadata__.json", "w") as f:
        f.write('{ "format":   "pt",   "a": "b" }')
    assert json.loads(shown_and_read_agree(f"{p}/__metadata__.json")) == {"a": "b", "format": "pt"}


def test_a_commit_changes_every_meta_it_moves(ckpt, run):
    p = ckpt.path
    offsets = {n: json.loads(shown_and_read_agree(f"{p}/layer.{n}.meta.json"))["file_offset"]
               for n in range(6)}
    # A longer metadata value grows the header: every tensor's file offset moves.
    with open(f"{p}/__metadata__.json", "w") as f:
        json.dump({"format": "pt", "note": "x" * 5000}, f)
    subprocess.run(["rm", f"{p}/layer.5"], check=True)
    listed(p)
    assert run("commit", p).returncode == 0
    for n in range(5):
        meta = json.loads(shown_and_read_agree(f"{p}/layer.{n}.meta.json"))
        assert meta["file_offset"] > offsets[n]
    assert not exists(f"{p}/layer.5.meta.json")


@pytest.mark.parametrize("cache", ["direct", "keep"])
def test_a_held_data_file_sees_the_size_its_meta_gives(tmp_path, mount, cache):
    src = tmp_path / "m.safetensors"
    save_file({"a": np.zeros(4, np.float32)}, str(src))
    m = mount(src, "-o", f"cache={cache}")
    p = m.path
    subprocess.run(["touch", f"{p}/w"], check=True)
    listed(p)
    fd = os.open(f"{p}/w", os.O_RDONLY)
    try:
        with open(f"{p}/w.meta.json", "w") as f:
            f.write('{"dtype":"F32","shape":[5]}')
        assert os.fstat(fd).st_size == 20
        assert os.pread(fd, 100, 0) == b"\0" * 20
    finally:
        os.close(fd)


def test_a_held_meta_replaced_by_a_rename_shows_no_link(ckpt):
    p = ckpt.path
    fd = os.open(f"{p}/layer.0.meta.json", os.O_RDONLY)
    try:
        assert os.fstat(fd).st_nlink == 1
        subprocess.run(["mv", f"{p}/layer.5", f"{p}/layer.0"], check=True)
        # Another file is at that name now; the descriptor's is gone.
        assert os.fstat(fd).st_nlink == 0
        assert shape_of(f"{p}/layer.0.meta.json") == [48]
    finally:
        os.close(fd)


def test_data_created_under_a_meta_gives_it_its_time(ckpt):
    p = ckpt.path
    subprocess.run(["rm", f"{p}/layer.2"], check=True)
    listed(p)
    assert mtime(f"{p}/layer.2.meta.json") == 946684800
    subprocess.run(["touch", f"{p}/layer.2"], check=True)
    assert mtime(f"{p}/layer.2.meta.json") == mtime(f"{p}/layer.2") > 946684800


def test_a_held_file_sees_the_time_a_commit_gives_it(ckpt, run):
    p = ckpt.path
    fd = os.open(f"{p}/layer.1", os.O_RDONLY)
    try:
        listed(p)
        assert int(os.fstat(fd).st_mtime) == 946684800
        with open(f"{p}/__metadata__.json", "w") as f:
            json.dump({"format": "pt", "a": "b"}, f)
        assert run("commit", p).returncode == 0
        # The source was written now: so is every tensor file's time.
        assert int(os.fstat(fd).st_mtime) == mtime(f"{p}/layer.1") > 946684800
    finally:
        os.close(fd)
