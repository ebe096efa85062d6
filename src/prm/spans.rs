//! A step's own tokens in a rendered conversation: where each step's text lies between the
//! assistant turns that answer it, as token positions (what a head that pools over a step's
//! tokens reads; `retrace_model::span_reads`).

use retrace_model::Span;

/// Each step's tokens: those that overlap the last occurrence of its text (`texts[k]`, trimmed)
/// before its "+" (`plus_at[k]`) and after the one before. None when some step's text is not found
/// there as given (a template that rewrote it), so a head that reads spans refuses the trace
/// rather than read other tokens.
pub(super) fn step_spans(
    text: &str,
    plus_at: &[usize],
    texts: &[&str],
    offsets: &[(usize, usize)],
) -> Vec<Span> {
    let mut spans = Vec::with_capacity(texts.len());
    let mut from = 0;
    for (&at, step) in plus_at.iter().zip(texts) {
        // Templates that trim a turn's content (Llama 3's) keep the trimmed text.
        let step = step.trim();
        if step.is_empty() {
            return Vec::new();
        }
        let Some(start) = text[from..at].rfind(step).map(|i| from + i) else {
            return Vec::new();
        };
        let end = start + step.len();
        let first = offsets.partition_point(|o| o.1 <= start);
        let last = offsets.partition_point(|o| o.0 < end);
        if first >= last {
            return Vec::new();
        }
        spans.push(first..last);
        from = at + 1;
    }
    spans
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steps_span_is_the_tokens_over_its_text_before_its_answer() {
        // "Q: a b +" then "Step: a b +": one character a token, the step text "a b" twice
        // over; each span is its own turn's, not the question's.
        let text = "Q: a b\nA:+Step: a b\nA:+";
        let plus_at = [9, 22];
        let offsets: Vec<(usize, usize)> = (0..text.len()).map(|i| (i, i + 1)).collect();
        let spans = step_spans(text, &plus_at, &["a b", " a b \n"], &offsets);
        assert_eq!(spans, vec![3..6, 16..19]);
        // A token that straddles the text's start belongs to the span.
        let merged: Vec<(usize, usize)> = vec![(0, 2), (2, 4), (4, 11), (11, 24)];
        assert_eq!(
            step_spans(text, &plus_at[..1], &["a b"], &merged),
            vec![1..3]
        );
        // A step the template rewrote, or an empty one: no spans at all.
        assert!(step_spans(text, &plus_at, &["a b", "c"], &offsets).is_empty());
        assert!(step_spans(text, &plus_at, &["a b", "  "], &offsets).is_empty());
    }
}
