//! The heads a trained PRM reads, as candle variables: the feature standardiser, the step head
//! (logistic, a one-hidden-layer MLP, or a trace probe over the steps in order) and the
//! category head, under the tensor names of the head folder's `head.safetensors`.

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng, rngs::StdRng};
use retrace_model::head_tensors::{self as names, bias, weight};
use retrace_model::{HeadKind, TraceProbe};
use std::collections::HashMap;
use std::sync::Arc;

/// Features are standardised before any head: x = (f - mean) / scale.
#[derive(Debug, Clone)]
pub(crate) struct Standardiser {
    pub(crate) mean: Tensor,
    pub(crate) scale: Tensor,
}

/// A head's weights: each a variable the optimiser moves, under its file name.
#[derive(Debug, Clone)]
pub(crate) struct Head {
    pub(crate) kind: HeadKind,
    /// (name in head.safetensors, variable), in a fixed order.
    pub(crate) params: Vec<(String, Var)>,
    /// A trace probe's traces, (first row, steps) in row order, tiling the feature rows: what
    /// it reads in order. Empty for a head that reads each row alone.
    traces: Arc<[(usize, usize)]>,
}

impl Standardiser {
    /// The mean and standard deviation of each column of `rows` (N, H); a constant column
    /// keeps scale 1 (it carries nothing, and dividing by 0 would poison it).
    pub(crate) fn fit(rows: &Tensor) -> Result<Standardiser> {
        let mean = rows.mean(0)?;
        let var = rows.broadcast_sub(&mean)?.sqr()?.mean(0)?;
        let std: Vec<f32> = var.sqrt()?.to_vec1()?;
        let scale: Vec<f32> = std
            .into_iter()
            .map(|s| if s > 1e-6 && s.is_finite() { s } else { 1.0 })
            .collect();
        let n = scale.len();
        Ok(Standardiser {
            mean,
            scale: Tensor::from_vec(scale, n, rows.device())?,
        })
    }

    pub(crate) fn apply(&self, f: &Tensor) -> Result<Tensor> {
        f.broadcast_sub(&self.mean)?.broadcast_div(&self.scale)
    }
}

/// Uniform in [-bound, bound), drawn from `rng` in row-major order.
fn uniform(rng: &mut StdRng, shape: (usize, usize), bound: f32, device: &Device) -> Result<Var> {
    let v: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| rng.random_range(-bound..bound))
        .collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, device)?)
}

fn zeros(n: usize, device: &Device) -> Result<Var> {
    Var::zeros(n, DType::F32, device)
}

/// A linear layer's weight, uniform in +-1/sqrt(fan_in) from `rng`, and its bias at zero.
fn layer(
    rng: &mut StdRng,
    name: &str,
    (rows, cols): (usize, usize),
    device: &Device,
) -> Result<[(String, Var); 2]> {
    let w = uniform(rng, (rows, cols), 1.0 / (cols as f32).sqrt(), device)?;
    Ok([(weight(name), w), (bias(name), zeros(rows, device)?)])
}

impl Head {
    /// A step head on `h` features: logistic weights start at zero (the loss is convex); an
    /// MLP's and a trace probe's start uniform in +-1/sqrt(fan_in) from `seed`, so a run
    /// repeats exactly. `traces` tiles the feature rows by trace (a trace probe reads them).
    pub(crate) fn step(
        kind: HeadKind,
        h: usize,
        seed: u64,
        device: &Device,
        traces: &[(usize, usize)],
    ) -> Result<Head> {
        let params = match kind {
            HeadKind::Logistic => vec![
                (weight(names::STEP), Var::zeros((1, h), DType::F32, device)?),
                (bias(names::STEP), zeros(1, device)?),
            ],
            HeadKind::Mlp { hidden } => {
                let mut rng = StdRng::seed_from_u64(seed);
                let b1 = 1.0 / (h as f32).sqrt();
                let b2 = 1.0 / (hidden as f32).sqrt();
                vec![
                    (
                        weight(names::STEP_HIDDEN),
                        uniform(&mut rng, (hidden, h), b1, device)?,
                    ),
                    (bias(names::STEP_HIDDEN), zeros(hidden, device)?),
                    (
                        weight(names::STEP_OUT),
                        uniform(&mut rng, (1, hidden), b2, device)?,
                    ),
                    (bias(names::STEP_OUT), zeros(1, device)?),
                ]
            }
            HeadKind::Trace { width: d } => {
                let mut rng = StdRng::seed_from_u64(seed);
                let mut params = Vec::with_capacity(8);
                params.extend(layer(&mut rng, names::TRACE_INPUT, (d, h), device)?);
                params.extend(layer(&mut rng, names::TRACE_GRU_IH, (3 * d, d), device)?);
                params.extend(layer(&mut rng, names::TRACE_GRU_HH, (3 * d, d), device)?);
                params.extend(layer(&mut rng, names::TRACE_OUT, (1, 2 * d), device)?);
                params
            }
        };
        let traces = match kind {
            HeadKind::Trace { .. } => traces.into(),
            _ => Arc::from([]),
        };
        Ok(Head {
            kind,
            params,
            traces,
        })
    }

