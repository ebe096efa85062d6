//! The decoder's view of a Hugging Face `config.json` (Llama, Mistral, Qwen2), with the defaults
//! transformers applies and the checks that name the offending key.

use serde::Deserialize;

/// What went wrong in a `config.json`, naming the key.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfigError {
    pub key: String,
    pub reason: String,
}

/// The keys of an HF `config.json` the decoder reads; every other key is ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct ModelConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub rope_scaling: Option<RawRopeScaling>,
    /// Per-frequency divisors, as a GGUF stores Llama 3.1's RoPE scaling (`rope_freqs.weight`).
    #[serde(skip)]
    pub rope_freq_factors: Option<Vec<f64>>,
}

/// `rope_scaling` as written: transformers has used both `type` and `rope_type` for the kind.
#[derive(Debug, Clone, Deserialize)]
pub struct RawRopeScaling {
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

/// Llama 3.1's frequency-dependent RoPE rescaling (the only scaling the PRM families use).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: usize,
}

impl ModelConfigError {
    fn new(key: &str, reason: impl Into<String>) -> Self {
        Self {
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for ModelConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "key `{}`: {}", self.key, self.reason)
    }
}

impl std::error::Error for ModelConfigError {}

impl ModelConfig {
    /// Parses and validates `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, ModelConfigError> {
        // The architecture first: an encoder's config (BERT's, say) lacks decoder keys, and
        // "missing rms_norm_eps" would hide that it is no decoder at all.
        #[derive(Deserialize)]
        struct Kind {
            model_type: Option<String>,
        }
        if let Ok(Kind {
            model_type: Some(t),
        }) = serde_json::from_str::<Kind>(text)
        {
            check_model_type(&t)?;
        }
        let cfg: ModelConfig = serde_json::from_str(text).map_err(|e| {
            let key = key_of_json_error(text, &e);
            ModelConfigError {
                key,
                reason: e.to_string(),
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn rope_theta(&self) -> f64 {
        self.rope_theta.unwrap_or(10_000.0)
    }

    /// The sliding window of layer `layer`, if it has one. Llama never windows. Mistral windows
    /// every layer when `sliding_window` is set. Qwen2 windows only with `use_sliding_window`, and
    /// then (as transformers does) only the layers from `max_window_layers` on.
    pub fn window_for_layer(&self, layer: usize) -> Option<usize> {
        match self.model_type.as_str() {
            "mistral" => self.sliding_window,
            "qwen2" if self.use_sliding_window == Some(true) => {
                // transformers' Qwen2Config default for a missing max_window_layers.
                let first = self.max_window_layers.unwrap_or(28);
                self.sliding_window.filter(|_| layer >= first)
            }
            _ => None,
        }
    }

    /// RoPE inverse frequencies (head_dim / 2 of them), with `rope_scaling` applied.
    pub fn rope_inv_freq(&self) -> Result<Vec<f64>, ModelConfigError> {
        let (hd, theta) = (self.head_dim() as f64, self.rope_theta());
        let mut inv: Vec<f64> = (0..self.head_dim() / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / hd))
            .collect();
        if let Some(factors) = &self.rope_freq_factors {
            if factors.len() != inv.len() {
                return Err(ModelConfigError::new(
                    "rope_freqs",
                    format!("{} factors for {} frequencies", factors.len(), inv.len()),
                ));
            }
            for (f, d) in inv.iter_mut().zip(factors) {
                *f /= d;
            }
        }
        if let Some(s) = self.rope_scaling()? {
            // transformers' `_compute_llama3_parameters`: long wavelengths slowed by `factor`,
            // short ones kept, the band between interpolated.
            let old = s.original_max_position_embeddings as f64;
            let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
            for f in inv.iter_mut() {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= s.factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
                }
            }
        }
        Ok(inv)
    }

    /// The validated `rope_scaling`; `None` for plain RoPE.
    pub fn rope_scaling(&self) -> Result<Option<Llama3Scaling>, ModelConfigError> {
        let Some(rs) = &self.rope_scaling else {
            return Ok(None);
        };
        let kind = rs
            .rope_type
            .as_deref()
            .or(rs.kind.as_deref())
            .unwrap_or("default");
        match kind {
            "default" => Ok(None),
            "llama3" => {
                let need = |v: Option<f64>, k: &str| {
                    v.filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| {
                        ModelConfigError::new(
                            &format!("rope_scaling.{k}"),
                            "missing or not a positive number",
                        )
                    })
                };
                let s = Llama3Scaling {
                    factor: need(rs.factor, "factor")?,
                    low_freq_factor: need(rs.low_freq_factor, "low_freq_factor")?,
                    high_freq_factor: need(rs.high_freq_factor, "high_freq_factor")?,
                    original_max_position_embeddings: rs
                        .original_max_position_embeddings
                        .filter(|n| *n > 0)
                        .ok_or_else(|| {
                            ModelConfigError::new(
                                "rope_scaling.original_max_position_embeddings",
                                "missing or zero",
                            )
                        })?,
                };
                if s.high_freq_factor <= s.low_freq_factor {
                    return Err(ModelConfigError::new(
                        "rope_scaling.high_freq_factor",
                        "must exceed low_freq_factor",
                    ));
                }
                Ok(Some(s))
            }
            other => Err(ModelConfigError::new(
                "rope_scaling",
                format!(
                    "unsupported rope scaling type {other:?} (supported: \"llama3\", \"default\")"
                ),
            )),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ModelConfigError> {
        check_model_type(&self.model_type)?;
        if let Some(act) = self.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(ModelConfigError::new(
                "hidden_act",
                format!("unsupported {act:?} (only silu)"),
            ));
        }
        let positive = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
            ("max_position_embeddings", self.max_position_embeddings),
            ("vocab_size", self.vocab_size),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(ModelConfigError::new(key, "must be positive"));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(ModelConfigError::new(
                "num_attention_heads",
                "does not divide hidden_size (and head_dim is not set)",
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(ModelConfigError::new("head_dim", "must be even for RoPE"));
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return Err(ModelConfigError::new(
                "num_key_value_heads",
                "must divide num_attention_heads",
            ));
        }
        if self.sliding_window == Some(0) {
            return Err(ModelConfigError::new(
                "sliding_window",
                "must be positive or null",
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err(ModelConfigError::new(
                "rms_norm_eps",
                "must be a positive number",
            ));
        }
        if !(self.rope_theta().is_finite() && self.rope_theta() > 0.0) {
            return Err(ModelConfigError::new(
                "rope_theta",
                "must be a positive number",
            ));
        }
        self.rope_scaling().map(|_| ())
    }
}

/// The key a serde_json error is about: the missing field, else the last object key written before
/// the error's position (config.json is flat apart from `rope_scaling`, so that is the culprit).
/// The decoders this crate runs.
fn check_model_type(t: &str) -> Result<(), ModelConfigError> {
    if matches!(t, "llama" | "mistral" | "qwen2") {
        return Ok(());
    }
    Err(ModelConfigError::new(
        "model_type",
        format!(
            "unsupported {t:?}: not a decoder this server runs (supported: llama, mistral, qwen2)"
        ),
    ))
}

fn key_of_json_error(text: &str, e: &serde_json::Error) -> String {
    let msg = e.to_string();
    if let Some(rest) = msg.strip_prefix("missing field `") {
        return rest.split('`').next().unwrap_or_default().to_string();
    }
    let offset: usize = text
        .split_inclusive('\n')
        .take(e.line().saturating_sub(1))
        .map(str::len)
        .sum::<usize>()
        + e.column();
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    // Scan back for `"key" :`, the pattern only an object key produces.
    let bytes = before.as_bytes();
    let mut i = bytes.len();
    while i > 0 {
        i -= 1;
        if bytes[i] != b':' {
            continue;
        }
        let head = before[..i].trim_end();
        if let Some(quoted) = head.strip_suffix('"')
            && let Some(start) = quoted.rfind('"')
        {
            return quoted[start + 1..].to_string();
        }
    }
    "(document)".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(overrides: &str) -> Result<ModelConfig, ModelConfigError> {
        let mut v: serde_json::Value = serde_json::from_str(
            r#"{"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "vocab_size": 704,
            "sliding_window": null, "unknown": {"a": 1}}"#,
        )
        .unwrap();
        let o: serde_json::Value = serde_json::from_str(&format!("{{{overrides}}}")).unwrap();
        for (k, x) in o.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfig::from_json(&serde_json::to_string_pretty(&v).unwrap())
    }

    #[test]
    fn defaults_follow_transformers() {
        let c = parse("").unwrap();
        assert_eq!(
            (c.kv_heads(), c.head_dim(), c.rope_theta()),
            (2, 16, 10_000.0)
        );
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.window_for_layer(1), None);
        assert_eq!(c.rope_scaling().unwrap(), None);
    }

    #[test]
    fn windows_per_family() {
        let q = parse(r#""sliding_window": 8, "use_sliding_window": false"#).unwrap();
        assert_eq!(q.window_for_layer(5), None);
        let q = parse(r#""sliding_window": 8, "use_sliding_window": true, "max_window_layers": 1"#)
            .unwrap();
        assert_eq!(
            (q.window_for_layer(0), q.window_for_layer(1)),
            (None, Some(8))
        );
        let m = parse(r#""model_type": "mistral", "sliding_window": 8"#).unwrap();
        assert_eq!(m.window_for_layer(0), Some(8));
        let l = parse(r#""model_type": "llama", "sliding_window": 8"#).unwrap();
        assert_eq!(l.window_for_layer(0), None);
    }

    #[test]
    fn llama3_rope_scaling_under_either_key() {
        for kind in ["rope_type", "type"] {
            let c = parse(&format!(
                r#""rope_scaling": {{"{kind}": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#
            ))
            .unwrap();
            assert_eq!(c.rope_scaling().unwrap().unwrap().factor, 8.0);
        }
    }

    #[test]
    fn errors_name_the_key() {
        let e = parse(r#""rope_scaling": {"type": "yarn", "factor": 4.0}"#).unwrap_err();
        assert_eq!(e.key, "rope_scaling");
        assert!(e.reason.contains("yarn"), "{e}");
        let e = ModelConfig::from_json(r#"{"model_type": "llama"}"#).unwrap_err();
        assert_eq!(e.key, "hidden_size");
        let e = parse(r#""rope_theta": "big""#).unwrap_err();
        assert_eq!(e.key, "rope_theta", "{e}");
        let e = parse(r#""model_type": "gpt2""#).unwrap_err();
        assert_eq!(e.key, "model_type");
        let e = parse(r#""num_key_value_heads": 3"#).unwrap_err();
        assert_eq!(e.key, "num_key_value_heads");
        // An encoder's config lacks decoder keys: the architecture is what it gets wrong.
        let bert = r#"{"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2}"#;
        let e = ModelConfig::from_json(bert).unwrap_err();
        assert_eq!(e.key, "model_type", "{e}");
        assert!(e.reason.contains("not a decoder"), "{e}");
    }
}
