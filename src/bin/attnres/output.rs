//! Results on stdout: written whole and flushed, and a stdout that is closed or full is an
//! error (the result did not arrive).

use anyhow::{Context, Result};
use std::io::Write;

/// Writes a result (text, numbers, JSON, a table) to stdout and flushes it. A stdout that is
/// closed or full is an error: the result did not arrive.
pub fn output(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context(STDOUT)
}

pub const STDOUT: &str = "cannot write to standard output";
