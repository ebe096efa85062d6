//! Unit tests for config parsing, overrides and validation.
use super::*;
use crate::prm::format::{Family, PrmKind};
use crate::prm::{Backend, DeviceSpec, Dtype};

const EXAMPLE: &str = r#"
[server]
grpc_addr = "0.0.0.0:50051"
metrics_addr = "0.0.0.0:9091"
default_evaluator = "qwen-prm"
max_in_flight = 512
shutdown_grace_s = 30

[[evaluator]]
name = "qwen-prm"
kind = "prm"                # prm | judge | cascade
family = "qwen2-math-prm"
model = "/models/Qwen2.5-Math-PRM-7B"
device = "cpu"
threshold = 0.5
"#;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, "test.toml", &[])
}

#[test]
fn example_parses() {
    let c = parse(EXAMPLE).unwrap();
    assert_eq!(c.server.max_in_flight, 512);
    assert_eq!(c.default_evaluator(), "qwen-prm");
    let KindConfig::Prm(p) = &c.evaluators[0].kind else {
        panic!("a prm table")
    };
    assert_eq!(p.family, Family::QwenMathPrm.into());
    assert_eq!(p.device(), DeviceSpec::Cpu);
    assert_eq!(p.max_batch_tokens(), crate::prm::defaults::MAX_BATCH_TOKENS);
    assert_eq!(c.evaluators[0].threshold, Some(0.5));
}

#[test]
fn unknown_key_names_key_and_file() {
    let err = parse(&EXAMPLE.replace("device =", "devise =")).unwrap_err();
    assert_eq!(err.source_name, "test.toml");
    assert!(err.message.contains("devise"), "{err}");
    assert!(err.to_string().starts_with("config test.toml:"), "{err}");
}

#[test]
fn bad_values_are_named() {
    let err = parse(&EXAMPLE.replace("threshold = 0.5", "threshold = 1.5")).unwrap_err();
    assert!(err.message.contains("threshold"), "{err}");
    let err =
        parse(&EXAMPLE.replace("family = \"qwen2-math-prm\"", "family = \"bert\"")).unwrap_err();
    assert!(err.message.contains("family \"bert\""), "{err}");
    let err = parse(&EXAMPLE.replace("max_in_flight = 512", "max_in_flight = -1")).unwrap_err();
    assert!(err.message.contains("max_in_flight"), "{err}");
    let err = parse(&EXAMPLE.replace(
        "default_evaluator = \"qwen-prm\"",
        "default_evaluator = \"x\"",
    ))
    .unwrap_err();
    assert!(err.message.contains("default_evaluator"), "{err}");
}

#[test]
fn a_rule_error_names_its_tables_line_as_a_parse_error_does() {
    // EXAMPLE's [[evaluator]] header is on line 9; the judge's, appended, on line 17.
    let err = parse(&EXAMPLE.replace("threshold = 0.5", "threshold = 1.5")).unwrap_err();
    assert!(
        err.message
            .starts_with("evaluator[0] (\"qwen-prm\") (line 9): threshold must lie in [0, 1]"),
        "{err}"
    );
    let bad_judge = JUDGE.replace("https://api.example.com/v1", "ftp://x");
    let err = parse(&format!("{EXAMPLE}{bad_judge}")).unwrap_err();
    assert!(
        err.message
            .starts_with("evaluator[1] (\"gpt-4o\") (line 17): base_url"),
        "{err}"
    );
    // The parse error of a table names the same line.
    let err = parse(&EXAMPLE.replace("device =", "devise =")).unwrap_err();
    assert!(err.message.contains("(line "), "{err}");
}

const JUDGE: &str = "\n[[evaluator]]\nname = \"gpt-4o\"\nkind = \"judge\"\nbase_url = \"https://api.example.com/v1\"\nmodel = \"gpt-4o\"\napi_key_env = \"OPENAI_API_KEY\"\n";
const CASCADE: &str = "\n[[evaluator]]\nname = \"both\"\nkind = \"cascade\"\nprm = \"qwen-prm\"\njudge = \"gpt-4o\"\n";

