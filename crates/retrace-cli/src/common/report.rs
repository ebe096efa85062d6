//! The report: sections of text, tables and plots, rendered as Markdown and as one
//! self-contained HTML page (inline CSS and SVG, nothing fetched).

use super::analysis::{Analysis, AnswerLevel, CategoryStats, GeneratorStats};
use super::best_of_n::BestOfN;
use super::calibrate::{Curve, ThresholdChoice};
use super::metric::Summary;
use super::plots::{self, html_escape};
use retrace::ErrorCategory;

/// Everything a report shows.
pub struct Report {
    pub title: String,
    /// Lines under the title: evaluator, inputs, counts.
    pub notes: Vec<String>,
    pub analysis: Analysis,
    pub calibration: Option<Calibration>,
}

/// What `calibrate` adds.
pub struct Calibration {
    pub evaluator: String,
    pub curve: Curve,
    pub choice: ThresholdChoice,
    /// Each split's own best, when asked for.
    pub per_split: Vec<(String, ThresholdChoice)>,
    /// The held-out set at the served threshold and at the chosen one.
    pub test: Option<(Summary, Summary)>,
}

/// A table of a report section.
pub(crate) struct Table {
    /// Shown above the table when not empty.
    pub caption: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// A section of a report: paragraphs, tables, then plots (SVG).
pub(crate) struct Section {
    pub title: String,
    pub text: Vec<String>,
    pub tables: Vec<Table>,
    pub plots: Vec<String>,
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |v| format!("{v:.1}"))
}

pub(crate) fn table(headers: &[&str], rows: Vec<Vec<String>>) -> Table {
    Table {
        caption: String::new(),
        headers: headers.iter().map(|h| h.to_string()).collect(),
        rows,
    }
}

pub(crate) fn section(title: &str) -> Section {
    Section {
        title: title.into(),
        text: vec![],
        tables: vec![],
        plots: vec![],
    }
}

/// The ProcessBench table: one row per split and the average.
fn metric_table(s: &Summary) -> Table {
    let mut rows: Vec<Vec<String>> = s
        .splits
        .iter()
        .map(|x| {
            vec![
                x.split.clone(),
                x.counts.error_total.to_string(),
                x.counts.correct_total.to_string(),
                pct(x.error_acc),
                pct(x.correct_acc),
                pct(x.f1),
                x.failed.to_string(),
            ]
        })
        .collect();
    if s.splits.len() > 1 {
        let total = |f: fn(&super::metric::SplitScore) -> usize| {
            s.splits.iter().map(f).sum::<usize>().to_string()
        };
        rows.push(vec![
            "**average**".into(),
            total(|x| x.counts.error_total),
            total(|x| x.counts.correct_total),
            pct(s.average.error_acc),
            pct(s.average.correct_acc),
            pct(s.average.f1),
            total(|x| x.failed),
        ]);
    }
    table(
        &[
            "split",
            "error traces",
            "correct traces",
            "error acc",
            "correct acc",
            "F1",
            "failed",
        ],
        rows,
    )
}

fn generator_row(g: &GeneratorStats) -> Vec<String> {
    vec![
        g.generator.clone(),
        g.traces.to_string(),
        pct(g.answer_acc()),
        pct(g.reasoning_acc(false)),
        pct(g.inflation(false)),
        pct(g.process_error_rate(false)),
        pct(g.reasoning_acc(true)),
        pct(g.inflation(true)),
        pct(g.process_error_rate(true)),
    ]
}

fn sections(r: &Report) -> Vec<Section> {
    let a = &r.analysis;
    let mut out = vec![metric_section(a)];
    if let Some(c) = &a.categories {
        out.push(categories_section(c));
    }
    if let Some(ans) = &a.answers {
        out.push(answers_section(ans));
    }
    if let Some(b) = &a.best_of_n {
        out.push(best_of_n_section(b));
    }
    if let Some(c) = &r.calibration {
        out.push(calibration_section(c));
    }
    out
}

pub(crate) fn metric_section(a: &Analysis) -> Section {
    let mut m = section("ProcessBench metric");
    m.text.push(format!(
        "{} traces, {} failed requests (counted wrong). Error acc: share of traces with a wrong \
         step whose first wrong step is found exactly; correct acc: share of all-correct traces \
         judged all-correct; F1: their harmonic mean; the average is the mean over splits.",
        a.rows, a.failed
    ));
    m.tables.push(metric_table(&a.summary));
    m.plots
        .extend(plots::for_analysis(a).into_iter().map(|(_, s)| s));
    m
}

