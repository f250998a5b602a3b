//! The GGUF reader: header, metadata and tensor table parsed from the bytes of a whole file,
//! every length and offset checked against the file before it is used; tensors read as their
//! blocks or dequantised to f32.

use super::{type_name, GgmlType, Value, MAGIC, SUPPORTED_TYPES};
use crate::kernels::quant::{self, bf16_to_f32, Format};
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension, so a PyTorch `[out, in]`
    /// matrix has `dims = [in, out]`.
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub type_id: u32,
    /// Offset of the data from the start of the tensor data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in PyTorch order (outermost first).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}
/// A parsed GGUF file: metadata, tensor table and the bytes of the tensor data section.
pub struct Gguf<'a> {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data: &'a [u8],
}
const DEFAULT_ALIGNMENT: u64 = 32;

/// Whether `bytes` start with the GGUF magic.
pub fn has_magic(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// What is being read, for the truncation error.
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            bail!(
                "the file is truncated: it ends at byte {} inside the {} (needed {} more bytes at byte {})",
                self.bytes.len(),
                self.what,
                n,
                self.pos
            )
        };
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returns N bytes"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items that take at least `min_size` bytes each: bounded by what is left of the
    /// file, so no allocation is sized by a corrupt count.
    fn count(&mut self, min_size: usize, what: &str) -> Result<usize> {
        let n = self.u64()?;
        let fits = n.checked_mul(min_size as u64).is_some_and(|b| b <= self.remaining() as u64);
        ensure!(
            fits,
            "{what} count {n} is impossible: the {} bytes left in the file cannot hold that many (corrupt or truncated file)",
            self.remaining()
        );
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.count(1, "string length")?;
        let at = self.pos;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| anyhow::anyhow!("the string at byte {at} is not valid UTF-8"))
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => {
                let at = self.pos;
                match self.array::<1>()?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => bail!("the bool at byte {at} is {b}, neither 0 nor 1"),
                }
            }
            8 => Value::Str(self.string()?),
            9 => {
                ensure!(depth < 8, "metadata arrays nested more than 8 deep");
                let elem = self.u32()?;
                let min = match elem {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => bail!("unknown metadata value type {t} in an array"),
                };
                let n = self.count(min, "array length")?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            t => bail!("unknown metadata value type {t}"),
        })
    }
}

impl<'a> Gguf<'a> {
    /// Parses the header, metadata and tensor table of a GGUF file held in `bytes`, and checks
    /// that every tensor's data lies inside the file.
    pub fn parse(bytes: &'a [u8]) -> Result<Gguf<'a>> {
        ensure!(
            has_magic(bytes),
            "not a GGUF file: it starts with {:?}, not the magic \"GGUF\"",
            String::from_utf8_lossy(&bytes[..bytes.len().min(4)])
        );
        let mut c = Cursor { bytes, pos: 4, what: "header" };
        let version = c.u32()?;
        if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
            bail!("big-endian GGUF files are not supported (version field {version:#x})");
        }
        ensure!(
            version == 2 || version == 3,
            "GGUF version {version} is not supported (versions 2 and 3 are)"
        );
        // A tensor-table entry takes at least 8 (name) + 4 + 4 + 8 bytes, a metadata pair at
        // least 8 + 4 + 1.
        let n_tensors = c.count(24, "tensor")?;
        let n_kv = c.count(13, "metadata")?;
        c.what = "metadata";
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let t = c.u32()?;
            let v = c.value(t, 0).with_context(|| format!("metadata key {key:?}"))?;
            ensure!(
                metadata.insert(key.clone(), v).is_none(),
                "metadata key {key:?} appears twice"
            );
        }
        c.what = "tensor table";
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            ensure!(
                (1..=4).contains(&n_dims),
                "tensor {name:?} has {n_dims} dimensions; GGUF allows 1 to 4"
            );
            let mut dims = Vec::new();
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let type_id = c.u32()?;
            let offset = c.u64()?;
            tensors.push(TensorInfo { name, dims, type_id, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_u64().context("general.alignment is not an integer")?;
                ensure!(
                    a > 0 && a.is_multiple_of(8) && a <= 1 << 20,
                    "general.alignment = {a} is not a positive multiple of 8"
                );
                a
            }
        };
        let start = (c.pos as u64).div_ceil(alignment) * alignment;
        ensure!(
            start <= bytes.len() as u64,
            "the file is truncated: it ends at byte {} before its tensor data (which starts at byte {start})",
            bytes.len()
        );
        let data = &bytes[start as usize..];
        let g = Gguf { version, metadata, tensors, data };
        let mut names = std::collections::HashSet::new();
        for t in &g.tensors {
            ensure!(names.insert(t.name.as_str()), "tensor {:?} appears twice", t.name);
            ensure!(
                t.offset.is_multiple_of(alignment),
                "tensor {:?}: offset {} is not a multiple of the alignment {alignment}",
                t.name,
                t.offset
            );
            if let Some(ty) = GgmlType::from_id(t.type_id) {
                // Only tensors of supported types are sized here; others are refused when read.
                g.byte_range(t, ty)?;
            }
        }
        Ok(g)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Where a tensor's bytes lie in the data section; an error if they run past its end.
    fn byte_range(&self, t: &TensorInfo, ty: GgmlType) -> Result<std::ops::Range<usize>> {
        let (per_block, block_bytes) = ty.block();
        let n = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let n =
            n.with_context(|| format!("tensor {:?}: dimensions {:?} overflow", t.name, t.dims))?;
        ensure!(
            t.dims[0].is_multiple_of(per_block as u64),
            "tensor {:?}: its rows of {} values are not a whole number of {}-value blocks of type {}",
            t.name,
            t.dims[0],
            per_block,
            type_name(t.type_id)
        );
        let size = (n / per_block as u64)
            .checked_mul(block_bytes as u64)
            .with_context(|| format!("tensor {:?} is too large", t.name))?;
        let end = t.offset.checked_add(size).filter(|&e| e <= self.data.len() as u64);
        let Some(end) = end else {
            bail!(
                "the file is truncated: tensor {:?} ({} bytes of {}) runs past the end of the file",
                t.name,
                size,
                type_name(t.type_id)
            )
        };
        Ok(t.offset as usize..end as usize)
    }

    /// A tensor's bytes when it is stored in a block format: the format and its blocks, row
    /// after row.
    pub fn blocks(&self, t: &TensorInfo) -> Result<Option<(Format, &'a [u8])>> {
        match GgmlType::from_id(t.type_id) {
            Some(ty @ GgmlType::Blocks(f)) => Ok(Some((f, &self.data[self.byte_range(t, ty)?]))),
            _ => Ok(None),
        }
    }

    /// A tensor's values as f32 in ggml order (row-major over `dims` reversed).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        let ty = GgmlType::from_id(t.type_id).with_context(|| {
            format!(
                "tensor {:?} has type {}, which import does not support (supported: {SUPPORTED_TYPES})",
                t.name,
                type_name(t.type_id)
            )
        })?;
        let range = self.byte_range(t, ty)?;
        Ok(dequantize(ty, &self.data[range]))
    }
}

/// Dequantises whole blocks of type `ty` (ggml's `dequantize_row_*`).
pub fn dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let two = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]);
    match ty {
        GgmlType::F32 => {
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
        }
        GgmlType::BF16 => bytes.chunks_exact(2).map(|b| bf16_to_f32(two(b))).collect(),
        GgmlType::Blocks(f) => quant::dequantize(f, bytes),
    }
}
