//! `POST /get_reward`, OpenRLHF's remote reward contract: `{"query", "prompts", "labels"}` in
//! (each a string for one sample or a list), `{"rewards", "scores", "extra_logs"}` out, the same
//! shape back. Each query is its prompt plus the response; the response, stripped of end
//! markers, is segmented into steps, and the question is read from the prompt. With the
//! policy's tokenizer configured, `prompt_ids` and `completion_ids` may stand for the text.

#[cfg(test)]
use super::SampleStatus;
use super::policy::NO_TOKENIZER;
use super::{Contract, Failure, Http, Sample, SampleReward, Text, sample_at};
use crate::field::FieldPath;
use serde::Serialize;
use serde_json::{Map, Value};

/// `/get_reward`'s request as read: one sample or a list, and text or token ids.
#[derive(Debug, PartialEq)]
pub(in crate::api::http) struct Openrlhf {
    /// The body held one sample as a string (or one list of ids): answered with scalars.
    single: bool,
    /// The samples came as token ids.
    ids: bool,
}

impl Contract for Openrlhf {
    const RPC: &'static str = "/get_reward";
    const PARAMS: &'static [&'static str] = &["evaluator", "rule"];

    fn read(
        body: &[u8],
        http: &Http,
        _param: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<Sample>), Failure> {
        parse_samples(body, http.policy.is_some())
    }

    fn list(&self) -> FieldPath {
        FieldPath::key(if self.ids { "completion_ids" } else { "query" })
    }

    fn render(&self, rewards: &[SampleReward]) -> Value {
        render(rewards, self.single)
    }
}

/// Reads the body: `query` (or `prompt_ids` and `completion_ids`) required, `prompts` and
/// `labels` optional, each a string or a list as long as the samples; other keys (a newer
/// trainer's `datasources`...) are ignored.
pub(super) fn parse_samples(
    body: &[u8],
    has_tokenizer: bool,
) -> Result<(Openrlhf, Vec<Sample>), Failure> {
    let value: Value = super::super::parse(body)?;
    let Value::Object(mut object) = value else {
        return Err(Failure::invalid(
            "body",
            "must be a JSON object with `query` (or `prompt_ids` and `completion_ids`)",
        ));
    };
    let ids = object.contains_key("prompt_ids") || object.contains_key("completion_ids");
    let (texts, single) = match ids {
        false => queries(&mut object)?,
        true => token_ids(&mut object, has_tokenizer)?,
    };
    let labels = optional_list(object.remove("labels"), "labels", texts.len(), true)?;
    let (response, prompt) = match ids {
        false => ("query", "prompts"),
        true => ("completion_ids", "prompt_ids"),
    };
    let samples = texts
        .into_iter()
        .zip(labels)
        .enumerate()
        .map(|(i, (text, label))| Sample {
            text,
            label,
            at: sample_at(response, i, single),
            prompt_at: sample_at(prompt, i, single),
        })
        .collect();
    Ok((Openrlhf { single, ids }, samples))
}

/// `query` and `prompts`, as OpenRLHF sends them.
fn queries(object: &mut Map<String, Value>) -> Result<(Vec<Text>, bool), Failure> {
    let (queries, single) = match object.remove("query") {
        Some(Value::String(q)) => (vec![q], true),
        Some(Value::Array(items)) => (strings(items, "query", false)?, false),
        Some(_) => {
            return Err(Failure::invalid(
                "query",
                "must be a string or a list of strings",
            ));
        }
        None => return Err(Failure::invalid("query", "is required (prompt + response)")),
    };
    if queries.is_empty() {
        return Err(Failure::invalid("query", "holds no sample"));
    }
    let prompts = optional_list(object.remove("prompts"), "prompts", queries.len(), false)?;
    let texts = queries
        .into_iter()
        .zip(prompts)
        .map(|(query, prompt)| Text::Query { query, prompt })
        .collect();
    Ok((texts, single))
}