#[test]
fn judge_and_cascade_tables_validate() {
    let config = parse(&format!("{EXAMPLE}{JUDGE}{CASCADE}")).expect("valid");
    assert_eq!(config.evaluators.len(), 3);
}

#[test]
fn bad_judge_and_cascade_values_are_named() {
    let cases: &[(&str, &str, &str)] = &[
        (
            JUDGE,
            "base_url = \"https://api.example.com/v1\"",
            "base_url = \"api.example.com\"",
        ),
        (
            JUDGE,
            "base_url = \"https://api.example.com/v1\"",
            "base_url = \"ftp://x/v1\"",
        ),
        (JUDGE, "model = \"gpt-4o\"", "model = \" \""),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\ntemperature = 3.0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\ntop_p = 0.0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nsamples = 65",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nsamples = 5\ntemperature = 0.0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nreasoning = true\ntemperature = 1.0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\ntimeout_s = 0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nretries = 11",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nrequests_per_minute = 0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nbreaker_failures = 0",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nextra_body = { n = 4 }",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nrepair_prompt = \"\"",
        ),
        (
            JUDGE,
            "model = \"gpt-4o\"",
            "model = \"gpt-4o\"\nfamily = \"chat-lm\"",
        ),
        (CASCADE, "prm = \"qwen-prm\"", "prm = \"nope\""),
        (CASCADE, "prm = \"qwen-prm\"", "prm = \"gpt-4o\""),
        (CASCADE, "judge = \"gpt-4o\"", "judge = \"qwen-prm\""),
        (
            CASCADE,
            "judge = \"gpt-4o\"",
            "judge = \"gpt-4o\"\nescalate_margin = 2.0",
        ),
    ];
    let wants = [
        "base_url",
        "base_url",
        "model",
        "temperature",
        "top_p",
        "samples",
        "samples > 1",
        "reasoning = true",
        "timeout_s",
        "retries",
        "requests_per_minute",
        "breaker_failures",
        "`n`",
        "repair_prompt",
        "unknown field `family`",
        "prm \"nope\" names no",
        "is a judge evaluator, not a prm",
        "is a prm evaluator, not a judge",
        "escalate_margin",
    ];
    for ((table, from, to), want) in cases.iter().zip(wants) {
        let bad = table.replace(from, to);
        let err = parse(&format!("{EXAMPLE}{JUDGE}{CASCADE}").replace(table, &bad)).unwrap_err();
        assert!(err.message.contains(want), "{to}: {err}");
        let name = if *table == JUDGE { "gpt-4o" } else { "both" };
        assert!(
            err.message.contains(name),
            "{to}: {err} should name the evaluator"
        );
    }
}

#[test]
fn key_of_another_kind_is_refused() {
    let text = EXAMPLE.replace("device = \"cpu\"", "temperature = 0.5");
    let err = parse(&text).unwrap_err();
    assert!(err.message.contains("unknown field `temperature`"), "{err}");
}

/// A judge's table flattens its upstream's keys in, which cost serde's list of expected keys:
/// the error lists every key the kind takes, the upstream's and the common ones included.
#[test]
fn an_unknown_key_of_a_judge_lists_the_keys_a_judge_takes() {
    let text = format!("{EXAMPLE}{JUDGE}family = \"chat-lm\"\n");
    let err = parse(&text).unwrap_err();
    for key in [
        "unknown field `family`",
        "`base_url`",
        "`model`",
        "`samples`",
        "`max_concurrency`",
    ] {
        assert!(err.message.contains(key), "{key}: {err}");
    }
    let prm = EXAMPLE.replace("device = \"cpu\"", "devise = \"cpu\"");
    let err = parse(&prm).unwrap_err();
    assert!(err.message.contains("`device`, `dtype`"), "{err}");
}

