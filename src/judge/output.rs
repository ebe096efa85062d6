//! A judge's output mode: the per-trace constraint (a JSON schema or a GBNF grammar) in each
//! upstream's dialect, the answer-format wording the prompt ends with, the repair turn's text,
//! and how a refusal of the constraint is recognised.
//!
//! Both constraints keep the judge's reasoning before its verdict: the schema's first property is
//! `analysis`, and the grammar lets free text run until `\boxed{`. Property names are chosen so
//! that their alphabetical order is the intended one, because serde_json (without
//! `preserve_order`) writes object keys sorted, and constrained decoders generate properties in
//! the order the schema lists them.

use super::keys::{ANALYSIS, CATEGORY_NAMES, EARLIEST_ERROR, ERROR_CATEGORY};
use super::parse::ParseError;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// How a judge's reply is shaped and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputMode {
    /// A JSON object constrained by a schema built for the trace (`response_format`).
    JsonSchema,
    /// Free review text, then `\boxed{index}` and the category line, constrained by a GBNF
    /// grammar built for the trace (llama.cpp, vLLM, SGLang).
    Grammar,
    /// Unconstrained text, read by the `\boxed{}` parser.
    Text,
}

/// The kind of server behind `base_url`: it decides the grammar dialect and the default mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub(crate) enum UpstreamKind {
    /// OpenAI, or any server that takes OpenAI's `response_format` (Gemini, gateways).
    #[default]
    #[serde(rename = "openai")]
    OpenAi,
    #[serde(rename = "llama.cpp", alias = "llamacpp")]
    LlamaCpp,
    #[serde(rename = "vllm")]
    Vllm,
    #[serde(rename = "sglang")]
    Sglang,
}

/// Which turn a constraint is for: the first reply (review, then verdict) or the repair turn,
/// which asks for the verdict alone, since the review was already written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Turn {
    Reply,
    Repair,
}

/// `extra_body` keys through which a user already constrains the reply themselves; with any of
/// them the default mode is text, and a structured mode would conflict.
pub(crate) const CONSTRAINT_KEYS: &[&str] = &[
    "response_format",
    "json_schema",
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_grammar",
    "guided_regex",
    "guided_choice",
    "ebnf",
    "regex",
];

impl UpstreamKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            UpstreamKind::OpenAi => "openai",
            UpstreamKind::LlamaCpp => "llama.cpp",
            UpstreamKind::Vllm => "vllm",
            UpstreamKind::Sglang => "sglang",
        }
    }

    /// Every kind takes a JSON schema through `response_format`, OpenAI's form, which vLLM,
    /// SGLang, llama.cpp's server and Gemini's endpoint all read; only these take a grammar.
    pub(crate) fn takes_grammar(self) -> bool {
        !matches!(self, UpstreamKind::OpenAi)
    }
}

impl OutputMode {
    /// The mode a judge gets when its table names none: a JSON schema, which every kind accepts,
    /// unless `extra_body` already constrains the reply (then the user's constraint stands).
    pub(crate) fn default_for(extra_constrains: bool) -> OutputMode {
        if extra_constrains {
            OutputMode::Text
        } else {
            OutputMode::JsonSchema
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            OutputMode::JsonSchema => "json_schema",
            OutputMode::Grammar => "grammar",
            OutputMode::Text => "text",
        }
    }
}

