//! The embedded default served from SmolLM2's Q4_1 GGUF as it is: its tokenizer rebuilt from the
//! file formats exactly as the converted folder's, and its step scores against llama.cpp's own
//! llama-server on the same file, scored the way users score a PRM behind it.

use crate::common;

use common::llama::{llama_server, smollm2_gguf};
use common::*;
use retrace::Trace;
use retrace::pb;
use retrace::{CHAT_LM_INSTRUCTION, Family, Formatter};
use serde::Deserialize;
use serde_json::{Value, json};
use tonic::transport::Channel;

#[derive(Deserialize)]
struct Bench {
    id: String,
    problem: String,
    steps: Vec<String>,
}

fn traces(split: &str) -> Vec<Bench> {
    serde_json::from_str(&std::fs::read_to_string(processbench(split)).unwrap()).unwrap()
}

#[test]
fn the_tokenizer_rebuilt_from_the_gguf_formats_like_the_converted_folder() {
    // The folder's tokenizer.json was rebuilt by scripts/fetch/gguf_to_hf.py and checked against
    // llama.cpp's /tokenize; this one is rebuilt in Rust from the same vocabulary and merges,
    // and the chat template and special tokens come from the GGUF's metadata.
    let folder = retrace::Env::process().cache_dir().join("smollm2");
    assert!(
        folder.join("tokenizer.json").is_file(),
        "{} is missing: run scripts/fetch-smollm2.sh --f32",
        folder.display()
    );
    let from_gguf = Formatter::load(Family::ChatLm, &smollm2_gguf()).unwrap();
    let from_folder = Formatter::load(Family::ChatLm, &folder).unwrap();
    let mut n = 0;
    // Every trace of the committed subset (32 a split, chosen to carry nearly every character
    // of the full split; tests/fixtures/processbench/README.md).
    for split in ["gsm8k", "math", "olympiadbench"] {
        for b in traces(split).iter() {
            let trace = Trace::of_steps(&b.problem, &b.steps);
            let (a, want) = (from_gguf.encode(&trace), from_folder.encode(&trace));
            assert_eq!(a, want, "{}", b.id);
            n += 1;
        }
    }
    assert_eq!(n, 96);
}

