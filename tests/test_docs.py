"""The docs stay true to the code and within issue 36's limits.

docs/step.md is exactly what docs/make_step.py prints. Every relative link in README.md and
docs/*.md resolves, and an anchor into a page names one of its headings. Every `gpt2np ...`, `python
-m gpt2np ...` and `python train.py ...` command of a ```bash block parses with that command's own
parser (nothing runs: the parse stops the command). The README is at most 250 lines; docs/ has at
least 5 pages of at most 500 lines; no date stamp outside CHANGELOG.md and docs/benchmarks*.md; the
median prose sentence is at most 25 words.
"""
import argparse
import contextlib
import difflib
import importlib.util
import io
import re
import shlex
import statistics

import pytest

from gpt2np import paths
from gpt2np.cli import main as gpt2np_command
from gpt2np.errors import ArgumentParser

ROOT = paths.REPO_ROOT
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_LINES, PAGE_LINES, MIN_PAGES, MEDIAN_WORDS = 250, 500, 5, 25
DATE = re.compile(r"\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b")
COMMAND = re.compile(r"^(gpt2np|python -m gpt2np|python train\.py)(\s|$)")
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"}


def pages():
    """README.md and every page under docs/."""
    return [README] + sorted(DOCS.rglob("*.md"))


def name(page):
    return page.relative_to(ROOT).as_posix()


def without_code(text):
    """The text without its fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


# ---------------------------------------------------------------------------------------------
# docs/step.md


def test_step_page_is_what_its_generator_prints():
    spec = importlib.util.spec_from_file_location("make_step", DOCS / "make_step.py")
    make_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_step)
    want = make_step.render()
    got = (DOCS / "step.md").read_text()
    diff = "".join(list(difflib.unified_diff(got.splitlines(True), want.splitlines(True),
                                             "docs/step.md", "python docs/make_step.py"))[:40])
    assert got == want, ("docs/step.md is stale; run: python docs/make_step.py > "
                         f"docs/step.md\n{diff}")


# ---------------------------------------------------------------------------------------------
# links


def heading_anchors(page):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated anchor numbered -1, -2, ..."""
    anchors, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def relative_links():
    """(page, target path or '', anchor or '') of every relative link of every page."""
    for page in pages():
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)",
                                 without_code(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):          # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            yield page, path, anchor


def test_every_relative_link_resolves():
    broken = [f"{name(page)}: {path}" for page, path, _ in relative_links()
              if path and not (page.parent / path).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_every_anchor_names_a_heading():
    broken = []
    for page, path, anchor in relative_links():
        target = (page.parent / path) if path else page
        if (anchor and target.suffix == ".md" and target.exists()
            and anchor not in heading_anchors(target)):
            broken.append(f"{name(page)}: {path}#{anchor}")
    assert not broken, "anchors that name no heading of their page:\n" + "\n".join(broken)


# ---------------------------------------------------------------------------------------------
# commands


def command_argv(words):
    """The `gpt2np` argv of a shown command: `python train.py X` is `gpt2np train X`."""
    if words[:3] == ["python", "-m", "gpt2np"]:
        return words[3:]
    if words[:2] == ["python", "train.py"]:
        return ["train"] + words[2:]
    return words[1:]


def shown_commands():
    """(page, argv after the command name) of every gpt2np / python -m gpt2np / python train.py
    command in a ```bash block: continuation lines joined, comments dropped, cut
    at shell operators."""
    for page in pages():
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(), flags=re.M | re.S):
            for line in block.replace("\\\n", " ").splitlines():
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                try:
                    tokens = list(lexer)
                except ValueError as e:
                    raise AssertionError(f"{name(page)}: cannot split {line!r}: {e}") from None
                segment = []
                for token in tokens + [";"]:
                    if token not in SHELL_OPERATORS:
                        segment.append(token)
                        continue
                    text = " ".join(segment)
                    if COMMAND.match(text):
                        yield page, text, command_argv(segment)
                    segment = []


