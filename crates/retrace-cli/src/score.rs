//! `retrace score`: sends traces to a running server and prints each verdict as a per-step table
//! (score, a bar, the first error marked, its category) or as proto3 JSON lines.

use crate::common::EvalBackend;
use anyhow::{Context, anyhow, bail};
use retrace::pb;
use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

/// `retrace score` flags.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Examples:\n  \
    retrace score --question 'What is 2+3*4?' --step '3*4 = 12.' --step '2+12 = 15.'\n  \
    retrace score --question 'Halve 9.' --text $'9/2 = 4.5\\n\\nSo 4.5.' --json\n  \
    retrace score --file trace.json\n  \
    cat traces.jsonl | retrace score --file -")]
pub struct ScoreOptions {
    /// The server's gRPC address (host:port or http(s)://host:port).
    #[arg(long, env = "RETRACE_ADDRESS", default_value = "127.0.0.1:50051")]
    pub server: String,
    /// The question (with --step or --text).
    #[arg(long, conflicts_with = "file")]
    pub question: Option<String>,
    /// One step of the chain of thought; repeat in order.
    #[arg(long = "step", conflicts_with = "text")]
    pub steps: Vec<String>,
    /// The chain of thought as raw text, segmented by the server.
    #[arg(long)]
    pub text: Option<String>,
    /// An answer option of a multiple-choice question; repeat in order.
    #[arg(long = "option")]
    pub options: Vec<String>,
    /// The gold answer (reference-based mode).
    #[arg(long)]
    pub reference: Option<String>,
    /// A JSON file holding a trace (`{"question", "steps" | "text", ...}`) or an EvaluateRequest
    /// (`{"trace": {...}, "evaluator", "threshold"}`), or JSONL of them; `-` reads stdin.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Evaluator to use [default: the server's default]; a request's own `evaluator` wins.
    #[arg(long, default_value = "")]
    pub evaluator: String,
    /// Overrides the evaluator's threshold, in [0, 1].
    #[arg(long)]
    pub threshold: Option<f32>,
    /// Print each verdict as one line of proto3 JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Environment variable holding a bearer token for the server.
    #[arg(long)]
    pub token_env: Option<String>,
    /// PEM CA certificate to trust for an https:// server.
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// Seconds to allow each trace.
    #[arg(long, default_value_t = 60.0)]
    pub timeout_s: f64,
    /// Seconds to wait for the server to report SERVING.
    #[arg(long, default_value_t = 10.0)]
    pub wait_s: f64,
}

/// Scores every trace the flags name and prints the verdicts; fails on the first error.
pub async fn score(opts: ScoreOptions) -> anyhow::Result<()> {
    let requests = requests(&opts)?;
    let timeout = Duration::try_from_secs_f64(opts.timeout_s)
        .ok()
        .filter(|d| !d.is_zero())
        .context("--timeout-s must be a positive number of seconds")?;
    let wait = Duration::try_from_secs_f64(opts.wait_s).context("--wait-s must be >= 0")?;
    let token = match &opts.token_env {
        Some(var) => Some(
            retrace::Env::process()
                .secret(var)
                .with_context(|| format!("--token-env names {var}, which is not set"))?,
        ),
        None => None,
    };
    let EvalBackend::Remote { client, token, .. } =
        EvalBackend::connect(&opts.server, token, opts.ca_cert.as_deref(), wait).await?
    else {
        bail!("retrace score needs a server");
    };
    let mut out = std::io::stdout().lock();
    for (i, request) in requests.into_iter().enumerate() {
        let mut call = tonic::Request::new(request);
        call.set_timeout(timeout);
        if let Some(t) = &token {
            call.metadata_mut().insert("authorization", t.clone());
        }
        let verdict = client
            .as_ref()
            .clone()
            .evaluate(call)
            .await
            .map_err(|s| anyhow!("trace {i}: {:?}: {}", s.code(), s.message()))?
            .into_inner();
        if opts.json {
            writeln!(out, "{}", serde_json::to_string(&verdict)?)?;
        } else {
            write!(out, "{}", table(&verdict))?;
        }
    }
    Ok(())
}

/// The requests the flags describe: one from --question, or every one in --file.
fn requests(opts: &ScoreOptions) -> anyhow::Result<Vec<pb::EvaluateRequest>> {
    let with_flags = |mut r: pb::EvaluateRequest| {
        if r.evaluator.is_empty() {
            r.evaluator.clone_from(&opts.evaluator);
        }
        if r.threshold.is_none() {
            r.threshold = opts.threshold;
        }
        r
    };
    if let Some(question) = &opts.question {
        if opts.steps.is_empty() && opts.text.is_none() {
            bail!("--question needs the chain of thought: repeat --step, or give --text");
        }
        let trace = pb::Trace {
            question: question.clone(),
            options: opts.options.clone(),
            steps: opts.steps.clone(),
            text: opts.text.clone().unwrap_or_default(),
            reference_answer: opts.reference.clone().unwrap_or_default(),
        };
        return Ok(vec![with_flags(pb::EvaluateRequest {
            trace: Some(trace),
            ..Default::default()
        })]);
    }
    let Some(path) = &opts.file else {
        bail!(
            "give --question with --step or --text, or --file (a JSON or JSONL file; - reads stdin)"
        );
    };
    let (name, text) = if path.as_os_str() == "-" {
        if std::io::stdin().is_terminal() {
            bail!("--file - reads traces from stdin, which is a terminal; pipe JSONL in");
        }
        let mut text = String::new();
        for line in std::io::stdin().lock().lines() {
            text.push_str(&line.context("reading stdin")?);
            text.push('\n');
        }
        ("stdin".to_string(), text)
    } else {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        (path.display().to_string(), text)
    };
    let parsed = parse_file(&text).map_err(|m| anyhow!("{name}: {m}"))?;
    Ok(parsed.into_iter().map(with_flags).collect())
}