#[test]
fn duplicate_names_and_missing_keys() {
    let twice = format!(
        "{EXAMPLE}\n[[evaluator]]\nname = \"qwen-prm\"\nkind = \"prm\"\nfamily = \"chat-lm\"\nmodel = \"m\"\n"
    );
    assert!(parse(&twice).unwrap_err().message.contains("used twice"));
    let no_model = EXAMPLE.replace("model = \"/models/Qwen2.5-Math-PRM-7B\"", "");
    assert!(
        parse(&no_model)
            .unwrap_err()
            .message
            .contains("missing field `model`")
    );
    assert!(
        parse("[server]\n")
            .unwrap_err()
            .message
            .contains("no [[evaluator]]")
    );
}

#[test]
fn overrides_apply_and_validate() {
    let over = vec![
        "server.max_in_flight=7".to_string(),
        "evaluator.qwen-prm.threshold=0.25".to_string(),
        "evaluator.qwen-prm.device=cuda:1".to_string(),
    ];
    let c = Config::parse(EXAMPLE, "t", &over).unwrap();
    assert_eq!(c.server.max_in_flight, 7);
    assert_eq!(c.evaluators[0].threshold, Some(0.25));
    let KindConfig::Prm(p) = &c.evaluators[0].kind else {
        panic!("a prm table")
    };
    assert_eq!(p.device(), DeviceSpec::Cuda(1));
    assert_eq!(
        p.max_batch_tokens(),
        crate::prm::defaults::MAX_BATCH_TOKENS_CUDA
    );
    // A key in an evaluator's own table: the vLLM server of a PRM moved to vLLM by flags alone.
    let vllm = vec![
        "evaluator.qwen-prm.backend=vllm".to_string(),
        "evaluator.qwen-prm.vllm.base_url=http://gpu-0:8000".to_string(),
    ];
    let err = Config::parse(EXAMPLE, "t", &vllm).unwrap_err();
    assert!(
        err.message
            .contains("device applies only to backend = \"candle\""),
        "{err}"
    );
    let c = Config::parse(&EXAMPLE.replace("device = \"cpu\"\n", ""), "t", &vllm).unwrap();
    let KindConfig::Prm(p) = &c.evaluators[0].kind else {
        panic!("a prm table")
    };
    assert_eq!(
        p.vllm.as_ref().unwrap().endpoint.base_url,
        "http://gpu-0:8000"
    );
    let err = Config::parse(EXAMPLE, "t", &["evaluator.nope.threshold=1".into()]).unwrap_err();
    assert!(
        err.message.contains("no evaluator is named \"nope\""),
        "{err}"
    );
    let err = Config::parse(EXAMPLE, "t", &["server.max_in_flight=many".into()]).unwrap_err();
    assert!(err.message.contains("max_in_flight"), "{err}");
}

#[test]
fn a_set_value_that_is_not_toml_is_a_string_only_for_a_key_that_takes_one() {
    for (set, want) in [
        (
            "server.max_in_flight=abc",
            "--set server.max_in_flight=abc: expected an integer (usize), and `abc` is not one",
        ),
        (
            "server.shutdown_grace_s=3s",
            "--set server.shutdown_grace_s=3s: expected a number (f64), and `3s` is not one",
        ),
        (
            "evaluator.qwen-prm.threshold=high",
            "--set evaluator.qwen-prm.threshold=high: expected a number (f32), and `high` is not one",
        ),
        (
            "server.auth_tokens=[a,b]",
            "--set server.auth_tokens=[a,b]: expected an array ([...]), and `[a,b]` is not one",
        ),
    ] {
        let err = Config::parse(EXAMPLE, "t", &[set.to_string()]).unwrap_err();
        assert!(err.message.contains(want), "{set}: {err}");
    }
    // A key that takes a string still takes the bare text, as `--set` has always allowed.
    let sets = ["evaluator.qwen-prm.model=some/path".to_string()];
    let c = Config::parse(EXAMPLE, "t", &sets).unwrap();
    let KindConfig::Prm(p) = &c.evaluators[0].kind else {
        panic!("a prm table")
    };
    assert_eq!(p.model, "some/path");
}

