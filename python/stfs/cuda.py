"""Load tensors from a stfs mount straight into GPU memory.

    from stfs import cuda
    tensors = cuda.load_all("/mnt/w", device=0)        # every tensor, one arena
    for name, t in cuda.load_iter("/mnt/w", names=["lm_head.weight"]):
        ...                                            # each as soon as it lands
    t = cuda.load("/mnt/w/lm_head.weight", device=0)   # one tensor, its own buffer
    a = cuda.load_cupy("/mnt/w/lm_head.weight")        # or a CuPy array

`load_all` and `load_iter` make one load (STFS_IOC_LOAD, include/stfs.h): the
daemon plans every tensor's bytes across the mount's files, makes one device
allocation (the arena) with each tensor at a 256-byte-aligned offset, and
streams the bytes into it through its pool of pinned slabs. This process opens
the arena once (one CUDA IPC mapping) and every tensor is a view into it.
Lifetime: the arena lives as long as any tensor of the load does (each keeps
the load, and so the daemon's descriptor, alive); `.clone()` what you keep
longer than the rest, or the whole arena stays.

The daemon reads the tensor's bytes into pinned host slabs and copies them to a
device buffer (STFS_IOC_PREFETCH, include/stfs.h); this module opens that
buffer with its CUDA IPC handle, zero-copy, and gives it the tensor's dtype and
shape. The buffer lives while the returned object holds the file open: keep the
tensor (or call .clone()) as long as you need it.

`prefetch(path, target, device)` is the raw ioctl, usable without a GPU
(target "cpu" brings the tensor into the page cache).
"""

from __future__ import annotations

import builtins
import ctypes
import fcntl
import json
import os
import struct
import sys
from typing import Any, Callable, Literal

Target = Literal["cpu", "cuda"]

SIZE = 520
TARGET_PAGE_CACHE, TARGET_CUDA = 0, 1
# _IOWR('s', 1, struct stfs_prefetch): (3 << 30) | (520 << 16) | ('s' << 8) | 1
IOC_PREFETCH = (3 << 30) | (SIZE << 16) | (ord("s") << 8) | 1
_LAYOUT = struct.Struct("<IIii5Q64s16sII16Q3Q224s")
assert _LAYOUT.size == SIZE

NUMPY_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
                "I32": "int32", "U32": "uint32", "F32": "float32", "C64": "complex64", "F64": "float64",
                "I64": "int64", "U64": "uint64"}
TORCH_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu"}


def _torch() -> Any:
    """torch, imported where a function needs it (the package works without it)."""
    import torch  # type: ignore[import-not-found]
    return torch


class Prefetched:
    """The daemon's answer. `fd` keeps a CUDA buffer alive until close()."""

    size: int
    target: int
    device: int
    result: int
    bytes: int
    nbytes: int
    elapsed_ns: int
    ipc_offset: int
    alloc_size: int
    ipc_handle: builtins.bytes
    shape: list[int]
    offset: int
    length: int
    next: int
    dtype: str
    message: str
    fd: int | None

    def __init__(self, fd: int | None, fields: tuple[Any, ...]) -> None:
        (self.size, self.target, self.device, self.result, self.bytes, self.nbytes, self.elapsed_ns,
         self.ipc_offset, self.alloc_size, self.ipc_handle, dtype, ndim, _, *rest) = fields
        self.shape = list(rest[:ndim])
        self.offset, self.length, self.next = rest[16:19]
        self.dtype = dtype.split(b"\0")[0].decode()
        self.message = rest[19].split(b"\0")[0].decode()
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


def _ask(fd: int, target: Target, device: int, offset: int, size: int) -> Prefetched:
    buf = bytearray(_LAYOUT.pack(size, TARGET_CUDA if target == "cuda" else TARGET_PAGE_CACHE, device, 0,
                                 0, 0, 0, 0, 0, b"", b"", 0, 0, *([0] * 16), offset, 0, 0, b""))
    fcntl.ioctl(fd, IOC_PREFETCH, buf, True)
    # (The descriptor is the caller's: an answer owns it only once returned.)
    return Prefetched(None, _LAYOUT.unpack(bytes(buf)))


