//! The `judge` evaluator: renders a trace into the prompt, collects samples (`n` in one request,
//! or parallel requests where the server ignores `n`), repairs unreadable replies once, votes,
//! and turns the vote into a judgement.

use super::JudgeError;
use super::call::{Caller, Fetched};
use super::client::{ChatParams, Choice, Turn, request_body};
use super::parse::{self, ParseError, Parsed, Vote};
use super::prompt::Templates;
use crate::engine::{Description, EngineError, Evaluator, Job};
use crate::metrics::{self, Stage};
use crate::trace::{Judgement, Path};
use futures::future::{BoxFuture, try_join_all};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::time::Instant;

/// A repair turn asks for two short lines; this is plenty, unless the model thinks aloud first.
const REPAIR_MAX_TOKENS: u32 = 256;

pub struct JudgeEvaluator {
    pub(super) name: String,
    pub(super) params: ChatParams,
    pub(super) samples: u32,
    /// Set by config, or once the server answered fewer choices than `n` asked for.
    pub(super) parallel: AtomicBool,
    pub(super) templates: Templates,
    /// The repair turn's text; `None` turns repairs off.
    pub(super) repair_prompt: Option<String>,
    pub(super) caller: Caller,
}

/// One sample: the reply, what it says, and whether the cache answered it.
struct Sample {
    choice: Choice,
    parsed: Result<Parsed, ParseError>,
    cached: bool,
}

impl Evaluator for JudgeEvaluator {
    fn describe(&self) -> Description {
        Description {
            kind: "judge".into(),
            // The protocol, not the URL: ListEvaluators is open to every client, and an internal
            // address is the operator's business.
            family: "openai-chat".into(),
            model: self.params.model.clone(),
        }
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let started = Instant::now();
            let result = self.judge(&job).await;
            metrics::record_stage(&self.name, Stage::Judge, started.elapsed());
            result
                .map(|mut j| {
                    j.inference = started.elapsed();
                    j
                })
                .map_err(|e| e.into_engine(&self.name))
        })
    }
}

impl JudgeEvaluator {
    /// The judge's verdict on `job`'s trace.
    pub async fn judge(&self, job: &Job) -> Result<Judgement, JudgeError> {
        let n_steps = job.trace.steps.len();
        let prompt = self.templates.render(&job.trace)?;
        let mut samples = self.sample(&prompt, n_steps, job.deadline).await?;
        if let Some(repair) = &self.repair_prompt {
            let repairs = samples
                .iter_mut()
                .filter(|s| {
                    matches!(
                        s.parsed,
                        Err(ParseError::NoAnswer | ParseError::Unreadable(_))
                    )
                })
                .map(|s| self.repair(s, &prompt, repair, n_steps, job.deadline));
            futures::future::join_all(repairs).await;
        }
        // Failed exchanges were counted as they happened; a fresh reply counts once read.
        for s in samples.iter().filter(|s| !s.cached) {
            let outcome = if s.parsed.is_ok() {
                "ok"
            } else {
                "parse_error"
            };
            metrics::record_judge_request(&self.name, outcome);
        }
        let parsed: Vec<_> = samples.iter().map(|s| s.parsed.clone()).collect();
        let Some(vote) = parse::vote(&parsed) else {
            return Err(JudgeError::Unreadable {
                samples: parsed.len(),
                reason: first_error(&parsed),
            });
        };
        if vote.agreement < 1.0 {
            metrics::record_judge_disagreement(&self.name);
        }
        let rationale = samples
            .iter()
            .find(|s| {
                s.parsed
                    .as_ref()
                    .is_ok_and(|p| p.first_error == vote.first_error)
            })
            .map(|s| s.choice.content.trim().to_string())
            .filter(|r| !r.is_empty());
        Ok(judgement(&parsed, vote, n_steps, rationale))
    }

    /// Collects `samples` replies: `n` in one request unless the server is known to ignore it.
    async fn sample(
        &self,
        prompt: &str,
        n_steps: usize,
        deadline: Option<Instant>,
    ) -> Result<Vec<Sample>, JudgeError> {
        let turns = [Turn {
            role: "user",
            content: prompt.to_string(),
        }];
        let mut choices: Vec<(Choice, bool)> = Vec::new();
        if self.samples > 1 && !self.parallel.load(Ordering::Relaxed) {
            match self.send(&turns, self.samples, deadline).await {
                Ok(got) => {
                    let first = got.reply.choices.iter().take(self.samples as usize);
                    choices.extend(first.map(|c| (c.clone(), got.cached)));
                }
                // A server that refuses this `n` (llama.cpp allows at most its slot count) is
                // asked again with one request per sample.
                Err(e) if refuses_n(&e) => {
                    tracing::warn!(judge = %self.name, error = %e, "upstream refuses `n`");
                }
                Err(e) => return Err(e),
            }
            if choices.len() < self.samples as usize {
                // Servers without `n` (some OpenAI-compatible gateways) answer one choice; from
                // now on this judge sends parallel requests instead.
                self.parallel.store(true, Ordering::Relaxed);
                tracing::warn!(judge = %self.name, asked = self.samples, got = choices.len(),
                    "upstream ignores `n`; sampling with parallel requests");
            }
        }
        let missing = self.samples as usize - choices.len();
        let more = try_join_all((0..missing).map(|_| self.send(&turns, 1, deadline))).await?;
        for got in more {
            choices.extend(got.reply.choices.first().map(|c| (c.clone(), got.cached)));
        }
        Ok(choices
            .into_iter()
            .map(|(choice, cached)| Sample {
                parsed: parse_choice(&choice, n_steps),
                choice,
                cached,
            })
            .collect())
    }

