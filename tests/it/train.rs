//! `retrace train-head` on the tiny chat-lm checkpoint and the committed ProcessBench subset:
//! the head folder it writes, a rerun that reuses the feature cache and repeats the head bit for
//! bit, bad input refused by file and line or option with nothing left behind (in this process,
//! through the library the binary calls), and the binary killed midway.

use crate::common::{REPO, TempDir, processbench};
use retrace_cli::read_records;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub fn tiny_base() -> PathBuf {
    Path::new(REPO).join("tests/fixtures/tiny/chat-lm")
}

/// Dev traces for the tiny base: the committed subset's math, olympiadbench and omnimath rows
/// short enough for its 2,048-token context, as JSONL (their split kept in `dataset`).
pub fn short_dev(dir: &Path) -> PathBuf {
    by_length(dir, "dev.jsonl", |chars| chars < 2500)
}

/// Six rows of those `short_dev` leaves out, each cut to its first three steps to fit the tiny
/// base's 2,048-token context (a first error past them becomes -1): a test set sharing no
/// question with dev.
pub fn long_test(dir: &Path) -> PathBuf {
    let path = by_length(dir, "test.jsonl", |chars| chars >= 2500);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut six = String::new();
    for line in text.lines().take(6) {
        let mut r: serde_json::Value = serde_json::from_str(line).unwrap();
        r["steps"] = serde_json::Value::Array(r["steps"].as_array().unwrap()[..3].to_vec());
        if r["label"].as_i64().unwrap() >= 3 {
            r["label"] = (-1).into();
        }
        six.push_str(&format!("{r}\n"));
    }
    std::fs::write(&path, six).unwrap();
    path
}

/// The math, olympiadbench and omnimath fixture rows whose text length `keep` takes, as JSONL.
fn by_length(dir: &Path, name: &str, keep: impl Fn(usize) -> bool) -> PathBuf {
    let mut out = String::new();
    for split in ["math", "olympiadbench", "omnimath"] {
        let text = std::fs::read_to_string(processbench(split)).unwrap();
        let rows: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        for mut r in rows {
            let steps = r["steps"].as_array().unwrap();
            let chars = r["problem"].as_str().unwrap().len()
                + steps
                    .iter()
                    .map(|s| s.as_str().unwrap().len())
                    .sum::<usize>();
            if keep(chars) {
                r["dataset"] = split.into();
                out.push_str(&format!("{r}\n"));
            }
        }
    }
    let path = dir.join(name);
    std::fs::write(&path, out).unwrap();
    path
}

/// `retrace train-head ARGS` in this process (the library the binary calls): Ok, or the
/// error as the binary prints it.
pub fn train_head(args: &[&std::ffi::OsStr]) -> Result<(), String> {
    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        opts: retrace_cli::TrainOptions,
    }
    let argv = [os("train-head")].into_iter().chain(args.iter().copied());
    let cmd = <Cmd as clap::Parser>::try_parse_from(argv.chain([os("--no-progress")]))
        .map_err(|e| e.to_string())?;
    retrace_cli::train_head(cmd.opts)
        .map(drop)
        .map_err(|e| e.to_string())
}

