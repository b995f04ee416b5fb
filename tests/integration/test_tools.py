"""Surgery with the tools people use (issue 10): every client that writes a file
atomically (temp + rename), replaces it (unlink + create), or edits it in
place works through the mount, with no sleep between steps. Each case is
judged by loading the committed file with the official package and by byte
equality with its save_file."""

import json
import os
import tarfile

import numpy as np
import pytest
from safetensors.numpy import save_file

from stfs_fixtures import assert_checkpoint, assert_committed, committed, mounted_base, sh


@pytest.fixture
def ckpt(tmp_path, mount):
    """A mounted checkpoint of base(); returns (source, tensors, mount)."""
    return mounted_base(tmp_path, mount, {"format": "np"})


def test_sed_in_place_on_a_meta(ckpt, run):
    _, t, m = ckpt
    sh("sed -i 's/\\[2,3\\]/[3,2]/' b.meta.json", cwd=m.path)
    assert json.load(open(os.path.join(m.path, "b.meta.json")))["shape"] == [3, 2]
    assert sorted(os.listdir(m.path)) == sorted(["__metadata__.json", "a", "a.meta.json", "b", "b.meta.json",
                                                 "c", "c.meta.json"]), "sed's temp file must not be left"
    assert_committed(run, ckpt, {"format": "np"}, b=t["b"].reshape(3, 2))


def test_sed_in_place_on_the_metadata(ckpt, run):
    _, _, m = ckpt
    sh("sed -i 's/np/pt/' __metadata__.json", cwd=m.path)
    assert_committed(run, ckpt, {"format": "pt"})


def test_jq_then_mv_inside_the_mount(ckpt, run):
    _, t, m = ckpt
    sh("jq -c '.shape=[2,4]' a.meta.json > tmp && mv tmp a.meta.json", cwd=m.path)
    assert not os.path.exists(os.path.join(m.path, "tmp"))
    assert_committed(run, ckpt, {"format": "np"}, a=t["a"].reshape(2, 4))


def test_jq_then_mv_from_another_filesystem(ckpt, run, tmp_path):
    _, t, m = ckpt
    elsewhere = tmp_path / "elsewhere.json"
    sh(f"jq -c '.shape=[4,2]' a.meta.json > {elsewhere} && mv {elsewhere} a.meta.json", cwd=m.path)
    assert_committed(run, ckpt, {"format": "np"}, a=t["a"].reshape(4, 2))


def test_vim_edits_a_meta(ckpt, run):
    _, t, m = ckpt
    # ex mode, no vimrc: vim still makes its swap file beside the file, and fsyncs.
    sh("vim -u NONE -i NONE -N -es -c '%s/\\[8\\]/[2,2,2]/' -c 'wq' a.meta.json", cwd=m.path)
    assert json.load(open(os.path.join(m.path, "a.meta.json")))["shape"] == [2, 2, 2]
    assert not any(n.endswith((".swp", ".swx", "~")) for n in os.listdir(m.path))
    assert_committed(run, ckpt, {"format": "np"}, a=t["a"].reshape(2, 2, 2))


def test_install_a_tensor_and_its_meta(ckpt, run, tmp_path):
    _, t, m = ckpt
    # Inside the mount (install unlinks the target, then creates it) ...
    sh("install a c && install a.meta.json c.meta.json", cwd=m.path)
    # ... and from outside.
    new = np.arange(3, dtype=np.int16)
    (tmp_path / "n.bin").write_bytes(new.tobytes())
    (tmp_path / "n.meta.json").write_text('{"dtype":"I16","shape":[3]}')
    sh(f"install {tmp_path}/n.bin {m.path}/n && install {tmp_path}/n.meta.json {m.path}/n.meta.json")
    assert_committed(run, ckpt, {"format": "np"}, c=t["a"].copy(), n=new)


def test_install_meta_first_then_the_bytes(ckpt, run):
    _, t, m = ckpt
    # Replacing c's bytes by unlink + create keeps the meta just written.
    sh("install a.meta.json c.meta.json && install a c", cwd=m.path)
    assert_committed(run, ckpt, {"format": "np"}, c=t["a"].copy())


def test_rsync_a_folder_into_the_mount(ckpt, run, tmp_path):
    _, _, m = ckpt
    d = tmp_path / "d"
    d.mkdir()
    new = np.linspace(0, 1, 6, dtype=np.float64)
    (d / "new").write_bytes(new.tobytes())
    (d / "new.meta.json").write_text('{"dtype":"F64","shape":[6]}')
    (d / "c").write_bytes(bytes([9] * 5))  # replaces c's bytes, keeps its meta
    os.utime(d / "c", (1e9, 1e9))  # rsync skips files of the same size and time
    sh(f"rsync -a {d}/ {m.path}/")
    assert not any(n.startswith(".") for n in os.listdir(m.path)), os.listdir(m.path)
    assert_committed(run, ckpt, {"format": "np"}, new=new, c=np.full(5, 9, np.uint8))


