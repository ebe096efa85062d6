//! The scaling curve: the model alone (in this process, the server's code path minus gRPC) over
//! trace length and batch size, so a user can see where cost grows faster than linearly.

use super::gemm::{Peak, Shapes};
use candle_core::{DType, Device};
use retrace::{Family, Formatter};
use retrace_model::{Batch, PrmModel};
use std::path::Path;
use std::time::Instant;

/// One (length, batch) point.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Point {
    pub(crate) len: usize,
    pub(crate) batch: usize,
    pub(crate) seconds: f64,
    pub(crate) tokens_per_s: f64,
    pub(crate) gflops: f64,
}

/// Tokens between two read positions: about a gsm8k step.
const STEP_TOKENS: usize = 40;

/// Runs every (len, batch) with len * batch <= `max_tokens`, best of `reps` after a warm-up.
pub(crate) fn sweep(
    folder: &Path,
    lens: &[usize],
    batches: &[usize],
    max_tokens: usize,
    reps: usize,
    mut progress: impl FnMut(&Point),
) -> anyhow::Result<Vec<Point>> {
    let formatter = Formatter::load(Family::ChatLm, folder).map_err(anyhow::Error::msg)?;
    let model = PrmModel::load(folder, formatter.head_spec(), &Device::Cpu, DType::F32)?;
    let shapes = Shapes::load(folder)?;
    let vocab = model.vocab_size() as u64;
    let mut points = Vec::new();
    for &len in lens {
        for &batch in batches {
            if len * batch > max_tokens || len > model.max_positions() {
                continue;
            }
            // Deterministic ids spread over the vocabulary (an LCG); content does not change cost.
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (len as u64) << 8 ^ batch as u64;
            let rows: Vec<Vec<u32>> = (0..batch)
                .map(|_| {
                    (0..len)
                        .map(|_| {
                            state = state
                                .wrapping_mul(6_364_136_223_846_793_005)
                                .wrapping_add(1_442_695_040_888_963_407);
                            ((state >> 33) % vocab) as u32
                        })
                        .collect()
                })
                .collect();
            let reads: Vec<usize> = (STEP_TOKENS - 1..len).step_by(STEP_TOKENS).collect();
            let rows_ref: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
            let pos_ref: Vec<&[usize]> = vec![reads.as_slice(); batch];
            model.score(Batch::new(&rows_ref, &pos_ref))?;
            let mut best = f64::INFINITY;
            for _ in 0..reps.max(1) {
                let t = Instant::now();
                model.score(Batch::new(&rows_ref, &pos_ref))?;
                best = best.min(t.elapsed().as_secs_f64());
            }
            let tokens = (len * batch) as f64;
            let flops = shapes.trace_flops(len, reads.len()) * batch as f64;
            let p = Point {
                len,
                batch,
                seconds: best,
                tokens_per_s: tokens / best,
                gflops: flops / best / 1e9,
            };
            progress(&p);
            points.push(p);
        }
    }
    Ok(points)
}

/// Two panels: time per token against length (flat = linear cost), and GFLOP/s against batch
/// size with the measured matmul peak.
pub(crate) fn svg(points: &[Point], peak: &Peak, title: &str) -> anyhow::Result<String> {
    use plotters::prelude::*;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (1000, 420)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(title, ("sans-serif", 16))?;
        let (left, right) = root.split_horizontally(500);
        let axes = Axes::of(points);
        per_token_panel(&left, points, &axes)?;
        gflops_panel(&right, points, peak, &axes)?;
        root.present()?;
    }
    Ok(out)
}

type Panel<'a> =
    plotters::drawing::DrawingArea<plotters::backend::SVGBackend<'a>, plotters::coord::Shift>;

/// The distinct lengths and batch sizes of the sweep, ascending.
struct Axes {
    lens: Vec<usize>,
    batches: Vec<usize>,
}

impl Axes {
    fn of(points: &[Point]) -> Axes {
        let mut lens: Vec<usize> = points.iter().map(|p| p.len).collect();
        let mut batches: Vec<usize> = points.iter().map(|p| p.batch).collect();
        lens.sort_unstable();
        lens.dedup();
        batches.sort_unstable();
        batches.dedup();
        Axes { lens, batches }
    }
}

