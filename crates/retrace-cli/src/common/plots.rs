//! The report's plots as self-contained SVG strings (plotters, SVG backend only): F1 per split,
//! the F1-threshold curve, gold against predicted first-error index, the category confusion.

use super::analysis::Analysis;
use super::calibrate::{Curve, ThresholdChoice};
use super::metric::Summary;
use plotters::coord::Shift;
use plotters::prelude::*;
use retrace::ErrorCategory;
use std::collections::BTreeMap;

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
pub(crate) type PlotResult = Result<(), Box<dyn std::error::Error>>;

pub(crate) const SPLIT_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Renders with `draw` into an SVG string; a failure renders as a note, not an error.
pub(crate) fn svg(size: (u32, u32), draw: impl FnOnce(&Area) -> PlotResult) -> String {
    let mut buf = String::new();
    let result = {
        let root = SVGBackend::with_string(&mut buf, size).into_drawing_area();
        root.fill(&WHITE)
            .map_err(Into::into)
            .and_then(|_| draw(&root))
            .and_then(|_| root.present().map_err(Into::into))
    };
    match result {
        Ok(()) => buf,
        Err(e) => format!("<p>(plot failed: {})</p>", html_escape(&e.to_string())),
    }
}

pub(crate) fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A white-to-blue shade for a share in [0, 1].
fn heat(share: f64) -> RGBColor {
    let s = share.clamp(0.0, 1.0);
    RGBColor(
        (255.0 - 224.0 * s) as u8,
        (255.0 - 136.0 * s) as u8,
        (255.0 - 75.0 * s) as u8,
    )
}

/// F1 per split (bars) with error and correct accuracy (markers), and the average.
pub(crate) fn f1_per_split(summary: &Summary) -> String {
    let mut names: Vec<String> = summary.splits.iter().map(|s| s.split.clone()).collect();
    let mut values: Vec<(Option<f64>, Option<f64>, Option<f64>)> = summary
        .splits
        .iter()
        .map(|s| (s.f1, s.error_acc, s.correct_acc))
        .collect();
    if summary.splits.len() > 1 {
        names.push("average".into());
        let a = &summary.average;
        values.push((a.f1, a.error_acc, a.correct_acc));
    }
    let width = 200 + 110 * names.len() as u32;
    svg((width.max(480), 360), |root| {
        let n = names.len();
        let mut chart = ChartBuilder::on(root)
            .caption("ProcessBench F1 per split", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            // plotters' integer ranges are inclusive: 0..=n-1 makes n segments.
            .build_cartesian_2d((0..n.saturating_sub(1)).into_segmented(), 0f64..100f64)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .y_desc("percent")
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                    names.get(*i).cloned().unwrap_or_default()
                }
                SegmentValue::Last => String::new(),
            })
            .draw()?;
        let bar = RGBColor(31, 119, 180);
        chart
            .draw_series(values.iter().enumerate().map(|(i, v)| {
                // The last segment's right edge is `Last`: `Exact(n)` lies outside the range.
                let right = if i + 1 == n {
                    SegmentValue::Last
                } else {
                    SegmentValue::Exact(i + 1)
                };
                let mut r = Rectangle::new(
                    [(SegmentValue::Exact(i), 0.0), (right, v.0.unwrap_or(0.0))],
                    bar.mix(0.7).filled(),
                );
                r.set_margin(0, 0, 18, 18);
                r
            }))?
            .label("F1")
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], bar.filled()));
        let markers = [(1usize, "error acc", RED), (2, "correct acc", GREEN)];
        for (which, label, color) in markers {
            let points = values.iter().enumerate().filter_map(move |(i, v)| {
                let value = if which == 1 { v.1 } else { v.2 };
                value.map(|y| (SegmentValue::CenterOf(i), y))
            });
            chart
                .draw_series(points.map(move |p| Circle::new(p, 5, color.filled())))?
                .label(label)
                .legend(move |(x, y)| Circle::new((x + 6, y), 5, color.filled()));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    })
}

/// Mean F1 (and each split's) against the threshold, with the chosen threshold marked.
pub(crate) fn threshold_curve(curve: &Curve, choice: &ThresholdChoice) -> String {
    let samples = curve.sampled(400);
    svg((720, 400), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption("F1 against PRM threshold", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(44)
            .build_cartesian_2d(0f32..1f32, 0f64..100f64)?;
        chart
            .configure_mesh()
            .x_desc("threshold (a step scoring below it is an error)")
            .y_desc("F1")
            .draw()?;
        if curve.splits.len() > 1 {
            for (s, name) in curve.splits.iter().enumerate() {
                let color = SPLIT_COLORS[s % SPLIT_COLORS.len()];
                chart
                    .draw_series(LineSeries::new(
                        samples.iter().map(|(t, _, per)| (*t, per[s])),
                        color.mix(0.6).stroke_width(1),
                    ))?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                    });
            }
        }
        chart
            .draw_series(LineSeries::new(
                samples.iter().map(|(t, mean, _)| (*t, *mean)),
                BLACK.stroke_width(2),
            ))?
            .label("mean over splits")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.stroke_width(2)));
        let t = choice.threshold;
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(t, 0.0), (t, 100.0)],
                RED.stroke_width(1),
            )))?
            .label(format!("chosen: {t} (F1 {:.1})", choice.f1))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED.stroke_width(1)));
        chart.draw_series(std::iter::once(Circle::new(
            (t, choice.f1),
            4,
            RED.filled(),
        )))?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    })
}

