//! The head folder's config: the contract's example parses and round-trips, each bad key is
//! refused naming the file and key, and a base that is not the one trained on is refused.

use super::*;
use serde_json::{Value, json};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-headcfg-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The contract's example (docs/training.md), with real values in place of its placeholders.
fn example() -> Value {
    json!({
        "retrace_head": 1,
        "base": "base",
        "base_sha256": "ab".repeat(32),
        "format": "chat-lm",
        "layers": [27, 28, 29],
        "hidden_size": 576,
        "head": "mlp",
        "mlp_hidden": 64,
        "threshold": 0.53,
        "categories": ["none", "misinterpretation", "hallucination", "reasoning"],
        "label_counts": {"correct_steps": 10, "wrong_steps": 4, "traces": 5, "all_correct_traces": 1},
        "data": [{"path": "train.json", "sha256": "cd".repeat(32), "rows": 5}],
        "dev": [{"path": "dev.json", "sha256": "ef".repeat(32), "rows": 2}],
        "seed": 0,
        "dev_f1": 71.2
    })
}

fn write(dir: &Path, config: &Value) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

#[test]
fn the_contracts_example_parses_and_round_trips() {
    let dir = temp("example");
    write(&dir, &example());
    let c = HeadConfig::read(&dir).unwrap();
    assert_eq!(c.format, Family::ChatLm);
    assert_eq!(c.head, HeadKind::Mlp { hidden: 64 });
    assert_eq!(
        c.categories.as_ref().unwrap()[2],
        ErrorCategory::Hallucination
    );
    let spec = c.spec(&dir);
    assert_eq!(spec.kind, HeadKind::Mlp { hidden: 64 });
    assert_eq!(
        (spec.groups.clone(), spec.categories),
        (vec![vec![27, 28, 29]], 4)
    );
    // What one side writes the other reads back unchanged.
    let again: HeadConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
    assert_eq!(again, c);
    // Groups of layers, concatenated, read and write as nested lists; one group as a flat one.
    let mut v = example();
    v["layers"] = json!([[15], [27, 28]]);
    write(&dir, &v);
    let c = HeadConfig::read(&dir).unwrap();
    assert_eq!(c.spec(&dir).groups, vec![vec![15], vec![27, 28]]);
    let written = serde_json::to_value(&c).unwrap();
    assert_eq!(written["layers"], json!([[15], [27, 28]]));
    let one = serde_json::to_value(
        HeadConfig::read(&dir)
            .map(|mut c| {
                c.layers = Layers(vec![vec![3, 4]]);
                c
            })
            .unwrap(),
    )
    .unwrap();
    assert_eq!(one["layers"], json!([3, 4]));
    // format defaults to chat-lm; categories and the trainer's record may be left out.
    let mut v = example();
    for key in [
        "format",
        "categories",
        "label_counts",
        "data",
        "dev",
        "seed",
        "dev_f1",
    ] {
        v.as_object_mut().unwrap().remove(key);
    }
    write(&dir, &v);
    let c = HeadConfig::read(&dir).unwrap();
    assert_eq!((c.format, c.categories), (Family::ChatLm, None));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn each_bad_key_is_refused_naming_the_file_and_key() {
    let dir = temp("bad");
    let cases: Vec<(&str, Value, &str)> = vec![
        ("threshold", Value::Null, "missing field `threshold`"),
        ("retrace_head", json!(2), "bad `retrace_head`: version 2"),
        ("format", json!("head"), "family \"head\" is not one of"),
        ("format", json!("nope"), "family \"nope\" is not one of"),
        ("layers", json!([]), "bad `layers`: lists no layer"),
        ("layers", json!([-1]), "`layers` is a list of layers"),
        ("layers", json!([[15], []]), "bad `layers`: lists no layer"),
        ("head", json!("svm"), "unknown variant `svm`"),
        ("mlp_hidden", Value::Null, "bad `mlp_hidden`"),
        (
            "threshold",
            json!(1.5),
            "bad `threshold`: must lie in [0, 1]",
        ),
        (
            "categories",
            json!(["none", "bogus"]),
            "unknown variant `bogus`",
        ),
        (
            "categories",
            json!(["none", "none"]),
            "bad `categories`: \"none\" is listed twice",
        ),
        (
            "categories",
            json!(["none"]),
            "bad `categories`: names no error category",
        ),
        ("base_sha256", json!("xyz"), "bad `base_sha256`"),
        ("hidden_size", json!(0), "bad `hidden_size`"),
    ];
    for (key, value, want) in cases {
        let mut v = example();
        match value {
            Value::Null => {
                v.as_object_mut().unwrap().remove(key);
            }
            value => v[key] = value,
        }
        write(&dir, &v);
        let err = HeadConfig::read(&dir).unwrap_err();
        assert!(
            err.contains(&dir.join("config.json").display().to_string()) && err.contains(want),
            "{key}: {err}"
        );
    }
    std::fs::remove_file(dir.join("config.json")).unwrap();
    let err = HeadConfig::read(&dir).unwrap_err();
    assert!(
        err.starts_with("cannot read") && err.contains("config.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_base_that_is_not_the_one_trained_on_is_refused_naming_both_checksums() {
    let dir = temp("base");
    let base = dir.join("base");
    std::fs::create_dir_all(&base).unwrap();
    std::fs::write(base.join("model.safetensors"), b"weights").unwrap();
    let sum = checkpoint_sha256(&base).unwrap();
    let mut v = example();
    v["base_sha256"] = json!(sum);
    write(&dir, &v);
    // A relative base is relative to the head folder.
    let head = HeadFolder::open(&dir).unwrap();
    assert_eq!(head.base, base);
    std::fs::write(base.join("model.safetensors"), b"other weights").unwrap();
    let changed = checkpoint_sha256(&base).unwrap();
    let err = HeadFolder::open(&dir).unwrap_err();
    for part in [&sum, &changed, &base.display().to_string()] {
        assert!(err.contains(part.as_str()), "{part} in {err}");
    }
    v["base"] = json!("elsewhere");
    write(&dir, &v);
    let err = HeadFolder::open(&dir).unwrap_err();
    assert!(err.contains("elsewhere does not exist"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_head_served_in_another_dtype_than_it_was_trained_in_is_refused_by_name() {
    let dir = temp("dtype");
    let mut config: HeadConfig = serde_json::from_value(example()).unwrap();
    let head = |config: HeadConfig| HeadFolder {
        dir: dir.clone(),
        config,
        base: dir.clone(),
    };
    // A folder from before the dtype was recorded serves in any.
    assert_eq!(config.dtype, None);
    assert!(head(config.clone()).check_dtype(Dtype::Bf16).is_ok());
    config.dtype = Some(Dtype::F32);
    assert!(head(config.clone()).check_dtype(Dtype::F32).is_ok());
    let err = head(config).check_dtype(Dtype::Bf16).unwrap_err();
    assert!(
        err.contains("config.json") && err.contains("in f32") && err.contains("in bf16"),
        "{err}"
    );
}

#[test]
fn the_category_is_the_most_probable_error_label() {
    let dir = temp("category");
    let config: HeadConfig = serde_json::from_value(example()).unwrap();
    let head = HeadFolder {
        dir: dir.clone(),
        config,
        base: dir.clone(),
    };
    // "none" is the most probable, but a first error has an error category: the next one.
    assert_eq!(
        head.category(&[0.7, 0.05, 0.2, 0.05]),
        ErrorCategory::Hallucination
    );
    assert_eq!(
        head.category(&[0.1, 0.6, 0.2, 0.1]),
        ErrorCategory::Misinterpretation
    );
    let mut none = head.clone();
    none.config.categories = None;
    assert_eq!(none.category(&[]), ErrorCategory::Unspecified);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_trace_head_needs_its_width_and_only_it() {
    let dir = temp("trace");
    let mut v = example();
    v["head"] = json!("trace");
    v.as_object_mut().unwrap().remove("mlp_hidden");
    v["trace_width"] = json!(32);
    write(&dir, &v);
    let c = HeadConfig::read(&dir).unwrap();
    assert_eq!(c.spec(&dir).kind, HeadKind::Trace { width: 32 });
    for (key, value, want) in [
        (
            "trace_width",
            Value::Null,
            "bad `trace_width`: a trace head needs",
        ),
        (
            "trace_width",
            json!(0),
            "bad `trace_width`: a trace head needs",
        ),
        (
            "mlp_hidden",
            json!(8),
            "bad `mlp_hidden`: applies only to head = \"mlp\"",
        ),
    ] {
        let mut bad = v.clone();
        match value {
            Value::Null => bad.as_object_mut().unwrap().remove(key),
            value => bad.as_object_mut().unwrap().insert(key.into(), value),
        };
        write(&dir, &bad);
        let e = HeadConfig::read(&dir).unwrap_err();
        assert!(e.contains("config.json") && e.contains(want), "{key}: {e}");
    }
    let mut mlp = example();
    mlp["trace_width"] = json!(32);
    write(&dir, &mlp);
    let e = HeadConfig::read(&dir).unwrap_err();
    assert!(
        e.contains("bad `trace_width`: applies only to head = \"trace\""),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pools_name_one_per_group_and_spans_only_where_the_format_marks_them() {
    let dir = temp("pools");
    let mut v = example();
    v["layers"] = json!([[15], [15]]);
    v["pools"] = json!(["read", "span"]);
    write(&dir, &v);
    let c = HeadConfig::read(&dir).unwrap();
    assert_eq!(c.spec(&dir).pools, vec![Pool::Read, Pool::Span]);
    assert!(c.spec(&dir).reads_spans());
    assert_eq!(
        serde_json::to_value(&c).unwrap()["pools"],
        json!(["read", "span"])
    );
    // Left out, every group is read at the read, and nothing is written back.
    let plain = HeadConfig::read(&{
        write(&dir, &example());
        dir.clone()
    })
    .unwrap();
    assert!(plain.spec(&dir).pools.is_empty());
    assert!(serde_json::to_value(&plain).unwrap().get("pools").is_none());
    let bad = [
        (json!(["span"]), "chat-lm", "names 1 pools for 2 groups"),
        (json!(["read", "mean"]), "chat-lm", "unknown variant `mean`"),
        (
            json!(["read", "span"]),
            "qwen2-math-prm",
            "which format qwen2-math-prm does not mark",
        ),
    ];
    for (pools, format, want) in bad {
        v["pools"] = pools;
        v["format"] = json!(format);
        write(&dir, &v);
        let err = HeadConfig::read(&dir).unwrap_err();
        assert!(err.contains(want), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_committed_default_heads_folder_reads_and_writes_byte_identically() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("heads/smollm2/config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let config: HeadConfig = serde_json::from_str(&text).unwrap();
    assert_eq!(config.to_json(), text);
    // Written before the record of reference answers: none is claimed for it.
    assert_eq!(config.label_counts.unwrap().references(), None);
}

#[test]
fn a_head_says_once_when_it_serves_traces_unlike_its_training_in_their_references() {
    let counts = |traces, with| LabelCounts {
        traces,
        with_reference: with,
        ..LabelCounts::default()
    };
    let without = ReferenceWatch::new(Some(&counts(10, Some(0))));
    assert!(without.differs(true) && !without.differs(false));
    let with = ReferenceWatch::new(Some(&counts(10, Some(10))));
    assert!(with.differs(false) && !with.differs(true));
    // Trained on both, or not recorded: nothing to say.
    for watch in [
        ReferenceWatch::new(Some(&counts(10, Some(4)))),
        ReferenceWatch::new(Some(&counts(10, None))),
        ReferenceWatch::new(None),
    ] {
        assert!(!watch.differs(true) && !watch.differs(false));
    }
    // Said once: the flag is taken by the first trace that differs.
    with.check("h", false);
    assert!(with.warned.load(std::sync::atomic::Ordering::Relaxed));
}
