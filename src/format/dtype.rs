//! The 22 element types of the safetensors format.

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

    /// Size of one element in bits (4 and 6 for the sub-byte float formats).
    pub fn bits(self) -> u64 {
        use Dtype::*;
        match self {
            F4 => 4,
            F6_E2M3 | F6_E3M2 => 6,
            BOOL | U8 | I8 | F8_E5M2 | F8_E4M3 | F8_E8M0 | F8_E4M3FNUZ | F8_E5M2FNUZ => 8,
            I16 | U16 | F16 | BF16 => 16,
            I32 | U32 | F32 => 32,
            C64 | F64 | I64 | U64 => 64,
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
        }
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
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