/// `prompt_ids` and `completion_ids` (AReaL's names): one sample's ids, or a list of them.
fn token_ids(
    object: &mut Map<String, Value>,
    has_tokenizer: bool,
) -> Result<(Vec<Text>, bool), Failure> {
    if let Some(text) = ["query", "prompts"]
        .into_iter()
        .find(|k| object.contains_key(*k))
    {
        return Err(Failure::invalid(
            text,
            "comes with token ids: send each sample's text or its token ids, not both",
        ));
    }
    let (prompt, completion) = (object.remove("prompt_ids"), object.remove("completion_ids"));
    if !has_tokenizer {
        let field = if completion.is_some() {
            "completion_ids"
        } else {
            "prompt_ids"
        };
        return Err(Failure::invalid(field, NO_TOKENIZER));
    }
    let prompt =
        prompt.ok_or_else(|| Failure::invalid("prompt_ids", "is required with completion_ids"))?;
    let completion = completion
        .ok_or_else(|| Failure::invalid("completion_ids", "is required with prompt_ids"))?;
    let Value::Array(prompt) = prompt else {
        return Err(Failure::invalid("prompt_ids", LISTS));
    };
    let (prompts, single) = match prompt.first() {
        None => return Err(Failure::invalid("prompt_ids", "holds no sample")),
        Some(Value::Array(_)) => (lists(prompt, "prompt_ids")?, false),
        Some(_) => (vec![ids(prompt, FieldPath::key("prompt_ids"))?], true),
    };
    let Value::Array(completion) = completion else {
        return Err(Failure::invalid("completion_ids", LISTS));
    };
    let completions = match single {
        true => vec![ids(completion, FieldPath::key("completion_ids"))?],
        false => lists(completion, "completion_ids")?,
    };
    if completions.len() != prompts.len() {
        return Err(Failure::invalid(
            "completion_ids",
            format!(
                "holds {} items for {} prompts",
                completions.len(),
                prompts.len()
            ),
        ));
    }
    let texts = prompts
        .into_iter()
        .zip(completions)
        .map(|(prompt, completion)| Text::Ids { prompt, completion })
        .collect();
    Ok((texts, single))
}

const LISTS: &str = "must be a list of token ids, or a list of such lists";

/// A list of lists of token ids.
fn lists(items: Vec<Value>, field: &'static str) -> Result<Vec<Vec<u32>>, Failure> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Array(list) => ids(list, FieldPath::key(field).at(i)),
            _ => Err(Failure::invalid(
                FieldPath::key(field).at(i),
                "must be a list of token ids",
            )),
        })
        .collect()
}

/// One list of token ids.
fn ids(items: Vec<Value>, at: FieldPath) -> Result<Vec<u32>, Failure> {
    items
        .iter()
        .enumerate()
        .map(|(j, v)| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    Failure::invalid(at.clone().at(j), "must be a token id (an integer from 0)")
                })
        })
        .collect()
}

/// A list of strings; with `lenient`, null stays empty and numbers or booleans become text
/// (labels are whatever the dataset held).
fn strings(items: Vec<Value>, field: &'static str, lenient: bool) -> Result<Vec<String>, Failure> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s),
            Value::Null if lenient => Ok(String::new()),
            Value::Number(n) if lenient => Ok(n.to_string()),
            Value::Bool(b) if lenient => Ok(b.to_string()),
            _ => Err(Failure::invalid(
                FieldPath::key(field).at(i),
                "must be a string",
            )),
        })
        .collect()
}

/// `prompts` or `labels`: absent or null gives `None` for every sample.
fn optional_list(
    value: Option<Value>,
    field: &'static str,
    n: usize,
    lenient: bool,
) -> Result<Vec<Option<String>>, Failure> {
    let items = match value {
        None | Some(Value::Null) => return Ok(vec![None; n]),
        Some(Value::Array(items)) => strings(items, field, lenient)?,
        Some(one) => strings(vec![one], field, lenient)
            .map_err(|_| Failure::invalid(field, "must be a string or a list of strings"))?,
    };
    if items.len() != n {
        return Err(Failure::invalid(
            field,
            format!("holds {} items for {n} samples", items.len()),
        ));
    }
    Ok(items.into_iter().map(Some).collect())
}