/// P('+') against P('-') for each step, from llama-server's chat completions: the conversation
/// up to the step (every earlier assistant turn "+"), one token, its top logprobs; `None` where
/// '+' or '-' is not among them.
async fn llama_scores(port: u16, b: &Bench) -> Vec<Option<f64>> {
    let http = reqwest::Client::new();
    let mut messages = vec![json!({"role": "system", "content": CHAT_LM_INSTRUCTION})];
    let mut scores = Vec::new();
    for (k, step) in b.steps.iter().enumerate() {
        let content = match k {
            0 => format!("Question: {}\n\nStep: {step}", b.problem),
            _ => format!("Step: {step}"),
        };
        messages.push(json!({"role": "user", "content": content}));
        let body = json!({"messages": messages, "max_tokens": 1, "temperature": 0.0,
                          "logprobs": true, "top_logprobs": 200});
        let reply: Value = http
            .post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let top = reply
            .pointer("/choices/0/logprobs/content/0/top_logprobs")
            .and_then(Value::as_array)
            .expect("top_logprobs");
        let logprob = |t: &str| {
            top.iter()
                .find(|x| x["token"] == t)
                .and_then(|x| x["logprob"].as_f64())
        };
        let score = match (logprob("+"), logprob("-")) {
            (Some(plus), Some(minus)) => Some(1.0 / (1.0 + (minus - plus).exp())),
            _ => None,
        };
        scores.push(score);
        messages.push(json!({"role": "assistant", "content": "+"}));
    }
    scores
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gguf_default_scores_as_llama_server_does_on_the_same_file() {
    let (server, channel, _) = spawn_retrace(&[], &[]).await;
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel);
    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    let chat = list.evaluators.iter().find(|e| e.name == "smollm2");
    assert!(
        chat.is_some_and(|e| e.model.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf")),
        "{:?}",
        list.evaluators
    );
    let (_llama, port) = llama_server(&["-c", "4096", "-np", "1", "-t", "2", "--jinja"]).await;
    let sample: Vec<Bench> = traces("gsm8k").into_iter().take(10).collect();
    let (mut diffs, mut same_first, mut compared, mut misses) = (Vec::new(), 0, 0, 0);
    for b in &sample {
        let steps: Vec<&str> = b.steps.iter().map(String::as_str).collect();
        let r = c
            .evaluate(request(&b.id, "smollm2", steps_trace(&b.problem, &steps)))
            .await
            .unwrap()
            .into_inner();
        let ours: Vec<f64> = r.steps.iter().map(|s| f64::from(s.score)).collect();
        let theirs = llama_scores(port, b).await;
        assert_eq!(ours.len(), theirs.len(), "{}", b.id);
        diffs.extend(
            ours.iter()
                .zip(&theirs)
                .filter_map(|(a, b)| b.map(|b| (a - b).abs())),
        );
        misses += theirs.iter().filter(|s| s.is_none()).count();
        // A trace with a step llama-server could not score has no first error to compare.
        if let Some(theirs) = theirs.into_iter().collect::<Option<Vec<f64>>>() {
            let first = |v: &[f64]| v.iter().position(|s| *s < 0.5);
            same_first += usize::from(first(&ours) == first(&theirs));
            compared += 1;
        }
    }
    diffs.sort_by(f64::total_cmp);
    let q = |p: f64| diffs[((diffs.len() - 1) as f64 * p).round() as usize];
    let close = diffs.iter().filter(|d| **d <= 5e-3).count();
    eprintln!(
        "| GGUF Q4_1, retrace against llama-server (defaults), {} traces, {} steps | |\n|---|---:|\n\
         | |score difference| median / p90 / max | {:.1e} / {:.1e} / {:.1e} |\n\
         | steps within 5e-3 | {close} |\n| first error (score < 0.5) agrees | {same_first} of {compared} |\n\
         | steps without '+' or '-' in llama-server's top 200 (left out) | {misses} |",
        sample.len(),
        diffs.len(),
        q(0.5),
        q(0.9),
        q(1.0),
    );
    // llama.cpp keeps its KV cache in f16 and rounds attention there; retrace keeps f32. The
    // median step agrees to 5e-3; first errors on nearly every trace.
    assert!(q(0.5) <= 5e-3, "median difference {}", q(0.5));
    assert!(
        compared >= sample.len() / 2,
        "only {compared} traces fully scored"
    );
    assert!(
        same_first + 1 >= compared,
        "first errors agree on {same_first} of {compared}"
    );
    drop(server);
}

#[derive(Deserialize)]
struct Known {
    threshold: f32,
    traces: Vec<KnownTrace>,
}

#[derive(Deserialize)]
struct KnownTrace {
    id: String,
    question: String,
    steps: Vec<String>,
    /// What training computed.
    step_scores: Vec<f64>,
    first_error: i32,
    /// What the served default gave at the baseline kernels
    /// (scripts/fixtures/default_head_served.py).
    served_scores: Vec<f64>,
}

/// How far a served score on the Q4_1 base may sit from training's (see `ask`).
const GGUF_ROUNDING: f64 = 0.2;
/// How far the served default may sit from its own recorded scores at the same kernels: the
/// only arithmetic that may differ between CPUs there is the f32 head's GEMM, after every
/// quantized rounding, which moves a score by a few ulps.
const SAME_KERNELS: f64 = 1e-4;

fn known() -> Known {
    let path = format!("{}/tests/fixtures/default-head/known.json", common::REPO);
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// What a server's default evaluator gave on the known traces, against known.json.
#[derive(Debug)]
struct Against {
    /// The largest distance from the recorded served scores, and from training's.
    served: f64,
    training: f64,
    /// Traces whose first error differs from training's, a score within rounding of the
    /// threshold aside (it may fall either side on another CPU).
    other_first_errors: usize,
    flagged: usize,
}

async fn ask(channel: Channel, known: &Known) -> Against {
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel);
    let mut a = Against {
        served: 0.0,
        training: 0.0,
        other_first_errors: 0,
        flagged: 0,
    };
    for k in &known.traces {
        let steps: Vec<&str> = k.steps.iter().map(String::as_str).collect();
        let r = c
            .evaluate(request(&k.id, "", steps_trace(&k.question, &steps)))
            .await
            .unwrap()
            .into_inner();
        let got: Vec<f64> = r.steps.iter().map(|s| f64::from(s.score)).collect();
        assert_eq!(got.len(), k.step_scores.len(), "{}", k.id);
        a.served = a.served.max(max_gap(&got, &k.served_scores));
        a.training = a.training.max(max_gap(&got, &k.step_scores));
        let near = k
            .step_scores
            .iter()
            .any(|s| (s - f64::from(known.threshold)).abs() < 1e-4);
        a.other_first_errors += usize::from(!near && r.first_error_index != k.first_error);
        a.flagged += usize::from(k.first_error >= 0);
    }
    a
}

/// The baseline kernels, which every x86-64 CPU runs: the recorded served scores are theirs.
const BASELINE: [(&str, &str); 1] = [("RETRACE_SIMD", "base")];

/// A fresh clone's default evaluator is the trained head: on held-out traces it gives the
/// verdicts training computed for them (tests/fixtures/default-head, written by
/// scripts/bench/default-head.sh with the head), and at the baseline kernels the very scores it
/// gave when they were recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_is_the_trained_head_and_gives_the_verdicts_training_computed() {
    let known = known();
    let (server, channel, _) = spawn_retrace(&[], &BASELINE).await;
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel.clone());
    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    let default = list.evaluators.iter().find(|e| e.is_default).unwrap();
    assert_eq!(
        (default.name.as_str(), default.family.as_str()),
        ("smollm2-head", "head")
    );
    let a = ask(channel, &known).await;
    drop(server);
    eprintln!("the default at the baseline kernels: {a:?}");
    assert!(
        a.served < SAME_KERNELS,
        "against the recorded scores: {a:?}"
    );
    assert_eq!(a.other_first_errors, 0, "{a:?}");
    // The base is a Q4_1 GGUF: before each quantized matmul the activations are rounded to
    // 8 bits a block, so a change of summation order anywhere upstream (training's extraction,
    // another vector width) moves some of them by a whole quantization step, and the head's
    // scores with them: 0.08 to 0.13 measured against training's, with every first error
    // matched. A wrong layer, format or reference moves scores further and flips first errors.
    assert!(a.training < GGUF_ROUNDING, "against training's: {a:?}");
    assert!(a.flagged > 0 && a.flagged < known.traces.len(), "{a:?}");
}

