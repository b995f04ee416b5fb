#![no_main]
//! Any text written into `__kv__/KEY`, read as any key type: an Ok or an
//! Err, never a panic; and what is accepted shows (`encoded_text`) as text
//! that reads back to the same value (once shown, a value is stable: NaN's
//! bits and a float's digits settle after one round).

use libfuzzer_sys::fuzz_target;
use stfs::format::gguf::ValueType;
use stfs::format::gguf::write::{KvType, decode, encoded_text, parse_text};


fuzz_target!(|input: &[u8]| {
    let Some((&choice, text)) = input.split_first() else {
        return;
    };
    // (Any type but an array, which is an item type of none.)
    let types: Vec<ValueType> = ValueType::ALL
        .into_iter()
        .filter(|t| *t != ValueType::Array)
        .collect();
    let item = types[(choice as usize) % types.len()];
    let ty = match choice & 0x80 {
        0 => KvType { value: item, item: None },
        _ => KvType { value: ValueType::Array, item: Some(item) },
    };
    let Ok(encoded) = parse_text(ty, text) else {
        return;
    };
    assert!(decode(&encoded).is_some(), "{ty:?} {text:?}");
    let shown = encoded_text(&encoded);
    let again = parse_text(ty, &shown).unwrap_or_else(|e| panic!("{ty:?} {text:?} -> {shown:?}: {e}"));
    if item == ValueType::String && ty.item.is_none() {
        assert_eq!(again, encoded, "{text:?}");
    }
    let settled = parse_text(ty, &encoded_text(&again)).unwrap();
    assert_eq!(settled, again, "{ty:?} {text:?}");
});
