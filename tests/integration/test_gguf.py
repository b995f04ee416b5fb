"""GGUF files read as ggml reads them (`stfs inspect`, `stfs verify`): written by
gguf-py's GGUFWriter (the `gguf` package, the writer llama.cpp's converters use), read
back by its GGUFReader, and bent byte by byte to break each rule ggml's C reader
enforces (docs/FORMAT.md, "GGUF")."""

import json
import errno
import os
import pathlib
import re
import struct
import subprocess

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf_models import GGML_LIB, ggml_verdicts, write_model  # noqa: E402


def inspect(run, path):
    p = run("inspect", "--json", path)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("alignment", [None, 64])
def test_inspect_agrees_with_gguf_py(tmp_path, run, alignment):
    path = tmp_path / "tiny.gguf"
    write_model(path, alignment)
    got = inspect(run, path)
    reader = gguf.GGUFReader(str(path))
    assert got["format"] == "gguf" and got["version"] == 3
    assert got["alignment"] == (alignment or 32)
    assert [t["name"] for t in got["tensors"]] == [t.name for t in reader.tensors]
    for mine, theirs in zip(got["tensors"], reader.tensors):
        assert mine["ggml_type"] == theirs.tensor_type.name, mine
        assert mine["ne"] == [int(n) for n in theirs.shape], mine
        assert mine["nbytes"] == int(theirs.n_bytes), mine
        assert mine["file_offset"] == int(theirs.data_offset), mine
    # Block-quantized sizes from ggml's table: Q8_0 34 bytes per 32, Q4_K 144 per 256.
    q = {t["name"]: t for t in got["tensors"]}
    assert (q["blk.0.attn_q.weight"]["ne"], q["blk.0.attn_q.weight"]["nbytes"]) == ([64, 4], 4 * 2 * 34)
    assert (q["blk.0.ffn_up.weight"]["shape"], q["blk.0.ffn_up.weight"]["nbytes"]) == ([2, 256], 2 * 144)
    meta = got["metadata"]
    assert meta["general.name"] == {"type": "STRING", "value": "tiny"}
    assert meta["tokenizer.chat_template"]["value"].count("\n") == 2
    assert meta["tokenizer.ggml.tokens"] == {"type": "ARRAY", "value": {"item_type": "STRING", "len": 3}}
    assert meta["tokenizer.ggml.eos_token_id"] == {"type": "UINT32", "value": 1}
    text = run("inspect", path).stdout
    assert "GGUF v3, 4 tensors" in text and "Q4_K" in text and "tokenizer.ggml.tokens (ARRAY): [3 x STRING]" in text
    assert "tokenizer.ggml.eos_token_id (UINT32): 1\n" in text and 'general.name (STRING): "tiny"' in text
    v = run("verify", path)
    assert v.returncode == 0 and f"{path}: ok (GGUF v3, 4 tensors" in v.stdout, v.stdout


def field_value_offset(path, key):
    """Byte offset of a key's value (after its type) in the file, by gguf-py's reader."""
    f = gguf.GGUFReader(str(path)).fields[key]
    return int(f.offset) + sum(p.nbytes for p in f.parts[:3])


def bent(tmp_path, run, change, expect):
    path = tmp_path / "bent.gguf"
    write_model(path)
    data = bytearray(path.read_bytes())
    change(data, path)
    path.write_bytes(bytes(data))
    p = run("verify", path)
    assert p.returncode == 1 and expect in p.stdout + p.stderr, p.stdout + p.stderr
    assert run("inspect", path).returncode == 1


