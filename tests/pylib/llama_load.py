"""Loads a GGUF model with llama.cpp itself (libllama, as node-llama-cpp ships it) and
prints the chat template it reports (`llama_model_chat_template`) as JSON, or exits 1
if llama.cpp refuses the model. Run in its own process: a refusal may abort.
Usage: llama_load.py BINS_DIR MODEL.gguf"""

import ctypes
import json
import os
import sys


class ModelParams(ctypes.Structure):
    # Opaque and larger than llama_model_params: the defaults come back through memory
    # and go back as they came (x86-64 passes and returns a struct this size in memory),
    # so its layout need not be known here.
    _fields_ = [("raw", ctypes.c_char * 512)]


def main():
    bins, model = sys.argv[1], sys.argv[2]
    ggml = ctypes.CDLL(os.path.join(bins, "libggml.v0.4.0.so"), mode=ctypes.RTLD_GLOBAL)
    llama = ctypes.CDLL(os.path.join(bins, "libllama.v0.4.0.so"), mode=ctypes.RTLD_GLOBAL)
    ggml.ggml_backend_load_all_from_path(bins.encode())
    llama.llama_backend_init()
    llama.llama_model_default_params.restype = ModelParams
    llama.llama_model_load_from_file.restype = ctypes.c_void_p
    llama.llama_model_load_from_file.argtypes = [ctypes.c_char_p, ModelParams]
    llama.llama_model_chat_template.restype = ctypes.c_char_p
    llama.llama_model_chat_template.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    llama.llama_model_meta_val_str.restype = ctypes.c_int32
    llama.llama_model_meta_val_str.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    m = llama.llama_model_load_from_file(model.encode(), llama.llama_model_default_params())
    if not m:
        sys.exit(1)
    buf = ctypes.create_string_buffer(256)
    n = llama.llama_model_meta_val_str(m, b"general.name", buf, len(buf))
    print(json.dumps({
        "template": llama.llama_model_chat_template(m, None).decode(),
        "name": buf.value.decode() if n >= 0 else None,
    }))


if __name__ == "__main__":
    main()