/// OpenRLHF reads `rewards`, then `scores` (the same numbers here), then `extra_logs`, whose
/// values it turns into tensors: numbers only, so the category is its proto enum number and
/// each status other than `ok` a 0-or-1 series (whose batch mean is its share). The statuses
/// by name, and what went wrong, are beside them for clients that read them.
#[derive(Serialize)]
struct Rewards {
    rewards: Vec<f32>,
    scores: Vec<f32>,
    extra_logs: ExtraLogs,
    status: Vec<&'static str>,
    status_detail: Vec<Option<String>>,
}

#[derive(Serialize)]
struct ExtraLogs {
    first_error_index: Vec<i32>,
    step_count: Vec<usize>,
    category: Vec<i32>,
    trace_score: Vec<f32>,
    empty: Vec<u8>,
    too_large: Vec<u8>,
    timed_out: Vec<u8>,
    unavailable: Vec<u8>,
}

/// The reply: lists for a list, scalars for one string.
fn render(scored: &[SampleReward], single: bool) -> Value {
    let rewards: Vec<f32> = scored.iter().map(|s| s.reward).collect();
    let is = |name: &str| -> Vec<u8> {
        let of = |s: &SampleReward| u8::from(s.status.as_str() == name);
        scored.iter().map(of).collect()
    };
    let body = Rewards {
        scores: rewards.clone(),
        rewards,
        extra_logs: ExtraLogs {
            first_error_index: scored.iter().map(|s| s.first_error_index).collect(),
            step_count: scored.iter().map(|s| s.step_count).collect(),
            category: scored.iter().map(|s| s.category).collect(),
            trace_score: scored.iter().map(|s| s.trace_score).collect(),
            empty: is("empty"),
            too_large: is("too_large"),
            timed_out: is("timed_out"),
            unavailable: is("unavailable"),
        },
        status: scored.iter().map(|s| s.status.as_str()).collect(),
        status_detail: scored.iter().map(|s| s.detail.clone()).collect(),
    };
    let mut value = serde_json::to_value(body).unwrap_or(Value::Null);
    if single {
        unwrap_singletons(&mut value);
    }
    value
}

