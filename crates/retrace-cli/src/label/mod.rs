//! `retrace label`: runs an evaluator (usually a voting judge) over traces, labelled or not, and
//! writes its verdicts as dataset rows that `eval` and `train-head` read. Resumable like `eval`
//! (it reuses eval's reader, backends and runner); failures are listed and retried; rows below
//! `--min-agreement` are held back in a sidecar.
//!
//! - `row`: a record and its verdict -> the output row, the input's fields kept.
//! - `files`: OUT and its sidecars, what a rerun skips, rows moved across a changed bar.
//! - `output`: the run's `Output`, routing each answer to its file and tallying it.

mod files;
mod output;
mod row;

pub(crate) use output::Tally;

use crate::common::RunStats;
use crate::common::run;
use crate::common::{ConnectOptions, EvalError, Purpose};
use files::{Paths, Resume};
use output::LabelOutput;
use std::path::PathBuf;

/// `retrace label`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct LabelOptions {
    /// Traces: ProcessBench JSON arrays or JSONL (ProcessBench or ReTraceQA fields), as `eval`
    /// reads them, except that `label` is optional.
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Evaluator that labels [default: the server's default]: usually a judge with
    /// `samples` > 1, or a cascade.
    #[arg(long)]
    pub evaluator: Option<String>,
    /// Output JSONL of labelled rows, appended to and resumed from. Beside it:
    /// OUT-STEM.failed.jsonl (rows whose request failed in the latest run, with the error;
    /// retried by a rerun) and OUT-STEM.below-agreement.jsonl (rows held back by
    /// --min-agreement).
    #[arg(long)]
    pub out: PathBuf,
    /// Keep in OUT only rows whose vote agreement (the share of the judge's samples that put
    /// the first error where the verdict does) is at least this, in [0, 1]. Rows below it, and
    /// rows without a vote, are counted and written to the held-back file instead, and a rerun
    /// does not label them again; a rerun at another bar moves rows between the two files.
    #[arg(long)]
    pub min_agreement: Option<f32>,
    #[command(flatten)]
    pub connect: ConnectOptions,
}

/// What `label` did.
#[derive(Debug)]
pub struct LabelOutcome {
    pub stats: RunStats,
    pub tally: Tally,
    /// Rows the bar moved into OUT from the held-back file, and out of OUT into it, before
    /// labelling.
    pub admitted: usize,
    pub held_back: usize,
    pub out: PathBuf,
    pub held: PathBuf,
    pub failed: PathBuf,
}

/// Runs `retrace label`. Failed rows make it end in `EvalError::Incomplete` after the summary,
/// so a script sees the run is not done.
pub async fn label(opts: LabelOptions) -> Result<LabelOutcome, EvalError> {
    check(&opts)?;
    let backend = crate::common::backend(&opts.connect).await?;
    let evaluator = opts.evaluator.clone().unwrap_or_default();
    let mut spec = crate::common::run_spec(&opts.connect, &opts.data, &evaluator, None);
    spec.purpose = Purpose::Label;
    let spec = run::resolve(&backend, &spec).await?;
    if let Some(dir) = opts.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        crate::common::ensure_dir(dir)?;
    }
    let paths = Paths::new(&opts.out);
    let Resume {
        done,
        admitted,
        held_back,
    } = files::prepare(&paths, &spec.evaluator, opts.min_agreement)?;
    let mut output = LabelOutput::open(&paths, opts.min_agreement)?;
    let stats = run::drive(&backend, &spec, done, &mut output).await?;
    let outcome = LabelOutcome {
        stats,
        tally: output.tally,
        admitted,
        held_back,
        out: paths.out,
        held: paths.held,
        failed: paths.failed,
    };
    print!("{}", summary(&outcome, opts.min_agreement));
    match outcome.tally.failed.len() {
        0 => Ok(outcome),
        n => Err(EvalError::Incomplete(format!(
            "{n} row(s) failed and are not in {}; rerun the same command to retry them",
            outcome.out.display()
        ))),
    }
}

/// The flag rules clap can't express.
fn check(opts: &LabelOptions) -> Result<(), EvalError> {
    if let Some(bar) = opts.min_agreement
        && !(0.0..=1.0).contains(&bar)
    {
        return Err(EvalError::Usage(format!(
            "--min-agreement must lie in [0, 1], got {bar}"
        )));
    }
    let canon = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
    if opts.data.iter().any(|d| canon(d) == canon(&opts.out)) {
        return Err(EvalError::Usage(format!(
            "--out {} is also an input: write the labels to another file",
            opts.out.display()
        )));
    }
    Ok(())
}

