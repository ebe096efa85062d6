//! The head folder's report, in `eval`'s style (its sections, tables and plots): what each
//! candidate tap and head kind scored on dev, F1 over the epochs, the threshold curve, and
//! dev's ProcessBench metric and category confusion at the chosen threshold.

use super::choose::Outcome;
use super::fit::Epoch;
use crate::common::Analysis;
use crate::common::style::{
    PlotResult, SPLIT_COLORS, Section, Table, categories_section, html, markdown, metric_section,
    section, svg, table, threshold_curve,
};
use plotters::prelude::*;
use retrace::HeadConfig;

/// The report's two renderings: (markdown, html).
pub(crate) fn render(config: &HeadConfig, out: &Outcome, dev: &Analysis) -> (String, String) {
    let title = format!("PRM head on {}", config.base);
    let notes = notes(config, out);
    let mut sections = vec![taps_section(out), head_section(out), epochs_section(out)];
    sections.push(threshold_section(out));
    let mut metric = metric_section(dev);
    metric.title = "Dev at the chosen threshold".into();
    sections.push(metric);
    if let Some(c) = &dev.categories {
        let mut s = categories_section(c);
        s.text.insert(
            0,
            "The category is the category head's choice at the predicted first wrong step.".into(),
        );
        sections.push(s);
    }
    (
        markdown(&title, &notes, &sections),
        html(&title, &notes, &sections),
    )
}

fn notes(c: &HeadConfig, out: &Outcome) -> Vec<String> {
    let files = |f: &[super::data::DataFile]| {
        f.iter()
            .map(|f| format!("`{}` ({} rows)", f.path, f.rows))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let l = c.label_counts.unwrap_or_default();
    vec![
        format!("base: `{}`, sha256 `{}`", c.base, c.base_sha256),
        format!("format: `{}`; seed {}", c.format.as_str(), c.seed),
        format!("trained on: {}", files(&c.data)),
        format!("dev: {}", files(&c.dev)),
        format!(
            "training steps: {} correct, {} wrong (first errors) in {} traces, {} of them \
             all correct; steps after a trace's first error are not trained on",
            l.correct_steps, l.wrong_steps, l.traces, l.all_correct_traces
        ),
        format!(
            "kept: **{}** head on tap **{}** (layers {}), threshold **{}**, dev F1 **{:.2}**",
            c.head.name(),
            out.tap().name,
            c.layers,
            c.threshold,
            out.threshold.f1
        ),
    ]
}

fn f1(v: f64) -> String {
    format!("{v:.2}")
}

fn taps_section(out: &Outcome) -> Section {
    let mut s = section("Taps");
    s.text.push(
        "A logistic head on each candidate tap (the hidden states of these layers at each \
         step's read position, averaged); the tap with the best dev F1 wins. Dev F1: the mean \
         over dev's splits of ProcessBench's F1, at dev's best threshold, for the best epoch."
            .into(),
    );
    let rows = out
        .taps
        .iter()
        .enumerate()
        .map(|(i, (tap, fit))| {
            let name = if i == out.winner {
                format!("**{}**", tap.name)
            } else {
                tap.name.clone()
            };
            let h = &fit.fitted;
            vec![
                name,
                retrace::HeadLayers(tap.parts.clone()).to_string(),
                f1(fit.dev_f1),
                f1(h.history[h.best].train),
                h.history[h.best].epoch.to_string(),
                h.history.len().to_string(),
            ]
        })
        .collect();
    s.tables.push(table(
        &[
            "tap",
            "layers",
            "dev F1",
            "train F1",
            "best epoch",
            "epochs run",
        ],
        rows,
    ));
    s
}

fn head_section(out: &Outcome) -> Section {
    let mut s = section("Step head");
    let logistic = out.taps[out.winner].1.dev_f1;
    let mut rows = vec![vec![
        "logistic".into(),
        f1(logistic),
        out.kept.is_none().to_string(),
    ]];
    for (i, l) in out.larger.iter().enumerate() {
        let name = l.fitted.head.kind.to_string();
        rows.push(vec![name, f1(l.dev_f1), (out.kept == Some(i)).to_string()]);
    }
    s.text.push(match out.larger.len() {
        0 => "No larger head was tried (--mlp-hidden 0 and --trace-width 0, or --head).".into(),
        _ => format!(
            "Larger heads on tap {} (the MLP reads each step alone, the trace probe the steps \
             before it too) are each kept only when their dev F1 beats the head kept so far by \
             the margin, unless --head names one.",
            out.tap().name
        ),
    });
    s.tables.push(table(&["head", "dev F1", "kept"], rows));
    s
}

fn epochs_section(out: &Outcome) -> Section {
    let mut s = section("Training");
    s.text.push(format!(
        "Train and dev F1 after each epoch of the kept step head (train F1 at dev's best \
         threshold of that epoch); training stops when dev has not improved for the patience, \
         and the best epoch's weights are kept.{}",
        if out.category.is_some() {
            " The category head's scores are balanced accuracies (mean recall over the \
             categories), on first wrong steps and, as none, correct steps."
        } else {
            ""
        }
    ));
    let kept = &out.step().fitted;
    let mut fits: Vec<(String, &[Epoch])> = vec![("step head".into(), &kept.history)];
    if let Some(c) = &out.category {
        fits.push(("category head".into(), &c.history));
    }
    s.tables.push(epoch_table(&kept.history, kept.best));
    s.plots.push(epochs_plot(&fits));
    s
}

fn epoch_table(history: &[Epoch], best: usize) -> Table {
    let rows = history
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let mark = if i == best { " (kept)" } else { "" };
            vec![
                format!("{}{mark}", e.epoch),
                format!("{:.4}", e.loss),
                format!("{:.4}", e.dev_loss),
                f1(e.train),
                f1(e.dev),
            ]
        })
        .collect();
    table(
        &["epoch", "train loss", "dev loss", "train F1", "dev F1"],
        rows,
    )
}

