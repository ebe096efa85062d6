//! Which prompt wording a trace gets: the judge's `domain` key, and the rule `auto` applies to a
//! trace's shape (its options, its question's notation and form, a yes/no reference answer).

use crate::trace::Trace;
use serde::{Deserialize, Serialize};

/// What kind of question a template is worded for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Domain {
    Math,
    MultipleChoice,
    /// Open and yes/no questions of world knowledge, commonsense or science (StrategyQA's kind).
    Open,
}

/// A judge's `domain` key: one wording for every trace, or `auto`, chosen per trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum DomainChoice {
    #[default]
    Auto,
    Math,
    MultipleChoice,
    Open,
}

impl DomainChoice {
    /// The wording for `trace`: the fixed one, or `auto`'s rule.
    pub(crate) fn domain_for(self, trace: &Trace) -> Domain {
        match self {
            DomainChoice::Auto => auto(trace),
            DomainChoice::Math => Domain::Math,
            DomainChoice::MultipleChoice => Domain::MultipleChoice,
            DomainChoice::Open => Domain::Open,
        }
    }
}

/// `auto`'s rule, first match wins:
/// 1. the trace has options: multiple choice (the only wording that shows them);
/// 2. the question has math notation (`$`, `\(`, a LaTeX command, `=`, `^`, `3 * 4`) or math
///    words (integer, probability, compute, how many, sum of ...): math;
/// 3. the question is a yes/no question (its last sentence ends in `?` and opens with an
///    auxiliary: is, did, could, would ...), or the reference answer is yes/no/true/false: open;
/// 4. the question holds a number (a digit, or a number word: three, twenty, half, dozen ...),
///    as word problems do: math;
/// 5. anything else (what, why, who, where questions, statements): open.
fn auto(trace: &Trace) -> Domain {
    let q = &trace.question;
    let words = words(q);
    if !trace.options.is_empty() {
        Domain::MultipleChoice
    } else if has_math_notation(q) || has_math_words(&words) {
        Domain::Math
    } else if is_yes_no_question(q) || trace.reference_answer.as_deref().is_some_and(is_yes_no) {
        Domain::Open
    } else if q.chars().any(|c| c.is_ascii_digit()) || words.iter().any(|w| is_number_word(w)) {
        Domain::Math
    } else {
        Domain::Open
    }
}

/// Words that open a yes/no question.
const AUXILIARIES: &[&str] = &[
    "is",
    "are",
    "was",
    "were",
    "am",
    "do",
    "does",
    "did",
    "can",
    "could",
    "will",
    "would",
    "shall",
    "should",
    "may",
    "might",
    "must",
    "has",
    "have",
    "had",
    "isn't",
    "aren't",
    "wasn't",
    "weren't",
    "don't",
    "doesn't",
    "didn't",
    "can't",
    "couldn't",
    "won't",
    "wouldn't",
    "shouldn't",
    "hasn't",
    "haven't",
];

/// Words only a quantitative problem uses.
const MATH_WORDS: &[&str] = &[
    "integer",
    "integers",
    "probability",
    "compute",
    "calculate",
    "digit",
    "digits",
    "divisible",
    "remainder",
    "polynomial",
    "polynomials",
    "equation",
    "equations",
    "percent",
    "isomorphic",
    "multiplicative",
];

/// Two-word phrases that ask for a quantity.
const MATH_PHRASES: &[[&str; 2]] = &[
    ["how", "many"],
    ["how", "much"],
    ["sum", "of"],
    ["product", "of"],
];

const NUMBER_WORDS: &[&str] = &[
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety", "hundred",
    "thousand", "million", "billion", "half", "twice", "dozen",
];

/// Lower-cased words: runs of letters, digits and apostrophes (so "isn't" stays one word).
fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '\'' || c == '’'))
        .filter(|w| !w.is_empty())
        .map(|w| w.to_lowercase().replace('’', "'"))
        .collect()
}

/// TeX delimiters or commands, an equation or a power, or an arithmetic expression between
/// digits. A hyphen between digits is a range or a date ("1945-46"), not a minus.
fn has_math_notation(q: &str) -> bool {
    if q.contains('$') || q.contains("\\(") || q.contains("\\[") || q.contains(['=', '^']) {
        return true;
    }
    let chars: Vec<char> = q.chars().collect();
    let tex_command = chars
        .windows(2)
        .any(|w| w[0] == '\\' && w[1].is_ascii_alphabetic());
    tex_command || has_arithmetic(&chars)
}

/// A digit, optional spaces, one of `+ * / × ÷`, optional spaces, a digit.
fn has_arithmetic(chars: &[char]) -> bool {
    chars.iter().enumerate().any(|(i, c)| {
        if !matches!(c, '+' | '*' | '/' | '×' | '÷') {
            return false;
        }
        let before = chars[..i].iter().rev().find(|c| **c != ' ');
        let after = chars[i + 1..].iter().find(|c| **c != ' ');
        before.is_some_and(char::is_ascii_digit) && after.is_some_and(char::is_ascii_digit)
    })
}

