"""GGUF files for the tests and benchmarks, written by gguf-py (the `gguf` package, the
writer llama.cpp's converters use), and llama.cpp's own readers asked about them (the
libraries node-llama-cpp ships, which scripts/setup installs)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
BINS = pathlib.Path(os.environ.get(
    "STFS_LLAMA_BINS",
    REPO / "target/node-llama-cpp/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64"))
GGML_LIB = BINS / "libggml-base.so"


def write(path, fill):
    """A GGUF file at `path`: `fill(writer)` adds its keys and tensors."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_model(path, alignment=None):
    """A tiny GGUF: a template with newlines, a 3-token vocabulary, an F32 and an F16
    tensor, and Q8_0 and Q4_K blocks stored as raw bytes."""
    import gguf

    def fill(w):
        w.add_name("tiny")
        w.add_chat_template("{% for m in messages %}\n{{ m.content }}\n{% endfor %}")
        w.add_token_list(["<s>", "</s>", "hello"])
        w.add_eos_token_id(1)
        if alignment:
            w.add_custom_alignment(alignment)
        rng = np.random.default_rng(0)
        w.add_tensor("token_embd.weight", rng.standard_normal((3, 8)).astype(np.float32))
        w.add_tensor("output_norm.weight", np.ones(8, np.float16))
        w.add_tensor("blk.0.attn_q.weight", rng.integers(0, 255, (4, 2 * 34), dtype=np.uint8),
                     raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("blk.0.ffn_up.weight", rng.integers(0, 255, (2, 144), dtype=np.uint8),
                     raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    write(path, fill)


def write_tiny_llama(path, template, layers=2):
    """A model of a real architecture (llama) that llama.cpp loads: random F32 weights,
    32 tokens of a sentencepiece vocabulary, `layers` blocks."""
    n_vocab, n_embd, n_head, n_ff = 32, 32, 4, 64
    rng = np.random.default_rng(0)

    def weights(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def fill(w):
        w.add_name("tiny-llama")
        w.add_context_length(64)
        w.add_embedding_length(n_embd)
        w.add_block_count(layers)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head)
        w.add_rope_dimension_count(n_embd // n_head)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_file_type(0)
        w.add_tokenizer_model("llama")
        w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(n_vocab - 3)])
        w.add_token_scores([0.0] * n_vocab)
        w.add_token_types([2, 3, 3] + [1] * (n_vocab - 3))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_chat_template(template)
        w.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
        w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor("output.weight", weights(n_vocab, n_embd))
        for i in range(layers):
            w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
            for t in ("q", "k", "v", "output"):
                w.add_tensor(f"blk.{i}.attn_{t}.weight", weights(n_embd, n_embd))
            w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
            w.add_tensor(f"blk.{i}.ffn_gate.weight", weights(n_ff, n_embd))
            w.add_tensor(f"blk.{i}.ffn_up.weight", weights(n_ff, n_embd))
            w.add_tensor(f"blk.{i}.ffn_down.weight", weights(n_embd, n_ff))
    write(path, fill)


def rebuild(path, out):
    """What gguf-py's GGUFWriter writes for the keys and tensors of `path`, in its order."""
    import gguf
    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()

    def fill(w):
        for k, f in r.fields.items():
            if k.startswith("GGUF.") or k == "general.architecture":
                continue
            t = f.types[0]
            if t == gguf.GGUFValueType.ARRAY:
                w.add_key_value(k, f.contents(), t, sub_type=f.types[1])
            else:
                w.add_key_value(k, f.contents(), t)
        for t in r.tensors:
            plain = t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            w.add_tensor(t.name, np.array(t.data), raw_dtype=None if plain else t.tensor_type)
    w = gguf.GGUFWriter(str(out), arch)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def have_llama():
    return GGML_LIB.exists()


def ggml_verdicts(files):
    """{file: True (accepted) / False (refused)} by gguf_init_from_file, and every tensor
    inside the file (as llama.cpp loads a model). The C reader aborts on some files (an
    assertion on a failed allocation): that file counts as refused, and the rest are
    asked in a new process."""
    helper = REPO / "tests/pylib/ggml_verdicts.py"
    verdicts, rest = {}, list(map(str, files))
    while rest:
        p = subprocess.run([sys.executable, str(helper), str(GGML_LIB), *rest], capture_output=True, text=True)
        answered = [line.split(" ", 1) for line in p.stdout.splitlines() if line[:2] in ("0 ", "1 ")]
        verdicts.update((f, v == "1") for v, f in answered)
        rest = rest[len(answered):]
        if p.returncode != 0 and rest:
            verdicts[rest.pop(0)] = False
    return verdicts


def llama_load(path):
    """What llama.cpp reports of a model it loads ({"template", "name"}), or None if it
    refuses it."""
    p = subprocess.run([sys.executable, str(REPO / "tests/pylib/llama_load.py"), str(BINS), str(path)],
                       capture_output=True, text=True, timeout=120)
    return json.loads(p.stdout) if p.returncode == 0 else None
