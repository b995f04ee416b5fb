"""transformers loads a mounted model folder's views as it loads the folder:
a tiny Llama saved by save_pretrained in several shards, mounted; its
logits from `__views__/` equal the original's, after a tensor edit through
the mount they equal the edited model's, and a `cp -r` of the bf16 view
loads as bf16 with its config saying so. The oracle is transformers on the
original folder, never stfs. A config edit and the weights it names, made through
the mount, are committed as one change."""

import json
import os
import subprocess

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [[1, 5, 9, 42, 7, 3, 999, 0]]


def tiny_llama(folder):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="100KB")
    return model


def logits(model_or_path, **kw):
    model = model_or_path
    if isinstance(model_or_path, (str, os.PathLike)):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_path, **kw).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def test_from_pretrained_on_the_views_gives_the_models_logits(tmp_path, mount):
    folder = tmp_path / "llama"
    original = tiny_llama(folder)
    shards = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(shards) > 2, shards
    want = logits(folder)
    assert torch.equal(want, logits(original))
    m = mount(folder)
    views = os.path.join(m.path, "__views__")
    assert torch.equal(logits(views), want)

    # A tensor edited through the mount: the views load the edited model.
    name = "model.embed_tokens.weight"
    index = json.load(open(folder / "model.safetensors.index.json"))
    shard = index["weight_map"][name].removesuffix(".safetensors")
    edited = original.state_dict()[name].clone()
    edited[42] = torch.linspace(-1, 1, edited.shape[1])
    with open(os.path.join(m.path, shard, name), "r+b") as f:
        f.write(edited.numpy().tobytes())
    with torch.no_grad():
        original.model.embed_tokens.weight.copy_(edited)
    want_edited = logits(original)
    assert not torch.equal(want_edited, want)
    assert torch.equal(logits(views), want_edited)

    # The bf16 view, copied out: a bf16 model whose config says so.
    out = tmp_path / "bf16"
    subprocess.run(["cp", "-r", os.path.join(views, "bf16"), str(out)], check=True)
    config = json.load(open(out / "config.json"))
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16", config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    assert loaded.dtype == torch.bfloat16
    # Every weight is the original's cast as torch casts it (round to nearest even)...
    want_weights = {k: v.to(torch.bfloat16) for k, v in original.state_dict().items()}
    got_weights = loaded.state_dict()
    assert sorted(got_weights) == sorted(want_weights)
    for k, v in want_weights.items():
        assert torch.equal(got_weights[k], v), k
    # ...so the logits are the bf16 model's (its buffers, as from_pretrained
    # keeps them, may round a last bit apart from a .to() of the whole model).
    torch.testing.assert_close(logits(loaded), logits(original.to(torch.bfloat16)), atol=2e-2, rtol=2e-2)


def test_a_config_edit_and_a_tensor_removal_are_one_commit(tmp_path, mount, run):
    """The config and the weights that must agree, edited through the mount: tie the
    output layer to the embeddings in config.json and remove lm_head.weight. The view
    loads as the tied model at once, and after the commit the folder does (the two
    land together: tests/integration/test_model_edits.py kills commits mid-way)."""
    folder = tmp_path / "llama"
    original = tiny_llama(folder)
    m = mount(folder)
    config_path = os.path.join(m.path, "config.json")
    config = json.load(open(config_path))
    assert config["tie_word_embeddings"] is False
    config["tie_word_embeddings"] = True
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    index = json.load(open(folder / "model.safetensors.index.json"))
    shard = index["weight_map"]["lm_head.weight"].removesuffix(".safetensors")
    os.remove(os.path.join(m.path, shard, "lm_head.weight"))
    before = logits(original)
    with torch.no_grad():
        original.lm_head.weight.copy_(original.model.embed_tokens.weight)
    want = logits(original)
    assert not torch.equal(want, before)
    assert torch.equal(logits(os.path.join(m.path, "__views__")), want)
    done = run("commit", m.path)
    assert done.returncode == 0, done.stderr
    m.close()
    assert json.load(open(folder / "config.json"))["tie_word_embeddings"] is True
    assert "lm_head.weight" not in json.load(open(folder / "model.safetensors.index.json"))["weight_map"]
    assert torch.equal(logits(folder), want)
