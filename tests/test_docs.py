"""The README and docs/ against what they describe: every node input in the node docs (from the
/object_info snapshots that tests/integration/test_object_info_snapshot.py checks against the real
servers), the headline table against the benchmark JSON, the compatibility matrix's rows against
tests/compat_matrix.py, and no project history in them."""
import json
import re
from pathlib import Path

import pytest

import compat_matrix
import doc_tables

PACK_ROOT = Path(__file__).resolve().parent.parent
README = PACK_ROOT / "README.md"
DOCS = [README, PACK_ROOT / "docs" / "benchmarks.md", PACK_ROOT / "docs" / "compatibility.md"]
SNAPSHOTS = sorted((PACK_ROOT / "tests" / "fixtures").glob("object_info_*.json"))


def node_sections(text) -> dict:
    """{node id: its section's text} for each "### Display name — `NodeId`" heading."""
    parts = re.split(r"^### .*?`(\w+)`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def section(text, heading) -> str:
    """The text under a "## heading" up to the next "## "."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"no section '## {heading}'"
    return match.group(1)


def test_node_sections_are_found_by_their_headings():
    sections = node_sections("### A — `NodeA`\n| `x` |\n### B — `NodeB`\ntext `y`\n## Next\n")
    assert list(sections) == ["NodeA", "NodeB"]
    assert "`x`" in sections["NodeA"] and "`x`" not in sections["NodeB"]


@pytest.mark.parametrize("snapshot", SNAPSHOTS, ids=lambda p: p.stem)
def test_readme_documents_every_node_and_every_input(snapshot):
    assert len(SNAPSHOTS) == 2
    nodes = json.loads(snapshot.read_text())
    sections = node_sections(section(README.read_text(), "Nodes"))
    assert sorted(sections) == sorted(nodes)
    for name, node in nodes.items():
        heading = re.search(rf"^### (.*?) — `{name}`$", README.read_text(), flags=re.M).group(1)
        assert heading == node["display_name"], name
        for kind in ("required", "optional"):
            for input_name in node["input"].get(kind, {}):
                # a table row that starts with the input, so a mention in passing does not count
                assert re.search(rf"^\| `{input_name}` \|", sections[name], flags=re.M), \
                    f"README's {name} section has no row for input {input_name!r}"


def test_readme_job_table_is_the_table_from_the_whole_job_runs():
    text = README.read_text()
    marker = "<!-- job: tests/doc_tables.py --job writes this table from tests/bench/results/ -->\n"
    assert marker in text and text.index(marker) < text.index("<!-- headline:")  # the README's first table
    assert text.split(marker, 1)[1].startswith(doc_tables.job_table() + "\n")
    table = doc_tables.job_table()
    assert "| turbo, 64 GiB, job 1 | `pack_fast` | 53.9 | 1.43x | 11.7 | 3.1 | 26.6 (16.9) | 1.37 | 7.0 |" in table
    assert "| turbo, 64 GiB, job 2 | `pack` (the shipped example) | 21.8 | 1.70x | 0.9 | 0.2 | 11.0 (1.6) |" in table
    assert "| turbo, 32 GiB, job 2 | `pack_fast` | 29.4 | 1.31x |" in table
    assert "| turbo, 64 GiB, again, job 1 | `pack_fast` | 57.2 | 1.22x | 11.6 | 4.4 | 27.3 (17.7) | 1.36 |" in table
    assert "| turbo, 64 GiB, again, job 2 | `pack_fast` | 22.4 | 1.30x |" in table
    assert "pack_fast_no_lora" not in table and "again, job 1 | `pack`" not in table  # shown: the template, pack_fast
    assert "| default, 32 GiB, job 1 | `pack` (the shipped example) | 84.1 | 1.24x | 17.5 | 3.1 | 47.9 (22.6) |" in table
    assert "| default, 32 GiB, job 2 | `pack` (the shipped example) | 48.8 | 1.27x |" in table
    assert "| default, 64 GiB, job 2 | `pack_fast` | 36.0 | 1.31x |" in table
    assert ("| turbo, 32 GiB, file's layers kept, job 1 | `pack` (the shipped example) | 61.9 | 1.14x | 14.6 | 4.7 |"
            in table)
    assert "| turbo, 32 GiB, file's layers kept, job 2 | `pack_fast` | 35.6 | 1.11x |" in table
    assert "| turbo, 32 GiB, H200, job 1 | `pack_fast` | 74.8 | 1.15x | 18.9 | 5.7 | 34.3 (22.8) |" in table
    assert "| turbo, 32 GiB, H200, job 2 | `pack_fast` | 35.3 | 1.29x | 2.9 | 3.7 |" in table
    assert "H200, job 4" not in table  # the template's fourth job ran alone there: nothing to set it against


def test_readme_headline_is_the_table_from_the_benchmark_json():
    text = README.read_text()
    marker = "<!-- headline: tests/doc_tables.py writes this table from tests/bench/results/ -->\n"
    assert marker in text
    assert text.split(marker, 1)[1].startswith(doc_tables.headline() + "\n")


def test_readme_formats_tables_are_the_tables_from_their_runs():
    marker = "<!-- formats: tests/doc_tables.py --formats writes this table -->\n"
    parts = README.read_text().split(marker)
    assert len(parts) == len(doc_tables.FORMATS_RUNS) + 1
    for names, before, table in zip(doc_tables.FORMATS_RUNS, parts, parts[1:]):
        caption = before.rstrip().rsplit("\n\n", 1)[1]
        assert all(name in caption for name in names)  # the caption names each run
        first, *more = (doc_tables.load(name) for name in names)
        assert table.startswith(doc_tables.formats_table(first, more=tuple(more)) + "\n")


def test_headline_rows_read_the_runs_they_name():
    table = doc_tables.headline()
    assert "| ComfyUI UNETLoader bf16 (reference) | no cap | 3.096 | 1.00x | 29.9 | 1.0000 |" in table
    # the bench reads the GPU's used memory (NVML; dynamic VRAM's pages are outside PyTorch's peak, 4.9 GiB here)
    # s/step leaves out the profiled second step: the third, 3.536 s against the reference's 6.584 s
    assert ("| LoadH3Quantized `auto` + SetAttentionBackend `sage` (SageAttention 2) | 24 GiB | 3.536 | 1.86x | "
            "24.3 | 0.9998 |") in table


def test_compatibility_matrix_lists_the_features_of_compat_matrix():
    text = DOCS[2].read_text()
    rows = re.findall(r"^\| (.+?) \| (.+?) \| (.+?) \|$", text, flags=re.M)
    assert rows[0] == ("Feature", "ComfyUI 0.3.75", "ComfyUI 0.33.0")
    assert [feature for feature, _, _ in rows[1:]] == [feature for feature, _ in compat_matrix.FEATURES]
    for _, *cells in rows[1:]:
        assert all(re.fullmatch(r"pass \d+|skipped: .+", cell) for cell in cells), cells


def test_docs_link_only_to_files_that_exist():
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_say_the_state_not_the_story(doc):
    text = doc.read_text()
    for story in (r"\bissue \d+", r"\brun [1-9]\b", r"\bthis round\b", r"\bsince\b", r"\bbefore the\b.*\bchanges?\b",
                  r"\bnow\b", r"\bno longer\b"):
        assert not re.search(story, text, flags=re.I), f"{doc.name}: {re.search(story, text, flags=re.I).group(0)!r}"


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 320  # the job and headline tables are most of it