/// The check above fails a head that reads the wrong layer: the committed head, served over
/// the same base reading layer 14 instead of 15.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_on_the_wrong_layer_fails_the_default_heads_check() {
    let dir = TempDir::new("wrong-layer");
    let head = dir.0.join("head");
    std::fs::create_dir_all(&head).unwrap();
    let committed = std::path::Path::new(common::REPO).join("heads/smollm2");
    std::fs::copy(
        committed.join("head.safetensors"),
        head.join("head.safetensors"),
    )
    .unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(committed.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["layers"], json!([15]));
    config["layers"] = json!([14]);
    config["base"] = json!(smollm2_gguf().display().to_string());
    std::fs::write(head.join("config.json"), config.to_string()).unwrap();
    let toml = dir.0.join("wrong.toml");
    let table = format!(
        "[[evaluator]]\nname = \"wrong-layer\"\nkind = \"prm\"\nfamily = \"head\"\nmodel = {:?}\n",
        head.display().to_string()
    );
    std::fs::write(&toml, table).unwrap();
    let (server, channel, _) =
        spawn_retrace(&["--config".as_ref(), toml.as_ref()], &BASELINE).await;
    let a = ask(channel, &known()).await;
    drop(server);
    eprintln!("layer 14 for 15: {a:?}");
    assert!(
        a.served > 100.0 * SAME_KERNELS && a.training > GGUF_ROUNDING,
        "the wrong layer passed: {a:?}"
    );
}