def prefetch(path: str | os.PathLike[str], target: Target = "cpu", device: int = 0,
             size: int = SIZE) -> Prefetched:
    """Sends STFS_IOC_PREFETCH on `path` (for the page cache, a range at a
    time until the whole tensor is in). Raises OSError with the daemon's errno
    and message on failure. `size` is for testing the daemon's size check."""
    fd = os.open(path, os.O_RDONLY)
    try:
        p = _ask(fd, target, device, 0, size)
        resident = p.bytes
        while p.result == 0 and target != "cuda" and p.next < p.nbytes:
            offset = p.next
            p = _ask(fd, target, device, offset, size)
            resident += p.bytes
            if p.result == 0 and p.next <= offset:
                raise OSError(f"{path}: prefetch made no progress at byte {offset}")
        p.bytes = resident if target != "cuda" else p.bytes
    except BaseException:
        os.close(fd)
        raise
    if p.result != 0 or target != "cuda":
        os.close(fd)
        if p.result != 0:
            raise OSError(p.result, f"{path}: {p.message}")
        return p
    p.fd = fd  # keeps the daemon's CUDA buffer alive until closed
    return p


def _open_ipc(p: Prefetched) -> tuple[int, Callable[[], Any]]:
    """Opens the IPC handle in this process; returns (device pointer, closer)."""
    cuda = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(f"{what} failed: CUresult {rc}")

    check(cuda.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), p.device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    handle = (ctypes.c_char * 64).from_buffer_copy(p.ipc_handle)
    ptr = ctypes.c_uint64()
    open_fn = getattr(cuda, "cuIpcOpenMemHandle_v2", None) or cuda.cuIpcOpenMemHandle
    # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1; the handle struct is passed by value.
    open_fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_char * 64, ctypes.c_uint]
    check(open_fn(ctypes.byref(ptr), handle, 1), "cuIpcOpenMemHandle")
    return ptr.value + p.ipc_offset, lambda: cuda.cuIpcCloseMemHandle(ctypes.c_uint64(ptr.value))


def load_cupy(path: str | os.PathLike[str], device: int = 0) -> Any:
    """The tensor as a CuPy array on `device` (raw uint8 bytes for dtypes numpy lacks)."""
    import cupy  # type: ignore[import-not-found]
    p = prefetch(path, "cuda", device)
    ptr, close = _open_ipc(p)
    dtype = NUMPY_DTYPES.get(p.dtype)
    shape = p.shape if dtype else [p.nbytes]
    mem = cupy.cuda.UnownedMemory(ptr, p.nbytes, p)  # p keeps the daemon's buffer alive
    arr = cupy.ndarray(shape, dtype=dtype or "uint8", memptr=cupy.cuda.MemoryPointer(mem, 0))
    arr._stfs_keepalive = (p, close)
    return arr


def load(path: str | os.PathLike[str], device: int = 0) -> Any:
    """The tensor as a torch tensor on cuda:`device`, with its dtype and shape."""
    torch = _torch()
    arr = load_cupy(path, device)
    p = arr._stfs_keepalive[0]
    t = torch.utils.dlpack.from_dlpack(arr.toDlpack())
    if p.dtype in TORCH_DTYPES:
        t = t.view(getattr(torch, TORCH_DTYPES[p.dtype])).reshape(p.shape)
    t._stfs_keepalive = arr
    return t


# ---- many tensors into one arena: STFS_IOC_LOAD ----

LOAD_SIZE = 16376
IOC_LOAD = (3 << 30) | (LOAD_SIZE << 16) | (ord("s") << 8) | 5
_LOAD = struct.Struct("<IIQIiIIiI11Q64s16184s")
assert _LOAD.size == LOAD_SIZE
TARGET_HOST = 2
OP_NAMES, OP_GLOB, OP_START, OP_POLL, OP_TABLE, OP_FREE = range(1, 7)
LOAD_THROUGH_SLABS = 1
_LOAD_FIELDS = ("size", "op", "id", "target", "device", "flags", "wait_ms", "result", "done", "tensors", "bytes",
                "landed_tensors", "landed_bytes", "arena_size", "elapsed_ns", "slabs_made", "slabs_freed",
                "live_arenas", "offset", "total", "handle", "text")
_PAGE = 16000  # names sent per request (the text field holds 16184 bytes)


def _mount_root(path: str) -> str:
    """The mount point of the stfs mount `path` lies in."""
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        parent = os.path.dirname(path)
        if parent == path:
            raise OSError(f"{path}: not in a stfs mount")
        path = parent
    return path


def _ask_load(fd: int, op: int, text: builtins.bytes = b"", **fields: int) -> dict[str, Any]:
    values: dict[str, Any] = dict.fromkeys(_LOAD_FIELDS, 0)
    values.update(size=LOAD_SIZE, op=op, handle=b"", text=text, **fields)
    buf = bytearray(_LOAD.pack(*(values[f] for f in _LOAD_FIELDS)))
    fcntl.ioctl(fd, IOC_LOAD, buf, True)
    got = dict(zip(_LOAD_FIELDS, _LOAD.unpack(builtins.bytes(buf))))
    if op != OP_TABLE:
        got["text"] = got["text"].split(b"\0")[0].decode(errors="replace")
    if got["result"] != 0:
        raise OSError(got["result"], got["text"] or os.strerror(got["result"]))
    return got


