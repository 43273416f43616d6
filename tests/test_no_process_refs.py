"""The tracked text says things themselves: no references a reader cannot follow (an issue
number, a run label such as R12, a working session). Code, scripts, configuration and documents
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
    # "issue 12", "issues 12 and 13", "issue #4", "(#16)", "PR 7"
    "issue": re.compile(r"\bissues?\s+#?\d+|\(#\d+\)|\b(?:PR|pull request)\s*#?\d+",
                        re.IGNORECASE),
    # "R12", "R76-R81", "runs R5/R6"; not "R^2" or "R2D2"
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
    caught = {"issue": ["issue 12's goal", "issues 12 and 13", "fixed (#16)", "see PR 7"],
              "run label": ["R12 measured", "runs R76-R81", "(R5)", "R5/R6"],
              "session": ["made in this session", "a session of the project"]}
    spared = {"issue": ["no issue here", "#1f77b4", "issue_idx = 3"],
              "run label": ["R^2 = 0.9", "R2D2", "dtype=R32x", "%R12", "HIDDEN_R2"],
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
