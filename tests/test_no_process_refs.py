"""The tracked text says things themselves: no references a reader cannot follow (a tracker's
number, the label of a measurement run, a working period of the authors). Code, scripts, configuration and documents
are read; binary files and the raw data under bench/results/ (CSV, JSON, logs) are not."""
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT_SUFFIXES = (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ".rst")
DATA_DIR = "bench/results/"
DATA_SUFFIXES = (".csv", ".json", ".log", ".xml")
SELF = "tests/test_no_process_refs.py"  # its examples of what the patterns catch

PATTERNS = {
    # the word issue or PR followed by a number, or a parenthesised hash number
    "issue": re.compile(r"\bissues?\s+#?\d+|\(#\d+\)|\b(?:PR|pull request)\s*#?\d+",
                        re.IGNORECASE),
    # a capital R followed by one to three digits as a word; not an exponent or part of a name
    "run label": re.compile(r"(?<![\w^$%.])R\d{1,3}(?![\w^])"),
    "session": re.compile(r"\b(?:this|that|previous|earlier|last|next) session\b|"
                          r"\bsessions? of\b", re.IGNORECASE),
}


def tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for path in out.decode().split("\0"):
        if (not path or (path.startswith(DATA_DIR) and path.endswith(DATA_SUFFIXES))
                or path == SELF):
            continue
        full = os.path.join(REPO, path)
        if not os.path.isfile(full):
            continue  # deleted in the working tree
        with open(full, "rb") as f:
            head = f.read(2)
        if path.endswith(TEXT_SUFFIXES) or ("." not in os.path.basename(path) and head == b"#!"):
            files.append(path)
    return files


def hits(pattern: re.Pattern, lines) -> list[tuple[int, str]]:
    return [(n, line.strip()) for n, line in enumerate(lines, 1) if pattern.search(line)]


def test_patterns_catch_references_and_spare_formulas():
    # Examples assembled from parts, so that this file holds no such reference itself.
    issue, run, session = "issue", "R", "session"
    caught = {"issue": [f"{issue} 12's goal", f"{issue}s 12 and 13", "fixed (#16)", "see PR 7"],
              "run label": [f"{run}12 measured", f"runs {run}76-{run}81", f"({run}5)",
                            f"{run}5/{run}6"],
              "session": [f"made in this {session}", f"a {session} of the project"]}
    spared = {"issue": ["no issue here", "#1f77b4", "issue_idx = 3"],
              "run label": [f"{run}^2 = 0.9", f"{run}2D2", "dtype=R32x", f"%{run}12",
                            "HIDDEN_R2"],
              "session": ['scope="session"', "the pytest session's environment"]}
    for name, pattern in PATTERNS.items():
        for text in caught[name]:
            assert pattern.search(text), (name, text)
        for text in spared[name]:
            assert not pattern.search(text), (name, text)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_no_reference_a_reader_cannot_follow(name):
    files = tracked_text_files()
    assert any(path.endswith(".py") for path in files) and "README.md" in files
    found = []
    for path in files:
        with open(os.path.join(REPO, path), encoding="utf-8", errors="replace") as f:
            found += [f"{path}:{n}: {line[:120]}" for n, line in hits(PATTERNS[name], f)]
    assert not found, (f"{len(found)} {name} reference(s); say the thing itself:\n"
                       + "\n".join(found[:40]))
