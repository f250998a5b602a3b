//! Files written whole or not at all, and text files read with a useful error.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// What marks the name of [`write_atomic`]'s temporary files: `.NAME.tmp-PID`.
const TEMPORARY: &str = ".tmp-";

/// Whether `name` is that of a temporary file of [`write_atomic`] (left behind only by a
/// process killed mid-write).
pub fn is_temporary(name: &str) -> bool {
    name.starts_with('.') && name.contains(TEMPORARY)
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// crash never leaves a half-written file under the real name. On any failure (a full or
/// read-only disk, a directory in the way) the temporary file is removed, so a failed write
/// leaves the disk as it was, and the error names `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_parts(path, &[bytes])
}

/// [`write_atomic`] of the concatenation of `parts`, written one after another (a large file
/// need not be one buffer first).
pub fn write_atomic_parts<B: AsRef<[u8]>>(path: &Path, parts: &[B]) -> Result<()> {
    write_atomic_with(path, |w| parts.iter().try_for_each(|p| w.write_all(p.as_ref())))
}

/// [`write_atomic`] of what `write` writes, in order (parts made one at a time, as they are
/// written).
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut dyn std::io::Write) -> std::io::Result<()>,
) -> Result<()> {
    use std::io::Write;
    let name = path.file_name().context("output path has no file name")?.to_string_lossy();
    refuse_non_file(path)?;
    let tmp = path.with_file_name(format!(".{name}{TEMPORARY}{}", std::process::id()));
    let written = std::fs::File::create(&tmp)
        .and_then(|f| {
            let mut w = std::io::BufWriter::new(f);
            write(&mut w)?;
            w.flush()
        })
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

/// An error when `path` exists and is not a regular file: the rename that replaces a file
/// whole would put a file in place of a device, pipe or socket (as root, over `/dev/null`).
/// A symbolic link is judged by what it points to.
pub fn refuse_non_file(path: &Path) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::metadata(path) else { return Ok(()) };
    let t = meta.file_type();
    let kind = if t.is_file() {
        return Ok(());
    } else if t.is_dir() {
        "a directory"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    anyhow::bail!("{} is {kind}, not a file: give the path of a file to write", path.display())
}

/// An error when writing `out` would overwrite or remove the command's input `input` (`what`
/// names it, e.g. `--from`): `out` is that file, or a directory holding it, compared by device
/// and inode (so another name for the same file, a hard link or a mount, is found too).
pub fn refuse_output_over_input(out: &Path, input: &Path, what: &str) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(target) = std::fs::metadata(out) else { return Ok(()) };
    let Ok(input_abs) = input.canonicalize() else { return Ok(()) };
    let same = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.dev() == target.dev() && m.ino() == target.ino())
    };
    anyhow::ensure!(
        !input_abs.ancestors().any(same),
        "{} is {what} ({}) or holds it: writing there would destroy the command's own input; \
         give another output",
        out.display(),
        input.display()
    );
    Ok(())
}

/// Reads a whole input file of bounded size: a regular file no larger than the machine's memory
/// (checked before reading), or a pipe (`/dev/stdin`), read up to that size. A device, socket or
/// directory is refused, so `/dev/zero` given as input is an error, not an endless read.
pub fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::FileTypeExt;
    let limit = crate::base::memory::memory_limit();
    let too_large = || {
        anyhow::anyhow!(
            "{} is larger than the machine's memory ({})",
            path.display(),
            crate::base::memory::format_bytes(limit as u128)
        )
    };
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?;
    let kind = meta.file_type();
    anyhow::ensure!(!kind.is_dir(), "{} is a directory, not a file", path.display());
    anyhow::ensure!(
        kind.is_file() || kind.is_fifo(),
        "{} is not a regular file or a pipe",
        path.display()
    );
    if kind.is_file() && meta.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(limit + 1).read_to_end(&mut bytes))
        .with_context(|| format!("cannot read {}", path.display()))?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Reads a UTF-8 text file (as [`read_bytes`]); an invalid file is an error naming the first