#[test]
fn limits_that_would_panic_later_are_refused_now() {
    for (from, to, key) in [
        (
            "shutdown_grace_s = 30",
            "shutdown_grace_s = 1e20",
            "shutdown_grace_s",
        ),
        (
            "max_in_flight = 512",
            "max_in_flight = 100000000000",
            "max_in_flight",
        ),
        (
            "shutdown_grace_s = 30",
            "shutdown_grace_s = 30\nauth_tokens = [\" \"]",
            "auth_tokens",
        ),
        (
            "threshold = 0.5",
            "threshold = 0.5\nmax_concurrency = 0",
            "max_concurrency",
        ),
    ] {
        let err = parse(&EXAMPLE.replace(from, to)).unwrap_err();
        assert!(err.message.contains(key), "{key}: {err}");
    }
}

#[test]
fn connection_lifetimes_are_positive_seconds_up_to_an_hour() {
    let c = parse(EXAMPLE).unwrap();
    let s = &c.server;
    assert_eq!(
        (s.max_connection_age_s, s.max_connection_age_grace_s),
        (300.0, 60.0)
    );
    assert_eq!(
        (s.http2_keepalive_interval_s, s.http2_keepalive_timeout_s),
        (60.0, 20.0)
    );
    for key in [
        "max_connection_age_s",
        "max_connection_age_grace_s",
        "http2_keepalive_interval_s",
        "http2_keepalive_timeout_s",
    ] {
        for ok in ["0.5", "3600"] {
            let set = format!("server.{key}={ok}");
            assert!(Config::parse(EXAMPLE, "t", &[set]).is_ok(), "{key} = {ok}");
        }
        for bad in ["0", "-1", "nan", "inf", "3600.5"] {
            let err = Config::parse(EXAMPLE, "t", &[format!("server.{key}={bad}")]).unwrap_err();
            assert!(
                err.message
                    .contains(&format!("server.{key} must lie in (0, 3600] seconds")),
                "{key} = {bad}: {err}"
            );
        }
    }
}

#[test]
fn secrets_are_redacted() {
    let text = EXAMPLE.replace(
        "shutdown_grace_s = 30",
        "shutdown_grace_s = 30\nauth_tokens = [\"hunter2\"]",
    );
    let c = parse(&text).unwrap();
    assert!(!format!("{c:?}").contains("hunter2"));
    assert!(!c.redacted_toml().contains("hunter2"));
    assert_eq!(c.auth_tokens().unwrap()[0].0, "hunter2");
}

#[test]
fn device_and_dtype_are_parsed_when_the_config_is_read() {
    for (to, want) in [
        (
            "device = \"gpu\"",
            "device \"gpu\" is not \"cpu\", \"cuda\" or \"cuda:N\"",
        ),
        ("device = \"cuda:x\"", "cuda:x"),
        ("device = \"cpu\"\ndtype = \"f64\"", "unknown variant `f64`"),
    ] {
        let err = parse(&EXAMPLE.replace("device = \"cpu\"", to)).unwrap_err();
        assert!(err.message.contains(want), "{to}: {err}");
        assert!(
            err.message.contains("evaluator[0] (\"qwen-prm\")"),
            "{to}: {err}"
        );
    }
    let c = parse(&EXAMPLE.replace("device = \"cpu\"", "device = \"cuda\"")).unwrap();
    let KindConfig::Prm(p) = &c.evaluators[0].kind else {
        panic!("a prm table")
    };
    assert_eq!((p.device(), p.dtype()), (DeviceSpec::Cuda(0), Dtype::Bf16));
}

