//! The trace probe: a head that reads a trace's steps in order. Each step's standardised feature
//! goes through a ReLU projection, a GRU carries what the steps before it looked like, and a
//! linear layer reads the step's projection beside the GRU's state. The one forward both the
//! trainer (on variables, batched over many traces) and the served head (one trace at a time)
//! run, so the two compute the same numbers.

use candle_core::{Result, Tensor};

/// The probe's weights, as `head.safetensors` holds them (`head_tensors::TRACE_*`), with `d`
/// the probe's width and `h` the base's hidden size.
#[derive(Debug, Clone)]
pub struct TraceProbe {
    /// (d, h) and (d): u = relu(W x + b).
    pub input_w: Tensor,
    pub input_b: Tensor,
    /// (3d, d) and (3d): the GRU's input and state weights, gates in the order r, z, n (as
    /// PyTorch's `nn.GRU` orders them).
    pub gru_ih_w: Tensor,
    pub gru_ih_b: Tensor,
    pub gru_hh_w: Tensor,
    pub gru_hh_b: Tensor,
    /// (1, 2d) and (1): the step's logit from [u, state].
    pub out_w: Tensor,
    pub out_b: Tensor,
}

/// sigmoid(x) as 0.5 (1 + tanh(x / 2)): never overflows, and its gradient is candle's tanh's.
fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.affine(0.5, 0.0)?.tanh()? + 1.0)? * 0.5
}

fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    x.matmul(&w.t()?)?.broadcast_add(b)
}

impl TraceProbe {
    /// The probe's width d.
    pub fn width(&self) -> usize {
        self.input_b.dims1().unwrap_or(0)
    }

    /// The logits, (rows, 1), of the traces `spans` ((first row, steps) in `x`, standardised
    /// features (N, h)), their rows one trace after another in span order. Traces run side by
    /// side, padded with zero inputs past their ends; a step reads only the steps before it,
    /// so padding changes nothing it reads.
    pub fn logits(&self, x: &Tensor, spans: &[(usize, usize)]) -> Result<Tensor> {
        let n = x.dim(0)?;
        let d = self.width();
        let b = spans.len();
        let t_max = spans.iter().map(|s| s.1).max().unwrap_or(0);
        if b == 0 || t_max == 0 {
            return Tensor::zeros((0, 1), x.dtype(), x.device());
        }
        if let Some(&(start, len)) = spans.iter().find(|(s, l)| s + l > n) {
            candle_core::bail!(
                "trace rows {start}..{} lie past the {n} feature rows",
                start + len
            )
        }
        let u = linear(x, &self.input_w, &self.input_b)?.relu()?;
        // Row n of `padded` is the zero input of a step past a trace's end.
        let padded = Tensor::cat(&[&u, &u.zeros_like()?.narrow(0, 0, 1)?], 0)?;
        let mut at = Vec::with_capacity(t_max * b);
        for t in 0..t_max {
            at.extend(
                spans
                    .iter()
                    .map(|&(s, l)| if t < l { (s + t) as u32 } else { n as u32 }),
            );
        }
        let at = Tensor::new(at.as_slice(), x.device())?;
        let steps = padded.index_select(&at, 0)?;
        let gi = linear(&steps, &self.gru_ih_w, &self.gru_ih_b)?.reshape((t_max, b, 3 * d))?;
        let mut state = Tensor::zeros((b, d), x.dtype(), x.device())?;
        let mut states = Vec::with_capacity(t_max);
        for t in 0..t_max {
            state = self.gru_step(&gi.get(t)?, &state, d)?;
            states.push(state.clone());
        }
        let states = Tensor::stack(&states, 0)?.reshape((t_max * b, d))?;
        // Back to the traces' rows, in span order: step t of trace j sits at t b + j.
        let mut back = Vec::new();
        for (j, &(_, l)) in spans.iter().enumerate() {
            back.extend((0..l).map(|t| (t * b + j) as u32));
        }
        let back = Tensor::new(back.as_slice(), x.device())?;
        let read = Tensor::cat(
            &[
                &steps.index_select(&back, 0)?,
                &states.index_select(&back, 0)?,
            ],
            1,
        )?;
        linear(&read, &self.out_w, &self.out_b)
    }

