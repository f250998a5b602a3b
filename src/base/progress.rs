//! Where long work reports: a terminal progress bar (one work's own, or one shared by the runs
//! of a comparison) or plain log lines on stderr. Neither ever stops a run: a log line that
//! cannot be written (stderr closed or full) is dropped, and the bar (drawn only when stderr is
//! a terminal) ignores failed draws.

use std::io::Write;

/// Writes one log line to stderr. A stderr that is closed or full is ignored: logging never
/// stops the work it reports on.
pub fn log(line: &str) {
    let _ = std::io::stderr().lock().write_all(format!("{line}\n").as_bytes());
}

/// A progress bar over several runs: this run's steps start at `offset`, and its messages are
/// prefixed with `label`.
#[derive(Clone)]
pub struct SharedBar {
    pub bar: indicatif::ProgressBar,
    pub offset: u64,
    pub label: String,
}

impl SharedBar {
    /// The label and a colon before a message, or nothing.
    pub fn prefix(&self) -> String {
        if self.label.is_empty() {
            String::new()
        } else {
            format!("{}: ", self.label)
        }
    }
}

/// A terminal progress bar of `total` steps (none when stderr is not a terminal).
pub fn new_progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps | {msg} | {elapsed_precise} elapsed, ETA {eta_precise}",
        )
        .expect("valid template"),
    );
    Some(b)
}
