//! Raw chain-of-thought text to steps: pure functions that keep exact byte offsets.
//!
//! Rules, in order (the first that yields two or more steps wins):
//! 1. blank-line paragraphs (the ProcessBench / ReTraceQA convention);
//! 2. lines that open with a step marker ("Step 3:", "3.", "3)"): each marker starts a step and
//!    the lines after it, up to the next marker, continue it;
//! 3. single non-blank lines.
//!
//! Each step is trimmed of surrounding whitespace, so the text between steps (and before the
//! first and after the last) is whitespace only: the steps and those separators rebuild the text
//! exactly.

use std::ops::Range;

/// Splits `text` into step byte ranges; empty when the text holds no non-whitespace character.
pub fn segment(text: &str) -> Vec<Range<usize>> {
    let paragraphs = paragraphs(text);
    if paragraphs.len() >= 2 {
        return paragraphs;
    }
    let lines = lines(text);
    let marked = by_markers(text, &lines);
    if marked.len() >= 2 {
        return marked;
    }
    lines
}

/// Trims whitespace off both ends of `text[range]`; `None` when nothing is left.
fn trim(text: &str, range: Range<usize>) -> Option<Range<usize>> {
    let slice = &text[range.clone()];
    let start = range.start + (slice.len() - slice.trim_start().len());
    let end = range.start + slice.trim_end().len();
    (start < end).then_some(start..end)
}

/// Non-blank lines as trimmed ranges.
fn lines(text: &str) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if c == '\n' {
            out.extend(trim(text, start..i));
            start = i + 1;
        }
    }
    out.extend(trim(text, start..text.len()));
    out
}

/// Paragraphs separated by a line break, optional horizontal whitespace, and another line break.
fn paragraphs(text: &str) -> Vec<Range<usize>> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\n' {
            // Look past spaces/tabs/CRs for a second newline.
            let mut j = i + 1;
            while j < bytes.len() && matches!(bytes[j], b' ' | b'\t' | b'\r') {
                j += 1;
            }
            if j < bytes.len() && bytes[j] == b'\n' {
                out.extend(trim(text, start..i));
                // Swallow the whole blank run.
                while j < bytes.len() && bytes[j].is_ascii_whitespace() {
                    j += 1;
                }
                start = j;
                i = j;
                continue;
            }
        }
        i += 1;
    }
    out.extend(trim(text, start..text.len()));
    out
}

/// Groups lines into steps that each open at a step-marker line.
fn by_markers(text: &str, lines: &[Range<usize>]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for line in lines {
        let opens = is_marker(&text[line.clone()]);
        match out.last_mut() {
            Some(step) if !opens => step.end = line.end,
            _ => out.push(line.clone()),
        }
    }
    out
}

/// "Step 12:", "step 3.", "Step 4)" or "12." / "12)" followed by whitespace.
pub(crate) fn is_marker(line: &str) -> bool {
    let rest = match line.get(..4) {
        Some(w) if w.eq_ignore_ascii_case("step") => {
            let after = line[4..].trim_start();
            return match digits_then(after) {
                Some(tail) => tail.starts_with([':', '.', ')']),
                None => false,
            };
        }
        _ => line,
    };
    match digits_then(rest) {
        Some(tail) => {
            let mut chars = tail.chars();
            matches!(chars.next(), Some('.' | ')')) && chars.next().is_some_and(char::is_whitespace)
        }
        None => false,
    }
}

/// The text after a leading run of 1 to 3 ASCII digits, or `None` when it has none.
fn digits_then(s: &str) -> Option<&str> {
    let n = s.bytes().take_while(u8::is_ascii_digit).count();
    (1..=3).contains(&n).then(|| &s[n..])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn texts<'a>(text: &'a str, spans: &[Range<usize>]) -> Vec<&'a str> {
        spans.iter().map(|r| &text[r.clone()]).collect()
    }

    #[test]
    fn table() {
        let cases: &[(&str, &[&str])] = &[
            ("", &[]),
            ("  \n\n \t ", &[]),
            ("one step", &["one step"]),
            ("a\n\nb", &["a", "b"]),
            (
                "  a line\nmore a\n\n\n  b \n \n c\n",
                &["a line\nmore a", "b", "c"],
            ),
            ("a\r\n\r\nb", &["a", "b"]),
            ("first\nsecond\nthird", &["first", "second", "third"]),
            (
                "Step 1: add\nstill adding\nStep 2: done",
                &["Step 1: add\nstill adding", "Step 2: done"],
            ),
            (
                "intro\n1. x\n2) y\n   more y",
                &["intro", "1. x", "2) y\n   more y"],
            ),
            (
                "step 3. lower\nSTEP 4) upper",
                &["step 3. lower", "STEP 4) upper"],
            ),
            ("3.14 is pi\nso 2r", &["3.14 is pi", "so 2r"]),
            (
                "Let x=1.\n\n**Step 2:** ∑ é\n\nDone ✓",
                &["Let x=1.", "**Step 2:** ∑ é", "Done ✓"],
            ),
        ];
        for (text, want) in cases {
            assert_eq!(texts(text, &segment(text)), *want, "text {text:?}");
        }
    }

    #[test]
    fn markers() {
        assert!(is_marker("Step 1: x"));
        assert!(is_marker("Step12. x"));
        assert!(is_marker("1. x"));
        assert!(is_marker("10) x"));
        assert!(!is_marker("1.5 x"));
        assert!(!is_marker("Stepping out"));
        assert!(!is_marker("1.x"));
        assert!(!is_marker("2024. x"));
    }

    proptest! {
        #[test]
        fn rebuilds_text_exactly(text in "(\\PC|[\n\r\t ]|Step 1: |2\\. ){0,60}") {
            let spans = segment(&text);
            let mut rebuilt = String::new();
            let mut at = 0;
            for span in &spans {
                prop_assert!(span.start >= at && span.start < span.end);
                let gap = &text[at..span.start];
                prop_assert!(gap.chars().all(char::is_whitespace), "gap {:?}", gap);
                let step = &text[span.clone()];
                prop_assert_eq!(step.trim(), step);
                rebuilt.push_str(gap);
                rebuilt.push_str(step);
                at = span.end;
            }
            let tail = &text[at..];
            prop_assert!(tail.chars().all(char::is_whitespace));
            rebuilt.push_str(tail);
            prop_assert_eq!(rebuilt, text.clone());
            prop_assert_eq!(spans.is_empty(), text.trim().is_empty());
        }
    }
}