    /// One GRU step: `gi` (b, 3d) the inputs' share, `h` (b, d) the state before.
    fn gru_step(&self, gi: &Tensor, h: &Tensor, d: usize) -> Result<Tensor> {
        let gh = linear(h, &self.gru_hh_w, &self.gru_hh_b)?;
        let gate = |k: usize, t: &Tensor| t.narrow(1, k * d, d);
        let r = sigmoid(&(gate(0, gi)? + gate(0, &gh)?)?)?;
        let z = sigmoid(&(gate(1, gi)? + gate(1, &gh)?)?)?;
        let candidate = (gate(2, gi)? + (r * gate(2, &gh)?)?)?.tanh()?;
        // h' = (1 - z) n + z h = n + z (h - n).
        &candidate + (z * (h - &candidate)?)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn probe(h: usize, d: usize) -> TraceProbe {
        let dev = &Device::Cpu;
        // Fixed, varied weights: element i of a tensor is sin(i * k + offset).
        let t = |shape: &[usize], k: f32| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * k + 0.3).sin() * 0.7).collect();
            Tensor::from_vec(v, shape, dev).unwrap()
        };
        TraceProbe {
            input_w: t(&[d, h], 0.37),
            input_b: t(&[d], 0.91),
            gru_ih_w: t(&[3 * d, d], 0.53),
            gru_ih_b: t(&[3 * d], 0.17),
            gru_hh_w: t(&[3 * d, d], 0.71),
            gru_hh_b: t(&[3 * d], 0.29),
            out_w: t(&[1, 2 * d], 0.43),
            out_b: t(&[1], 0.61),
        }
    }

    /// The same probe written out in scalars, PyTorch's GRU equations term by term.
    fn reference(p: &TraceProbe, x: &[Vec<f32>]) -> Vec<f32> {
        let m = |t: &Tensor| t.to_vec2::<f32>().unwrap();
        let v = |t: &Tensor| t.to_vec1::<f32>().unwrap();
        let (wi, bi, wih, bih) = (m(&p.input_w), v(&p.input_b), m(&p.gru_ih_w), v(&p.gru_ih_b));
        let (whh, bhh, wo, bo) = (m(&p.gru_hh_w), v(&p.gru_hh_b), m(&p.out_w), v(&p.out_b));
        let d = bi.len();
        let dot = |w: &[f32], x: &[f32]| w.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let mut h = vec![0f32; d];
        let mut out = Vec::new();
        for step in x {
            let u: Vec<f32> = (0..d)
                .map(|i| (dot(&wi[i], step) + bi[i]).max(0.0))
                .collect();
            let gi = |k: usize| dot(&wih[k], &u) + bih[k];
            let gh = |k: usize| dot(&whh[k], &h) + bhh[k];
            let next: Vec<f32> = (0..d)
                .map(|i| {
                    let r = sig(gi(i) + gh(i));
                    let z = sig(gi(d + i) + gh(d + i));
                    let n = (gi(2 * d + i) + r * gh(2 * d + i)).tanh();
                    (1.0 - z) * n + z * h[i]
                })
                .collect();
            h = next;
            let read: Vec<f32> = u.iter().chain(&h).copied().collect();
            out.push(dot(&wo[0], &read) + bo[0]);
        }
        out
    }

    #[test]
    fn computes_the_gru_equations_and_one_trace_alone_as_in_a_batch() {
        let (h, d) = (5, 3);
        let p = probe(h, d);
        let rows: Vec<Vec<f32>> = (0..9)
            .map(|r| {
                (0..h)
                    .map(|j| ((r * h + j) as f32 * 0.61).cos() * 2.0)
                    .collect()
            })
            .collect();
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let x = Tensor::from_vec(flat, (9, h), &Device::Cpu).unwrap();
        // Three traces of 4, 2 and 3 steps, run together and each alone.
        let spans = [(0, 4), (4, 2), (6, 3)];
        let together = p.logits(&x, &spans).unwrap().flatten_all().unwrap();
        let together = together.to_vec1::<f32>().unwrap();
        let mut alone = Vec::new();
        for &(s, l) in &spans {
            let one = p.logits(&x.narrow(0, s, l).unwrap(), &[(0, l)]).unwrap();
            alone.extend(one.flatten_all().unwrap().to_vec1::<f32>().unwrap());
            let want = reference(&p, &rows[s..s + l]);
            let got = &alone[s..s + l];
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-5,
                    "trace at {s}: {got:?} against {want:?}"
                );
            }
        }
        for (a, b) in together.iter().zip(&alone) {
            assert!((a - b).abs() < 1e-6, "{together:?} against {alone:?}");
        }
        // A trace's first steps read the same whatever follows them.
        let first = p.logits(&x, &[(0, 2)]).unwrap().flatten_all().unwrap();
        for (a, b) in first.to_vec1::<f32>().unwrap().iter().zip(&alone[..2]) {
            assert!((a - b).abs() < 1e-6, "{a} against {b}");
        }
        assert!(p.logits(&x, &[(8, 2)]).is_err(), "a span past the rows");
    }
}
