use super::*;

fn params(reasoning: bool) -> ChatParams {
    let mut extra = Map::new();
    extra.insert("reasoning_effort".into(), json!("low"));
    ChatParams {
        model: "m".into(),
        temperature: Some(0.7),
        top_p: Some(0.9),
        max_tokens: 512,
        reasoning,
        extra,
    }
}

fn turns() -> Vec<ChatMessage> {
    vec![ChatMessage {
        role: "user",
        content: "judge this".into(),
    }]
}

#[test]
fn body_carries_sampling_parameters_and_extra_fields() {
    let body = request_body(&params(false), &turns(), 3);
    assert_eq!(
        body,
        json!({
            "model": "m",
            "messages": [{"role": "user", "content": "judge this"}],
            "stream": false,
            "max_tokens": 512,
            "temperature": 0.7f32,
            "top_p": 0.9f32,
            "n": 3,
            "reasoning_effort": "low",
        })
    );
}

#[test]
fn reasoning_models_get_max_completion_tokens_and_no_sampling_knobs() {
    let body = request_body(&params(true), &turns(), 1);
    let keys: Vec<&str> = body
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(
        keys,
        [
            "max_completion_tokens",
            "messages",
            "model",
            "reasoning_effort",
            "stream"
        ]
    );
}

#[test]
fn one_sample_sends_no_n() {
    assert!(request_body(&params(false), &turns(), 1).get("n").is_none());
}

#[test]
fn reads_llama_cpp_reply_with_its_extra_fields() {
    // Shape as llama.cpp's server sends it, `timings` and all.
    let body = br#"{"choices":[{"finish_reason":"stop","index":0,"message":{"role":"assistant","content":"\\boxed{1}"}}],
        "created":1,"model":"smollm2","system_fingerprint":"b1-0c1e570","object":"chat.completion",
        "usage":{"completion_tokens":7,"prompt_tokens":120,"total_tokens":127},"id":"chatcmpl-x",
        "timings":{"prompt_n":120,"predicted_n":7}}"#;
    let reply = read_reply(Some("application/json; charset=utf-8"), body).unwrap();
    assert_eq!(reply.choices.len(), 1);
    assert_eq!(reply.choices[0].content, "\\boxed{1}");
    assert_eq!(reply.choices[0].finish_reason.as_deref(), Some("stop"));
    assert_eq!((reply.prompt_tokens, reply.completion_tokens), (120, 7));
}

#[test]
fn choices_are_put_in_index_order_and_reasoning_is_kept() {
    let body = br#"{"choices":[
        {"index":1,"message":{"content":"b","reasoning":"r1"}},
        {"index":0,"message":{"content":null,"reasoning_content":"r0"}}]}"#;
    let reply = read_reply(None, body).unwrap();
    let contents: Vec<&str> = reply.choices.iter().map(|c| c.content.as_str()).collect();
    assert_eq!(contents, ["", "b"]);
    assert_eq!(reply.choices[0].reasoning.as_deref(), Some("r0"));
    assert_eq!(reply.choices[1].reasoning.as_deref(), Some("r1"));
    assert_eq!((reply.prompt_tokens, reply.completion_tokens), (0, 0));
}

#[test]
fn malformed_bodies_are_bad_responses() {
    let cases: &[(Option<&str>, &[u8], &str)] = &[
        (
            Some("text/event-stream"),
            b"data: {\"choices\":[]}\n\n",
            "event stream",
        ),
        (None, br#"{"choices":[{"index":0,"message":{"con"#, "EOF"),
        (None, b"<html>502 Bad Gateway</html>", "<html>"),
        (None, br#"{"choices":[]}"#, "no choices"),
        (None, br#"{"object":"list"}"#, "missing field `choices`"),
        (None, b"", "EOF"),
    ];
    for (content_type, body, needle) in cases {
        match read_reply(*content_type, body) {
            Err(AttemptError::BadResponse(m)) => {
                assert!(m.contains(needle), "{m:?} should mention {needle:?}")
            }
            other => panic!("{body:?}: expected BadResponse, got {other:?}"),
        }
    }
}