/// Failures shown in the summary; the failures file lists them all.
const FAILURES_SHOWN: usize = 10;

/// The end-of-run summary: what was written where, what was held back, what failed and why.
fn summary(o: &LabelOutcome, bar: Option<f32>) -> String {
    let t = &o.tally;
    let by_category: Vec<String> = t.written.iter().map(|(c, n)| format!("{n} {c}")).collect();
    let mut s = format!(
        "labelled {} rows into {} ({}); {} already labelled before this run",
        t.written_total(),
        o.out.display(),
        if by_category.is_empty() {
            "none".into()
        } else {
            by_category.join(", ")
        },
        o.stats.already_done
    );
    s.push('\n');
    if o.admitted + o.held_back > 0 {
        s.push_str(&format!(
            "the bar moved {} rows into {} and {} out of it, without labelling them again\n",
            o.admitted,
            o.out.display(),
            o.held_back
        ));
    }
    if let Some(bar) = bar {
        s.push_str(&format!(
            "held back {} rows below --min-agreement {bar} ({} without a vote) in {}\n",
            t.held,
            t.held_without_vote,
            o.held.display()
        ));
    }
    if o.stats.bad_rows > 0 {
        s.push_str(&format!("skipped {} bad input rows\n", o.stats.bad_rows));
        for b in &o.stats.bad {
            s.push_str(&format!("  skipped: {b}\n"));
        }
    }
    if !t.failed.is_empty() {
        s.push_str(&format!(
            "failed {} rows, listed with their errors in {}:\n",
            t.failed.len(),
            o.failed.display()
        ));
        for f in t.failed.iter().take(FAILURES_SHOWN) {
            s.push_str(&format!("  {}/{}: {}\n", f.dataset, f.id, f.error));
        }
        if t.failed.len() > FAILURES_SHOWN {
            s.push_str(&format!(
                "  ... and {} more\n",
                t.failed.len() - FAILURES_SHOWN
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use output::Failure;

    #[test]
    fn the_summary_names_files_bar_and_failures() {
        let failure = |i: usize| Failure {
            id: format!("r{i}"),
            dataset: "sqa".into(),
            evaluator: "j".into(),
            error: "UNAVAILABLE: HTTP 500".into(),
        };
        let tally = Tally {
            written: [("none".to_string(), 2), ("reasoning".to_string(), 1)].into(),
            held: 2,
            held_without_vote: 1,
            failed: (0..12).map(failure).collect(),
        };
        let outcome = LabelOutcome {
            stats: RunStats::default(),
            tally,
            admitted: 0,
            held_back: 0,
            out: "l.jsonl".into(),
            held: "l.below-agreement.jsonl".into(),
            failed: "l.failed.jsonl".into(),
        };
        let s = summary(&outcome, Some(0.8));
        assert!(
            s.starts_with("labelled 3 rows into l.jsonl (2 none, 1 reasoning)"),
            "{s}"
        );
        assert!(s.contains("held back 2 rows below --min-agreement 0.8 (1 without a vote) in l.below-agreement.jsonl"), "{s}");
        assert!(
            s.contains("failed 12 rows, listed with their errors in l.failed.jsonl:"),
            "{s}"
        );
        assert!(
            s.contains("  sqa/r9: UNAVAILABLE: HTTP 500\n  ... and 2 more\n"),
            "{s}"
        );
        assert!(!s.contains("the bar moved"), "{s}");
        let mut bad = LabelOptions {
            data: vec!["a.jsonl".into()],
            evaluator: None,
            out: "a.jsonl".into(),
            min_agreement: None,
            connect: ConnectOptions {
                server: Some("x".into()),
                config: None,
                set: vec![],
                concurrency: 1,
                limit: None,
                skip_bad: false,
                token_env: None,
                ca_cert: None,
                wait_s: 0.0,
                no_progress: true,
            },
        };
        assert!(
            check(&bad)
                .unwrap_err()
                .to_string()
                .contains("is also an input")
        );
        bad.out = "b.jsonl".into();
        bad.min_agreement = Some(1.5);
        assert!(
            check(&bad)
                .unwrap_err()
                .to_string()
                .contains("[0, 1], got 1.5")
        );
    }
}
