"""Asks llama.cpp's own GGUF reader whether it accepts each file named on the command
line, as llama.cpp does when it loads a model: gguf_init_from_file (libggml-base.so, as
node-llama-cpp ships it) parses the keys and tensor infos, then every tensor's bytes
(offset + size, unpadded) must lie inside the file. Prints one line per file, `1`
(accepted) or `0` (refused) and the path, flushed at once: a crash of the C reader shows
as the file after the last line. Usage: ggml_verdicts.py LIB FILE..."""

import ctypes
import os
import sys


class InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def main():
    lib = ctypes.CDLL(sys.argv[1])
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, InitParams]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    lib.gguf_get_data_offset.restype = ctypes.c_size_t
    lib.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
    for f in (lib.gguf_get_tensor_offset, lib.gguf_get_tensor_size):
        f.restype = ctypes.c_size_t
        f.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    for path in sys.argv[2:]:
        g = lib.gguf_init_from_file(path.encode(), InitParams(True, None))
        ok = bool(g)
        if g:
            size, start = os.path.getsize(path), lib.gguf_get_data_offset(g)
            for i in range(lib.gguf_get_n_tensors(g)):
                if start + lib.gguf_get_tensor_offset(g, i) + lib.gguf_get_tensor_size(g, i) > size:
                    ok = False
            lib.gguf_free(g)
        print(f"{1 if ok else 0} {path}", flush=True)


if __name__ == "__main__":
    main()
