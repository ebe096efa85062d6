//! The training loop: seeded mini-batches under AdamW (decoupled weight decay), class-weighted
//! losses, an evaluation after every epoch, and early stopping on its dev score (the weights of
//! the best epoch are kept; among epochs of equal dev score, the one of lowest dev loss, so a
//! score that saturates early does not freeze a barely trained head).

use super::head::Head;
use candle_core::{D, Result, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use rand::{SeedableRng, rngs::StdRng, seq::SliceRandom};

/// How to train.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Params {
    pub(crate) epochs: usize,
    /// Stop after this many epochs without a better dev score.
    pub(crate) patience: usize,
    pub(crate) lr: f64,
    pub(crate) weight_decay: f64,
    pub(crate) batch_size: usize,
    pub(crate) seed: u64,
}

/// What the loss compares the logits with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Loss {
    /// One logit per row; targets 1 (correct) or 0 (wrong): binary cross-entropy.
    Binary,
    /// One logit per class; targets are class indices: softmax cross-entropy.
    Softmax,
}

/// The rows a head trains on: indices into the feature matrix, a target and a weight each.
#[derive(Debug, Clone, Default)]
pub(crate) struct Examples {
    pub(crate) rows: Vec<u32>,
    pub(crate) targets: Vec<u32>,
    pub(crate) weights: Vec<f32>,
}

/// One epoch's record. Scores are percentages (F1 for a step head).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Epoch {
    pub(crate) epoch: usize,
    /// The mean training loss over the epoch's batches, and the loss on dev's examples after it.
    pub(crate) loss: f64,
    pub(crate) dev_loss: f64,
    pub(crate) train: f64,
    pub(crate) dev: f64,
}

impl Epoch {
    /// Better on dev: a higher score, or the same score at a lower loss.
    fn beats(&self, other: &Epoch) -> bool {
        self.dev > other.dev || (self.dev == other.dev && self.dev_loss < other.dev_loss)
    }
}

/// The data a head trains on: features (N, H), the training examples, dev's examples (rows of
/// the same features), and the loss.
pub(crate) struct Data<'a> {
    pub(crate) x: &'a Tensor,
    pub(crate) train: &'a Examples,
    pub(crate) dev: &'a Examples,
    pub(crate) loss: Loss,
}

/// A trained head and how it got there.
#[derive(Debug)]
pub(crate) struct Fitted {
    /// The weights of the epoch with the best dev score (the earliest among equals).
    pub(crate) head: Head,
    pub(crate) history: Vec<Epoch>,
    /// Index into `history` of that epoch.
    pub(crate) best: usize,
}

