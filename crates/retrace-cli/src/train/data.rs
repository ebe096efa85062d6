//! Training data: labelled traces read with `eval`'s reader, the target of each step (correct up
//! to the first error, the first error wrong, the steps after it untrained), and the split into
//! train and dev by question, so that one question's traces never sit on both sides.

use super::TrainError;
use super::checksum::file_sha256;
use crate::common::{DataError, Record, read_records};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

/// One labelled trace, its steps as the server sees them.
#[derive(Debug, Clone)]
pub(crate) struct Labelled {
    pub(crate) record: Record,
    /// The first wrong step, -1 when none (`record.label`, which training requires).
    pub(crate) label: i32,
    /// Index into the files it was read from, and the line it starts on.
    pub(crate) file: usize,
    pub(crate) line: usize,
    /// `record.steps`, or the server's segmentation of `record.text`.
    pub(crate) steps: Vec<String>,
}

/// A data file as the head's config records it, and a training set's counts.
pub(crate) use retrace::{HeadDataFile as DataFile, LabelCounts};

/// The traces of some files, in file order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Dataset {
    pub(crate) files: Vec<DataFile>,
    pub(crate) traces: Vec<Labelled>,
}

/// What the step head is trained to say about a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Target {
    Correct,
    Wrong,
    /// After the first error: the task defines nothing there.
    Untrained,
}

/// The targets of a trace of `len` steps whose first wrong step is `label` (-1: none).
pub(crate) fn targets(label: i32, len: usize) -> impl Iterator<Item = Target> {
    (0..len as i32).map(move |i| match label {
        -1 => Target::Correct,
        l if i < l => Target::Correct,
        l if i == l => Target::Wrong,
        _ => Target::Untrained,
    })
}

impl Labelled {
    /// Each step's target, in order.
    pub(crate) fn targets(&self) -> impl Iterator<Item = Target> {
        targets(self.label, self.steps.len())
    }

    /// The question as the split compares it.
    pub(crate) fn question_key(&self) -> String {
        normalise_question(&self.record.question)
    }
}

/// The question's text, lowercased, whitespace runs as one space, trimmed.
pub(crate) fn normalise_question(q: &str) -> String {
    q.split_whitespace()
        .map(str::to_lowercase)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Reads every file (first bad row stops it, naming file and line); `text` traces are segmented
/// as the server segments them, and their label checked against the steps that gives.
pub(crate) fn read(paths: &[PathBuf]) -> Result<Dataset, TrainError> {
    let mut out = Dataset::default();
    for (file, path) in paths.iter().enumerate() {
        let sha256 = file_sha256(path).map_err(|e| DataError {
            file: path.display().to_string(),
            line: 0,
            message: format!("cannot read: {e}"),
            fatal: true,
        })?;
        let mut records = read_records(path)?;
        let mut rows = 0;
        while let Some(item) = records.next_located() {
            let (line, record) = item?;
            let Some(label) = record.label else {
                return Err(DataError {
                    file: path.display().to_string(),
                    line,
                    message: format!("row {:?} has no `label`: training needs one", record.id),
                    fatal: false,
                }
                .into());
            };
            let steps = steps_of(&record, label, path, line)?;
            out.traces.push(Labelled {
                record,
                label,
                file,
                line,
                steps,
            });
            rows += 1;
        }
        out.files.push(DataFile {
            path: path.display().to_string(),
            sha256,
            rows,
        });
    }
    Ok(out)
}

fn steps_of(
    record: &Record,
    label: i32,
    path: &std::path::Path,
    line: usize,
) -> Result<Vec<String>, TrainError> {
    if !record.steps.is_empty() {
        return Ok(record.steps.clone());
    }
    let text = record.text.as_deref().unwrap_or_default();
    let steps: Vec<String> = retrace::segment(text)
        .into_iter()
        .map(|r| text[r].to_string())
        .collect();
    if label >= steps.len() as i32 {
        return Err(DataError {
            file: path.display().to_string(),
            line,
            message: format!(
                "row {:?}: `label` {} is not -1 or a step index (the text segments into {} steps)",
                record.id,
                label,
                steps.len()
            ),
            fatal: false,
        }
        .into());
    }
    Ok(steps)
}

/// Counts what `traces` train on.
pub(crate) fn label_counts<'a>(traces: impl IntoIterator<Item = &'a Labelled>) -> LabelCounts {
    let mut c = LabelCounts {
        with_reference: Some(0),
        ..LabelCounts::default()
    };
    for t in traces {
        c.traces += 1;
        c.all_correct_traces += usize::from(t.label == -1);
        let reference = t.record.reference_answer.as_deref();
        if reference.is_some_and(|r| !r.trim().is_empty()) {
            c.with_reference = c.with_reference.map(|n| n + 1);
        }
        for target in t.targets() {
            match target {
                Target::Correct => c.correct_steps += 1,
                Target::Wrong => c.wrong_steps += 1,
                Target::Untrained => {}
            }
        }
    }
    c
}

