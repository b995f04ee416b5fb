"""Commits that cost what the edit costs (docs/SEMANTICS.md, "The ways"): each edit kind is
committed in place (same inode, a few bytes written by the daemon), the
official package reads the result, and every reason to rewrite instead is
said. Crash trials kill the daemon at every step of the in-place protocol
(STFS_CRASH_AT) and check that the file is old, new, or refused by every
reader until the next mount completes it."""

import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import stfs_fixtures as fx
from stfs_fixtures import assert_checkpoint, header_of, resident, sh, written_by

MIB = 1 << 20


def tensors():
    rng = np.random.default_rng(5)
    return {
        "embed": rng.standard_normal((256, 64)).astype(np.float32),
        "layer.0": rng.standard_normal((128, 128)).astype(np.float32),
        "layer.1": rng.integers(0, 100, (64, 64), dtype=np.int64),
        "z_tail": rng.integers(0, 255, 4096, dtype=np.uint8),
    }


def with_room(path, mount, run, t, metadata):
    """A checkpoint as a first stfs commit leaves it: a save_file file, whose header has no
    room, grown in place by whole blocks inserted at its start (ext4, XFS)."""
    save_file(t, str(path))
    _, before, _ = header_of(path)
    ino = os.stat(path).st_ino
    m = mount(path)
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump(metadata, f)
    p = run("commit", m.path)
    grown = re.search(r"committed in place \(header grown by (\d+) KiB at the start;", p.stdout)
    assert grown, p.stdout
    # Room for the next edits: at least 64 KiB more.
    assert (64 << 10) <= int(grown[1]) << 10 < (64 << 10) + 8192, p.stdout
    m.close()
    _, n, _ = header_of(path)
    assert n == before + (int(grown[1]) << 10) and os.stat(path).st_ino == ino
    assert_checkpoint(path, t, metadata)


def mounted_as_saved(tmp_path, mount):
    """tensors() in tmp_path/m.safetensors as save_file writes it (no room in its
    header), mounted: (source, tensors, mount)."""
    src = tmp_path / "m.safetensors"
    t = tensors()
    save_file(t, str(src))
    return src, t, mount(src)


def mounted_with_room(tmp_path, mount, run):
    """tensors() in tmp_path/m.safetensors with room in its header (`with_room`,
    metadata {"format": "pt"}), mounted: (source, tensors, mount)."""
    src = tmp_path / "m.safetensors"
    t = tensors()
    with_room(src, mount, run, t, {"format": "pt"})
    return src, t, mount(src)


def test_the_page_cache_of_the_source_is_brought_back_after_the_header_grows(tmp_path, mount, run):
    """Blocks inserted at the start empty the file's page cache (the kernel drops it past the
    insertion): what was resident is read back in the background after the commit."""
    src = tmp_path / "m.safetensors"
    rng = np.random.default_rng(3)
    t = {f"w{i}": rng.standard_normal(1 << 20).astype(np.float32) for i in range(8)}  # 32 MiB
    save_file(t, str(src))
    with open(src, "rb") as f:
        while f.read(1 << 24):
            pass
    before = resident(src)
    assert before > 0.95 * os.path.getsize(src)
    m = mount(src)
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump({"chat_template": "x" * 5000}, f)
    p = run("commit", m.path)
    assert "committed in place (header grown by" in p.stdout, p.stdout
    # The log says when it is done; until then the pages come back.
    fx.wait_for(lambda: "page cache brought back" in open(m.log).read(), "the page cache back")
    assert resident(src) >= 0.95 * before
    assert_checkpoint(src, t, {"chat_template": "x" * 5000})


def commit_in_place(run, m, src, what, edited=0):
    """Commits; checks it says in place with `what`, kept the inode, and wrote little:
    less than 1 MiB beyond the `edited` bytes (the edit's own data)."""
    ino = os.stat(src).st_ino
    before = written_by(m.pid)
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    assert f"committed in place ({what}" in p.stdout, p.stdout
    assert os.stat(src).st_ino == ino
    n = written_by(m.pid) - before
    assert n < edited + 1 * MIB, n


