//! A step's own tokens in a rendered conversation: where each step's text lies at the end of the
//! user turn that holds it, as token positions (what a head that pools over a step's tokens
//! reads; `retrace_model::span_reads`).

use retrace_model::Span;

/// The step whose tokens could not be marked, and why.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Unmarked {
    pub(super) step: usize,
    pub(super) message: String,
}

/// Each step's tokens: those that overlap its text (`texts[k]`, trimmed) where its user turn's
/// content ends, `gap` (the template's text from a user turn's end to its assistant turn's
/// start) before its "+" (`plus_at[k]`). The turn's end is found from the "+", not by searching
/// the text, so a step that spells the template's own words ("assistant") is still its own.
/// An error names the first step whose text is not there as given (a template that rewrote
/// it) or that is empty: a head that reads spans refuses the trace rather than read other
/// tokens.
pub(super) fn step_spans(
    text: &str,
    plus_at: &[usize],
    texts: &[&str],
    offsets: &[(usize, usize)],
    gap: &str,
) -> Result<Vec<Span>, Unmarked> {
    let mut spans = Vec::with_capacity(texts.len());
    let mut from = 0;
    for (step, (&at, &given)) in plus_at.iter().zip(texts).enumerate() {
        let refuse = |message: &str| Unmarked {
            step,
            message: format!(
                "{message}, so a head that reads each step's own tokens can't score it"
            ),
        };
        let trimmed = given.trim();
        if trimmed.is_empty() {
            return Err(refuse("is empty"));
        }
        let turn_end = at
            .checked_sub(gap.len())
            .filter(|&e| e >= from && text.get(e..at) == Some(gap))
            .ok_or_else(|| refuse("its turn does not end as the chat template ends a turn"))?;
        let content = &text[from..turn_end];
        // The turn ends with the step as given, or trimmed (templates that trim, as Llama 3's).
        let end = if content.ends_with(given) {
            turn_end - (given.len() - given.trim_end().len())
        } else if content.ends_with(trimmed) {
            turn_end
        } else {
            return Err(refuse("the chat template rewrote its text"));
        };
        let start = end - trimmed.len();
        let first = offsets.partition_point(|o| o.1 <= start);
        let last = offsets.partition_point(|o| o.0 < end);
        if first >= last {
            return Err(refuse("no token covers its text"));
        }
        spans.push(first..last);
        from = at + 1;
    }
    Ok(spans)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chars(text: &str) -> Vec<(usize, usize)> {
        (0..text.len()).map(|i| (i, i + 1)).collect()
    }

    #[test]
    fn a_steps_span_is_the_tokens_over_its_text_where_its_turn_ends() {
        // "Q: a b" then "a b \n", each turn closed by "\nA:" and answered by "+": one character
        // a token, the step text "a b" twice over; each span is its own turn's, trimmed.
        let text = "Q: a b\nA:+ a b \n\nA:+";
        let plus_at = [9, 19];
        let spans = step_spans(text, &plus_at, &["a b", " a b \n"], &chars(text), "\nA:");
        assert_eq!(spans, Ok(vec![3..6, 11..14]));
        // A token that straddles the text's start belongs to the span.
        let merged: Vec<(usize, usize)> = vec![(0, 2), (2, 4), (4, 11), (11, 24)];
        let first = step_spans(text, &plus_at[..1], &["a b"], &merged, "\nA:");
        assert_eq!(first.unwrap(), vec![Span { start: 1, end: 3 }]);
    }

    #[test]
    fn a_step_that_spells_the_templates_words_is_read_in_its_own_turn() {
        // The step "A" is also the gap's "A": its span is the turn's, not the template's.
        let text = "Q: A\nA:+";
        let spans = step_spans(text, &[7], &["A"], &chars(text), "\nA:");
        assert_eq!(spans.unwrap(), vec![Span { start: 3, end: 4 }]);
    }

    #[test]
    fn a_rewritten_or_empty_step_is_refused_by_its_index() {
        let text = "Q: a b\nA:+Step: a b\nA:+";
        let plus_at = [9, 22];
        let offsets = chars(text);
        let refused =
            |texts: &[&str], gap: &str| match step_spans(text, &plus_at, texts, &offsets, gap) {
                Err(Unmarked { step, message }) => (step, message),
                other => panic!("{other:?}"),
            };
        let (step, message) = refused(&["a b", "c"], "\nA:");
        assert_eq!(step, 1);
        assert!(
            message.starts_with("the chat template rewrote its text"),
            "{message}"
        );
        assert_eq!(
            refused(&["a b", "  "], "\nA:"),
            (
                1,
                "is empty, so a head that reads each step's own tokens can't score it".into()
            )
        );
        let (step, message) = refused(&["a b", "a b"], "\nB:");
        assert_eq!(step, 0);
        assert!(message.starts_with("its turn does not end"), "{message}");
    }
}