/// The JSON schema of a verdict on `n_steps` paragraphs. OpenAI's strict mode needs every
/// property required and no others allowed; the index range and the category names are what
/// make the reply always readable.
pub(crate) fn schema(n_steps: usize, turn: Turn) -> Value {
    let last = n_steps as i64 - 1;
    let mut properties = Map::new();
    if turn == Turn::Reply {
        properties.insert(ANALYSIS.into(), json!({"type": "string"}));
    }
    properties.insert(
        EARLIEST_ERROR.into(),
        json!({"type": "integer", "minimum": -1, "maximum": last}),
    );
    properties.insert(
        ERROR_CATEGORY.into(),
        json!({"type": "string", "enum": CATEGORY_NAMES}),
    );
    let required: Vec<&String> = properties.keys().collect();
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

/// A GBNF grammar for the text shape: review text without `\boxed{` in it, then
/// `\boxed{index}` with the index in range and the category line (`None` exactly with -1).
/// GBNF is what llama.cpp reads and what xgrammar (vLLM's and SGLang's default backend) reads.
pub(crate) fn grammar(n_steps: usize, turn: Turn) -> String {
    let indices: Vec<String> = (0..n_steps).map(|i| format!("\"{i}\"")).collect();
    let verdict = if indices.is_empty() {
        "verdict ::= \"-1}\\nCategory: None\"".to_string()
    } else {
        format!(
            "verdict ::= \"-1}}\\nCategory: None\" | index \"}}\\nCategory: \" \
             (\"Misinterpretation\" | \"Hallucination\" | \"Reasoning\")\n\
             index ::= {}",
            indices.join(" | ")
        )
    };
    let head = match turn {
        Turn::Reply => "root ::= review \"\\\\boxed{\" verdict",
        Turn::Repair => "root ::= \"\\\\boxed{\" verdict",
    };
    // The review is any text in which "\boxed{" never occurs: after a backslash, each state
    // follows one more letter of "boxed{" and falls back on any other character, so the only
    // way to write "\boxed{" is the verdict's own.
    let review = "review ::= ( [^\\\\] | \"\\\\\" after1 )*\n\
        after1 ::= [^b\\\\] | \"\\\\\" after1 | \"b\" after2\n\
        after2 ::= [^o\\\\] | \"\\\\\" after1 | \"o\" after3\n\
        after3 ::= [^x\\\\] | \"\\\\\" after1 | \"x\" after4\n\
        after4 ::= [^e\\\\] | \"\\\\\" after1 | \"e\" after5\n\
        after5 ::= [^d\\\\] | \"\\\\\" after1 | \"d\" after6\n\
        after6 ::= [^{\\\\] | \"\\\\\" after1";
    match turn {
        Turn::Reply => format!("{head}\n{verdict}\n{review}\n"),
        Turn::Repair => format!("{head}\n{verdict}\n"),
    }
}

/// Adds `mode`'s constraint to a request body, in `upstream`'s dialect. Text adds nothing, and
/// so does a grammar for an upstream that takes none (config refuses that pairing).
pub(crate) fn constrain(
    body: &mut Value,
    mode: OutputMode,
    upstream: UpstreamKind,
    n_steps: usize,
    turn: Turn,
) {
    let Value::Object(body) = body else { return };
    match (mode, upstream) {
        (OutputMode::JsonSchema, _) => {
            let format = json!({
                "type": "json_schema",
                "json_schema": {"name": "judgement", "strict": true, "schema": schema(n_steps, turn)},
            });
            body.insert("response_format".into(), format);
        }
        (OutputMode::Grammar, UpstreamKind::LlamaCpp) => {
            body.insert("grammar".into(), json!(grammar(n_steps, turn)));
        }
        (OutputMode::Grammar, UpstreamKind::Vllm) => {
            let g = json!({"grammar": grammar(n_steps, turn)});
            body.insert("structured_outputs".into(), g);
        }
        (OutputMode::Grammar, UpstreamKind::Sglang) => {
            body.insert("ebnf".into(), json!(grammar(n_steps, turn)));
        }
        (OutputMode::Grammar, UpstreamKind::OpenAi) | (OutputMode::Text, _) => {}
    }
}

/// The end of the prompt, which `{answer_format}` in a template stands for: what to write and
/// in what order, review first. Text keeps the wording the judge has always used.
pub(crate) fn answer_format(mode: OutputMode, n_steps: usize) -> String {
    let range = range_words(n_steps);
    match mode {
        OutputMode::Text => "Write your review first. Then finish with exactly these two lines and \
            nothing after them:\n\\boxed{<index>}\nCategory: <category>\nHere <index> is the number \
            of the earliest paragraph with an error, or -1 if every paragraph is correct, and \
            <category> is one of Misinterpretation, Hallucination, Reasoning, or None when the \
            index is -1."
            .to_string(),
        OutputMode::Grammar => format!(
            "Write your review first, without writing \\boxed{{}} in it. Then finish with exactly \
             these two lines and nothing after them:\n\\boxed{{<index>}}\nCategory: <category>\n\
             Here <index> is the number of the earliest paragraph with an error ({range}), or -1 \
             if every paragraph is correct, and <category> is one of Misinterpretation, \
             Hallucination, Reasoning, or None when the index is -1."
        ),
        OutputMode::JsonSchema => format!(
            "Reply with one JSON object and nothing else. Write your review first, in \
             \"{ANALYSIS}\", then your verdict:\n{{\"{ANALYSIS}\": \"<your review, paragraph by \
             paragraph>\", \"{EARLIEST_ERROR}\": <index>, \"{ERROR_CATEGORY}\": \"<category>\"}}\n\
             Here <index> is the number of the earliest paragraph with an error ({range}), or -1 \
             if every paragraph is correct, and <category> is one of Misinterpretation, \
             Hallucination, Reasoning, or None when the index is -1."
        ),
    }
}

/// The repair turn: the configured text (or the built-in one for the mode), preceded by what
/// was wrong when the index was out of range, and always the paragraphs' count and range, so a
/// model that boxed the problem's answer learns what an index is.
pub fn repair_prompt(
    mode: OutputMode,
    configured: Option<&str>,
    error: &ParseError,
    n_steps: usize,
) -> String {
    let base = configured.unwrap_or(match mode {
        OutputMode::JsonSchema => JSON_REPAIR_PROMPT,
        OutputMode::Grammar | OutputMode::Text => super::parse::REPAIR_PROMPT,
    });
    let count = format!(
        "There are {n_steps} paragraph(s), {}.",
        range_words(n_steps)
    );
    match error {
        ParseError::OutOfRange { index, .. } => format!(
            "Your answer {index} is not a paragraph number. {count} Give the number of the \
             earliest wrong paragraph, or -1 if every paragraph is correct.\n{base}"
        ),
        _ => format!("{base}\n{count}"),
    }
}

/// The repair text for a JSON reply that could not be read.
pub(crate) const JSON_REPAIR_PROMPT: &str = "Your reply was not the JSON object asked for. Reply with \
only this JSON object and nothing else:\n{\"earliest_error\": <index>, \"error_category\": \
\"<category>\"}\n<index> is the number of the earliest paragraph with an error, or -1 if every \
paragraph is correct; <category> is Misinterpretation, Hallucination, Reasoning, or None when the \
index is -1.";

/// Whether an upstream's 4xx reason refuses the constraint itself (an unknown field, an
/// unsupported `response_format`), rather than the request as a whole.
pub fn refuses_constraint(code: u16, reason: &str) -> bool {
    let reason = reason.to_ascii_lowercase();
    (400..500).contains(&code)
        && code != 429
        && [
            "response_format",
            "json_schema",
            "grammar",
            "structured_output",
            "guided",
            "ebnf",
            "schema",
        ]
        .iter()
        .any(|w| reason.contains(w))
}

fn range_words(n_steps: usize) -> String {
    match n_steps {
        0 | 1 => "numbered 0".to_string(),
        n => format!("numbered 0 to {}", n - 1),
    }
}

#[cfg(test)]
#[path = "output_tests.rs"]
mod tests;