impl Examples {
    /// Examples of `targets` (one per row, in row order), each class weighted by
    /// n / (classes present * its count), so every class weighs the same in the loss.
    pub(crate) fn balanced(rows: Vec<u32>, targets: Vec<u32>) -> Examples {
        let classes = targets.iter().max().map_or(0, |&m| m as usize + 1);
        let mut count = vec![0usize; classes];
        for &t in &targets {
            count[t as usize] += 1;
        }
        let present = count.iter().filter(|&&c| c > 0).count().max(1);
        let n = targets.len() as f32;
        let weights = targets
            .iter()
            .map(|&t| n / (present as f32 * count[t as usize] as f32))
            .collect();
        Examples {
            rows,
            targets,
            weights,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.rows.len()
    }
}

/// The weighted mean loss of `logits` (B, out) against `targets` (B, u32) with `weights` (B).
fn loss(kind: Loss, logits: &Tensor, targets: &Tensor, weights: &Tensor) -> Result<Tensor> {
    let per_row = match kind {
        Loss::Binary => {
            // softplus(z) - y z, with softplus(z) = relu(z) + ln(1 + e^-|z|): never overflows.
            let z = logits.flatten_all()?;
            let y = targets.to_dtype(z.dtype())?;
            let softplus = (z.relu()? + z.abs()?.neg()?.exp()?.affine(1.0, 1.0)?.log()?)?;
            (softplus - (y * &z)?)?
        }
        Loss::Softmax => {
            let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
            logp.gather(&targets.unsqueeze(1)?, 1)?
                .flatten_all()?
                .neg()?
        }
    };
    (per_row * weights)?.mean_all()
}

/// Trains `head` for up to `params.epochs` epochs; after each, `evaluate` gets the logits of
/// every feature row and returns the (train, dev) scores to maximise (percentages), and
/// `progress` gets the epoch's record.
pub(crate) fn fit(
    head: Head,
    data: &Data,
    params: &Params,
    mut evaluate: impl FnMut(&Tensor) -> Result<(f64, f64)>,
    mut progress: impl FnMut(&Epoch),
) -> Result<Fitted> {
    let mut opt = AdamW::new(
        head.vars(),
        ParamsAdamW {
            lr: params.lr,
            weight_decay: params.weight_decay,
            ..ParamsAdamW::default()
        },
    )?;
    let mut rng = StdRng::seed_from_u64(params.seed);
    let mut order: Vec<usize> = (0..data.train.len()).collect();
    let (mut history, mut best, mut kept) = (Vec::<Epoch>::new(), 0, head.snapshot()?);
    for epoch in 1..=params.epochs {
        order.shuffle(&mut rng);
        let loss = one_epoch(&head, &mut opt, data, &order, params.batch_size)?;
        let logits = head.logits(data.x)?;
        let (train, dev) = evaluate(&logits)?;
        let record = Epoch {
            epoch,
            loss,
            dev_loss: examples_loss(data.loss, &logits, data.dev)?,
            train,
            dev,
        };
        progress(&record);
        history.push(record);
        if history.len() == 1 || record.beats(&history[best]) {
            best = history.len() - 1;
            kept = head.snapshot()?;
        } else if history.len() - 1 - best >= params.patience {
            break;
        }
    }
    Ok(Fitted {
        head: kept,
        history,
        best,
    })
}

/// The loss over `ex`'s rows of `logits` (N, out); 0 when `ex` is empty.
fn examples_loss(kind: Loss, logits: &Tensor, ex: &Examples) -> Result<f64> {
    if ex.len() == 0 {
        return Ok(0.0);
    }
    let device = logits.device();
    let rows = Tensor::new(ex.rows.as_slice(), device)?;
    let targets = Tensor::new(ex.targets.as_slice(), device)?;
    let weights = Tensor::new(ex.weights.as_slice(), device)?;
    let l = loss(kind, &logits.index_select(&rows, 0)?, &targets, &weights)?;
    Ok(f64::from(l.to_scalar::<f32>()?))
}

/// One pass over `order` in mini-batches of the training examples; the mean batch loss.
fn one_epoch(
    head: &Head,
    opt: &mut AdamW,
    data: &Data,
    order: &[usize],
    batch_size: usize,
) -> Result<f64> {
    let (x, ex, kind) = (data.x, data.train, data.loss);
    let device = x.device();
    let (mut total, mut batches) = (0.0, 0usize);
    for chunk in order.chunks(batch_size.max(1)) {
        let pick = |v: &dyn Fn(usize) -> u32| chunk.iter().map(|&i| v(i)).collect::<Vec<u32>>();
        let rows = pick(&|i| ex.rows[i]);
        let targets = Tensor::new(pick(&|i| ex.targets[i]), device)?;
        let weights: Vec<f32> = chunk.iter().map(|&i| ex.weights[i]).collect();
        let weights = Tensor::new(weights, device)?;
        let logits = head.logits_at(x, &rows)?;
        let l = loss(kind, &logits, &targets, &weights)?;
        opt.backward_step(&l)?;
        total += f64::from(l.to_scalar::<f32>()?);
        batches += 1;
    }
    Ok(total / batches.max(1) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn balanced_weights_even_out_classes() {
        let e = Examples::balanced(vec![0, 1, 2, 3], vec![1, 1, 1, 0]);
        assert_eq!(e.weights, [4.0 / 6.0, 4.0 / 6.0, 4.0 / 6.0, 2.0]);
        let sum = |c: u32| -> f32 {
            (0..4)
                .filter(|&i| e.targets[i] == c)
                .map(|i| e.weights[i])
                .sum()
        };
        assert!((sum(0) - sum(1)).abs() < 1e-6);
    }

    #[test]
    fn losses_match_their_formulas() {
        let d = &Device::Cpu;
        let z = Tensor::new(&[[2f32], [-1.0]], d).unwrap();
        let y = Tensor::new(&[1u32, 0], d).unwrap();
        let w = Tensor::new(&[1f32, 3.0], d).unwrap();
        let got = loss(Loss::Binary, &z, &y, &w).unwrap();
        let sp = |v: f64| (1.0 + v.exp()).ln();
        let want = ((sp(2.0) - 2.0) + 3.0 * sp(-1.0)) / 2.0;
        assert!((f64::from(got.to_scalar::<f32>().unwrap()) - want).abs() < 1e-6);
        let z = Tensor::new(&[[0f32, 1.0, 2.0]], d).unwrap();
        let y = Tensor::new(&[2u32], d).unwrap();
        let w = Tensor::new(&[1f32], d).unwrap();
        let got = loss(Loss::Softmax, &z, &y, &w).unwrap();
        let want = -(2f64.exp() / (1.0 + 1f64.exp() + 2f64.exp())).ln();
        assert!((f64::from(got.to_scalar::<f32>().unwrap()) - want).abs() < 1e-6);
    }
}