def test_every_edit_kind_commits_in_place(tmp_path, mount, run):
    if os.geteuid() != 0:
        pytest.skip("reads the daemon's /proc/PID/io")
    src = tmp_path / "m.safetensors"
    t = tensors()
    meta = {"format": "pt"}
    with_room(src, mount, run, t, meta)
    m = mount(src)
    # Metadata.
    meta["chat_template"] = "{{ messages }}"
    with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
        json.dump(meta, f)
    status = run("status", m.path).stdout
    assert "  commit     in place (header;" in status, status
    commit_in_place(run, m, src, "header;")
    assert_checkpoint(src, t, meta)
    # Renames, and a reshape of the same size.
    sh(f"mv {m.path}/layer.0 {m.path}/model.layers.0.weight")
    with open(os.path.join(m.path, "layer.1.meta.json"), "w") as f:
        json.dump({"dtype": "I64", "shape": [32, 128]}, f)
    t["model.layers.0.weight"] = t.pop("layer.0")
    t["layer.1"] = t["layer.1"].reshape(32, 128)
    commit_in_place(run, m, src, "header;")
    assert_checkpoint(src, t, meta)
    # A tensor rewritten in place, same size (dd conv=notrunc).
    new_embed = np.full((256, 64), 0.5, np.float32)
    (tmp_path / "embed.bin").write_bytes(new_embed.tobytes())
    sh(f"dd if={tmp_path}/embed.bin of={m.path}/embed bs=64K conv=notrunc status=none")
    t["embed"] = new_embed
    commit_in_place(run, m, src, "header, 1 tensor overwritten;", new_embed.nbytes)
    assert_checkpoint(src, t, meta)
    # A tensor appended.
    extra = np.arange(3 * MIB, dtype=np.uint8)
    (tmp_path / "extra.bin").write_bytes(extra.tobytes())
    sh(f"cp {tmp_path}/extra.bin {m.path}/lora.A && echo '{{\"dtype\":\"U8\",\"shape\":[{extra.size}]}}' > {m.path}/lora.A.meta.json")
    t["lora.A"] = extra
    commit_in_place(run, m, src, "header, 1 tensor appended;", extra.nbytes)
    assert_checkpoint(src, t, meta)
    # The last tensor dropped: the file is cut.
    size = os.path.getsize(src)
    os.unlink(os.path.join(m.path, "lora.A"))
    del t["lora.A"]
    commit_in_place(run, m, src, "header, 1 tensor dropped at the end;")
    assert os.path.getsize(src) == size - extra.nbytes
    assert_checkpoint(src, t, meta)
    # A tensor dropped from the middle leaves a hole: a rewrite, which says why.
    os.unlink(os.path.join(m.path, "layer.1"))
    del t["layer.1"]
    status = run("status", m.path).stdout
    assert "commit     by a rewrite (not in place: tensor \"layer.1\" leaves a hole" in status, status
    p = run("commit", m.path)
    assert "committed by a rewrite (not in place: tensor \"layer.1\" leaves a hole" in p.stdout, p.stdout
    assert_checkpoint(src, t, meta)


def layers(n):
    """An embedding and `n` layers of the same shapes, as models repeat them."""
    rng = np.random.default_rng(7)
    t = {"embed": rng.standard_normal((64, 64)).astype(np.float32)}
    for i in range(n):
        t[f"model.layers.{i}.bias"] = rng.standard_normal(64).astype(np.float32)
        t[f"model.layers.{i}.weight"] = rng.standard_normal((128, 128)).astype(np.float32)
    return t


def drop_layers(path, t, which):
    t = dict(t)
    for i in which:
        for part in ("bias", "weight"):
            os.unlink(os.path.join(path, f"model.layers.{i}.{part}"))
            del t[f"model.layers.{i}.{part}"]
    return t