#[test]
fn an_unknown_kind_or_a_typo_names_the_key_and_the_line() {
    let err = parse(&EXAMPLE.replace("kind = \"prm\"", "kind = \"reranker\"")).unwrap_err();
    assert!(err.message.contains("unknown variant `reranker`"), "{err}");
    let err = parse(&EXAMPLE.replace("device =", "devise =")).unwrap_err();
    // The table starts on line 9 of EXAMPLE.
    assert!(
        err.message
            .starts_with("evaluator[0] (\"qwen-prm\") (line 9): unknown field `devise`"),
        "{err}"
    );
    let err =
        Config::parse(EXAMPLE, "t", &["evaluator.qwen-prm.temperature=0.5".into()]).unwrap_err();
    assert!(
        err.message
            .contains("after --set overrides: evaluator[0] (\"qwen-prm\")")
            && err.message.contains("unknown field `temperature`"),
        "{err}"
    );
}

#[test]
fn flags_are_typed_overrides_laid_over_the_file_and_set() {
    let flags = ServerFlags {
        max_in_flight: Some(9),
        grpc_addr: Some("127.0.0.1:7000".parse().unwrap()),
        ..ServerFlags::default()
    };
    let sets = ["server.max_in_flight=7".to_string()];
    let c = Config::parse_with(EXAMPLE, "t", &sets, &flags).unwrap();
    assert_eq!(c.server.max_in_flight, 9);
    assert_eq!(c.server.grpc_addr.port(), 7000);
    assert_eq!(
        c.server.shutdown_grace_s, 30.0,
        "what no flag names is the file's"
    );
    // Flags are validated like the file.
    let zero = ServerFlags {
        max_in_flight: Some(0),
        ..ServerFlags::default()
    };
    let err = Config::parse_with(EXAMPLE, "t", &[], &zero).unwrap_err();
    assert!(err.message.contains("server.max_in_flight"), "{err}");
}