pub(crate) fn categories_section(c: &CategoryStats) -> Section {
    let mut s = section("Error categories");
    s.text.push(
        "Index acc: the first wrong step is found exactly; category acc: the predicted \
         category equals the gold one. Confusion: gold (rows) against predicted (columns)."
            .into(),
    );
    s.tables.push(table(
        &["gold category", "traces", "index acc", "category acc"],
        c.by_gold
            .iter()
            .map(|(g, &(n, idx, cat))| {
                let p = |k: usize| pct((n > 0).then(|| k as f64 / n as f64 * 100.0));
                vec![g.as_str().into(), n.to_string(), p(idx), p(cat)]
            })
            .collect(),
    ));
    s.tables.push(confusion_table(c));
    s
}

/// Gold categories (rows) against predicted ones (columns, then unspecified and failed).
fn confusion_table(c: &CategoryStats) -> Table {
    let cols: Vec<Option<ErrorCategory>> = ErrorCategory::LABELLED
        .iter()
        .copied()
        .map(Some)
        .chain([Some(ErrorCategory::Unspecified), None])
        .collect();
    let mut headers = vec!["gold \\ predicted".to_string()];
    headers.extend(
        cols.iter()
            .map(|c| c.map_or("failed", ErrorCategory::as_str).to_string()),
    );
    let rows = ErrorCategory::LABELLED
        .iter()
        .map(|g| {
            let mut row = vec![g.as_str().to_string()];
            row.extend(
                cols.iter()
                    .map(|p| c.confusion.get(&(*g, *p)).copied().unwrap_or(0).to_string()),
            );
            row
        })
        .collect();
    Table {
        caption: String::new(),
        headers,
        rows,
    }
}

fn answers_section(ans: &AnswerLevel) -> Section {
    let mut s = section("Answer-level analysis (by generator)");
    s.text.push(
        "Answer-only acc: final answer correct. Reasoning-aware acc: final answer correct \
         and no wrong step, by the gold labels and by the evaluator's verdicts. Inflation: \
         the points between them. Process error rate: share of correct answers whose trace \
         has a wrong step. A failed request never counts as a sound trace."
            .into(),
    );
    let mut rows: Vec<Vec<String>> = ans.generators.iter().map(generator_row).collect();
    rows.push(generator_row(&ans.all));
    s.tables.push(table(
        &[
            "generator",
            "traces",
            "answer-only acc",
            "reasoning-aware acc (gold)",
            "inflation (gold)",
            "process error rate (gold)",
            "reasoning-aware acc (evaluator)",
            "inflation (evaluator)",
            "process error rate (evaluator)",
        ],
        rows,
    ));
    s
}

fn best_of_n_section(b: &BestOfN) -> Section {
    let mut s = section("Best-of-N selection");
    s.text.push(format!(
        "Rows with the same question are one question's candidates: {} questions with two \
         candidates or more ({} candidates), {} of them with both a right and a wrong final \
         answer. Each selector picks the candidate it scores highest; the share is of questions \
         whose pick has a right final answer (ties count the expected share of a random break).",
        b.questions, b.candidates, b.mixed
    ));
    s.tables.push(table(
        &["selector", "right picks, all (%)", "right picks, mixed (%)"],
        b.rows(),
    ));
    s
}

fn calibration_section(c: &Calibration) -> Section {
    let mut s = section("Threshold calibration");
    let ch = &c.choice;
    let interval = match ch.low {
        Some(low) => format!("({low}, {}]", ch.high),
        None => format!("[0, {}]", ch.high),
    };
    s.text.push(format!(
        "The F1-maximising threshold on the calibration data is **{}** (mean F1 over splits \
         {:.2}; every threshold in {interval} scores the same there). The curve is exact: it \
         has one point per interval between distinct step scores ({} points).",
        ch.threshold,
        ch.f1,
        c.curve.len()
    ));
    s.text.push(format!(
        "Config line for evaluator `{}`:\n\n```toml\nthreshold = {}\n```",
        c.evaluator, ch.threshold
    ));
    s.tables.push(Table {
        caption: "Calibration data at the chosen threshold:".into(),
        ..metric_table(&ch.summary)
    });
    if !c.per_split.is_empty() {
        s.tables.push(Table {
            caption: "Each split's own best threshold:".into(),
            ..table(
                &["split", "best threshold", "its F1"],
                c.per_split
                    .iter()
                    .map(|(name, x)| {
                        vec![
                            name.clone(),
                            x.threshold.to_string(),
                            format!("{:.2}", x.f1),
                        ]
                    })
                    .collect(),
            )
        });
    }
    if let Some((served, tuned)) = &c.test {
        s.text.push(format!(
            "Held-out test data: mean F1 {} at the thresholds it was served with, {} at {}.",
            pct(served.average.f1),
            pct(tuned.average.f1),
            ch.threshold
        ));
        s.tables.push(Table {
            caption: format!("Test data at threshold {}:", ch.threshold),
            ..metric_table(tuned)
        });
    } else {
        s.text.push(
            "No test data was given (--test-on): the F1 above is measured on the data the \
             threshold was chosen on, so it is optimistic."
                .into(),
        );
    }
    let rows = (0..=20)
        .map(|i| {
            let t = i as f32 / 20.0;
            let k = c.curve.point(t);
            vec![format!("{t:.2}"), format!("{:.2}", c.curve.mean_f1(k))]
        })
        .collect();
    s.tables.push(Table {
        caption: "Mean F1 on the calibration data at round thresholds:".into(),
        ..table(&["threshold", "mean F1"], rows)
    });
    s.plots.push(plots::threshold_curve(&c.curve, ch));
    s
}

