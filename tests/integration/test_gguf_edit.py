"""Editing GGUF through the mount (docs/SEMANTICS.md, "GGUF"): keys written as files with
the tools people have (echo, sed -i, vim, Python), tensors moved, removed, overwritten and
added, commits in place or by a rewrite, `--compact` byte for byte what gguf-py's
GGUFWriter writes, and every result read back by gguf-py and by llama.cpp's own C code."""

import errno
import json
import os
import pathlib
import re
import shutil
import subprocess

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_models import (ggml_verdicts, have_llama, llama_load, rebuild, write,  # noqa: E402
                         write_model, write_tiny_llama)


def need_llama():
    """llama.cpp's libraries: a test that needs them fails in CI as root (scripts/setup
    installs them there) and is skipped elsewhere."""
    if not have_llama():
        if os.environ.get("CI") and os.getuid() == 0:
            pytest.fail("llama.cpp's libraries are missing: scripts/setup installs them (npm, node-llama-cpp)")
        pytest.skip("llama.cpp's libraries are not installed (scripts/setup, with npm)")


def fields(path):
    """{key: (type names, value)} as gguf-py reads the file (stfs's room key left out)."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "stfs.room":
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            value = [f.contents(i) for i in range(len(f.data))]
        elif f.types[0] == gguf.GGUFValueType.STRING:
            raw = bytes(f.parts[-1])  # (gguf-py decodes strings as UTF-8; ggml does not ask it)
            value = raw.decode() if raw.isascii() or _utf8(raw) else raw
        else:
            value = f.contents()
        out[k] = ([t.name for t in f.types], value)
    return out


def _utf8(raw):
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


def close_error(path, text):
    """Writes `text` to `path` with Python's open/write/close; the errno of the close
    (where the value is read) or None."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        return e.errno
    return None


def written(output):
    """Bytes an in-place commit says it wrote ("... 1.2 KiB written")."""
    m = re.search(r"in place \(.*?; ([\d.]+) (bytes|KiB|MiB) written\)", output)
    assert m, output
    return float(m.group(1)) * {"bytes": 1, "KiB": 1024, "MiB": 1 << 20}[m.group(2)]


