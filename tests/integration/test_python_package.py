"""The Python package `stfs` (python/stfs): mount, edit, status, commit,
discard and errors through it, checked with the official safetensors package.

In the suite it runs this checkout's package against the release build
($STFS). scripts/test_wheel runs this same file again with STFS_FROM_WHEEL=1,
in a fresh virtual environment where only the built wheel is installed: then
`stfs` and its binary must come from that environment."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save, save_file

FROM_WHEEL = os.environ.get("STFS_FROM_WHEEL") == "1"
if not FROM_WHEEL:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "python"))
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "pylib"))
    from stfs_fixtures import stfs_path

    os.environ["STFS_BIN"] = stfs_path()
import stfs  # noqa: E402


def stfs_mounts():
    """(mount point, source) of every stfs mount of this machine."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, post = line.split(" - ")
            fstype, source = post.split()[:2]
            if fstype == "fuse.stfs":
                out.append((pre.split()[4].replace("\\040", " "), source))
    return out


@pytest.fixture(autouse=True)
def no_mount_left(tmp_path):
    """Whatever a test does, no mount of its sources (all in tmp_path) stays."""
    yield
    for point, source in stfs_mounts():
        if source.startswith(str(tmp_path)):
            subprocess.run(["umount", "-l", point], capture_output=True)
            raise AssertionError(f"the test left {source} mounted at {point}")


def demo_checkpoint(path):
    """The checkpoint scripts/demo mounts, written by the official save_file."""
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((1000, 64)).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((256, 64)).astype(np.float32),
        "model.layers.0.mlp.up_proj.bias": np.zeros(256, np.float32),
        "lm_head.weight": rng.standard_normal((1000, 64)).astype(np.float16),
    }
    save_file(tensors, str(path), metadata={"format": "np", "made_by": "stfs demo"})
    return tensors