def daemon_counts(mount: str | os.PathLike[str]) -> dict[str, int]:
    """The daemon's `slabs_made` and `slabs_freed` (since it started: a
    pool's slabs are freed once it has been idle for the mount's
    load_idle_s) and `live_arenas` (now)."""
    fd = os.open(mount, os.O_RDONLY)
    try:
        got = _ask_load(fd, OP_POLL)
    finally:
        os.close(fd)
    return {k: got[k] for k in ("slabs_made", "slabs_freed", "live_arenas")}


class Load:
    """One STFS_IOC_LOAD: the tensors of `mount` named by `names` (exact
    tensor names), `glob` (a shell pattern), or all of them, loaded into
    one arena on `device` (a CUDA ordinal, or "host": the daemon's memory,
    for tests). Started at once; `poll` sees them land; `close` (or the
    last reference going) frees the arena. `through_slabs`: copy every
    chunk through the daemon's slabs even where the arena is host memory
    it could read into (tests of the path a GPU takes)."""

    def __init__(self, mount: str | os.PathLike[str], device: int | str = 0,
                 names: list[str] | None = None, glob: str | None = None, through_slabs: bool = False) -> None:
        self.fd: int | None = os.open(mount, os.O_RDONLY)
        self._close_ipc: Callable[[], Any] | None = None
        self._table: list[dict[str, Any]] | None = None
        self.device = device
        try:
            if names is not None:
                self._send_names(names)
            elif glob is not None:
                self._ask(OP_GLOB, text=glob.encode())
            target = TARGET_HOST if device == "host" else TARGET_CUDA
            self.state = self._ask(OP_START, target=target, device=0 if device == "host" else int(device),
                                   flags=LOAD_THROUGH_SLABS if through_slabs else 0)
            self.id = self.state["id"]
        except BaseException:
            self.close()
            raise

    def _ask(self, op: int, text: builtins.bytes = b"", **fields: int) -> dict[str, Any]:
        if self.fd is None:
            raise ValueError("the load is closed")
        return _ask_load(self.fd, op, text, id=getattr(self, "id", 0), **fields)

    def _send_names(self, names: list[str]) -> None:
        if not names:
            raise ValueError("no tensor names given")
        page = b""
        for name in names:
            item = name.encode() + b"\0"
            if len(item) > _PAGE:
                raise ValueError(f"a tensor name of {len(item)} bytes")
            if len(page) + len(item) > _PAGE:
                self._ask(OP_NAMES, text=page)
                page = b""
            page += item
        self._ask(OP_NAMES, text=page)

    def poll(self, wait_ms: int = 0) -> dict[str, Any]:
        """How far it got, after waiting up to `wait_ms` (at most 1000) for
        more: the first `landed_tensors` of `table()` are in place; `done`
        once all are. Raises OSError (naming the tensor) if it failed."""
        self.state = self._ask(OP_POLL, wait_ms=min(wait_ms, 1000))
        return self.state

    def wait(self) -> dict[str, Any]:
        while not self.poll(200)["done"]:
            pass
        return self.state

    def table(self) -> list[dict[str, Any]]:
        """Each tensor, in the order they land: name, offset (in the arena),
        nbytes, dtype, shape."""
        if self._table is None:
            text, offset = b"", 0
            while True:
                page = self._ask(OP_TABLE, offset=offset)
                chunk = page["text"].split(b"\0")[0]
                text += chunk
                offset += len(chunk)
                if offset >= page["total"] or not chunk:
                    break
            self._table = [json.loads(line) for line in text.decode().splitlines() if line]
        return self._table

    def close(self) -> None:
        """Frees the arena: this process's mapping, then the daemon's."""
        if self._close_ipc is not None:
            close, self._close_ipc = self._close_ipc, None
            close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.close()


def _names_and_mount(mount_or_paths: Any, names: list[str] | None) -> tuple[str, list[str] | None]:
    """A mount (or a folder in it) with `names`, or tensor files of one mount."""
    if isinstance(mount_or_paths, (str, os.PathLike)):
        path = os.fspath(mount_or_paths)
        if os.path.isdir(path):
            return _mount_root(path), names
        mount_or_paths = [path]
    paths = [os.fspath(p) for p in mount_or_paths]
    roots = {_mount_root(p) for p in paths}
    if len(roots) != 1:
        raise ValueError("the tensor files given are not all in one mount")
    return roots.pop(), [os.path.basename(p) for p in paths] + (names or [])


