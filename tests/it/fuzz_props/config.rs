//! The config loader: keys set in the file or by `--set` to values on both sides of their limits
//! load exactly when every value is in range, and a refusal names a key that is out of it.

use super::{cases, pieces};
use proptest::prelude::*;
use retrace::{Config, KindConfig};

/// A key, a value as TOML writes it, and whether the loader must accept it.
#[derive(Debug, Clone)]
struct Setting {
    section: &'static str,
    key: &'static str,
    value: String,
    ok: bool,
}

fn setting() -> impl Strategy<Value = Setting> {
    let s = |section, key, value: String, ok| Setting {
        section,
        key,
        value,
        ok,
    };
    prop_oneof![
        prop_oneof![0u64..4, (1u64 << 20) - 1..(1 << 20) + 2].prop_map(move |n| s(
            "server",
            "max_in_flight",
            n.to_string(),
            (1..=1 << 20).contains(&n)
        )),
        (-3i64..3700).prop_map(move |n| s(
            "server",
            "shutdown_grace_s",
            format!("{n}.5"),
            (0..3600).contains(&n)
        )),
        (0u64..3).prop_map(move |n| s("server", "max_steps", n.to_string(), n >= 1)),
        (-2i64..3700).prop_map(move |n| s(
            "server",
            "max_connection_age_s",
            format!("{n}.5"),
            (0..3600).contains(&n)
        )),
        (-20i64..120).prop_map(move |n| s(
            "evaluator",
            "threshold",
            format!("{:.2}", n as f64 / 100.0),
            (0..=100).contains(&n)
        )),
        (0u32..70).prop_map(move |n| s(
            "evaluator",
            "samples",
            n.to_string(),
            (1..=64).contains(&n)
        )),
        (0u32..14).prop_map(move |n| s("evaluator", "retries", n.to_string(), n <= 10)),
        (-2i64..3700).prop_map(move |n| s(
            "evaluator",
            "timeout_s",
            format!("{n}.5"),
            (0..3600).contains(&n)
        )),
    ]
}

fn file(settings: &[Setting]) -> String {
    let lines = |section| {
        settings
            .iter()
            .filter(|s| s.section == section)
            .map(|s| format!("{} = {}\n", s.key, s.value))
            .collect::<String>()
    };
    format!(
        "[server]\n{}\n[[evaluator]]\nname = \"j\"\nkind = \"judge\"\n\
         base_url = \"http://127.0.0.1:8080/v1\"\nmodel = \"m\"\n{}",
        lines("server"),
        lines("evaluator")
    )
}

/// The setting's value as the loaded config holds it, printed as TOML would write it.
fn loaded(config: &Config, s: &Setting) -> String {
    let e = &config.evaluators[0];
    let KindConfig::Judge(j) = &e.kind else {
        panic!("a judge table")
    };
    match s.key {
        "max_in_flight" => config.server.max_in_flight.to_string(),
        "shutdown_grace_s" => format!("{:.1}", config.server.shutdown_grace_s),
        "max_steps" => config.server.max_steps.to_string(),
        "max_connection_age_s" => format!("{:.1}", config.server.max_connection_age_s),
        "threshold" => format!("{:.2}", e.threshold.expect("resolved")),
        "samples" => j.samples.to_string(),
        "retries" => j.endpoint.retries.to_string(),
        "timeout_s" => format!("{:.1}", j.endpoint.timeout_s),
        other => panic!("no setting {other}"),
    }
}

fn first_of_each<'a>(settings: impl Iterator<Item = &'a Setting>) -> Vec<Setting> {
    let mut out: Vec<Setting> = Vec::new();
    for s in settings {
        if !out.iter().any(|o| o.key == s.key) {
            out.push(s.clone());
        }
    }
    out
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn out_of_range_values_are_refused_by_name(
        settings in prop::collection::vec(setting(), 1..4),
        by_flag: bool,
    ) {
        // A key twice in a file is a TOML error, so the file gets each key's first value;
        // `--set` keeps the last, as a command line does.
        let effective = if by_flag {
            first_of_each(settings.iter().rev())
        } else {
            first_of_each(settings.iter())
        };
        let (text, sets) = if by_flag {
            let sets = settings.iter().map(|s| match s.section {
                "server" => format!("server.{}={}", s.key, s.value),
                _ => format!("evaluator.j.{}={}", s.key, s.value),
            }).collect();
            (file(&[]), sets)
        } else {
            (file(&effective), Vec::new())
        };
        match Config::parse(&text, "props.toml", &sets) {
            Ok(config) => {
                prop_assert!(effective.iter().all(|s| s.ok), "accepted {:?}", effective);
                for s in &effective {
                    prop_assert_eq!(loaded(&config, s), s.value.clone());
                }
            }
            Err(e) => {
                let bad: Vec<&Setting> = effective.iter().filter(|s| !s.ok).collect();
                prop_assert!(!bad.is_empty(), "refused {:?}: {}", effective, e);
                prop_assert!(bad.iter().any(|s| e.message.contains(s.key)), "{}", e);
            }
        }
    }

    #[test]
    fn any_text_loads_or_says_why(
        text in pieces(&["[server]\n", "[[evaluator]]\n", "[reward]\n", "name = \"j\"\n",
            "kind = \"judge\"\n", "kind = \"cascade\"\n", "base_url = \"http://h/v1\"\n",
            "model = \"m\"\n", "prm = \"j\"\n", "judge = \"j\"\n", "max_in_flight = ", "= ",
            "\"", "1", "-1", "1e999", "nan", "\n", "[", "]", "{", "}", "."], 30),
        sets in prop::collection::vec(pieces(&["server.", "evaluator.j.", "reward.", "=",
            "max_steps", "samples", "1", "\"x\"", "."], 6), 0..3),
    ) {
        match Config::parse(&text, "props.toml", &sets) {
            Ok(config) => {
                prop_assert!(config.validate().is_ok());
                let rendered = config.redacted_toml();
                prop_assert!(Config::parse(&rendered, "rendered", &[]).is_ok(), "{}", rendered);
            }
            Err(e) => prop_assert!(!e.message.trim().is_empty()),
        }
    }
}