/// Why a --file's text is not a trace or request, or JSONL of them.
#[derive(Debug, thiserror::Error)]
enum FileError {
    #[error("line {line}: {error}")]
    Line { line: usize, error: NotARequest },
    #[error(transparent)]
    Document(NotARequest),
    #[error("holds no trace")]
    Empty,
}

/// Why one JSON value is not a trace or an EvaluateRequest.
#[derive(Debug, thiserror::Error)]
enum NotARequest {
    #[error("{0}")]
    Json(serde_json::Error),
    #[error("an EvaluateRequest: {0}")]
    Request(serde_json::Error),
    #[error("a trace: {0}")]
    Trace(serde_json::Error),
}

/// One JSON document, or JSONL; each a trace or an EvaluateRequest. Errors name the line.
fn parse_file(text: &str) -> Result<Vec<pb::EvaluateRequest>, FileError> {
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(text) {
        return request_of(value)
            .map(|r| vec![r])
            .map_err(FileError::Document);
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |error| FileError::Line { line: i + 1, error };
        let value = serde_json::from_str(line).map_err(|e| at(NotARequest::Json(e)))?;
        out.push(request_of(value).map_err(at)?);
    }
    if out.is_empty() {
        return Err(FileError::Empty);
    }
    Ok(out)
}

fn request_of(value: serde_json::Value) -> Result<pb::EvaluateRequest, NotARequest> {
    let is_request = value.get("trace").is_some();
    match is_request {
        true => serde_json::from_value(value).map_err(NotARequest::Request),
        false => serde_json::from_value::<pb::Trace>(value)
            .map(|t| pb::EvaluateRequest {
                trace: Some(t),
                ..Default::default()
            })
            .map_err(NotARequest::Trace),
    }
}

/// Width of a score bar, in characters.
const BAR: usize = 20;

/// A verdict as a readable table: a header, then one row per step.
fn table(v: &pb::EvaluateResponse) -> String {
    let category = pb::ErrorCategory::try_from(v.category)
        .map(|c| {
            c.as_str_name()
                .trim_start_matches("ERROR_CATEGORY_")
                .to_lowercase()
        })
        .unwrap_or_default();
    let verdict = match v.first_error_index {
        -1 => "every step holds".to_string(),
        i if i < -1 => "the outcome model finds the trace wrong (no step located)".to_string(),
        i if category == "unspecified" => format!("first error at step {i}"),
        i => format!("first error at step {i} ({category})"),
    };
    let total = v.timing.as_ref().map_or(0.0, |t| t.total_s);
    let mut s = format!(
        "{}: {verdict}; trace score {:.3}, threshold {:.2}, {:.0} ms\n",
        v.evaluator,
        v.trace_score,
        v.threshold,
        total * 1e3
    );
    if let Some(o) = v.outcome_score {
        s.insert_str(s.len() - 1, &format!("; outcome score {o:.3}"));
    }
    for (i, step) in v.steps.iter().enumerate() {
        let filled = ((step.score.clamp(0.0, 1.0) * BAR as f32).round() as usize).min(BAR);
        let mark = if i as i32 == v.first_error_index {
            "✗"
        } else {
            " "
        };
        let text: String = step.text.split_whitespace().collect::<Vec<_>>().join(" ");
        let text = match text.chars().count() > 72 {
            true => format!("{}…", text.chars().take(71).collect::<String>()),
            false => text,
        };
        s.push_str(&format!(
            "{mark} {i:>3}  {:.3}  {}{}  {text}\n",
            step.score,
            "█".repeat(filled),
            "░".repeat(BAR - filled)
        ));
    }
    if !v.rationale.is_empty() {
        s.push_str(&format!("rationale: {}\n", v.rationale.trim()));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_hold_traces_or_requests_and_errors_name_the_line() {
        let one = parse_file(r#"{"question": "q", "steps": ["a"]}"#).unwrap();
        assert_eq!(one[0].trace.as_ref().unwrap().steps, ["a"]);
        let lines = "{\"question\": \"q\", \"text\": \"a\"}\n\n{\"trace\": {\"question\": \"r\", \
                     \"steps\": [\"b\"]}, \"evaluator\": \"e\", \"threshold\": 0.3}\n";
        let two = parse_file(lines).unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(two[1].evaluator, "e");
        assert_eq!(two[1].threshold, Some(0.3));
        let bad = parse_file("{\"question\": \"q\", \"steps\": [\"a\"]}\n{\"question\": 3}\n");
        assert!(bad.unwrap_err().to_string().starts_with("line 2: a trace"));
        assert!(parse_file("\n").is_err());
    }

    #[test]
    fn the_table_marks_the_first_error() {
        let step = |text: &str, score| pb::StepVerdict {
            text: text.into(),
            score,
            ..Default::default()
        };
        let v = pb::EvaluateResponse {
            evaluator: "e".into(),
            first_error_index: 1,
            category: pb::ErrorCategory::Reasoning as i32,
            steps: vec![step("3*4 = 12.", 1.0), step("2+12 =\n15.", 0.25)],
            trace_score: 0.25,
            threshold: 0.5,
            ..Default::default()
        };
        let t = table(&v);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].contains("first error at step 1 (reasoning)"),
            "{t}"
        );
        assert!(
            lines[1].starts_with("    0  1.000  ████████████████████  3*4"),
            "{t}"
        );
        assert!(
            lines[2].starts_with("✗   1  0.250  █████░░░░░░░░░░░░░░░  2+12 = 15."),
            "{t}"
        );
    }
}
