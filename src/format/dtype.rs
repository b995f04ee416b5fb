//! Element types: the 22 of the safetensors format, then the block-quantized
//! types of ggml (GGUF), which only GGUF files hold.

use std::fmt;

use serde::{Deserialize, Serialize};

/// An element type. The declaration order is the reference's: it is the
/// serializer's sort key (descending), so it must never be reordered.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Dtype {
    BOOL,
    F4,
    F6_E2M3,
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
    // ggml's block-quantized types (GGUF only: a safetensors header naming
    // one is refused, as the reference refuses it).
    #[serde(skip_deserializing)]
    Q4_0,
    #[serde(skip_deserializing)]
    Q4_1,
    #[serde(skip_deserializing)]
    Q5_0,
    #[serde(skip_deserializing)]
    Q5_1,
    #[serde(skip_deserializing)]
    Q8_0,
    #[serde(skip_deserializing)]
    Q8_1,
    #[serde(skip_deserializing)]
    Q2_K,
    #[serde(skip_deserializing)]
    Q3_K,
    #[serde(skip_deserializing)]
    Q4_K,
    #[serde(skip_deserializing)]
    Q5_K,
    #[serde(skip_deserializing)]
    Q6_K,
    #[serde(skip_deserializing)]
    Q8_K,
    #[serde(skip_deserializing)]
    IQ2_XXS,
    #[serde(skip_deserializing)]
    IQ2_XS,
    #[serde(skip_deserializing)]
    IQ3_XXS,
    #[serde(skip_deserializing)]
    IQ1_S,
    #[serde(skip_deserializing)]
    IQ4_NL,
    #[serde(skip_deserializing)]
    IQ3_S,
    #[serde(skip_deserializing)]
    IQ2_S,
    #[serde(skip_deserializing)]
    IQ4_XS,
    #[serde(skip_deserializing)]
    IQ1_M,
    #[serde(skip_deserializing)]
    TQ1_0,
    #[serde(skip_deserializing)]
    TQ2_0,
    #[serde(skip_deserializing)]
    MXFP4,
    #[serde(skip_deserializing)]
    NVFP4,
    #[serde(skip_deserializing)]
    Q1_0,
    #[serde(skip_deserializing)]
    Q2_0,
}

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// ggml's block-quantized types, in ggml's id order.
    pub const GGML_BLOCKS: [Dtype; 27] = [
        Dtype::Q4_0,
        Dtype::Q4_1,
        Dtype::Q5_0,
        Dtype::Q5_1,
        Dtype::Q8_0,
        Dtype::Q8_1,
        Dtype::Q2_K,
        Dtype::Q3_K,
        Dtype::Q4_K,
        Dtype::Q5_K,
        Dtype::Q6_K,
        Dtype::Q8_K,
        Dtype::IQ2_XXS,
        Dtype::IQ2_XS,
        Dtype::IQ3_XXS,
        Dtype::IQ1_S,
        Dtype::IQ4_NL,
        Dtype::IQ3_S,
        Dtype::IQ2_S,
        Dtype::IQ4_XS,
        Dtype::IQ1_M,
        Dtype::TQ1_0,
        Dtype::TQ2_0,
        Dtype::MXFP4,
        Dtype::NVFP4,
        Dtype::Q1_0,
        Dtype::Q2_0,
    ];

    /// Every type: `ALL`, then `GGML_BLOCKS` (the compact tensor table
    /// stores a type as its position here).
    pub fn from_index(i: usize) -> Option<Dtype> {
        Dtype::ALL
            .get(i)
            .or_else(|| Dtype::GGML_BLOCKS.get(i.wrapping_sub(Dtype::ALL.len())))
            .copied()
    }

    /// Position in `ALL` then `GGML_BLOCKS` (see `from_index`).
    pub fn index(self) -> usize {
        self as usize
    }

    /// A block: how many elements are stored together, in how many bits.
    /// One element for the safetensors types (4 and 6 bits for the sub-byte
    /// floats); ggml's quantized types store 32 to 256 elements per block.
    pub fn block(self) -> (u64, u64) {
        use Dtype::*;
        match self {
            Q4_0 => (32, 144),
            Q4_1 => (32, 160),
            Q5_0 => (32, 176),
            Q5_1 => (32, 192),
            Q8_0 => (32, 272),
            Q8_1 => (32, 288),
            Q2_K => (256, 672),
            Q3_K => (256, 880),
            Q4_K => (256, 1152),
            Q5_K => (256, 1408),
            Q6_K => (256, 1680),
            Q8_K => (256, 2336),
            IQ2_XXS => (256, 528),
            IQ2_XS => (256, 592),
            IQ3_XXS => (256, 784),
            IQ1_S => (256, 400),
            IQ4_NL => (32, 144),
            IQ3_S => (256, 880),
            IQ2_S => (256, 656),
            IQ4_XS => (256, 1088),
            IQ1_M => (256, 448),
            TQ1_0 => (256, 432),
            TQ2_0 => (256, 528),
            MXFP4 => (32, 136),
            NVFP4 => (64, 288),
            Q1_0 => (128, 144),
            Q2_0 => (64, 144),
            t => (1, t.bits()),
        }
    }

    /// Whether this is one of ggml's block-quantized types.
    pub fn is_quantized_block(self) -> bool {
        self.block().0 > 1
    }

    /// Size of one element in bits (4 and 6 for the sub-byte float formats).
    /// A block-quantized type has no whole number of bits per element: it
    /// answers its block's bits over its elements, rounded down (sizes come
    /// from `byte_len`, which counts blocks).
    pub fn bits(self) -> u64 {
        use Dtype::*;
        match self {
            F4 => 4,
            F6_E2M3 | F6_E3M2 => 6,
            BOOL | U8 | I8 | F8_E5M2 | F8_E4M3 | F8_E8M0 | F8_E4M3FNUZ | F8_E5M2FNUZ => 8,
            I16 | U16 | F16 | BF16 => 16,
            I32 | U32 | F32 => 32,
            C64 | F64 | I64 | U64 => 64,
            block => {
                let (elements, bits) = block.block();
                bits / elements
            }
        }
    }

    /// The name used in headers (`"BF16"`).
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            BOOL => "BOOL",
            F4 => "F4",
            F6_E2M3 => "F6_E2M3",
            F6_E3M2 => "F6_E3M2",
            U8 => "U8",
            I8 => "I8",
            F8_E5M2 => "F8_E5M2",
            F8_E4M3 => "F8_E4M3",
            F8_E8M0 => "F8_E8M0",
            F8_E4M3FNUZ => "F8_E4M3FNUZ",
            F8_E5M2FNUZ => "F8_E5M2FNUZ",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            C64 => "C64",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            IQ1_M => "IQ1_M",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
            Q2_0 => "Q2_0",
        }
    }

    /// A safetensors dtype by its header name.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Any type by its name, ggml's block types too (a `.meta.json`: a
    /// commit refuses a type its file's format cannot hold).
    pub fn from_any_name(name: &str) -> Option<Dtype> {
        Dtype::from_name(name).or_else(|| Dtype::GGML_BLOCKS.into_iter().find(|d| d.name() == name))
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_serde_agrees() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<Dtype>(&json).unwrap(), d);
        }
        assert_eq!(Dtype::from_name("f32"), None);
    }

    #[test]
    fn every_type_has_one_index_and_ggml_blocks_are_not_read_from_headers() {
        let every: Vec<Dtype> = Dtype::ALL.into_iter().chain(Dtype::GGML_BLOCKS).collect();
        for (i, d) in every.iter().enumerate() {
            assert_eq!(d.index(), i, "{d}");
            assert_eq!(Dtype::from_index(i), Some(*d));
        }
        assert_eq!(Dtype::from_index(every.len()), None);
        for d in Dtype::GGML_BLOCKS {
            assert!(d.is_quantized_block(), "{d}");
            assert_eq!(Dtype::from_name(d.name()), None);
            assert!(serde_json::from_str::<Dtype>(&format!("\"{d}\"")).is_err());
        }
        assert_eq!(Dtype::Q4_K.block(), (256, 144 * 8));
        assert_eq!(crate::format::byte_len(Dtype::Q4_K, &[2, 256]), Ok(288));
        assert!(crate::format::byte_len(Dtype::Q4_K, &[2, 255]).is_err());
    }

    #[test]
    fn all_is_sorted_in_declaration_order() {
        assert!(Dtype::ALL.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn bit_sizes() {
        let expected: [(Dtype, u64); 22] = [
            (Dtype::BOOL, 8),
            (Dtype::F4, 4),
            (Dtype::F6_E2M3, 6),
            (Dtype::F6_E3M2, 6),
            (Dtype::U8, 8),
            (Dtype::I8, 8),
            (Dtype::F8_E5M2, 8),
            (Dtype::F8_E4M3, 8),
            (Dtype::F8_E8M0, 8),
            (Dtype::F8_E4M3FNUZ, 8),
            (Dtype::F8_E5M2FNUZ, 8),
            (Dtype::I16, 16),
            (Dtype::U16, 16),
            (Dtype::F16, 16),
            (Dtype::BF16, 16),
            (Dtype::I32, 32),
            (Dtype::U32, 32),
            (Dtype::F32, 32),
            (Dtype::C64, 64),
            (Dtype::F64, 64),
            (Dtype::I64, 64),
            (Dtype::U64, 64),
        ];
        for (d, bits) in expected {
            assert_eq!(d.bits(), bits, "{d}");
        }
    }
}
