//! Beam search as search-and-learn runs it with a PRM: at each depth every kept beam is
//! extended by several candidate next steps, all of them are scored at once, and the best
//! `WIDTH` by their last step's score are kept. The candidate steps come from the Best-of-N
//! file's sampled solutions (split into steps as the server splits a trace's text): a beam
//! that ended on solution s continues with step d of s and of `EXPAND - 1` other solutions.
//! Every request is a kept prefix plus one new step, so the prefix cache serves all but the
//! step; which beams survive depends on the scores, so each depth waits for the one before.
//! llama-server runs the same search, each candidate scored by the per-step procedure's request
//! for its last step.

use super::super::grpc::again_if_cut;
use super::super::llama::LlamaClient;
use super::source::{Candidates, evaluate};
use anyhow::Context;
use retrace::pb;
use tonic::transport::Channel;

/// Beams kept at each depth.
pub(super) const WIDTH: usize = 4;
/// Candidate next steps per kept beam.
pub(super) const EXPAND: usize = 4;

/// One search: a question and its sampled solutions as steps.
#[derive(Debug, Clone)]
pub(crate) struct BeamJob {
    question: String,
    solutions: Vec<Vec<String>>,
}

/// Who scores a search's candidates (and, for retrace, sends the other workloads' requests).
#[derive(Clone)]
pub(super) enum Scorer {
    Retrace(pb::evaluator_client::EvaluatorClient<Channel>),
    Llama(LlamaClient),
}

/// A prefix being searched: its steps, and the solution its last step came from.
#[derive(Debug, Clone, PartialEq)]
struct Beam {
    steps: Vec<String>,
    source: usize,
}

/// One search per question of `candidates`, repeated (each copy its own question, so no copy
/// reuses another's work) until there are at least `callers` of them.
pub(super) fn jobs(candidates: &[Candidates], marker: &str, callers: usize) -> Vec<BeamJob> {
    let copies = callers.div_ceil(candidates.len().max(1)).max(1);
    (0..copies)
        .flat_map(|copy| {
            candidates.iter().map(move |c| BeamJob {
                // The question alone, as a search scores its prefixes: the few-shot
                // instruction was the sampler's prompt, not the verifier's.
                question: format!("{marker} Search {copy}. {}", c.question),
                solutions: c.candidates.iter().map(|t| steps_of(t)).collect(),
            })
        })
        .filter(|j| j.solutions.iter().any(|s| !s.is_empty()))
        .collect()
}

/// A solution's steps, as the server splits a trace's text.
fn steps_of(text: &str) -> Vec<String> {
    retrace::segment(text)
        .into_iter()
        .map(|r| text[r].to_string())
        .collect()
}

/// Adds `next` unless a beam with the same steps is there already.
fn push_new(out: &mut Vec<Beam>, next: Beam) {
    if !out.iter().any(|o| o.steps == next.steps) {
        out.push(next);
    }
}

impl BeamJob {
    /// The extensions of `beams` at `depth` (0-based: the step each adds), without repeats.
    fn expand(&self, beams: &[Beam], depth: usize) -> Vec<Beam> {
        let n = self.solutions.len();
        let stride = (n / EXPAND).max(1);
        let mut out: Vec<Beam> = Vec::new();
        for b in beams {
            for j in 0..EXPAND.min(n) {
                let source = (b.source + j * stride) % n;
                let Some(step) = self.solutions[source].get(depth) else {
                    continue;
                };
                let mut steps = b.steps.clone();
                steps.push(step.clone());
                push_new(&mut out, Beam { steps, source });
            }
        }
        out
    }

