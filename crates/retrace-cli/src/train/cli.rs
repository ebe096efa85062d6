//! `retrace train-head`'s options and its flow: read and split the data, load the base, get
//! the features (cached), train and decide on dev, write the head folder.

use super::cache::FeatureCache;
use super::choose::{Candidate, Force, Outcome, Settings, decide};
use super::data::{self, DataFile, Dataset};
use super::extract::{Base, Extraction, features, load_base};
use super::fit::Params;
use super::output::{Content, check_out, write_folder};
use super::progress::Progress;
use super::select::{CATEGORIES, OwnThreshold, Problem, TraceRows};
use super::taps::{self, Tap};
use super::{TrainError, report};
use crate::common::{Analysis, Outcome as RowOutcome, Row, first_below};
use retrace::ErrorCategory;
use retrace::Family;
use retrace::{DeviceSpec, Dtype};
use retrace::{HEAD_VERSION, HeadConfig};
use retrace_model::{HEAD_CONFIG, HEAD_WEIGHTS, head_tensors};
use std::path::PathBuf;
use std::time::Instant;

/// `retrace train-head`.
#[derive(Debug, Clone, clap::Args)]
#[command(after_long_help = LABELS)]
pub struct TrainOptions {
    /// The frozen base: a Hugging Face folder or a .gguf file, any decoder the server loads.
    #[arg(long)]
    pub base: PathBuf,
    /// Labelled traces: any file `retrace eval` reads (ProcessBench JSON arrays, JSONL in
    /// ProcessBench or ReTraceQA shape, `retrace label` output with categories).
    #[arg(long, num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Dev data (taps, head kind, epochs and threshold are chosen on it); must share no
    /// question with --data. Without it, --dev-share of --data's questions are held out.
    #[arg(long, num_args = 1..)]
    pub dev: Vec<PathBuf>,
    /// Held-out test data, scored by the head kept and never used to choose anything; must
    /// share no question with --data or --dev. Its F1 per split is printed and its scores
    /// written to test-scores.jsonl (as `retrace eval` writes predictions).
    #[arg(long, num_args = 1..)]
    pub test: Vec<PathBuf>,
    /// Share of --data's distinct questions held out as dev when --dev is not given.
    #[arg(long, default_value_t = 0.2)]
    pub dev_share: f64,
    /// The head folder to write (refused if it exists, unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
    /// The PRM family whose formatting (and read positions) the head uses.
    #[arg(long, default_value = "chat-lm")]
    pub format: String,
    /// Candidate taps, comma-separated: final (after the final norm), topN (mean of the top N
    /// layers), middle, a layer N, a range A-B. The best on dev is kept.
    #[arg(long, default_value = taps::DEFAULT, value_delimiter = ',')]
    pub taps: Vec<String>,
    /// Feature cache folder [default: the cache folder's features/].
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Seeds the dev split, the shuffles and the MLP's initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[arg(long, default_value_t = 60)]
    pub epochs: usize,
    /// Epochs without a better dev score before training stops.
    #[arg(long, default_value_t = 8)]
    pub patience: usize,
    /// AdamW's learning rate.
    #[arg(long, default_value_t = 1e-2)]
    pub lr: f64,
    /// AdamW's (decoupled) weight decay.
    #[arg(long, default_value_t = 1e-2)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Hidden width of the MLP tried against the logistic head; 0 tries none.
    #[arg(long, default_value_t = 64)]
    pub mlp_hidden: usize,
    /// Width of the trace probe tried against the heads that read each step alone: a GRU over
    /// the trace's steps in order, so a step's score reads the steps before it; 0 tries none.
    #[arg(long, default_value_t = 32)]
    pub trace_width: usize,
    /// Dev F1 points by which a larger head (the MLP, then the trace probe) must beat the head
    /// kept so far to be kept.
    #[arg(long, alias = "mlp-margin", default_value_t = 1.0)]
    pub head_margin: f64,
    /// The step head to keep whatever dev says: logistic, mlp or trace; auto lets dev decide.
    #[arg(long, default_value = "auto", value_parser = ["auto", "logistic", "mlp", "trace"])]
    pub head: String,
    /// Where the base runs: cpu, cuda, cuda:N [default: cpu].
    #[arg(long)]
    pub device: Option<DeviceSpec>,
    /// The base's dtype [default: f32 on the CPU, bf16 on a GPU].
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    pub dtype: Option<String>,
    /// Trains on at most N of the training traces, drawn by --seed (dev is unchanged): for a
    /// learning curve, whose points all read the whole files' cached features.
    #[arg(long)]
    pub max_train: Option<usize>,
    /// No progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

const LABELS: &str = "Labels: the task defines only a trace's first error, so steps before a \
row's `label` are trained as correct, the step at `label` as wrong, and the steps after it are \
not trained on; a row with label -1 trains every step as correct. Where rows carry a \
`category`, a second head learns none / misinterpretation / hallucination / reasoning (the \
first wrong step as its category, correct steps as none).";

/// What `train-head` wrote.
#[derive(Debug)]
pub struct Trained {
    pub out: PathBuf,
    pub dev_f1: f64,
    pub threshold: f32,
    pub head: &'static str,
    pub layers: retrace::HeadLayers,
    /// The tap kept, as --taps named it.
    pub tap: String,
    /// Traces trained on (after --max-train).
    pub train_traces: usize,
    /// The features: how long getting them took, and what was extracted rather than read
    /// from the cache.
    pub extraction: Extraction,
    /// Seconds spent training and choosing on dev (every candidate head, and the threshold).
    pub train_s: f64,
    /// The kept head on --test, when given.
    pub test: Option<Analysis>,
    /// Each --test split at a threshold from a few of its own traces.
    pub own: Vec<OwnThreshold>,
}

impl TrainOptions {
    fn check(&self) -> Result<(Family, Settings), TrainError> {
        let usage = |m: &str| Err(TrainError::Usage(m.into()));
        let format = Family::parse(&self.format).ok_or_else(|| {
            TrainError::Usage(format!(
                "--format {:?} is not a PRM family's format ({}): name the format the head \
                 reads its base through, e.g. chat-lm",
                self.format,
                Family::names()
            ))
        })?;
        if self.epochs == 0 || self.batch_size == 0 {
            return usage("--epochs and --batch-size must be at least 1");
        }
        let positive = |v: f64| v > 0.0 && v.is_finite();
        let not_negative = |v: f64| v == 0.0 || positive(v);
        if !positive(self.lr) || !not_negative(self.weight_decay) {
            return usage("--lr must be positive and --weight-decay not negative");
        }
        if !positive(self.dev_share) || self.dev_share >= 1.0 {
            return usage("--dev-share must lie strictly between 0 and 1");
        }
        if self.max_train == Some(0) {
            return usage("--max-train must be at least 1");
        }
        if !not_negative(self.head_margin) {
            return usage("--head-margin must not be negative");
        }
        let force = match self.head.as_str() {
            "logistic" => Some(Force::Logistic),
            "mlp" if self.mlp_hidden == 0 => return usage("--head mlp needs --mlp-hidden > 0"),
            "mlp" => Some(Force::Mlp),
            "trace" if self.trace_width == 0 => {
                return usage("--head trace needs --trace-width > 0");
            }
            "trace" => Some(Force::Trace),
            _ => None,
        };
        let params = Params {
            epochs: self.epochs,
            patience: self.patience,
            lr: self.lr,
            weight_decay: self.weight_decay,
            batch_size: self.batch_size,
            seed: self.seed,
        };
        Ok((
            format,
            Settings {
                params,
                mlp_hidden: self.mlp_hidden,
                trace_width: self.trace_width,
                margin: self.head_margin,
                force,
            },
        ))
    }

