//! Token ids of texts under a checkpoint's tokenizer, for scripts/reference/check_import.py.
//!
//!     cargo run --release --example tokenize -- DIR < texts.json > ids.json
//!
//! Reads a JSON list of strings on stdin and prints a JSON object: `ids` (one list per text,
//! from `Bpe::encode`, as `generate` and `eval` encode), `decoded` (each list decoded again) and
//! `eot` (the end-of-text id).

use anyhow::{Context, Result};
use attnres::text::tokenizer::Bpe;
use std::io::Read;
use std::path::PathBuf;

fn main() -> Result<()> {
    let dir: PathBuf =
        std::env::args_os().nth(1).context("usage: tokenize DIR < texts.json")?.into();
    let bpe = Bpe::load(&dir.join("tokenizer.json"))?;
    let mut input = String::new();
    std::io::stdin().read_to_string(&mut input)?;
    let texts: Vec<String> =
        serde_json::from_str(&input).context("stdin: a JSON list of strings")?;
    let ids = texts.iter().map(|t| bpe.encode(t)).collect::<Result<Vec<_>>>()?;
    let decoded = ids.iter().map(|i| bpe.decode(i)).collect::<Result<Vec<_>>>()?;
    println!("{}", serde_json::json!({"ids": ids, "decoded": decoded, "eot": bpe.eot}));
    Ok(())
}