class _CudaArena:
    """The arena as torch sees device memory (__cuda_array_interface__);
    holds the load, so that every tensor viewing it keeps it alive."""

    def __init__(self, load: Load, ptr: int) -> None:
        self.load = load
        size = load.state["arena_size"]
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _open_arena(load: Load) -> Any:
    """The arena as one uint8 torch tensor on the load's device (one IPC open)."""
    torch = _torch()
    p = Prefetched(None, _LAYOUT.unpack(builtins.bytes(SIZE)))
    p.device, p.ipc_handle, p.ipc_offset = int(load.device), load.state["handle"], 0
    ptr, close = _open_ipc(p)
    load._close_ipc = close
    return torch.as_tensor(_CudaArena(load, ptr), device=f"cuda:{load.device}")


class _HostArena:
    """The host target's arena (tests): read from the daemon's memory through
    /proc/PID/mem (its own user and root only); `arena[a:b]` is a numpy copy."""

    def __init__(self, load: Load) -> None:
        self.load = load
        self.size = load.state["arena_size"]
        pid = struct.unpack_from("<i", load.state["handle"])[0]
        self.address = struct.unpack_from("<Q", load.state["handle"], 8)[0]
        self.fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)

    def __getitem__(self, at: slice) -> Any:
        import numpy as np
        start, stop, _ = at.indices(self.size)
        out = bytearray(max(stop - start, 0))
        done = 0
        while done < len(out):
            n = os.preadv(self.fd, [memoryview(out)[done:]], self.address + start + done)
            if n <= 0:
                raise OSError(f"reading the host arena at {start + done}")
            done += n
        return np.frombuffer(out, np.uint8)

    def __del__(self) -> None:
        os.close(self.fd)


def _host_arena(load: Load) -> Any:
    return _HostArena(load)


def _view(arena: Any, e: dict[str, Any]) -> Any:
    """Tensor `e` of the table as a view into `arena` (raw bytes for a dtype
    the framework lacks)."""
    raw = arena[e["offset"]:e["offset"] + e["nbytes"]]
    if hasattr(raw, "numpy"):  # torch
        torch = _torch()
        name = TORCH_DTYPES.get(e["dtype"]) or NUMPY_DTYPES.get(e["dtype"])
        dtype = getattr(torch, name, None) if name else None
        return raw.view(dtype).reshape(e["shape"]) if dtype is not None else raw
    dtype = NUMPY_DTYPES.get(e["dtype"])
    return raw.view(dtype).reshape(e["shape"]) if dtype else raw


def load_iter(mount_or_paths: Any, device: int | str = 0, names: list[str] | None = None,
              glob: str | None = None, through_slabs: bool = False) -> Any:
    """Yields (name, tensor) as each tensor lands in the arena, while the
    rest are still read: torch tensors on cuda:`device` (numpy copies of the
    daemon's memory for device="host", a test target). `mount_or_paths`: a
    mount (or a folder in it), or tensor files of one mount."""
    mount, chosen = _names_and_mount(mount_or_paths, names)
    load = Load(mount, device, names=chosen, glob=glob, through_slabs=through_slabs)
    arena = _host_arena(load) if device == "host" else _open_arena(load)
    table, given = load.table(), 0
    while given < len(table):
        landed = load.poll(200)["landed_tensors"]
        for e in table[given:landed]:
            yield e["name"], _view(arena, e)
        given = max(given, landed)


def load_all(mount_or_paths: Any, device: int | str = 0, names: list[str] | None = None,
             glob: str | None = None, through_slabs: bool = False) -> dict[str, Any]:
    """Every tensor of a mount (or those `names` or `glob` choose, or the
    tensor files given) as torch tensors on cuda:`device`, in one load: one
    device allocation, one IPC mapping, each tensor a view into it. The
    arena is freed once no tensor of the load is left (keep the dict, or
    `.clone()` what you keep). Raises OSError naming the tensor if a read
    failed (no tensor is handed out then)."""
    return dict(load_iter(mount_or_paths, device, names, glob, through_slabs))


if __name__ == "__main__":  # python -m stfs.cuda PATH...: page-cache prefetch
    for path in sys.argv[1:]:
        p = prefetch(path, "cpu")
        print(f"{path}: {p.bytes} of {p.nbytes} bytes resident, {p.dtype} {p.shape}")
