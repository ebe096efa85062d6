//! Trained heads served as `family = "head"`: a head folder written here with random weights
//! over the tiny chat-lm base, served by a real `retrace serve`; its gRPC step scores, first
//! errors and categories against the extractor's features pushed through the same weights
//! here; a base whose weights changed is refused naming both checksums.

use crate::common::{REPO, free_port, max_gap, request, spawn_retrace, step_scores};
use candle_core::{Device, Tensor};
use retrace::Extractor;
use retrace::Family;
use retrace::PrmConfig;
use retrace::pb;
use retrace::{Step, Trace};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const LAYERS: [usize; 2] = [0, 2];
const CATEGORIES: [&str; 4] = ["none", "misinterpretation", "hallucination", "reasoning"];

pub(crate) fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-it-head-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny chat-lm checkpoint copied to `dir`, so the test may change its weights.
pub(crate) fn copy_base(dir: &Path) {
    let src = Path::new(REPO).join("tests/fixtures/tiny/chat-lm");
    std::fs::create_dir_all(dir).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
}

/// The fixture's traces.
fn traces() -> Vec<Trace> {
    let path = Path::new(REPO).join("tests/fixtures/tiny/chat-lm/expected.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strings = |x: &serde_json::Value| -> Vec<String> {
        x.as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Trace {
            question: c["question"].as_str().unwrap().to_string(),
            options: strings(&c["options"]),
            steps: strings(&c["steps"])
                .into_iter()
                .map(|text| Step { text, span: None })
                .collect(),
            reference_answer: c["reference_answer"]
                .as_str()
                .filter(|r| !r.is_empty())
                .map(str::to_string),
        })
        .collect()
}

/// Random head weights, seeded: (name, shape, values).
pub(crate) fn weights(h: usize) -> Vec<(&'static str, Vec<usize>, Vec<f32>)> {
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    };
    let mean = noise(h);
    let scale = noise(h).iter().map(|v| 0.5 + v.abs()).collect();
    vec![
        ("norm.mean", vec![h], mean),
        ("norm.scale", vec![h], scale),
        ("step.weight", vec![1, h], noise(h)),
        ("step.bias", vec![1], vec![0.1]),
        ("category.weight", vec![4, h], noise(4 * h)),
        ("category.bias", vec![4], noise(4)),
    ]
}