/// Gold first-error index (x) against predicted (y), each gold column shaded by its share.
pub(crate) fn index_heatmap(pairs: &BTreeMap<(i32, Option<i32>), usize>) -> String {
    const FAILED: i32 = -2;
    // Long traces make huge grids: indices past 20 share one cell.
    let cap = |i: i32| i.min(20);
    let mut cells: BTreeMap<(i32, i32), usize> = BTreeMap::new();
    let mut columns: BTreeMap<i32, usize> = BTreeMap::new();
    for (&(gold, pred), &n) in pairs {
        let (x, y) = (cap(gold), pred.map_or(FAILED, cap));
        *cells.entry((x, y)).or_default() += n;
        *columns.entry(x).or_default() += n;
    }
    let max_x = cells.keys().map(|k| k.0).max().unwrap_or(0).max(0);
    let max_y = cells.keys().map(|k| k.1).max().unwrap_or(0).max(0);
    let has_failed = cells.keys().any(|k| k.1 == FAILED);
    let min_y = if has_failed { FAILED } else { -1 };
    let label = |v: f64| {
        let r = v.round();
        if (v - r).abs() > 1e-6 {
            return String::new();
        }
        match r as i32 {
            FAILED => "failed".into(),
            20 => "20+".into(),
            i => i.to_string(),
        }
    };
    svg((640, 560), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption(
                "First wrong step: gold (x) against predicted (y)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(
                -1.5f64..max_x as f64 + 0.5,
                min_y as f64 - 0.5..max_y as f64 + 0.5,
            )?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("gold index (-1: all steps correct); shade: share of the gold column")
            .y_desc("predicted index")
            .x_labels((max_x + 3) as usize)
            .y_labels((max_y - min_y + 2) as usize)
            .x_label_formatter(&|v| label(*v))
            .y_label_formatter(&|v| label(*v))
            .draw()?;
        chart.draw_series(cells.iter().map(|(&(x, y), &n)| {
            let share = n as f64 / columns[&x].max(1) as f64;
            let (x, y) = (x as f64, y as f64);
            Rectangle::new(
                [(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)],
                heat(share).filled(),
            )
        }))?;
        // The diagonal: where a prediction matches.
        let d = max_x.min(max_y) as f64 + 0.5;
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(-1.5, -1.5), (d, d)],
            RED.mix(0.5).stroke_width(1),
        )))?;
        Ok(())
    })
}

/// Gold category (rows) against predicted category (columns), with counts in the cells.
pub(crate) fn category_heatmap(
    confusion: &BTreeMap<(ErrorCategory, Option<ErrorCategory>), usize>,
) -> String {
    let rows = ErrorCategory::LABELLED;
    let cols: Vec<Option<ErrorCategory>> = ErrorCategory::LABELLED
        .iter()
        .copied()
        .map(Some)
        .chain([Some(ErrorCategory::Unspecified), None])
        .collect();
    let col_name =
        |c: &Option<ErrorCategory>| c.map_or("failed", ErrorCategory::as_str).to_string();
    let row_totals: Vec<usize> = rows
        .iter()
        .map(|g| {
            cols.iter()
                .map(|p| confusion.get(&(*g, *p)).copied().unwrap_or(0))
                .sum()
        })
        .collect();
    let name_at = |names: &[String], v: f64| {
        let r = v.round();
        if (v - r).abs() > 1e-6 || r < 0.0 {
            return String::new();
        }
        names.get(r as usize).cloned().unwrap_or_default()
    };
    let col_names: Vec<String> = cols.iter().map(col_name).collect();
    let row_names: Vec<String> = rows.iter().map(|c| c.as_str().to_string()).collect();
    svg((820, 400), |root| {
        let mut chart = ChartBuilder::on(root)
            .caption(
                "Error category: gold (rows) against predicted",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(130)
            .build_cartesian_2d(
                -0.5f64..cols.len() as f64 - 0.5,
                rows.len() as f64 - 0.5..-0.5f64,
            )?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(cols.len())
            .y_labels(rows.len())
            .x_label_formatter(&|v| name_at(&col_names, *v))
            .y_label_formatter(&|v| name_at(&row_names, *v))
            .draw()?;
        for (ri, g) in rows.iter().enumerate() {
            for (ci, p) in cols.iter().enumerate() {
                let n = confusion.get(&(*g, *p)).copied().unwrap_or(0);
                let share = n as f64 / row_totals[ri].max(1) as f64;
                let (x, y) = (ci as f64, ri as f64);
                chart.draw_series(std::iter::once(Rectangle::new(
                    [(x - 0.5, y - 0.5), (x + 0.5, y + 0.5)],
                    heat(share).filled(),
                )))?;
                chart.draw_series(std::iter::once(Text::new(
                    n.to_string(),
                    (x - 0.1, y),
                    ("sans-serif", 14).into_font().color(&BLACK),
                )))?;
            }
        }
        Ok(())
    })
}

/// Every plot an analysis supports, as (title, svg).
pub(crate) fn for_analysis(a: &Analysis) -> Vec<(&'static str, String)> {
    let mut out = vec![("F1 per split", f1_per_split(&a.summary))];
    if !a.index_pairs.is_empty() {
        out.push(("First wrong step", index_heatmap(&a.index_pairs)));
    }
    if let Some(c) = &a.categories {
        out.push(("ErrorCategory confusion", category_heatmap(&c.confusion)));
    }
    out
}