/// Refuses training data with a single class of step.
pub(crate) fn check_two_classes(c: &LabelCounts, files: &[DataFile]) -> Result<(), TrainError> {
    let names = || {
        files
            .iter()
            .map(|f| f.path.clone())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if c.traces == 0 {
        return Err(TrainError::Usage(format!(
            "the training data ({}) holds no trace",
            names()
        )));
    }
    if c.wrong_steps == 0 || c.correct_steps == 0 {
        let (has, lacks) = if c.wrong_steps == 0 {
            ("correct", "no row has a `label` >= 0")
        } else {
            ("wrong", "every row's first step is wrong")
        };
        return Err(TrainError::Usage(format!(
            "the training data ({}) has a single class: only {has} steps ({lacks}); a head needs both",
            names()
        )));
    }
    Ok(())
}

/// Splits `traces` into (train, dev) index lists: a `share` of the distinct questions, drawn
/// with `seed`, go to dev with all their traces.
pub(crate) fn hold_out(traces: &[Labelled], share: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let questions: BTreeSet<String> = traces.iter().map(Labelled::question_key).collect();
    let mut order: Vec<&String> = questions.iter().collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    let n_dev = ((order.len() as f64 * share).round() as usize).clamp(1, order.len().max(2) - 1);
    let dev: BTreeSet<&String> = order.into_iter().take(n_dev).collect();
    let (mut train, mut dev_idx) = (Vec::new(), Vec::new());
    for (i, t) in traces.iter().enumerate() {
        if dev.contains(&t.question_key()) {
            dev_idx.push(i);
        } else {
            train.push(i);
        }
    }
    (train, dev_idx)
}

/// `n` of `indices`, drawn with `seed`, in their original order.
pub(crate) fn sample(indices: &[usize], n: usize, seed: u64) -> Vec<usize> {
    let mut picked = indices.to_vec();
    picked.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
    picked.truncate(n);
    picked.sort_unstable();
    picked
}

/// Refuses a held-out set (`b`, given as option `b_opt`) that shares a question with `a`
/// (option `a_opt`), naming both rows.
pub(crate) fn check_disjoint(
    a: &Dataset,
    a_opt: &str,
    b: &Dataset,
    b_opt: &str,
) -> Result<(), TrainError> {
    let mut seen: HashMap<String, &Labelled> = HashMap::new();
    for t in &a.traces {
        seen.entry(t.question_key()).or_insert(t);
    }
    for d in &b.traces {
        if let Some(t) = seen.get(&d.question_key()) {
            return Err(TrainError::Usage(format!(
                "{b_opt} {}:{}: row {:?} has the question of {a_opt} {}:{} (row {:?}); one \
                 question's traces must not be on both sides",
                b.files[d.file].path,
                d.line,
                d.record.id,
                a.files[t.file].path,
                t.line,
                t.record.id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(question: &str, steps: usize, label: i32) -> Labelled {
        Labelled {
            record: Record {
                id: question.into(),
                split: "s".into(),
                question: question.into(),
                options: vec![],
                steps: (0..steps).map(|i| format!("s{i}")).collect(),
                text: None,
                label: Some(label),
                category: None,
                reference_answer: None,
                final_answer_correct: None,
                generator: None,
                source: None,
            },
            label,
            file: 0,
            line: 1,
            steps: (0..steps).map(|i| format!("s{i}")).collect(),
        }
    }

    #[test]
    fn targets_stop_at_the_first_error() {
        use Target::*;
        let t: Vec<_> = trace("q", 4, 1).targets().collect();
        assert_eq!(t, [Correct, Wrong, Untrained, Untrained]);
        let t: Vec<_> = trace("q", 2, -1).targets().collect();
        assert_eq!(t, [Correct, Correct]);
        let c = label_counts(&[trace("a", 4, 1), trace("b", 2, -1), trace("c", 3, 0)]);
        assert_eq!(
            c,
            LabelCounts {
                correct_steps: 3,
                wrong_steps: 2,
                traces: 3,
                all_correct_traces: 1,
                with_reference: Some(0),
            }
        );
        let mut referenced = trace("d", 2, -1);
        referenced.record.reference_answer = Some("42".into());
        let c = label_counts(&[referenced, trace("e", 2, -1)]);
        assert_eq!(c.with_reference, Some(1));
        assert_eq!(c.references(), Some(retrace::References::Some));
    }

    #[test]
    fn hold_out_keeps_questions_whole_and_is_seeded() {
        let traces: Vec<_> = (0..40)
            .map(|i| trace(&format!("Question  {}", i % 10), 3, -1))
            .chain([trace("question 3", 2, 0)])
            .collect();
        let (train, dev) = hold_out(&traces, 0.3, 7);
        assert_eq!(train.len() + dev.len(), traces.len());
        let key = |i: &usize| traces[*i].question_key();
        let dev_q: BTreeSet<_> = dev.iter().map(key).collect();
        assert_eq!(dev_q.len(), 3);
        assert!(train.iter().all(|i| !dev_q.contains(&key(i))));
        assert_eq!(hold_out(&traces, 0.3, 7), (train, dev.clone()));
        assert_ne!(hold_out(&traces, 0.3, 8).1, dev);
    }

    #[test]
    fn a_sample_is_seeded_ordered_and_drawn_from_the_whole() {
        let all: Vec<usize> = (0..100).collect();
        let a = sample(&all, 10, 3);
        assert_eq!(a.len(), 10);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(a, sample(&all, 10, 3));
        assert_ne!(a, sample(&all, 10, 4));
        // Drawn from the whole range, not its head.
        assert!(a.iter().any(|&i| i >= 50), "{a:?}");
    }

    #[test]
    fn single_class_is_refused() {
        let files = [DataFile {
            path: "d.jsonl".into(),
            sha256: String::new(),
            rows: 1,
        }];
        let only_correct = label_counts(&[trace("a", 3, -1)]);
        let e = check_two_classes(&only_correct, &files).unwrap_err();
        assert!(e.to_string().contains("single class"), "{e}");
        assert!(e.to_string().contains("d.jsonl"), "{e}");
        assert!(check_two_classes(&label_counts(&[trace("a", 3, 1)]), &files).is_ok());
    }
}