def digest(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def test_the_package_and_its_binary_come_from_where_they_should():
    exe = stfs.binary()
    assert subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.startswith("stfs ")
    if FROM_WHEEL:
        # The wheel put both into this environment: nothing of the checkout is used.
        assert pathlib.Path(stfs.__file__).is_relative_to(sys.prefix), stfs.__file__
        assert pathlib.Path(exe).is_relative_to(sys.prefix), exe
        assert "STFS_BIN" not in os.environ
    else:
        assert exe == os.environ["STFS_BIN"]


def test_one_cell_mount_edit_commit_then_the_official_reader_sees_the_edit(tmp_path):
    src = tmp_path / "demo.safetensors"
    tensors = demo_checkpoint(src)
    with stfs.mount(src) as m:
        assert m.path.is_dir() and str(m.path) in [p for p, _ in stfs_mounts()]
        assert "lm_head.weight" in m.tensors()
        (m.path / "lm_head.weight").rename(m.path / "output.weight")
        (m.path / "model.layers.0.mlp.up_proj.bias").unlink()
        (m.path / "__metadata__.json").write_text('{"format": "pt"}')
        st = m.status()
        assert not st.refused and st.problems == []
        kinds = {c.kind for c in st.changes}
        assert {"renamed", "removed", "metadata"} <= kinds, st
        # (The way depends on the filesystem; the removed middle tensor is why it is not in place.)
        assert st.files[0].file == src and "up_proj.bias" in st.files[0].commit, st.files[0].commit
        mount_point = m.path
    # Committed on leaving the block, unmounted, and the temporary mount point removed.
    assert not mount_point.exists()
    assert not [s for _, s in stfs_mounts() if s == str(src)]
    got = load_file(str(src))
    assert sorted(got) == sorted(["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "output.weight"])
    assert np.array_equal(got["output.weight"], tensors["lm_head.weight"])
    with safe_open(str(src), "np") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_block_that_raises_commits_nothing(tmp_path):
    src = tmp_path / "m.safetensors"
    demo_checkpoint(src)
    before = digest(src)
    with pytest.raises(RuntimeError, match="half done"):
        with stfs.mount(src) as m:
            (m.path / "lm_head.weight").unlink()
            raise RuntimeError("half done")
    assert digest(src) == before
    assert not m.mounted and not m.path.exists()


def test_on_exit_discard_and_discard_keep_the_source_as_it_was(tmp_path):
    src = tmp_path / "m.safetensors"
    demo_checkpoint(src)
    before = digest(src)
    (tmp_path / "mnt").mkdir()
    with stfs.mount(src, tmp_path / "mnt", on_exit="discard") as m:
        (m.path / "lm_head.weight").unlink()
        assert [c.kind for c in m.status().changes] == ["removed"]
        m.discard()
        assert m.status().changes == [] and "lm_head.weight" in m.tensors()
        (m.path / "model.embed_tokens.weight").unlink()
    assert digest(src) == before
    # A mount point the caller gave is the caller's: it stays.
    assert (tmp_path / "mnt").is_dir()


def test_a_refused_commit_raises_with_stfs_message_and_loses_nothing(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({"w": np.ones(8, np.float32)}, str(src))
    before = digest(src)
    m = stfs.mount(src)
    try:
        (m.path / "w.meta.json").write_text('{"dtype": "F32", "shape": [9]}')
        st = m.status()
        assert st.refused and any('"w"' in p for p in st.problems), st
        with pytest.raises(stfs.StfsError) as e:
            m.commit()
        assert '"w"' in e.value.message and "F32 [9] needs 36" in e.value.message, e.value.message
        assert e.value.returncode == 1
        # Leaving a block over an invalid edit raises too, and keeps the mount and its edits.
        with pytest.raises(stfs.StfsError, match="still mounted"):
            with m:
                pass
        assert m.mounted and m.status().refused
        assert digest(src) == before
    finally:
        if m.mounted:
            m.unmount(discard=True)
    assert digest(src) == before and not m.path.exists()


def test_leaving_the_block_with_a_file_still_open_commits_and_detaches_lazily(tmp_path):
    src = tmp_path / "m.safetensors"
    tensors = demo_checkpoint(src)
    with pytest.warns(UserWarning, match="still open: detached lazily"):
        with stfs.mount(src) as m:
            keep = np.memmap(m.path / "model.embed_tokens.weight", np.float16, mode="r", shape=(1000, 64))
            (m.path / "lm_head.weight").rename(m.path / "output.weight")
    assert "output.weight" in load_file(str(src))
    assert not m.mounted and not m.path.exists()
    assert np.array_equal(keep, tensors["model.embed_tokens.weight"]), "the open file stopped reading"
    del keep
    # A Mount that was unmounted says so.
    with pytest.raises(stfs.StfsError, match="not mounted any more"):
        m.status()
    with pytest.raises(stfs.StfsError, match="not mounted any more"):
        m.tensors()


def test_views_and_a_compact_commit_match_the_reference_writer(tmp_path):
    src = tmp_path / "m.safetensors"
    tensors = demo_checkpoint(src)
    with stfs.mount(src) as m:
        (m.path / "lm_head.weight").rename(m.path / "output.weight")
        with safe_open(str(m.views / "model.safetensors"), "np") as f:
            assert "output.weight" in f.keys() and "lm_head.weight" not in f.keys()
        bf16 = m.views / "bf16" / "model.safetensors"
        with safe_open(str(bf16), "np") as f:
            assert str(f.get_slice("output.weight").get_dtype()) == "BF16"
        message = m.commit(compact=True)
        assert str(src) in message and "committed" in message, message
    tensors["output.weight"] = tensors.pop("lm_head.weight")
    got, want = src.read_bytes(), save(tensors, metadata={"format": "np", "made_by": "stfs demo"})
    # Byte for byte, but for the order of __metadata__'s keys, which the
    # reference writer takes from a hash map (it differs from run to run).
    n = int.from_bytes(want[:8], "little")
    assert got[:8] == want[:8] and got[8 + n:] == want[8 + n:]
    assert json.loads(got[8:8 + n]) == json.loads(want[8:8 + n])
    assert list(json.loads(got[8:8 + n])) == list(json.loads(want[8:8 + n]))


def test_a_bad_source_raises_and_leaves_no_temporary_folder(tmp_path):
    before = set(os.listdir(tempfile.gettempdir()))
    with pytest.raises(stfs.StfsError) as e:
        stfs.mount(tmp_path / "missing.safetensors")
    assert "missing.safetensors" in e.value.message, e.value.message
    assert set(os.listdir(tempfile.gettempdir())) - before == set()
    with pytest.raises(ValueError):
        stfs.mount(tmp_path / "missing.safetensors", on_exit="keep")


def test_completions_and_man_pages_come_from_the_command_line_definitions(tmp_path):
    (tmp_path / "stfs.bash").write_text(stfs.run("completions", "bash").stdout)
    # What bash offers after `stfs mo<TAB>` and `stfs mount --stag<TAB>`.
    script = f"""source {tmp_path / 'stfs.bash'}
COMP_WORDS=(stfs mo); COMP_CWORD=1; _stfs stfs mo stfs; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(stfs mount --stag); COMP_CWORD=2; _stfs stfs --stag mount; echo "${{COMPREPLY[@]}}"
"""
    offered = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert offered.splitlines() == ["mount", "--staging-dir"], offered
    # A word that is not an option, where a command takes a path: nothing
    # offered, so bash completes file names (the script registers -o default);
    # where it takes a value, the values.
    script = f"""source {tmp_path / 'stfs.bash'}
COMP_WORDS=(stfs mount ''); COMP_CWORD=2; _stfs stfs '' mount; echo "mount:${{COMPREPLY[@]}}"
COMP_WORDS=(stfs mount m.safetensors ''); COMP_CWORD=3; _stfs stfs '' m.safetensors; echo "mnt:${{COMPREPLY[@]}}"
COMP_WORDS=(stfs status ''); COMP_CWORD=2; _stfs stfs '' status; echo "status:${{COMPREPLY[@]}}"
COMP_WORDS=(stfs completions ''); COMP_CWORD=2; _stfs stfs '' completions; echo "shells:${{COMPREPLY[@]}}"
complete -p stfs
"""
    offered = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert offered[:3] == ["mount:", "mnt:", "status:"], offered
    assert "bash" in offered[3].split() and "zsh" in offered[3].split(), offered
    assert "-o default" in offered[4], offered
    for shell in ("zsh", "fish"):
        assert "staging-dir" in stfs.run("completions", shell).stdout
    page = stfs.run("man").stdout
    assert page.startswith(".ie") and ".TH stfs 1" in page and "stfs\\-mount(1)" in page
    stfs.run("man", "--out-dir", tmp_path / "man1")
    mount_page = (tmp_path / "man1" / "stfs-mount.1").read_text()
    assert "\\-\\-staging\\-dir" in mount_page
    with pytest.raises(stfs.StfsError, match="invalid value"):
        stfs.run("completions", "tcsh")
