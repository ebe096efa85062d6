//! Segmentation of raw text into steps: never panics, and keeps its promise that the steps and
//! the whitespace between them rebuild the text exactly.
#![no_main]

use libfuzzer_sys::fuzz_target;
use retrace::fuzzing::segment;

fuzz_target!(|data: &[u8]| {
    // Lossy decoding keeps every input useful: the segmenter takes text, never bytes.
    let text = String::from_utf8_lossy(data);
    let spans = segment(&text);
    let mut at = 0;
    for span in &spans {
        assert!(
            at <= span.start && span.start < span.end,
            "steps overlap or one is empty: {spans:?}"
        );
        assert!(text[at..span.start].chars().all(char::is_whitespace));
        let step = &text[span.clone()];
        assert_eq!(step, step.trim(), "a step keeps surrounding whitespace");
        at = span.end;
    }
    assert!(text[at..].chars().all(char::is_whitespace));
    assert_eq!(spans.is_empty(), text.trim().is_empty());
});
