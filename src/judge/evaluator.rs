//! The `judge` evaluator: renders a trace into the prompt, collects samples (`n` in one request,
//! or parallel requests where the server ignores `n`) in the judge's output mode (falling back to
//! text once if the upstream refuses the constraint), repairs unreadable replies once, votes,
//! and turns the vote into a judgement.

use super::call::{CachedCaller, Fetched};
use super::client::{ChatMessage, ChatParams, Choice, request_body};
use super::domain::DomainChoice;
use super::output::{self, OutputMode, UpstreamKind};
use super::parse::{self, ParseError, Parsed, Vote};
use super::prompt::Templates;
use super::{JudgeError, JudgeFailure};
use crate::engine::{Description, EngineError, Evaluator, Job};
use crate::metrics::{self, Stage};
use crate::trace::{DecisionPath, Judgement};
use futures::future::{BoxFuture, try_join_all};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::time::Instant;

/// A repair turn asks for two short lines; this is plenty, unless the model thinks aloud first.
const REPAIR_MAX_TOKENS: u32 = 256;

pub(crate) struct JudgeEvaluator {
    pub(super) name: String,
    pub(super) params: ChatParams,
    pub(super) samples: u32,
    /// Set by config, or once the server answered fewer choices than `n` asked for.
    pub(super) parallel: AtomicBool,
    pub(super) templates: Templates,
    /// Which wording each trace gets (`auto`: by its shape).
    pub(super) domain: DomainChoice,
    pub(super) repair: bool,
    /// The configured repair text; `None` is the built-in one for the mode.
    pub(super) repair_prompt: Option<String>,
    pub(super) output: OutputMode,
    pub(super) upstream: UpstreamKind,
    /// Set once the upstream refused the output constraint: text mode from then on.
    pub(super) text_fallback: AtomicBool,
    pub(super) caller: CachedCaller,
    /// Writes each verdict as a dataset row (`record`).
    pub(super) recorder: Option<crate::record::Recorder>,
}

/// One sample: the reply, what it says, the rationale to show, and whether the cache answered.
struct Sample {
    choice: Choice,
    parsed: Result<Parsed, ParseError>,
    /// The JSON reply's analysis, or the whole text reply.
    rationale: String,
    /// Asked for under the JSON schema, it came back as text and was read as text.
    schema_ignored: bool,
    cached: bool,
}

/// What a request asks for: the mode, the trace's size, and which turn.
#[derive(Debug, Clone, Copy)]
struct Shape {
    mode: OutputMode,
    n_steps: usize,
    turn: output::Turn,
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
                    if let Some(r) = &self.recorder {
                        r.record(&job.trace, &j, None);
                    }
                    j
                })
                .map_err(|error| {
                    EngineError::from(JudgeFailure {
                        judge: self.name.clone(),
                        error,
                    })
                })
        })
    }
}

