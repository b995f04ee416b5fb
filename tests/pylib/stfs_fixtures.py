"""What the integration tests (tests/integration/conftest.py builds its pytest
fixtures from it) and the benchmarks (scripts/bench_*.py) share:

- where the stfs binary is (`stfs_path`, `add_stfs_option` for a script's --stfs), and a
  benchmark's usual options (`bench_args`);
- `Mount`: a mount made with `stfs mount --pid-file --log-file`, and its cleanup
  (`stfs umount`, then `umount -l` as a last resort, only of the mount it made;
  then it waits for the daemon it started to exit, killing it by pid if it hangs);
- checkpoint writers: with the official `safetensors` package and, for dtypes or
  layouts it does not write (or a checkpoint too large to hold in memory), by hand;
  readers of a file's header, and the checks of a committed checkpoint;
- timing (`timed`), `dd`, and a pwrite into a file (`write_at`);
- /proc readers: a field of /proc/PID/status or /proc/meminfo in KiB, the bytes a
  process has written (/proc/PID/io), a file's bytes in the page cache (fincore).

Scripts import it after one line: sys.path.insert(0, .../tests/pylib)."""

import argparse
import json
import os
import pathlib
import signal
import struct
import subprocess
import time

import numpy as np
from safetensors import TensorSpec, safe_open, serialize_file
from safetensors.numpy import load_file, save_file

ROOT = pathlib.Path(__file__).resolve().parents[2]
MIB = 1 << 20


# -- the binary ----------------------------------------------------------------------------------

def stfs_path():
    """The stfs binary: $STFS, or the release build of this checkout."""
    return os.environ.get("STFS") or str(ROOT / "target" / "release" / "stfs")


def add_stfs_option(parser):
    """A script's --stfs option (default: `stfs_path()`)."""
    parser.add_argument("--stfs", default=stfs_path(), help="the stfs binary (default: $STFS or %(default)s)")


def bench_args(doc, **options):
    """A benchmark's options, parsed: --stfs, --dir (where its files go, default /var/tmp),
    and a --NAME for each of `options`, NAME=default (of the default's type); `doc` is its --help."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stfs_option(p)
    p.add_argument("--dir", default="/var/tmp")
    for name, default in options.items():
        p.add_argument(f"--{name}", type=type(default), default=default)
    return p.parse_args()


# -- mounts --------------------------------------------------------------------------------------

class Mount:
    """A live stfs mount of `source` at `mountpoint`, an empty folder made for it; `close()`
    always leaves nothing behind there. The mount's outcome is `result` (a CompletedProcess,
    text mode) and `ok`; with `check`, a failed mount raises `Failed` (a CalledProcessError).
    A context manager: the mount is closed on leaving the block."""

    def __init__(self, stfs, source, mountpoint, options=(), log=None, check=False, timeout=None, env=None):
        self.stfs, self.source, self.path = str(stfs), str(source), str(mountpoint)
        self.log = log if log is not None else self.path + ".log"
        self.pid_file = str(self.log) + ".pid"
        self.pid = None
        cmd = [self.stfs, "mount", "--pid-file", self.pid_file, "--log-file", str(self.log), *map(str, options),
               self.source, self.path]
        self.result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                     env=None if env is None else {**os.environ, **env})
        if self.result.returncode == 0:
            with open(self.pid_file) as f:
                self.pid = int(f.read())
        elif check:
            raise Failed(self.result.returncode, cmd, self.result.stdout, self.result.stderr)

    @property
    def ok(self):
        return self.result.returncode == 0

    def is_mounted(self):
        with open("/proc/self/mountinfo") as f:
            return any(line.split()[4] == self.path for line in f)

    def status_kib(self, field):
        """A field of the daemon's /proc/PID/status, in KiB."""
        return status_kib(self.pid, field)

    def close(self, discard=False, check=False):
        """`stfs umount [--discard]` if still mounted, `umount -l` if that failed; then waits
        for the daemon to exit (killed by pid, and an error, if it hangs). With `check`, a
        failed `stfs umount` is an error too (raised once the mount is gone)."""
        failed = None
        if self.is_mounted():
            cmd = [self.stfs, "umount", *(["--discard"] if discard else []), self.path]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if p.returncode != 0:
                failed = Failed(p.returncode, cmd, p.stdout, p.stderr)
                if self.is_mounted():
                    subprocess.run(["umount", "-l", self.path], timeout=60)  # last resort
        if self.pid is not None:
            wait_for_exit(self.pid, 20)
        assert not self.is_mounted(), f"{self.path} is still mounted"
        if check and failed is not None:
            raise failed

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.close(check=exc_type is None)


class Failed(subprocess.CalledProcessError):
    """A command that failed, with what it printed in its message."""

    def __str__(self):
        return f"{super().__str__()}\n{self.stdout or ''}{self.stderr or ''}".rstrip()


