//! `retrace eval` and `retrace calibrate`: their options (clap) and their flow: connect, score
//! (resumably), analyse the predictions file, write the report, print the headline. What they
//! stand on (datasets, the client and run driver, the metric, reports) is the tools' floor,
//! `common/`. `guarantee.rs`: what a guaranteed cascade would keep, measured offline.

mod guarantee;

use crate::common::run::score;
use crate::common::{
    Analysis, Analyzer, Calibration, ConnectOptions, EvalBackend, EvalError, Report, Row, RunStats,
    ScoredTrace, Summary, backend, ensure_dir, read_rows, render_html, render_markdown,
    rethreshold, run_spec, shown, sweep,
};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// `retrace eval`: judge labelled traces, score them with ProcessBench's metric, write a report.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalOptions {
    /// Labelled data: ProcessBench JSON arrays or JSONL (ProcessBench or ReTraceQA fields).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Evaluator to use [default: the server's default].
    #[arg(long)]
    pub evaluator: Option<String>,
    /// Overrides the evaluator's threshold, in [0, 1].
    #[arg(long)]
    pub threshold: Option<f32>,
    /// Output folder: predictions.jsonl (resumed when present), report.md, report.html,
    /// summary.json.
    #[arg(long, default_value = "retrace-eval")]
    pub out: PathBuf,
    #[command(flatten)]
    pub connect: ConnectOptions,
}

/// `retrace calibrate`: choose each evaluator's F1-maximising threshold on one set, test on another.
#[derive(Debug, Clone, clap::Args)]
pub struct CalibrateOptions {
    /// Data the threshold is chosen on.
    #[arg(long, num_args = 1.., required = true)]
    pub calibrate_on: Vec<PathBuf>,
    /// Held-out data the chosen threshold is measured on; must not share traces with
    /// --calibrate-on.
    #[arg(long, num_args = 1..)]
    pub test_on: Vec<PathBuf>,
    /// Evaluator(s) to calibrate, repeatable [default: the server's default].
    #[arg(long)]
    pub evaluator: Vec<String>,
    /// Also report each split's own best threshold.
    #[arg(long)]
    pub per_split: bool,
    /// Also choose the confidence threshold a cascade with this target_agreement would keep
    /// PRM verdicts above (the labels standing for its judge's), for each way of reading
    /// confidence, and measure it on --test-on: the share kept and their agreement.
    #[arg(long, value_parser = probability)]
    pub target_agreement: Option<f64>,
    /// The guarantee's probability (target_confidence) [default: 0.9].
    #[arg(long, value_parser = probability, requires = "target_agreement")]
    pub target_confidence: Option<f64>,
    /// Output folder: one subfolder per evaluator with the cached scores
    /// (calibration.jsonl, test.jsonl; reused on rerun) and the report (with
    /// --target-agreement, also guarantee.txt and guarantee.json).
    #[arg(long, default_value = "retrace-calibrate")]
    pub out: PathBuf,
    #[command(flatten)]
    pub connect: ConnectOptions,
}

/// A probability strictly inside (0, 1).
fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if p > 0.0 && p < 1.0 => Ok(p),
        _ => Err(format!(
            "{s:?} is not a probability strictly between 0 and 1"
        )),
    }
}

/// What `eval` produced.
#[derive(Debug)]
pub struct EvalOutcome {
    pub stats: RunStats,
    pub analysis: Analysis,
    pub predictions: PathBuf,
}

/// What `calibrate` chose for one evaluator.
#[derive(Debug)]
pub struct Calibrated {
    pub evaluator: String,
    pub threshold: f32,
    pub calibration_f1: f64,
    pub test_f1: Option<(Option<f64>, Option<f64>)>,
}

/// Reads a predictions file whole (calibration needs every score at once).
fn load_rows(path: &Path) -> Result<Vec<Row>, EvalError> {
    let mut rows = Vec::new();
    read_rows(path, |r| rows.push(r))?;
    Ok(rows)
}

fn stats_notes(what: &str, s: &RunStats, file: &Path) -> Vec<String> {
    let mut notes = vec![format!(
        "{what}: {} traces judged in this run ({} failed), {} already in `{}`, {} bad rows skipped",
        s.judged,
        s.failed,
        s.already_done,
        shown(file),
        s.bad_rows
    )];
    notes.extend(s.bad.iter().map(|b| format!("skipped: {b}")));
    notes
}

fn write_report(
    dir: &Path,
    report: &Report,
    summary: &impl serde::Serialize,
) -> Result<(), EvalError> {
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text)
            .map_err(|e| EvalError::io(format!("writing {}", shown(&path)), e))
    };
    write("report.md", render_markdown(report))?;
    write("report.html", render_html(report))?;
    let json = serde_json::to_string_pretty(summary)
        .map_err(|e| EvalError::io("encoding summary.json", e.into()))?;
    write("summary.json", json + "\n")
}

fn check_threshold(t: Option<f32>) -> Result<(), EvalError> {
    match t {
        Some(v) if !(0.0..=1.0).contains(&v) => Err(EvalError::Usage(format!(
            "--threshold must lie in [0, 1], got {v}"
        ))),
        _ => Ok(()),
    }
}