fn threshold_section(out: &Outcome) -> Section {
    let mut s = section("Threshold");
    let ch = &out.threshold;
    s.text.push(format!(
        "A step is wrong when its probability is below the threshold; the first such step is \
         the first error. Calibrated on dev with `calibrate`'s exact sweep: **{}** (dev F1 \
         {:.2}; every threshold in ({}, {}] scores the same there). Dev chose it, so dev's F1 \
         is optimistic; measure the head on data it never saw with `retrace eval`.",
        ch.threshold,
        ch.f1,
        ch.low.unwrap_or(0.0),
        ch.high
    ));
    let rows = (0..=20)
        .map(|i| {
            let t = i as f32 / 20.0;
            vec![format!("{t:.2}"), f1(out.curve.mean_f1(out.curve.point(t)))]
        })
        .collect();
    s.tables.push(Table {
        caption: "Dev F1 at round thresholds:".into(),
        ..table(&["threshold", "dev F1"], rows)
    });
    s.plots.push(threshold_curve(&out.curve, ch));
    s
}

/// Train (dashed) and dev (solid) scores over the epochs, one colour per head.
fn epochs_plot(fits: &[(String, &[Epoch])]) -> String {
    let last = fits
        .iter()
        .flat_map(|(_, h)| h.iter().map(|e| e.epoch))
        .max()
        .unwrap_or(1)
        .max(2);
    svg((720, 400), |root| -> PlotResult {
        let mut chart = ChartBuilder::on(root)
            .caption("Train and dev scores over epochs", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(44)
            .build_cartesian_2d(1usize..last, 0f64..100f64)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .y_desc("F1 (step head) / balanced accuracy (category head)")
            .draw()?;
        for (i, (name, history)) in fits.iter().enumerate() {
            let color = SPLIT_COLORS[i % SPLIT_COLORS.len()];
            let dev = history.iter().map(|e| (e.epoch, e.dev));
            chart
                .draw_series(LineSeries::new(dev, color.stroke_width(2)))?
                .label(format!("{name}: dev"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            let train = history.iter().map(|e| (e.epoch, e.train));
            chart
                .draw_series(DashedLineSeries::new(train, 6, 4, color.stroke_width(1)))?
                .label(format!("{name}: train"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(1))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        Ok(())
    })
}