def wait_for(done, what, seconds=60):
    """Waits until `done()` (something the daemon finishes in the background
    and says it did), failing with `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def wait_for_exit(pid, seconds):
    """Waits for a daemon we started to exit; kills it by pid if it hangs.

    The main thread turns zombie before the others have closed their
    descriptors (/dev/fuse among them): done when it is the last one left."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z" and len(os.listdir(f"/proc/{pid}/task")) <= 1:
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    raise AssertionError(f"stfs daemon {pid} did not exit after unmount; killed")


# -- timing and dd -------------------------------------------------------------------------------

def cuda_driver_present():
    """Whether libcuda can be loaded here (the tests of ENODEV skip then:
    scripts/gpu-check.sh covers such a machine)."""
    import ctypes
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def timed(fn):
    """Seconds `fn()` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def dd_read(path, skip=0, count=None):
    """dd of `count` bytes (default: to the end) of `path` from byte `skip` to /dev/null, 1 MiB blocks."""
    args = ["dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none", "iflag=skip_bytes,count_bytes", f"skip={skip}"]
    if count is not None:
        args.append(f"count={count}")
    subprocess.run(args, check=True)


def dd_write(path, nbytes, source="/dev/zero", fsync=True, notrunc=False):
    """dd of `nbytes` (whole MiB) from `source` into `path`, 1 MiB blocks; `fsync`: conv=fsync,
    `notrunc`: conv=notrunc (overwrites in place)."""
    assert nbytes % MIB == 0, nbytes
    conv = [c for c, on in (("notrunc", notrunc), ("fsync", fsync)) if on]
    subprocess.run(["dd", f"if={source}", f"of={path}", "bs=1M", f"count={nbytes // MIB}",
                    *([f"conv={','.join(conv)}"] if conv else []), "status=none"], check=True)


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_at(path, data, offset):
    """pwrite of `data` at `offset` into `path`, opened write-only (no truncation, no fsync)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


# -- /proc and the page cache --------------------------------------------------------------------

def status_kib(pid, field):
    """A field of /proc/PID/status (VmRSS, VmHWM, RssAnon, RssFile...), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/{pid}/status")


def meminfo_kib(field):
    """A field of /proc/meminfo (Cached: the page cache of the whole machine), in KiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"no {field} in /proc/meminfo")


def written_by(pid):
    """Bytes the process has caused to be written (write_bytes of /proc/PID/io; needs root
    for another user's process)."""
    with open(f"/proc/{pid}/io") as f:
        return int(next(line for line in f if line.startswith("write_bytes")).split()[1])


def resident(path):
    """Bytes of a file in the page cache, by util-linux fincore (independent of stfs)."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def drop_from_cache(path):
    """Writes back, then drops a file's pages from the page cache (POSIX_FADV_DONTNEED)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


# -- checkpoints ---------------------------------------------------------------------------------

# numpy dtypes the official numpy API writes, with their header names.
NUMPY_DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16,
    "F16": np.float16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "C64": np.complex64, "F64": np.float64, "I64": np.int64, "U64": np.uint64,
}

# Dtypes the official writer takes only as raw bytes (its TensorSpec names).
RAW_DTYPES = {
    "BF16": ("bfloat16", 16), "F8_E4M3": ("float8_e4m3fn", 8), "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8), "F8_E4M3FNUZ": ("float8_e4m3fnuz", 8),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 8), "F4": ("float4_e2m1fn_x2", 4),
}


