//! Heads on one base hold one copy of it while either serves, a base goes with its last head,
//! and a base with another checksum is another base.

use super::*;
use crate::prm::PrmEvaluator;
use crate::prm::format::PrmKind;
use candle_core::{Device, Tensor};
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-bases-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The tiny chat-lm checkpoint copied to `dir` with `note` in its tokenizer config, so that
/// its checksum is this test's own.
fn base_copy(dir: &Path, note: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/chat-lm");
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap())
            .unwrap();
    config["retrace_test_note"] = note.into();
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
}

/// A logistic head over `base` in `dir`, its step bias `bias`.
fn head(dir: &Path, base: &Path, bias: f32) {
    std::fs::create_dir_all(dir).unwrap();
    let h = 64;
    let t = |v: Vec<f32>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
    let tensors = std::collections::HashMap::from([
        ("norm.mean".to_string(), t(vec![0.0; h], &[h])),
        ("norm.scale".to_string(), t(vec![1.0; h], &[h])),
        ("step.weight".to_string(), t(vec![0.01; h], &[1, h])),
        ("step.bias".to_string(), t(vec![bias], &[1])),
    ]);
    candle_core::safetensors::save(&tensors, dir.join("head.safetensors")).unwrap();
    let config = serde_json::json!({
        "retrace_head": 1,
        "base": base.display().to_string(),
        "base_sha256": retrace_model::checkpoint_sha256(base).unwrap(),
        "layers": [1],
        "hidden_size": h,
        "head": "logistic",
        "threshold": 0.5,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
}

fn load(dir: &Path, bases: &Bases) -> PrmEvaluator {
    let cfg = PrmConfig::new(PrmKind::Head, dir.display().to_string());
    PrmEvaluator::load_sharing("head", 1, &cfg, bases).unwrap()
}

fn base_of(e: &PrmEvaluator) -> &Arc<SharedBase> {
    e.base.as_ref().expect("a head holds its base")
}

#[test]
fn heads_on_one_base_share_it_and_it_goes_with_the_last() {
    let dir = temp("share");
    let (base, other) = (dir.join("base"), dir.join("other-base"));
    base_copy(&base, "share");
    base_copy(&other, "share, another");
    head(&dir.join("a"), &base, 0.1);
    head(&dir.join("b"), &base, 0.2);
    head(&dir.join("c"), &other, 0.3);

    let bases = Bases::default();
    let a = load(&dir.join("a"), &bases);
    let b = load(&dir.join("b"), &bases);
    assert!(
        Arc::ptr_eq(base_of(&a), base_of(&b)),
        "b loaded the base again"
    );
    assert_eq!(a.head.as_ref().unwrap().config.threshold, 0.5);
    let c = load(&dir.join("c"), &bases);
    assert!(
        !Arc::ptr_eq(base_of(&a), base_of(&c)),
        "another checksum, another base"
    );

    // A reload's order: the new head loads while the old one serves, then the old one goes.
    let weak = Arc::downgrade(base_of(&a));
    drop(a);
    let b2 = load(&dir.join("b"), &bases);
    assert!(Arc::ptr_eq(base_of(&b), base_of(&b2)));
    drop((b, b2));
    assert_eq!(weak.strong_count(), 0, "the base outlived its heads");
    let a = load(&dir.join("a"), &bases);
    assert!(!Arc::ptr_eq(base_of(&a), base_of(&c)));
    drop((a, c));
    std::fs::remove_dir_all(&dir).unwrap();
}