def test_refusals_name_the_rule(tmp_path, run):
    def version(v):
        return lambda d, _: d.__setitem__(slice(4, 8), struct.pack("<I", v))
    bent(tmp_path, run, version(1), "ggml reads versions 2 and 3")
    bent(tmp_path, run, version(3 << 24), "big-endian")

    def retype(key, new_type):
        def go(d, path):
            f = gguf.GGUFReader(str(path)).fields[key]
            at = int(f.offset) + f.parts[0].nbytes + f.parts[1].nbytes
            d[at:at + 4] = struct.pack("<i", new_type)
        return go
    bent(tmp_path, run, retype("general.name", 13), 'key "general.name": unknown value type 13')

    def tensor_type(d, path):
        t = gguf.GGUFReader(str(path)).tensors[2]  # Q8_0
        at = int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:-2])
        assert struct.unpack("<i", d[at:at + 4])[0] == 8
        d[at:at + 4] = struct.pack("<i", 4)  # Q4_2, removed
    bent(tmp_path, run, tensor_type, 'tensor "blk.0.attn_q.weight": ggml type 4 is unknown or was removed')

    def offset(d, path):
        t = gguf.GGUFReader(str(path)).tensors[1]
        at = int(t.field.offset) + sum(p.nbytes for p in t.field.parts[:-1])
        d[at:at + 8] = struct.pack("<Q", struct.unpack("<Q", d[at:at + 8])[0] + 32)
    bent(tmp_path, run, offset, 'tensor "output_norm.weight": its offset is')

    def cut(d, _):
        del d[len(d) - 100:]
    bent(tmp_path, run, cut, "past the end of the file")


# --- Mounting a GGUF file ---------------------------------------------------------------


def reader_value(field):
    """A key's value as gguf-py's reader decodes it (str, number, bool, or a list)."""
    t = field.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        return [field.contents(i) for i in range(len(field.data))]
    return field.contents()


def test_mount_shows_tensors_keys_and_metadata_as_gguf_py_reads_them(tmp_path, mount):
    path = tmp_path / "tiny.gguf"
    write_model(path)
    m = mount(path)
    assert m.result.stderr == ""
    mnt = pathlib.Path(m.path)
    reader = gguf.GGUFReader(str(path))
    names = sorted(os.listdir(mnt))
    tensors = [t.name for t in reader.tensors]
    assert names == sorted(["__metadata__.json", "__kv__"] + tensors + [n + ".meta.json" for n in tensors])
    # Each tensor: its stored bytes (quantized blocks as they are), and its meta.
    for t in reader.tensors:
        assert (mnt / t.name).read_bytes() == t.data.tobytes(), t.name
        meta = json.loads((mnt / (t.name + ".meta.json")).read_text())
        assert meta["dtype"] == t.tensor_type.name
        assert meta["ne"] == [int(n) for n in t.shape]
        assert meta["shape"] == [int(n) for n in reversed(t.shape)]
        assert meta["nbytes"] == int(t.n_bytes)
        assert meta["file_offset"] == int(t.data_offset)
        assert meta["name"] == t.name
    # Every key, typed, in file order; and one file per key under __kv__.
    text = (mnt / "__metadata__.json").read_bytes()
    assert os.stat(mnt / "__metadata__.json").st_size == len(text)
    shown = json.loads(text)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(shown) == list(fields)
    for key, f in fields.items():
        assert shown[key]["type"] == f.types[0].name, key
        assert shown[key]["value"] == reader_value(f), key
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            assert shown[key]["item_type"] == f.types[1].name
    assert sorted(os.listdir(mnt / "__kv__")) == sorted(fields)
    kv = mnt / "__kv__"
    # (A string with a final newline, which a write takes off again.)
    assert (kv / "tokenizer.chat_template").read_bytes() == reader_value(fields["tokenizer.chat_template"]).encode() + b"\n"
    assert (kv / "general.name").read_text() == "tiny\n"
    assert (kv / "tokenizer.ggml.eos_token_id").read_text() == "1\n"
    assert json.loads((kv / "tokenizer.ggml.tokens").read_text()) == ["<s>", "</s>", "hello"]
    # __kv__ has one name (not also one in __views__); safetensors views are not
    # offered for GGUF.
    assert sorted(os.listdir(mnt / "__views__")) == ["model.gguf", "npy"]
    assert not (mnt / "__views__/kv").exists()
    # Float tensors as .npy; quantized blocks have no numpy dtype and are left out.
    assert sorted(os.listdir(mnt / "__views__/npy")) == ["output_norm.weight.npy", "token_embd.weight.npy"]
    for t in reader.tensors[:2]:
        assert np.array_equal(np.load(mnt / "__views__/npy" / (t.name + ".npy")),
                              t.data.reshape([int(n) for n in reversed(t.shape)])), t.name