    fn dtype(&self) -> Option<Dtype> {
        self.dtype.as_deref().map(|d| match d {
            "bf16" => Dtype::Bf16,
            "f16" => Dtype::F16,
            _ => Dtype::F32,
        })
    }
}

/// The data: `--data` and `--dev` as read (features are per whole file), and the traces
/// each side takes, as indices into `--data`'s traces followed by `--dev`'s.
struct Split {
    data: Dataset,
    dev_data: Dataset,
    test_data: Dataset,
    train: Vec<usize>,
    dev: Vec<usize>,
}

impl Split {
    fn trace(&self, i: usize) -> &data::Labelled {
        let (n, m) = (self.data.traces.len(), self.dev_data.traces.len());
        match i {
            i if i < n => &self.data.traces[i],
            i if i < n + m => &self.dev_data.traces[i - n],
            i => &self.test_data.traces[i - n - m],
        }
    }

    /// The test traces, as indices after --data's and --dev's.
    fn test(&self) -> std::ops::Range<usize> {
        let start = self.data.traces.len() + self.dev_data.traces.len();
        start..start + self.test_data.traces.len()
    }

    /// The files a side's traces come from, each with the rows it took.
    fn files(&self, side: &[usize]) -> Vec<DataFile> {
        let n = self.data.files.len();
        let mut files: Vec<DataFile> = (self.data.files.iter())
            .chain(&self.dev_data.files)
            .cloned()
            .map(|f| DataFile { rows: 0, ..f })
            .collect();
        for &i in side {
            let t = self.trace(i);
            let at = if i < self.data.traces.len() {
                t.file
            } else {
                n + t.file
            };
            files[at].rows += 1;
        }
        files.retain(|f| f.rows > 0);
        files
    }
}

fn split(opts: &TrainOptions) -> Result<Split, TrainError> {
    let data = data::read(&opts.data)?;
    let n = data.traces.len();
    let test_data = match opts.test.is_empty() {
        true => Dataset::default(),
        false => data::read(&opts.test)?,
    };
    data::check_disjoint(&data, "--data", &test_data, "--test")?;
    if !opts.dev.is_empty() {
        let dev_data = data::read(&opts.dev)?;
        data::check_disjoint(&data, "--data", &dev_data, "--dev")?;
        data::check_disjoint(&dev_data, "--dev", &test_data, "--test")?;
        let m = dev_data.traces.len();
        return Ok(Split {
            data,
            dev_data,
            test_data,
            train: (0..n).collect(),
            dev: (n..n + m).collect(),
        });
    }
    let (train, dev) = data::hold_out(&data.traces, opts.dev_share, opts.seed);
    if train.is_empty() || dev.is_empty() {
        return Err(TrainError::Usage(
            "--data holds too few distinct questions to hold out a dev share; give --dev".into(),
        ));
    }
    Ok(Split {
        data,
        dev_data: Dataset::default(),
        test_data,
        train,
        dev,
    })
}

/// `split` with its training side cut to `max` traces, drawn by `seed`.
fn limit(mut split: Split, max: Option<usize>, seed: u64) -> Split {
    if let Some(max) = max.filter(|&m| m < split.train.len()) {
        split.train = data::sample(&split.train, max, seed);
    }
    split
}

/// Runs `retrace train-head`.
pub fn train_head(opts: TrainOptions) -> Result<Trained, TrainError> {
    let (format, settings) = opts.check()?;
    check_out(&opts.out, opts.force)?;
    let split = limit(split(&opts)?, opts.max_train, opts.seed);
    let counts = data::label_counts(split.train.iter().map(|&i| split.trace(i)));
    data::check_two_classes(&counts, &split.files(&split.train))?;
    let base = load_base(&opts.base, format, opts.device, opts.dtype())?;
    let taps = taps::resolve(&opts.taps, base.extractor.num_layers())?;
    let progress = Progress {
        shown: !opts.no_progress,
    };
    let cache = FeatureCache {
        dir: opts
            .cache
            .clone()
            .unwrap_or_else(|| retrace::Env::process().cache_dir().join("features")),
    };
    let sets = [&split.data, &split.dev_data, &split.test_data];
    let parts = taps::parts(&taps);
    let (columns, extraction) = features(&base, &parts, &sets, &cache, &progress)?;
    let traces = layout(&sets);
    let problem = Problem {
        traces: &traces,
        train: &split.train,
        dev: &split.dev,
    };
    let candidates = taps
        .into_iter()
        .map(|tap| {
            let rows = tap.rows(&parts, &columns)?;
            Ok(Candidate { tap, rows })
        })
        .collect::<Result<Vec<_>, TrainError>>()?;
    let started = Instant::now();
    let outcome = decide(&problem, &candidates, &settings, &progress)?;
    let train_s = started.elapsed().as_secs_f64();
    let config = head_config(&opts, &base, &outcome, &split, counts);
    let test_rows = write(&opts, &config, &outcome, &problem, &split)?;
    Ok(Trained {
        out: opts.out.clone(),
        dev_f1: outcome.threshold.f1,
        threshold: config.threshold,
        head: config.head.name(),
        layers: config.layers,
        tap: outcome.tap().name.clone(),
        train_traces: split.train.len(),
        extraction,
        train_s,
        test: (!test_rows.is_empty()).then(|| Analysis::of(&test_rows)),
        own: problem.own_thresholds(&split.test().collect::<Vec<_>>(), &outcome.probs),
    })
}

/// Where each trace's steps sit in the feature rows.
fn layout(sets: &[&Dataset]) -> Vec<TraceRows> {
    let mut start = 0;
    let mut out = Vec::new();
    for set in sets {
        for t in &set.traces {
            out.push(TraceRows {
                split: t.record.split.clone(),
                label: t.label,
                category: t.record.category,
                start,
                len: t.steps.len(),
            });
            start += t.steps.len();
        }
    }
    out
}

fn head_config(
    opts: &TrainOptions,
    base: &Base,
    out: &Outcome,
    split: &Split,
    label_counts: data::LabelCounts,
) -> HeadConfig {
    let tap: &Tap = out.tap();
    HeadConfig {
        retrace_head: HEAD_VERSION,
        base: base.path.display().to_string(),
        base_sha256: base.sha256.clone(),
        dtype: Some(base.dtype),
        format: base.format,
        layers: retrace::HeadLayers(tap.parts.clone()),
        pools: tap.recorded_pools(),
        hidden_size: base.extractor.hidden_size(),
        head: out.kind(),
        threshold: out.threshold.threshold,
        categories: out.category.as_ref().map(|_| CATEGORIES.to_vec()),
        label_counts: Some(label_counts),
        data: split.files(&split.train),
        dev: split.files(&split.dev),
        seed: opts.seed,
        dev_f1: Some(out.threshold.f1),
    }
}

/// Traces (dev's or test's) as `eval` predictions rows: the scores a server would give, the
/// first step below the threshold, and the category head's choice there.
fn scored_rows(out: &Outcome, p: &Problem, split: &Split, traces: &[usize]) -> Vec<Row> {
    let t = out.threshold.threshold;
    traces
        .iter()
        .map(|&i| {
            let labelled = split.trace(i);
            let rows = &p.traces[i];
            let scores = out.probs[rows.start..rows.start + rows.len].to_vec();
            let first = first_below(&scores, t);
            let category = match (first, &out.categories) {
                (-1, _) => ErrorCategory::None,
                (k, Some(c)) => c[rows.start + k as usize],
                (_, None) => ErrorCategory::Unspecified,
            };
            let outcome = RowOutcome::Judged {
                evaluator: "head".into(),
                first_error: first,
                category,
                // The server's default aggregate, min over the steps.
                trace_score: scores.iter().copied().fold(f32::INFINITY, f32::min),
                outcome_score: None,
                step_scores: scores,
                threshold: t,
                steps: labelled.steps.clone(),
                rationale: None,
                agreement: None,
            };
            Row::new(&labelled.record, labelled.label, outcome)
        })
        .collect()
}

/// Writes the head folder; returns the --test rows it scored (none without --test).
fn write(
    opts: &TrainOptions,
    config: &HeadConfig,
    out: &Outcome,
    p: &Problem,
    split: &Split,
) -> Result<Vec<Row>, TrainError> {
    let rows = scored_rows(out, p, split, p.dev);
    let analysis = Analysis::of(&rows);
    let test: Vec<usize> = split.test().collect();
    let test_rows = scored_rows(out, p, split, &test);
    let (md, html) = report::render(config, out, &analysis);
    let mut tensors = out.head().tensors();
    let norm = out.norm();
    tensors.insert(head_tensors::NORM_MEAN.into(), norm.mean.clone());
    tensors.insert(head_tensors::NORM_SCALE.into(), norm.scale.clone());
    if let Some(c) = &out.category {
        tensors.extend(c.head.tensors());
    }
    let jsonl = |rows: &[Row]| -> String {
        rows.iter()
            .map(|r| serde_json::to_string(r).unwrap_or_default() + "\n")
            .collect()
    };
    let mut files = vec![
        (HEAD_CONFIG, Content::Text(config.to_json())),
        (HEAD_WEIGHTS, Content::Tensors(tensors)),
        ("dev-scores.jsonl", Content::Text(jsonl(&rows))),
        ("report.md", Content::Text(md)),
        ("report.html", Content::Text(html)),
    ];
    if !test_rows.is_empty() {
        files.push(("test-scores.jsonl", Content::Text(jsonl(&test_rows))));
    }
    write_folder(&opts.out, opts.force, &files)?;
    Ok(test_rows)
}