    /// The search, to the depth where no beam continues.
    pub(super) async fn run(&self, scorer: &Scorer) -> anyhow::Result<()> {
        let n = self.solutions.len();
        // The first depth starts from as many solutions as the later ones score.
        let mut beams: Vec<Beam> = (0..(WIDTH * EXPAND).min(n))
            .map(|source| Beam {
                steps: Vec::new(),
                source,
            })
            .collect();
        for depth in 0.. {
            let candidates = match depth {
                0 => self.first_steps(&beams),
                d => self.expand(&beams, d),
            };
            if candidates.is_empty() {
                break;
            }
            let scores = match scorer {
                Scorer::Retrace(client) => self.score(client, &candidates).await?,
                Scorer::Llama(client) => self.score_llama(client, &candidates).await?,
            };
            let mut ranked: Vec<(f32, Beam)> = scores.into_iter().zip(candidates).collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
            beams = ranked.into_iter().take(WIDTH).map(|(_, b)| b).collect();
        }
        Ok(())
    }

    fn first_steps(&self, starts: &[Beam]) -> Vec<Beam> {
        let mut out: Vec<Beam> = Vec::new();
        for b in starts {
            if let Some(step) = self.solutions[b.source].first() {
                let steps = vec![step.clone()];
                push_new(
                    &mut out,
                    Beam {
                        steps,
                        source: b.source,
                    },
                );
            }
        }
        out
    }

    /// Each candidate's last step score, all sent at once as a search scores a depth.
    async fn score(
        &self,
        client: &pb::evaluator_client::EvaluatorClient<Channel>,
        candidates: &[Beam],
    ) -> anyhow::Result<Vec<f32>> {
        let calls = candidates.iter().map(|b| {
            let request = evaluate(self.question.clone(), b.steps.clone());
            again_if_cut(move || {
                let (mut client, r) = (client.clone(), request.clone());
                async move { client.evaluate(r).await }
            })
        });
        futures::future::try_join_all(calls)
            .await
            .context("Evaluate")?
            .into_iter()
            .map(|r| {
                let r = r.into_inner();
                r.steps
                    .last()
                    .map(|s| s.score)
                    .context("a reply with no step")
            })
            .collect()
    }

    /// The same with llama-server, all of a depth's requests at once.
    async fn score_llama(
        &self,
        client: &LlamaClient,
        candidates: &[Beam],
    ) -> anyhow::Result<Vec<f32>> {
        let calls = candidates
            .iter()
            .map(|b| client.last_score(&self.question, &b.steps));
        futures::future::try_join_all(calls)
            .await
            .context("llama-server")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(solutions: &[&[&str]]) -> BeamJob {
        BeamJob {
            question: "q".into(),
            solutions: solutions
                .iter()
                .map(|s| s.iter().map(|x| x.to_string()).collect())
                .collect(),
        }
    }

    #[test]
    fn each_beam_continues_with_its_own_and_other_solutions_next_steps() {
        let j = job(&[&["a1", "a2"], &["b1", "b2"], &["c1"], &["d1", "d2"]]);
        let beam = Beam {
            steps: vec!["a1".into()],
            source: 0,
        };
        // Four solutions, EXPAND 4: every solution's step 1 that exists (c has none).
        let next = j.expand(&[beam], 1);
        let tails: Vec<&str> = next.iter().map(|b| b.steps[1].as_str()).collect();
        assert_eq!(tails, ["a2", "b2", "d2"]);
        assert!(next.iter().all(|b| b.steps[0] == "a1"));
        assert_eq!(next[1].source, 1);
        // Past every solution's end nothing continues, so the search stops.
        assert!(j.expand(&next, 2).is_empty());
    }

    #[test]
    fn solutions_split_at_blank_lines_and_copies_are_distinct_questions() {
        assert_eq!(
            steps_of("one\n\n two \n\n\n\nthree"),
            ["one", "two", "three"]
        );
        let c = Candidates {
            instruction: "i".into(),
            question: "q".into(),
            candidates: vec!["x\n\ny".into()],
        };
        let jobs = jobs(&[c], "Round 1.", 3);
        assert_eq!(jobs.len(), 3);
        assert_ne!(jobs[0].question, jobs[1].question);
        assert_eq!(jobs[2].solutions, [vec!["x".to_string(), "y".into()]]);
    }
}
