//! Features from the frozen base: the server's `Extractor` (its loading, formatting, batching
//! and prefix cache), one data file at a time through the feature cache.

use super::TrainError;
use super::cache::{Entry, FeatureCache, Key};
use super::data::{Dataset, Labelled};
use super::progress::Progress;
use super::taps::TapPart;
use crate::common::DataError;
use candle_core::{Device, Tensor};
use retrace::{Backend, CandleConfig, DeviceSpec, Dtype, PrmConfig};
use retrace::{ExtractError, Extractor};
use retrace::{Family, Pool};
use retrace::{Step, Trace};
use std::path::{Path, PathBuf};

/// The base, loaded, with what ties features to it.
pub(crate) struct Base {
    pub(crate) extractor: Extractor,
    /// The checkpoint, absolute.
    pub(crate) path: PathBuf,
    pub(crate) sha256: String,
    pub(crate) format: Family,
    /// The dtype it runs in, which the head records: serving must run the base in it too.
    pub(crate) dtype: Dtype,
    /// The device and dtype it runs in, as the cache key records them.
    pub(crate) precision: String,
}

/// Loads `path` with `format`'s formatting on `device` in `dtype` (the server's defaults when
/// unset); every failure names `--base` and the path.
pub(crate) fn load_base(
    path: &Path,
    format: Family,
    device: Option<DeviceSpec>,
    dtype: Option<Dtype>,
) -> Result<Base, TrainError> {
    let bad = |m: String| TrainError::Usage(format!("--base {}: {m}", path.display()));
    let abs = std::fs::canonicalize(path).map_err(|e| bad(e.to_string()))?;
    let cfg = PrmConfig {
        family: format.into(),
        model: abs.display().to_string(),
        backend: Backend::Candle,
        vllm: None,
        candle: CandleConfig {
            device,
            dtype,
            ..CandleConfig::default()
        },
    };
    let extractor = Extractor::load(&cfg).map_err(|e| bad(e.to_string()))?;
    let sha256 = retrace_model::checkpoint_sha256(&abs).map_err(|e| bad(e.to_string()))?;
    // What runs, as the server resolves it (a .gguf file's activations are f32 anywhere).
    let resolved = cfg.resolved().candle;
    let (device, dtype) = (resolved.device.unwrap_or_default(), resolved.dtype);
    let dtype = dtype.unwrap_or(Dtype::F32);
    Ok(Base {
        extractor,
        path: abs,
        sha256,
        format,
        dtype,
        precision: format!("{device} {dtype:?}").to_lowercase(),
    })
}

/// Every trace's features for every part (a set of layers, averaged): one (steps, H) matrix per
/// part, rows in trace order across `sets` (the sets' traces one after another). Each part of
/// each file is cached on its own, so a run whose taps share parts with an earlier one extracts
/// only the parts it lacks (all of them in one pass over the base).
pub(crate) fn features(
    base: &Base,
    parts: &[TapPart],
    sets: &[&Dataset],
    cache: &FeatureCache,
    progress: &Progress,
) -> Result<(Vec<Tensor>, Extraction), TrainError> {
    let started = std::time::Instant::now();
    let mut columns: Vec<Vec<Tensor>> = vec![Vec::new(); parts.len()];
    let mut done = Extraction::default();
    for set in sets {
        for (f, file) in set.files.iter().enumerate() {
            let traces: Vec<_> = set.traces.iter().filter(|t| t.file == f).collect();
            let steps: Vec<usize> = traces.iter().map(|t| t.steps.len()).collect();
            let keys: Vec<Key> = parts
                .iter()
                .map(|p| part_key(base, p, &file.sha256))
                .collect();
            let mut got: Vec<Option<Tensor>> = keys
                .iter()
                .map(|k| cache.get(k, &steps).and_then(|e| e.taps.into_iter().next()))
                .collect();
            let missing: Vec<usize> = (0..parts.len()).filter(|&i| got[i].is_none()).collect();
            if missing.is_empty() {
                done.cached_files += 1;
            } else {
                let path = Path::new(&file.path);
                let taps: Vec<Vec<usize>> = missing.iter().map(|&i| parts[i].0.clone()).collect();
                let pools: Vec<Pool> = missing.iter().map(|&i| parts[i].1).collect();
                let (entry, tokens) = extract(base, (&taps, &pools), &traces, path, progress)?;
                for (&i, t) in missing.iter().zip(entry.taps) {
                    let one = Entry {
                        steps: entry.steps.clone(),
                        taps: vec![t.clone()],
                    };
                    cache.put(&keys[i], path, &one)?;
                    got[i] = Some(t);
                }
                done.traces += traces.len();
                done.tokens += tokens;
            }
            for (column, t) in columns.iter_mut().zip(got) {
                column.push(t.ok_or_else(|| {
                    TrainError::Usage(format!("{}: a part was not extracted", file.path))
                })?);
            }
        }
    }
    let rows = columns
        .iter()
        .map(|p| Ok(Tensor::cat(p, 0)?))
        .collect::<Result<_, TrainError>>()?;
    done.seconds = started.elapsed().as_secs_f64();
    Ok((rows, done))
}

