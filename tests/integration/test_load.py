"""STFS_IOC_LOAD through a real mount, with the host engine (the daemon's
memory instead of a GPU: the same planning, chunking, slab reuse, errors,
cancellation and progress code a CUDA load runs). Every byte of every
tensor is checked against what the test wrote, never against stfs."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from stfs import cuda as stfs_cuda  # noqa: E402
from stfs_fixtures import cuda_driver_present, wait_for  # noqa: E402
from conftest import as_user  # noqa: E402
from test_remote import moto, s3  # noqa: E402,F401 (fixtures)

SLAB = 4096  # -o load_slab_kib=4: sizes around a slab are cheap to make
SMALL_POOL = ("-o", "load_slab_kib=4,load_slabs=3")
PYTHON_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "python")


WAYS = pytest.mark.parametrize("through_slabs", [False, True], ids=["direct", "slabs"])


def loaded(mnt, **kw):
    return stfs_cuda.load_all(mnt, device="host", **kw)


def assert_same(got, want):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), name
        assert g.tobytes() == w.tobytes(), name


def sizes_checkpoint(path):
    """Tensors of 0 and 1 byte, and sizes around one and two slabs, of
    several dtypes, laid out back to back (so that reads join them)."""
    rng = np.random.default_rng(7)
    tensors = {"empty": np.zeros((0, 3), np.float32), "one": np.array([7], np.uint8)}
    for n in (SLAB - 1, SLAB, SLAB + 1, 2 * SLAB - 3, 2 * SLAB + 5, 5 * SLAB + 17):
        tensors[f"u8.{n}"] = rng.integers(0, 255, n, dtype=np.uint8)
    tensors["f16"] = rng.standard_normal((33, 65)).astype(np.float16)
    tensors["f32"] = rng.standard_normal((129, 31)).astype(np.float32)
    tensors["i64"] = rng.integers(-(1 << 60), 1 << 60, (3, 1001), dtype=np.int64)
    tensors["bool"] = rng.integers(0, 2, 77).astype(bool)
    save_file(tensors, str(path))
    return tensors


@WAYS
def test_every_byte_of_every_tensor_lands_at_its_offset(tmp_path, mount, through_slabs):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    m = mount(src, *SMALL_POOL)
    assert_same(loaded(m.path, through_slabs=through_slabs), want)
    load = stfs_cuda.Load(m.path, "host", through_slabs=through_slabs)
    load.wait()
    table = load.table()
    assert [e["offset"] % 256 for e in table] == [0] * len(table)
    ends = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in table)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "tensors overlap in the arena"
    assert load.state["arena_size"] == ends[-1][1]
    assert load.state["landed_tensors"] == len(want) and load.state["landed_bytes"] == sum(
        t.nbytes for t in want.values())


def test_names_a_glob_and_tensor_files_choose_what_loads(tmp_path, mount):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    m = mount(src, *SMALL_POOL)
    assert_same(loaded(m.path, names=["f16", "one"]), {k: want[k] for k in ("f16", "one")})
    assert_same(loaded(m.path, glob="u8.*"), {k: v for k, v in want.items() if k.startswith("u8.")})
    files = [os.path.join(m.path, "i64"), os.path.join(m.path, "bool")]
    assert_same(loaded(files), {k: want[k] for k in ("i64", "bool")})
    with pytest.raises(OSError) as e:
        loaded(m.path, names=["f16", "nope"])
    assert e.value.errno == errno.ENOENT and '"nope"' in str(e.value)
    with pytest.raises(OSError) as e:
        loaded(m.path, glob="[")
    assert e.value.errno == errno.EINVAL


@WAYS
def test_a_folder_of_shards_loads_as_one(tmp_path, mount, through_slabs):
    folder = tmp_path / "model"
    folder.mkdir()
    rng = np.random.default_rng(1)
    shards = [{f"l{i}.{j}": rng.standard_normal((i + 3, 7 * j + 1)).astype(np.float32) for j in range(4)}
              for i in range(3)]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    m = mount(folder, *SMALL_POOL)
    assert_same(loaded(m.path, through_slabs=through_slabs), {k: v for s in shards for k, v in s.items()})


@WAYS
def test_edited_tensors_load_their_own_bytes(tmp_path, mount, through_slabs):
    src = tmp_path / "s.safetensors"
    rng = np.random.default_rng(3)
    want = {n: rng.standard_normal(3 * SLAB + i).astype(np.float32) for i, n in enumerate("abcde")}
    save_file(want, str(src))
    m = mount(src, *SMALL_POOL)
    p = lambda *n: os.path.join(m.path, *n)  # noqa: E731
    # a: rewritten whole (a staging file); b: a few blocks written (source
    # and staged blocks read together); c: renamed; d: removed; e: new meta.
    new_a = rng.standard_normal(want["a"].size).astype(np.float32)
    with open(p("a"), "r+b") as f:
        f.write(new_a.tobytes())
    want["a"] = new_a
    b = want["b"].copy()
    b[SLAB // 4 + 5: SLAB // 4 + 700] = -1.0
    with open(p("b"), "r+b") as f:
        f.seek((SLAB // 4 + 5) * 4)
        f.write(b[SLAB // 4 + 5: SLAB // 4 + 700].tobytes())
    want["b"] = b
    os.rename(p("c"), p("c2"))
    want["c2"] = want.pop("c")
    os.unlink(p("d"))
    del want["d"]
    with open(p("e.meta.json"), "w") as f:
        f.write(json.dumps({"dtype": "I32", "shape": [want["e"].size]}))
    want["e"] = want["e"].view(np.int32)
    new = np.arange(1000, dtype=np.int16)
    with open(p("new"), "wb") as f:
        f.write(new.tobytes())
    with open(p("new.meta.json"), "w") as f:
        f.write('{"dtype":"I16","shape":[1000]}')
    want["new"] = new
    assert_same(loaded(m.path, through_slabs=through_slabs), want)


def test_the_pool_is_made_once_and_two_loads_share_it(tmp_path, mount):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    m = mount(src, *SMALL_POOL)
    assert stfs_cuda.daemon_counts(m.path) == {"slabs_made": 0, "slabs_freed": 0, "live_arenas": 0}
    assert_same(loaded(m.path), want)
    assert stfs_cuda.daemon_counts(m.path)["slabs_made"] == 3
    first, second = stfs_cuda.Load(m.path, "host"), stfs_cuda.Load(m.path, "host")
    assert stfs_cuda.daemon_counts(m.path)["live_arenas"] == 2
    for load in (first, second):
        load.wait()
        arena = stfs_cuda._host_arena(load)
        assert_same({e["name"]: stfs_cuda._view(arena, e) for e in load.table()}, want)
    first.close()
    second.close()
    wait_for(lambda: stfs_cuda.daemon_counts(m.path)["live_arenas"] == 0, "the arenas freed at close")
    assert stfs_cuda.daemon_counts(m.path)["slabs_made"] == 3, "no slab made after the first load"


def test_an_idle_pool_is_freed_and_the_next_load_makes_it_again(tmp_path, mount):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    m = mount(src, "-o", "load_slab_kib=4,load_slabs=3,load_idle_s=1")
    assert_same(loaded(m.path), want)
    assert stfs_cuda.daemon_counts(m.path)["slabs_made"] == 3
    wait_for(lambda: stfs_cuda.daemon_counts(m.path)["slabs_freed"] == 3, "the pool freed after 1 s with no load")
    assert_same(loaded(m.path), want)
    assert stfs_cuda.daemon_counts(m.path)["slabs_made"] == 6, "the second load made the pool again"
    assert "pool freed after its idle time" in open(m.log).read()


@WAYS
def test_a_read_error_mid_way_names_the_tensor_and_hands_out_nothing(tmp_path, mount, through_slabs):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    # The fifth chunk read fails.
    m = mount(src, *SMALL_POOL, env={"STFS_FAULT_AT": "load:read:EIO:5"})
    load = stfs_cuda.Load(m.path, "host", through_slabs=through_slabs)
    with pytest.raises(OSError) as e:
        load.wait()
    assert e.value.errno == errno.EIO
    assert "reading tensor" in str(e.value) and '"' in str(e.value), str(e.value)
    assert load.state["landed_tensors"] == 0
    load.close()
    # The fault fired once: the next load reads every chunk.
    assert_same(dict(stfs_cuda.load_iter(m.path, "host")), want)
    wait_for(lambda: stfs_cuda.daemon_counts(m.path)["live_arenas"] == 0, "the failed load's arena freed")
    assert "reading tensor" in open(m.log).read()


def test_a_caller_killed_mid_load_frees_everything(tmp_path, mount):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    m = mount(src, *SMALL_POOL, env={"STFS_PAUSE_AT": "load:read", "STFS_PAUSE_DIR": str(pauses)})
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {PYTHON_DIR!r})
        from stfs import cuda
        load = cuda.Load({m.path!r}, "host")
        print("started", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout.readline().strip() == "started"
        wait_for(lambda: (pauses / "load:read").exists(), "the load paused at its first read")
        assert stfs_cuda.daemon_counts(m.path)["live_arenas"] == 1
        caller.kill()
        caller.wait()
        (pauses / "load:read").unlink()
        wait_for(lambda: stfs_cuda.daemon_counts(m.path)["live_arenas"] == 0, "the arena freed")
    finally:
        caller.kill()
        (pauses / "go-all").touch()
    assert "load was cancelled" in open(m.log).read()
    assert_same(loaded(m.path), want)  # the lanes went back to the pool


def test_offsets_past_4_gib_of_a_sparse_tensor(tmp_path, mount):
    """A 4 GiB + 8 KiB tensor (a sparse file: holes read as zeros) and a
    tensor after it, whose arena offset is past 4 GiB."""
    src = tmp_path / "big.safetensors"
    big = (4 << 30) + 8192
    header = json.dumps({"big": {"dtype": "U8", "shape": [big], "data_offsets": [0, big]},
                         "tail": {"dtype": "U8", "shape": [300], "data_offsets": [big, big + 300]}}).encode()
    header += b" " * (-len(header) % 8)
    start = 8 + len(header)
    marks = {0: b"first", (4 << 30) - 2: b"across", big - 4: b"last", big: bytes(range(200)) + b"x" * 100}
    with open(src, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(start + big + 300)
        for at, data in marks.items():
            f.seek(start + at)
            f.write(data)
    m = mount(src)
    load = stfs_cuda.Load(m.path, "host")
    load.wait()
    arena = stfs_cuda._host_arena(load)
    table = {e["name"]: e for e in load.table()}
    assert table["tail"]["offset"] > (4 << 30)
    for at, data in marks.items():
        start = table["big"]["offset"] + at if at < big else table["tail"]["offset"]
        assert arena[start:start + len(data)].tobytes() == data, at
    middle = table["big"]["offset"] + (2 << 30)
    assert not arena[middle:middle + (1 << 20)].any(), "a hole reads as zeros"
    del arena, middle
    load.close()


def test_the_command_line_loads_a_mount_and_says_how_fast(tmp_path, mount, run):
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    m = mount(src, *SMALL_POOL)
    p = run("prefetch", "--device", "host", m.path)
    total = sum(t.nbytes for t in want.values())
    assert p.returncode == 0, p.stderr
    assert f"{len(want)} tensors, {total} bytes loaded into host memory" in p.stdout and "GB/s" in p.stdout
    p = run("prefetch", "--device", "host", os.path.join(m.path, "f16"), os.path.join(m.path, "one"))
    assert p.returncode == 0 and f"2 tensors, {want['f16'].nbytes + 1} bytes" in p.stdout, p.stdout


@pytest.mark.skipif(cuda_driver_present(), reason="a CUDA driver is present: scripts/gpu-check.sh covers it")
def test_cuda_without_a_driver_is_enodev(tmp_path, mount, run):
    src = tmp_path / "s.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32)}, str(src))
    m = mount(src)
    for device in (0, 7):
        with pytest.raises(OSError) as e:
            stfs_cuda.Load(m.path, device)
        assert e.value.errno == errno.ENODEV and "no CUDA driver" in str(e.value)
    p = run("prefetch", "--device", "cuda:0", m.path)
    assert p.returncode != 0 and "no CUDA driver" in p.stderr, p.stderr
    assert stfs_cuda.daemon_counts(m.path) == {"slabs_made": 0, "slabs_freed": 0, "live_arenas": 0}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: another user")
def test_a_user_other_than_the_owner_may_not_load(shared, user, mount, stfs):
    # (shared first: torn down last, once the mount in it is gone)
    src = os.path.join(shared, "s.safetensors")
    save_file({"a": np.arange(4, dtype=np.float32)}, src)
    os.chmod(src, 0o644)
    m = mount(src, "-o", "allow_other", at=shared)
    p = as_user(user, stfs, "prefetch", "--device", "host", m.path)
    assert p.returncode != 0 and "Permission denied" in p.stderr and "load" in p.stderr, p.stderr
    assert stfs_cuda.daemon_counts(m.path) == {"slabs_made": 0, "slabs_freed": 0, "live_arenas": 0}


def test_the_c_header_says_what_the_daemon_reads(tmp_path):
    """include/stfs.h, compiled: the sizes and offsets the daemon checks."""
    cc = subprocess.run(["sh", "-c", "command -v cc"], capture_output=True, text=True).stdout.strip()
    if not cc:
        pytest.skip("no C compiler")
    include = os.path.join(os.path.dirname(__file__), "..", "..", "include")
    prog = tmp_path / "abi.c"
    prog.write_text(textwrap.dedent("""
        #include <stddef.h>
        #include <stdio.h>
        #include "stfs.h"
        int main(void) {
            printf("%zu %zu %zu %zu %zu %lu\\n", sizeof(struct stfs_load), offsetof(struct stfs_load, result),
                   offsetof(struct stfs_load, tensors), offsetof(struct stfs_load, handle),
                   offsetof(struct stfs_load, text), (unsigned long)STFS_IOC_LOAD);
            return 0;
        }
    """))
    subprocess.run([cc, "-I", include, "-o", str(tmp_path / "abi"), str(prog)], check=True)
    out = subprocess.run([str(tmp_path / "abi")], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["16376", "32", "40", "128", "192", str(stfs_cuda.IOC_LOAD)]


def test_a_remote_sources_tensors_load_through_the_same_plan(tmp_path, s3, mount):  # noqa: F811
    src = tmp_path / "s.safetensors"
    want = sizes_checkpoint(src)
    m = mount(s3.upload(src, "load/s.safetensors"), *s3.options, *SMALL_POOL)
    assert_same(loaded(m.path), want)
    assert_same(loaded(m.path, through_slabs=True), want)
