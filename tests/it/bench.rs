//! `retrace bench` end to end on the committed tiny chat-lm PRM: it starts its own server, scores
//! ProcessBench traces over gRPC at two concurrencies, measures the matmul peak and the scaling
//! sweep, and prints the table. The llama-server contender is left out (`--no-llama`); the
//! runs in docs/performance.md have it.

use crate::common;

use std::path::Path;

use std::process::Command;

/// The numbers of a table row, by its label (its first cells, `|`-separated); `–` cells are
/// skipped.
fn row(table: &str, label: &str) -> Vec<f64> {
    numbers(table.lines().find(|l| labelled(l, label)), table, label)
}

/// The numbers of the last row so labelled (a later table's).
fn last_row(table: &str, label: &str) -> Vec<f64> {
    numbers(table.lines().rfind(|l| labelled(l, label)), table, label)
}

/// A bench run's standard output, after checking that it succeeded.
fn succeeded(o: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "retrace bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    stdout
}

fn labelled(line: &str, label: &str) -> bool {
    line.starts_with(&format!("| {label} |"))
}

fn numbers(line: Option<&str>, table: &str, label: &str) -> Vec<f64> {
    let line = line.unwrap_or_else(|| panic!("no row {label:?} in:\n{table}"));
    line.split('|')
        .skip(2 + label.matches('|').count())
        .map(|c| c.trim().trim_end_matches(['%', 'x']))
        .filter(|c| !c.is_empty() && *c != "–")
        .map(|c| {
            c.parse::<f64>()
                .unwrap_or_else(|_| panic!("cell {c:?} in {line}"))
        })
        .collect()
}

