//! The conversation families' rendering: one user turn per step, each answered by an assistant
//! "+", with each step's read position and its own tokens found exactly in the rendered text.

use super::{Encoded, FormatError, Formatter};
use crate::prm::spans::{Unmarked, step_spans};
use crate::prm::template::Message;

/// Stands in for each assistant "+" while rendering, so its place in the text is known exactly.
const SENTINEL: &str = "\u{E000}";
/// Stands in for a user turn's content once, at load, to find where the template ends a turn.
const TURN: &str = "\u{E001}";

impl Formatter {
    /// What the template writes between a user turn's content and the assistant's: a probe
    /// conversation of one turn each, its content and the assistant's private-use stand-ins.
    pub(super) fn turn_gap(&self) -> Option<String> {
        let probe = [
            Message {
                role: "user",
                content: TURN.into(),
            },
            Message {
                role: "assistant",
                content: SENTINEL.into(),
            },
        ];
        let rendered = self.template.as_ref()?.render(&probe, false).ok()?;
        let (_, after) = rendered.split_once(TURN)?;
        let (gap, _) = after.split_once(SENTINEL)?;
        Some(gap.to_string())
    }

    /// After `opening`, one user turn per step (`first` words the first, `rest` the others), each
    /// answered by an assistant "+": the RLHFlow conversation shape.
    pub(super) fn conversation(
        &self,
        mut messages: Vec<Message>,
        steps: &[&str],
        first: impl Fn(&str) -> String,
        rest: impl Fn(&str) -> String,
    ) -> Result<Encoded, FormatError> {
        for (k, s) in steps.iter().enumerate() {
            let content = if k == 0 { first(s) } else { rest(s) };
            messages.push(Message {
                role: "user",
                content,
            });
            messages.push(Message {
                role: "assistant",
                content: SENTINEL.into(),
            });
        }
        self.render_turns(&messages, steps)
    }

    /// Renders a conversation whose assistant turns are `SENTINEL`, puts "+" in their place, and
    /// reads each step at the token just before its "+"; each step's span is the tokens of its
    /// text (`steps`) in its user turn.
    fn render_turns(&self, messages: &[Message], texts: &[&str]) -> Result<Encoded, FormatError> {
        let steps = texts.len();
        for (i, m) in messages.iter().filter(|m| m.role == "user").enumerate() {
            if m.content.contains(SENTINEL) {
                return Err(FormatError::Step {
                    step: i,
                    message: "contains the character U+E000".into(),
                });
            }
        }
        let rendered = self
            .template()
            .render(messages, false)
            .map_err(|e| FormatError::Trace(e.to_string()))?;
        let mut text = String::with_capacity(rendered.len());
        let mut plus_at = Vec::with_capacity(steps);
        for (i, piece) in rendered.split(SENTINEL).enumerate() {
            if i > 0 {
                plus_at.push(text.len());
                text.push('+');
            }
            text.push_str(piece);
        }
        if plus_at.len() != steps {
            return Err(FormatError::Trace(format!(
                "the chat template rendered {} assistant turns for {steps} steps",
                plus_at.len()
            )));
        }
        let encoding = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| FormatError::Trace(format!("tokenizing: {e}")))?;
        let (ids, offsets) = (encoding.get_ids(), encoding.get_offsets());
        let mut positions = Vec::with_capacity(steps);
        let mut t = 0;
        for (step, &at) in plus_at.iter().enumerate() {
            while t < offsets.len() && offsets[t].0 < at {
                t += 1;
            }
            if t == 0 || t >= ids.len() || offsets[t] != (at, at + 1) || ids[t] != self.plus_id {
                return Err(FormatError::Step {
                    step,
                    message: "the tokenizer merged the assistant's '+' with neighbouring text"
                        .into(),
                });
            }
            positions.push(t - 1);
        }
        Ok(Encoded {
            ids: ids.to_vec(),
            positions,
            spans: match &self.turn_gap {
                Some(gap) => step_spans(&text, &plus_at, texts, offsets, gap)
                    .map_err(|Unmarked { step, message }| FormatError::Step { step, message }),
                None => Err(FormatError::Trace(
                    "the chat template's turn ends could not be found, so a head that reads \
                     each step's own tokens can't score this base"
                        .into(),
                )),
            },
        })
    }
}