def test_a_read_only_gguf_mount_refuses_every_edit_with_erofs(tmp_path, mount, run):
    path = tmp_path / "tiny.gguf"
    write_model(path)
    before = path.read_bytes()
    mnt = pathlib.Path(mount(path, "-o", "ro").path)
    for attempt in (
        lambda: (mnt / "__kv__/general.name").write_text("other"),
        lambda: (mnt / "__kv__/new.key").write_text("x"),
        lambda: os.unlink(mnt / "__kv__/general.name"),
        lambda: (mnt / "token_embd.weight").write_bytes(b"\0" * 96),
        lambda: os.unlink(mnt / "output_norm.weight"),
        lambda: os.rename(mnt / "output_norm.weight", mnt / "x"),
        lambda: (mnt / "new.meta.json").write_text('{"dtype":"F32","shape":[1]}'),
        lambda: (mnt / "__metadata__.json").write_text("{}"),
    ):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    assert run("status", mnt).stdout.startswith(f"{path}: no changes")
    assert path.read_bytes() == before
    # A second, writable mount says that another mount has the file.
    again = mount(path)
    assert "also mounted at" in again.result.stderr, again.result.stderr


def test_long_templates_big_vocabularies_and_awkward_names(tmp_path, mount):
    """A 100 KB template and a 50,000-token vocabulary read back whole; a tensor named
    __kv__ keeps its bytes under its escaped name, as __views__ does."""
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    template = "".join(f"{{% if i == {i} %}}line {i} ünï\n{{% endif %}}" for i in range(2500))
    assert len(template.encode()) > 100_000
    w.add_chat_template(template)
    tokens = [f"tok{i}" for i in range(50_000)]
    w.add_token_list(tokens)
    w.add_array("test.floats", [0.5, 1.25, -2.0])
    w.add_float32("test.scale", 0.1)
    w.add_bool("test.flag", True)
    w.add_int64("test.big", -(2**40))
    w.add_float32("test.tiny", 1e-45)
    w.add_float64("test.huge", 1e300)
    w.add_float32("test.two", 2.0)
    w.add_float32("test.nan", float("nan"))
    w.add_float64("test.ninf", float("-inf"))
    w.add_tensor("__kv__", np.arange(4, dtype=np.float32))
    w.add_tensor("a/b", np.arange(2, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mnt = pathlib.Path(mount(path).path)
    kv = mnt / "__kv__"
    assert (kv / "tokenizer.chat_template").read_text() == template + "\n"
    assert json.loads((kv / "tokenizer.ggml.tokens").read_text()) == tokens
    assert (kv / "test.floats").read_text() == "[0.5,1.25,-2.0]\n"
    assert (kv / "test.scale").read_text() == "0.1\n"
    # Floats as in JSON, shortest; NaN and the infinities, which JSON lacks, as text.
    for key, text in [("test.tiny", "1e-45"), ("test.huge", "1e+300"), ("test.two", "2.0"),
                      ("test.nan", "NaN"), ("test.ninf", "-inf")]:
        assert (kv / key).read_text() == text + "\n", key

    assert (kv / "test.flag").read_text() == "true\n"
    assert (kv / "test.big").read_text() == f"{-(2**40)}\n"
    shown = json.loads((mnt / "__metadata__.json").read_text())
    assert shown["tokenizer.ggml.tokens"]["value"] == tokens
    assert shown["test.scale"] == {"type": "FLOAT32", "value": 0.1}
    assert shown["test.huge"]["value"] == 1e300 and shown["test.nan"]["value"] == "NaN" and shown["test.ninf"]["value"] == "-inf"
    assert (mnt / "%5F_kv__").read_bytes() == np.arange(4, dtype=np.float32).tobytes()
    assert (mnt / "a%2Fb").read_bytes() == np.arange(2, dtype=np.float32).tobytes()


# --- Verdict parity with ggml's own C reader ----------------------------------------------

def test_verdicts_match_ggml_c_reader_on_every_bent_byte_and_cut(tmp_path, run):
    """stfs accepts exactly the files llama.cpp accepts when it loads a model (its C
    reader, then every tensor inside the file): two valid files (alignment 32 and 64,
    whose last tensor then has padding a cut can take away), every byte of their headers
    set to 0, 0xff, flipped in its lowest bit and incremented, and each cut at every
    third byte (about 5,000 files)."""
    if not GGML_LIB.exists():
        if os.environ.get("CI") and os.getuid() == 0:
            pytest.fail(f"{GGML_LIB} is missing: scripts/setup installs it (npm, node-llama-cpp)")
        pytest.skip("llama.cpp's libggml-base.so is not installed (scripts/setup, with npm)")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    files = []
    for alignment in (None, 64):
        good = tmp_path / f"ok{alignment}.gguf"
        write_model(good, alignment)
        data = good.read_bytes()
        data_start = gguf.GGUFReader(str(good)).data_offset
        files.append(good)
        for i in range(data_start):
            for v in {0, 0xFF, data[i] ^ 1, (data[i] + 1) & 0xFF} - {data[i]}:
                f = corpus / f"a{alignment}_byte{i}_{v}.gguf"
                f.write_bytes(data[:i] + bytes([v]) + data[i + 1:])
                files.append(f)
        for n in range(0, len(data), 3):
            f = corpus / f"a{alignment}_cut{n}.gguf"
            f.write_bytes(data[:n])
            files.append(f)
    theirs = ggml_verdicts(files)
    p = run("verify", *files)
    ours = {line.split(": ok")[0] for line in p.stdout.splitlines() if ": ok" in line}
    differ = [(str(f), theirs[str(f)]) for f in files if theirs[str(f)] != (str(f) in ours)]
    assert not differ, f"{len(differ)} verdicts differ (file, ggml accepts): {differ[:10]}"
    # Both accept some bent files (a byte of a name or a value) and refuse most of the rest.
    accepted = sum(theirs.values())
    assert 2 < accepted < len(files) - 1000, accepted


def write_split(folder, parts_of=2, tensors=5):
    """A GGUF file split by gguf-py (`-0000k-of-0000n.gguf`), `parts_of` tensors a part."""
    w = gguf.GGUFWriter(str(folder / "model.gguf"), "llama", split_max_tensors=parts_of)
    w.add_name("split")
    w.add_chat_template("{{ messages }}")
    arrays = {f"blk.{i}.w": np.full((2, 4), i, np.float32) for i in range(tensors)}
    for name, a in arrays.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_a_folder_of_split_gguf_parts_mounts_as_shards(tmp_path, mount, run):
    folder = tmp_path / "split"
    folder.mkdir()
    arrays = write_split(folder)
    parts = sorted(p.name for p in folder.iterdir())
    assert parts == [f"model-0000{k}-of-00003.gguf" for k in (1, 2, 3)]
    m = mount(folder)
    mnt = pathlib.Path(m.path)
    assert sorted(os.listdir(mnt)) == [p[:-len(".gguf")] for p in parts]
    seen = {}
    for part in parts:
        shard = mnt / part[:-len(".gguf")]
        reader = gguf.GGUFReader(str(folder / part))
        keys = [k for k in reader.fields if not k.startswith("GGUF.")]
        assert sorted(os.listdir(shard / "__kv__")) == sorted(keys)
        assert (shard / "__kv__/split.no").read_text() == f"{parts.index(part)}\n"
        assert sorted(json.loads((shard / "__metadata__.json").read_text())) == sorted(keys)
        for t in reader.tensors:
            seen[t.name] = (shard / t.name).read_bytes()
            assert seen[t.name] == t.data.tobytes()
    assert seen == {k: v.tobytes() for k, v in arrays.items()}
    # The views of each part: __views__/PART.gguf and npy/PART.
    assert sorted(os.listdir(mnt / "__views__")) == sorted(parts + ["npy"])
    for part in parts:
        assert (mnt / "__views__" / part).read_bytes() == (folder / part).read_bytes(), part
    first = parts[0][:-len(".gguf")]
    assert (mnt / first / "__kv__/general.name").read_text() == "split\n"
    assert np.array_equal(np.load(mnt / "__views__/npy" / first / "blk.0.w.npy"), arrays["blk.0.w"])
    v = run("verify", folder)
    assert v.returncode == 0 and v.stdout.count(": ok (GGUF v3") == 3, v.stdout
    # Beside safetensors files, GGUF files are not shown, and the mount says so.
    from safetensors.numpy import save_file
    save_file({"x": np.ones(2, np.float32)}, str(folder / "other.safetensors"))
    m2 = mount(folder)
    assert "3 *.gguf files not shown" in m2.result.stderr, m2.result.stderr
    assert os.listdir(m2.path) == ["other"]
    # A .safetensors file that holds GGUF among safetensors shards: refused, both named.
    os.rename(folder / parts[0], folder / "sneaky.safetensors")
    m3 = mount(folder, expect_ok=False)
    said = m3.result.stderr
    assert not m3.ok and "sneaky.safetensors is GGUF but other.safetensors is safetensors" in said, said
    assert "a folder mount shows one format" in said


def test_listings_of_many_tensors_resume_where_they_stopped(tmp_path, mount):
    """700 tensors: 1,402 entries, more than one getdents buffer holds, so the listing
    resumes at offsets (__metadata__.json 3, __kv__ 4, tensors from 5): every name once."""
    path = tmp_path / "many.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("many")
    names = [f"blk.{i}.a_rather_long_name_to_fill_the_buffer.weight" for i in range(700)]
    for i, n in enumerate(names):
        w.add_tensor(n, np.full(2, i, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mnt = pathlib.Path(mount(path).path)
    listed = [e.name for e in os.scandir(mnt)]
    expected = ["__metadata__.json", "__kv__"] + [x for n in names for x in (n, n + ".meta.json")]
    assert listed == expected
    ls = subprocess.run(["ls", "-1U", str(mnt)], capture_output=True, text=True, check=True).stdout.split()
    assert ls == expected


def test_what_stfs_cannot_show_is_refused_at_mount_naming_the_rule(tmp_path, mount, run):
    """A tensor name that is not UTF-8 (ggml accepts it) cannot become a file name without
    being mixed up with others: the mount refuses it, naming the tensor; verify still says
    ok, as ggml does. A .gguf file that is not GGUF is refused as GGUF."""
    path = tmp_path / "bytes.gguf"
    write_model(path)
    data = bytearray(path.read_bytes())
    at = data.index(b"output_norm.weight")
    data[at] = 0xFF
    path.write_bytes(bytes(data))
    v = run("verify", path)
    assert v.returncode == 0, v.stdout + v.stderr
    m = mount(path, expect_ok=False)
    assert not m.ok
    assert "tensor \"\ufffdutput_norm.weight\": the name is not UTF-8" in m.result.stderr, m.result.stderr
    assert str(path) in m.result.stderr
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGU")
    for p in (run("verify", fake), mount(fake, expect_ok=False).result):
        assert p.returncode != 0 and 'not a GGUF file (no "GGUF" magic at its start)' in p.stdout + p.stderr, \
            p.stdout + p.stderr


def test_prefetch_of_a_gguf_mount_takes_the_tensors_and_skips_the_keys(tmp_path, mount, run):
    path = tmp_path / "tiny.gguf"
    write_model(path)
    m = mount(path)
    p = run("prefetch", m.path)
    assert p.returncode == 0, p.stderr
    assert "__kv__" not in p.stdout + p.stderr
    assert p.stdout.count("token_embd.weight") == 1, p.stdout


def ggml_string(path, key):
    """The string value of `key` as llama.cpp's C reader reads it from `path`."""
    import ctypes
    lib = ctypes.CDLL(str(GGML_LIB))

    class InitParams(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, InitParams]
    lib.gguf_find_key.restype = ctypes.c_int64
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_get_val_str.restype = ctypes.c_char_p
    lib.gguf_get_val_str.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    g = lib.gguf_init_from_file(str(path).encode(), InitParams(True, None))
    assert g, f"ggml refuses {path}"
    try:
        k = lib.gguf_find_key(g, key.encode())
        assert k >= 0, key
        return lib.gguf_get_val_str(g, k).decode()
    finally:
        lib.gguf_free(g)


@pytest.mark.parametrize("alignment,trailing", [(None, b""), (64, b""), (None, b"extra")])
def test_the_gguf_view_is_the_file_as_readers_read_it(tmp_path, mount, alignment, trailing):
    """__views__/model.gguf: the file byte for byte (keys, tensor infos, each tensor
    padded with zeros to the alignment), read back by gguf-py and by llama.cpp's reader
    through the mount. Bytes after the last tensor (which ggml accepts) are not part of
    it: that view is made by the daemon, not passed through to the file."""
    path = tmp_path / "tiny.gguf"
    write_model(path, alignment)
    data = path.read_bytes()
    with open(path, "ab") as f:
        f.write(trailing)
    mnt = pathlib.Path(mount(path).path)
    view = mnt / "__views__/model.gguf"
    assert view.stat().st_size == len(data)
    assert view.read_bytes() == data
    # Read in odd pieces, across the padding between tensors.
    got = bytearray()
    with open(view, "rb") as f:
        while chunk := f.read(37):
            got += chunk
    assert bytes(got) == data
    reader = gguf.GGUFReader(str(view))
    assert [t.name for t in reader.tensors] == [t.name for t in gguf.GGUFReader(str(path)).tensors]
    if GGML_LIB.exists():
        assert ggml_string(view, "tokenizer.chat_template") == reader_value(reader.fields["tokenizer.chat_template"])


def write_gguf_with_a_huge_name(path, name_len):
    """A valid GGUF file (one F32 tensor) whose general.name is `name_len`
    NUL bytes, written without holding them in memory."""
    def s(b):
        return struct.pack("<Q", len(b)) + b
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 1, 2))
        f.write(s(b"general.architecture") + struct.pack("<I", 8) + s(b"llama"))
        f.write(s(b"general.name") + struct.pack("<I", 8) + struct.pack("<Q", name_len))
        chunk = b"\0" * (8 << 20)
        left = name_len
        while left:
            f.write(chunk[:min(left, len(chunk))])
            left -= min(left, len(chunk))
        f.write(s(b"w") + struct.pack("<I", 1) + struct.pack("<q", 4) + struct.pack("<IQ", 0, 0))
        f.write(b"\0" * ((-f.tell()) % 32))
        f.write(np.arange(4, dtype=np.float32).tobytes())


def test_a_key_of_half_a_gigabyte_costs_the_daemon_no_memory(tmp_path, mount, run):
    """A valid GGUF file whose general.name is 512 MiB of NULs (each six bytes
    of JSON): the daemon once held the name at mount and grew past 4 GiB when
    a co-user read __metadata__.json. Its memory (beyond its mappings) stays
    small; __metadata__.json and __kv__/general.name are refused (EFBIG), the
    tensors read, and a tensor edit still commits."""
    path = tmp_path / "huge.gguf"
    write_gguf_with_a_huge_name(path, 512 << 20)
    m = mount(path)
    mnt = pathlib.Path(m.path)

    def anon_mib():
        status = open(f"/proc/{m.pid}/status").read()
        return int(re.search(r"RssAnon:\s+(\d+) kB", status).group(1)) >> 10

    assert anon_mib() < 256
    for name in ("__metadata__.json", "__kv__/general.name"):
        with pytest.raises(OSError) as e:
            (mnt / name).read_bytes()
        assert e.value.errno == errno.EFBIG, name
    assert (mnt / "__kv__/general.architecture").read_text() == "llama\n"
    assert np.frombuffer((mnt / "w").read_bytes(), np.float32).tolist() == [0, 1, 2, 3]
    assert anon_mib() < 256
    with open(mnt / "w", "r+b") as f:
        f.write(np.float32(7).tobytes())
    assert run("commit", m.path).returncode == 0
    assert anon_mib() < 1024  # (a commit holds the header it writes)