#[test]
fn bench_prints_the_table_and_writes_the_plot() {
    let dir = std::env::temp_dir().join(format!("retrace-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (svg, out) = (dir.join("scaling.svg"), dir.join("report.md"));
    let model = Path::new(crate::common::REPO).join("tests/fixtures/tiny/chat-lm");
    let o = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .args(["bench", "--no-llama", "--limit", "3", "--rounds", "2"])
        .args(["--concurrency", "1,2", "--gemm-rows", "32"])
        .args(["--target-peak-percent", "50", "--target-rss-factor", "1.5"])
        .args([
            "--scaling",
            "--scaling-lens",
            "32,64",
            "--scaling-batches",
            "1,2",
        ])
        .arg("--model")
        .arg(&model)
        .arg("--data")
        .arg(common::processbench("gsm8k"))
        .arg("--svg")
        .arg(&svg)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("run retrace bench");
    let stdout = succeeded(&o);
    assert!(
        stdout.contains("| | retrace c=1 | retrace c=2 |"),
        "header:\n{stdout}"
    );
    assert!(stdout.contains("3 traces of"), "{stdout}");
    for label in [
        "traces/s",
        "tokens/s",
        "p50 latency (ms)",
        "p99 latency (ms)",
        "achieved GFLOP/s",
        "% of matmul peak",
    ] {
        let cells = row(&stdout, label);
        assert_eq!(cells.len(), 2, "{label}: {cells:?}");
        assert!(cells.iter().all(|c| *c > 0.0), "{label}: {cells:?}");
    }
    let p50 = row(&stdout, "p50 latency (ms)");
    let p99 = row(&stdout, "p99 latency (ms)");
    assert!(p50.iter().zip(&p99).all(|(a, b)| a <= b), "{p50:?} {p99:?}");
    // The server the bench started was measured: at least the tiny model's weights.
    let rss = row(&stdout, "peak RSS (MiB, whole run)");
    assert!(rss.len() == 1 && rss[0] > 1.0, "{rss:?}");
    assert!(stdout.contains("f32 matmul peak"), "{stdout}");
    // No sweep point reaches batch 8, so that target is not claimed either way.
    assert!(!stdout.contains("at batch ≥ 8"), "{stdout}");
    assert!(stdout.contains("peak RSS ≤ 1.5 × weights"), "{stdout}");
    // Only the targets asked for are checked: no speed-up target was given.
    assert!(!stdout.contains("llama-server at c="), "{stdout}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(plot.starts_with("<svg") && plot.contains("batch 2") && plot.contains("64 tokens"));
    assert_eq!(std::fs::read_to_string(&out).unwrap().trim(), stdout.trim());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The reuse workloads that search: beam search and tree search at two caller counts, each on
/// the three servers the bench starts, with where the cache server's time went. The prefix
/// cache must reuse what a search scored a moment before, and no-reuse must reuse nothing.
#[test]
fn the_searches_run_at_each_callers_count_and_the_cache_reuses_their_prefixes() {
    let model = Path::new(crate::common::REPO).join("tests/fixtures/tiny/chat-lm");
    let bon = Path::new(crate::common::REPO).join("bench/best-of-n.jsonl");
    let o = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .args(["bench", "--no-llama", "--workload", "beam,tree"])
        .args(["--callers", "1,2", "--limit", "1", "--rounds", "1"])
        .arg("--model")
        .arg(&model)
        .arg("--bon-data")
        .arg(&bon)
        .arg("--data")
        .arg(common::processbench("gsm8k"))
        .output()
        .expect("run retrace bench");
    let stdout = succeeded(&o);
    for workload in ["beam search", "tree search"] {
        for callers in [1, 2] {
            let name = match callers {
                1 => format!("{workload}, 1 caller"),
                n => format!("{workload}, {n} callers"),
            };
            // seconds, tokens computed, tokens reused, speed-up[, bound, share of bound]
            let cache = row(&stdout, &format!("{name} | retrace, prefix cache"));
            assert!(cache[1] > 0.0 && cache[2] > cache[1], "{name}: {cache:?}");
            let none = row(&stdout, &format!("{name} | retrace, no reuse"));
            assert_eq!(none[2], 0.0, "{name}: {none:?}");
            // The cache computed fewer tokens for the same work.
            assert!(cache[1] < none[1], "{name}: {cache:?} against {none:?}");
            // requests, ms in server, queued, tokenizing, a forward, busy, traces, tokens
            let profile = last_row(&stdout, &name);
            assert!(profile[0] >= 2.0 && profile[1] > 0.0, "{name}: {profile:?}");
            assert!(profile[6] >= 1.0 && profile[7] > 0.0, "{name}: {profile:?}");
        }
    }
    assert!(
        stdout.contains("beam search, 2 callers: "),
        "a note on beam search's share of its bound:\n{stdout}"
    );
}

/// The prompt tokens llama-server computed for each request, in order, from its log.
fn computed_prompts(log: &str) -> Vec<usize> {
    log.lines()
        .filter(|l| l.contains("prompt eval time"))
        .map(|l| {
            let (_, tail) = l.split_once(" / ").expect("'/ N tokens'");
            let n = tail.split_whitespace().next().expect("a count");
            n.parse().unwrap_or_else(|_| panic!("{l}"))
        })
        .collect()
}

/// Against llama-server on the same file, no round reads the one before from llama-server's
/// slots or prompt cache (retrace's contender runs with no prefix cache): a run's first prompt
/// is computed past the shared system prompt, not served whole from memory, and every round
/// computes the same prompts.
#[test]
fn each_llama_server_round_computes_its_prompts_afresh() {
    let gguf = common::llama::smollm2_gguf();
    let o = Command::new(env!("CARGO_BIN_EXE_retrace"))
        .args([
            "bench",
            "--limit",
            "2",
            "--rounds",
            "2",
            "--concurrency",
            "1",
        ])
        .args(["--gemm-rows", "32"])
        .arg("--model")
        .arg(&gguf)
        .arg("--llama-gguf")
        .arg(&gguf)
        .arg("--data")
        .arg(common::processbench("gsm8k"))
        .output()
        .expect("run retrace bench");
    succeeded(&o);
    let stderr = String::from_utf8_lossy(&o.stderr);
    let header = stderr.lines().find(|l| l.contains("; logs in ")).unwrap();
    let (head, logs) = header.split_once("; logs in ").unwrap();
    let steps: usize = head
        .rsplit(", ")
        .next()
        .unwrap()
        .trim_end_matches(" steps")
        .parse()
        .unwrap();
    let log = std::fs::read_to_string(Path::new(logs.trim()).join("llama-server.log")).unwrap();
    let prompts = computed_prompts(&log);
    // The warm-up scores the same two traces, then each round does: a request per step.
    assert_eq!(prompts.len(), 3 * steps, "{prompts:?}");
    let (warm, rounds) = prompts.split_at(steps);
    let (first, second) = rounds.split_at(steps);
    // The marker's words may match the last round's marker for a token or two of the first.
    assert_eq!(
        first[1..],
        second[1..],
        "the two rounds computed different prompts"
    );
    assert!(first[0].abs_diff(second[0]) <= 8, "{prompts:?}");
    // A slot holding the same conversation from the warm-up or the round before leaves one
    // token of the first prompt to compute; another trace's, all but the system prompt.
    assert!(first[0] > 16, "round 1 began on a warm slot: {prompts:?}");
    assert!(warm.iter().all(|&n| n > 0), "{warm:?}");
}