/// Replaces every one-element list in `value` (an object tree) by its element.
fn unwrap_singletons(value: &mut Value) {
    match value {
        Value::Object(map) => map.values_mut().for_each(unwrap_singletons),
        Value::Array(items) if items.len() == 1 => *value = items.remove(0),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: &[u8]) -> Result<(Openrlhf, Vec<Sample>), Failure> {
        parse_samples(body, true)
    }

    fn field(r: Result<(Openrlhf, Vec<Sample>), Failure>) -> String {
        r.unwrap_err().field.unwrap_or_default()
    }

    fn query(s: &Sample) -> (&str, Option<&str>) {
        match &s.text {
            Text::Query { query, prompt } => (query, prompt.as_deref()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn one_sample_or_a_list() {
        let (one, s) = read(br#"{"query": "p r", "prompts": "p", "labels": "5"}"#).unwrap();
        assert!(one.single);
        assert_eq!(query(&s[0]), ("p r", Some("p")));
        assert_eq!(s[0].label.as_deref(), Some("5"));
        assert_eq!(
            (s[0].at.to_string(), s[0].prompt_at.to_string()),
            ("query".into(), "prompts".into())
        );
        let (many, s) = read(
            br#"{"query": ["a", "b"], "prompts": ["x", "y"], "labels": [3, null], "datasources": ["m"]}"#,
        )
        .unwrap();
        assert!(!many.single);
        assert_eq!(query(&s[1]), ("b", Some("y")));
        assert_eq!(s[1].at.to_string(), "query[1]");
        assert_eq!(s[0].label.as_deref(), Some("3"));
        assert_eq!(s[1].label.as_deref(), Some(""));
        let (_, bare) = read(br#"{"query": ["a"]}"#).unwrap();
        assert_eq!(query(&bare[0]).1, None);
    }

    #[test]
    fn token_ids_one_sample_or_a_list() {
        let (one, s) =
            read(br#"{"prompt_ids": [1, 2], "completion_ids": [], "labels": "4"}"#).unwrap();
        assert_eq!(
            one,
            Openrlhf {
                single: true,
                ids: true
            }
        );
        assert_eq!(
            s[0].text,
            Text::Ids {
                prompt: vec![1, 2],
                completion: vec![]
            }
        );
        assert_eq!(s[0].at.to_string(), "completion_ids");
        let (many, s) =
            read(br#"{"prompt_ids": [[1], [2, 3]], "completion_ids": [[4], [5, 6]]}"#).unwrap();
        assert_eq!(
            many,
            Openrlhf {
                single: false,
                ids: true
            }
        );
        assert_eq!(
            s[1].text,
            Text::Ids {
                prompt: vec![2, 3],
                completion: vec![5, 6]
            }
        );
        assert_eq!(s[1].prompt_at.to_string(), "prompt_ids[1]");
    }

    #[test]
    fn bad_bodies_name_the_field() {
        assert_eq!(field(read(b"{")), "body");
        assert_eq!(field(read(b"[]")), "body");
        assert_eq!(field(read(br#"{"prompts": []}"#)), "query");
        assert_eq!(field(read(br#"{"query": []}"#)), "query");
        assert_eq!(field(read(br#"{"query": ["a", 3]}"#)), "query[1]");
        assert_eq!(
            field(read(br#"{"query": ["a", "b"], "prompts": ["x"]}"#)),
            "prompts"
        );
        assert_eq!(
            field(read(br#"{"query": ["a"], "prompts": [1]}"#)),
            "prompts[0]"
        );
    }

    #[test]
    fn bad_token_ids_name_the_field_and_index() {
        let cases: [(&[u8], &str); 9] = [
            (br#"{"query": "q", "completion_ids": [1]}"#, "query"),
            (
                br#"{"prompts": "p", "prompt_ids": [1], "completion_ids": [1]}"#,
                "prompts",
            ),
            (br#"{"completion_ids": [1]}"#, "prompt_ids"),
            (br#"{"prompt_ids": [1]}"#, "completion_ids"),
            (br#"{"prompt_ids": [], "completion_ids": []}"#, "prompt_ids"),
            (
                br#"{"prompt_ids": [1, -2], "completion_ids": [3]}"#,
                "prompt_ids[1]",
            ),
            (
                br#"{"prompt_ids": [[1], [2]], "completion_ids": [[3], [4, 1.5]]}"#,
                "completion_ids[1][1]",
            ),
            (
                br#"{"prompt_ids": [[1], [2]], "completion_ids": [[3]]}"#,
                "completion_ids",
            ),
            (
                br#"{"prompt_ids": [[1], 2], "completion_ids": [[3], [4]]}"#,
                "prompt_ids[1]",
            ),
        ];
        for (body, want) in cases {
            assert_eq!(field(read(body)), want, "{}", String::from_utf8_lossy(body));
        }
        let e = parse_samples(br#"{"prompt_ids": [1], "completion_ids": [2]}"#, false).unwrap_err();
        assert_eq!(e.field.as_deref(), Some("completion_ids"));
        assert!(
            e.message.contains("[reward] policy_tokenizer"),
            "{}",
            e.message
        );
    }

    #[test]
    fn scalars_for_one_sample() {
        let s = SampleReward {
            reward: 0.5,
            trace_score: 0.5,
            first_error_index: -1,
            step_count: 2,
            category: 1,
            status: SampleStatus::Ok,
            detail: None,
        };
        let one = render(std::slice::from_ref(&s), true);
        assert_eq!(one["rewards"], serde_json::json!(0.5));
        assert_eq!(one["extra_logs"]["step_count"], serde_json::json!(2));
        assert_eq!(one["extra_logs"]["timed_out"], serde_json::json!(0));
        assert_eq!(one["status"], serde_json::json!("ok"));
        let late = SampleReward {
            status: SampleStatus::TimedOut,
            detail: Some("deadline exceeded".into()),
            ..s.clone()
        };
        let many = render(&[s, late], false);
        assert_eq!(many["scores"], serde_json::json!([0.5, 0.5]));
        assert_eq!(
            many["extra_logs"]["first_error_index"],
            serde_json::json!([-1, -1])
        );
        assert_eq!(many["extra_logs"]["timed_out"], serde_json::json!([0, 1]));
    }
}
