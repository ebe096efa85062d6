//! `POST /slime/reward`, slime's remote reward contract (`--rm-type remote_rm --rm-url URL`):
//! slime posts one sample, `{"prompt", "response", "label"}`, and keeps the reply's JSON as the
//! sample's reward: a number, or, under `--reward-key KEY`, an object it reads `KEY` from. So
//! the reply is a bare number unless a reward key is asked for (`?reward_key=` on the URL, or
//! `[reward] reward_key`); then `{KEY: reward, ...}` with the verdict's numbers beside it.

use super::{Contract, Failure, Http, Sample, SampleReward, SampleStatus, Text, label_text};
use crate::config::{LabelsAs, SLIME_EXTRAS, check_reward_key};
use crate::field::FieldPath;
use serde_json::{Map, Value, json};

/// `/slime/reward`'s request as read: the key to answer under, if any.
#[derive(Debug, PartialEq)]
pub(in crate::api::http) struct Slime {
    reward_key: Option<String>,
}

impl Contract for Slime {
    const RPC: &'static str = "/slime/reward";
    const PARAMS: &'static [&'static str] = &["evaluator", "rule", "reward_key"];

    fn read(
        body: &[u8],
        http: &Http,
        param: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<Sample>), Failure> {
        let reward_key = match param("reward_key") {
            Some(key) => {
                check_reward_key(&key).map_err(|m| Failure::invalid("?reward_key", m))?;
                Some(key)
            }
            None => http.reward.reward_key.clone(),
        };
        Ok((
            Slime { reward_key },
            vec![parse_sample(body, http.reward.labels)?],
        ))
    }

    fn list(&self) -> FieldPath {
        FieldPath::key("response")
    }

    fn render(&self, rewards: &[SampleReward]) -> Value {
        match (rewards, &self.reward_key) {
            ([s], Some(key)) => {
                let mut object = Map::new();
                object.insert(key.clone(), json!(s.reward));
                let extras = [
                    json!(s.trace_score),
                    json!(s.first_error_index),
                    json!(s.step_count),
                    json!(s.category),
                    json!(u8::from(s.status == SampleStatus::TimedOut)),
                    json!(s.status.as_str()),
                ];
                object.extend(SLIME_EXTRAS.iter().map(|k| k.to_string()).zip(extras));
                Value::Object(object)
            }
            ([s], None) => json!(s.reward),
            _ => Value::Null,
        }
    }
}

/// Reads slime's body: `prompt` (a string, or chat messages), `response` and an optional
/// `label`, read only when `labels` says labels are references (slime's datasets hold dicts
/// and lists there, which a reference-free reward must not refuse: slime retries a refused
/// sample ten times, then stops); other keys are ignored.
pub(super) fn parse_sample(body: &[u8], labels: LabelsAs) -> Result<Sample, Failure> {
    let value: Value = super::super::parse(body)?;
    let Value::Object(mut object) = value else {
        return Err(Failure::invalid(
            "body",
            "must be a JSON object with `prompt` and `response`",
        ));
    };
    let (prompt, is_question) = match object.remove("prompt") {
        Some(Value::String(p)) => (p, false),
        Some(Value::Array(messages)) => (last_user_message(messages)?, true),
        Some(_) => {
            return Err(Failure::invalid(
                "prompt",
                "must be a string or a list of chat messages",
            ));
        }
        None => return Err(Failure::invalid("prompt", "is required")),
    };
    let response = match object.remove("response") {
        Some(Value::String(r)) => r,
        Some(_) => return Err(Failure::invalid("response", "must be a string")),
        None => return Err(Failure::invalid("response", "is required")),
    };
    let label = match labels {
        LabelsAs::Reference => label_text(
            object.remove("label").unwrap_or(Value::Null),
            "label".into(),
        )?,
        LabelsAs::Ignore => None,
    };
    Ok(Sample {
        text: Text::Apart {
            prompt,
            is_question,
            response,
        },
        label,
        at: FieldPath::key("response"),
        prompt_at: FieldPath::key("prompt"),
    })
}

