//! Text corpora: the embedded default corpus or the user's files, cut into documents, and the
//! deterministic train/validation split.
//!
//! - The default corpus is Shakespeare's plays (35 plays, public domain), embedded gzip-compressed.
//! - `--data FILE.txt` (any extension but `.jsonl`): documents are separated by two or more blank
//!   lines.
//! - `--data FILE.jsonl`: one JSON object per line with a string field `text`; each is a document.
//! - `--data DIR`: every non-hidden file below it, in name order, read as above. Symbolic links
//!   are followed, but every file and directory is read once: a link back to a directory above
//!   it (a loop) or a second link to the same file adds nothing.
//!
//! Validation takes whole documents: every 10th document (indices 9, 19, ...) when there are at
//! least 10, the last document when there are 2 to 9, and the last tenth of the lines of the only
//! document otherwise.

use anyhow::{bail, ensure, Context, Result};
use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

const EMBEDDED: &[u8] = include_bytes!("../../data/shakespeare.txt.gz");

pub struct Corpus {
    /// Where the text came from, for messages.
    pub name: String,
    pub documents: Vec<String>,
}

/// The documents of each split.
pub struct Split {
    pub train: Vec<String>,
    pub val: Vec<String>,
}

impl Corpus {
    /// The embedded default corpus.
    pub fn embedded() -> Corpus {
        let mut text = String::new();
        flate2::read::GzDecoder::new(EMBEDDED)
            .read_to_string(&mut text)
            .expect("the embedded corpus is valid gzip UTF-8");
        Corpus { name: "Shakespeare's plays (embedded)".into(), documents: split_documents(&text) }
    }

    /// The corpus at `path` (a text file, a JSONL file or a directory of them).
    pub fn from_path(path: &Path) -> Result<Corpus> {
        ensure!(path.exists(), "--data {}: no such file or directory", path.display());
        let mut files = Vec::new();
        if path.is_dir() {
            collect_files(path, &mut files, &mut HashSet::new())?;
            ensure!(!files.is_empty(), "--data {}: the directory holds no files", path.display());
        } else {
            files.push(path.to_path_buf());
        }
        let mut documents = Vec::new();
        for f in &files {
            documents.extend(read_documents(f)?);
        }
        documents.retain(|d| !d.trim().is_empty());
        ensure!(!documents.is_empty(), "--data {}: the corpus is empty", path.display());
        Ok(Corpus { name: path.display().to_string(), documents })
    }

    /// Total bytes of text (UTF-8).
    pub fn bytes(&self) -> usize {
        self.documents.iter().map(|d| d.len()).sum()
    }

    /// The deterministic train/validation split (see the module docs).
    pub fn split(&self) -> Split {
        let docs = &self.documents;
        match docs.len() {
            0 => Split { train: vec![], val: vec![] },
            1 => {
                let lines: Vec<&str> = docs[0].split_inclusive('\n').collect();
                let cut = (lines.len() * 9 / 10).max(1).min(lines.len());
                Split { train: vec![lines[..cut].concat()], val: vec![lines[cut..].concat()] }
            }
            n if n < 10 => Split { train: docs[..n - 1].to_vec(), val: vec![docs[n - 1].clone()] },
            _ => {
                let (mut train, mut val) = (Vec::new(), Vec::new());
                for (i, d) in docs.iter().enumerate() {
                    if i % 10 == 9 {
                        val.push(d.clone())
                    } else {
                        train.push(d.clone())
                    }
                }
                Split { train, val }
            }
        }
    }
}

/// Splits text at runs of two or more blank lines.
pub fn split_documents(text: &str) -> Vec<String> {
    let text = text.replace("\r\n", "\n");
    text.split("\n\n\n")
        .map(|d| d.trim_matches('\n'))
        .filter(|d| !d.trim().is_empty())
        .map(String::from)
        .collect()
}

