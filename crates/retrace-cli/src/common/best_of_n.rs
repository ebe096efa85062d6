//! Best-of-N selection from a predictions file: rows that share a question (and split) are one
//! question's candidates; each selector picks the candidate it scores highest, and the table is
//! the share of questions whose pick has a correct final answer (`final_answer_correct`).

use super::predictions::Row;
use serde::Serialize;
use std::collections::BTreeMap;

/// One way of picking a candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Selector {
    /// Each candidate equally likely (every score ties): the share of right candidates.
    Random,
    /// The evaluator's trace score (a PRM's aggregate of step scores, min by default).
    TraceScore,
    /// The outcome model's raw score.
    Outcome,
    /// min(trace score, sigmoid(outcome score)), as the `min_with_outcome` reward rule.
    MinWithOutcome,
    /// A right candidate whenever the question has one.
    Oracle,
}

/// One selector's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SelectorShare {
    pub selector: &'static str,
    /// Share of questions whose pick is right, in percent; ties are broken at random (the
    /// expected share is counted).
    pub all: f64,
    /// The same over questions with both right and wrong candidates, where the pick matters.
    pub mixed: Option<f64>,
}

/// The Best-of-N table of one predictions file.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BestOfN {
    /// Questions with two candidates or more (each judged, with `final_answer_correct`).
    pub questions: usize,
    /// ... of which hold both a right and a wrong candidate.
    pub mixed: usize,
    pub candidates: usize,
    pub selectors: Vec<SelectorShare>,
}

/// One candidate as the selectors see it.
#[derive(Debug, Clone, Copy)]
struct Candidate {
    right: bool,
    trace_score: Option<f32>,
    outcome: Option<f32>,
}

/// Gathers candidates by question while the predictions stream past.
#[derive(Debug, Default)]
pub(crate) struct Groups(BTreeMap<(String, String), Vec<Candidate>>);

impl Selector {
    const ALL: [Selector; 5] = [
        Selector::Random,
        Selector::TraceScore,
        Selector::Outcome,
        Selector::MinWithOutcome,
        Selector::Oracle,
    ];

    fn name(self) -> &'static str {
        match self {
            Selector::Random => "random pick (expected)",
            Selector::TraceScore => "trace score (the PRM's aggregate)",
            Selector::Outcome => "outcome score",
            Selector::MinWithOutcome => "min(trace score, sigmoid(outcome score))",
            Selector::Oracle => "oracle (a right candidate when there is one)",
        }
    }

    /// A candidate's score under this selector; `None` when the row lacks what it reads.
    fn score(self, c: &Candidate) -> Option<f64> {
        let sigmoid = |x: f32| 1.0 / (1.0 + (-f64::from(x)).exp());
        match self {
            Selector::Random => Some(0.0),
            Selector::TraceScore => c.trace_score.map(f64::from),
            Selector::Outcome => c.outcome.map(f64::from),
            Selector::MinWithOutcome => Some(f64::from(c.trace_score?).min(sigmoid(c.outcome?))),
            Selector::Oracle => Some(f64::from(u8::from(c.right))),
        }
    }

    /// The expected rightness of this selector's pick among `cands`: the share of right ones
    /// among those tied at the top score. `None` when a candidate has no score.
    fn pick(self, cands: &[Candidate]) -> Option<f64> {
        let scores: Vec<f64> = cands.iter().map(|c| self.score(c)).collect::<Option<_>>()?;
        let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let tied: Vec<bool> = cands
            .iter()
            .zip(&scores)
            .filter(|(_, s)| **s == top)
            .map(|(c, _)| c.right)
            .collect();
        Some(tied.iter().filter(|r| **r).count() as f64 / tied.len() as f64)
    }
}

impl Groups {
    pub(crate) fn add(&mut self, row: &Row) {
        let (Some(right), Some(key), None) = (
            row.final_answer_correct,
            row.question_key.as_ref(),
            row.error.as_ref(),
        ) else {
            return;
        };
        self.0
            .entry((row.split.clone(), key.clone()))
            .or_default()
            .push(Candidate {
                right,
                trace_score: row.trace_score,
                outcome: row.outcome_score,
            });
    }

