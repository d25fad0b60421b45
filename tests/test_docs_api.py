"""docs/api.md is checked against the code: public names, config and sampling fields, stats() keys.

Every list here comes from the code (``__all__``, dataclass fields, the dicts the engines return), never
from a copy, so a key or field added anywhere fails this test until the page documents it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import ourobatch
from ourobatch import Engine, EngineConfig, SamplingParams, SyncEngine
from ourobatch.testing import make_tiny_checkpoint

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
WHERE = ("both", "async `Engine` only", "CUDA only")  # the stats table's "where" column


def code_names(text: str) -> set[str]:
    """Every identifier inside a fenced code block or a `code span` of `text`."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
    return {name for code in fenced + inline for name in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", code)}


def section(title: str) -> str:
    """The text of the '## <title>' section of docs/api.md, up to the next '## ' heading."""
    parts = re.split(r"^## ", API_MD.read_text(), flags=re.M)
    found = [p for p in parts if p.split("\n", 1)[0].strip() == title]
    assert len(found) == 1, f"docs/api.md has no single '## {title}' section"
    return found[0]


def stats_table() -> dict[str, str]:
    """key -> its 'where' cell, from the stats() section's table (rows may list several keys)."""
    table: dict[str, str] = {}
    for line in section("stats()").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("key", "") or set(cells[0]) <= set("-"):
            continue
        assert len(cells) == 3, f"stats table row needs key | meaning | where: {line!r}"
        assert cells[2] in WHERE, f"'where' must be one of {WHERE}: {line!r}"
        for key in re.findall(r"`([^`]+)`", cells[0]):
            assert key not in table, f"stats key {key!r} is listed twice"
            table[key] = cells[2]
    return table


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("docs") / "m")


@pytest.fixture(scope="module")
def stats_keys(ckpt) -> tuple[set[str], set[str]]:
    """(SyncEngine.stats() keys, async Engine.stats() keys) of engines built on a tiny checkpoint."""
    import anyio

    config = EngineConfig(model=str(ckpt), block_size=4, num_kv_blocks=16, max_model_len=32, max_num_seqs=2)
    with SyncEngine(config) as llm:
        llm.generate([1, 2], {"max_tokens": 2})
        sync = set(llm.stats())

    async def async_stats() -> set[str]:
        async with Engine(config) as engine:
            await engine.generate([1, 2], {"max_tokens": 2})
            return set(engine.stats())

    return sync, anyio.run(async_stats)


def test_every_public_name_is_documented():
    missing = set(ourobatch.__all__) - code_names(API_MD.read_text())
    assert not missing, f"docs/api.md does not name {sorted(missing)} (in a `code span`)"


@pytest.mark.parametrize("cls, title", [(EngineConfig, "EngineConfig"), (SamplingParams, "SamplingParams")])
def test_every_field_is_documented_in_its_section(cls, title):
    missing = {f.name for f in dataclasses.fields(cls)} - code_names(section(title))
    assert not missing, f"docs/api.md's '## {title}' section does not name {sorted(missing)}"


def test_every_stats_key_is_in_the_table_and_async_only_keys_are_marked(stats_keys):
    sync, both = stats_keys
    assert sync <= both, f"SyncEngine has keys the async Engine lacks: {sorted(sync - both)}"
    table = stats_table()
    missing = both - set(table)
    assert not missing, f"docs/api.md's stats table lacks {sorted(missing)}"
    for key in both:
        expected = "both" if key in sync else "async `Engine` only"
        assert table[key] == expected, f"stats key {key!r} is marked {table[key]!r}, but it is {expected!r}"


def test_the_stats_table_lists_no_key_the_engines_lack(stats_keys):
    _, both = stats_keys
    # CUDA-only keys cannot be observed on a CPU run; everything else must exist.
    stale = {key for key, where in stats_table().items() if where != "CUDA only"} - both
    assert not stale, f"docs/api.md's stats table lists keys no engine returns: {sorted(stale)}"


def test_the_table_parser_sees_marks_and_rows():
    # Guards the helpers above: a parser that found nothing would make the tests above pass vacuously.
    table = stats_table()
    assert len(table) >= 20 and set(table.values()) == set(WHERE)
    assert {"model", "cuda_graphs"} <= code_names(section("EngineConfig"))
