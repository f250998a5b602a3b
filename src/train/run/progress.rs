//! A training run's output: its steps on a progress bar (its own or a comparison's), or as log
//! lines.

use crate::base::progress::{log, new_progress_bar, SharedBar};

/// A run's output channel: a progress bar with a message prefix, or log lines.
pub(crate) struct Progress {
    bar: Option<SharedBar>,
    /// The bar belongs to this run (not to a comparison), so the run clears it when done.
    own: bool,
}

impl Progress {
    /// `shared`: a comparison's bar; else the run's own bar when `bar` is asked and stderr is a
    /// terminal, else log lines. The bar starts at step `pos` of `total`.
    pub(crate) fn new(shared: Option<&SharedBar>, bar: bool, total: u64, pos: u64) -> Progress {
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
    pub(crate) fn say(&self, line: String) {
        match &self.bar {
            Some(b) => b.bar.println(format!("{}{line}", b.prefix())),
            None => log(&line),
        }
    }

    /// After a step: moves the bar, or without a bar logs the step unless an evaluation line
    /// was just said for it.
    pub(crate) fn step(
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
    pub(crate) fn finish(self) {
        if let Some(b) = self.bar.filter(|_| self.own) {
            b.bar.finish_and_clear();
        }
    }
}
