use super::*;

/// Five tokens, steps read at positions 1 and 4 (the tags).
fn encoded() -> Encoded {
    Encoded {
        ids: vec![10, 7, 11, 12, 7],
        positions: vec![1, 4],
        spans: Ok(Vec::new()),
    }
}

fn raw(body: Value) -> Raw {
    Raw {
        content_type: Some("application/json".into()),
        body: body.to_string().into_bytes(),
    }
}

fn pooling(data: Value) -> Raw {
    raw(json!({
        "id": "pool-1", "object": "list", "created": 1, "model": "prm",
        "data": [{"index": 0, "object": "pooling", "data": data}],
        "usage": {"prompt_tokens": 5, "total_tokens": 5, "completion_tokens": 0}
    }))
}

const LOGPROBS: Route = Route::Logprobs {
    plus: 3,
    minus: 4,
    top: 5,
};

fn entry(pairs: &[(u32, f64)]) -> Value {
    let map: Map<String, Value> = pairs
        .iter()
        .map(|(id, lp)| {
            (
                id.to_string(),
                json!({"logprob": lp, "rank": 1, "decoded_token": "x"}),
            )
        })
        .collect();
    Value::Object(map)
}

fn completion(prompt_logprobs: Value) -> Raw {
    raw(json!({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "prm",
        "choices": [{"index": 0, "text": "+", "logprobs": null, "finish_reason": "length",
                     "prompt_logprobs": prompt_logprobs}],
        "usage": {"prompt_tokens": 6, "total_tokens": 7, "completion_tokens": 1}
    }))
}

fn bad_message(r: Result<Scores, AttemptError>) -> String {
    match r {
        Err(AttemptError::BadResponse(m)) => m,
        other => panic!("expected a bad response, got {other:?}"),
    }
}

#[test]
fn pooling_sends_ids_for_token_classification() {
    let body = request_body(Route::Pooling, Some("prm"), &[1, 2, 3]);
    assert_eq!(
        body,
        json!({"model": "prm", "input": [1, 2, 3], "task": "token_classify", "use_activation": true})
    );
    let body = request_body(Route::Pooling, None, &[1]);
    assert!(body.get("model").is_none(), "{body}");
}

#[test]
fn logprobs_appends_a_token_so_the_last_position_is_read() {
    let body = request_body(LOGPROBS, None, &[1, 2]);
    assert_eq!(
        body,
        json!({"prompt": [1, 2, 3], "prompt_logprobs": 5, "max_tokens": 1, "temperature": 0})
    );
}

#[test]
fn step_pooling_rows_map_one_to_one_and_all_pooling_is_read_at_positions() {
    let step = pooling(json!([[0.25, 0.75], [0.9, 0.1]]));
    let got = read_scores(Route::Pooling, &encoded(), &step).unwrap();
    assert_eq!(got.scores, vec![0.75, 0.1]);
    let all = pooling(json!([
        [0.5, 0.5],
        [0.2, 0.8],
        [0.5, 0.5],
        [0.5, 0.5],
        [0.6, 0.4]
    ]));
    let got = read_scores(Route::Pooling, &encoded(), &all).unwrap();
    assert_eq!(got.scores, vec![0.8, 0.4]);
}

#[test]
fn pooling_replies_that_cannot_be_steps_are_refused_with_the_reason() {
    let cases = [
        (
            pooling(json!([[0.5, 0.5]])),
            "1 rows for 2 steps and 5 tokens",
        ),
        (pooling(json!([0.1, 0.2])), "not a list of rows"),
        (
            pooling(json!([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])),
            "3 values, not 2",
        ),
        (
            pooling(json!([[2.5, -1.0], [0.5, 0.5]])),
            "not two probabilities",
        ),
        (pooling(json!([[0.3, 0.3], [0.5, 0.5]])), "summing to 1"),
        (raw(json!({"data": []})), "0 items"),
        (raw(json!({"object": "list"})), "missing field `data`"),
    ];
    for (reply, needle) in cases {
        let m = bad_message(read_scores(Route::Pooling, &encoded(), &reply));
        assert!(m.contains(needle), "{m:?} should say {needle:?}");
        assert!(m.starts_with("a vLLM pooling response"), "{m}");
    }
}