def test_layers_dropped_from_the_middle_are_filled_from_the_end_in_place(tmp_path, mount, run):
    if os.geteuid() != 0:
        pytest.skip("reads the daemon's /proc/PID/io")
    src = tmp_path / "m.safetensors"
    t = layers(6)
    meta = {"format": "pt"}
    with_room(src, mount, run, t, meta)
    layer = t["model.layers.0.weight"].nbytes + t["model.layers.0.bias"].nbytes
    m = mount(src)
    # Read through the mount first, and a tensor at the end renamed: neither
    # stops it moving (only a descriptor still open does).
    sh(f"cat {m.path}/model.layers.* > /dev/null")
    os.rename(os.path.join(m.path, "model.layers.5.bias"), os.path.join(m.path, "model.layers.5.b"))
    t["model.layers.5.b"] = t.pop("model.layers.5.bias")
    # One layer: the last layer's two tensors move into its place.
    t = drop_layers(m.path, t, [1])
    status = run("status", m.path).stdout
    assert "commit     in place (header, 2 tensors dropped, 2 tensors moved up from the end" in status, status
    size = os.path.getsize(src)
    commit_in_place(run, m, src, "header, 2 tensors dropped, 2 tensors moved up from the end;", layer)
    assert os.path.getsize(src) == size - layer
    assert_checkpoint(src, t, meta)
    # A run of layers (2-3 of what is left, as removing layers 20-29 of 32):
    # the one layer after them moves into the first one's place, the rest is cut.
    t = drop_layers(m.path, t, [2, 3])
    commit_in_place(run, m, src, "header, 4 tensors dropped, 2 tensors moved up from the end;", layer)
    assert os.path.getsize(src) == size - 3 * layer
    assert_checkpoint(src, t, meta)
    # Two layers apart (0 and 5, the latter now third): the last one fills
    # the first hole, the second is cut.
    t = drop_layers(m.path, t, [0])
    os.unlink(os.path.join(m.path, "model.layers.5.weight"))
    os.unlink(os.path.join(m.path, "model.layers.5.b"))
    del t["model.layers.5.weight"], t["model.layers.5.b"]
    commit_in_place(run, m, src, "header, 4 tensors dropped, 2 tensors moved up from the end;", layer)
    assert os.path.getsize(src) == size - 5 * layer
    assert_checkpoint(src, t, meta)
    # The mount reads the moved tensors at their new places.
    for name, v in t.items():
        assert open(os.path.join(m.path, name), "rb").read() == v.tobytes(), name
    # A tensor at the end open through the mount is not moved: a rewrite.
    src2 = tmp_path / "m2.safetensors"
    t2 = layers(3)
    save_file(t2, str(src2))
    m2 = mount(src2)
    with open(os.path.join(m2.path, "model.layers.2.weight"), "rb"):
        t2 = drop_layers(m2.path, t2, [0])
        p = run("commit", m2.path)
        assert "committed by a rewrite" in p.stdout and "is still read" in p.stdout, p.stdout
    assert_checkpoint(src2, t2)


def test_a_rewrite_leaves_room_in_the_header(tmp_path, mount, run):
    src, t, m = mounted_as_saved(tmp_path, mount)
    os.unlink(os.path.join(m.path, "layer.1"))  # from the middle, no exact fill: a rewrite
    del t["layer.1"]
    p = run("commit", m.path)
    assert "committed by a rewrite (not in place: tensor \"layer.1\" leaves a hole" in p.stdout, p.stdout
    _, n, _ = header_of(src)
    assert (8 + n) % 4096 == 0, "a rewrite puts the data section on a 4 KiB boundary"
    assert_checkpoint(src, t)
    # The room takes the next header edits in place.
    sh(f"mv {m.path}/embed {m.path}/model.embed_tokens.weight")
    t["model.embed_tokens.weight"] = t.pop("embed")
    p = run("commit", m.path)
    assert "committed in place (header;" in p.stdout, p.stdout
    assert_checkpoint(src, t)


def test_a_descriptor_reads_the_right_bytes_across_a_header_that_grows(tmp_path, mount, run):
    """Blocks inserted at the file's start move every tensor: what the mount serves follows."""
    src, t, m = mounted_as_saved(tmp_path, mount)
    held = open(os.path.join(m.path, "layer.1"), "rb")
    mapped = np.memmap(os.path.join(m.path, "embed"), dtype=np.float32, mode="r")
    try:
        with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
            json.dump({"notes": "n" * 20000}, f)
        p = run("commit", m.path)
        assert re.search(r"committed in place \(header grown by (8|9)\d KiB at the start;", p.stdout), p.stdout
        assert held.read() == t["layer.1"].tobytes()
        assert np.array_equal(np.asarray(mapped).reshape(256, 64), t["embed"])
        for name, v in t.items():
            assert open(os.path.join(m.path, name), "rb").read() == v.tobytes(), name
    finally:
        held.close()
        del mapped
    assert_checkpoint(src, t, {"notes": "n" * 20000})


