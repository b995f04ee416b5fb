"""Load tensors from a stfs mount straight into GPU memory.

    from stfs import cuda
    t = cuda.load("/mnt/w/lm_head.weight", device=0)   # a torch tensor on cuda:0
    a = cuda.load_cupy("/mnt/w/lm_head.weight")        # or a CuPy array

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
    import torch  # type: ignore[import-not-found]
    arr = load_cupy(path, device)
    p = arr._stfs_keepalive[0]
    t = torch.utils.dlpack.from_dlpack(arr.toDlpack())
    if p.dtype in TORCH_DTYPES:
        t = t.view(getattr(torch, TORCH_DTYPES[p.dtype])).reshape(p.shape)
    t._stfs_keepalive = arr
    return t


if __name__ == "__main__":  # python -m stfs.cuda PATH...: page-cache prefetch
    for path in sys.argv[1:]:
        p = prefetch(path, "cpu")
        print(f"{path}: {p.bytes} of {p.nbytes} bytes resident, {p.dtype} {p.shape}")