    /// One short follow-up turn asking only for the two final lines; best effort, so a failed
    /// repair leaves the sample's parse error as it was.
    async fn repair(
        &self,
        sample: &mut Sample,
        prompt: &str,
        repair: &str,
        n_steps: usize,
        deadline: Option<Instant>,
    ) {
        let turns = [
            Turn {
                role: "user",
                content: prompt.to_string(),
            },
            Turn {
                role: "assistant",
                content: sample.choice.content.clone(),
            },
            Turn {
                role: "user",
                content: repair.to_string(),
            },
        ];
        let mut params = self.params.clone();
        if !params.reasoning {
            params.max_tokens = params.max_tokens.min(REPAIR_MAX_TOKENS);
        }
        let body = request_body(&params, &turns, 1);
        let reply = match self.caller.call(&body, self.cacheable(), deadline).await {
            Ok(got) => {
                self.count_tokens(&got);
                got.reply
            }
            Err(e) => {
                tracing::debug!(judge = %self.name, error = %e, "repair turn failed");
                metrics::record_judge_repair(&self.name, false);
                return;
            }
        };
        let repaired = reply.choices.first().map(|c| parse_choice(c, n_steps));
        metrics::record_judge_repair(&self.name, repaired.as_ref().is_some_and(|p| p.is_ok()));
        if let Some(Ok(parsed)) = repaired {
            sample.parsed = Ok(parsed);
        }
    }

    async fn send(
        &self,
        turns: &[Turn],
        n: u32,
        deadline: Option<Instant>,
    ) -> Result<Fetched, JudgeError> {
        let body = request_body(&self.params, turns, n);
        let got = self.caller.call(&body, self.cacheable(), deadline).await?;
        self.count_tokens(&got);
        Ok(got)
    }

    /// Only greedy decoding repeats itself, so only its replies may be reused.
    fn cacheable(&self) -> bool {
        !self.params.reasoning && self.params.temperature == Some(0.0)
    }

    /// Tokens the upstream spent; a cached reply cost nothing this time.
    fn count_tokens(&self, got: &Fetched) {
        if !got.cached {
            let r = &got.reply;
            metrics::record_judge_tokens(&self.name, r.prompt_tokens, r.completion_tokens);
        }
    }
}

/// A 400 whose reason names the `n` field.
fn refuses_n(e: &JudgeError) -> bool {
    match e {
        JudgeError::Call(super::CallError::Upstream {
            error:
                super::client::AttemptError::Status {
                    code: 400, reason, ..
                },
            ..
        }) => ["'n'", "\"n\"", "`n`"].iter().any(|q| reason.contains(q)),
        _ => false,
    }
}

/// A choice's verdict: from its content, or from the reasoning text when the content is empty
/// (a reasoning model that spent its whole budget thinking may still have boxed an answer).
fn parse_choice(choice: &Choice, n_steps: usize) -> Result<Parsed, ParseError> {
    match (
        &choice.reasoning,
        parse::parse_reply(&choice.content, n_steps),
    ) {
        (Some(reasoning), Err(ParseError::Empty)) => parse::parse_reply(reasoning, n_steps),
        (_, parsed) => parsed,
    }
}

fn first_error(parsed: &[Result<Parsed, ParseError>]) -> String {
    parsed
        .iter()
        .find_map(|p| p.as_ref().err())
        .map_or_else(String::new, ToString::to_string)
}

/// The vote as a judgement. A step's score is the share of valid samples that found no error up
/// to and including it, so a unanimous judge gives 1s then 0s, and a split vote shows its doubt.
pub(super) fn judgement(
    parsed: &[Result<Parsed, ParseError>],
    vote: Vote,
    n_steps: usize,
    rationale: Option<String>,
) -> Judgement {
    let valid: Vec<&Parsed> = parsed.iter().filter_map(|p| p.as_ref().ok()).collect();
    let step_scores = (0..n_steps)
        .map(|i| {
            let holds = valid
                .iter()
                .filter(|p| p.first_error.is_none_or(|k| k > i))
                .count();
            holds as f32 / valid.len() as f32
        })
        .collect();
    Judgement {
        step_scores,
        first_error: vote.first_error,
        category: vote.category,
        rationale,
        queued: std::time::Duration::ZERO,
        inference: std::time::Duration::ZERO,
        path: Path::Judge,
    }
}
