//! `retrace calibrate --target-agreement`: the confidence threshold a guaranteed cascade would
//! choose on the calibration rows (the server's own choice, `retrace::guarantee`), for each way
//! of reading the PRM's confidence, measured on the held-out rows: the share it keeps, and how
//! often what it keeps agrees with the rows' labels. The labels stand for the judge's verdicts
//! (a judge's recorded rows, or gold labels as an oracle judge).

use crate::common::Row;
use retrace::guarantee::{
    AgreementTarget, CalibrationItem, Confidence, GuaranteedThreshold, choose,
};

/// One way of reading confidence, chosen on the calibration rows and measured on the test rows.
#[derive(Debug, Clone)]
pub(super) struct GuaranteeRow {
    pub(super) confidence: Confidence,
    pub(super) calibrated: GuaranteedThreshold,
    /// On the test rows: kept, of which agreeing, of how many rows.
    pub(super) test: Option<(usize, usize, usize)>,
    /// How well the confidence ranks agreeing verdicts above disagreeing ones on the test rows
    /// (else the calibration rows): the area under the ROC curve.
    pub(super) auroc: Option<f64>,
}

/// The rows' items at each row's served threshold: the verdict's confidence and whether it
/// is the label. A failed row is no item.
fn items(rows: &[Row], confidence: Confidence) -> Vec<CalibrationItem> {
    rows.iter()
        .filter_map(|r| {
            let prediction = r.prediction?;
            let threshold = r.threshold?;
            let first = usize::try_from(prediction).ok();
            Some(CalibrationItem {
                confidence: confidence.of(&r.step_scores, first, threshold),
                agrees: prediction == r.label,
            })
        })
        .collect()
}

/// Every way of reading confidence, at `target`.
pub(super) fn measure(
    target: AgreementTarget,
    cal: &[Row],
    test: Option<&[Row]>,
) -> Vec<GuaranteeRow> {
    [Confidence::Verdict, Confidence::Margin]
        .into_iter()
        .map(|confidence| {
            let calibrated = choose(&items(cal, confidence), target);
            let held = test.map(|rows| items(rows, confidence));
            let test = held.as_ref().map(|items| {
                let kept: Vec<&CalibrationItem> = match calibrated.threshold {
                    Some(t) => items.iter().filter(|i| i.confidence >= t).collect(),
                    None => Vec::new(),
                };
                let agreed = kept.iter().filter(|i| i.agrees).count();
                (kept.len(), agreed, items.len())
            });
            let ranked = held.unwrap_or_else(|| items(cal, confidence));
            GuaranteeRow {
                confidence,
                calibrated,
                test,
                auroc: auroc(&ranked),
            }
        })
        .collect()
}

/// P(an agreeing item's confidence > a disagreeing one's), ties counting half; None without
/// both kinds.
pub(super) fn auroc(items: &[CalibrationItem]) -> Option<f64> {
    let mut sorted: Vec<&CalibrationItem> = items.iter().collect();
    sorted.sort_by(|a, b| a.confidence.total_cmp(&b.confidence));
    let (pos, neg) = (
        sorted.iter().filter(|i| i.agrees).count() as f64,
        sorted.iter().filter(|i| !i.agrees).count() as f64,
    );
    if pos == 0.0 || neg == 0.0 {
        return None;
    }
    // Mann-Whitney: the agreeing items' mean rank, ties sharing theirs.
    let mut rank_sum = 0.0;
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j < sorted.len() && sorted[j].confidence == sorted[i].confidence {
            j += 1;
        }
        let mean_rank = (i + j + 1) as f64 / 2.0;
        rank_sum += mean_rank * sorted[i..j].iter().filter(|x| x.agrees).count() as f64;
        i = j;
    }
    Some((rank_sum - pos * (pos + 1.0) / 2.0) / (pos * neg))
}

/// The table, and the config lines for the way that kept the most held-out rows (else the
/// most calibration rows).
pub(super) fn render(target: AgreementTarget, rows: &[GuaranteeRow]) -> String {
    let pct = |a: usize, b: usize| match b {
        0 => "-".to_string(),
        _ => format!("{:.1}%", 100.0 * a as f64 / b as f64),
    };
    let mut out = format!(
        "guarantee at target_agreement {} with target_confidence {}:\n\
         confidence  threshold  kept (calibration)  bound   coverage (test)  agreement (test)  AUROC\n",
        target.agreement, target.confidence
    );
    for r in rows {
        let c = &r.calibrated;
        let (coverage, agreement) = match r.test {
            Some((kept, agreed, n)) => (
                pct(kept, n),
                format!("{} ({agreed}/{kept})", pct(agreed, kept)),
            ),
            None => ("-".into(), "-".into()),
        };
        out.push_str(&format!(
            "{:<11} {:>9}  {:>18}  {:.3}  {coverage:>15}  {agreement:>16}  {}\n",
            name(r.confidence),
            c.threshold.map_or("none".into(), |t| format!("{t:.4}")),
            format!("{}/{}", c.kept, c.items),
            c.bound,
            r.auroc.map_or("-".into(), |a| format!("{a:.3}")),
        ));
    }
    let best = rows
        .iter()
        .max_by_key(|r| r.test.map_or(r.calibrated.kept, |t| t.0));
    if let Some(b) = best.filter(|b| b.calibrated.threshold.is_some()) {
        out.push_str(&format!(
            "target_agreement = {}\ntarget_confidence = {}\nconfidence = \"{}\"\n",
            target.agreement,
            target.confidence,
            name(b.confidence)
        ));
    }
    out
}

/// The same table as JSON (`guarantee.json`), for scripts that act on it (the learning loop
/// compares heads by their coverage): one entry per way of reading confidence.
pub(super) fn json(target: AgreementTarget, rows: &[GuaranteeRow]) -> serde_json::Value {
    let ways: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let c = &r.calibrated;
            serde_json::json!({
                "confidence": name(r.confidence),
                "threshold": c.threshold,
                "calibration_rows": c.items,
                "kept": c.kept,
                "disagreements": c.disagreements,
                "bound": c.bound,
                "test": r.test.map(|(kept, agreed, rows)| serde_json::json!({
                    "rows": rows, "kept": kept, "agreed": agreed,
                })),
                "auroc": r.auroc,
            })
        })
        .collect();
    serde_json::json!({
        "target_agreement": target.agreement,
        "target_confidence": target.confidence,
        "ways": ways,
    })
}

fn name(c: Confidence) -> &'static str {
    match c {
        Confidence::Verdict => "verdict",
        Confidence::Margin => "margin",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auroc_counts_pairs_and_halves_ties() {
        let item = |confidence, agrees| CalibrationItem { confidence, agrees };
        assert_eq!(auroc(&[item(0.9, true), item(0.1, false)]), Some(1.0));
        assert_eq!(auroc(&[item(0.1, true), item(0.9, false)]), Some(0.0));
        assert_eq!(auroc(&[item(0.5, true), item(0.5, false)]), Some(0.5));
        // Two agreeing (0.9, 0.3), two not (0.5, 0.1): of four pairs, three ranked right.
        let mixed = [
            item(0.9, true),
            item(0.3, true),
            item(0.5, false),
            item(0.1, false),
        ];
        assert_eq!(auroc(&mixed), Some(0.75));
        assert_eq!(auroc(&[item(0.5, true)]), None);
    }
}