/// What one part of one file's features depend on. A part read at the read position keys as a
/// one-tap entry always has.
fn part_key(base: &Base, (layers, pool): &TapPart, file_sha256: &str) -> Key {
    Key {
        retrace: env!("CARGO_PKG_VERSION").into(),
        base_sha256: base.sha256.clone(),
        format: base.format.as_str().into(),
        taps: vec![layers.clone()],
        pools: match pool {
            Pool::Read => Vec::new(),
            Pool::Span => vec![Pool::Span],
        },
        precision: base.precision.clone(),
        file_sha256: file_sha256.to_string(),
    }
}

/// What getting the features took: the traces and tokens run through the base (files read
/// from the cache add none), and the seconds the whole of it took.
#[derive(Debug, Clone, Default)]
pub struct Extraction {
    pub traces: usize,
    /// Tokens the base ran, shared ones included (as a server counts a request's tokens).
    pub tokens: usize,
    pub cached_files: usize,
    pub seconds: f64,
}

/// The trace a server builds from a labelled row as `eval` sends it, its reference answer
/// included when it has one: the head must read in training what it reads when served.
fn trace_of(t: &Labelled) -> Trace {
    Trace {
        question: t.record.question.clone(),
        options: t.record.options.clone(),
        steps: t
            .steps
            .iter()
            .map(|s| Step {
                text: s.clone(),
                span: None,
            })
            .collect(),
        reference_answer: t.record.reference_answer.clone(),
    }
}

/// One file's traces through the base, with a progress bar; a trace the base cannot take is an
/// error naming its file and line.
fn extract(
    base: &Base,
    (layers, pools): (&[Vec<usize>], &[Pool]),
    labelled: &[&Labelled],
    file: &Path,
    progress: &Progress,
) -> Result<(Entry, usize), TrainError> {
    let traces: Vec<Trace> = labelled.iter().map(|t| trace_of(t)).collect();
    let h = base.extractor.hidden_size();
    let bar = progress.extraction(&file.display().to_string(), traces.len());
    let mut flat: Vec<Vec<f32>> = vec![Vec::new(); layers.len()];
    let mut steps = Vec::with_capacity(traces.len());
    let mut tokens = 0;
    base.extractor
        .extract_each(
            &traces,
            layers,
            pools,
            |_, f| {
                steps.push(f.steps.len());
                for step in f.steps {
                    for (out, v) in flat.iter_mut().zip(step) {
                        out.extend_from_slice(&v);
                    }
                }
            },
            |p| {
                tokens = p.tokens_done;
                bar.set_position(p.traces_done as u64)
            },
        )
        .map_err(|e| extract_error(e, labelled, file))?;
    bar.finish();
    let rows: usize = steps.iter().sum();
    let taps = flat
        .into_iter()
        .map(|v| Tensor::from_vec(v, (rows, h), &Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((Entry { steps, taps }, tokens))
}

fn extract_error(e: ExtractError, labelled: &[&Labelled], file: &Path) -> TrainError {
    let at = |index: usize, message: String| match labelled.get(index) {
        Some(t) => TrainError::Data(DataError {
            file: file.display().to_string(),
            line: t.line,
            message: format!(
                "row {:?}: {message} (drop the row to train on the rest)",
                t.record.id
            ),
            fatal: false,
        }),
        None => TrainError::Usage(format!("extracting {}: {message}", file.display())),
    };
    match e {
        ExtractError::Format { index, error } => at(index, error.to_string()),
        ExtractError::Trace { index, message } => at(index, message),
        e => TrainError::Usage(format!(
            "extracting the features of {}: {e}",
            file.display()
        )),
    }
}