def test_compact_is_the_reference_layout(tmp_path, mount, run):
    src, t, m = mounted_as_saved(tmp_path, mount)
    sh(f"mv {m.path}/embed {m.path}/wte")
    t["wte"] = t.pop("embed")
    p = run("commit", "--compact", m.path)
    assert "committed by a rewrite (not in place: --compact;" in p.stdout, p.stdout
    assert_checkpoint(src, t, compact=True)
    # A file with room in its header is made compact with nothing staged, too.
    sh(f"mv {m.path}/wte {m.path}/embed")
    t["embed"] = t.pop("wte")
    assert "committed in place" in run("commit", m.path).stdout
    _, n, _ = header_of(src)
    p = run("commit", "--compact", m.path)
    assert "committed by a rewrite (not in place: --compact;" in p.stdout, p.stdout
    assert_checkpoint(src, t, compact=True)
    assert header_of(src)[1] < n


def test_a_reader_of_the_source_keeps_its_bytes_and_the_commit_says_why(tmp_path, mount, run):
    src, t, m = mounted_with_room(tmp_path, mount, run)
    old_tail = t["z_tail"].tobytes()
    with safe_open(str(src), framework="np") as reader:
        mapped = np.memmap(src, dtype=np.uint8, mode="r")
        sh(f"dd if=/dev/zero of={m.path}/z_tail bs=4096 count=1 conv=notrunc status=none")
        # status takes no lease (it changes nothing): it cannot know of the
        # reader, and says what a commit depends on.
        status = run("status", m.path).stdout
        assert "  commit     in place (header, 1 tensor overwritten" in status, status
        assert "unless another program has the file open then" in status, status
        p = run("commit", m.path)
        assert "committed by a rewrite (not in place: another program has it open or mapped" in p.stdout, p.stdout
        # The reader's file is the old one, whole.
        assert reader.get_tensor("z_tail").tobytes() == old_tail
        assert mapped[-4096:].tobytes() == old_tail
        del mapped
    t["z_tail"] = np.zeros(4096, np.uint8)
    assert_checkpoint(src, t, {"format": "pt"})
    # Nobody holds it now: in place again (only the block written).
    sh(f"dd if=/dev/zero of={m.path}/embed bs=4096 count=1 conv=notrunc status=none")
    p = run("commit", m.path)
    assert "committed in place (header, 1 tensor written in part; 4.0 KiB written)" in p.stdout, p.stdout


def test_an_open_descriptor_through_the_mount_keeps_its_bytes(tmp_path, mount, run):
    src, t, m = mounted_with_room(tmp_path, mount, run)
    with open(os.path.join(m.path, "z_tail"), "rb") as held:
        os.unlink(os.path.join(m.path, "z_tail"))  # the tail: in place would cut it off
        p = run("commit", m.path)
        assert "committed by a rewrite (not in place: tensor \"z_tail\"'s old bytes are still read" in p.stdout, p.stdout
        assert held.read() == t["z_tail"].tobytes()
    del t["z_tail"]
    assert_checkpoint(src, t, {"format": "pt"})
    # A tensor replaced by one of the same size while a descriptor reads its old bytes:
    # not overwritten under that descriptor.
    with open(os.path.join(m.path, "layer.0"), "rb") as held:
        replacement = np.full((128, 128), 7.0, np.float32)
        os.unlink(os.path.join(m.path, "layer.0"))
        with open(os.path.join(m.path, "layer.0"), "wb") as f:
            f.write(replacement.tobytes())
        p = run("commit", m.path)
        assert "committed by a rewrite (not in place: tensor \"layer.0\"'s old bytes are still read" in p.stdout, p.stdout
        assert held.read() == t["layer.0"].tobytes()
    t["layer.0"] = replacement
    assert_checkpoint(src, t, {"format": "pt"})


