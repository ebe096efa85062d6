//! The `composite` evaluator: a step evaluator (a PRM, judge or cascade) and an outcome reward
//! model (an `outcome-rm` PRM) on the same trace at once; the step evaluator's verdict, with the
//! outcome model's score beside it.

use crate::engine::{Description, EngineError, Evaluator, Job, Loaded, NotLoaded, wrapped};
use crate::trace::Judgement;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Step scores from one evaluator, the outcome score from another.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CompositeConfig {
    /// The evaluator whose step scores, first error and category the verdict carries: a `prm`
    /// of a step family, a `judge` or a `cascade`.
    pub steps: String,
    /// The `prm` evaluator of family `outcome-rm` whose score the verdict carries.
    pub outcome: String,
}

pub(crate) struct Composite {
    steps: Arc<dyn Evaluator>,
    outcome: Arc<dyn Evaluator>,
    steps_name: String,
    outcome_name: String,
}

/// Builds a composite over evaluators loaded before it (`Engine::load` loads composites last).
pub(crate) fn load(config: &CompositeConfig, loaded: &Loaded) -> Result<Composite, NotLoaded> {
    let find = |key, wanted: &str| wrapped(loaded, key, wanted);
    Ok(Composite {
        steps: find("steps", &config.steps)?,
        outcome: find("outcome", &config.outcome)?,
        steps_name: config.steps.clone(),
        outcome_name: config.outcome.clone(),
    })
}

/// What the composite's own step can get wrong; what it wraps fails in its own errors.
#[derive(Debug, thiserror::Error)]
enum CompositeError {
    /// Config validation allows only an `outcome-rm` PRM there, which always gives one.
    #[error("the outcome evaluator gave no outcome score")]
    NoOutcome,
}

impl From<CompositeError> for EngineError {
    fn from(e: CompositeError) -> Self {
        EngineError::Internal(e.to_string())
    }
}

/// The step verdict with the outcome model's score. The two ran side by side, so the time is
/// the longer of the two, not their sum.
fn merge(mut steps: Judgement, outcome: Judgement) -> Result<Judgement, CompositeError> {
    let Some(o) = outcome.outcome else {
        return Err(CompositeError::NoOutcome);
    };
    steps.outcome = Some(o);
    steps.queued = steps.queued.max(outcome.queued);
    steps.inference = steps.inference.max(outcome.inference);
    Ok(steps)
}

impl Evaluator for Composite {
    fn describe(&self) -> Description {
        Description {
            kind: "composite".into(),
            family: format!(
                "steps {:?} + outcome {:?}",
                self.steps_name, self.outcome_name
            ),
            model: format!(
                "{} + {}",
                self.steps.describe().model,
                self.outcome.describe().model
            ),
        }
    }

    fn ready(&self) -> bool {
        self.steps.ready() && self.outcome.ready()
    }

    fn why_not_ready(&self) -> Option<String> {
        self.steps
            .why_not_ready()
            .or_else(|| self.outcome.why_not_ready())
    }

    /// Both through their own gates, concurrently; either's failure fails the request (the
    /// verdict promises both), and dropping it drops both.
    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let (steps, outcome) = futures::future::try_join(
                self.steps.evaluate(job.clone()),
                self.outcome.evaluate(job),
            )
            .await?;
            Ok(merge(steps, outcome)?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_verdict_is_the_steps_with_the_outcome_score() {
        let mut steps = Judgement::from_scores(vec![0.9, 0.2], 0.5);
        steps.inference = Duration::from_millis(30);
        let mut outcome = Judgement::from_outcome(2.5, 0.5);
        outcome.inference = Duration::from_millis(50);
        let j = merge(steps.clone(), outcome).unwrap();
        assert_eq!(j.step_scores, steps.step_scores);
        assert_eq!((j.first_error, j.error_index()), (Some(1), 1));
        assert_eq!(j.outcome.map(|o| o.score), Some(2.5));
        assert_eq!(j.inference, Duration::from_millis(50));
        assert!(merge(steps.clone(), steps).is_err());
    }
}
