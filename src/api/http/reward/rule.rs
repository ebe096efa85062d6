//! A reward rule applied to a verdict: the number a trainer's reward route answers with, or the
//! reason the verdict lacks what the rule needs (which the route's `on_*` policy settles).

use crate::config::{Gives, RewardRule};
use crate::trace::Verdict;

/// The reward `rule` gives `v`, a verdict over `steps` steps; the reason when `v` lacks what
/// the rule needs.
pub(super) fn reward(rule: RewardRule, v: &Verdict, steps: usize) -> Result<f32, &'static str> {
    let j = &v.judgement;
    let gives = Gives {
        steps: !j.step_scores.is_empty(),
        outcome: j.outcome.is_some(),
    };
    if let Some(why) = rule.unmet(gives) {
        return Err(why);
    }
    let first = j.error_index();
    Ok(match (rule, j.outcome) {
        (RewardRule::TraceScore, _) => v.trace_score,
        (RewardRule::Correct, _) => f32::from(u8::from(first == -1)),
        (RewardRule::Prefix, _) if first == -1 || steps == 0 => 1.0,
        (RewardRule::Prefix, _) => first as f32 / steps as f32,
        (RewardRule::Outcome, Some(o)) => o.score,
        (RewardRule::MinWithOutcome, Some(o)) => v.trace_score.min(o.sigmoid()),
        (RewardRule::Outcome | RewardRule::MinWithOutcome, None) => {
            return Err("needs an outcome score");
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Judgement, Outcome};
    use std::time::Duration;

    fn verdict(j: Judgement, trace_score: f32) -> Verdict {
        Verdict {
            evaluator: "e".into(),
            judgement: j,
            threshold: 0.5,
            trace_score,
            queue: Duration::ZERO,
            total: Duration::ZERO,
        }
    }

    #[test]
    fn rules() {
        let steps = verdict(Judgement::from_scores(vec![0.9, 0.25, 0.9, 0.9], 0.5), 0.25);
        let apply = |r: RewardRule, v: &Verdict| reward(r, v, 4);
        assert_eq!(apply(RewardRule::TraceScore, &steps), Ok(0.25));
        assert_eq!(apply(RewardRule::Correct, &steps), Ok(0.0));
        assert_eq!(apply(RewardRule::Prefix, &steps), Ok(0.25));
        let holds = verdict(Judgement::from_scores(vec![0.9; 4], 0.5), 0.9);
        assert_eq!(apply(RewardRule::Correct, &holds), Ok(1.0));
        assert_eq!(apply(RewardRule::Prefix, &holds), Ok(1.0));
    }

    #[test]
    fn outcome_rules_need_an_outcome_score() {
        let steps = verdict(Judgement::from_scores(vec![0.9, 0.8], 0.5), 0.8);
        for r in [RewardRule::Outcome, RewardRule::MinWithOutcome] {
            assert!(reward(r, &steps, 2).unwrap_err().contains("outcome score"));
        }
        let mut j = Judgement::from_scores(vec![0.9, 0.8], 0.5);
        j.outcome = Some(Outcome::new(-1.0, 0.5));
        let both = verdict(j, 0.8);
        assert_eq!(reward(RewardRule::Outcome, &both, 2), Ok(-1.0));
        let low = 1.0 / (1.0 + 1f32.exp());
        let got = reward(RewardRule::MinWithOutcome, &both, 2).unwrap();
        assert!((got - low).abs() < 1e-6, "{got}");
        // The steps hold, so `correct` is the PRM's even though the outcome model disagrees.
        assert_eq!(reward(RewardRule::Correct, &both, 2), Ok(1.0));
        let alone = verdict(Judgement::from_outcome(-1.0, 0.5), -1.0);
        assert_eq!(reward(RewardRule::TraceScore, &alone, 2), Ok(-1.0));
        assert_eq!(reward(RewardRule::Correct, &alone, 2), Ok(0.0));
        assert!(reward(RewardRule::Prefix, &alone, 2).is_err());
        assert!(reward(RewardRule::MinWithOutcome, &alone, 2).is_err());
    }
}
