//! Token embedding lookup and its scatter-add backward.

use super::par_rows_mut;

/// Forward: `out[t] = table[ids[t]]`. Ids must already be checked against the vocabulary.
pub fn forward(out: &mut [f32], table: &[f32], ids: &[u32], d: usize) {
    par_rows_mut(out, d, |r0, chunk| {
        for (i, row) in chunk.chunks_mut(d).enumerate() {
            let id = ids[r0 + i] as usize;
            row.copy_from_slice(&table[id * d..(id + 1) * d]);
        }
    });
}

/// Backward: `dtable[ids[t]] += dout[t]` (serial: repeated ids would race, and it is O(tokens·d)).
pub fn backward(dtable: &mut [f32], dout: &[f32], ids: &[u32], d: usize) {
    for (t, &id) in ids.iter().enumerate() {
        let id = id as usize;
        super::axpy(&mut dtable[id * d..(id + 1) * d], 1.0, &dout[t * d..(t + 1) * d]);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn gather_and_scatter_add() {
        let table = vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0];
        let ids = [2u32, 0, 2];
        let mut out = vec![0.0; 6];
        super::forward(&mut out, &table, &ids, 2);
        assert_eq!(out, vec![20.0, 21.0, 0.0, 1.0, 20.0, 21.0]);
        let mut d = vec![0.0; 6];
        super::backward(&mut d, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &ids, 2);
        assert_eq!(d, vec![3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);
    }
}