    /// A softmax head over `classes` on `h` features, starting at zero.
    pub(crate) fn category(classes: usize, h: usize, device: &Device) -> Result<Head> {
        Ok(Head {
            kind: HeadKind::Logistic,
            params: vec![
                (
                    weight(names::CATEGORY),
                    Var::zeros((classes, h), DType::F32, device)?,
                ),
                (bias(names::CATEGORY), zeros(classes, device)?),
            ],
            traces: Arc::from([]),
        })
    }

    fn p(&self, i: usize) -> &Tensor {
        self.params[i].1.as_tensor()
    }

    /// Logits for standardised rows `x` (N, H): (N, out), out = 1 for a step head. A trace
    /// probe's `x` is every feature row, the rows its traces tile.
    pub(crate) fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let linear = |x: &Tensor, w: &Tensor, b: &Tensor| x.matmul(&w.t()?)?.broadcast_add(b);
        match self.kind {
            HeadKind::Logistic => linear(x, self.p(0), self.p(1)),
            HeadKind::Mlp { .. } => {
                let hidden = linear(x, self.p(0), self.p(1))?.relu()?;
                linear(&hidden, self.p(2), self.p(3))
            }
            HeadKind::Trace { .. } => self.probe().logits(x, &self.traces),
        }
    }

    /// The logits of rows `rows` of every feature row `x`, in that order: a trace probe runs
    /// the traces that hold them, whole up to their last step.
    pub(crate) fn logits_at(&self, x: &Tensor, rows: &[u32]) -> Result<Tensor> {
        if !matches!(self.kind, HeadKind::Trace { .. }) {
            return self.logits(&x.index_select(&Tensor::new(rows, x.device())?, 0)?);
        }
        // Each row's trace, the traces in order of first appearance, and each one's offset in
        // the probe's output.
        let trace_of = |r: usize| self.traces.partition_point(|&(s, _)| s <= r) - 1;
        let (mut spans, mut offset) = (Vec::new(), HashMap::new());
        let mut total = 0;
        for &r in rows {
            let j = trace_of(r as usize);
            offset.entry(j).or_insert_with(|| {
                spans.push(self.traces[j]);
                total += self.traces[j].1;
                total - self.traces[j].1
            });
        }
        let at: Vec<u32> = rows
            .iter()
            .map(|&r| {
                let j = trace_of(r as usize);
                (offset[&j] + r as usize - self.traces[j].0) as u32
            })
            .collect();
        let logits = self.probe().logits(x, &spans)?;
        logits.index_select(&Tensor::new(at.as_slice(), x.device())?, 0)
    }

    /// A trace probe's weights, in `Head::step`'s order.
    fn probe(&self) -> TraceProbe {
        let p = |i: usize| self.p(i).clone();
        TraceProbe {
            input_w: p(0),
            input_b: p(1),
            gru_ih_w: p(2),
            gru_ih_b: p(3),
            gru_hh_w: p(4),
            gru_hh_b: p(5),
            out_w: p(6),
            out_b: p(7),
        }
    }

    /// P(step correct) for raw features `f` (N, H), the way a server computes it.
    pub(crate) fn step_probs(&self, norm: &Standardiser, f: &Tensor) -> Result<Vec<f32>> {
        let z = self.logits(&norm.apply(f)?)?;
        candle_nn::ops::sigmoid(&z)?.flatten_all()?.to_vec1()
    }

    pub(crate) fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|(_, v)| v.clone()).collect()
    }

    /// A copy of the current weights (the optimiser moves the variables in place).
    pub(crate) fn snapshot(&self) -> Result<Head> {
        let params = self
            .params
            .iter()
            .map(|(n, v)| Ok((n.clone(), Var::from_tensor(&v.as_tensor().copy()?)?)))
            .collect::<Result<_>>()?;
        Ok(Head {
            kind: self.kind,
            params,
            traces: self.traces.clone(),
        })
    }

    /// The weights under their file names.
    pub(crate) fn tensors(&self) -> HashMap<String, Tensor> {
        self.params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standardises_columns_and_keeps_constant_ones() {
        let rows = Tensor::new(&[[1f32, 5.0], [3.0, 5.0]], &Device::Cpu).unwrap();
        let s = Standardiser::fit(&rows).unwrap();
        assert_eq!(s.mean.to_vec1::<f32>().unwrap(), [2.0, 5.0]);
        assert_eq!(s.scale.to_vec1::<f32>().unwrap(), [1.0, 1.0]);
        let x = s.apply(&rows).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(x, [[-1.0, 0.0], [1.0, 0.0]]);
    }

    #[test]
    fn mlp_init_is_seeded_and_shaped() {
        let kind = HeadKind::Mlp { hidden: 3 };
        let a = Head::step(kind, 4, 1, &Device::Cpu, &[]).unwrap();
        let b = Head::step(kind, 4, 1, &Device::Cpu, &[]).unwrap();
        let c = Head::step(kind, 4, 2, &Device::Cpu, &[]).unwrap();
        let w = |h: &Head| h.p(0).flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(w(&a), w(&b));
        assert_ne!(w(&a), w(&c));
        let x = Tensor::ones((5, 4), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(a.logits(&x).unwrap().dims(), [5, 1]);
        let names: Vec<_> = a.params.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "step.0.weight",
                "step.0.bias",
                "step.2.weight",
                "step.2.bias"
            ]
        );
    }
}
