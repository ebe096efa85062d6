//! Features for training a PRM head (`retrace train-head`): a base checkpoint loaded as a served
//! PRM is (device, dtype, prefix cache), traces formatted by a family's `Formatter` (the
//! server's own code, so training and serving read the same positions), cut into batches by the
//! batcher's `next_batch`, and the hidden states of chosen layers at each step's read position,
//! averaged per tap as a trained head averages them.

use super::batcher::{Budget, next_batch};
use super::candle::load_model;
use super::config::PrmConfig;
use super::format::{Encoded, FormatError, Formatter, PrmKind};
use super::head::Pool;
use super::resolve_model;
use crate::env::Env;
use crate::trace::Trace;
use retrace_model::{
    Batch, HeadSpec, ModelError, PrmModel, RowStates, Tokens, average_states, span_reads, span_rows,
};
use std::ops::Range;
use std::time::Duration;

/// A base checkpoint and a format, ready to turn traces into features.
pub struct Extractor {
    formatter: Formatter,
    model: PrmModel,
    budget: Budget,
}

/// Why features could not be extracted; each names the trace or tap at fault.
#[derive(Debug, thiserror::Error)]
pub enum ExtractError {
    /// The base or its tokenizer could not be loaded, or the table is refused.
    #[error("{0}")]
    Load(String),
    #[error("taps[{tap}]: {message}")]
    Tap { tap: usize, message: String },
    #[error("trace {index}: {error}")]
    Format { index: usize, error: FormatError },
    #[error("trace {index}: {message}")]
    Trace { index: usize, message: String },
    #[error("the model failed: {0}")]
    Model(#[from] ModelError),
}

/// How far an extraction has come, after each batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Progress {
    pub traces_done: usize,
    pub traces: usize,
    /// Tokens the model needed (each trace up to its last step's read), done and in all.
    pub tokens_done: usize,
    pub tokens: usize,
    /// Of the tokens done, those computed rather than reused (cached, or shared in a batch).
    pub tokens_computed: usize,
}

/// One trace's features: per step, one vector (hidden size long) per tap, in the order asked.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceFeatures {
    pub steps: Vec<Vec<Vec<f32>>>,
    pub tokens: Tokens,
}

impl Extractor {
    /// Loads the base `cfg.model` (a folder, a `.gguf` file, or a hub id already in the
    /// Hugging Face cache) with `cfg.family`'s formatting, on the device, dtype, batch budget
    /// and prefix cache `cfg`'s in-process keys name, as `PrmEvaluator::load` would.
    pub fn load(cfg: &PrmConfig) -> Result<Extractor, ExtractError> {
        let fail = |what: String| ExtractError::Load(what);
        cfg.check().map_err(|e| fail(e.to_string()))?;
        let PrmKind::Checkpoint(family) = cfg.family else {
            return Err(fail(
                "family head: features come from a base; name the format the head will use".into(),
            ));
        };
        let base = resolve_model(&cfg.model, Env::process().hf_hub_cache().as_deref())
            .ok_or_else(|| fail(format!("base {} is not a folder or .gguf file", cfg.model)))?;
        let formatter = Formatter::load(family, &base).map_err(|e| fail(e.to_string()))?;
        let model = load_model(&base, HeadSpec::States, cfg).map_err(|e| fail(e.to_string()))?;
        Ok(Extractor {
            formatter,
            model,
            budget: Budget {
                max_batch_tokens: cfg.max_batch_tokens(),
                max_batch_size: cfg.max_batch_size(),
                max_wait: Duration::ZERO,
            },
        })
    }

    /// The base's decoder layers: a tap's layers lie in 0..=num_layers() (the last is the
    /// state after the final norm).
    pub fn num_layers(&self) -> usize {
        self.model.num_layers()
    }

    pub fn hidden_size(&self) -> usize {
        self.model.hidden_size()
    }

    /// A trace as the model sees it: ids, and one read position per step.
    pub fn encode(&self, trace: &Trace) -> Result<Encoded, FormatError> {
        self.formatter.encode(trace)
    }

    /// Every trace's features for every tap (a set of layers, averaged), in one pass over
    /// the base; `progress` hears after each batch.
    pub fn extract(
        &self,
        traces: &[Trace],
        taps: &[Vec<usize>],
        progress: impl FnMut(Progress),
    ) -> Result<Vec<TraceFeatures>, ExtractError> {
        let mut out = Vec::with_capacity(traces.len());
        self.extract_each(traces, taps, &[], |_, f| out.push(f), progress)?;
        Ok(out)
    }