/// The content of the last `{"role": "user", "content": "..."}` in a message list: the
/// question, as the last user turn of a rendered prompt is.
fn last_user_message(messages: Vec<Value>) -> Result<String, Failure> {
    let at = |i: usize| FieldPath::key("prompt").at(i);
    let mut question = None;
    for (i, m) in messages.into_iter().enumerate() {
        let Value::Object(mut m) = m else {
            return Err(Failure::invalid(
                at(i),
                "must be a message: {\"role\", \"content\"}",
            ));
        };
        let role = m.get("role").and_then(Value::as_str);
        if role.is_none() {
            return Err(Failure::invalid(at(i).then("role"), "must be a string"));
        }
        if role != Some("user") {
            continue;
        }
        match m.remove("content") {
            Some(Value::String(c)) => question = Some(c),
            _ => return Err(Failure::invalid(at(i).then("content"), "must be a string")),
        }
    }
    question.ok_or_else(|| Failure::invalid("prompt", "holds no user message"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(body: &[u8]) -> String {
        parse_sample(body, LabelsAs::Reference)
            .unwrap_err()
            .field
            .unwrap_or_default()
    }

    #[test]
    fn reads_what_slime_posts() {
        let s = parse_sample(
            br#"{"prompt": "p", "response": "r", "label": 42}"#,
            LabelsAs::Reference,
        )
        .unwrap();
        assert_eq!(
            s.text,
            Text::Apart {
                prompt: "p".into(),
                is_question: false,
                response: "r".into()
            }
        );
        assert_eq!(s.label.as_deref(), Some("42"));
        let s = parse_sample(
            br#"{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
                 "response": "5", "label": null, "metadata": {}}"#,
            LabelsAs::Reference,
        )
        .unwrap();
        assert_eq!(
            s.text,
            Text::Apart {
                prompt: "2+3?".into(),
                is_question: true,
                response: "5".into()
            }
        );
        assert_eq!(s.label, None);
    }

    #[test]
    fn a_label_of_any_shape_is_left_alone_when_labels_are_ignored() {
        for label in [r#"{"answer": "5", "id": 3}"#, "[1, 2]", "\"5\"", "null"] {
            let body = format!(r#"{{"prompt": "p", "response": "r", "label": {label}}}"#);
            let s = parse_sample(body.as_bytes(), LabelsAs::Ignore).unwrap();
            assert_eq!(s.label, None, "{label}");
        }
    }

    #[test]
    fn bad_bodies_name_the_field() {
        assert_eq!(field(b"[]"), "body");
        assert_eq!(field(br#"{"response": "r"}"#), "prompt");
        assert_eq!(field(br#"{"prompt": 3, "response": "r"}"#), "prompt");
        assert_eq!(field(br#"{"prompt": "p"}"#), "response");
        assert_eq!(
            field(br#"{"prompt": "p", "response": "r", "label": [1]}"#),
            "label"
        );
        let messages =
            br#"{"prompt": [{"role": "user", "content": [{"type": "text"}]}], "response": "r"}"#;
        assert_eq!(field(messages), "prompt[0].content");
        let no_user = br#"{"prompt": [{"role": "system", "content": "s"}], "response": "r"}"#;
        assert_eq!(field(no_user), "prompt");
        assert_eq!(
            field(br#"{"prompt": [{"content": "c"}], "response": "r"}"#),
            "prompt[0].role"
        );
    }

    #[test]
    fn a_number_or_an_object_under_the_key() {
        let s = SampleReward {
            reward: 0.25,
            trace_score: 0.5,
            first_error_index: 1,
            step_count: 4,
            category: 0,
            status: SampleStatus::Ok,
            detail: None,
        };
        let plain = Slime { reward_key: None };
        assert_eq!(plain.render(std::slice::from_ref(&s)), json!(0.25));
        let keyed = Slime {
            reward_key: Some("score".into()),
        };
        assert_eq!(
            keyed.render(&[s]),
            json!({"score": 0.25, "trace_score": 0.5, "first_error_index": 1, "step_count": 4,
                   "category": 0, "timed_out": 0, "status": "ok"})
        );
    }
}
