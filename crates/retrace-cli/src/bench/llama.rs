//! The llama.cpp contender: `llama-server` on the same weights, driven the way users score with a
//! PRM behind an OpenAI-compatible server (ProcessBench's RLHFlow procedure): for each step k one
//! chat request holding the conversation up to step k (every earlier assistant turn "+"),
//! `max_tokens: 1`, and the step's score read from the logprobs of '+' against '-'.

use super::procs::{Guard, free_port, wait_until};
use super::{BenchTrace, ContenderRun, Workload};
use anyhow::{Context, bail};
use retrace::CHAT_LM_INSTRUCTION;
use serde_json::{Value, json};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// A running llama-server and a client for it.
pub(super) struct LlamaServer {
    pub(super) guard: Guard,
    base: String,
    http: reqwest::Client,
    /// How many alternatives each reply lists; '+' or '-' outside them counts as a miss.
    top_logprobs: usize,
}

impl LlamaServer {
    /// Starts `bin` on `gguf`, 127.0.0.1 only, with `parallel` slots of `ctx` tokens each, the
    /// threads, alternatives and extra arguments `opts` asks for, and waits for /health.
    pub(super) async fn start(
        bin: &Path,
        gguf: &Path,
        parallel: usize,
        ctx: usize,
        opts: &super::BenchOptions,
        log: &Path,
    ) -> anyhow::Result<LlamaServer> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = opts.llama_threads.unwrap_or(cores);
        let top_logprobs = opts.llama_top_logprobs;
        if !bin.is_file() {
            bail!(
                "no llama-server at {} (build it with scripts/fetch/fetch-llama-server.sh, or pass \
                 --no-llama)",
                bin.display()
            );
        }
        if !gguf.is_file() {
            bail!(
                "no GGUF at {} (scripts/bench/bench.sh writes the f32 one; or pass --no-llama)",
                gguf.display()
            );
        }
        let port = free_port()?;
        let mut cmd = Command::new(bin);
        cmd.arg("-m")
            .arg(gguf)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // Each slot gets the context of the longest trace; prompt caching per slot lets
            // request k reuse request k-1's prefix, as it does for users.
            .args(["-c", &(ctx * parallel).to_string()])
            .args(["-np", &parallel.to_string()])
            .args(["-t", &threads.to_string()])
            .arg("--jinja")
            .args(&opts.llama_args)
            // Spinning OpenMP workers starve everything else on a shared machine.
            .env("OMP_WAIT_POLICY", "passive");
        let mut guard = Guard::spawn("llama-server", cmd, log)?;
        let http = retrace::http_client()?;
        let base = format!("http://127.0.0.1:{port}");
        let health = format!("{base}/health");
        wait_until(&mut guard, Duration::from_secs(120), || {
            let (http, url) = (http.clone(), health.clone());
            async move { matches!(http.get(&url).send().await, Ok(r) if r.status().is_success()) }
        })
        .await?;
        Ok(LlamaServer {
            guard,
            base,
            http,
            top_logprobs,
        })
    }

    /// Scores every trace of `work`, `concurrency` traces at a time, each trace's steps one
    /// request after another.
    pub(super) async fn run(
        &self,
        work: &Arc<Workload>,
        concurrency: usize,
    ) -> anyhow::Result<ContenderRun> {
        self.guard_alive()?;
        let client = LlamaClient {
            http: self.http.clone(),
            url: format!("{}/v1/chat/completions", self.base),
            top_logprobs: self.top_logprobs,
        };
        let traces = work.clone();
        super::drive(work.traces.len(), concurrency, move |i| {
            let (client, traces) = (client.clone(), traces.clone());
            async move {
                let t = &traces.traces[i];
                client
                    .score(t)
                    .await
                    .with_context(|| format!("llama-server: trace {i}"))
            }
        })
        .await
    }

    /// A client for scoring a prefix's last step (the beam search's contender).
    pub(super) fn client(&self) -> anyhow::Result<LlamaClient> {
        self.guard_alive()?;
        Ok(LlamaClient {
            http: self.http.clone(),
            url: format!("{}/v1/chat/completions", self.base),
            top_logprobs: self.top_logprobs,
        })
    }

    fn guard_alive(&self) -> anyhow::Result<()> {
        super::procs::peak_rss(self.guard.pid()).map(drop)
    }
}

/// One client task's handle on the server.
#[derive(Clone)]
pub(super) struct LlamaClient {
    http: reqwest::Client,
    url: String,
    top_logprobs: usize,
}

