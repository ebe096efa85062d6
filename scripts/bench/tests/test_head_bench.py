"""The head benchmark's reading of train-head's output."""
from scripts.bench.head_bench import kinds, parse_log

# train-head's summary as it prints it (crates/retrace-cli/src/main.rs).
LOG = """\
wrote runs/h/head: mlp head on layers [[14], [14]] concatenated (tap middle+span:middle), \
threshold 0.35315263, dev F1 48.73
features: 1394.7 s, 527 traces (299558 tokens, 215 tokens/s) through the base, 0 file(s) \
from the cache; training on 303 traces: 12.7 s
test bbm-tracking_shuffled_objects: F1 29.5 (error accuracy 36.1, correct accuracy 25.0; 40 traces)
test mrben-physics: F1 - (error accuracy 10.5, correct accuracy -; 41 traces)
test olympiadbench: F1 29.1 (error accuracy 29.6, correct accuracy 28.6; 41 traces)
test mean F1 over splits: 25.6
test bbm-tracking_shuffled_objects: F1 0.0 on its other 20 traces at threshold 0.139 chosen on \
its first 20
test mrben-physics: F1 21.4 on its other 21 traces at threshold 0.429 chosen on its first 20
test olympiadbench: F1 43.0 on its other 21 traces at threshold 0.344 chosen on its first 20
"""


def test_dev_threshold_and_own_twenty_are_read_apart():
    run = parse_log(LOG)
    assert run["test"] == {"bbm-tracking_shuffled_objects": 29.5, "mrben-physics": None,
                           "olympiadbench": 29.1}
    assert run["own"] == {"bbm-tracking_shuffled_objects": 0.0, "mrben-physics": 21.4,
                          "olympiadbench": 43.0}


def test_the_head_its_tap_and_its_costs():
    run = parse_log(LOG)
    assert (run["head"], run["tap"], run["layers"]) == ("mlp", "middle+span:middle", "[[14], [14]]")
    assert run["dev_f1"] == 48.73
    assert (run["tokens"], run["tokens_s"], run["features_s"]) == (299558, 215, 1394.7)
    assert (run["train_traces"], run["train_s"]) == (303, 12.7)
    assert run["test_mean"] == 25.6


def test_the_kinds_table_spreads_each_kind_over_seeds(tmp_path, capsys):
    for seed, f1 in ((0, "20.0"), (1, "30.0")):
        d = tmp_path / f"seed-{seed}"
        d.mkdir()
        text = LOG.replace("F1 - (", "F1 10.0 (").replace("F1 29.5 (", f"F1 {f1} (")
        text = text.replace("test mean F1 over splits: 25.6\n", "")
        (d / "train-mlp-middle.log").write_text(text)
    (tmp_path / "seed-0" / "train-auto.log").write_text(LOG)

    class Args:
        out, taps, heads = str(tmp_path), "middle", "mlp"
    kinds(Args)
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("| mlp")]
    # Tracking 20 and 30 over the seeds, physics 10, olympiadbench 29.1: split means 19.7, 23.0.
    assert rows == ["| mlp | middle | 10.0 (10.0-10.0) | 25.0 (20.0-30.0) | 29.1 (29.1-29.1) "
                    "| **21.4 (19.7-23.0)** | 48.7 (48.7-48.7) | 21.5 (21.5-21.5) "
                    "| 12.7 (12.7-12.7) |"]
    # Dev's choice: the head and tap it kept, and the mean as train-head printed it.
    chosen = [line for line in out if line.startswith("| dev chooses")]
    assert chosen[0].startswith("| dev chooses (mlp middle+span:middle) | middle | ")
    assert "| **25.6 (25.6-25.6)** |" in chosen[0]