/// Series i of n's colour.
fn color(i: usize, n: usize) -> plotters::style::RGBColor {
    use plotters::style::{Color, Palette, Palette99, RGBColor};
    let c = Palette99::pick(i * 99 / n.max(1)).to_rgba();
    RGBColor(c.0, c.1, c.2)
}

/// Left: µs per token against trace length, a line per batch size.
fn per_token_panel(area: &Panel, points: &[Point], axes: &Axes) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let (lens, batches) = (&axes.lens, &axes.batches);
    let us_max = points
        .iter()
        .map(|p| p.seconds * 1e6 / (p.len * p.batch) as f64)
        .fold(0.0, f64::max);
    let (lmin, lmax) = (
        *lens.first().unwrap_or(&1) as f64,
        *lens.last().unwrap_or(&2) as f64,
    );
    let mut chart = ChartBuilder::on(area)
        .caption("time per token vs trace length", ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d((lmin * 0.9..lmax * 1.1).log_scale(), 0.0..us_max * 1.15)?;
    chart
        .configure_mesh()
        .x_desc("tokens per trace (log)")
        .y_desc("µs per token")
        .draw()?;
    for (i, &b) in batches.iter().enumerate() {
        let c = color(i, batches.len());
        let series: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.batch == b)
            .map(|p| (p.len as f64, p.seconds * 1e6 / (p.len * p.batch) as f64))
            .collect();
        dotted_line(&mut chart, series, format!("batch {b}"), c)?;
    }
    legend(&mut chart, SeriesLabelPosition::UpperLeft)
}

/// Right: achieved GFLOP/s against batch size, a line per length, and the matmul peak.
fn gflops_panel(area: &Panel, points: &[Point], peak: &Peak, axes: &Axes) -> anyhow::Result<()> {
    use plotters::prelude::*;
    let (lens, batches) = (&axes.lens, &axes.batches);
    let bmax = *batches.last().unwrap_or(&1) as f64;
    let gmax = points.iter().map(|p| p.gflops).fold(peak.gflops, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption("achieved GFLOP/s vs batch size", ("sans-serif", 14))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d((0.9..bmax * 1.1).log_scale(), 0.0..gmax * 1.15)?;
    chart
        .configure_mesh()
        .x_desc("traces per forward pass (log)")
        .y_desc("GFLOP/s")
        .draw()?;
    let peak_line = vec![(0.9, peak.gflops), (bmax * 1.1, peak.gflops)];
    chart
        .draw_series(LineSeries::new(peak_line, BLACK.stroke_width(1)))?
        .label(format!("matmul peak {:.0}", peak.gflops))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], BLACK));
    for (i, &l) in lens.iter().enumerate() {
        let c = color(i, lens.len());
        let series: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.len == l)
            .map(|p| (p.batch as f64, p.gflops))
            .collect();
        dotted_line(&mut chart, series, format!("{l} tokens"), c)?;
    }
    legend(&mut chart, SeriesLabelPosition::LowerRight)
}

/// A chart of the scaling plot: a log-scaled x against a linear y.
type Chart<'a, 'b, X> = plotters::chart::ChartContext<
    'a,
    plotters::backend::SVGBackend<'b>,
    plotters::coord::cartesian::Cartesian2d<X, plotters::coord::types::RangedCoordf64>,
>;

/// One series as a line with a dot at each point, named in the legend.
fn dotted_line<X>(
    chart: &mut Chart<'_, '_, X>,
    series: Vec<(f64, f64)>,
    label: String,
    c: plotters::style::RGBColor,
) -> anyhow::Result<()>
where
    X: plotters::coord::ranged1d::Ranged<ValueType = f64>,
{
    use plotters::prelude::*;
    chart
        .draw_series(LineSeries::new(series.clone(), c.stroke_width(2)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], c));
    chart.draw_series(series.into_iter().map(|xy| Circle::new(xy, 3, c.filled())))?;
    Ok(())
}

/// The series' legend, boxed, at `position`.
fn legend<'a, 'b: 'a, X>(
    chart: &mut Chart<'a, 'b, X>,
    position: plotters::chart::SeriesLabelPosition,
) -> anyhow::Result<()>
where
    X: plotters::coord::ranged1d::Ranged<ValueType = f64>,
{
    use plotters::prelude::*;
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(position)
        .draw()?;
    Ok(())
}