/// bad byte's offset.
pub fn read_utf8(path: &Path) -> Result<String> {
    let bytes = read_bytes(path)?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (first invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

/// `path` mapped read-only into memory (a regular file only). A file that another process
/// truncates while it is mapped is outside what the callers guard against: checkpoints are
/// replaced by renaming a new file over them, which leaves a mapped old one intact.
pub fn map_file(path: &Path) -> Result<memmap2::Mmap> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let meta = file.metadata().with_context(|| format!("cannot read {}", path.display()))?;
    anyhow::ensure!(meta.is_file(), "{} is not a regular file", path.display());
    // SAFETY: the map is only read; see above for files changed under it.
    unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))
}

/// 128-bit FNV-1a over several byte strings, as a hex key.
pub fn content_key(parts: &[&[u8]]) -> String {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for p in parts {
        for &b in p.iter().chain((p.len() as u64).to_le_bytes().iter()) {
            h ^= b as u128;
            h = h.wrapping_mul(0x0000000001000000000000000000013B);
        }
    }
    format!("{h:032x}")
}

/// Where cached files live: `$ATTNRES_CACHE`, else `$XDG_CACHE_HOME/attnres`, else
/// `~/.cache/attnres`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ATTNRES_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("attnres");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".cache/attnres"),
        None => std::env::temp_dir().join("attnres-cache"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files in `dir` whose name marks them as temporary.
    fn leftovers(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| is_temporary(n))
            .collect()
    }

    #[test]
    fn devices_pipes_and_directories_are_refused_and_left_as_they_are() {
        use std::os::unix::fs::FileTypeExt;
        let tmp = tempfile::tempdir().unwrap();
        // A private null device (1:3) and a named pipe, made here: never the machine's own.
        let null = tmp.path().join("null");
        let fifo = tmp.path().join("fifo");
        let made = |cmd: &str, args: &[&std::ffi::OsStr]| {
            let ok = std::process::Command::new(cmd).args(args).status();
            assert!(ok.is_ok_and(|s| s.success()), "{cmd} failed (the test needs root, as CI has)");
        };
        made("mknod", &[null.as_os_str(), "c".as_ref(), "1".as_ref(), "3".as_ref()]);
        made("mkfifo", &[fifo.as_os_str()]);
        for (path, kind) in [(&null, "a device"), (&fifo, "a named pipe")] {
            let err = format!("{:#}", write_atomic(path, b"{}").unwrap_err());
            assert!(err.contains(&format!("{} is {kind}, not a file", path.display())), "{err}");
        }
        assert!(std::fs::metadata(&null).unwrap().file_type().is_char_device());
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        assert_eq!(leftovers(tmp.path()), Vec::<String>::new());
    }

    #[test]
    fn an_output_that_is_or_holds_an_input_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("run");
        std::fs::create_dir(&dir).unwrap();
        let input = dir.join("model.gguf");
        std::fs::write(&input, "x").unwrap();
        let link = tmp.path().join("link.gguf");
        std::fs::hard_link(&input, &link).unwrap();
        for out in [&input, &dir, &link, &tmp.path().to_path_buf()] {
            let e = refuse_output_over_input(out, &input, "--from").unwrap_err().to_string();
            assert!(e.contains("or holds it") && e.contains("--from"), "{e}");
        }
        // A sibling, a missing path and a directory inside the input's are fine.
        for out in [tmp.path().join("other"), dir.join("sub"), tmp.path().join("missing")] {
            if out.ends_with("sub") {
                std::fs::create_dir(&out).unwrap();
            }
            refuse_output_over_input(&out, &input, "--from").unwrap();
        }
    }

    #[test]
    fn a_directory_in_the_way_is_refused_naming_the_path_and_left_alone() {
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