class Parsed(BaseException):
    """Raised by the patched parser once a command's flags parsed: the command
    stops before it runs."""


@pytest.fixture
def parse_only(monkeypatch):
    """gpt2np's ArgumentParser raises Parsed after its outermost successful parse; any other parser
    is an error (so no command can run past a parser this test does not stop)."""
    depth = [0]

    def stopping(original):
        def parse(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed(result)
            return result
        return parse

    base = argparse.ArgumentParser.parse_known_args

    def ours_only(self, *args, **kwargs):
        if not isinstance(self, ArgumentParser):
            raise AssertionError(f"{self.prog}: not a gpt2np.errors.ArgumentParser")
        return base(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", ours_only)
    monkeypatch.setattr(ArgumentParser, "parse_known_args",
                        stopping(ArgumentParser.parse_known_args))
    monkeypatch.setattr(ArgumentParser, "parse_args", stopping(argparse.ArgumentParser.parse_args))


def test_the_pages_show_commands():
    assert any(True for _ in shown_commands()), "no gpt2np or train.py command in any ```bash block"


def test_every_shown_command_parses(parse_only):
    failed = []
    for page, text, argv in shown_commands():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = gpt2np_command.main(argv)
            except Parsed:
                continue
        if code != 0:         # 0: --help or --version, which exit before any work
            failed.append(f"{name(page)}: {text}\n    exit {code}: {err.getvalue().strip()}")
    assert not failed, "commands their parser rejects:\n" + "\n".join(failed)


# ---------------------------------------------------------------------------------------------
# issue 36's limits


def test_readme_is_at_most_250_lines():
    n = len(README.read_text().splitlines())
    assert n <= README_LINES, (f"README.md has {n} lines (at most {README_LINES}): move a "
                               "section to docs/")


def test_docs_has_at_least_5_pages_of_at_most_500_lines():
    docs = sorted(DOCS.rglob("*.md"))
    assert len(docs) >= MIN_PAGES, f"docs/ has {len(docs)} pages (at least {MIN_PAGES})"
    long = [f"{name(p)}: {n} lines" for p in docs
            if (n := len(p.read_text().splitlines())) > PAGE_LINES]
    assert not long, f"pages over {PAGE_LINES} lines:\n" + "\n".join(long)


def test_dates_only_in_the_changelog_and_benchmarks():
    dated = [f"{name(p)}: {', '.join(DATE.findall(p.read_text()))}" for p in pages()
             if not name(p).startswith("docs/benchmarks") and DATE.search(p.read_text())]
    assert not dated, ("date stamps belong in CHANGELOG.md or docs/benchmarks*.md:\n"
                       + "\n".join(dated))


def sentence_lengths(text):
    """Words per prose sentence of a page: code blocks, tables, headings and indented lines left
    out, list markers dropped, inline code counted as one word; sentences split after . ! ? before a
    capital, a parenthesis or inline code; fragments under 3 words not counted."""
    prose, in_code = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_code = not in_code
            continue
        if in_code or not line.strip() or line.lstrip().startswith(("|", "#", "    ")):
            prose.append("\n")
            continue
        prose.append(re.sub(r"^\s*([-*+]|\d+\.)\s+", "", line))
    flat = re.sub(r"`[^`]*`", "X", " ".join(prose))
    lengths = []
    for paragraph in flat.split("\n"):
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(`])", paragraph):
            if len(sentence.split()) >= 3:
                lengths.append(len(sentence.split()))
    return lengths


def test_median_sentence_is_at_most_25_words():
    lengths = [n for p in pages() for n in sentence_lengths(p.read_text())]
    median = statistics.median(lengths)
    by_page = ", ".join(f"{name(p)} {statistics.median(s):.0f}" for p in pages()
                        if (s := sentence_lengths(p.read_text())))
    assert median <= MEDIAN_WORDS, (f"median sentence {median:.0f} words (at most "
                                    f"{MEDIAN_WORDS}): {by_page}")