def sample_array(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    t = NUMPY_DTYPES[dtype]
    if t is np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if np.issubdtype(t, np.integer):
        info = np.iinfo(t)
        return rng.integers(info.min, info.max, size=shape, dtype=t, endpoint=True)
    if t is np.complex64:
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(t)
    return rng.standard_normal(shape).astype(t)


def save_raw(path, raw, metadata=None, arrays=None):
    """Writes numpy arrays plus raw-byte tensors {name: (dtype, shape, bytes)}
    with the official writer's TensorSpec."""
    arrays = arrays or {}
    keep = []
    specs = {}
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        keep.append(a)
        specs[name] = TensorSpec(dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes)
    for name, (dtype, shape, data) in raw.items():
        buf = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, np.uint8)
        keep.append(buf)
        st_name, bits = RAW_DTYPES[dtype]
        # The F4 spec takes the packed storage shape (two values a byte).
        spec_shape = list(shape[:-1]) + [shape[-1] // 2] if dtype == "F4" else list(shape)
        specs[name] = TensorSpec(dtype=st_name, shape=spec_shape, data_ptr=buf.ctypes.data, data_len=len(data))
    serialize_file(specs, path, metadata=metadata)


def write_by_hand(path, entries, metadata=None, fill=None, fsync=False):
    """Writes a file the way the format describes it, for dtypes (F6_*) or layouts the
    official writer does not produce, or a checkpoint too large to hold in memory.
    entries: [(name, dtype, shape, data)] in file order, `data` the tensor's bytes, or,
    with `fill`, its length: `fill(length)` makes the bytes as the file is written (streamed,
    one tensor in memory at a time). The header is padded with spaces to 8 bytes, as the
    official writer pads it. Returns the header's length."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, data in entries:
        n = data if fill else len(data)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in entries:
            f.write(fill(data) if fill else data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return len(text)


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def tensor_bytes(path, name):
    """A tensor's bytes, read straight from the file by its header."""
    n, header = read_header(path)
    b, e = header[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(8 + n + b)
        return f.read(e - b)


def tensor_range(path, name):
    """(file offset, length) of a tensor's bytes."""
    n, header = read_header(path)
    b, e = header[name]["data_offsets"]
    return 8 + n + b, e - b


def mixed_checkpoint(path, seed=0):
    """Every numpy dtype, the raw dtypes, a scalar, a zero-size tensor, names
    that need escaping, and metadata. Returns the expected {name: bytes}."""
    arrays = {}
    for i, dtype in enumerate(NUMPY_DTYPES):
        arrays[f"model.layers.{i}.{dtype.lower()}"] = sample_array(dtype, (3, 5), seed + i)
    arrays["scalar"] = np.array(3.5, dtype=np.float32)
    arrays["empty"] = np.zeros((0, 7), dtype=np.float16)
    arrays["a/b/c"] = sample_array("U8", (4,), seed + 50)
    arrays["100%"] = sample_array("I16", (2,), seed + 51)
    arrays["x.meta.json"] = sample_array("F32", (2,), seed + 52)
    arrays["__metadata__.json"] = sample_array("U8", (3,), seed + 53)
    arrays["ünïcødé ✓"] = sample_array("F64", (2, 2), seed + 54)
    rng = np.random.default_rng(seed)
    raw = {}
    for dtype, (_, bits) in RAW_DTYPES.items():
        shape = (4, 6)
        raw[f"raw.{dtype}"] = (dtype, shape, rng.bytes(24 * bits // 8))
    save_raw(path, raw, metadata={"format": "np", "note": "stfs test"}, arrays=arrays)
    _, header = read_header(path)
    return {name: tensor_bytes(path, name) for name in header if name != "__metadata__"}


def base(path, metadata=None):
    """Three tensors written by the official package; returns them."""
    tensors = {
        "a": np.arange(8, dtype=np.float32),
        "b": np.arange(6, dtype=np.int64).reshape(2, 3),
        "c": np.ones(5, np.uint8),
    }
    save_file(tensors, str(path), metadata=metadata)
    return tensors


def two_shards(folder):
    """A folder of two shards (a: F16 [6], b: I64 [10]) and their index: (a, b, the index)."""
    folder.mkdir()
    a, b = np.arange(6, dtype=np.float16), np.arange(10, dtype=np.int64)
    save_file({"a": a}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(folder / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": a.nbytes + b.nbytes},
             "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return a, b, index


def mounted_base(tmp_path, mount, metadata=None):
    """base() written as tmp_path/m.safetensors (with `metadata`), mounted by the test's
    `mount` fixture: (source, tensors, mount)."""
    src = tmp_path / "m.safetensors"
    t = base(src, metadata=metadata)
    return src, t, mount(src)


def assert_checkpoint(path, expected, metadata=None, compact=False):
    """Loads with the official package and compares values and metadata, then the layout.

    With `compact` (a `stfs commit --compact`, or a file stfs never wrote), byte-identical to
    the package's save_file. Otherwise (a commit in place, or a rewrite that leaves room in
    the header): the header is save_file's JSON but for data offsets, then only spaces.
    """
    got = load_file(str(path))
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert got[k].tobytes() == v.tobytes(), k
    with safe_open(str(path), framework="np") as f:
        assert (f.metadata() or None) == (metadata or None)
    ref = str(path) + ".ref"
    save_file(expected, ref, metadata=metadata)
    try:
        if compact:
            assert open(path, "rb").read() == open(ref, "rb").read(), "not byte-identical to save_file"
        else:
            assert header_without_offsets(path) == header_without_offsets(ref)
    finally:
        os.unlink(ref)


def header_of(path):
    """(JSON header as a dict, header length, the header's bytes) of a safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        raw = f.read(n)
    text = raw.decode()
    end = text.rindex("}") + 1
    assert set(text[end:]) <= {" "}, f"{path}: not only spaces after the header's JSON"
    return json.loads(text[:end]), n, raw


def header_without_offsets(path):
    h, _, _ = header_of(path)
    return {k: ({f: x for f, x in v.items() if f != "data_offsets"} if k != "__metadata__" else v) for k, v in h.items()}


def sh(cmd, cwd=None, check=True):
    """Runs a shell command line; with `check`, a failure says what it printed."""
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd!r} failed ({p.returncode}): {p.stdout}{p.stderr}")
    return p


def committed(run, m):
    """`stfs commit` of mount `m`, which must succeed."""
    p = run("commit", m.path)
    assert p.returncode == 0, p.stderr
    return p


def assert_committed(run, ckpt, metadata, **changed):
    """Commits the mount of `ckpt` (source, tensors, mount), which must succeed, then checks
    the source (`assert_checkpoint`): those tensors with the `changed` ones put in, and `metadata`."""
    src, t, m = ckpt
    committed(run, m)
    assert_checkpoint(src, {**t, **changed}, metadata)
