//! Tensor name <-> file name: a bijection (docs/SEMANTICS.md, "Names").
//!
//! - `%` -> `%25`, `/` -> `%2F`, NUL -> `%00`;
//! - the names `""`, `.`, `..` are written `%`, `%2E`, `%2E%2E`;
//! - a name ending in `.meta.json` gets that suffix's `.` escaped (`x%2Emeta.json`);
//! - the name `__metadata__.json` is written `%5F_metadata__.json`, and
//!   `__views__` (the folder of views) `%5F_views__`, and `__kv__` (a GGUF
//!   file's keys) `%5F_kv__`;
//! - a name whose file name plus `.meta.json` would pass 255 bytes becomes
//!   `<prefix>~<16 hex digits of a hash>`; its full name is in its `.meta.json`.

/// The suffix of a tensor's description file.
pub const META_SUFFIX: &str = ".meta.json";
/// The file holding a checkpoint's `__metadata__`.
pub const METADATA_FILE: &str = "__metadata__.json";
/// The folder of views at the top of a mount (docs/SEMANTICS.md, "Views").
pub const VIEWS_DIR: &str = "__views__";
/// The folder of a GGUF file's keys, one file each (docs/SEMANTICS.md, "GGUF").
pub const KV_DIR: &str = "__kv__";
/// The kernel's limit for one path component.
pub const NAME_MAX: usize = 255;
/// Longest tensor file name, so that its `.meta.json` still fits.
pub const MAX_TENSOR_FILE: usize = NAME_MAX - META_SUFFIX.len();

/// The file name of a tensor.
pub fn tensor_file_name(name: &str) -> String {
    let escaped = escape(name);
    if escaped.len() <= MAX_TENSOR_FILE {
        return escaped;
    }
    // Keep in step with is_hashed.
    // `<prefix>~<16 hex>`: cut the escaped form on a char boundary.
    let mut cut = MAX_TENSOR_FILE - 17;
    while !escaped.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}~{:016x}", &escaped[..cut], fnv1a64(name.as_bytes()))
}

/// Whether a tensor's file name is the hashed form (its escape is too long).
pub fn is_hashed(name: &str) -> bool {
    // An escape at most triples a name, plus a few bytes: skip the work for short names.
    name.len() * 3 + 4 > MAX_TENSOR_FILE && escape(name).len() > MAX_TENSOR_FILE
}

/// Whether a file name that does not decode may be the hashed form of a long name.
pub fn maybe_hashed(file_name: &str) -> bool {
    file_name.len() > 17 && file_name.as_bytes()[file_name.len() - 17] == b'~'
}

/// The tensor name a file name stands for, if it is a valid (canonical) escape
/// of a short name. Hashed long names return None: they are looked up instead.
pub fn tensor_name(file_name: &str) -> Option<String> {
    let decoded = if file_name == "%" {
        String::new()
    } else {
        decode_percent(file_name)?
    };
    // Only the canonical form is valid: this makes the mapping a bijection.
    let canonical = escape(&decoded);
    (canonical == file_name && canonical.len() <= MAX_TENSOR_FILE).then_some(decoded)
}

fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for c in name.chars() {
        match c {
            '%' => out.push_str("%25"),
            '/' => out.push_str("%2F"),
            '\0' => out.push_str("%00"),
            c => out.push(c),
        }
    }
    match out.as_str() {
        "" => return "%".into(),
        "." => return "%2E".into(),
        ".." => return "%2E%2E".into(),
        METADATA_FILE => return "%5F_metadata__.json".into(),
        VIEWS_DIR => return "%5F_views__".into(),
        KV_DIR => return "%5F_kv__".into(),
        _ => {}
    }
    if let Some(stem) = out.strip_suffix(META_SUFFIX) {
        out = format!("{stem}%2E{}", &META_SUFFIX[1..]);
    }
    out
}

/// Decodes every `%XX`; None if a `%` is not followed by two hex digits or the
/// result is not UTF-8.
fn decode_percent(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// FNV-1a: stable across runs and builds, unlike std's hasher.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documented_escapes() {
        let cases = [
            ("lm_head.weight", "lm_head.weight"),
            ("a/b", "a%2Fb"),
            ("100%", "100%25"),
            ("nul\0", "nul%00"),
            ("", "%"),
            (".", "%2E"),
            ("..", "%2E%2E"),
            ("...", "..."),
            ("x.meta.json", "x%2Emeta.json"),
            (".meta.json", "%2Emeta.json"),
            ("__metadata__.json", "%5F_metadata__.json"),
            ("__metadata__", "__metadata__"),
            ("__kv__", "%5F_kv__"),
            ("__views__", "%5F_views__"),
            ("ünï ✓", "ünï ✓"),
            ("%2F", "%252F"),
        ];
        for (name, file) in cases {
            assert_eq!(tensor_file_name(name), file, "{name:?}");
            assert_eq!(tensor_name(file).as_deref(), Some(name), "{file:?}");
        }
    }

    #[test]
    fn non_canonical_file_names_are_refused() {
        for bad in [
            "%2f",
            "a%2",
            "%zz",
            "%41",
            "%2E%2E%2E",
            "x.meta.json",
            "__metadata__.json",
            "%FF",
            "a/b",
            "%2Emeta",
        ] {
            assert_eq!(tensor_name(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn long_names_are_hashed_and_fit_with_their_meta_suffix() {
        let long = "w".repeat(300);
        let f = tensor_file_name(&long);
        assert!(f.len() <= MAX_TENSOR_FILE && (f.clone() + META_SUFFIX).len() <= NAME_MAX);
        assert!(f.starts_with("www") && f.contains('~') && is_hashed(&long));
        assert!(!is_hashed("short") && !is_hashed(&"%".repeat(81)) && is_hashed(&"%".repeat(82)));
        assert_ne!(tensor_name(&f).as_deref(), Some(long.as_str()));
        assert_ne!(f, tensor_file_name(&"w".repeat(301)));
        // Multi-byte characters are cut on a boundary.
        let f = tensor_file_name(&"é".repeat(200));
        assert!(f.len() <= MAX_TENSOR_FILE);
        // The longest short name is kept as it is.
        let edge = "v".repeat(MAX_TENSOR_FILE);
        assert_eq!(tensor_file_name(&edge), edge);
        let over = "v".repeat(MAX_TENSOR_FILE - 2) + "%";
        assert!(tensor_file_name(&over).contains('~'));
    }
}

#[cfg(test)]
mod properties {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        prop_oneof![
            "\\PC{0,12}",
            "[%/.\\x00_a-z]{0,8}",
            "[a-z%]{0,4}(\\.meta\\.json)?",
            Just("__metadata__.json".to_string()),
            "[a-z]{240,260}",
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Short names round-trip; long ones are hashed and fit with their suffix.
        #[test]
        fn names_round_trip(n in name()) {
            let f = tensor_file_name(&n);
            prop_assert!(f.len() + META_SUFFIX.len() <= NAME_MAX);
            prop_assert!(!f.contains('/') && !f.contains('\0') && f != "." && f != ".." && !f.is_empty());
            prop_assert!(!f.ends_with(META_SUFFIX) && f != METADATA_FILE);
            if !is_hashed(&n) {
                prop_assert_eq!(tensor_name(&f), Some(n));
            }
        }

        /// Every file name that decodes is the file name of what it decodes to.
        #[test]
        fn decoding_is_canonical(f in "[%0-9A-Fa-f/._a-z]{0,10}") {
            if let Some(n) = tensor_name(&f) {
                prop_assert_eq!(tensor_file_name(&n), f);
            }
        }
    }
}