pub(crate) fn write_weights(dir: &Path, w: &[(&str, Vec<usize>, Vec<f32>)]) {
    let tensors: HashMap<String, Tensor> = w
        .iter()
        .map(|(name, shape, v)| {
            let t = Tensor::from_vec(v.clone(), shape.as_slice(), &Device::Cpu).unwrap();
            (name.to_string(), t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("head.safetensors")).unwrap();
}

/// P(correct) and the category probabilities of one feature, in f64 from the contract.
fn head_of(w: &[(&str, Vec<usize>, Vec<f32>)], f: &[f32]) -> (f64, Vec<f64>) {
    let get = |name: &str| &w.iter().find(|t| t.0 == name).unwrap().2;
    let (mean, scale) = (get("norm.mean"), get("norm.scale"));
    let x: Vec<f64> = (0..f.len())
        .map(|i| (f[i] as f64 - mean[i] as f64) / scale[i] as f64)
        .collect();
    let dot = |w: &[f32]| x.iter().zip(w).map(|(a, b)| a * *b as f64).sum::<f64>();
    let z = dot(get("step.weight")) + get("step.bias")[0] as f64;
    let (cw, cb) = (get("category.weight"), get("category.bias"));
    let h = f.len();
    let logits: Vec<f64> = (0..4)
        .map(|c| dot(&cw[c * h..(c + 1) * h]) + cb[c] as f64)
        .collect();
    let sum: f64 = logits.iter().map(|l| l.exp()).sum();
    (
        1.0 / (1.0 + (-z).exp()),
        logits.iter().map(|l| l.exp() / sum).collect(),
    )
}

fn probs_of(want: &[(f64, Vec<f64>)]) -> Vec<f64> {
    want.iter().map(|(p, _)| *p).collect()
}

/// The first error index and category a head with `threshold` gives steps of these (P(correct),
/// category probabilities): the first step below it, and its likeliest error category.
fn verdict(want: &[(f64, Vec<f64>)], threshold: f64) -> (i32, i32) {
    let Some(k) = want.iter().position(|(p, _)| *p < threshold) else {
        return (-1, pb::ErrorCategory::None as i32);
    };
    let probs = &want[k].1;
    let best = (1..4)
        .max_by(|a, b| probs[*a].total_cmp(&probs[*b]))
        .unwrap();
    (k as i32, category(CATEGORIES[best]))
}

pub(crate) fn write_config(dir: &Path, base: &str, sum: &str, threshold: f64) {
    let config = json!({
        "retrace_head": 1,
        "base": base,
        "base_sha256": sum,
        "format": "chat-lm",
        "layers": LAYERS,
        "hidden_size": 64,
        "head": "logistic",
        "threshold": threshold,
        "categories": CATEGORIES,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

fn serve_config(dir: &Path, head: &Path) -> PathBuf {
    let path = dir.join("retrace.toml");
    let text = format!(
        "[[evaluator]]\nname = \"head\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {m:?}\n\
         prefix_cache_mb = 8\n\n[[evaluator]]\nname = \"head-set\"\nkind = \"prm\"\n\
         family = \"head\"\nmodel = {m:?}\nthreshold = 0.0\n\n[[evaluator]]\nname = \"j\"\n\
         kind = \"judge\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\nretries = 0\n\n\
         [[evaluator]]\nname = \"c\"\nkind = \"cascade\"\nprm = \"head\"\njudge = \"j\"\n\
         escalate_margin = 0.0\n",
        m = head.display().to_string()
    );
    let gguf = dir.join("head-gguf");
    let text = match gguf.is_dir() {
        true => format!(
            "{text}\n[[evaluator]]\nname = \"head-gguf\"\nkind = \"prm\"\nfamily = \"head\"\n\
             model = {:?}\n",
            gguf.display().to_string()
        ),
        false => text,
    };
    std::fs::write(&path, text).unwrap();
    path
}

fn category(name: &str) -> i32 {
    match name {
        "misinterpretation" => pb::ErrorCategory::Misinterpretation as i32,
        "hallucination" => pb::ErrorCategory::Hallucination as i32,
        "reasoning" => pb::ErrorCategory::Reasoning as i32,
        other => panic!("{other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trained_head_serves_its_weights_on_the_extractors_features() {
    let dir = temp("serve");
    let head = dir.join("head");
    copy_base(&head.join("base"));
    let sum = retrace_model::checkpoint_sha256(&head.join("base")).unwrap();
    let traces = traces();
    let ex = Extractor::load(&PrmConfig::new(
        Family::ChatLm,
        head.join("base").display().to_string(),
    ))
    .unwrap();
    let features = ex.extract(&traces, &[LAYERS.to_vec()], |_| {}).unwrap();
    let w = weights(ex.hidden_size());
    write_weights(&head, &w);
    let expected: Vec<Vec<(f64, Vec<f64>)>> = features
        .iter()
        .map(|t| t.steps.iter().map(|s| head_of(&w, &s[0])).collect())
        .collect();
    // The stored threshold: the middle of the widest gap between step probabilities in their
    // middle half, so some traces have a first error and no step lies near it (where f32
    // rounding would decide).
    let mut all: Vec<f64> = expected.iter().flatten().map(|e| e.0).collect();
    all.sort_by(f64::total_cmp);
    let gap = |k: &usize| all[k + 1] - all[*k];
    let k = (all.len() / 4..all.len() * 3 / 4)
        .max_by(|a, b| gap(a).total_cmp(&gap(b)))
        .unwrap();
    let threshold = (all[k] + all[k + 1]) / 2.0;
    write_config(&head, "base", &sum, threshold);
    // So that the default threshold would decide some trace otherwise.
    let first_below = |w: &Vec<(f64, Vec<f64>)>, t: f64| w.iter().position(|(p, _)| *p < t);
    assert!(
        expected
            .iter()
            .any(|w| first_below(w, threshold) != first_below(w, 0.5)),
        "threshold {threshold}"
    );
    // The same head over the base as a GGUF file, read as it is.
    let gguf = Path::new(REPO).join("tests/fixtures/tiny/chat-lm/model.f32.gguf");
    let gguf_head = dir.join("head-gguf");
    std::fs::create_dir_all(&gguf_head).unwrap();
    write_weights(&gguf_head, &w);
    let gguf_sum = retrace_model::checkpoint_sha256(&gguf).unwrap();
    write_config(&gguf_head, gguf.to_str().unwrap(), &gguf_sum, threshold);
    let on_gguf: Vec<Vec<(f64, Vec<f64>)>> =
        Extractor::load(&PrmConfig::new(Family::ChatLm, gguf.display().to_string()))
            .unwrap()
            .extract(&traces, &[LAYERS.to_vec()], |_| {})
            .unwrap()
            .iter()
            .map(|t| t.steps.iter().map(|s| head_of(&w, &s[0])).collect())
            .collect();
    // No step on either base lies within the scores' tolerance of the threshold, so each
    // verdict below is the head's, not f32 rounding's.
    let nearest = expected
        .iter()
        .chain(&on_gguf)
        .flatten()
        .map(|(p, _)| (p - threshold).abs())
        .min_by(f64::total_cmp)
        .unwrap();
    assert!(nearest > 1e-4, "a step {nearest} from the threshold");
    let cfg = serve_config(&dir, &head);
    let (_server, channel, _) = spawn_retrace(&["--config".as_ref(), cfg.as_ref()], &[]).await;
    let mut client = pb::evaluator_client::EvaluatorClient::new(channel);
    let listed = client
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap();
    let info = |n: &str| {
        listed
            .get_ref()
            .evaluators
            .iter()
            .find(|e| e.name == n)
            .unwrap()
            .clone()
    };
    assert_eq!(info("head").family, "head");
    assert!(
        (info("head").threshold as f64 - threshold).abs() < 1e-6,
        "the stored threshold"
    );
    assert_eq!(
        info("head-set").threshold,
        0.0,
        "the config's threshold overrides it"
    );
    assert_eq!(
        info("c").threshold,
        info("head").threshold,
        "a cascade takes its head's"
    );
    let (mut worst, mut errors) = (0.0f64, 0);
    for (i, (trace, want)) in traces.iter().zip(&expected).enumerate() {
        let steps: Vec<String> = trace.steps.iter().map(|s| s.text.clone()).collect();
        let t = pb::Trace {
            question: trace.question.clone(),
            options: trace.options.clone(),
            steps,
            reference_answer: trace.reference_answer.clone().unwrap_or_default(),
            ..Default::default()
        };
        let got = client
            .evaluate(request(&format!("{i}"), "head", t.clone()))
            .await
            .unwrap();
        let got = got.into_inner();
        assert_eq!(got.steps.len(), trace.steps.len(), "trace {i}");
        worst = worst.max(max_gap(&step_scores(&got), &probs_of(want)));
        let (first, cat) = verdict(want, threshold);
        assert_eq!(
            (got.first_error_index, got.category),
            (first, cat),
            "trace {i}"
        );
        errors += usize::from(first >= 0);
        let set = client
            .evaluate(request("s", "head-set", t.clone()))
            .await
            .unwrap();
        assert_eq!(
            set.get_ref().first_error_index,
            -1,
            "threshold 0 finds no error"
        );
        // The cascade's judge is unreachable: where it escalates, the head's verdict stands.
        let c = client.evaluate(request("c", "c", t.clone())).await.unwrap();
        assert_eq!(
            c.get_ref().first_error_index,
            got.first_error_index,
            "trace {i}"
        );
        // The same head over the GGUF base: its own features' scores and verdict.
        let g = client.evaluate(request("g", "head-gguf", t)).await.unwrap();
        let g = g.into_inner();
        let want = &on_gguf[i];
        assert_eq!(
            g.steps.len(),
            trace.steps.len(),
            "trace {i} on the GGUF base"
        );
        worst = worst.max(max_gap(&step_scores(&g), &probs_of(want)));
        assert_eq!(
            (g.first_error_index, g.category),
            verdict(want, threshold),
            "trace {i} on the GGUF base"
        );
    }
    assert!(
        worst < 1e-5,
        "served scores vs the extractor's features: {worst}"
    );
    assert!(
        errors > 0 && errors < traces.len(),
        "{errors} traces with an error"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Another checkpoint of the same shape: one weight changed.
fn other_weight(base: &Path) {
    let path = base.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let norm = tensors["model.norm.weight"].clone();
    tensors.insert("model.norm.weight".into(), (norm * 1.5).unwrap());
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

/// The same weights with another chat template: the head's features would differ too.
fn other_template(base: &Path) {
    let path = base.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    config["chat_template"] = json!("{% for m in messages %}{{ m['content'] }}{% endfor %}");
    std::fs::write(&path, config.to_string()).unwrap();
}

#[test]
fn a_head_whose_base_changed_is_refused_naming_both_checksums() {
    for what in ["weight", "template"] {
        let dir = temp(&format!("changed-{what}"));
        let head = dir.join("head");
        let base = head.join("base");
        copy_base(&base);
        let sum = retrace_model::checkpoint_sha256(&base).unwrap();
        write_weights(&head, &weights(64));
        write_config(&head, "base", &sum, 0.5);
        match what {
            "weight" => other_weight(&base),
            _ => other_template(&base),
        }
        let changed = retrace_model::checkpoint_sha256(&base).unwrap();
        let cfg = serve_config(&dir, &head);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_retrace"))
            .args(["serve", "--config", &cfg.display().to_string()])
            .args(["--grpc-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
            .args(["--http-addr", &format!("127.0.0.1:{}", free_port())])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{what}: {err}");
        for part in [&sum, &changed, &base.display().to_string()] {
            assert!(err.contains(part.as_str()), "{what}: {part} in {err}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