fn os<T: AsRef<std::ffi::OsStr> + ?Sized>(s: &T) -> &std::ffi::OsStr {
    s.as_ref()
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn mtimes(dir: &Path) -> Vec<(String, std::time::SystemTime)> {
    names(dir)
        .into_iter()
        .map(|n| {
            let m = std::fs::metadata(dir.join(&n)).unwrap().modified().unwrap();
            (n, m)
        })
        .collect()
}

#[test]
fn writes_the_head_folder_and_repeats_it_from_the_cache() {
    let tmp = TempDir::new("folder");
    let (out, cache, dev) = (tmp.0.join("head"), tmp.0.join("cache"), short_dev(&tmp.0));
    let gsm8k = processbench("gsm8k");
    let base = tiny_base();
    let args = [
        os(&"--base"),
        os(&base),
        os(&"--data"),
        os(&gsm8k),
        os(&"--dev"),
        os(&dev),
        os(&"--out"),
        os(&out),
        os(&"--cache"),
        os(&cache),
        os(&"--seed"),
        os(&"7"),
    ];
    train_head(&args).unwrap();
    assert_eq!(
        names(&out),
        [
            "config.json",
            "dev-scores.jsonl",
            "head.safetensors",
            "report.html",
            "report.md"
        ]
    );
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["retrace_head"], 1);
    assert_eq!(config["format"], "chat-lm");
    assert_eq!(config["hidden_size"], 64);
    assert_eq!(config["seed"], 7);
    let sha = retrace_model::checkpoint_sha256(&base).unwrap();
    assert_eq!(config["base_sha256"], sha.as_str());
    assert!(Path::new(config["base"].as_str().unwrap()).is_absolute());
    // Counted here from the data: steps up to each first error, all steps of a correct trace.
    let (mut correct, mut wrong, mut all_correct) = (0, 0, 0);
    for r in read_records(&gsm8k).unwrap() {
        let r = r.unwrap();
        match r.label.expect("the fixture's rows carry labels") {
            -1 => {
                correct += r.steps.len();
                all_correct += 1;
            }
            l => {
                correct += l as usize;
                wrong += 1;
            }
        }
    }
    let counts = &config["label_counts"];
    assert_eq!(counts["correct_steps"], correct);
    assert_eq!(counts["wrong_steps"], wrong);
    assert_eq!(counts["traces"], 32);
    assert_eq!(counts["all_correct_traces"], all_correct);
    assert!(config["categories"].is_null());
    let dev_rows = read_records(&dev).unwrap().count();
    assert_eq!(config["dev"][0]["rows"], dev_rows);
    let head =
        candle_core::safetensors::load(out.join("head.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    assert_eq!(head["norm.mean"].dims(), [64]);
    assert_eq!(head["norm.scale"].dims(), [64]);
    match config["head"].as_str().unwrap() {
        "logistic" => assert_eq!(head["step.weight"].dims(), [1, 64]),
        "mlp" => assert_eq!(head["step.2.weight"].dims(), [1, 64]),
        "trace" => {
            assert_eq!(config["trace_width"], 32, "the default width");
            assert_eq!(head["trace.input.weight"].dims(), [32, 64]);
            assert_eq!(head["trace.gru_hh.weight"].dims(), [96, 32]);
            assert_eq!(head["trace.out.weight"].dims(), [1, 64]);
        }
        other => panic!("head {other}"),
    }
    let scores = std::fs::read_to_string(out.join("dev-scores.jsonl")).unwrap();
    assert_eq!(scores.lines().count(), dev_rows);
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    for part in [
        "## Taps",
        "final",
        "| [2] |",
        "## Step head",
        "trace probe 32",
        "## Threshold",
        "## Training",
    ] {
        assert!(report.contains(part), "{part} missing from the report");
    }

    // Again, same seed: the features come from the cache (untouched) and the head repeats.
    let cached = mtimes(&cache);
    assert_eq!(
        cached.len(),
        12,
        "an entry (data, index) per file and part (final, top4, middle): {cached:?}"
    );
    let first = std::fs::read(out.join("head.safetensors")).unwrap();
    let mut again = args.to_vec();
    again.push(os(&"--force"));
    train_head(&again).unwrap();
    assert_eq!(mtimes(&cache), cached);
    assert_eq!(std::fs::read(out.join("head.safetensors")).unwrap(), first);
    assert_eq!(names(&tmp.0), ["cache", "dev.jsonl", "head"]);
    // Other taps whose parts are partly cached: only the new part is extracted.
    again.extend([os(&"--taps"), os(&"middle,middle+span:middle")]);
    train_head(&again).unwrap();
    let now = mtimes(&cache);
    assert_eq!(now.len(), 16, "one new part for each file: {now:?}");
    assert!(
        cached.iter().all(|c| now.contains(c)),
        "{cached:?} -> {now:?}"
    );
}

/// Runs train-head with `args` and expects a refusal whose message holds each of `expect`, with
/// no head folder and no temporary folder left in `dir`.
fn refused(dir: &Path, args: &[&std::ffi::OsStr], expect: &[&str]) {
    let before = names(dir);
    let (out, cache) = (dir.join("head"), dir.join("cache"));
    let mut all = args.to_vec();
    all.extend([os(&"--out"), os(&out), os(&"--cache"), os(&cache)]);
    let err = train_head(&all).expect_err("accepted");
    for e in expect {
        assert!(err.contains(e), "{e:?} not in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    let left: Vec<String> = names(dir)
        .into_iter()
        .filter(|n| n != "cache" && !before.contains(n))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

fn jsonl(dir: &Path, name: &str, rows: &[&str]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path
}

#[test]
fn bad_input_is_refused_by_file_and_line_or_option() {
    let tmp = TempDir::new("bad");
    let d = &tmp.0;
    let base = tiny_base();
    fn with<'a>(base: &'a Path, data: &'a Path) -> [&'a std::ffi::OsStr; 4] {
        [os("--base"), os(base), os("--data"), os(data)]
    }
    let good = r#"{"question": "q1", "steps": ["a", "b"], "label": 1}"#;
    let out_of_range = jsonl(
        d,
        "range.jsonl",
        &[
            good,
            r#"{"question": "q2", "steps": ["a", "b"], "label": 5}"#,
        ],
    );
    let shown = out_of_range.display().to_string();
    refused(
        d,
        &with(&base, &out_of_range),
        &[&format!("{shown}:2:"), "`label` 5"],
    );
    // A text that segments into fewer steps than its label.
    let text = jsonl(
        d,
        "text.jsonl",
        &[
            good,
            r#"{"question": "q3", "text": "one\n\ntwo", "label": 2}"#,
        ],
    );
    refused(
        d,
        &with(&base, &text),
        &[&format!("{}:2:", text.display()), "segments into 2 steps"],
    );
    let one_class = jsonl(
        d,
        "one.jsonl",
        &[
            r#"{"question": "q1", "steps": ["a"], "label": -1}"#,
            r#"{"question": "q2", "steps": ["a", "b"], "label": -1}"#,
        ],
    );
    refused(
        d,
        &with(&base, &one_class),
        &["single class", &one_class.display().to_string()],
    );

    // Dev shares a question with the training data (case and spacing aside).
    let gsm8k = processbench("gsm8k");
    let text = std::fs::read_to_string(&gsm8k).unwrap();
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
    let mut twin = rows[3].clone();
    twin["id"] = "twin".into();
    twin["problem"] = format!("  {}", twin["problem"].as_str().unwrap().to_uppercase()).into();
    let dev = jsonl(d, "dev.jsonl", &[&twin.to_string()]);
    let mut args = with(&base, &gsm8k).to_vec();
    args.extend([os(&"--dev"), os(&dev)]);
    refused(
        d,
        &args,
        &[
            &format!("--dev {}:1", dev.display()),
            &gsm8k.display().to_string(),
            "gsm8k-3",
        ],
    );
    // So does a test set, which must be held out from both.
    let mut args = with(&base, &gsm8k).to_vec();
    args.extend([os(&"--test"), os(&dev)]);
    refused(
        d,
        &args,
        &[&format!("--test {}:1", dev.display()), "--data", "gsm8k-3"],
    );

    // Bases that are no decoder: an encoder's folder, a file that is no model.
    let bert = d.join("bert");
    std::fs::create_dir_all(&bert).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(base.join(f), bert.join(f)).unwrap();
    }
    std::fs::write(
        bert.join("config.json"),
        r#"{"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 640}"#,
    )
    .unwrap();
    let data = jsonl(
        d,
        "ok.jsonl",
        &[good, r#"{"question": "q2", "steps": ["a"], "label": -1}"#],
    );
    let args = [os(&"--base"), os(&bert), os(&"--data"), os(&data)];
    refused(
        d,
        &args,
        &[&format!("--base {}", bert.display()), "model_type", "bert"],
    );
    let not_model = d.join("notes.txt");
    std::fs::write(&not_model, "not a model").unwrap();
    let args = [os(&"--base"), os(&not_model), os(&"--data"), os(&data)];
    refused(d, &args, &[&format!("--base {}", not_model.display())]);

    // Options.
    let mut args = with(&base, &data).to_vec();
    args.extend([os(&"--taps"), os(&"final,top0")]);
    refused(d, &args, &["--taps \"top0\""]);
    let mut args = with(&base, &data).to_vec();
    args.extend([os(&"--format"), os(&"no-such-family")]);
    refused(d, &args, &["--format \"no-such-family\""]);
    std::fs::create_dir_all(d.join("head")).unwrap();
    refused(d, &with(&base, &data), &["--out", "exists", "--force"]);
}

#[test]
fn a_killed_run_leaves_no_head_and_a_sound_cache() {
    let tmp = TempDir::new("killed");
    let (out, cache, dev) = (tmp.0.join("head"), tmp.0.join("cache"), short_dev(&tmp.0));
    let (base, gsm8k) = (tiny_base(), processbench("gsm8k"));
    let mut args = vec![
        os(&"--base"),
        os(&base),
        os(&"--data"),
        os(&gsm8k),
        os(&"--dev"),
        os(&dev),
        os(&"--out"),
        os(&out),
        os(&"--cache"),
        os(&cache),
    ];
    // Training that would run for hours once the features are in: killed mid-training.
    let mut child = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .arg("train-head")
        .args(&args)
        .args([
            "--epochs",
            "1000000",
            "--patience",
            "1000000",
            "--no-progress",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while names(&cache)
        .iter()
        .filter(|n| n.ends_with(".json"))
        .count()
        < 6
    {
        assert!(
            child.try_wait().unwrap().is_none(),
            "train-head ended early"
        );
        assert!(
            start.elapsed() < Duration::from_secs(300),
            "no features in 300 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    kill_running(&mut child, "mid-training");
    assert_eq!(
        names(&tmp.0),
        ["cache", "dev.jsonl"],
        "no head, no temporary folder"
    );
    let cached = mtimes(&cache);
    // The cache it left is whole: a normal run reads it and recomputes nothing.
    args.extend([os(&"--epochs"), os(&"3")]);
    train_head(&args).unwrap();
    assert_eq!(mtimes(&cache), cached);
    assert!(out.join("head.safetensors").is_file());

    // Killed early (loading the base or extracting, as the machine's speed has it; training
    // as long as the first run's, so the kill always lands): no head, and whatever reached the
    // cache is whole, so a later run works.
    let cache2 = tmp.0.join("cache2");
    args[9] = os(&cache2);
    let out2 = tmp.0.join("head2");
    args[7] = os(&out2);
    let mut child = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .arg("train-head")
        .args(&args[..10])
        .args(["--epochs", "1000000", "--patience", "1000000"])
        .arg("--no-progress")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(150));
    kill_running(&mut child, "early");
    assert!(!out2.exists(), "no head from a killed run");
    assert!(
        names(&tmp.0).iter().all(|n| !n.contains("tmp")),
        "{:?}",
        names(&tmp.0)
    );
    train_head(&args).unwrap();
    assert!(out2.join("head.safetensors").is_file());
}

/// Kills `child`, which must still be running (`when` says at what point), and checks that
/// the kill is what ended it: a run that ended by itself would test nothing.
fn kill_running(child: &mut std::process::Child, when: &str) {
    use std::os::unix::process::ExitStatusExt;
    let ended = child.try_wait().unwrap();
    assert!(
        ended.is_none(),
        "train-head ended before the kill ({when}): {ended:?}"
    );
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "killed {when}: {status}");
}

/// `rows` of a ProcessBench file as JSONL with a category each (none for an all-correct trace,
/// else the three error categories in turn), so a category head is trained too.
fn with_categories(src: &Path, dest: &Path) -> PathBuf {
    let text = std::fs::read_to_string(src).unwrap();
    let rows: Vec<serde_json::Value> = match text.trim_start().starts_with('[') {
        true => serde_json::from_str(&text).unwrap(),
        false => text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect(),
    };
    let cats = ["misinterpretation", "hallucination", "reasoning"];
    let out: String = rows
        .into_iter()
        .enumerate()
        .map(|(i, mut r)| {
            r["category"] = match r["label"].as_i64().unwrap() {
                -1 => "none".into(),
                _ => cats[i % 3].into(),
            };
            // Every other row with a reference answer, as eval sends it: a head must read it
            // in training as the server does when serving.
            if i % 2 == 0 {
                r["reference_answer"] = "42".into();
            }
            format!("{r}\n")
        })
        .collect();
    std::fs::write(dest, out).unwrap();
    dest.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_head_scores_dev_as_training_did() {
    served_as_trained(&[os("--trace-width"), os("0")], "logistic|mlp").await;
}

/// A trace probe reads each step's predecessors: served one trace at a time, it must give
/// what training computed over all of them side by side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_trace_probe_scores_dev_as_training_did() {
    served_as_trained(
        &[os("--head"), os("trace"), os("--trace-width"), os("8")],
        "trace",
    )
    .await;
}

/// Two taps' means side by side: the served head concatenates them as training did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_head_on_concatenated_taps_scores_dev_as_training_did() {
    let config = served_as_trained(
        &[os("--taps"), os("middle+final"), os("--head"), os("mlp")],
        "mlp",
    )
    .await;
    // The tiny base has 2 layers: middle is 1, final (after the norm) 2.
    assert_eq!(config["layers"], serde_json::json!([[1], [2]]));
}

#[tokio::test]
async fn a_served_head_on_the_steps_tokens_scores_dev_as_training_did() {
    let config = served_as_trained(
        &[
            os("--taps"),
            os("final+span:middle"),
            os("--head"),
            os("mlp"),
        ],
        "mlp",
    )
    .await;
    // The final state at the read, beside layer 1's mean over each step's own tokens.
    assert_eq!(config["layers"], serde_json::json!([[2], [1]]));
    assert_eq!(config["pools"], serde_json::json!(["read", "span"]));
}

/// Trains a head on the tiny base with `extra` options, expects its kind to match `kinds`
/// (alternatives split by `|`), serves it and compares every dev and test trace's scores;
/// returns the head's config.
async fn served_as_trained(extra: &[&std::ffi::OsStr], kinds: &str) -> serde_json::Value {
    use crate::common::{max_gap, request, spawn_retrace, step_scores};
    use retrace::pb;
    use retrace_cli::{Row, read_rows};
    let tmp = TempDir::new("serve");
    let out = tmp.0.join("head");
    let data = with_categories(&processbench("gsm8k"), &tmp.0.join("train.jsonl"));
    let dev = with_categories(&short_dev(&tmp.0), &tmp.0.join("dev-cat.jsonl"));
    let test = long_test(&tmp.0);
    let base = tiny_base();
    let cache = tmp.0.join("cache");
    let args = [
        os("--base"),
        os(&base),
        os("--data"),
        os(&data),
        os("--dev"),
        os(&dev),
        os("--test"),
        os(&test),
        os("--max-train"),
        os("24"),
        os("--out"),
        os(&out),
        os("--cache"),
        os(&cache),
    ];
    let args: Vec<&std::ffi::OsStr> = args.into_iter().chain(extra.iter().copied()).collect();
    train_head(&args).unwrap();
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    let kind = config["head"].as_str().unwrap();
    assert!(kinds.split('|').any(|k| k == kind), "{kind}, not {kinds}");
    assert_eq!(config["categories"][3], "reasoning");
    assert_eq!(config["label_counts"]["traces"], 24, "--max-train");
    // Dev's rows then test's: the server must score both as training did.
    let mut rows: Vec<Row> = Vec::new();
    read_rows(&out.join("dev-scores.jsonl"), |r| rows.push(r)).unwrap();
    let mut test_rows: Vec<Row> = Vec::new();
    read_rows(&out.join("test-scores.jsonl"), |r| test_rows.push(r)).unwrap();
    assert_eq!(test_rows.len(), 6);
    let mut records: Vec<_> = read_records(&dev).unwrap().map(Result::unwrap).collect();
    records.extend(read_records(&test).unwrap().map(Result::unwrap));
    rows.extend(test_rows);
    let toml = tmp.0.join("retrace.toml");
    std::fs::write(
        &toml,
        format!(
            "[[evaluator]]\nname = \"trained\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n",
            out.display().to_string()
        ),
    )
    .unwrap();
    let (_server, channel, _) = spawn_retrace(&[os("--config"), os(&toml)], &[]).await;
    let mut client = pb::evaluator_client::EvaluatorClient::new(channel);
    assert_eq!(records.len(), rows.len());
    let (mut worst, mut errors) = (0.0f64, 0);
    for (record, row) in records.iter().zip(&rows) {
        assert_eq!(record.id, row.id);
        let trace = pb::Trace {
            question: record.question.clone(),
            options: record.options.clone(),
            steps: record.steps.clone(),
            reference_answer: record.reference_answer.clone().unwrap_or_default(),
            ..Default::default()
        };
        let got = client
            .evaluate(request(&row.id, "trained", trace))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(got.steps.len(), row.step_scores.len(), "{}", row.id);
        worst = worst.max(max_gap(&step_scores(&got), &row.step_scores));
        assert_eq!(Some(got.first_error_index), row.prediction, "{}", row.id);
        let category = pb::ErrorCategory::try_from(got.category).unwrap();
        let want = row.category.unwrap().as_str().to_uppercase();
        assert_eq!(
            category.as_str_name(),
            format!("ERROR_CATEGORY_{want}"),
            "{}",
            row.id
        );
        errors += usize::from(got.first_error_index >= 0);
    }
    assert!(
        worst < 1e-5,
        "served against train-head's dev scores: {worst}"
    );
    assert!(
        errors > 0 && errors < rows.len(),
        "{errors} of {} flagged",
        rows.len()
    );
    config
}
