//! Tests for the judge prompt templates: the built-ins, rendering, and overrides.

use super::*;
use crate::judge::DomainChoice;
use crate::trace::Step;

fn trace(options: &[&str], reference: Option<&str>) -> Trace {
    Trace {
        question: "Where would you keep a {options} jar?".into(),
        options: options.iter().map(|o| o.to_string()).collect(),
        steps: ["Jars go in kitchens.", "So (B)."]
            .iter()
            .map(|s| Step {
                text: s.to_string(),
                span: None,
            })
            .collect(),
        reference_answer: reference.map(str::to_string),
    }
}

#[test]
fn builtins_are_valid_and_ask_for_the_contract() {
    for kind in TemplateKind::ALL {
        let t = Template::new(kind, kind.builtin(), Path::new(kind.name()))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t, Template::builtin(kind));
        assert!(!t.text().ends_with('\n'), "{kind}");
        // The reply format is the output mode's, placed last.
        assert!(t.text().ends_with("\n\n{answer_format}"), "{kind}");
        let text = t.render(
            &trace(&["a", "b"], Some("B")),
            &crate::judge::output::answer_format(crate::judge::output::OutputMode::Text, 2),
        );
        let text = text.unwrap();
        for needle in [
            "\\boxed{",
            "-1",
            "Category:",
            "Misinterpretation",
            "Hallucination",
        ] {
            assert!(text.contains(needle), "{kind} lacks {needle}");
        }
        // The priority order is part of the contract: Misinterpretation before
        // Hallucination before Reasoning.
        let at = |w| t.text().find(w).unwrap();
        assert!(
            at("1. Misinterpretation") < at("2. Hallucination"),
            "{kind}"
        );
        assert!(at("2. Hallucination") < at("3. Reasoning"), "{kind}");
        assert_eq!(TemplateKind::parse(kind.name()), Some(kind));
    }
}

/// (domain, options, reference, expected kind, texts present, texts absent)
type Case<'a> = (
    DomainChoice,
    &'a [&'a str],
    Option<&'a str>,
    &'a str,
    &'a [&'a str],
    &'a [&'a str],
);

#[test]
fn renders_each_kind_from_the_trace() {
    use DomainChoice::{Auto, Math, Open};
    let templates = Templates::default();
    // The question is no math and no yes/no question: `auto` words it as an open question.
    let cases: [Case; 7] = [
        (
            Math,
            &[],
            None,
            "math-reference-free",
            &["[Problem]"],
            &["(A)", "[Reference"],
        ),
        (
            Math,
            &[],
            Some("42"),
            "math-reference-based",
            &["[Reference Answer]\n42\n"],
            &["(A)"],
        ),
        (
            Auto,
            &["pantry", "kitchen"],
            None,
            "multiple-choice-reference-free",
            &["[Options]\n(A) pantry\n(B) kitchen\n"],
            &["[Correct Answer]"],
        ),
        (
            Auto,
            &["pantry", "kitchen"],
            Some("B"),
            "multiple-choice-reference-based",
            &["(B) kitchen", "[Correct Answer]\nB\n"],
            &[],
        ),
        (
            Auto,
            &[],
            None,
            "open-reference-free",
            &[
                "[Question]\nWhere would",
                "world knowledge, commonsense or science",
            ],
            &["(A)", "[Correct Answer]", "[Problem]", "[Options]"],
        ),
        (
            Auto,
            &[],
            Some("the kitchen"),
            "open-reference-based",
            &[
                "[Correct Answer]\nthe kitchen\n",
                "[Reasoning]\n<paragraph_0>",
            ],
            &["(A)", "[Options]"],
        ),
        (
            Open,
            &[],
            Some("42"),
            "open-reference-based",
            &["[Correct Answer]\n42\n"],
            &[],
        ),
    ];
    let steps = "<paragraph_0>\nJars go in kitchens.\n</paragraph_0>\n\n<paragraph_1>\nSo (B).\n</paragraph_1>";
    for (choice, options, reference, kind, present, absent) in cases {
        let t = trace(options, reference);
        assert_eq!(TemplateKind::for_trace(&t, choice).name(), kind);
        let prompt = templates.render(&t, choice, "FORMAT").unwrap();
        assert!(prompt.contains(steps), "{kind}: {prompt}");
        // The question's literal "{options}" stays as the caller wrote it.
        assert!(prompt.contains("keep a {options} jar?"), "{kind}");
        for p in present {
            assert!(prompt.contains(p), "{kind} lacks {p:?}: {prompt}");
        }
        for a in absent {
            assert!(!prompt.contains(a), "{kind} has {a:?}");
        }
        assert!(!prompt.contains("{tagged_steps}") && !prompt.contains("{question}"));
        assert!(
            prompt.ends_with("\n\nFORMAT"),
            "{kind}: the answer format comes last"
        );
    }
}