def test_links_and_read_only_mounts_rewrite(tmp_path, mount, run):
    src = tmp_path / "m.safetensors"
    t = tensors()
    with_room(src, mount, run, t, {"format": "pt"})
    os.link(src, tmp_path / "link.safetensors")
    m = mount(src)
    sh(f"mv {m.path}/embed {m.path}/wte")
    p = run("commit", m.path)
    assert "committed by a rewrite (not in place: it has 2 links" in p.stdout, p.stdout
    # The other link keeps the old file.
    assert "embed" in load_file(str(tmp_path / "link.safetensors"))


# ---- crash trials ----

STEPS = ["in-place:recorded", "in-place:marked", "in-place:inserted", "in-place:data", "in-place:written",
         "in-place:prefix", "in-place:landed"]


def edit(kind, path, t, meta):
    """Makes an edit of `kind` through the mount at `path`; returns the expected tensors and metadata."""
    t, meta = dict(t), dict(meta)
    if kind == "grow":  # past the header's room: blocks inserted at the start
        meta["note"] = "x" * 100000  # past the 64 KiB a first growth leaves
        with open(os.path.join(path, "__metadata__.json"), "w") as f:
            json.dump(meta, f)
    if kind in ("metadata", "all"):
        meta["note"] = "x" * 100
        with open(os.path.join(path, "__metadata__.json"), "w") as f:
            json.dump(meta, f)
    if kind in ("overwrite", "all"):
        new = np.full((256, 64), 2.0, np.float32)
        with open(os.path.join(path, "embed"), "r+b") as f:
            f.write(new.tobytes())
        t["embed"] = new
    if kind in ("append", "all"):
        new = np.arange(1 * MIB, dtype=np.uint8)
        with open(os.path.join(path, "new.tensor"), "wb") as f:
            f.write(new.tobytes())
        with open(os.path.join(path, "new.tensor.meta.json"), "w") as f:
            json.dump({"dtype": "U8", "shape": [new.size]}, f)
        t["new.tensor"] = new
    if kind in ("drop", "all"):
        os.unlink(os.path.join(path, "z_tail"))
        del t["z_tail"]
    return t, meta


def same(path, t, meta):
    try:
        got = load_file(str(path))
        with safe_open(str(path), framework="np") as f:
            got_meta = f.metadata() or {}
    except Exception:
        return False
    return sorted(got) == sorted(t) and all(got[k].tobytes() == v.tobytes() for k, v in t.items()) and got_meta == meta


@pytest.mark.parametrize("kind", ["metadata", "overwrite", "append", "drop", "all", "grow"])
def test_a_daemon_killed_at_every_step_leaves_old_new_or_refused(tmp_path, mount, run, kind):
    pristine = tmp_path / "pristine.safetensors"
    t = tensors()
    meta = {"format": "pt"}
    with_room(pristine, mount, run, t, meta)
    outcomes = {}
    for step in STEPS:
        src = tmp_path / f"m-{step.split(':')[1]}.safetensors"
        shutil.copyfile(pristine, src)
        m = mount(src, env={"STFS_CRASH_AT": step})
        new_t, new_meta = edit(kind, m.path, t, meta)
        p = run("commit", m.path)
        died = p.returncode != 0
        if died:
            m.close()  # the daemon is gone: unmount what it left
        if same(src, t, meta):
            outcome = "old"
        elif same(src, new_t, new_meta):
            outcome = "new"
        else:
            outcome = "refused"
            # The marker (too large), or just after blocks were inserted, a length of 0.
            with pytest.raises(Exception, match="too large|TooLarge|EOF while parsing"):
                load_file(str(src))
            insp = run("inspect", src)
            assert insp.returncode != 0 and "was interrupted" in insp.stderr, insp.stderr
        outcomes[step] = outcome
        # The next mount completes (or leaves old) and shows the edits' result.
        m2 = mount(src)
        listed = sorted(x for x in os.listdir(m2.path) if not x.endswith(".meta.json") and x not in ("__metadata__.json", "__views__"))
        assert listed == sorted(new_t), (step, listed)
        m2.close()
        assert same(src, new_t, new_meta), f"{kind} killed at {step} ({outcome}): not the new checkpoint after the next mount"
        if not died:
            m.close()
    print(kind, outcomes)
    # Before the marker: old; from it until the prefix: refused; after: new.
    assert outcomes["in-place:recorded"] == "old"
    assert outcomes["in-place:marked"] == "refused"
    assert outcomes["in-place:written"] == "refused"
    assert outcomes["in-place:prefix"] == "new" and outcomes["in-place:landed"] == "new"
    if kind == "grow":
        assert outcomes["in-place:inserted"] == "refused"


