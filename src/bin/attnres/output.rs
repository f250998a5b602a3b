//! Results on stdout: written whole and flushed, and a stdout that is closed or full is an
//! error (the result did not arrive).

use anyhow::{Context, Result};
use std::io::Write;

/// Writes a result (text, numbers, JSON, a table) to stdout and flushes it. A stdout that is
/// closed or full is an error: the result did not arrive.
pub fn output(text: &str) -> Result<()> {
    write_stdout(text.as_bytes())
}

/// Writes bytes of a result to stdout and flushes them (a stream writes piece by piece).
pub fn write_stdout(bytes: &[u8]) -> Result<()> {
    if closed_at_start() {
        let closed = std::io::Error::other("it was closed when attnres started");
        return Err(closed).context(STDOUT);
    }
    let mut out = std::io::stdout().lock();
    out.write_all(bytes).and_then(|()| out.flush()).context(STDOUT)
}

pub const STDOUT: &str = "cannot write to standard output";

/// Whether stdout was closed when the process started (`attnres eval ... >&-`). Rust's runtime
/// puts `/dev/null` in place of a closed standard descriptor before `main`, where writes would
/// succeed and the result go nowhere; so it is looked at before the runtime starts.
fn closed_at_start() -> bool {
    #[cfg(target_os = "linux")]
    return before_main::STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(target_os = "linux"))]
    false
}

#[cfg(target_os = "linux")]
mod before_main {
    use std::sync::atomic::{AtomicBool, Ordering};

    pub static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

    extern "C" {
        fn fcntl(fd: i32, cmd: i32, ...) -> i32;
    }

    extern "C" fn check_stdout() {
        const F_GETFD: i32 = 1;
        // SAFETY: F_GETFD reads the descriptor's flags and changes nothing; -1 means that
        // descriptor 1 is not open.
        if unsafe { fcntl(1, F_GETFD) } == -1 {
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
        }
    }

    /// Run by the C runtime before Rust's, like any constructor in `.init_array`.
    #[used]
    #[link_section = ".init_array"]
    static CHECK_STDOUT: extern "C" fn() = check_stdout;
}
