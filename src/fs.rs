//! Files written whole or not at all, and text files read with a useful error.

use anyhow::{Context, Result};
use std::path::Path;

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// crash never leaves a half-written file under the real name. On any failure (a full or
/// read-only disk, a directory in the way) the temporary file is removed, so a failed write
/// leaves the disk as it was, and the error names `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().context("output path has no file name")?.to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = std::fs::write(&tmp, bytes)
        .with_context(|| format!("cannot write {}", path.display()))
        .and_then(|()| {
            std::fs::rename(&tmp, path)
                .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Reads a UTF-8 text file; an invalid file is an error naming the first bad byte's offset.
pub fn read_utf8(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (first invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files in `dir` whose name marks them as temporary.
    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect()
    }

    #[test]
    fn a_failed_rename_removes_the_temporary_file_and_names_the_path() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("summary.json");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("inside"), "x").unwrap();
        let err = format!("{:#}", write_atomic(&target, b"{}").unwrap_err());
        assert!(err.contains(&target.display().to_string()), "{err}");
        assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
        assert!(target.join("inside").exists(), "the directory in the way is left alone");
    }

    #[test]
    fn a_failed_write_names_the_path_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("missing").join("model.safetensors");
        let err = format!("{:#}", write_atomic(&target, b"abc").unwrap_err());
        assert!(err.contains(&target.display().to_string()), "{err}");
        assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
    }

    #[test]
    fn a_successful_write_replaces_the_file_and_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let target = tmp.path().join("a.txt");
        std::fs::write(&target, "old").unwrap();
        write_atomic(&target, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "new");
        assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
    }
}
