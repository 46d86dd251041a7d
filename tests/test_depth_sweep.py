"""The KV bytes the depth sweep (loadtest/bench_forward.py --depths) reports per decode step:
Gemma 3 270M's windowed layers read at most their 512-position window, its global layers
(every sixth) the whole context; q8_0 rows are 34 bytes per 32 values."""
from __future__ import annotations

import sys
from pathlib import Path

from shared.gguf_file import GGUFFile
from shared.model_config import ModelConfig
from shared.model_registry import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "loadtest"))
from depth_sweep import kv_bytes_per_step  # noqa: E402


def test_kv_bytes_per_step_counts_windows_and_codecs():
    config = ModelConfig.from_gguf(GGUFFile(resolve_model("gemma3-270m")))
    assert (config.n_layers, config.n_kv_heads, config.head_dim, config.sliding_window) == (18, 1, 256, 512)
    f16_row = 2 * 256 * 2                                  # K and V, 256 values of 2 bytes
    assert kv_bytes_per_step(config, 8192, "f16") == (3 * 8192 + 15 * 512) * f16_row
    assert kv_bytes_per_step(config, 300, "f16") == 18 * 300 * f16_row
    assert kv_bytes_per_step(config, 8192, "q8_0") == (3 * 8192 + 15 * 512) * 2 * (256 // 32 * 34)
