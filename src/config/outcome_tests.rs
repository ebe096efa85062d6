//! Unit tests for the outcome-rm family, the composite kind and the reward rules that read an
//! outcome score: what validates, and each refusal naming its key.
use super::*;
use reward::Gives;

const TABLES: &str = r#"
[[evaluator]]
name = "both"
kind = "composite"
steps = "steps-prm"
outcome = "rm"

[[evaluator]]
name = "steps-prm"
kind = "prm"
family = "qwen2-math-prm"
model = "/models/prm"

[[evaluator]]
name = "rm"
kind = "prm"
family = "outcome-rm"
model = "/models/rm"
"#;

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, "test.toml", &[])
}

fn refusal(text: &str) -> String {
    parse(text).unwrap_err().message
}

#[test]
fn a_composite_validates_and_loads_after_what_it_wraps() {
    let c = parse(TABLES).unwrap();
    let tiers: Vec<(String, u8)> = c
        .slot_specs()
        .into_iter()
        .map(|s| (s.name, s.tier))
        .collect();
    assert_eq!(
        tiers,
        [
            ("both".into(), 2),
            ("steps-prm".into(), 0),
            ("rm".into(), 0)
        ]
    );
    assert_eq!(
        c.evaluators[0].kind.gives(),
        Gives {
            steps: true,
            outcome: true
        }
    );
    assert_eq!(
        c.evaluators[2].kind.gives(),
        Gives {
            steps: false,
            outcome: true
        }
    );
    let cascade = "\n[[evaluator]]\nname = \"c\"\nkind = \"cascade\"\nprm = \"steps-prm\"\njudge = \"j\"\n\n[[evaluator]]\nname = \"j\"\nkind = \"judge\"\nbase_url = \"http://127.0.0.1:1\"\nmodel = \"m\"\n";
    let over_cascade = format!(
        "{}{cascade}",
        TABLES.replace("steps = \"steps-prm\"", "steps = \"c\"")
    );
    let c = parse(&over_cascade).unwrap();
    assert_eq!(c.slot_specs()[0].tier, 2);
}

#[test]
fn outcome_rm_refuses_what_it_cannot_run() {
    let e = refusal(&TABLES.replace("model = \"/models/rm\"", "model = \"/models/rm.gguf\""));
    assert!(
        e.contains("evaluator[2] (\"rm\")") && e.contains("score` head"),
        "{e}"
    );
    let vllm = TABLES.replace(
        "model = \"/models/rm\"",
        "model = \"/models/rm\"\nbackend = \"vllm\"\n[evaluator.vllm]\nbase_url = \"http://127.0.0.1:8000\"",
    );
    let e = refusal(&vllm);
    assert!(e.contains("outcome-rm runs in-process"), "{e}");
}

#[test]
fn a_composite_names_a_step_evaluator_and_an_outcome_rm() {
    let e = refusal(&TABLES.replace("outcome = \"rm\"", "outcome = \"steps-prm\""));
    assert!(
        e.contains("outcome \"steps-prm\" is a prm (qwen2-math-prm), not an outcome-rm"),
        "{e}"
    );
    let e = refusal(&TABLES.replace("steps = \"steps-prm\"", "steps = \"rm\""));
    assert!(
        e.contains("steps \"rm\" is an outcome-rm PRM, which scores no steps"),
        "{e}"
    );
    let e = refusal(&TABLES.replace("steps = \"steps-prm\"", "steps = \"both\""));
    assert!(e.contains("steps \"both\" is a composite"), "{e}");
    let e = refusal(&TABLES.replace("outcome = \"rm\"", "outcome = \"nope\""));
    assert!(e.contains("outcome \"nope\" names no [[evaluator]]"), "{e}");
    let e = refusal(&TABLES.replace("outcome = \"rm\"", "outcome = \"rm\"\nprm = \"x\""));
    assert!(e.contains("prm"), "{e}");
    let cascade = "\n[[evaluator]]\nname = \"c\"\nkind = \"cascade\"\nprm = \"rm\"\njudge = \"j\"\n\n[[evaluator]]\nname = \"j\"\nkind = \"judge\"\nbase_url = \"http://127.0.0.1:1\"\nmodel = \"m\"\n";
    let e = refusal(&format!("{TABLES}{cascade}"));
    assert!(e.contains("prm \"rm\" is an outcome-rm PRM"), "{e}");
}

#[test]
fn reward_rules_check_the_reward_evaluator_gives_what_they_read() {
    let with = |reward: &str| format!("[reward]\n{reward}\n{TABLES}");
    // The default evaluator is the composite: every rule applies.
    for rule in RewardRule::ALL {
        parse(&with(&format!("rule = \"{}\"", rule.as_str()))).unwrap();
    }
    let e = refusal(&with("rule = \"outcome\"\nevaluator = \"steps-prm\""));
    assert!(
        e.contains("reward.rule = \"outcome\" needs an outcome score")
            && e.contains("\"steps-prm\" (the reward's) is a prm (qwen2-math-prm)"),
        "{e}"
    );
    let e = refusal(&with("rule = \"min_with_outcome\"\nevaluator = \"rm\""));
    assert!(e.contains("needs step scores"), "{e}");
    let e = refusal(&with("rule = \"prefix\"\nevaluator = \"rm\""));
    assert!(e.contains("needs step scores"), "{e}");
    parse(&with("rule = \"outcome\"\nevaluator = \"rm\"")).unwrap();
    parse(&with("rule = \"correct\"\nevaluator = \"rm\"")).unwrap();
    // Without reward.evaluator the server's default is checked.
    let e = refusal(&format!(
        "[server]\ndefault_evaluator = \"steps-prm\"\n[reward]\nrule = \"min_with_outcome\"\n{TABLES}"
    ));
    assert!(e.contains("\"steps-prm\" (the reward's)"), "{e}");
}
