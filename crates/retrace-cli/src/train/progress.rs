//! Progress bars with ETA (indicatif): one for feature extraction, one per head trained.

use super::fit::Epoch;
use indicatif::{ProgressBar, ProgressStyle};

/// Makes the bars, or hidden ones (`--no-progress`, tests).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Progress {
    pub(crate) shown: bool,
}

fn bar(total: u64, shown: bool, template: &str) -> ProgressBar {
    if !shown {
        return ProgressBar::hidden();
    }
    let style =
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(total).with_style(style)
}

impl Progress {
    /// A bar over the traces of one data file.
    pub(crate) fn extraction(&self, file: &str, traces: usize) -> ProgressBar {
        let b = bar(
            traces as u64,
            self.shown,
            "{msg} {bar:30} {pos}/{len} traces  {per_sec}  ETA {eta}  {elapsed}",
        );
        b.set_message(format!("features of {file}"));
        b
    }

    /// A bar over the epochs of one head; `epoch` moves it and shows the scores.
    pub(crate) fn training(&self, what: &str, epochs: usize) -> EpochBar {
        let b = bar(
            epochs as u64,
            self.shown,
            "{prefix} {bar:30} epoch {pos}/{len}  ETA {eta}  {msg}",
        );
        b.set_prefix(what.to_string());
        EpochBar(b)
    }
}

/// The bar of one head's training; finished (kept on screen) when dropped.
pub(crate) struct EpochBar(ProgressBar);

impl EpochBar {
    pub(crate) fn epoch(&self, e: &Epoch) {
        self.0.set_position(e.epoch as u64);
        self.0.set_message(format!(
            "loss {:.4}  train {:.1}  dev {:.1}",
            e.loss, e.train, e.dev
        ));
    }
}

impl Drop for EpochBar {
    fn drop(&mut self) {
        self.0.abandon();
    }
}