/// The report as Markdown (plots are in the HTML page only).
pub fn render_markdown(r: &Report) -> String {
    markdown(&r.title, &r.notes, &sections(r))
}

/// A titled page of notes and sections as Markdown (plots are in the HTML page only).
pub(crate) fn markdown(title: &str, notes: &[String], sections: &[Section]) -> String {
    let mut out = format!("# {title}\n\n");
    for n in notes {
        out.push_str(&format!("- {n}\n"));
    }
    for s in sections {
        out.push_str(&format!("\n## {}\n\n", s.title));
        for t in &s.text {
            out.push_str(t);
            out.push_str("\n\n");
        }
        for t in &s.tables {
            if !t.caption.is_empty() {
                out.push_str(&format!("{}\n\n", t.caption));
            }
            out.push_str(&format!("| {} |\n", t.headers.join(" | ")));
            out.push_str(&format!("|{}\n", "---|".repeat(t.headers.len())));
            for row in &t.rows {
                out.push_str(&format!("| {} |\n", row.join(" | ")));
            }
            out.push('\n');
        }
    }
    out
}

/// Markdown's two inline forms we use (`**bold**`, `` `code` ``) and fenced blocks, as HTML.
fn inline_html(text: &str) -> String {
    let escaped = html_escape(text);
    if let Some(rest) = escaped.split_once("```toml\n") {
        let (before, code) = rest;
        let code = code.trim_end_matches("```").trim_end_matches('\n');
        return format!("{}<pre>{code}</pre>", inline_html(before.trim_end()));
    }
    let mut out = String::new();
    for (i, part) in escaped.split("**").enumerate() {
        let part = part
            .split('`')
            .enumerate()
            .map(|(j, p)| {
                if j % 2 == 1 {
                    format!("<code>{p}</code>")
                } else {
                    p.to_string()
                }
            })
            .collect::<String>();
        if i % 2 == 1 {
            out.push_str(&format!("<strong>{part}</strong>"));
        } else {
            out.push_str(&part);
        }
    }
    out
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;\
padding:0 1em;color:#222}table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;\
padding:4px 8px;text-align:right}th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}\
pre{background:#f6f6f6;padding:.6em}figure{margin:1em 0}";

/// The report as one HTML page with the plots inline.
pub fn render_html(r: &Report) -> String {
    html(&r.title, &r.notes, &sections(r))
}

/// A titled page of notes and sections as one HTML page with the plots inline.
pub(crate) fn html(title: &str, notes: &[String], sections: &[Section]) -> String {
    let mut out = format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{t}</title><style>{STYLE}</style></head><body>\n<h1>{t}</h1>\n<ul>",
        t = html_escape(title)
    );
    for n in notes {
        out.push_str(&format!("<li>{}</li>", inline_html(n)));
    }
    out.push_str("</ul>\n");
    for s in sections {
        out.push_str(&format!("<h2>{}</h2>\n", html_escape(&s.title)));
        for t in &s.text {
            out.push_str(&format!("<p>{}</p>\n", inline_html(t)));
        }
        for t in &s.tables {
            if !t.caption.is_empty() {
                out.push_str(&format!("<p>{}</p>\n", inline_html(&t.caption)));
            }
            out.push_str("<table><tr>");
            for h in &t.headers {
                out.push_str(&format!("<th>{}</th>", html_escape(h)));
            }
            out.push_str("</tr>\n");
            for row in &t.rows {
                out.push_str("<tr>");
                for cell in row {
                    out.push_str(&format!("<td>{}</td>", inline_html(cell)));
                }
                out.push_str("</tr>\n");
            }
            out.push_str("</table>\n");
        }
        for p in &s.plots {
            out.push_str(&format!("<figure>{p}</figure>\n"));
        }
    }
    out.push_str("</body></html>\n");
    out
}
