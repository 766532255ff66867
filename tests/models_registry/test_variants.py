"""Grouping a repo's GGUF files into the variants the picker offers."""

from __future__ import annotations

from models_registry.downloads import gguf_variants


def test_split_parts_together_projectors_apart() -> None:
    files = [
        {"name": "README.md", "size": 10},
        {"name": "Qwen3-4B-Q8_0.gguf", "size": 4_000},
        {"name": "Qwen3-4B-F16-00002-of-00002.gguf", "size": 3_000},
        {"name": "Qwen3-4B-F16-00001-of-00002.gguf", "size": 5_000},
        {"name": "mmproj-Qwen3-4B-f16.gguf", "size": 700},
        {"name": "Q4/Qwen3-4B-Q4_K_M.gguf", "size": None},
    ]
    found = gguf_variants(files)
    by_name = {v["name"]: v for v in found["variants"]}
    assert set(by_name) == {"Qwen3-4B-Q8_0.gguf", "Qwen3-4B-F16.gguf", "Q4/Qwen3-4B-Q4_K_M.gguf"}
    split = by_name["Qwen3-4B-F16.gguf"]
    assert split["files"] == [
        "Qwen3-4B-F16-00001-of-00002.gguf",
        "Qwen3-4B-F16-00002-of-00002.gguf",
    ]
    assert split["complete"] and split["sizeBytes"] == 8_000
    assert split["modelFile"] == "Qwen3-4B-F16-00001-of-00002.gguf"
    assert split["allowPatterns"] == split["files"]
    # No size from the hub: no invented number.
    assert by_name["Q4/Qwen3-4B-Q4_K_M.gguf"]["needsAtLeastBytes"] is None
    assert found["projectors"] == [{"name": "mmproj-Qwen3-4B-f16.gguf", "sizeBytes": 700}]


def test_an_incomplete_split_is_flagged() -> None:
    files = [{"name": "x-00001-of-00003.gguf", "size": 1}]
    (variant,) = gguf_variants(files)["variants"]
    assert not variant["complete"] and variant["expectedParts"] == 3
