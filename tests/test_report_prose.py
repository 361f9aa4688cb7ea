"""The committed reports stay short: their tables and plots carry the numbers, the prose beside them
says what was measured, the caveats and the answers."""

from pathlib import Path

import pytest

from cs336_systems.reports.index import result_directories

REPORTS = Path(__file__).resolve().parents[1] / "reports"
# A measured report (one directory per device) says how, the caveats and what its tables answer.
MEASURED_PROSE_WORDS = 300
# A closed-form report is a written derivation: each part's answer and the formulas it rests on.
CLOSED_FORM_PROSE_WORDS = 800
# The provenance lines the report headers write (reports.header, reports._closed_form_header).
HEADER_BULLETS = ("- device:", "- software:", "- run ", "- measured on earlier code:", "- model sizes:", "- timing:",
                  "- date:", "- command:", "- units:", "- FlashAttention GPU source:")
INDEX = "README.md"  # the index of answers, not a report


def prose_words(markdown: str) -> int:
    """Words on the lines that are neither table rows, headings, header bullets nor blank."""
    return sum(len(line.split()) for line in markdown.splitlines()
               if line.strip() and not line.startswith(("|", "#", *HEADER_BULLETS)))


# The committed reports: a local CPU run's (reports/cpu/, git-ignored) are not results and are not read.
MEASURED = sorted(path for slug in result_directories(REPORTS) for path in (REPORTS / slug).glob("*.md"))
CLOSED_FORM = sorted(path for path in REPORTS.glob("*.md") if path.name != INDEX)


def test_every_report_directory_is_found():
    assert {path.parent.name for path in MEASURED} >= {"h100", "h200"}
    assert "communication_accounting.md" in {path.name for path in CLOSED_FORM}


@pytest.mark.parametrize("path, limit", [(p, MEASURED_PROSE_WORDS) for p in MEASURED]
                         + [(p, CLOSED_FORM_PROSE_WORDS) for p in CLOSED_FORM],
                         ids=lambda value: str(value.relative_to(REPORTS)) if isinstance(value, Path) else None)
def test_report_prose_stays_within_its_word_limit(path, limit):
    words = prose_words(path.read_text())
    assert words <= limit, f"{path.relative_to(REPORTS.parent)}: {words} words of prose, over {limit}"


def test_prose_count_skips_tables_headings_and_header_bullets():
    markdown = ("# title\n\n- device: NVIDIA H100\n- run 1: 2026-01-01, `pytest`\n\n## Section\n\n"
                "Two words.\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n- a finding\n")
    assert prose_words(markdown) == 2 + 3  # a bullet's dash is a word to str.split
