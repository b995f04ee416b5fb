"""Asks ggml's own GGUF reader (gguf_init_from_file in libggml-base.so, as llama.cpp
ships it) whether it accepts each file named on the command line. Prints one line per
file, `1` (accepted) or `0` (refused) and the path, flushed at once: a crash of the C
reader shows as the file after the last line. Usage: ggml_verdicts.py LIB FILE..."""

import ctypes
import sys


class InitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]


def main():
    lib = ctypes.CDLL(sys.argv[1])
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, InitParams]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.ggml_free.argtypes = [ctypes.c_void_p]
    for path in sys.argv[2:]:
        ctx = ctypes.c_void_p()
        # no_alloc false: the tensors' data are read too, as llama.cpp needs them.
        g = lib.gguf_init_from_file(path.encode(), InitParams(False, ctypes.pointer(ctx)))
        if g:
            lib.gguf_free(g)
        if ctx:
            lib.ggml_free(ctx)
        print(f"{1 if g else 0} {path}", flush=True)


if __name__ == "__main__":
    main()