/// Runs `retrace eval`.
pub async fn eval(opts: EvalOptions) -> Result<EvalOutcome, EvalError> {
    check_threshold(opts.threshold)?;
    let backend = backend(&opts.connect).await?;
    let dir = ensure_dir(&opts.out)?;
    let predictions = dir.join("predictions.jsonl");
    let evaluator = opts.evaluator.clone().unwrap_or_default();
    let spec = run_spec(&opts.connect, &opts.data, &evaluator, opts.threshold);
    let stats = score(&backend, &spec, &predictions).await?;
    let mut analyzer = Analyzer::default();
    read_rows(&predictions, |r| analyzer.add(&r))?;
    let analysis = analyzer.finish();
    let mut notes = vec![format!(
        "evaluator: `{}`",
        backend.resolve(&evaluator).await?
    )];
    notes.push(format!(
        "data: {}",
        opts.data
            .iter()
            .map(|p| shown(p))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    notes.extend(stats_notes("run", &stats, &predictions));
    notes.push(format!(
        "the report covers every row of `{}` ({} rows)",
        shown(&predictions),
        analysis.rows
    ));
    let report = Report {
        title: "retrace eval".into(),
        notes,
        analysis,
        calibration: None,
    };
    write_report(&dir, &report, &report.analysis)?;
    print!("{}", headline(&report.analysis));
    for b in &stats.bad {
        eprintln!("skipped a bad row: {b}");
    }
    if stats.failed > 0 {
        eprintln!(
            "{} requests failed; they count as wrong predictions",
            stats.failed
        );
    }
    println!(
        "wrote {}, report.md, report.html and summary.json",
        shown(&predictions)
    );
    Ok(EvalOutcome {
        stats,
        analysis: report.analysis,
        predictions,
    })
}

/// The ProcessBench table as plain text.
fn headline(a: &Analysis) -> String {
    let mut out = format!(
        "{:<16} {:>7} {:>10} {:>12} {:>7}\n",
        "split", "traces", "error acc", "correct acc", "F1"
    );
    let p = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.1}"));
    for s in &a.summary.splits {
        out.push_str(&format!(
            "{:<16} {:>7} {:>10} {:>12} {:>7}\n",
            s.split,
            s.counts.total(),
            p(s.error_acc),
            p(s.correct_acc),
            p(s.f1)
        ));
    }
    let av = &a.summary.average;
    out.push_str(&format!(
        "{:<16} {:>7} {:>10} {:>12} {:>7}\n",
        "average",
        a.rows,
        p(av.error_acc),
        p(av.correct_acc),
        p(av.f1)
    ));
    if let Some(b) = &a.best_of_n {
        out.push_str(&format!(
            "\nBest-of-N: {} questions ({} with right and wrong candidates), right picks in %\n",
            b.questions, b.mixed
        ));
        for r in b.rows() {
            out.push_str(&format!("{:<48} {:>6} {:>8}\n", r[0], r[1], r[2]));
        }
    }
    out
}

/// Runs `retrace calibrate`.
pub async fn calibrate(opts: CalibrateOptions) -> Result<Vec<Calibrated>, EvalError> {
    let canon = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
    let cal_files: HashSet<PathBuf> = opts.calibrate_on.iter().map(canon).collect();
    if let Some(both) = opts.test_on.iter().find(|p| cal_files.contains(&canon(p))) {
        return Err(EvalError::Usage(format!(
            "{} is given to both --calibrate-on and --test-on: keep calibration and test data apart",
            shown(both)
        )));
    }
    let backend = backend(&opts.connect).await?;
    let names = if opts.evaluator.is_empty() {
        vec![String::new()]
    } else {
        opts.evaluator.clone()
    };
    let mut chosen = Vec::new();
    for requested in names {
        let name = backend.resolve(&requested).await?;
        chosen.push(calibrate_one(&opts, &backend, &name).await?);
    }
    Ok(chosen)
}

/// One evaluator: score both sets (cached), sweep, re-decide, write the report, print the line.
async fn calibrate_one(
    opts: &CalibrateOptions,
    backend: &EvalBackend,
    name: &str,
) -> Result<Calibrated, EvalError> {
    let dir = ensure_dir(&opts.out.join(name))?;
    let mut notes = vec![format!("evaluator: `{name}`")];
    let (cal_rows, test_rows) = score_sets(opts, backend, name, &dir, &mut notes).await?;
    // An outcome model alone has no step scores to sweep: every re-decided index would be -1.
    if cal_rows
        .iter()
        .any(|r| r.prediction.is_some() && r.step_scores.is_empty() && r.outcome_score.is_some())
    {
        return Err(EvalError::Usage(format!(
            "evaluator {name:?} is an outcome-rm PRM, which gives no step scores: calibrate sweeps \
             a step threshold; calibrate the composite it belongs to, or its step evaluator"
        )));
    }
    let traces: Vec<ScoredTrace> = cal_rows.iter().map(ScoredTrace::of).collect();
    if traces.iter().all(|t| t.scores.is_none()) {
        return Err(EvalError::Usage(format!(
            "no calibration trace was judged for evaluator {name:?}: nothing to calibrate on"
        )));
    }
    let curve = sweep(&traces);
    let choice = curve.best();
    let t = choice.threshold;
    let per_split = match opts.per_split {
        true => curve.best_per_split(),
        false => Vec::new(),
    };
    let (analysis, test) = redecide(&cal_rows, test_rows.as_deref(), t);
    notes.push(format!(
        "the tables below are the {} data re-decided at threshold {t} from the cached scores",
        if test.is_some() {
            "test"
        } else {
            "calibration"
        }
    ));
    let result = Calibrated {
        evaluator: name.to_string(),
        threshold: t,
        calibration_f1: choice.f1,
        test_f1: test.as_ref().map(|(a, b)| (a.average.f1, b.average.f1)),
    };
    let report = Report {
        title: format!("retrace calibrate: {name}"),
        notes,
        analysis,
        calibration: Some(Calibration {
            evaluator: name.to_string(),
            curve,
            choice: choice.clone(),
            per_split,
            test,
        }),
    };
    write_report(&dir, &report, &choice)?;
    print_choice(&result, &dir);
    if let Some(agreement) = opts.target_agreement {
        let target = retrace::guarantee::AgreementTarget {
            agreement,
            confidence: opts.target_confidence.unwrap_or(0.9),
        };
        let measured = guarantee::measure(target, &cal_rows, test_rows.as_deref());
        let text = guarantee::render(target, &measured);
        print!("{text}");
        let json = guarantee::json(target, &measured).to_string() + "\n";
        for (file, body) in [("guarantee.txt", &text), ("guarantee.json", &json)] {
            let path = dir.join(file);
            std::fs::write(&path, body).map_err(|source| EvalError::Io {
                what: format!("writing {}", shown(&path)),
                source,
            })?;
        }
    }
    Ok(result)
}

/// Scores the calibration set, and the test set when given, into `dir` (reusing what is
/// cached there); refuses a trace in both.
async fn score_sets(
    opts: &CalibrateOptions,
    backend: &EvalBackend,
    name: &str,
    dir: &Path,
    notes: &mut Vec<String>,
) -> Result<(Vec<Row>, Option<Vec<Row>>), EvalError> {
    let cal_path = dir.join("calibration.jsonl");
    let cal_spec = run_spec(&opts.connect, &opts.calibrate_on, name, None);
    let cal_stats = score(backend, &cal_spec, &cal_path).await?;
    let cal_rows = load_rows(&cal_path)?;
    notes.extend(stats_notes("calibration", &cal_stats, &cal_path));
    if opts.test_on.is_empty() {
        return Ok((cal_rows, None));
    }
    let test_path = dir.join("test.jsonl");
    let s = score(
        backend,
        &run_spec(&opts.connect, &opts.test_on, name, None),
        &test_path,
    )
    .await?;
    notes.extend(stats_notes("test", &s, &test_path));
    let test = load_rows(&test_path)?;
    let keys: HashSet<_> = cal_rows.iter().map(Row::key).collect();
    if let Some(r) = test.iter().find(|r| keys.contains(&r.key())) {
        return Err(EvalError::Usage(format!(
            "trace {:?} of split {:?} is in both the calibration and the test data: keep them apart",
            r.id, r.split
        )));
    }
    Ok((cal_rows, Some(test)))
}

/// The analysis of the test rows (else the calibration rows) re-decided at `t`; with test rows,
/// their summaries as served and at `t`.
fn redecide(
    cal_rows: &[Row],
    test_rows: Option<&[Row]>,
    t: f32,
) -> (Analysis, Option<(Summary, Summary)>) {
    match test_rows {
        Some(rows) => {
            let served = Analysis::of(rows).summary;
            let tuned: Vec<Row> = rows.iter().map(|r| rethreshold(r, t)).collect();
            let analysis = Analysis::of(&tuned);
            let tuned_summary = analysis.summary.clone();
            (analysis, Some((served, tuned_summary)))
        }
        None => {
            let tuned: Vec<Row> = cal_rows.iter().map(|r| rethreshold(r, t)).collect();
            (Analysis::of(&tuned), None)
        }
    }
}

/// The headline and the config line for one evaluator.
fn print_choice(result: &Calibrated, dir: &Path) {
    let p = |v: Option<f64>| v.map_or_else(|| "n/a".into(), |v| format!("{v:.2}"));
    let test_note = match result.test_f1 {
        Some((served, tuned)) => format!(
            "; test mean F1 {} at this threshold ({} as served)",
            p(tuned),
            p(served)
        ),
        None => "; no --test-on data, so no held-out figure".into(),
    };
    println!(
        "# evaluator {:?}: calibration mean F1 {:.2}{test_note}; report in {}",
        result.evaluator,
        result.calibration_f1,
        shown(dir)
    );
    println!("threshold = {}", result.threshold);
}
