"""The documentation-command check's reading of Markdown, against help text written here."""
from scripts.check.doc_commands import Help, check

# clap's help as the binary prints it, cut down to what the check reads.
TOP = """\
Judges reasoning traces step by step over gRPC.

Usage: retrace <COMMAND>

Commands:
  serve         Serves the gRPC API
  eval          Runs labelled traces through an evaluator, on a
                server or in-process
  help          Print this message or the help of the given subcommand(s)

Options:
  -h, --help
          Print help
  -V, --version
          Print version
"""
SERVE = """\
Usage: retrace serve [OPTIONS]

Options:
      --config <CONFIG>
          TOML config file, e.g. one that --made-up-in-prose would name

      --set <SET>
          Overrides a key
  -h, --help
          Print help
"""
EVAL = """\
Usage: retrace eval [OPTIONS] --data <DATA>...

Options:
      --data <DATA>...
          Labelled data
      --out <OUT>
          Output folder
  -h, --help
          Print help
"""
HELP = {(): TOP, ("serve",): SERVE, ("eval",): EVAL}


def run(tmp_path, text):
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    return [line.split(": ", 1)[1] for line in check([doc], Help(HELP.get))]


def test_known_flags_pass(tmp_path):
    text = """\
Serve it with `retrace serve --config FILE --set server.x=1`:

```sh
RUST_LOG=info cargo run --release -- serve \\
  --config retrace.toml --set=evaluator.a.threshold=0.5   # a comment --nope
retrace eval --data a.json b.json --out runs/x | grep --count F1 && other --flag
nice -n 10 target/release/retrace eval --data x.json -- --passed-on
```

A fence that is not shell is not read:

```toml
retrace = "--not-a-flag"
```
"""
    assert run(tmp_path, text) == []


def test_a_made_up_flag_fails_with_its_line(tmp_path):
    text = "Intro.\n\n```sh\nretrace serve --config c.toml \\\n  --made-up-in-prose\n```\n"
    doc = tmp_path / "doc.md"
    doc.write_text(text)
    found = check([doc], Help(HELP.get))
    assert found == [f"{doc}:4: retrace serve --made-up-in-prose: "
                     "not in `retrace serve --help`"]


def test_an_unknown_subcommand_and_an_inline_flag_fail(tmp_path):
    text = "Run `retrace distill --every 5`, then `retrace eval --data x\n--limit 3`.\n"
    assert run(tmp_path, text) == [
        "retrace distill: no such subcommand in `retrace --help`",
        "retrace eval --limit: not in `retrace eval --help`",
    ]