#[test]
fn the_embedded_default_serves_smollm2_from_the_cache_folder() {
    let flags = ServerFlags {
        cache_dir: Some("/models/cache".into()),
        ..ServerFlags::default()
    };
    let c = Config::embedded(&[], &flags).unwrap();
    let prm = |i: usize| match &c.evaluators[i].kind {
        KindConfig::Prm(p) => (c.evaluators[i].name.as_str(), p.family, p.model.as_str()),
        _ => panic!("a prm table"),
    };
    assert_eq!(c.evaluators.len(), 2);
    // The trained head first, so it is the default; zero-shot chat-lm beside it.
    assert_eq!(
        prm(0),
        ("smollm2-head", PrmKind::Head, "/models/cache/heads/smollm2")
    );
    assert_eq!(
        prm(1),
        (
            "smollm2",
            Family::ChatLm.into(),
            "/models/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    );
    // A model --set names stays.
    let set = ["evaluator.smollm2.model=/elsewhere".to_string()];
    let c = Config::embedded(&set, &flags).unwrap();
    let KindConfig::Prm(p) = &c.evaluators[1].kind else {
        panic!("a prm table")
    };
    assert_eq!(p.model, "/elsewhere");
}

#[test]
fn the_embedded_head_is_written_once_and_mended_when_changed() {
    let dir = std::env::temp_dir().join(format!("retrace-embedded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let head = super::install_head(&dir).unwrap();
    assert_eq!(head, dir.join("heads/smollm2"));
    let config = head.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(
        text.contains("../../gguf/SmolLM2-135M-Instruct.Q4_1.gguf"),
        "{text}"
    );
    std::fs::write(&config, "{}").unwrap();
    super::install_head(&dir).unwrap();
    assert_eq!(std::fs::read_to_string(&config).unwrap(), text);
    let mut names: Vec<_> = std::fs::read_dir(&head)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["config.json", "head.safetensors"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_resolved_config_renders_and_reads_back_the_same() {
    let text = format!(
        "{EXAMPLE}\n[[evaluator]]\nname = \"j\"\nkind = \"judge\"\nbase_url = \"http://x/v1\"\n\
         model = \"m\"\nextra_body = {{ seed = 1 }}\n\n[[evaluator]]\nname = \"c\"\nkind = \"cascade\"\n\
         prm = \"qwen-prm\"\njudge = \"j\"\n"
    );
    let c = parse(&text).unwrap();
    let rendered = c.redacted_toml();
    let back = Config::parse(&rendered, "rendered", &[]).unwrap();
    assert_eq!(back.evaluators, c.evaluators, "{rendered}");
    assert!(rendered.contains("kind = \"cascade\""), "{rendered}");
}

#[test]
fn a_vllm_backed_prm_validates_its_keys() {
    let base = EXAMPLE.replace("device = \"cpu\"\n", "backend = \"vllm\"\n");
    let vllm = format!(
        "{base}[evaluator.vllm]\nbase_url = \"http://gpu-0:8000\"\nserved_model = \"prm\"\ntimeout_s = 30\n"
    );
    let c = parse(&vllm).unwrap();
    let KindConfig::Prm(p) = &c.evaluators[0].kind else {
        panic!("a prm table")
    };
    assert_eq!(p.backend, Backend::Vllm);
    let table = p.vllm.as_ref().expect("the vllm table");
    assert_eq!(table.endpoint.base_url, "http://gpu-0:8000");
    assert_eq!(table.endpoint.timeout_s, 30.0);
    assert_eq!(table.top_logprobs, crate::prm::defaults::TOP_LOGPROBS);
    let candle_key = |key: &str| {
        vllm.replace(
            "backend = \"vllm\"\n",
            &format!("backend = \"vllm\"\n{key}\n"),
        )
    };
    let cases = [
        // The table on an in-process PRM.
        (
            format!("{EXAMPLE}[evaluator.vllm]\nbase_url = \"http://x\"\n"),
            "applies only to backend = \"vllm\"".to_string(),
        ),
        // The old spelling at the PRM's top level: named, with where it went.
        (
            EXAMPLE.replace("device = \"cpu\"", "base_url = \"http://x\""),
            "base_url: a PRM's vLLM keys now live in their own table".to_string(),
        ),
        (
            EXAMPLE.replace("device = \"cpu\"", "top_logprobs = 5"),
            "move `top_logprobs` under [evaluator.vllm]".to_string(),
        ),
        (base.clone(), "needs an [evaluator.vllm] table".to_string()),
        (
            vllm.replace("base_url = \"http://gpu-0:8000\"\n", ""),
            "base_url".to_string(),
        ),
        (
            vllm.replace("http://gpu-0:8000", "gpu-0:8000"),
            "\"gpu-0:8000\"".to_string(),
        ),
        (
            vllm.replace("family = \"qwen2-math-prm\"", "family = \"skywork-prm\""),
            "skywork-prm's value head".to_string(),
        ),
        (
            format!("{vllm}top_logprobs = 1\n"),
            "vllm.top_logprobs must lie in [2, 100]".to_string(),
        ),
        (
            format!("{vllm}retries = 99\n"),
            "vllm.retries must be at most".to_string(),
        ),
        (
            vllm.replace("timeout_s = 30", "timeout_s = 0"),
            "vllm.timeout_s must lie in".to_string(),
        ),
        (
            format!("{vllm}backend_url = \"x\"\n"),
            "backend_url".to_string(),
        ),
    ];
    let candle_keys = [
        "device = \"cuda\"",
        "dtype = \"bf16\"",
        "max_batch_tokens = 4096",
        "max_batch_size = 8",
        "max_wait_ms = 5",
        "prefix_cache_mb = 64",
        "prefix_sharing = false",
    ];
    // Every candle key under a vLLM backend is refused, by name.
    let candle_cases = candle_keys.iter().map(|kv| {
        let key = kv.split(' ').next().unwrap();
        (
            candle_key(kv),
            format!("{key} applies only to backend = \"candle\""),
        )
    });
    for (text, needle) in cases.into_iter().chain(candle_cases) {
        let err = parse(&text).unwrap_err();
        assert!(err.message.contains(&needle), "{needle:?} not in {err}");
    }
}

#[test]
fn an_unset_threshold_is_left_to_the_engine() {
    let text = EXAMPLE.replace("threshold = 0.5\n", "");
    let c = parse(&format!("{text}{JUDGE}{CASCADE}")).unwrap();
    // The engine decides what applies (a head's own, else its default), in one place.
    for e in &c.evaluators {
        assert_eq!(e.threshold, None, "{}", e.name);
    }
    assert!(!c.redacted_toml().contains("threshold"));
    let set = parse(&format!("{text}{JUDGE}{CASCADE}threshold = 0.25\n")).unwrap();
    assert_eq!(set.evaluators.last().unwrap().threshold, Some(0.25));
    assert_eq!(set.slot_specs().last().unwrap().threshold, Some(0.25));
}

#[test]
fn two_evaluators_recording_to_one_file_are_refused() {
    let judge = format!("{JUDGE}record = \"runs/verdicts.jsonl\"\n");
    let cascade = format!("{CASCADE}record = \"runs/\"\n");
    let err = parse(&format!("{EXAMPLE}{judge}{cascade}")).unwrap_err();
    assert!(
        err.message
            .contains("\"gpt-4o\" and \"both\" both record to"),
        "{}",
        err.message
    );
    let apart = format!("{CASCADE}record = \"runs/cascade.jsonl\"\n");
    parse(&format!("{EXAMPLE}{judge}{apart}")).expect("apart is fine");
}

#[test]
fn admin_tokens_come_from_their_variable_and_set_but_empty_is_an_error() {
    let env = |vars: &[(&'static str, &'static str)]| Env::fixed(vars.iter().copied());
    let text = EXAMPLE.replace(
        "shutdown_grace_s = 30",
        "shutdown_grace_s = 30\nadmin_tokens_env = \"ADMIN\"",
    );
    let mut c = parse(&text).unwrap();
    c.env = env(&[("ADMIN", "root, spare")]);
    let tokens: Vec<String> = c.admin_tokens().unwrap().into_iter().map(|t| t.0).collect();
    assert_eq!(tokens, ["root", "spare"]);
    c.env = env(&[("ADMIN", " , ")]);
    assert!(
        c.admin_tokens()
            .unwrap_err()
            .message
            .contains("holds no token")
    );
    c.env = env(&[]);
    assert!(c.admin_tokens().unwrap_err().message.contains("not set"));
    assert!(parse(EXAMPLE).unwrap().admin_tokens().unwrap().is_empty());
}

#[test]
fn a_guaranteed_cascade_needs_its_keys_together_and_in_range() {
    let with = |keys: &str| parse(&format!("{EXAMPLE}{JUDGE}{CASCADE}{keys}\n"));
    let ok = "target_agreement = 0.9\ncalibration = \"rows.jsonl\"\naudit_rate = 0.3";
    with(ok).expect("a guaranteed, audited cascade");
    let refused = [
        (
            "target_agreement = 1.5\ncalibration = \"r\"",
            "target_agreement must lie strictly",
        ),
        ("target_agreement = 0.9", "needs calibration"),
        (
            "target_agreement = 0.9\ncalibration = \"r\"\ntarget_confidence = 0",
            "target_confidence",
        ),
        (
            "target_agreement = 0.9\ncalibration = \"r\"\nescalate_margin = 0.2",
            "set one",
        ),
        ("calibration = \"r\"", "calibration needs target_agreement"),
        ("audit_rate = 0.3", "audit_rate needs target_agreement"),
        (
            "target_agreement = 0.9\ncalibration = \"r\"\naudit_floor = 0.1",
            "need audit_rate",
        ),
        (
            "target_agreement = 0.9\ncalibration = \"r\"\naudit_rate = 0.1\naudit_floor = 0.2",
            "floor",
        ),
        (
            "target_agreement = 0.9\ncalibration = \"r\"\nconfidence = \"vibes\"",
            "vibes",
        ),
    ];
    for (keys, want) in refused {
        let err = with(keys).unwrap_err();
        assert!(err.message.contains(want), "{keys}: {err}");
        assert!(
            err.message.contains("both"),
            "{keys}: {err} names the cascade"
        );
    }
}
