//! Each PRM family's input format (docs/prm-formats.md): a trace becomes token ids plus the
//! positions where each step's score is read. Byte-exact strings, the model's own tokenizer.

pub use super::family::{Family, PrmKind};
pub use super::template::TemplateError;
use super::template::{ChatTemplate, Message, special_token};
use crate::trace::Trace;
use retrace_model::{HeadSpec, Span};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

mod turns;

/// qwen2-math-prm's system prompt, as in the model card.
const QWEN_SYSTEM: &str = "Please reason step by step, and put your final answer within \\boxed{}.";
const QWEN_STEP_TAG: &str = "<extra_0>";
const SHEPHERD_STEP_TAG: &str = "ки";
/// chat-lm's instruction to a general chat model.
pub const CHAT_LM_INSTRUCTION: &str = "You check a solution to a problem one step at a time. After each step, reply with a single character: + if the step is correct, - if it contains an error.";
const CHAT_LM_REFERENCE: &str = "\n\nReference answer (use it only to check the steps): ";
/// outcome-rm's assistant turn: the steps as paragraphs, the inverse of segmenting raw text.
pub(crate) const OUTCOME_STEP_JOIN: &str = "\n\n";

/// A trace ready for the model: ids, one read position per step, and where a family marks
/// them, each step's own tokens (empty where it does not; an error naming the step where the
/// family marks them and could not find one, which only a head that reads them refuses).
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub positions: Vec<usize>,
    pub spans: Result<Vec<Span>, FormatError>,
}

impl Encoded {
    /// Each step's own tokens where the format marked them, else none.
    pub fn marked_spans(&self) -> &[Span] {
        self.spans.as_deref().unwrap_or(&[])
    }
}

/// Why a trace can't be formatted; `step` names the culprit when one step is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FormatError {
    #[error("trace.steps[{step}]: {message}")]
    Step { step: usize, message: String },
    #[error("{0}")]
    Trace(String),
}

/// Formats traces for one checkpoint.
pub struct Formatter {
    family: Family,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    bos_token: Option<String>,
    /// The id scores are read at (qwen2-math-prm, math-shepherd) or after (skywork: "\n").
    tag_id: u32,
    plus_id: u32,
    minus_id: u32,
    /// outcome-rm: the id the last-token read skips (config.json's `pad_token_id`).
    pad_id: Option<u32>,
    /// The conversation families: the template's text from a user turn's end to the assistant
    /// turn's start, where each step's text ends (None when rendering a probe turn failed).
    turn_gap: Option<String>,
}

/// Why a formatter could not be built from a checkpoint's tokenizer files; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: {reason}", path.display())]
    File { path: PathBuf, reason: String },
    #[error("{}: {source}", path.display())]
    Template {
        path: PathBuf,
        source: TemplateError,
    },
    #[error("{}: family {family} needs {what}", path.display())]
    Needs {
        path: PathBuf,
        family: &'static str,
        what: String,
    },
    #[error(transparent)]
    Tokenize(#[from] TokenizeError),
    #[error(transparent)]
    Model(#[from] retrace_model::ModelError),
}

/// The tokenizer refused a text, or encoded it to nothing.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizeError {
    #[error("tokenizing: {0}")]
    Failed(String),
    #[error("the tokenizer encodes {0:?} to nothing")]
    Empty(String),
}

