//! The other files of a model folder (`config.json`, the tokenizer's files,
//! `README.md`...): every regular file of a mounted folder that is not a
//! shard or an index, read at mount and shown at the mount's root and in
//! each view folder that is a model folder (the export, each cast, each
//! reshard), so that `from_pretrained(view)` and `cp -r view out/` give a
//! whole model. In a cast folder `config.json` names the cast's dtype.

use crate::format::Dtype;
use crate::source::FileStat;

/// A file of the folder, as read at mount.
#[derive(Clone)]
pub struct ModelFile {
    pub name: String,
    pub bytes: std::sync::Arc<Vec<u8>>,
    pub stat: FileStat,
    /// Its ETag, in a store (the version a commit replaces).
    pub etag: Option<String>,
    /// Its own headers, in a store (type, cache policy, user metadata),
    /// which a commit keeps.
    pub headers: Vec<(String, String)>,
}

/// A file larger than this is not shown (a model folder's other files are
/// configs, tokenizers and cards: a few MiB at most); the mount says so.
pub const MAX_FILE: u64 = 64 << 20;
/// Nor are more than this in all.
pub const MAX_TOTAL: u64 = 256 << 20;

/// Weights and pickles of other formats: a view is the safetensors model,
/// and its export in bf16 must not carry the fp32 weights of another format.
const OTHER_WEIGHTS: [&str; 10] = [
    ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".pkl", ".npz", ".ot",
];

/// Why a folder's file `name` is left out of the mount, if it is: hidden
/// (a dot file), or weights of another format.
pub fn left_out(name: &str) -> Option<&'static str> {
    if name.starts_with('.') {
        return Some("hidden");
    }
    OTHER_WEIGHTS
        .iter()
        .any(|ext| name.ends_with(ext))
        .then_some("weights of another format")
}

/// Whether a folder's file `name` is shown as a model file: not left out,
/// not a checkpoint, not an index (those are shown as they are).
pub fn is_model_file(name: &str) -> bool {
    left_out(name).is_none()
        && !name.ends_with(".safetensors")
        && !name.ends_with(".index.json")
        && !name.ends_with(".gguf")
        && name != crate::fs::VIEWS_DIR
}

/// The name transformers gives a dtype in `config.json`.
fn torch_name(dtype: Dtype) -> Option<&'static str> {
    Some(match dtype {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        Dtype::F32 => "float32",
        Dtype::F64 => "float64",
        _ => return None,
    })
}

/// Whether a config's dtype value names a floating-point torch dtype (the
/// values a cast replaces; "auto" and the rest are left as they are).
fn is_float_name(value: &str) -> bool {
    let v = value.strip_prefix("torch.").unwrap_or(value);
    matches!(
        v,
        "bfloat16" | "float16" | "half" | "float32" | "float" | "float64" | "double"
    )
}

/// `config.json` as a cast to `dtype` shows it: the string value of every
/// `torch_dtype` or `dtype` key (at any depth: a multimodal config has one
/// per part) that names a float dtype becomes the cast's name; every other
/// byte is kept. A file that is not a JSON object is kept as it is.
pub fn config_cast(bytes: &[u8], dtype: Dtype) -> Vec<u8> {
    let Some(name) = torch_name(dtype) else {
        return bytes.to_vec();
    };
    if serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(bytes).is_err() {
        return bytes.to_vec();
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    for (start, end) in dtype_values(bytes) {
        let value = std::str::from_utf8(&bytes[start + 1..end - 1]).unwrap_or("");
        if is_float_name(value) {
            out.extend_from_slice(&bytes[at..start]);
            out.extend_from_slice(format!("\"{name}\"").as_bytes());
            at = end;
        }
    }
    out.extend_from_slice(&bytes[at..]);
    out
}

/// The byte ranges (quotes included) of the string values of the keys
/// `torch_dtype` and `dtype` in a JSON text known to be valid.
fn dtype_values(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut found = Vec::new();
    let mut i = 0;
    // The last string seen, and whether a ':' followed it (it was a key).
    let mut last: Option<(usize, usize)> = None;
    let mut key: Option<(usize, usize)> = None;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let end = string_end(bytes, i);
                if let Some((ks, ke)) = key.take() {
                    let k = &bytes[ks + 1..ke - 1];
                    if k == b"torch_dtype" || k == b"dtype" {
                        found.push((i, end));
                    }
                }
                last = Some((i, end));
                i = end;
                continue;
            }
            b':' => key = last.take(),
            b' ' | b'\t' | b'\n' | b'\r' => {}
            _ => {
                key = None;
                last = None;
            }
        }
        i += 1;
    }
    found
}

/// One past the closing quote of the string that opens at `start`.
fn string_end(bytes: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    bytes.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cast_names_its_dtype_and_keeps_every_other_byte() {
        let config = br#"{
  "architectures": ["LlamaForCausalLM"],
  "torch_dtype": "float32",
  "text_config": {"dtype":  "bfloat16", "note": "dtype"},
  "quantization_config": {"bnb_4bit_compute_dtype": "float16"},
  "name": "a \"dtype\": \"float32\" in a string",
  "dtype": "auto"
}
"#;
        let cast = config_cast(config, Dtype::BF16);
        let want = String::from_utf8_lossy(config).replace(
            r#""torch_dtype": "float32""#,
            r#""torch_dtype": "bfloat16""#,
        );
        assert_eq!(String::from_utf8(cast).unwrap(), want);
        let f16 = String::from_utf8(config_cast(config, Dtype::F16)).unwrap();
        assert!(
            f16.contains(r#""torch_dtype": "float16""#) && f16.contains(r#"{"dtype":  "float16""#)
        );
        assert!(f16.contains(r#""bnb_4bit_compute_dtype": "float16""#));
        assert!(f16.contains(r#""dtype": "auto""#), "auto is left as it is");
        assert!(f16.contains(r#"a \"dtype\": \"float32\" in a string"#));
    }

    #[test]
    fn what_is_not_a_json_object_is_kept() {
        for text in [&b"not json"[..], b"[\"dtype\", \"float32\"]", b""] {
            assert_eq!(config_cast(text, Dtype::BF16), text);
        }
        let torch_prefixed = br#"{"torch_dtype":"torch.float16"}"#;
        assert_eq!(
            config_cast(torch_prefixed, Dtype::F32),
            br#"{"torch_dtype":"float32"}"#
        );
    }

    #[test]
    fn model_files_are_what_is_not_a_checkpoint_an_index_or_left_out() {
        for name in [
            "config.json",
            "tokenizer.json",
            "README.md",
            "chat_template.jinja",
            "tokenizer.model",
            "vocab.txt",
            "binary.md",
        ] {
            assert!(is_model_file(name) && left_out(name).is_none(), "{name}");
        }
        for name in [
            "m.safetensors",
            "model.safetensors.index.json",
            "x.gguf",
            "__views__",
        ] {
            assert!(!is_model_file(name), "{name}");
        }
        assert_eq!(left_out(".gitattributes"), Some("hidden"));
        for name in [
            "pytorch_model.bin",
            "training_args.bin",
            "model.onnx",
            "flax_model.msgpack",
        ] {
            assert_eq!(left_out(name), Some("weights of another format"), "{name}");
            assert!(!is_model_file(name), "{name}");
        }
    }
}
