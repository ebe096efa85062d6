//! Chat markup in the decoded text an RL trainer sends: where its response starts, which end
//! markers close it, and what the prompt's last user turn asked. Pure functions.

use crate::config::QuestionFrom;

/// Openings of an assistant turn (ChatML, Llama 3, Mistral): the response follows the last one.
const ASSISTANT_HEADERS: [&str; 3] = [
    "<|im_start|>assistant\n",
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "[/INST]",
];

/// A user turn's opening and its end, per markup.
const USER_TURNS: [(&str, &str); 3] = [
    ("<|im_start|>user\n", "<|im_end|>"),
    ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"),
    ("[INST]", "[/INST]"),
];

/// End-of-turn, end-of-text and padding markers a decoded rollout may end with (the trainer
/// decodes with special tokens kept; padding is often the end-of-text token repeated).
const END_MARKERS: [&str; 12] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|finetune_right_pad_id|>",
    "</s>",
    "<eos>",
    "<pad>",
    "<end_of_turn>",
    "<｜end▁of▁sentence｜>",
    "<|end|>",
];

/// One sample as a trace's parts.
#[derive(Debug, PartialEq)]
pub(super) struct SampleParts<'a> {
    pub question: &'a str,
    pub response: &'a str,
}

/// Why a query's response can't be found.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub(super) enum SplitError {
    #[error(
        "holds neither its prompt nor an assistant turn of ChatML, Llama 3 or Mistral markup, so \
         its response can't be found"
    )]
    NoPromptNorAssistant,
    #[error(
        "holds no assistant turn of ChatML, Llama 3 or Mistral markup; send `prompts` too, so \
         the response is the query after its prompt"
    )]
    NoAssistant,
}

/// Splits a trainer's `query` (prompt + response, decoded) into the question and the response.
/// With `prompt`, the response is what follows it in the query; without one (or when the query
/// does not hold it), what follows the query's last assistant header. Errors say which.
pub(super) fn split<'a>(
    query: &'a str,
    prompt: Option<&'a str>,
    from: QuestionFrom,
) -> Result<SampleParts<'a>, SplitError> {
    let prompt = prompt.filter(|p| !p.trim().is_empty());
    let (prompt, response) = match prompt.and_then(|p| query.find(p).map(|at| (p, at))) {
        // The decoded query may carry a BOS the prompt string lacks: take the prompt where it is.
        Some((p, at)) => (p, &query[at + p.len()..]),
        None => {
            let at = last_assistant(query).ok_or(match prompt {
                Some(_) => SplitError::NoPromptNorAssistant,
                None => SplitError::NoAssistant,
            })?;
            (prompt.unwrap_or(&query[..at]), &query[at..])
        }
    };
    Ok(SampleParts {
        question: question(prompt, from),
        response: strip_end_markers(response),
    })
}

/// The question `prompt` asks: its last user turn (`Chat`, the whole prompt when it has no
/// markup) or the prompt itself (`Raw`), trimmed.
pub(super) fn question(prompt: &str, from: QuestionFrom) -> &str {
    match from {
        QuestionFrom::Chat => last_user_turn(prompt).unwrap_or(prompt),
        QuestionFrom::Raw => prompt,
    }
    .trim()
}

/// Byte offset just past the last assistant header in `text`.
fn last_assistant(text: &str) -> Option<usize> {
    ASSISTANT_HEADERS
        .iter()
        .filter_map(|h| text.rfind(h).map(|at| at + h.len()))
        .max()
}

/// The content of the last user turn of whichever markup `prompt` uses; `None` when it uses none.
pub(super) fn last_user_turn(prompt: &str) -> Option<&str> {
    let (start, end) = USER_TURNS
        .iter()
        .filter_map(|(open, end)| prompt.rfind(open).map(|at| (at + open.len(), *end)))
        .max_by_key(|(at, _)| *at)?;
    let rest = &prompt[start..];
    Some(rest.find(end).map_or(rest, |e| &rest[..e]))
}

/// `response` without the end markers and whitespace it ends with, however many are stacked.
pub(super) fn strip_end_markers(response: &str) -> &str {
    let mut s = response.trim_end();
    while let Some(marker) = END_MARKERS.iter().find(|m| s.ends_with(**m)) {
        s = s[..s.len() - marker.len()].trim_end();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "<|im_start|>system\nPlease reason step by step.<|im_end|>\n\
                          <|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n";
    const LLAMA3: &str = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe \
                          brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is \
                          2+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
    const MISTRAL: &str = "<s>[INST] What is 2+3? [/INST]";

    #[test]
    fn splits_each_markup_with_and_without_prompts() {
        for prompt in [CHATML, LLAMA3, MISTRAL] {
            let end = if prompt == LLAMA3 {
                "<|eot_id|>"
            } else {
                "</s>"
            };
            let query = format!("{prompt}2+3 = 5.\n\nThe answer is 5.{end}");
            let want = SampleParts {
                question: "What is 2+3?",
                response: "2+3 = 5.\n\nThe answer is 5.",
            };
            assert_eq!(split(&query, Some(prompt), QuestionFrom::Chat), Ok(want));
            let got = split(&query, None, QuestionFrom::Chat).unwrap();
            assert_eq!(got.question, "What is 2+3?", "{prompt}");
            assert_eq!(got.response, "2+3 = 5.\n\nThe answer is 5.");
        }
    }

    #[test]
    fn raw_prompts_and_a_bos_the_prompt_lacks() {
        let got = split("Q: 1+1?\nA: 2", Some("Q: 1+1?\nA:"), QuestionFrom::Chat).unwrap();
        assert_eq!(
            got,
            SampleParts {
                question: "Q: 1+1?\nA:",
                response: " 2".trim_end()
            }
        );
        let query = format!("<|endoftext|>{CHATML}Five.<|im_end|>");
        let got = split(&query, Some(CHATML), QuestionFrom::Raw).unwrap();
        assert_eq!(got.question, CHATML.trim());
        assert_eq!(got.response, "Five.");
    }

    #[test]
    fn the_last_user_turn_of_several() {
        let prompt = "<|im_start|>user\nfirst<|im_end|>\n<|im_start|>assistant\nok<|im_end|>\n\
                      <|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n";
        assert_eq!(last_user_turn(prompt), Some("second"));
        assert_eq!(last_user_turn("plain text"), None);
    }

    #[test]
    fn stacked_end_markers_and_padding() {
        assert_eq!(
            strip_end_markers("x<|im_end|>\n<|endoftext|><|endoftext|>"),
            "x"
        );
        assert_eq!(strip_end_markers("x </s>  "), "x");
        assert_eq!(strip_end_markers("<|im_end|>"), "");
        assert_eq!(strip_end_markers("a <b>"), "a <b>");
    }

    #[test]
    fn a_query_without_its_prompt_or_markup_is_refused() {
        let e = split("just text", None, QuestionFrom::Chat).unwrap_err();
        assert!(e.to_string().contains("send `prompts`"), "{e}");
        let e = split("just text", Some("other"), QuestionFrom::Chat).unwrap_err();
        assert!(e.to_string().contains("neither its prompt"), "{e}");
    }
}