    /// The table, when some question has two candidates or more; a selector appears when every
    /// candidate carries what it reads.
    pub(crate) fn finish(self) -> Option<BestOfN> {
        let groups: Vec<Vec<Candidate>> = self.0.into_values().filter(|g| g.len() > 1).collect();
        if groups.is_empty() {
            return None;
        }
        let is_mixed = |g: &[Candidate]| g.iter().any(|c| c.right) && g.iter().any(|c| !c.right);
        let mixed = groups.iter().filter(|g| is_mixed(g)).count();
        let share = |s: Selector, only_mixed: bool| -> Option<f64> {
            let chosen: Vec<&Vec<Candidate>> = groups
                .iter()
                .filter(|g| !only_mixed || is_mixed(g))
                .collect();
            let picks: Vec<f64> = chosen.iter().map(|g| s.pick(g)).collect::<Option<_>>()?;
            (!picks.is_empty()).then(|| 100.0 * picks.iter().sum::<f64>() / picks.len() as f64)
        };
        let selectors = Selector::ALL
            .into_iter()
            .filter_map(|s| {
                Some(SelectorShare {
                    selector: s.name(),
                    all: share(s, false)?,
                    mixed: share(s, true),
                })
            })
            .collect();
        Some(BestOfN {
            questions: groups.len(),
            mixed,
            candidates: groups.iter().map(Vec::len).sum(),
            selectors,
        })
    }
}

impl BestOfN {
    /// The table as Markdown rows: selector, share over every question, over mixed ones.
    pub fn rows(&self) -> Vec<Vec<String>> {
        self.selectors
            .iter()
            .map(|s| {
                vec![
                    s.selector.to_string(),
                    format!("{:.1}", s.all),
                    s.mixed.map_or_else(|| "n/a".into(), |m| format!("{m:.1}")),
                ]
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(right: bool, trace_score: f32, outcome: Option<f32>) -> Candidate {
        Candidate {
            right,
            trace_score: Some(trace_score),
            outcome,
        }
    }

    fn table(groups: Vec<Vec<Candidate>>) -> BestOfN {
        let mut g = Groups::default();
        for (i, cands) in groups.into_iter().enumerate() {
            g.0.insert(("s".into(), i.to_string()), cands);
        }
        g.finish().unwrap()
    }

    fn share(t: &BestOfN, prefix: &str) -> (f64, Option<f64>) {
        let s = t
            .selectors
            .iter()
            .find(|s| s.selector.starts_with(prefix))
            .unwrap();
        (s.all, s.mixed)
    }

    #[test]
    fn each_selector_picks_its_top_candidate() {
        let t = table(vec![
            // The PRM picks the right one, the outcome model the wrong one.
            vec![cand(true, 0.9, Some(-2.0)), cand(false, 0.2, Some(3.0))],
            // Both wrong: no pick can be right.
            vec![cand(false, 0.9, Some(1.0)), cand(false, 0.1, Some(0.0))],
            // A tie on the trace score between a right and a wrong one: half right expected.
            vec![
                cand(true, 0.5, Some(1.0)),
                cand(false, 0.5, Some(0.0)),
                cand(false, 0.1, Some(-1.0)),
            ],
        ]);
        assert_eq!((t.questions, t.mixed, t.candidates), (3, 2, 7));
        assert_eq!(share(&t, "trace"), (50.0, Some(75.0)));
        assert_eq!(share(&t, "outcome"), (100.0 / 3.0, Some(50.0)));
        // min(0.9, sigmoid(-2)) = 0.12 < min(0.2, sigmoid(3)) = 0.2: the wrong one; in the
        // third question min(0.5, 0.73) ties min(0.5, 0.5): half right.
        assert_eq!(share(&t, "min("), (50.0 / 3.0, Some(25.0)));
        assert_eq!(share(&t, "oracle"), (200.0 / 3.0, Some(100.0)));
        let (random, random_mixed) = share(&t, "random");
        assert!((random - 100.0 * (0.5 + 0.0 + 1.0 / 3.0) / 3.0).abs() < 1e-9);
        assert!((random_mixed.unwrap() - 100.0 * (0.5 + 1.0 / 3.0) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn selectors_without_their_scores_and_lone_candidates_are_left_out() {
        let t = table(vec![
            vec![cand(true, 0.9, None), cand(false, 0.2, None)],
            vec![cand(true, 0.9, None)],
        ]);
        assert_eq!(t.questions, 1);
        assert!(t.selectors.iter().all(|s| !s.selector.contains("outcome")));
        assert!(Groups::default().finish().is_none());
    }
}