def test_a_daemon_killed_at_every_step_of_a_hole_fill_leaves_old_new_or_refused(tmp_path, mount, run):
    pristine = tmp_path / "pristine.safetensors"
    t = layers(3)
    meta = {"format": "pt"}
    with_room(pristine, mount, run, t, meta)
    outcomes = {}
    for step in [*STEPS[:-2], "in-place:moved", *STEPS[-2:]]:
        src = tmp_path / f"m-{step.split(':')[1]}.safetensors"
        shutil.copyfile(pristine, src)
        m = mount(src, env={"STFS_CRASH_AT": step})
        new_t = drop_layers(m.path, t, [0])
        p = run("commit", m.path)
        if p.returncode != 0:
            m.close()  # the daemon is gone: unmount what it left
        outcomes[step] = "old" if same(src, t, meta) else "new" if same(src, new_t, meta) else "refused"
        if outcomes[step] == "refused":
            insp = run("inspect", src)
            assert insp.returncode != 0 and "was interrupted" in insp.stderr, insp.stderr
        m2 = mount(src)
        m2.close()
        assert same(src, new_t, meta), f"killed at {step} ({outcomes[step]}): not the new checkpoint after the next mount"
        m.close()
    assert outcomes["in-place:recorded"] == "old"
    assert outcomes["in-place:data"] == outcomes["in-place:moved"] == "refused"
    assert outcomes["in-place:written"] == "refused"
    assert outcomes["in-place:landed"] == "new"


def test_a_folder_mount_killed_mid_commit_is_completed(tmp_path, mount, run):
    folder = tmp_path / "model"
    folder.mkdir()
    t = tensors()
    shards = {"model-00001-of-00002": dict(list(t.items())[:2]), "model-00002-of-00002": dict(list(t.items())[2:])}
    for name, part in shards.items():
        with_room(folder / f"{name}.safetensors", mount, run, part, {"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f"{s}.safetensors" for s, p in shards.items() for k in p}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    for step in STEPS:
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)
        m = mount(folder, env={"STFS_CRASH_AT": step})
        a, b = (os.path.join(m.path, s) for s in shards)
        new1 = np.full((256, 64), 9.0, np.float32)
        with open(os.path.join(a, "embed"), "r+b") as f:
            f.write(new1.tobytes())
        sh(f"mv {b}/layer.1 {b}/layer.one")
        with open(os.path.join(b, "__metadata__.json"), "w") as f:  # past its room: blocks inserted
            json.dump({"format": "pt", "note": "y" * 30000}, f)
        run("commit", m.path)  # the daemon dies at `step` (if this commit reaches it)
        m.close()
        m2 = mount(folder)
        m2.close()
        one = load_file(str(folder / "model-00001-of-00002.safetensors"))
        two = load_file(str(folder / "model-00002-of-00002.safetensors"))
        assert one["embed"].tobytes() == new1.tobytes(), step
        assert sorted(two) == ["layer.one", "z_tail"], step
        with safe_open(str(folder / "model-00002-of-00002.safetensors"), framework="np") as f:
            assert f.metadata() == {"format": "pt", "note": "y" * 30000}, step
        weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert weight_map["layer.one"] == "model-00002-of-00002.safetensors", step


def test_commits_go_on_while_another_program_keeps_opening_the_source(tmp_path, mount, run):
    """An opener racing the lease makes the commit plan again, or rewrite: never fail."""
    import threading
    src, t, m = mounted_with_room(tmp_path, mount, run)
    stop = threading.Event()

    def opener():
        while not stop.is_set():
            with open(src, "rb") as f:
                f.read(8)

    th = threading.Thread(target=opener)
    th.start()
    try:
        for k in range(12):
            with open(os.path.join(m.path, "__metadata__.json"), "w") as f:
                json.dump({"format": "pt", "round": str(k)}, f)
            p = run("commit", m.path)
            assert p.returncode == 0, p.stderr
    finally:
        stop.set()
        th.join()
    assert_checkpoint(src, t, {"format": "pt", "round": "11"})