impl LlamaClient {
    /// The trace's step scores, and how many steps lacked '+' or '-' in the reply.
    async fn score(&self, t: &BenchTrace) -> anyhow::Result<(Vec<f32>, usize)> {
        let mut messages = vec![json!({"role": "system", "content": CHAT_LM_INSTRUCTION})];
        let mut scores = Vec::with_capacity(t.steps.len());
        let mut misses = 0;
        for (k, step) in t.steps.iter().enumerate() {
            messages.push(turn(k, &t.question, step));
            let (plus, minus) = self.plus_minus(&messages).await?;
            misses += usize::from(plus.is_none() || minus.is_none());
            scores.push(step_score(plus, minus));
            messages.push(json!({"role": "assistant", "content": "+"}));
        }
        Ok((scores, misses))
    }

    /// The score of `steps`' last step after `question`: one request holding the conversation
    /// up to it, as the per-step procedure sends for that step.
    pub(super) async fn last_score(&self, question: &str, steps: &[String]) -> anyhow::Result<f32> {
        let (plus, minus) = self.plus_minus(&conversation(question, steps)).await?;
        Ok(step_score(plus, minus))
    }

    /// The logprobs of '+' and '-' as the reply to `messages`.
    async fn plus_minus(&self, messages: &[Value]) -> anyhow::Result<(Option<f64>, Option<f64>)> {
        let body = json!({
            "messages": messages,
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": true,
            "top_logprobs": self.top_logprobs,
        });
        plus_minus(&self.post(&body).await?)
    }

    async fn post(&self, body: &Value) -> anyhow::Result<Value> {
        let resp = self.http.post(&self.url).json(body).send().await?;
        let status = resp.status();
        let bytes = resp.bytes().await?;
        if !status.is_success() {
            bail!("HTTP {status}: {}", String::from_utf8_lossy(&bytes));
        }
        Ok(serde_json::from_slice(&bytes)?)
    }
}

/// The conversation `score` sends for the last of `steps`: every earlier step's turn answered
/// "+".
fn conversation(question: &str, steps: &[String]) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": CHAT_LM_INSTRUCTION})];
    for (k, step) in steps.iter().enumerate() {
        if k > 0 {
            messages.push(json!({"role": "assistant", "content": "+"}));
        }
        messages.push(turn(k, question, step));
    }
    messages
}

/// Step `k`'s user turn, in the words chat-lm uses (src/prm/format.rs), so both contenders
/// score the same text.
fn turn(k: usize, question: &str, step: &str) -> Value {
    let content = match k {
        0 => format!("Question: {question}\n\nStep: {step}"),
        _ => format!("Step: {step}"),
    };
    json!({"role": "user", "content": content})
}

/// The logprobs of '+' and '-' among the first generated token's top alternatives.
fn plus_minus(reply: &Value) -> anyhow::Result<(Option<f64>, Option<f64>)> {
    let top = reply
        .pointer("/choices/0/logprobs/content/0/top_logprobs")
        .and_then(Value::as_array)
        .context("the reply has no choices[0].logprobs.content[0].top_logprobs")?;
    let find = |tok: &str| {
        top.iter()
            .find(|e| e.get("token").and_then(Value::as_str) == Some(tok))
            .and_then(|e| e.get("logprob").and_then(Value::as_f64))
    };
    Ok((find("+"), find("-")))
}

/// softmax over the two logprobs, index '+': what chat-lm computes from the logits (the shared
/// normaliser cancels). A token outside the top list counts as probability 0.
fn step_score(plus: Option<f64>, minus: Option<f64>) -> f32 {
    match (plus, minus) {
        (Some(p), Some(m)) => (1.0 / (1.0 + (m - p).exp())) as f32,
        (Some(_), None) => 1.0,
        (None, Some(_)) => 0.0,
        (None, None) => 0.5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_sent_as_the_per_step_procedure_sends_its_last_step() {
        let steps = ["a".to_string(), "b".to_string()];
        let sent = conversation("q", &steps);
        let roles: Vec<&str> = sent.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(sent[1]["content"], "Question: q\n\nStep: a");
        assert_eq!(sent[2]["content"], "+");
        assert_eq!(sent[3]["content"], "Step: b");
        assert_eq!(sent[0]["content"], CHAT_LM_INSTRUCTION);
    }

    #[test]
    fn reads_plus_against_minus() {
        let reply = json!({"choices": [{"logprobs": {"content": [{"top_logprobs": [
            {"token": "The", "logprob": -1.0},
            {"token": "+", "logprob": -2.0},
            {"token": "-", "logprob": -3.0},
        ]}]}}]});
        let (p, m) = plus_minus(&reply).unwrap();
        assert_eq!((p, m), (Some(-2.0), Some(-3.0)));
        let s = step_score(p, m);
        assert!((s - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert_eq!(step_score(Some(-1.0), None), 1.0);
        assert_eq!(step_score(None, Some(-1.0)), 0.0);
        assert!(plus_minus(&json!({"choices": []})).is_err());
    }
}