/// A fixed domain whose wording can't show the trace's options (or needs some) is refused, and
/// the error names the trace's field, so the request fails as bad input.
#[test]
fn a_fixed_domain_refuses_a_trace_it_cannot_show() {
    let templates = Templates::default();
    for choice in [DomainChoice::Math, DomainChoice::Open] {
        let err = templates
            .render(&trace(&["a", "b"], None), choice, "")
            .unwrap_err();
        assert_eq!(err.field(), Some("options"), "{err}");
        assert!(err.to_string().contains("no place for options"), "{err}");
    }
    let err = templates
        .render(&trace(&[], None), DomainChoice::MultipleChoice, "")
        .unwrap_err();
    assert_eq!(err.field(), Some("options"), "{err}");
    let engine = crate::engine::EngineError::from(crate::judge::JudgeFailure {
        judge: "j".into(),
        error: crate::judge::JudgeError::Prompt(err),
    });
    assert!(
        matches!(&engine, crate::engine::EngineError::Invalid { field, .. } if field.to_string() == "options"),
        "{engine:?}"
    );
}

/// Text mode's answer format is the wording the built-ins carried before output modes existed,
/// so a text judge's prompt is unchanged; the structured modes name the paragraphs' range.
#[test]
fn answer_formats_keep_review_first_and_name_the_range() {
    use crate::judge::output::{OutputMode, answer_format};
    let text = answer_format(OutputMode::Text, 5);
    assert!(text.starts_with("Write your review first. Then finish with exactly these two lines"));
    assert!(text.contains("\n\\boxed{<index>}\nCategory: <category>\nHere <index> is the number"));
    assert!(!text.contains("0 to 4"), "{text}");
    for mode in [OutputMode::Grammar, OutputMode::JsonSchema] {
        let f = answer_format(mode, 5);
        assert!(f.contains("(numbered 0 to 4)"), "{f}");
        assert!(f.contains("review first"), "{f}");
    }
    let json = answer_format(OutputMode::JsonSchema, 3);
    let (a, e, c) = (
        json.find("\"analysis\"").unwrap(),
        json.find("\"earliest_error\"").unwrap(),
        json.find("\"error_category\"").unwrap(),
    );
    assert!(a < e && e < c, "{json}");
}

#[test]
fn tags_single_step_like_processbench() {
    assert_eq!(
        tagged_steps(["x = 1"]),
        "<paragraph_0>\nx = 1\n</paragraph_0>"
    );
}

#[test]
fn overrides_are_checked_and_errors_name_file_and_placeholder() {
    let mc_free = TemplateKind::new(Domain::MultipleChoice, Mode::ReferenceFree);
    let math_free = TemplateKind::new(Domain::Math, Mode::ReferenceFree);
    let open_free = TemplateKind::new(Domain::Open, Mode::ReferenceFree);
    let open_based = TemplateKind::new(Domain::Open, Mode::ReferenceBased);
    let cases = [
        (
            mc_free,
            "Q {question}\n{tagged_steps}",
            "missing placeholder {options}",
        ),
        (math_free, "{question} {tagged_steps}", ""),
        (
            math_free,
            "{question} {tagged_steps} {reference_answer}",
            "{reference_answer} has no value",
        ),
        (
            math_free,
            "{question} {tagged_step}",
            "missing placeholder {tagged_steps}",
        ),
        (
            open_free,
            "{question} {tagged_steps} {options}",
            "{options} has no value",
        ),
        (open_free, "{question}\n{tagged_steps}\n{answer_format}", ""),
        (
            open_based,
            "{question} {tagged_steps}",
            "missing placeholder {reference_answer}",
        ),
    ];
    for (kind, text, want) in cases {
        let result = Template::new(kind, text, Path::new("/etc/judge/mine.txt"));
        match (result, want) {
            (Ok(t), "") => assert_eq!(t.text(), text),
            (Err(e), want) if !want.is_empty() => {
                let msg = e.to_string();
                assert!(
                    msg.contains("/etc/judge/mine.txt") && msg.contains(want),
                    "{msg}"
                );
            }
            (other, want) => panic!("{text:?}: got {other:?}, wanted {want:?}"),
        }
    }
}

#[test]
fn load_reads_a_file_and_names_it_when_unreadable() {
    let dir = std::env::temp_dir().join(format!("retrace-judge-prompt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("math.txt");
    std::fs::write(&path, "Problem: {question}\n\n{tagged_steps}\n").unwrap();
    let kind = TemplateKind::new(Domain::Math, Mode::ReferenceFree);
    let t = Template::load(kind, &path).unwrap();
    let mut templates = Templates::builtin();
    templates.set(t);
    let prompt = templates
        .render(&trace(&[], None), DomainChoice::Math, "FORMAT")
        .unwrap();
    assert!(prompt.starts_with("Problem: Where would") && prompt.ends_with("</paragraph_1>"));

    let gone = dir.join("absent.txt");
    let msg = Template::load(kind, &gone).unwrap_err().to_string();
    assert!(msg.contains("absent.txt"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_template_without_its_input_refuses_to_render() {
    let kind = TemplateKind::new(Domain::MultipleChoice, Mode::ReferenceBased);
    let err = Template::builtin(kind)
        .render(&trace(&["a"], None), "")
        .unwrap_err();
    assert!(err.to_string().contains("reference answer"), "{err}");
    let err = Template::builtin(kind)
        .render(&trace(&[], Some("B")), "")
        .unwrap_err();
    assert!(err.to_string().contains("options"), "{err}");
}