fn has_math_words(words: &[String]) -> bool {
    words.iter().any(|w| MATH_WORDS.contains(&w.as_str()))
        || words.windows(2).any(|pair| {
            MATH_PHRASES
                .iter()
                .any(|p| pair[0] == p[0] && pair[1] == p[1])
        })
}

/// The question ends in `?` and its last sentence opens with an auxiliary verb.
fn is_yes_no_question(q: &str) -> bool {
    let Some(body) = q.trim().strip_suffix('?') else {
        return false;
    };
    let last = body
        .rsplit(['.', '!', '?', ':', ';', '\n'])
        .next()
        .unwrap_or(body);
    words(last)
        .first()
        .is_some_and(|w| AUXILIARIES.contains(&w.as_str()))
}

fn is_yes_no(answer: &str) -> bool {
    let a = answer.trim().trim_end_matches('.').to_lowercase();
    matches!(a.as_str(), "yes" | "no" | "true" | "false")
}

fn is_number_word(w: &str) -> bool {
    NUMBER_WORDS.contains(&w)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(question: &str, options: &[&str], reference: Option<&str>) -> Trace {
        let mut t = Trace::of_steps(question, &["a step".to_string()]);
        t.options = options.iter().map(|o| o.to_string()).collect();
        t.reference_answer = reference.map(str::to_string);
        t
    }

    #[test]
    fn auto_reads_the_trace_shape() {
        use Domain::{Math, MultipleChoice as Mc, Open};
        let cases: &[(&str, &[&str], Option<&str>, Domain)] = &[
            // StrategyQA-style yes/no questions, dates and number words included.
            ("Did Aristotle use a laptop?", &[], None, Open),
            (
                "Could a llama birth twice during War in Vietnam (1945-46)?",
                &[],
                None,
                Open,
            ),
            (
                "Did the 40th president of the United States forward lolcats?",
                &[],
                None,
                Open,
            ),
            ("Isn't a tomato a fruit?", &[], None, Open),
            (
                "Hydrogen's atomic number squared exceeds number of Spice Girls?",
                &[],
                None,
                Open,
            ),
            (
                "Hydrogen's atomic number exceeds 2 Spice Girls?",
                &[],
                Some("No."),
                Open,
            ),
            ("Why do leaves change color in autumn?", &[], None, Open),
            (
                "What is the capital of Australia?",
                &[],
                Some("Canberra"),
                Open,
            ),
            // Options win over everything, even math.
            ("Where do wolves live?", &["arctic", "desert"], None, Mc),
            ("What is $2+2$?", &["3", "4"], None, Mc),
            // Math: notation, words, numbers in a word problem.
            (
                "Natalia sold clips to 48 friends. How many clips?",
                &[],
                None,
                Math,
            ),
            (
                "Does there exist an integer n with n^2 = 2?",
                &[],
                None,
                Math,
            ),
            ("Is $\\sqrt{2}$ rational?", &[], None, Math),
            (
                "Compute the least possible sum of the list.",
                &[],
                None,
                Math,
            ),
            ("What is 12 * 7?", &[], None, Math),
            (
                "Each of the six faces of a cube is colored red or blue.",
                &[],
                None,
                Math,
            ),
            (
                "What is the probability that all three agree?",
                &[],
                None,
                Math,
            ),
        ];
        for (q, options, reference, want) in cases {
            assert_eq!(auto(&trace(q, options, *reference)), *want, "{q}");
        }
    }

    #[test]
    fn a_fixed_domain_ignores_the_shape() {
        let t = trace("Did Aristotle use a laptop?", &["yes", "no"], None);
        assert_eq!(DomainChoice::Auto.domain_for(&t), Domain::MultipleChoice);
        assert_eq!(DomainChoice::Open.domain_for(&t), Domain::Open);
        assert_eq!(DomainChoice::Math.domain_for(&t), Domain::Math);
        let parsed: DomainChoice = serde_json::from_str("\"multiple_choice\"").unwrap();
        assert_eq!(parsed, DomainChoice::MultipleChoice);
    }

    /// Every problem of the committed ProcessBench subset is math to `auto`.
    #[test]
    fn processbench_problems_are_math() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/processbench");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let rows: Vec<serde_json::Value> =
                serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
            for row in rows {
                let q = row["problem"].as_str().unwrap();
                assert_eq!(auto(&trace(q, &[], None)), Domain::Math, "{q}");
                seen += 1;
            }
        }
        assert!(seen >= 100, "{seen} problems");
    }
}
