//! GGUF files (llama.cpp's model format) both ways, written from the specification (ggml's
//! `docs/gguf.md`, versions 2 and 3, little-endian) and the block layouts of `ggml-common.h`:
//! - here, what both sides share: metadata values ([`Value`]), the tensor types ([`GgmlType`]),
//!   the names of every ggml type id and the magic;
//! - [`read`]: the reader. It reads the metadata and the tensor table, checks every length and
//!   offset against the file before using it, and dequantises the tensor types of [`GgmlType`];
//! - [`write`]: the writer, version 3, each tensor's data aligned.
//!
//! `attnres import` reads GGUF files with it (`crate::import`), `attnres export` writes them
//! (`crate::export`).

pub mod read;
pub mod write;

use crate::kernels::quant::Format;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// An integer value of any width, if non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v as f64),
            Value::I16(v) => Some(v as f64),
            Value::I32(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "uint8",
            Value::I8(_) => "int8",
            Value::U16(_) => "uint16",
            Value::I16(_) => "int16",
            Value::U32(_) => "uint32",
            Value::I32(_) => "int32",
            Value::F32(_) => "float32",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "uint64",
            Value::I64(_) => "int64",
            Value::F64(_) => "float64",
        }
    }

    /// The GGUF id of the value's type, as it stands in the file before the value.
    pub fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::Str(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }
}

/// The tensor types read and written, with their ggml type ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    BF16,
    /// One of the formats the products take as they are ([`Format`]: F16 and ggml's block
    /// formats).
    Blocks(Format),
}

/// Names of every ggml type id, so that an unsupported one is named in the error.
const TYPE_NAMES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
];

/// The supported types, as the error for another one lists them.
pub const SUPPORTED_TYPES: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K";

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Some(match id {
            0 => GgmlType::F32,
            30 => GgmlType::BF16,
            _ => GgmlType::Blocks(Format::from_ggml_id(id)?),
        })
    }

    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::BF16 => 30,
            GgmlType::Blocks(f) => f.ggml_id(),
        }
    }

    /// Values per block and bytes per block.
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::BF16 => (1, 2),
            GgmlType::Blocks(f) => (f.block_values(), f.block_bytes()),
        }
    }
}

/// The name of a ggml type id: `Q4_K`, or `type 77` for an id no version of ggml has.
pub fn type_name(id: u32) -> String {
    TYPE_NAMES
        .iter()
        .find(|(i, _)| *i == id)
        .map_or_else(|| format!("type {id}"), |(_, n)| n.to_string())
}

pub const MAGIC: &[u8; 4] = b"GGUF";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_and_sizes() {
        assert_eq!(type_name(12), "Q4_K");
        assert_eq!(type_name(77), "type 77");
        let blocks = Format::ALL.map(GgmlType::Blocks);
        for ty in [GgmlType::F32, GgmlType::BF16].into_iter().chain(blocks) {
            assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        }
    }
}