def test_tar_extracts_over_existing_files(ckpt, run, tmp_path):
    _, _, m = ckpt
    d = tmp_path / "d"
    d.mkdir()
    (d / "a").write_bytes(np.full(8, 2, np.float32).tobytes())
    (d / "a.meta.json").write_text('{"dtype":"F32","shape":[8]}')
    (d / "z").write_bytes(b"\x01\x02")
    (d / "z.meta.json").write_text('{"dtype":"U8","shape":[2]}')
    with tarfile.open(tmp_path / "t.tar", "w") as tar:
        for name in ["a.meta.json", "a", "z", "z.meta.json"]:
            tar.add(d / name, arcname=name)
    sh(f"tar xf {tmp_path}/t.tar -C {m.path}")
    assert_committed(run, ckpt, {"format": "np"}, a=np.full(8, 2, np.float32), z=np.array([1, 2], np.uint8))


def test_os_replace_keeps_the_meta_and_the_meta_opens_at_once(ckpt, run):
    _, _, m = ckpt
    tmp, big = os.path.join(m.path, ".a.tmp"), os.path.join(m.path, "a")
    with open(tmp, "wb") as f:
        f.write(np.full(8, 3, np.float32).tobytes())
    os.replace(tmp, big)
    # At once, no sleep: the name's meta is there.
    with open(big + ".meta.json", "w") as f:
        f.write('{"dtype":"F32","shape":[2,4]}')
    assert_committed(run, ckpt, {"format": "np"}, a=np.full((2, 4), 3, np.float32))


def test_rm_then_cp_a_tensor_and_its_meta_with_no_pause(ckpt, run):
    _, t, m = ckpt
    sh("cat a.meta.json > /dev/null; rm a; cp b a; cp b.meta.json a.meta.json", cwd=m.path)
    assert_committed(run, ckpt, {"format": "np"}, a=t["b"].copy())


def test_an_invalid_meta_from_the_shell_is_kept_not_dropped(ckpt, run):
    src, _, m = ckpt
    before = src.read_bytes()
    bad = '{"dtype":"f32","shape":[8]}'
    p = sh(f"echo '{bad}' > a.meta.json", cwd=m.path, check=False)
    assert p.returncode == 0  # bash ignores errors of close: nothing must be lost for it
    assert open(os.path.join(m.path, "a.meta.json")).read() == bad + "\n"
    p = run("status", m.path)
    assert p.returncode == 1 and 'unknown dtype "f32"' in p.stdout, p.stdout
    p = run("commit", m.path)
    assert p.returncode != 0 and 'tensor "a" has an invalid .meta.json' in p.stderr, p.stderr
    assert src.read_bytes() == before
    sh(f"echo '{bad.replace('f32', 'F32')}' > a.meta.json", cwd=m.path)
    assert_committed(run, ckpt, {"format": "np"})


def test_scratch_files_are_problems_until_removed(ckpt, run):
    _, _, m = ckpt
    sh("echo scratch > .a.meta.json.swp", cwd=m.path)
    p = run("status", m.path)
    assert p.returncode == 1 and ".a.meta.json.swp" in p.stdout and "no dtype and shape" in p.stdout
    assert run("commit", m.path).returncode != 0
    os.unlink(os.path.join(m.path, ".a.meta.json.swp"))
    assert run("status", m.path).returncode == 0
    assert_committed(run, ckpt, {"format": "np"})


def test_mv_between_shards_moves_the_meta_and_rewrites_the_index(tmp_path, mount, run):
    folder = tmp_path / "f"
    folder.mkdir()
    w = np.arange(4, dtype=np.float32)
    save_file({"w": w, "k": np.ones(2, np.uint8)}, str(folder / "s1.safetensors"))
    save_file({"v": np.zeros(3, np.int8)}, str(folder / "s2.safetensors"))
    index = {"metadata": {"total_size": 16 + 2 + 3},
             "weight_map": {"w": "s1.safetensors", "k": "s1.safetensors", "v": "s2.safetensors"}}
    (folder / "m.safetensors.index.json").write_text(json.dumps(index, indent=2))
    m = mount(folder)
    sh(f"mv {m.path}/s1/w {m.path}/s2/")
    assert sorted(os.listdir(os.path.join(m.path, "s2"))) == ["__metadata__.json", "v", "v.meta.json", "w", "w.meta.json"]
    assert "w.meta.json" not in os.listdir(os.path.join(m.path, "s1"))
    sh(f"rm {m.path}/s1/k")  # s1 is left empty
    committed(run, m)
    assert_checkpoint(folder / "s1.safetensors", {})
    assert_checkpoint(folder / "s2.safetensors", {"v": np.zeros(3, np.int8), "w": w})
    got = json.loads((folder / "m.safetensors.index.json").read_text())
    assert got["weight_map"] == {"v": "s2.safetensors", "w": "s2.safetensors"}
    assert got["metadata"]["total_size"] == 16 + 3
    assert run("verify", folder).returncode == 0
    # The mount shows the new index.
    assert json.loads(open(os.path.join(m.path, "m.safetensors.index.json")).read()) == got