fn file_error(path: &Path, reason: impl ToString) -> LoadError {
    LoadError::File {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn read_json(path: &Path) -> Result<serde_json::Value, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
    serde_json::from_str(&text).map_err(|e| file_error(path, e))
}

/// The question as every family sees it: options appended as "(A) text" lines.
pub fn question_text(trace: &Trace) -> String {
    let mut q = trace.question.clone();
    if !trace.options.is_empty() {
        q.push_str("\n\nOptions:");
        for (i, option) in trace.options.iter().enumerate() {
            let letter = char::from(b'A' + (i % 26) as u8);
            q.push_str(&format!("\n({letter}) {option}"));
        }
    }
    q
}

impl Formatter {
    /// Reads `tokenizer.json` and `tokenizer_config.json` from `folder`; for a `.gguf` file, from
    /// beside it, or else rebuilt from the file's own vocabulary and metadata.
    pub fn load(family: Family, folder: &Path) -> Result<Formatter, LoadError> {
        if retrace_model::is_gguf(folder) {
            return Self::load_gguf(family, folder);
        }
        let tokenizer_path = folder.join("tokenizer.json");
        let tokenizer =
            Tokenizer::from_file(&tokenizer_path).map_err(|e| file_error(&tokenizer_path, e))?;
        let mut config_path = folder.join("tokenizer_config.json");
        let mut config = read_json(&config_path)?;
        // transformers prefers a chat_template.jinja beside the config to the config's entry.
        let jinja = folder.join("chat_template.jinja");
        if jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| file_error(&jinja, e))?;
            config["chat_template"] = serde_json::Value::String(source);
            config_path = jinja;
        }
        let mut f = Self::from_parts(family, tokenizer, &tokenizer_path, config, &config_path)?;
        if family.is_outcome() {
            f.pad_id = retrace_model::ClassifierConfig::read(folder)?.pad_token_id;
        }
        Ok(f)
    }

    fn load_gguf(family: Family, path: &Path) -> Result<Formatter, LoadError> {
        if family.is_outcome() {
            return Err(file_error(
                path,
                "a GGUF file carries no sequence-classification `score` head; family \
                 outcome-rm needs the Hugging Face folder",
            ));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let (tokenizer_path, config_path) = (
            dir.join("tokenizer.json"),
            dir.join("tokenizer_config.json"),
        );
        let gguf = retrace_model::Gguf::open(path).map_err(|e| file_error(path, e))?;
        let tokenizer = if tokenizer_path.is_file() {
            Tokenizer::from_file(&tokenizer_path).map_err(|e| file_error(&tokenizer_path, e))?
        } else {
            gguf.tokenizer_json()?
                .parse::<Tokenizer>()
                .map_err(|e| file_error(path, format!("rebuilding its tokenizer: {e}")))?
        };
        let (config, config_path) = if config_path.is_file() {
            (read_json(&config_path)?, config_path)
        } else {
            (gguf.tokenizer_config(), path.to_path_buf())
        };
        let tokenizer_path = match tokenizer_path.is_file() {
            true => tokenizer_path,
            false => path.to_path_buf(),
        };
        Self::from_parts(family, tokenizer, &tokenizer_path, config, &config_path)
    }

    fn from_parts(
        family: Family,
        tokenizer: Tokenizer,
        tokenizer_path: &Path,
        config: serde_json::Value,
        config_path: &Path,
    ) -> Result<Formatter, LoadError> {
        let template =
            ChatTemplate::from_config(&config).map_err(|source| LoadError::Template {
                path: config_path.to_path_buf(),
                source,
            })?;
        let needs_template = matches!(
            family,
            Family::QwenMathPrm | Family::Rlhflow | Family::ChatLm | Family::OutcomeRm
        );
        let needs = |what: &str| LoadError::Needs {
            path: config_path.to_path_buf(),
            family: family.as_str(),
            what: what.to_string(),
        };
        if needs_template && template.is_none() {
            return Err(needs("a chat_template"));
        }
        let bos_token = special_token(&config, "bos_token");
        if family == Family::Skywork && bos_token.is_none() {
            return Err(needs("a bos_token"));
        }
        let mut f = Formatter {
            family,
            tokenizer,
            template,
            bos_token,
            tag_id: 0,
            plus_id: 0,
            minus_id: 0,
            pad_id: None,
            turn_gap: None,
        };
        f.plus_id = f.last_id("+", false)?;
        f.minus_id = f.last_id("-", false)?;
        f.tag_id = match family {
            Family::QwenMathPrm => f
                .tokenizer
                .token_to_id(QWEN_STEP_TAG)
                .ok_or_else(|| file_error(tokenizer_path, format!("no {QWEN_STEP_TAG} token")))?,
            Family::Skywork => f.last_id("\n", false)?,
            Family::MathShepherd => f.last_id(SHEPHERD_STEP_TAG, true)?,
            Family::Rlhflow | Family::ChatLm | Family::OutcomeRm => 0,
        };
        if matches!(family, Family::Rlhflow | Family::ChatLm) {
            f.turn_gap = f.turn_gap();
        }
        Ok(f)
    }

    /// The head this family reads.
    pub fn head_spec(&self) -> HeadSpec {
        match self.family {
            Family::QwenMathPrm => HeadSpec::QwenScore,
            Family::Skywork => HeadSpec::ValueHead,
            Family::OutcomeRm => HeadSpec::Outcome,
            _ => HeadSpec::LmPair {
                plus: self.plus_id,
                minus: self.minus_id,
            },
        }
    }

    fn encode_ids(&self, text: &str, special: bool) -> Result<Vec<u32>, TokenizeError> {
        self.tokenizer
            .encode(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Failed(e.to_string()))
    }

    fn last_id(&self, text: &str, special: bool) -> Result<u32, TokenizeError> {
        self.encode_ids(text, special)?
            .last()
            .copied()
            .ok_or_else(|| TokenizeError::Empty(text.to_string()))
    }

    /// Formats a trace into ids and one read position per step.
    pub fn encode(&self, trace: &Trace) -> Result<Encoded, FormatError> {
        let q = question_text(trace);
        let steps: Vec<&str> = trace.step_texts().collect();
        match self.family {
            Family::QwenMathPrm => self.qwen(&q, &steps),
            Family::Skywork => self.skywork(&q, &steps),
            Family::MathShepherd => self.shepherd(&q, &steps),
            Family::OutcomeRm => self.outcome(&q, &steps),
            Family::Rlhflow => {
                let first = |s: &str| format!("{q} {s}");
                self.conversation(Vec::new(), &steps, first, str::to_string)
            }
            Family::ChatLm => {
                let mut system = CHAT_LM_INSTRUCTION.to_string();
                if let Some(r) = &trace.reference_answer {
                    system.push_str(CHAT_LM_REFERENCE);
                    system.push_str(r);
                }
                let opening = vec![Message {
                    role: "system",
                    content: system,
                }];
                let first = |s: &str| format!("Question: {q}\n\nStep: {s}");
                self.conversation(opening, &steps, first, |s| format!("Step: {s}"))
            }
        }
    }

    fn template(&self) -> &ChatTemplate {
        self.template
            .as_ref()
            .expect("checked at load for families that render one")
    }

    fn qwen(&self, q: &str, steps: &[&str]) -> Result<Encoded, FormatError> {
        forbid(steps, QWEN_STEP_TAG)?;
        let mut answer = steps.join(QWEN_STEP_TAG);
        answer.push_str(QWEN_STEP_TAG);
        let messages = [
            Message {
                role: "system",
                content: QWEN_SYSTEM.into(),
            },
            Message {
                role: "user",
                content: q.into(),
            },
            Message {
                role: "assistant",
                content: answer,
            },
        ];
        let text = self
            .template()
            .render(&messages, false)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        let ids = self
            .encode_ids(&text, false)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        self.tagged(ids, steps.len())
    }

    fn skywork(&self, q: &str, steps: &[&str]) -> Result<Encoded, FormatError> {
        let bos = self.bos_token.as_deref().unwrap_or_default();
        let mut ids = self
            .encode_ids(&format!("{bos}{q}\n"), false)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        let mut positions = Vec::with_capacity(steps.len());
        for (i, s) in steps.iter().enumerate() {
            let step_ids = self.encode_ids(s, false).map_err(|e| FormatError::Step {
                step: i,
                message: e.to_string(),
            })?;
            ids.extend(step_ids);
            positions.push(ids.len());
            ids.push(self.tag_id);
        }
        Ok(Encoded {
            ids,
            positions,
            spans: Ok(Vec::new()),
        })
    }

    fn shepherd(&self, q: &str, steps: &[&str]) -> Result<Encoded, FormatError> {
        forbid(steps, SHEPHERD_STEP_TAG)?;
        let body: Vec<String> = steps
            .iter()
            .map(|s| format!("{s} {SHEPHERD_STEP_TAG}"))
            .collect();
        let text = format!("{q} {}", body.join("\n"));
        let ids = self
            .encode_ids(&text, true)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        self.tagged(ids, steps.len())
    }

    /// The question as the user turn, the steps joined as the assistant turn, read once: at the
    /// last token that is not the pad id, as transformers' sequence classifiers read it.
    fn outcome(&self, q: &str, steps: &[&str]) -> Result<Encoded, FormatError> {
        let messages = [
            Message {
                role: "user",
                content: q.into(),
            },
            Message {
                role: "assistant",
                content: steps.join(OUTCOME_STEP_JOIN),
            },
        ];
        let text = self
            .template()
            .render(&messages, false)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        let ids = self
            .encode_ids(&text, false)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        if ids.is_empty() {
            return Err(FormatError::Trace(
                "the chat template rendered nothing".into(),
            ));
        }
        // transformers takes the argmax of index * (id != pad): 0 when every id is the pad.
        let read = ids
            .iter()
            .rposition(|&id| Some(id) != self.pad_id)
            .unwrap_or(0);
        Ok(Encoded {
            ids,
            positions: vec![read],
            spans: Ok(Vec::new()),
        })
    }

    /// Reads at every `tag_id`; there must be exactly one per step.
    fn tagged(&self, ids: Vec<u32>, steps: usize) -> Result<Encoded, FormatError> {
        let positions: Vec<usize> = (0..ids.len()).filter(|&i| ids[i] == self.tag_id).collect();
        if positions.len() != steps {
            return Err(FormatError::Trace(format!(
                "the formatted trace has {} step tags for {steps} steps; the question may contain the tag",
                positions.len()
            )));
        }
        Ok(Encoded {
            ids,
            positions,
            spans: Ok(Vec::new()),
        })
    }
}

/// Refuses steps that contain a family's step tag: it would add a score the caller didn't ask for.
fn forbid(steps: &[&str], tag: &str) -> Result<(), FormatError> {
    match steps.iter().position(|s| s.contains(tag)) {
        Some(step) => Err(FormatError::Step {
            step,
            message: format!("contains the step tag {tag:?}"),
        }),
        None => Ok(()),
    }
}
