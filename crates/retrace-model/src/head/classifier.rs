//! What a sequence-classification reward model's `config.json` says beyond the decoder's keys:
//! its class (`architectures`), its labels (`num_labels` / `id2label`) and `pad_token_id`, read
//! the way transformers reads them, with errors that name the key.

use crate::error::ModelError;
use serde_json::Value;
use std::path::Path;

/// The classes an outcome reward model may be, with the `model_type` each implies.
const SEQUENCE_CLASSIFIERS: [(&str, &str); 3] = [
    ("LlamaForSequenceClassification", "llama"),
    ("Qwen2ForSequenceClassification", "qwen2"),
    ("MistralForSequenceClassification", "mistral"),
];

/// A sequence classifier's own keys, checked: one label, a known class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassifierConfig {
    /// `architectures[0]`.
    pub architecture: String,
    /// The id transformers skips when it looks for the last token; `None` when unset (or
    /// negative, which no token equals).
    pub pad_token_id: Option<u32>,
}

impl ClassifierConfig {
    /// Reads `folder/config.json`.
    pub fn read(folder: &Path) -> Result<Self, ModelError> {
        let path = folder.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => ModelError::MissingFile(path.clone()),
            _ => ModelError::Io {
                path: path.clone(),
                source,
            },
        })?;
        Self::from_json(&text).map_err(|(key, reason)| ModelError::BadConfig {
            path,
            key: key.to_string(),
            reason,
        })
    }

    /// Parses `config.json` text; an error is the key at fault and why.
    pub fn from_json(text: &str) -> Result<Self, (&'static str, String)> {
        let v: Value = serde_json::from_str(text).map_err(|e| ("(document)", e.to_string()))?;
        let names = SEQUENCE_CLASSIFIERS.map(|(a, _)| a).join(", ");
        let architecture = match v.get("architectures").and_then(Value::as_array) {
            Some(list) => list.first().and_then(Value::as_str).unwrap_or_default(),
            None => "",
        };
        let Some((_, model_type)) = SEQUENCE_CLASSIFIERS
            .iter()
            .find(|(a, _)| *a == architecture)
        else {
            return Err((
                "architectures",
                format!(
                    "names {architecture:?}; a sequence-classification reward model is one of \
                     {names} (its `score` head is what the outcome-rm family reads)"
                ),
            ));
        };
        if v.get("model_type").and_then(Value::as_str) != Some(model_type) {
            return Err((
                "model_type",
                format!("must be {model_type:?} for {architecture}"),
            ));
        }
        let labels = num_labels(&v)?;
        if labels != 1 {
            return Err((
                "id2label",
                format!(
                    "the checkpoint has {labels} labels; an outcome reward model has one (a \
                     single reward logit). A classifier with several labels is not read, since \
                     no one label of it is a reward"
                ),
            ));
        }
        let pad_token_id = match v.get("pad_token_id") {
            None | Some(Value::Null) => None,
            Some(n) => match n.as_i64() {
                Some(id) if id < 0 => None,
                Some(id) => Some(
                    u32::try_from(id)
                        .map_err(|_| ("pad_token_id", format!("{id} is not a token id")))?,
                ),
                None => return Err(("pad_token_id", format!("{n} is not an integer"))),
            },
        };
        Ok(ClassifierConfig {
            architecture: architecture.to_string(),
            pad_token_id,
        })
    }
}

/// transformers' count: the length of `id2label` when present, else `num_labels`, else its
/// default of 2 (configs saved without `id2label` had the default two labels).
fn num_labels(v: &Value) -> Result<usize, (&'static str, String)> {
    match (v.get("id2label"), v.get("num_labels")) {
        (Some(Value::Object(map)), _) => Ok(map.len()),
        (Some(other), _) if !other.is_null() => {
            Err(("id2label", format!("{other} is not an object")))
        }
        (_, Some(n)) => n
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| ("num_labels", format!("{n} is not a count"))),
        _ => Ok(2),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &str) -> Result<ClassifierConfig, (&'static str, String)> {
        ClassifierConfig::from_json(&format!(
            r#"{{"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2"{extra}}}"#
        ))
    }

    #[test]
    fn reads_one_label_and_the_pad_id() {
        let c = parse(r#", "id2label": {"0": "LABEL_0"}, "pad_token_id": 7"#).unwrap();
        assert_eq!(c.pad_token_id, Some(7));
        assert_eq!(c.architecture, "Qwen2ForSequenceClassification");
        let c = parse(r#", "num_labels": 1, "pad_token_id": null"#).unwrap();
        assert_eq!(c.pad_token_id, None);
        assert_eq!(
            parse(r#", "num_labels": 1, "pad_token_id": -1"#)
                .unwrap()
                .pad_token_id,
            None
        );
    }

    #[test]
    fn refusals_name_the_key() {
        // No id2label and no num_labels: transformers' default of two labels.
        assert_eq!(parse("").unwrap_err().0, "id2label");
        let e = parse(r#", "id2label": {"0": "a", "1": "b"}"#).unwrap_err();
        assert!(e.1.contains("2 labels"), "{}", e.1);
        assert_eq!(
            parse(r#", "num_labels": 1, "pad_token_id": "x""#)
                .unwrap_err()
                .0,
            "pad_token_id"
        );
        let e = ClassifierConfig::from_json(
            r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_labels": 1}"#,
        )
        .unwrap_err();
        assert_eq!(e.0, "architectures");
        assert!(e.1.contains("LlamaForCausalLM"), "{}", e.1);
        let e = ClassifierConfig::from_json(
            r#"{"architectures": ["LlamaForSequenceClassification"], "model_type": "qwen2", "num_labels": 1}"#,
        )
        .unwrap_err();
        assert_eq!(e.0, "model_type");
    }
}