#[test]
fn logprobs_give_the_pair_softmax_at_each_steps_position() {
    let (p1, p2) = (0.9f64, 0.2f64);
    // Entries are for prompt tokens 0..=5; step positions 1 and 4 are read at entries 2 and 5.
    let reply = completion(json!([
        null,
        entry(&[(7, -0.1)]),
        entry(&[(3, p1.ln()), (4, (1.0 - p1).ln()), (9, -9.0)]),
        entry(&[(12, -0.3)]),
        entry(&[(7, -0.2)]),
        entry(&[(4, (1.0 - p2).ln()), (3, p2.ln())]),
    ]));
    let got = read_scores(LOGPROBS, &encoded(), &reply).unwrap();
    assert_eq!(got.inexact, 0);
    assert!((got.scores[0] as f64 - p1).abs() < 1e-6, "{got:?}");
    assert!((got.scores[1] as f64 - p2).abs() < 1e-6, "{got:?}");
}

#[test]
fn a_token_outside_the_top_k_is_bounded_by_the_smallest_listed_and_counted() {
    let reply = completion(json!([
        null,
        entry(&[(7, -0.1)]),
        entry(&[(3, -0.01), (9, -5.0)]),
        entry(&[(12, -0.3)]),
        entry(&[(7, -0.2)]),
        entry(&[(3, -0.7), (4, -0.7)]),
    ]));
    let got = read_scores(LOGPROBS, &encoded(), &reply).unwrap();
    assert_eq!(got.inexact, 1);
    let bound = 1.0 / (1.0 + (-5.0f64 + 0.01).exp());
    assert!((got.scores[0] as f64 - bound).abs() < 1e-6, "{got:?}");
    assert!((got.scores[1] - 0.5).abs() < 1e-6, "{got:?}");
}

#[test]
fn a_null_log_probability_is_minus_infinity() {
    // The first step's + is 0 and its - null; the second step's pair is `last`.
    let reply = |last: serde_json::Value| {
        completion(json!([
            null,
            entry(&[(7, -0.1)]),
            {"3": {"logprob": 0.0, "rank": 1}, "4": {"logprob": null, "rank": 2}},
            entry(&[(12, -0.3)]),
            entry(&[(7, -0.2)]),
            last,
        ]))
    };
    let both_null = reply(json!({"3": {"logprob": null}, "4": {"logprob": null}}));
    let m = bad_message(read_scores(LOGPROBS, &encoded(), &both_null));
    assert!(
        m.contains("step 1: + and - both have log-probability -inf"),
        "{m}"
    );
    let got = read_scores(LOGPROBS, &encoded(), &reply(entry(&[(3, -0.7), (4, -0.7)]))).unwrap();
    assert_eq!((got.scores[0], got.inexact), (1.0, 0));
}

#[test]
fn completions_without_usable_prompt_logprobs_are_refused() {
    let six_nulls = json!([null, null, null, null, null, null]);
    let cases = [
        (completion(Value::Null), "no prompt_logprobs"),
        (
            completion(json!([null, {}])),
            "2 prompt_logprobs entries for 6",
        ),
        (completion(six_nulls), "position 2 has no log-probabilities"),
        (raw(json!({"choices": []})), "no choices"),
        (
            raw(json!({"error": "x"})),
            "a vLLM completion with prompt_logprobs: missing field `choices`",
        ),
    ];
    for (reply, needle) in cases {
        let m = bad_message(read_scores(LOGPROBS, &encoded(), &reply));
        assert!(m.contains(needle), "{m:?} should say {needle:?}");
    }
}