/// The files below `dir` in name order, each once: `seen` holds the canonical paths of the
/// directories and files met so far, so links that lead back to them are skipped.
fn collect_files(dir: &Path, out: &mut Vec<PathBuf>, seen: &mut HashSet<PathBuf>) -> Result<()> {
    let canonical =
        std::fs::canonicalize(dir).with_context(|| format!("cannot resolve {}", dir.display()))?;
    if !seen.insert(canonical) {
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read directory {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("cannot read directory {}", dir.display()))?;
    entries.sort();
    for p in entries {
        let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        if p.is_dir() {
            collect_files(&p, out, seen)?;
        } else if p.is_file() {
            let canonical = std::fs::canonicalize(&p)
                .with_context(|| format!("cannot resolve {}", p.display()))?;
            if seen.insert(canonical) {
                out.push(p);
            }
        }
    }
    Ok(())
}

fn read_documents(path: &Path) -> Result<Vec<String>> {
    let text = crate::base::fs::read_utf8(path)?;
    if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
        return Ok(split_documents(&text));
    }
    let mut docs = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not valid JSON", path.display(), i + 1))?;
        match v.get("text") {
            Some(serde_json::Value::String(s)) => docs.push(s.clone()),
            Some(_) => bail!("{} line {}: field \"text\" is not a string", path.display(), i + 1),
            None => bail!("{} line {}: no \"text\" field", path.display(), i + 1),
        }
    }
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_corpus_is_the_35_plays_and_splits_by_document() {
        let c = Corpus::embedded();
        assert_eq!(c.documents.len(), 35);
        assert!(c.documents[0].starts_with("A Midsummer Night's Dream"));
        let s = c.split();
        assert_eq!((s.train.len(), s.val.len()), (32, 3));
        assert_eq!(s.val[0], c.documents[9]);
    }

    #[test]
    fn files_directories_and_jsonl() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("a.txt"), "one\n\n\n\ntwo\nlines\n\n\nthree").unwrap();
        std::fs::write(
            tmp.path().join("b.jsonl"),
            "{\"text\": \"four\"}\n\n{\"text\": \"five\", \"id\": 2}\n",
        )
        .unwrap();
        std::fs::write(tmp.path().join(".hidden"), "ignored").unwrap();
        let c = Corpus::from_path(tmp.path()).unwrap();
        assert_eq!(c.documents, vec!["one", "two\nlines", "three", "four", "five"]);
        let s = c.split();
        assert_eq!(s.val, vec!["five"]);

        std::fs::write(tmp.path().join("b.jsonl"), "{\"text\": 3}\n").unwrap();
        let e = Corpus::from_path(tmp.path()).err().unwrap().to_string();
        assert!(e.contains("line 1: field \"text\" is not a string"), "{e}");
        std::fs::write(tmp.path().join("b.jsonl"), "{\"txt\": \"x\"}\n").unwrap();
        assert!(Corpus::from_path(tmp.path())
            .err()
            .unwrap()
            .to_string()
            .contains("no \"text\" field"));
        std::fs::write(tmp.path().join("b.jsonl"), "[1,\n").unwrap();
        assert!(format!("{:#}", Corpus::from_path(tmp.path()).err().unwrap())
            .contains("not valid JSON"));

        let bad = tmp.path().join("bad.txt");
        std::fs::write(&bad, b"ok \xff\xfe nope").unwrap();
        let e = Corpus::from_path(&bad).err().unwrap().to_string();
        assert!(e.contains("not valid UTF-8 (first invalid byte at offset 3)"), "{e}");
        let empty = tmp.path().join("empty.txt");
        std::fs::write(&empty, "\n\n  \n").unwrap();
        assert!(Corpus::from_path(&empty).err().unwrap().to_string().contains("empty"));
        assert!(Corpus::from_path(&tmp.path().join("nope"))
            .err()
            .unwrap()
            .to_string()
            .contains("no such file"));
    }

    /// A link back to a directory above it is followed once, not until the system gives up,
    /// and a second link to a file already read adds nothing.
    #[cfg(unix)]
    #[test]
    fn symlink_loops_and_repeated_files_are_read_once() {
        let tmp = tempfile::tempdir().unwrap();
        let sub = tmp.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        std::fs::write(sub.join("a.txt"), "alpha").unwrap();
        std::fs::write(tmp.path().join("b.txt"), "beta").unwrap();
        std::os::unix::fs::symlink(tmp.path(), sub.join("loop")).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("b.txt"), sub.join("c.txt")).unwrap();
        let c = Corpus::from_path(tmp.path()).unwrap();
        assert_eq!(c.documents, vec!["beta", "alpha"]);
    }

    #[test]
    fn a_single_document_keeps_its_last_tenth_of_lines_for_validation() {
        let text: String = (0..20).map(|i| format!("line {i}\n")).collect();
        let c = Corpus { name: "x".into(), documents: vec![text] };
        let s = c.split();
        assert!(s.train[0].ends_with("line 17\n") && s.val[0] == "line 18\nline 19\n");
    }
}
