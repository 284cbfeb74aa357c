"""Every file under eval/bench/ is cited by a doc: README.md, docs/*.md or an eval/**/README.md names its path, as
the doc writes it (from the repository root, `eval/bench/...`, or relative to the doc, `../eval/bench/...`), with
shell brace patterns (`foo_{a,b}_run{1..3}.json`, nested and several in one path) and `*` globs expanded.

eval/bench/README.md is not counted: it lists every file there (tests/test_cli.py requires it), so a file it lists
would count as cited whatever the docs say. A file no doc cites backs no claim: cite it where a doc makes its claim,
or `git rm` it (its history stays in git)."""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "eval" / "bench"
# a path that names bench/: word characters, dots, slashes, dashes, and the brace and glob characters around them
_PATH = re.compile(r"[\w./{},*-]*bench/[\w./{},*-]+")
_SEQUENCE = re.compile(r"(-?\d+)\.\.(-?\d+)")


def expand_braces(text: str) -> list[str]:
    """Bash's brace expansion: the leftmost `{...}` holding a top-level comma (or a `{1..3}` sequence) gives one
    word per alternative, each alternative and the rest of the word expanded in turn; `{x}` stays as written."""
    for start, char in enumerate(text):
        if char != "{":
            continue
        depth, commas = 0, []
        for end in range(start, len(text)):
            if text[end] == "{":
                depth += 1
            elif text[end] == "}":
                depth -= 1
                if depth == 0:
                    break
            elif text[end] == "," and depth == 1:
                commas.append(end)
        else:
            return [text]  # no closing brace: the rest is literal
        body = text[start + 1 : end]
        sequence = _SEQUENCE.fullmatch(body)
        if commas:
            cuts = [start, *commas, end]
            options = [text[a + 1 : b] for a, b in zip(cuts, cuts[1:])]
        elif sequence:
            first, last = int(sequence[1]), int(sequence[2])
            step = 1 if last >= first else -1
            options = [str(i) for i in range(first, last + step, step)]
        else:
            continue  # `{x}`: literal; a brace inside it may still expand
        alternatives = [word for option in options for word in expand_braces(option)]
        tails = expand_braces(text[end + 1 :])
        return [text[:start] + word + tail for word in alternatives for tail in tails]
    return [text]


def cited_files(text: str, doc_dir: Path, held: set[str]) -> set[str]:
    """The files of `held` (paths relative to eval/bench/) that `text`, a doc in `doc_dir`, cites."""
    found = set()
    for match in _PATH.finditer(text):
        for path in expand_braces(match.group(0).rstrip(".,")):
            base = ROOT if path.startswith("eval/bench/") else doc_dir
            resolved = Path(os.path.normpath(base / path))
            if BENCH not in resolved.parents:
                continue  # another bench/ (runs/bench/, a GPU run's output directory)
            name = resolved.relative_to(BENCH).as_posix()
            found |= set(fnmatch.filter(held, name)) if "*" in name else {name} & held
    return found


def _held() -> set[str]:
    return {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*") if p.is_file()} - {"README.md"}


def _docs() -> list[Path]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "eval").rglob("README.md"))]
    return [doc for doc in docs if doc != BENCH / "README.md"]


@pytest.mark.parametrize(("pattern", "words"), [
    ("a_{x,y}_run{1..3}.json", ["a_x_run1.json", "a_x_run2.json", "a_x_run3.json", "a_y_run1.json", "a_y_run2.json",
                                "a_y_run3.json"]),
    ("t{,_12repeats,_1adapter}.{json,md}", ["t.json", "t.md", "t_12repeats.json", "t_12repeats.md", "t_1adapter.json",
                                             "t_1adapter.md"]),
    ("x_{a,b{c,d}}.txt", ["x_a.txt", "x_bc.txt", "x_bd.txt"]),  # nested
    ("r{3..1}", ["r3", "r2", "r1"]),
    ("{x}_{1,2}", ["{x}_1", "{x}_2"]),  # no comma: literal, as in bash
    ("{x{a,b}}", ["{xa}", "{xb}"]),
    ("open{a,b", ["open{a,b"]),
    ("plain.json", ["plain.json"]),
])
def test_brace_expansion_as_bash_does_it(pattern, words):
    assert expand_braces(pattern) == words


def test_citations_as_docs_write_them():
    held = {"a_1.json", "a_2.json", "a_3.json", "b_run1.txt", "b_run2.txt", "c.md", "sub/d.json"}
    text = ("[runs](../eval/bench/a_{1,2}.json) and `eval/bench/b_run*.txt`, eval/bench/sub/d.json. "
            "runs/bench/c.md is another directory; ../eval/bench/zz.json is not held")
    assert cited_files(text, ROOT / "docs", held) == {"a_1.json", "a_2.json", "b_run1.txt", "b_run2.txt",
                                                       "sub/d.json"}
    assert cited_files("../../bench/c.md", ROOT / "eval" / "results" / "x", held) == {"c.md"}
    assert cited_files("eval/bench/c.md", ROOT / "docs", held) == {"c.md"}  # from the root, wherever the doc is


def test_every_bench_file_is_cited_by_a_doc():
    held = _held()
    cited = set()
    for doc in _docs():
        cited |= cited_files(doc.read_text(), doc.parent, held)
    assert held, "eval/bench/ holds no files"
    uncited = sorted(held - cited)
    assert not uncited, (f"{len(uncited)} of {len(held)} files in eval/bench/ are cited by no doc (README.md, "
                         f"docs/*.md, eval/**/README.md): cite or git rm them: {uncited}")