impl JudgeEvaluator {
    /// The judge's verdict on `job`'s trace.
    pub(crate) async fn judge(&self, job: &Job) -> Result<Judgement, JudgeError> {
        let n_steps = job.trace.steps.len();
        let (mode, prompt, mut samples) = loop {
            let mode = self.mode();
            let prompt = self.templates.render(
                &job.trace,
                self.domain,
                &output::answer_format(mode, n_steps),
            )?;
            match self.sample(&prompt, mode, n_steps, job.deadline).await {
                Ok(samples) => break (mode, prompt, samples),
                // An upstream that refuses the constraint is asked again in text mode, and so is
                // every later request: the same fallback as for `n`, once per judge.
                Err(e) if mode != OutputMode::Text && refuses_constraint(&e) => {
                    self.text_fallback.store(true, Ordering::Relaxed);
                    tracing::warn!(judge = %self.name, mode = mode.name(), error = %e,
                        "upstream refuses the output constraint; judging in text mode from now on");
                }
                Err(e) => return Err(e),
            }
        };
        if self.repair {
            let repairs = samples
                .iter_mut()
                .filter(|s| s.parsed.as_ref().is_err_and(|e| *e != ParseError::Empty))
                .map(|s| self.repair(s, &prompt, mode, n_steps, job.deadline));
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
                reason: unreadable(&samples),
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
            .map(|s| s.rationale.trim().to_string())
            .filter(|r| !r.is_empty());
        let mut judgement = judgement(&parsed, vote, n_steps, rationale);
        // One sample agrees with itself: only a vote has an agreement worth reporting.
        judgement.agreement = (self.samples > 1).then_some(vote.agreement);
        Ok(judgement)
    }

    /// The mode requests are sent in now: the configured one, or text after a refusal.
    fn mode(&self) -> OutputMode {
        if self.text_fallback.load(Ordering::Relaxed) {
            OutputMode::Text
        } else {
            self.output
        }
    }

    /// Collects `samples` replies: `n` in one request unless the server is known to ignore it.
    async fn sample(
        &self,
        prompt: &str,
        mode: OutputMode,
        n_steps: usize,
        deadline: Option<Instant>,
    ) -> Result<Vec<Sample>, JudgeError> {
        let turns = [ChatMessage {
            role: "user",
            content: prompt.to_string(),
        }];
        let shape = Shape {
            mode,
            n_steps,
            turn: output::Turn::Reply,
        };
        let mut choices: Vec<(Choice, bool)> = Vec::new();
        if self.samples > 1 && !self.parallel.load(Ordering::Relaxed) {
            match self
                .send(&self.params, &turns, self.samples, shape, deadline)
                .await
            {
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
        let more =
            try_join_all((0..missing).map(|_| self.send(&self.params, &turns, 1, shape, deadline)))
                .await?;
        for got in more {
            choices.extend(got.reply.choices.first().map(|c| (c.clone(), got.cached)));
        }
        let samples: Vec<Sample> = choices
            .into_iter()
            .map(|(choice, cached)| Sample::read(choice, shape, cached))
            .collect();
        // Counted once per reply the upstream sent, not again when the cache repeats it.
        let ignored = samples
            .iter()
            .filter(|s| s.schema_ignored && !s.cached)
            .count();
        if ignored > 0 {
            metrics::record_judge_schema_ignored(&self.name, ignored as u64);
        }
        Ok(samples)
    }

    /// One short follow-up turn asking only for the verdict (constrained to the verdict alone
    /// in a structured mode), naming the paragraphs' range; best effort, so a failed repair
    /// leaves the sample's parse error as it was.
    async fn repair(
        &self,
        sample: &mut Sample,
        prompt: &str,
        mode: OutputMode,
        n_steps: usize,
        deadline: Option<Instant>,
    ) {
        let Err(error) = &sample.parsed else { return };
        let text = output::repair_prompt(mode, self.repair_prompt.as_deref(), error, n_steps);
        let turns = [
            ChatMessage {
                role: "user",
                content: prompt.to_string(),
            },
            ChatMessage {
                role: "assistant",
                content: sample.choice.content.clone(),
            },
            ChatMessage {
                role: "user",
                content: text,
            },
        ];
        let mut params = self.params.clone();
        if !params.reasoning {
            params.max_tokens = params.max_tokens.min(REPAIR_MAX_TOKENS);
        }
        let shape = Shape {
            mode,
            n_steps,
            turn: output::Turn::Repair,
        };
        let reply = match self.send(&params, &turns, 1, shape, deadline).await {
            Ok(got) => got.reply,
            Err(e) => {
                tracing::debug!(judge = %self.name, error = %e, "repair turn failed");
                metrics::record_judge_repair(&self.name, false);
                return;
            }
        };
        let repaired = reply.choices.first().map(|c| parse_choice(c, shape).parsed);
        metrics::record_judge_repair(&self.name, repaired.as_ref().is_some_and(|p| p.is_ok()));
        if let Some(Ok(parsed)) = repaired {
            sample.parsed = Ok(parsed);
        }
    }

    /// One exchange with `params`, constrained for `shape`; counts the tokens it cost.
    async fn send(
        &self,
        params: &ChatParams,
        turns: &[ChatMessage],
        n: u32,
        shape: Shape,
        deadline: Option<Instant>,
    ) -> Result<Fetched, JudgeError> {
        let mut body = request_body(params, turns, n);
        output::constrain(
            &mut body,
            shape.mode,
            self.upstream,
            shape.n_steps,
            shape.turn,
        );
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

impl Sample {
    fn read(choice: Choice, shape: Shape, cached: bool) -> Sample {
        let reading = parse_choice(&choice, shape);
        Sample {
            rationale: reading.analysis.unwrap_or_else(|| choice.content.clone()),
            parsed: reading.parsed,
            schema_ignored: reading.schema_ignored,
            choice,
            cached,
        }
    }
}

/// A 4xx whose reason names the constraint's field.
fn refuses_constraint(e: &JudgeError) -> bool {
    match e {
        JudgeError::Call(super::CallError::Upstream {
            error: super::client::AttemptError::Status { code, reason, .. },
            ..
        }) => output::refuses_constraint(*code, reason),
        _ => false,
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

/// A choice's verdict, and the JSON reply's analysis: from its content, or from the reasoning
/// text when the content is empty (a reasoning model that spent its whole budget thinking may
/// still have boxed an answer). Grammar replies are text in the `\boxed{}` shape.
fn parse_choice(choice: &Choice, shape: Shape) -> Reading {
    let read = |text: &str| match shape.mode {
        OutputMode::JsonSchema => read_json(text, shape),
        OutputMode::Grammar | OutputMode::Text => Reading {
            parsed: parse::parse_reply(text, shape.n_steps),
            analysis: None,
            schema_ignored: false,
        },
    };
    let first = read(&choice.content);
    match (&choice.reasoning, &first.parsed) {
        (Some(reasoning), Err(ParseError::Empty)) => read(reasoning),
        _ => first,
    }
}

/// A reply under the JSON schema; one that came back as plain text (the upstream dropped
/// `response_format`) is read as text when it holds a verdict, and says so.
fn read_json(text: &str, shape: Shape) -> Reading {
    let with_analysis = shape.turn == output::Turn::Reply;
    match parse::parse_json_reply(text, shape.n_steps, with_analysis) {
        Ok((parsed, analysis)) => Reading {
            parsed: Ok(parsed),
            analysis,
            schema_ignored: false,
        },
        Err(e) => match (&e, parse::parse_ignored_schema(text, shape.n_steps)) {
            (ParseError::NotJson(_), Some(Ok(parsed))) => Reading {
                parsed: Ok(parsed),
                analysis: None,
                schema_ignored: true,
            },
            _ => Reading {
                parsed: Err(e),
                analysis: None,
                schema_ignored: false,
            },
        },
    }
}

/// What one reply says: its verdict, the JSON reply's analysis, and whether a JSON reply came
/// back as text.
struct Reading {
    parsed: Result<Parsed, ParseError>,
    analysis: Option<String>,
    schema_ignored: bool,
}

/// Why the first unreadable sample is unreadable, with what the operator can do about it: a
/// reasoning model that spent its budget thinking leaves only `reasoning_content`, and its
/// `finish_reason` says the budget ran out.
fn unreadable(samples: &[Sample]) -> String {
    let Some((sample, error)) = samples
        .iter()
        .find_map(|s| s.parsed.as_ref().err().map(|e| (s, e)))
    else {
        return String::new();
    };
    let choice = &sample.choice;
    let mut reason = match &choice.reasoning {
        Some(_) if choice.content.trim().is_empty() => format!(
            "the reply's content is empty and its reasoning_content gives no verdict ({error})"
        ),
        _ => error.to_string(),
    };
    if choice.finish_reason.as_deref() == Some("length") {
        reason.push_str(
            "; the reply stopped at the token limit (finish_reason \"length\"): raise max_tokens",
        );
    }
    reason
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
        agreement: None,
        queued: std::time::Duration::ZERO,
        inference: std::time::Duration::ZERO,
        path: DecisionPath::Judge,
        tokens: None,
        outcome: None,
    }
}