def with_keys(path):
    """The tiny model, and keys of more types: a UINT8, a BOOL, an array of floats."""
    def fill(w):
        w.add_name("tiny")
        w.add_chat_template("{% for m in messages %}\n{{ m.content }}\n{% endfor %}")
        w.add_token_list(["<s>", "</s>", "hello"])
        w.add_eos_token_id(1)
        w.add_uint8("test.u8", 3)
        w.add_bool("test.flag", False)
        w.add_array("test.floats", [0.5, 1.25])
        w.add_tensor("token_embd.weight", np.arange(24, dtype=np.float32).reshape(3, 8))
        w.add_tensor("output_norm.weight", np.ones(8, np.float16))
        w.add_tensor("blk.0.ffn_up.weight", np.arange(2 * 144, dtype=np.uint8).reshape(2, 144) % 251,
                     raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    write(path, fill)


def test_keys_edited_with_shell_tools_commit_in_place_and_readers_agree(tmp_path, mount, run):
    path = tmp_path / "tiny.gguf"
    with_keys(path)
    before = fields(path)
    m = mount(path)
    kv = pathlib.Path(m.path) / "__kv__"
    sh = lambda cmd: subprocess.run(["sh", "-c", cmd], cwd=kv, capture_output=True, text=True)  # noqa: E731
    assert sh("echo 128009 > tokenizer.ggml.eos_token_id").returncode == 0
    assert sh("sed -i 's/m.content/m.content | trim/' tokenizer.chat_template").returncode == 0
    assert sh("printf 'Apache-2.0' > general.license").returncode == 0
    assert sh("echo true > test.flag && rm general.name").returncode == 0
    assert sh("echo '[1, -2.5, \"inf\"]' > test.floats").returncode == 0
    # A value its key's type cannot hold: refused at close, kept as written, listed.
    assert close_error(kv / "test.u8", "300\n") == errno.EINVAL
    assert (kv / "test.u8").read_text() == "300\n"
    st = run("status", m.path).stdout
    assert 'problem' in st and "__kv__/test.u8" in st and "not a valid UINT8" in st, st
    c = run("commit", m.path)
    assert c.returncode != 0 and "__kv__/test.u8" in c.stderr, c.stderr
    assert fields(path) == before
    assert close_error(kv / "test.u8", "7") is None
    shown = json.loads((pathlib.Path(m.path) / "__metadata__.json").read_text())
    assert shown["test.u8"] == {"type": "UINT8", "value": 7}
    assert shown["general.license"] == {"type": "STRING", "value": "Apache-2.0"}
    assert "general.name" not in shown and sorted(os.listdir(kv)) == sorted(shown)
    st = run("status", m.path).stdout
    for line in ("key        tokenizer.chat_template: set", "key        general.name: removed",
                 "key        general.license: added (STRING)"):
        assert line in st, st
    c = run("commit", m.path)
    assert c.returncode == 0 and "in place" in c.stdout, c.stdout + c.stderr
    after = fields(path)
    assert after["tokenizer.ggml.eos_token_id"] == (["UINT32"], 128009)
    assert after["test.u8"] == (["UINT8"], 7)
    assert after["test.flag"] == (["BOOL"], True)
    assert after["test.floats"] == (["ARRAY", "FLOAT32"], [1.0, -2.5, float("inf")])
    assert after["general.license"] == (["STRING"], "Apache-2.0")
    assert after["tokenizer.chat_template"][1] == "{% for m in messages %}\n{{ m.content | trim }}\n{% endfor %}"
    assert "general.name" not in after
    # Keys keep their order; a new one comes last.
    assert list(after) == [k for k in before if k != "general.name"] + ["general.license"]
    # The tensors are where and what they were.
    r1 = gguf.GGUFReader(str(path))
    assert [t.name for t in r1.tensors] == ["token_embd.weight", "output_norm.weight", "blk.0.ffn_up.weight"]
    assert np.array_equal(r1.tensors[0].data, np.arange(24, dtype=np.float32).reshape(3, 8))
    del r1  # (its mapping would make the next commit a rewrite)
    if have_llama():
        assert ggml_verdicts([path]) == {str(path): True}
    # The next edit of the template writes what changed, not the header.
    assert sh("sed -i 's/trim/upper/' tokenizer.chat_template").returncode == 0
    c = run("commit", m.path)
    assert c.returncode == 0 and written(c.stdout) < 1024, c.stdout
    assert fields(path)["tokenizer.chat_template"][1].count("upper") == 1


def test_a_template_fixed_with_vim_is_what_llama_cpp_loads(tmp_path, mount, run):
    """A tiny llama (random weights) built by gguf-py: its template fixed through the
    mount with vim, committed in place; llama.cpp loads the model and reports the new
    template. Then a template longer than the header's room: blocks are inserted at the
    file's start, and llama.cpp still loads it."""
    need_llama()
    path = tmp_path / "llama.gguf"
    write_tiny_llama(path, "{{ old }}")
    assert llama_load(path) == {"template": "{{ old }}", "name": "tiny-llama"}
    m = mount(path)
    template = pathlib.Path(m.path) / "__kv__/tokenizer.chat_template"
    subprocess.run(["vim", "-Es", "-c", "%s/old/bos_token + messages[0].content/", "-c", "wq", str(template)],
                   check=True, timeout=60)
    assert template.read_text() == "{{ bos_token + messages[0].content }}\n"
    c = run("commit", m.path)
    assert c.returncode == 0 and "in place" in c.stdout, c.stdout + c.stderr
    assert llama_load(path)["template"] == "{{ bos_token + messages[0].content }}"
    long = "".join(f"{{% if x == {i} %}}{i}{{% endif %}}\n" for i in range(3000))
    template.write_text(long)
    c = run("commit", m.path)
    assert c.returncode == 0 and "header grown by" in c.stdout, c.stdout + c.stderr
    m.close()
    # (One final newline is the file's, as `cat` shows every value: a write takes it off.)
    assert llama_load(path) == {"template": long[:-1], "name": "tiny-llama"}


def test_compact_writes_what_gguf_writer_writes(tmp_path, mount, run):
    path = tmp_path / "tiny.gguf"
    write_model(path)
    m = mount(path)
    mnt = pathlib.Path(m.path)
    (mnt / "__kv__/general.name").write_text("renamed\n")
    (mnt / "__kv__/general.author").write_text("someone")
    os.rename(mnt / "output_norm.weight", mnt / "norm.weight")
    # The edited state shows as a file before the commit: what --compact writes.
    view = (mnt / "__views__/model.gguf").read_bytes()
    c = run("commit", "--compact", m.path)
    assert c.returncode == 0, c.stderr
    expected = tmp_path / "expected.gguf"
    rebuild(path, expected)
    assert path.read_bytes() == expected.read_bytes() == view
    assert "stfs.room" not in gguf.GGUFReader(str(path)).fields
    # A rewrite leaves room (a key readers ignore), and the next key edit is in place.
    os.unlink(mnt / "token_embd.weight")
    c = run("commit", m.path)
    assert c.returncode == 0 and "by a rewrite" in c.stdout, c.stdout
    r = gguf.GGUFReader(str(path))
    assert "stfs.room" in r.fields and r.data_offset % 4096 == 0
    assert [t.name for t in r.tensors] == ["norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_up.weight"]
    del r  # (its mapping would make the next commit a rewrite)
    (mnt / "__kv__/general.name").write_text("x" * 2000)
    c = run("commit", m.path)
    assert c.returncode == 0 and "in place (header;" in c.stdout, c.stdout
    assert fields(path)["general.name"][1] == "x" * 2000


def test_tensor_edits_commit_as_gguf(tmp_path, mount, run):
    """Renames, same-size overwrites and appends in place; a tensor dropped from the
    middle by a rewrite; what GGUF cannot hold refused, naming the tensor."""
    path = tmp_path / "tiny.gguf"
    with_keys(path)
    m = mount(path)
    mnt = pathlib.Path(m.path)
    os.rename(mnt / "token_embd.weight", mnt / "tok.weight")
    (mnt / "output_norm.weight").write_bytes(np.full(8, 2, np.float16).tobytes())
    (mnt / "extra.weight").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    (mnt / "extra.weight.meta.json").write_text('{"dtype": "F32", "shape": [2, 3]}')
    c = run("commit", m.path)
    assert c.returncode == 0 and "in place" in c.stdout and "1 tensor overwritten" in c.stdout, c.stdout + c.stderr
    r = gguf.GGUFReader(str(path))
    got = {t.name: t for t in r.tensors}
    assert list(got) == ["tok.weight", "output_norm.weight", "blk.0.ffn_up.weight", "extra.weight"]
    assert np.array_equal(got["output_norm.weight"].data, np.full(8, 2, np.float16))
    assert np.array_equal(got["extra.weight"].data, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert [int(n) for n in got["extra.weight"].shape] == [3, 2]  # ne, innermost first
    assert all(int(t.data_offset) % 32 == 0 for t in r.tensors)
    del r, got
    # A dtype GGUF has no type for, and a quantized row that is not whole blocks: refused.
    (mnt / "b.weight").write_bytes(b"\1\0")
    (mnt / "b.weight.meta.json").write_text('{"dtype": "BOOL", "shape": [2]}')
    c = run("commit", m.path)
    assert c.returncode != 0 and 'tensor "b.weight"' in c.stderr and "not a ggml type" in c.stderr, c.stderr
    os.unlink(mnt / "b.weight")
    os.unlink(mnt / "tok.weight")
    c = run("commit", m.path)
    assert c.returncode == 0 and "by a rewrite" in c.stdout, c.stdout + c.stderr
    r = gguf.GGUFReader(str(path))
    assert [t.name for t in r.tensors] == ["output_norm.weight", "blk.0.ffn_up.weight", "extra.weight"]
    assert bytes(r.tensors[1].data) == bytes(np.arange(2 * 144, dtype=np.uint8) % 251)
    del r
    if have_llama():
        assert ggml_verdicts([path]) == {str(path): True}
    # An empty tensor last, by a rewrite: it lies past the padding of the one
    # before, which the file holds (it once ended before it: ggml refused it).
    (mnt / "z.weight").touch()
    (mnt / "z.weight.meta.json").write_text('{"dtype": "F32", "shape": [0]}')
    os.unlink(mnt / "output_norm.weight")
    c = run("commit", m.path)
    assert c.returncode == 0 and "by a rewrite" in c.stdout, c.stdout + c.stderr
    r = gguf.GGUFReader(str(path))
    assert [t.name for t in r.tensors] == ["blk.0.ffn_up.weight", "extra.weight", "z.weight"]
    assert os.path.getsize(path) == int(r.tensors[2].data_offset)  # (absolute)
    del r
    if have_llama():
        assert ggml_verdicts([path]) == {str(path): True}


@pytest.mark.parametrize("tool", [
    "perl -pi.bak -e 's/1/7/' tokenizer.ggml.eos_token_id && rm tokenizer.ggml.eos_token_id.bak",
    "sed -i.orig 's/1/7/' tokenizer.ggml.eos_token_id && rm tokenizer.ggml.eos_token_id.orig",
    "mv tokenizer.ggml.eos_token_id old && echo 7 > tokenizer.ggml.eos_token_id && rm old",
    "echo 7 > /tmp/stfs-seven-$$ && install /tmp/stfs-seven-$$ tokenizer.ggml.eos_token_id; rm -f /tmp/stfs-seven-$$",
])
def test_tools_that_keep_a_backup_keep_the_keys_type(tmp_path, mount, run, tool):
    """A tool that renames the key away (a backup) and writes a new file under its name
    gives the key its value, of the key's type: a key made under a name the file has, or
    had during the mount, takes that name's type."""
    path = tmp_path / "tiny.gguf"
    write_model(path)
    m = mount(path)
    p = subprocess.run(["sh", "-c", tool], cwd=pathlib.Path(m.path) / "__kv__", capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "its type changed" not in run("status", m.path).stdout
    assert run("commit", m.path).returncode == 0
    assert fields(path)["tokenizer.ggml.eos_token_id"] == (["UINT32"], 7)


def test_what_keys_cannot_be(tmp_path, mount, run):
    path = tmp_path / "tiny.gguf"
    write_model(path)
    mnt = pathlib.Path(mount(path).path)
    kv = mnt / "__kv__"
    for name in ["stfs.room", "GGUF.tensor_count", "GGUF.kv_count", "GGUF.version"]:
        with pytest.raises(OSError) as e:
            (kv / name).write_text("1")  # (gguf-py could not read the file)
        assert e.value.errno == errno.EINVAL, name
    # A key ggml reads as a UINT32 is made one.
    (kv / "general.alignment").write_text("64\n")
    assert json.loads((mnt / "__metadata__.json").read_text())["general.alignment"] == {
        "type": "UINT32", "value": 64}
    os.unlink(kv / "general.alignment")
    # (EPERM, not EXDEV: mv would copy, making a tensor of the key's text.)
    with pytest.raises(OSError) as e:
        os.rename(kv / "general.name", mnt / "general.name")
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        os.rename(mnt / "token_embd.weight", kv / "token_embd.weight")
    assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        os.mkdir(kv / "sub")
    assert e.value.errno in (errno.ENOTSUP, errno.EPERM, errno.EROFS)
    # mv between keys: the target keeps its type, and a value that does not fit is refused.
    (kv / "n").write_text("12")
    os.rename(kv / "n", kv / "tokenizer.ggml.eos_token_id")
    assert json.loads((mnt / "__metadata__.json").read_text())["tokenizer.ggml.eos_token_id"] == {
        "type": "UINT32", "value": 12}
    (kv / "word").write_text("twelve")
    with pytest.raises(OSError) as e:
        os.rename(kv / "word", kv / "tokenizer.ggml.eos_token_id")
    assert e.value.errno == errno.EINVAL
    # (A value reads back as it will after a commit: `printf 12` gives 12 and a newline.)
    assert (kv / "word").exists() and (kv / "tokenizer.ggml.eos_token_id").read_text() == "12\n"
    # A general.alignment that ggml would refuse: listed, and the commit refused.
    (kv / "general.alignment").write_text("24")
    p = run("commit", mnt)
    assert p.returncode != 0 and "general.alignment" in p.stderr, p.stderr


def test_edits_survive_a_killed_daemon(tmp_path, mount, run):
    """Keys, and writes into quantized tensors (whose block types a safetensors
    header cannot name: the journal once lost them), come back after kill -9."""
    path = tmp_path / "tiny.gguf"
    write_model(path)
    before = path.read_bytes()
    m = mount(path)
    mnt = pathlib.Path(m.path)
    kv = mnt / "__kv__"
    (kv / "tokenizer.chat_template").write_text("{{ kept }}\n")
    (kv / "general.new").write_bytes(b"\xff\xfe not utf-8")
    os.unlink(kv / "general.name")
    subprocess.run(["dd", "of=" + str(mnt / "blk.0.attn_q.weight"), "conv=notrunc", "bs=1", "seek=3",
                    "status=none"], input=b"\x07\x07", check=True)
    q8 = (mnt / "blk.0.attn_q.weight").read_bytes()
    os.rename(mnt / "blk.0.ffn_up.weight", mnt / "blk.0.ffn_down.weight")
    subprocess.run(["sync"])
    os.kill(m.pid, 9)
    m.close()
    assert path.read_bytes() == before
    m2 = mount(path)
    mnt = pathlib.Path(m2.path)
    kv = mnt / "__kv__"
    assert (kv / "tokenizer.chat_template").read_text() == "{{ kept }}\n"
    assert (kv / "general.new").read_bytes() == b"\xff\xfe not utf-8\n"
    assert not (kv / "general.name").exists()
    assert (mnt / "blk.0.attn_q.weight").read_bytes() == q8 and q8[3:5] == b"\x07\x07"
    assert json.loads((mnt / "blk.0.ffn_down.weight.meta.json").read_text())["dtype"] == "Q4_K"
    assert not (mnt / "blk.0.ffn_up.weight").exists()
    # A string that is not UTF-8 (an editor's swap file, say) is kept, and refused at commit.
    c = run("commit", m2.path)
    assert c.returncode != 0 and "__kv__/general.new: a string that is not UTF-8" in c.stderr, c.stderr
    os.unlink(kv / "general.new")
    assert run("commit", m2.path).returncode == 0
    got = fields(path)
    assert got["tokenizer.chat_template"][1] == "{{ kept }}" and "general.name" not in got
    assert "general.new" not in got
    import gguf
    r = gguf.GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}
    assert bytes(tensors["blk.0.attn_q.weight"].data.tobytes()) == q8
    assert tensors["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_K
    del r, tensors


STEPS = ["in-place:recorded", "in-place:marked", "in-place:inserted", "in-place:data", "in-place:header",
         "in-place:written", "in-place:prefix", "in-place:landed"]


@pytest.mark.parametrize("kind", ["template", "grow", "append"])
def test_a_daemon_killed_at_every_step_of_a_gguf_commit(tmp_path, mount, run, kind):
    """Killed at each step of an in-place commit, the file is the old one, the new one, or
    one that gguf-py and llama.cpp both refuse; the next mount completes it."""
    pristine = tmp_path / "pristine.gguf"
    write_model(pristine)
    old = fields(pristine)
    template = {"template": "{{ short }}", "grow": "{{ long }}\n" * 6000 + "end", "append": "{{ x }}"}[kind]
    outcomes = {}
    for step in STEPS:
        src = tmp_path / f"m-{step.split(':')[1]}.gguf"
        shutil.copyfile(pristine, src)
        m = mount(src, env={"STFS_CRASH_AT": step})
        mnt = pathlib.Path(m.path)
        (mnt / "__kv__/tokenizer.chat_template").write_text(template)
        if kind == "append":
            (mnt / "new.weight").write_bytes(np.arange(4, dtype=np.float32).tobytes())
            (mnt / "new.weight.meta.json").write_text('{"dtype": "F32", "shape": [4]}')
        died = run("commit", m.path).returncode != 0
        if died:
            m.close()  # the daemon is gone: unmount what it left

        def is_new(path):
            got = fields(path)
            names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
            return got["tokenizer.chat_template"][1] == template and ("new.weight" in names) == (kind == "append")
        try:
            outcome = "old" if fields(src) == old else "new" if is_new(src) else "other"
        except Exception:
            outcome = "refused"
        assert outcome != "other", step
        if outcome == "refused" and have_llama():
            assert ggml_verdicts([src]) == {str(src): False}, step
        outcomes[step] = outcome
        m2 = mount(src)
        m2.close()
        assert is_new(src), f"{kind} killed at {step} ({outcome}): not the new file after the next mount"
        if not died:
            m.close()
    print(kind, outcomes)
    assert outcomes["in-place:recorded"] == "old"
    assert outcomes["in-place:marked"] == outcomes["in-place:written"] == "refused"
    assert outcomes["in-place:prefix"] == outcomes["in-place:landed"] == "new"


def test_metadata_json_and_kv_are_one_state(tmp_path, mount, run):
    """__metadata__.json written back (jq, Python) sets every key: values, a new key's
    type, a key left out removed; what is not such a document is refused whole."""
    path = tmp_path / "tiny.gguf"
    with_keys(path)
    m = mount(path)
    mnt = pathlib.Path(m.path)
    doc = json.loads((mnt / "__metadata__.json").read_text())
    doc["general.name"]["value"] = "edited"
    doc["tokenizer.ggml.bos_token_id"] = {"type": "UINT32", "value": 0}
    del doc["test.flag"]
    (mnt / "__metadata__.json").write_text(json.dumps(doc))
    kv = mnt / "__kv__"
    assert (kv / "general.name").read_text() == "edited\n"
    assert (kv / "tokenizer.ggml.bos_token_id").read_text() == "0\n"
    assert not (kv / "test.flag").exists()
    if shutil.which("jq"):
        p = subprocess.run(f"jq '.\"test.u8\".value = 9' {mnt}/__metadata__.json > {tmp_path}/m.json && "
                           f"cp {tmp_path}/m.json {mnt}/__metadata__.json", shell=True, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert (kv / "test.u8").read_text() == "9\n"
    good = (mnt / "__metadata__.json").read_text()
    for bad in ('{"general.name": "no type"}', '{"test.u8": {"type": "UINT8", "value": 300}}', "not json"):
        with pytest.raises(OSError) as e:
            (mnt / "__metadata__.json").write_text(bad)
        assert e.value.errno == errno.EINVAL, bad
    # (Kept as written, refused by a commit, until a document of keys replaces it.)
    assert (mnt / "__metadata__.json").read_text() == "not json"
    assert (kv / "general.name").read_text() == "edited\n"
    assert run("commit", m.path).returncode != 0
    (mnt / "__metadata__.json").write_text(good)
    with pytest.raises(OSError) as e:
        os.unlink(mnt / "__metadata__.json")
    assert e.value.errno == errno.EPERM
    assert run("commit", m.path).returncode == 0
    got = fields(path)
    assert got["general.name"] == (["STRING"], "edited") and "test.flag" not in got
    assert got["tokenizer.ggml.bos_token_id"] == (["UINT32"], 0)


@pytest.mark.parametrize("step", ["in-place:mark", "in-place:reserve"])
def test_a_gguf_commit_that_fails_after_its_marker_puts_the_file_back(tmp_path, mount, run, step):
    """A step failing after the marker went on (no space for an appended tensor): the
    file's own first bytes (GGUF's magic and version) are put back, and the edits stay."""
    path = tmp_path / "tiny.gguf"
    write_model(path)
    before = path.read_bytes()
    m = mount(path, env={"STFS_FAULT_AT": f"{step}:28"})
    mnt = pathlib.Path(m.path)
    (mnt / "__kv__/general.name").write_text("after")
    (mnt / "new.weight").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    (mnt / "new.weight.meta.json").write_text('{"dtype": "F32", "shape": [4]}')
    c = run("commit", m.path)
    assert c.returncode != 0 and "No space left" in c.stderr, c.stdout + c.stderr
    assert path.read_bytes() == before
    assert "key        general.name: set" in run("status", m.path).stdout
    assert run("commit", m.path).returncode == 0
    assert fields(path)["general.name"] == (["STRING"], "after")


def test_the_parts_of_a_split_file_keep_their_tensor_count(tmp_path, mount, run):
    """Each part of a split GGUF file says how many tensors all parts hold
    (split.tensors.count): a tensor added to one part, or removed, changes it in every
    part at the commit, as llama.cpp checks it."""
    from test_gguf import write_split
    folder = tmp_path / "split"
    folder.mkdir()
    write_split(folder)
    parts = sorted(p.name for p in folder.iterdir())
    mnt = pathlib.Path(mount(folder).path)
    second = mnt / parts[1][:-len(".gguf")]
    (second / "extra.w").write_bytes(np.zeros(4, np.float32).tobytes())
    (second / "extra.w.meta.json").write_text('{"dtype": "F32", "shape": [4]}')
    os.unlink(mnt / parts[0][:-len(".gguf")] / "blk.0.w")
    assert run("commit", mnt).returncode == 0
    for part in parts:
        assert fields(folder / part)["split.tensors.count"][1] == 5, part
    if have_llama():
        verdicts = ggml_verdicts([folder / p for p in parts])
        assert all(verdicts.values()), verdicts
    # Keys of one part are its own: a template edit of the first changes no other.
    (mnt / parts[0][:-len(".gguf")] / "__kv__/tokenizer.chat_template").write_text("{{ one }}")
    assert run("commit", mnt).returncode == 0
    assert fields(folder / parts[0])["tokenizer.chat_template"][1] == "{{ one }}"
    assert "tokenizer.chat_template" not in fields(folder / parts[1])


def test_create_makes_an_empty_gguf_that_mounts_and_grows(tmp_path, mount, run):
    """`stfs create NAME.gguf` writes GGUF (a .gguf name is always read as one): what
    GGUFWriter writes for the same keys; tensors copied in commit as a model."""
    made = tmp_path / "made.gguf"
    run("create", made, "--metadata", "general.architecture=llama", "--metadata", "general.name=new",
        check=True)
    ref = tmp_path / "ref.gguf"
    write(ref, lambda w: w.add_name("new"))  # (GGUFWriter adds the architecture first)
    assert made.read_bytes() == ref.read_bytes()
    assert run("verify", made).returncode == 0
    src = tmp_path / "tiny.gguf"
    write_model(src)
    m = mount(made)
    mnt = pathlib.Path(m.path)
    s = mount(src)
    for name in ["token_embd.weight", "blk.0.attn_q.weight"]:
        shutil.copyfile(pathlib.Path(s.path) / f"{name}.meta.json", mnt / f"{name}.meta.json")
        shutil.copyfile(pathlib.Path(s.path) / name, mnt / name)
    assert run("commit", m.path).returncode == 0
    r = gguf.GGUFReader(str(made))
    assert [t.name for t in r.tensors] == ["token_embd.weight", "blk.0.attn_q.weight"]
    assert r.tensors[1].tensor_type == gguf.GGMLQuantizationType.Q8_0
    del r
    if have_llama():
        assert ggml_verdicts([made]) == {str(made): True}


def test_a_key_reads_the_same_text_after_a_write_as_after_the_commit(tmp_path, mount, run):
    """`printf abc > __kv__/general.name` (no newline): the file reads back
    what it will after the commit, before and after."""
    path = tmp_path / "tiny.gguf"
    write_model(path)
    m = mount(path)
    kv = pathlib.Path(m.path) / "__kv__"
    subprocess.run(["sh", "-c", f"printf abc > {kv / 'general.name'}"], check=True)
    subprocess.run(["sh", "-c", f"printf 7 > {kv / 'tokenizer.ggml.bos_token_id'}"], check=True)
    before = {k: (kv / k).read_bytes() for k in ("general.name", "tokenizer.ggml.bos_token_id")}
    assert before == {"general.name": b"abc\n", "tokenizer.ggml.bos_token_id": b"7\n"}, before
    assert run("commit", m.path).returncode == 0
    assert {k: (kv / k).read_bytes() for k in before} == before


def test_an_invalid_metadata_document_is_kept_as_written_and_refused(tmp_path, mount, run):
    """`echo '{"broken' > __metadata__.json` of a GGUF mount: the shell drops
    the close's EINVAL, so the text is kept as written (cat shows it), listed
    by stfs status and refused by a commit, through a kill -9, until a
    document of keys or an edit of a key replaces it (it was once dropped)."""
    path = tmp_path / "tiny.gguf"
    write_model(path)
    before = path.read_bytes()
    m = mount(path)
    doc = pathlib.Path(m.path) / "__metadata__.json"
    good = doc.read_bytes()
    subprocess.run(["sh", "-c", f"echo '{{\"broken' > {doc}"], check=True)
    assert doc.read_bytes() == b'{"broken\n'
    st = run("status", m.path)
    assert st.returncode == 1 and "__metadata__.json" in st.stdout, st.stdout
    p = run("commit", m.path)
    assert p.returncode != 0 and "__metadata__.json" in p.stderr, p.stderr
    os.kill(m.pid, 9)
    m.close()
    assert path.read_bytes() == before
    m2 = mount(path)
    doc = pathlib.Path(m2.path) / "__metadata__.json"
    assert doc.read_bytes() == b'{"broken\n'
    (pathlib.Path(m2.path) / "__kv__" / "general.name").write_text("fixed\n")
    assert json.loads(doc.read_text())["general.name"]["value"] == "fixed"
    assert run("commit", m2.path).returncode == 0
    assert good != doc.read_bytes()