    /// `extract`, handing each trace's features to `each` (with its index) as its batch
    /// finishes, in order, so a caller need not hold them all.
    /// `pools` says where each tap is read (empty: every tap at the read); a tap read over
    /// spans averages its state over each step's own tokens, which the format must mark.
    pub fn extract_each(
        &self,
        traces: &[Trace],
        taps: &[Vec<usize>],
        pools: &[Pool],
        mut each: impl FnMut(usize, TraceFeatures),
        mut progress: impl FnMut(Progress),
    ) -> Result<(), ExtractError> {
        let (layers, picks) = self.layers(taps)?;
        let pools = pools_of(taps, pools)?;
        let spans = pools.contains(&Pool::Span);
        let encoded = self.encode_all(traces, spans)?;
        let needed = |e: &Encoded| e.positions.iter().max().map_or(0, |p| p + 1);
        let mut done = Progress {
            traces: traces.len(),
            tokens: encoded.iter().map(needed).sum(),
            ..Progress::default()
        };
        let mut at = 0;
        while at < encoded.len() {
            let n = next_batch(encoded[at..].iter().map(|e| e.ids.len()), &self.budget);
            let batch = &encoded[at..at + n];
            let rows: Vec<&[u32]> = batch.iter().map(|e| e.ids.as_slice()).collect();
            // With spans, each row is read at its steps, then at every token of their spans.
            let wide: Vec<Vec<usize>> = batch
                .iter()
                .map(|e| match spans {
                    true => span_reads(&e.positions, e.marked_spans()),
                    false => e.positions.clone(),
                })
                .collect();
            let positions: Vec<&[usize]> = wide.iter().map(Vec::as_slice).collect();
            let states = self.model.states(Batch::new(&rows, &positions), &layers)?;
            for (j, (row, e)) in states.into_iter().zip(batch).enumerate() {
                done.tokens_done += row.tokens.computed + row.tokens.reused;
                done.tokens_computed += row.tokens.computed;
                let span_at = span_rows(e.positions.len(), e.marked_spans());
                let steps = (0..e.positions.len())
                    .map(|r| per_tap(&row, r, &picks, &pools, span_at.get(r)))
                    .collect::<Result<_, _>>()
                    .map_err(|message| ExtractError::Trace {
                        index: at + j,
                        message,
                    })?;
                each(
                    at + j,
                    TraceFeatures {
                        steps,
                        tokens: row.tokens,
                    },
                );
            }
            at += n;
            done.traces_done = at;
            progress(done);
        }
        Ok(())
    }

    /// The layers the taps name, sorted without repeats, and each tap as indices into them.
    fn layers(&self, taps: &[Vec<usize>]) -> Result<(Vec<usize>, Vec<Vec<usize>>), ExtractError> {
        let n = self.num_layers();
        let mut layers: Vec<usize> = taps.iter().flatten().copied().collect();
        layers.sort_unstable();
        layers.dedup();
        for (tap, t) in taps.iter().enumerate() {
            let message = match t.iter().find(|&&l| l > n) {
                _ if t.is_empty() => "names no layer".to_string(),
                Some(l) => format!(
                    "layer {l} is out of range: the base has {n} decoder layers, so 0..={n} \
                     ({n} is after the final norm)"
                ),
                None => continue,
            };
            return Err(ExtractError::Tap { tap, message });
        }
        let picks = taps
            .iter()
            .map(|t| {
                t.iter()
                    .map(|l| layers.binary_search(l).unwrap_or(0))
                    .collect()
            })
            .collect();
        Ok((layers, picks))
    }

    /// Every trace formatted, and checked against the base's context and vocabulary (and, when
    /// `spans`, that its format marked each step's tokens).
    fn encode_all(&self, traces: &[Trace], spans: bool) -> Result<Vec<Encoded>, ExtractError> {
        let (limit, vocab) = (self.model.max_positions(), self.model.vocab_size());
        traces
            .iter()
            .enumerate()
            .map(|(index, t)| {
                let e = self
                    .formatter
                    .encode(t)
                    .map_err(|error| ExtractError::Format { index, error })?;
                let message = if e.ids.len() > limit {
                    format!(
                        "{} tokens exceed the base's context of {limit} tokens",
                        e.ids.len()
                    )
                } else if let Some(id) = e.ids.iter().find(|&&id| id as usize >= vocab) {
                    format!("token id {id} is outside the base's vocabulary of {vocab}")
                } else if let (true, Err(why)) = (spans, &e.spans) {
                    format!("a tap reads each step's own tokens: {why}")
                } else if spans && e.marked_spans().len() != e.positions.len() {
                    "a tap reads each step's own tokens, and this format marks none (chat-lm \
                     and rlhflow do)"
                        .to_string()
                } else {
                    return Ok(e);
                };
                Err(ExtractError::Trace { index, message })
            })
            .collect()
    }
}

/// Each tap's pool: `pools` as given, one per tap, or every tap at the read.
fn pools_of(taps: &[Vec<usize>], pools: &[Pool]) -> Result<Vec<Pool>, ExtractError> {
    match pools.len() {
        0 => Ok(vec![Pool::Read; taps.len()]),
        n if n == taps.len() => Ok(pools.to_vec()),
        n => Err(ExtractError::Load(format!(
            "{n} pools for {} taps",
            taps.len()
        ))),
    }
}

/// Step `r`'s feature for each tap: its layers' states averaged (`picks`: indices into the
/// layers `row` holds), at the step's read or, for a span tap, at each of its tokens (`span`:
/// their rows, as `span_rows` lays them out) and then averaged over them, as the served head
/// does.
fn per_tap(
    row: &RowStates,
    r: usize,
    picks: &[Vec<usize>],
    pools: &[Pool],
    span: Option<&Range<usize>>,
) -> Result<Vec<Vec<f32>>, String> {
    let at = |pick: &[usize], read: usize| {
        let states: Vec<&[f32]> = pick.iter().map(|&l| row.at(l, read)).collect();
        average_states(&states)
    };
    picks
        .iter()
        .zip(pools)
        .map(|(pick, pool)| match (pool, span) {
            (Pool::Read, _) => Ok(at(pick, r)),
            (Pool::Span, Some(rows)) => {
                let tokens: Vec<Vec<f32>> = rows.clone().map(|t| at(pick, t)).collect();
                Ok(average_states(
                    &tokens.iter().map(Vec::as_slice).collect::<Vec<_>>(),
                ))
            }
            // encode_all refuses such a trace first; never read the step's read instead.
            (Pool::Span, None) => Err(format!("step {r} has no tokens of its own marked")),
        })
        .collect()
}

#[cfg(test)]
#[path = "features_tests.rs"]
mod tests;
