//! The GGUF writer, the counterpart of [`super::read`]: version 3, little-endian, metadata and
//! tensor table, then the tensor data, each tensor starting at a multiple of the alignment
//! (`general.alignment`, 32) from the start of the data section, which itself starts at a
//! multiple of it in the file.

use super::{GgmlType, Value, MAGIC};
use anyhow::{bail, ensure, Result};

pub const ALIGNMENT: usize = 32;

/// One tensor to write.
pub struct Tensor {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub data: Vec<u8>,
}

/// A whole GGUF file before it is written: metadata in the order given, and tensors.
pub struct File {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<Tensor>,
}

impl File {
    /// Header, metadata and tensor table, padded to where the data section starts.
    pub fn header(&self) -> Result<Vec<u8>> {
        let mut out = MAGIC.to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            out.extend(value.type_id().to_le_bytes());
            put_value(&mut out, value).map_err(|e| e.context(format!("metadata key {key:?}")))?;
        }
        let mut offset = 0;
        for t in &self.tensors {
            let (per_block, block_bytes) = t.ty.block();
            let values: u64 = t.dims.iter().product();
            ensure!(
                t.dims[0].is_multiple_of(per_block as u64)
                    && values / per_block as u64 * block_bytes as u64 == t.data.len() as u64,
                "tensor {:?}: {} bytes do not hold {:?} values of its type",
                t.name,
                t.data.len(),
                t.dims
            );
            put_str(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
            out.extend(t.ty.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset += t.data.len().next_multiple_of(ALIGNMENT);
        }
        out.resize(out.len().next_multiple_of(ALIGNMENT), 0);
        Ok(out)
    }

    /// The file's bytes, written to `w` one tensor at a time.
    pub fn write(&self, header: &[u8], w: &mut dyn std::io::Write) -> std::io::Result<()> {
        w.write_all(header)?;
        let zeros = [0u8; ALIGNMENT];
        for t in &self.tensors {
            w.write_all(&t.data)?;
            w.write_all(&zeros[..t.data.len().next_multiple_of(ALIGNMENT) - t.data.len()])?;
        }
        Ok(())
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend(x.to_le_bytes()),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::Str(s) => put_str(out, s),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Array(items) => {
            // An array holds one type; an empty one is written as an array of strings.
            let elem = items.first().map_or(8, Value::type_id);
            if items.iter().any(|x| x.type_id() != elem) {
                bail!("an array mixes value types");
            }
            out.extend(elem.to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for x in items {
                put_value(out, x)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::read::Gguf;
    use crate::kernels::quant::Format;

    /// What the writer writes, the reader reads back: every value type, nested arrays, tensor
    /// dims, types, offsets (aligned) and bytes.
    #[test]
    fn the_reader_reads_what_the_writer_writes() {
        let mut f = File { metadata: Vec::new(), tensors: Vec::new() };
        let values = [
            Value::U8(7),
            Value::I8(-7),
            Value::U16(700),
            Value::I16(-700),
            Value::U32(70_000),
            Value::I32(-70_000),
            Value::F32(1e-5),
            Value::Bool(true),
            Value::Str("llama".into()),
            Value::U64(1 << 40),
            Value::I64(-(1 << 40)),
            Value::F64(0.1),
            Value::Array(vec![Value::Str("a b".into()), Value::Str("ĠĠ".into())]),
            Value::Array(vec![Value::Array(vec![Value::I32(1)]), Value::Array(vec![])]),
        ];
        for (i, v) in values.iter().enumerate() {
            f.metadata.push((format!("k{i}"), v.clone()));
        }
        f.metadata.push(("general.alignment".into(), Value::U32(ALIGNMENT as u32)));
        let q8 = GgmlType::Blocks(Format::Q8_0);
        f.tensors.push(Tensor {
            name: "a".into(),
            dims: vec![3],
            ty: GgmlType::F32,
            data: (0..12).collect(),
        });
        f.tensors.push(Tensor { name: "b".into(), dims: vec![32, 2], ty: q8, data: vec![9; 68] });
        let header = f.header().unwrap();
        let mut bytes = Vec::new();
        f.write(&header, &mut bytes).unwrap();
        let g = Gguf::parse(&bytes).unwrap();
        for (i, v) in values.iter().enumerate() {
            assert_eq!(g.get(&format!("k{i}")), Some(v), "k{i}");
        }
        let (a, b) = (g.tensor("a").unwrap(), g.tensor("b").unwrap());
        assert_eq!((a.offset, b.offset), (0, 32));
        assert_eq!((b.dims.clone(), b.type_id), (vec![32, 2], 8));
        assert_eq!(g.blocks(b).unwrap().unwrap().1, &[9; 68][..]);
        let start = bytes.len() - 32 - 96;
        assert!(start.is_multiple_of(ALIGNMENT));
        assert_eq!(&bytes[start..start + 12], &(0..12).collect::<Vec<u8>>()[..]);

        // Bytes that do not fit the dims, or an array of mixed types: refused.
        f.tensors[1].data.pop();
        assert!(f.header().unwrap_err().to_string().contains("\"b\""));
        f.tensors.pop();
        f.metadata.push(("mixed".into(), Value::Array(vec![Value::U8(1), Value::I8(1)])));
        assert!(format!("{:#}", f.header().unwrap_err()).contains("mixes"));
    }
}
