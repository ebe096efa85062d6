#!/usr/bin/env python3
"""Checks that every `retrace` command the documentation shows is one the binary takes.

Standard library only. In README.md and docs/*.md (or the Markdown files given after the binary),
it finds each command whose program is `retrace` (or a path ending in /retrace), `cargo run
[cargo flags] -- SUBCOMMAND`, or a script that hands its arguments to one (FORWARDERS), in shell
code blocks and in inline code, and checks that its subcommand is listed by `BINARY --help` and
that each long flag it passes (`--flag`, `--flag=value`) is an option `BINARY SUBCOMMAND --help`
lists. A command may run over lines ending in `\\`; flags after a pipe, `;`, `&&` or `--` belong
to other programs and are not read.

Usage: scripts/check/doc_commands.py BINARY [FILE.md...]. Prints each mismatch as
FILE:LINE: retrace SUB --flag: not in `retrace SUB --help` and exits 1 when there is any.
"""

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+-]*)")
# Code blocks in these languages (or none) are shell; a toml or python block may name retrace in
# other senses (a host, a module) and is not read.
SHELL_LANGS = {"", "sh", "bash", "shell", "console", "zsh"}
# A code span: one or more backticks, the shortest text up to as many again. Spans may run over a
# line break inside a paragraph, never over a blank line.
CODE_SPAN = re.compile(r"(`+)((?:(?!\1).)+?)\1", re.S)
# shlex with punctuation_chars gives each run of these as a word of its own: a pipe, a list, a
# subshell or a command substitution, each of which starts another program.
SEPARATOR_CHARS = set("|&;()")
# Programs that run the command after them: the program checked is the one they start.
WRAPPERS = {"env", "nice", "time", "exec", "nohup", "sudo", "command", "timeout"}
# Scripts that hand every argument on to a subcommand: their flags are that subcommand's.
FORWARDERS = {"scripts/bench/bench.sh": "bench", "scripts/bench/bench-reuse.sh": "bench"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
LONG_FLAG = re.compile(r"^[\[(]*(--[A-Za-z0-9][A-Za-z0-9_-]*)")
# clap's help: an option's own line starts with it, indented 2 to 6 ("  -h, --help",
# "      --data <DATA>..."; descriptions sit at 10), and aliases are listed as
# "[aliases: --a, --b]". Flags named only in a description do not count.
HELP_OPTION = re.compile(r"^ {2,6}(?:-[A-Za-z0-9], )?(--[A-Za-z0-9][A-Za-z0-9_-]*)", re.M)
HELP_ALIASES = re.compile(r"\[(?:short )?aliases?: ([^\]]*)\]")
HELP_COMMAND = re.compile(r"^  ([a-z][a-z0-9-]*)(?:\s{2,}|$)")


def fenced_blocks(lines):
    """The shell code blocks' commands as (line number, text), and the indexes of every line
    inside a fence (prose is what is outside)."""
    commands, inside, fence, lang, start, body = [], set(), None, "", 0, []
    for i, line in enumerate(lines):
        if fence is None:
            m = FENCE.match(line)
            if m:
                fence, lang, start, body = m.group(1), m.group(2).lower(), i, []
                inside.add(i)
            continue
        inside.add(i)
        closing = line.strip()
        if closing.startswith(fence) and closing.strip(fence[0]) == "":
            if lang in SHELL_LANGS:
                commands.extend(commands_of_block(body, start + 2))
            fence = None
            continue
        body.append(line)
    return commands, inside


def commands_of_block(body, first_line):
    """Joins continuation lines (ending in a backslash); yields (line number, text) per
    logical line, a console's `$ ` prompt dropped."""
    text, line_no = "", None
    for offset, line in enumerate(body):
        if line_no is None:
            line_no = first_line + offset
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            text += stripped[:-1] + " "
            continue
        text += stripped
        yield line_no, re.sub(r"^\s*\$\s+", "", text)
        text, line_no = "", None
    if line_no is not None:
        yield line_no, text


def inline_spans(lines, fenced):
    """Yields (line number, text) for each code span outside fences. Paragraphs are cut at blank
    lines and fences so that a stray backtick cannot pair with one far away."""
    paragraph, start = [], 0
    for i, line in enumerate(lines + [""]):
        if i in fenced or not line.strip():
            yield from spans_of(paragraph, start)
            paragraph = []
            continue
        if not paragraph:
            start = i
        paragraph.append(line)


def spans_of(paragraph, start):
    # A table row may escape its pipes inside code (`a \| b`); unescaped, it reads as the
    # alternative the author meant, which the tokenizer then treats as a separator.
    text = "\n".join(paragraph).replace("\\|", "|")
    for m in CODE_SPAN.finditer(text):
        yield start + 1 + text.count("\n", 0, m.start()), m.group(2).replace("\n", " ")


def tokens(text):
    """Shell words and separators; a span that does not parse (an unclosed quote in a fragment)
    falls back to a plain split."""
    # A comment starts at a `#` that opens a word; shlex would also end a word at one inside it
    # (an anchor in a URL), so comments are cut here and shlex's own are turned off.
    text = re.sub(r"(^|\s)#.*", "", text)
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:
        return re.findall(r"[|;&()]+|[^\s|;&()]+", text.replace('"', " ").replace("'", " "))


def simple_commands(words):
    """Splits the words at shell separators."""
    command = []
    for w in words:
        if w and set(w) <= SEPARATOR_CHARS:
            if command:
                yield command
            command = []
        else:
            command.append(w)
    if command:
        yield command


def program_args(command):
    """The words after `retrace` (or after cargo run's `--`), or None when the command runs
    something else."""
    i = 0
    while i < len(command) and ASSIGNMENT.match(command[i]):
        i += 1
    while i < len(command) and command[i] in WRAPPERS:
        i += 1
        # A wrapper's own options and arguments (nice -n 10, env -u X, timeout 470).
        while i < len(command) and (command[i].startswith("-") or ASSIGNMENT.match(command[i])
                                    or re.fullmatch(r"[\d.]+[smhd]?", command[i])):
            takes_value = command[i] in ("-n", "-u", "-s", "-k", "--unset", "--signal")
            i += 2 if takes_value else 1
    rest = command[i:]
    if not rest:
        return None
    name = rest[0]
    if name == "retrace" or name.endswith("/retrace"):
        return rest[1:]
    for script, sub in FORWARDERS.items():
        if name.removeprefix("./") == script:
            return [sub, *rest[1:]]
    if name == "cargo" and len(rest) > 1 and rest[1] == "run" and "--" in rest:
        cargo = rest[2:rest.index("--")]
        # Another package's binary or an example is not the retrace CLI.
        for flag in ("-p", "--package", "--bin", "--example"):
            if flag in cargo:
                value = cargo[cargo.index(flag) + 1] if cargo.index(flag) + 1 < len(cargo) else ""
                if flag == "--example" or value != "retrace":
                    return None
        if any(w.startswith(("--package=", "--bin=", "--example=")) and
               not w.endswith("=retrace") for w in cargo):
            return None
        return rest[rest.index("--") + 1:]
    return None


def usages(path, bare=()):
    """Yields (line number, argument words) for each retrace command in a Markdown file. Inline
    code that opens with a subcommand in `bare` and then a long flag (`train-head --taps T`) is
    read as that subcommand's: prose names them so without the program."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, fenced = fenced_blocks(lines)
    spans = list(inline_spans(lines, fenced))
    found = [(n, text, False) for n, text in blocks] + [(n, text, True) for n, text in spans]
    for line_no, text, inline in sorted(found):
        for k, command in enumerate(simple_commands(tokens(text))):
            args = program_args(command)
            if args is None and inline and k == 0 and len(command) > 1 \
                    and command[0] in bare and command[1].startswith("--"):
                args = command
            if args is not None:
                yield line_no, args


class Help:
    """`BINARY ... --help`, read once per command path, as subcommands and long options."""

    def __init__(self, run):
        self.run = run
        self.cache = {}

    def get(self, path):
        if path not in self.cache:
            text = self.run(path)
            if text is None:
                self.cache[path] = None
            else:
                flags = set(HELP_OPTION.findall(text))
                for aliases in HELP_ALIASES.findall(text):
                    flags.update(re.findall(r"--[A-Za-z0-9][A-Za-z0-9_-]*", aliases))
                self.cache[path] = (subcommands(text), flags)
        return self.cache[path]


def subcommands(help_text):
    """The names under clap's "Commands:" heading, `help` included."""
    names, listing = set(), False
    for line in help_text.splitlines():
        if line.strip() in ("Commands:", "Subcommands:"):
            listing = True
            continue
        if listing:
            m = HELP_COMMAND.match(line)
            if m:
                names.add(m.group(1))
            elif line.strip() and not line.startswith("   "):
                listing = False
    return names


def problems(args, help):
    """The mismatches of one command's arguments: an unknown subcommand, or each long flag its
    subcommand's help does not list."""
    path, i = (), 0
    # Descend through subcommands while the next word names one.
    while i < len(args):
        entry = help.get(path)
        if entry is None:
            return [f"`retrace {' '.join(path)} --help` failed".replace("  ", " ")]
        commands, _ = entry
        word = args[i]
        if word.startswith("-") or not commands:
            break
        if word not in commands:
            if path:
                break
            return [f"retrace {word}: no such subcommand in `retrace --help`"]
        path += (word,)
        i += 1
    entry = help.get(path)
    if entry is None:
        return [f"`retrace {' '.join(path)} --help` failed"]
    _, flags = entry
    shown = " ".join(("retrace",) + path)
    out = []
    for word in args[i:]:
        if word == "--":
            break
        m = LONG_FLAG.match(word)
        if m and m.group(1) not in flags:
            out.append(f"{shown} {m.group(1)}: not in `{shown} --help`")
    return out


def binary_help(binary):
    def run(path):
        try:
            done = subprocess.run([binary, *path, "--help"], capture_output=True, text=True,
                                  timeout=60)
        except OSError as e:
            sys.exit(f"doc_commands: cannot run {binary}: {e}")
        return done.stdout if done.returncode == 0 else None
    return run


def check(files, help):
    """Every mismatch in the files, as FILE:LINE: message lines."""
    out = []
    for path in files:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        top = help.get(())
        bare = top[0] - {"help"} if top else set()
        for line_no, args in usages(path, bare):
            for problem in problems(args, help):
                out.append(f"{shown}:{line_no}: {problem}")
    return out


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    binary = argv[1]
    files = [Path(f).resolve() for f in argv[2:]] or \
        [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = check(files, Help(binary_help(binary)))
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
