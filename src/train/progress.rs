//! Where a run's messages go: a terminal progress bar (the run's own, or one shared by the runs
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
    fn prefix(&self) -> String {
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

/// A run's output channel: a progress bar with a message prefix, or log lines.
pub(super) struct Progress {
    bar: Option<SharedBar>,
    /// The bar belongs to this run (not to a comparison), so the run clears it when done.
    own: bool,
}

impl Progress {
    /// `shared`: a comparison's bar; else the run's own bar when `bar` is asked and stderr is a
    /// terminal, else log lines. The bar starts at step `pos` of `total`.
    pub(super) fn new(shared: Option<&SharedBar>, bar: bool, total: u64, pos: u64) -> Progress {
        if let Some(b) = shared {
            b.bar.set_position(b.offset + pos);
            return Progress { bar: Some(b.clone()), own: false };
        }
        let bar = bar.then(|| new_progress_bar(total)).flatten().map(|bar| {
            bar.set_position(pos);
            SharedBar { bar, offset: 0, label: String::new() }
        });
        Progress { bar, own: true }
    }

    /// A line above the bar, or on stderr.
    pub(super) fn say(&self, line: String) {
        match &self.bar {
            Some(b) => b.bar.println(format!("{}{line}", b.prefix())),
            None => log(&line),
        }
    }

    /// After a step: moves the bar, or without a bar logs the step unless an evaluation line
    /// was just said for it.
    pub(super) fn step(
        &self,
        step: usize,
        total: usize,
        train_loss: f64,
        tps: f64,
        evaluated: bool,
    ) {
        if let Some(b) = &self.bar {
            b.bar.set_position(b.offset + step as u64);
            b.bar.set_message(format!("{}loss {train_loss:.3} | {tps:.0} tok/s", b.prefix()));
        } else if !evaluated {
            log(&format!("step {step}/{total}: train loss {train_loss:.4}, {tps:.0} tokens/s"));
        }
    }

    /// Clears the run's own bar; a comparison's bar lives on.
    pub(super) fn finish(self) {
        if let Some(b) = self.bar.filter(|_| self.own) {
            b.bar.finish_and_clear();
        }
    }
}
