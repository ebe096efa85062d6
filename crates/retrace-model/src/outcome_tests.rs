//! Exactness of the sequence-classification head against the tiny outcome reward models'
//! float64 numpy reference (one checkpoint per architecture), and its load refusals.

use super::tests::scores;
use super::*;

const ARCHS: [&str; 3] = ["qwen2", "llama", "mistral"];

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(format!("outcome-rm-{arch}"))
}

/// Each case's ids, the position the reference read, and its score.
fn cases(arch: &str) -> Vec<(Vec<u32>, usize, f64)> {
    let text = std::fs::read_to_string(fixture(arch).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["input_ids"].as_array().unwrap();
            (
                ids.iter().map(|n| n.as_u64().unwrap() as u32).collect(),
                c["read_position"].as_u64().unwrap() as usize,
                c["score"].as_f64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn every_architecture_matches_the_reference_alone_and_batched() {
    for arch in ARCHS {
        let model = PrmModel::load(&fixture(arch), HeadSpec::Outcome, &Device::Cpu, DType::F32)
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        let cases = cases(arch);
        let positions: Vec<[usize; 1]> = cases.iter().map(|c| [c.1]).collect();
        let rows: Vec<&[u32]> = cases.iter().map(|c| c.0.as_slice()).collect();
        let reads: Vec<&[usize]> = positions.iter().map(|p| p.as_slice()).collect();
        let batched = model.score(Batch::new(&rows, &reads)).map(scores).unwrap();
        for (i, (ids, pos, want)) in cases.iter().enumerate() {
            let alone = model
                .score(Batch::new(&[ids], &[&[*pos]]))
                .map(scores)
                .unwrap();
            for got in [alone[0][0], batched[i][0]] {
                assert!(
                    (f64::from(got) - want).abs() < 1e-4,
                    "{arch} case {i}: {got} vs {want}"
                );
            }
        }
        // Raw rewards, not probabilities: the fixtures' scores lie outside [0, 1].
        assert!(batched.iter().any(|s| s[0] < 0.0), "{arch}: {batched:?}");
    }
}

#[test]
fn refuses_what_it_cannot_read_as_a_reward() {
    let dir = std::env::temp_dir().join(format!("retrace-outcome-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture("qwen2").join(f), dir.join(f)).unwrap();
    }
    let config = std::fs::read_to_string(fixture("qwen2").join("config.json")).unwrap();
    let cases = [
        (
            config.replace(r#""0": "LABEL_0""#, r#""0": "a", "1": "b""#),
            "id2label",
        ),
        (
            config.replace("Qwen2ForSequenceClassification", "Qwen2ForCausalLM"),
            "architectures",
        ),
    ];
    for (text, key) in cases {
        std::fs::write(dir.join("config.json"), text).unwrap();
        let err = PrmModel::load(&dir, HeadSpec::Outcome, &Device::Cpu, DType::F32)
            .err()
            .unwrap();
        assert!(
            matches!(&err, ModelError::BadConfig { key: k, .. } if k == key),
            "{err}"
        );
    }
    // A checkpoint without the head: candle names the missing tensor.
    std::fs::write(dir.join("config.json"), &config).unwrap();
    let mut tensors =
        candle_core::safetensors::load(fixture("qwen2").join("model.safetensors"), &Device::Cpu)
            .unwrap();
    tensors.remove("score.weight");
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let err = PrmModel::load(&dir, HeadSpec::Outcome, &Device::Cpu, DType::F32)
        .err()
        .unwrap();
    assert!(err.to_string().contains("score"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    let gguf = fixture("qwen2").join("../chat-lm/model.f32.gguf");
    let err = PrmModel::load(&gguf, HeadSpec::Outcome, &Device::Cpu, DType::F32)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("no sequence-classification"),
        "{err}"
    );
}
