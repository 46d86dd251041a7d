"""Captured decode steps: a CUDA graph per decode batch size bucket (1, 2, 4, ..., 128, ...),
replayed each step, as vLLM's and llama.cpp's CUDA backends do.

A decode batch of n rows runs as the graph of the smallest bucket >= n: its inputs are copied into
the bucket's static device buffers, the rows past n padded, the graph launched, and the first n
rows of its static output read back. Batches larger than the largest bucket run eagerly.

Padding contract with the kernels: a padded row has token 0, position 0, context length 1, an
all-zero block table row and slot -1, and the K/V store writes nothing for a slot < 0 (vLLM's
PAD_SLOT_ID), so padded rows read block 0 and write nothing; their outputs are discarded.

The captured function must be device-only (no host synchronisation, no allocation from a host
size that changes): it is run once on the capture stream first (kernel compilation and the memory
pool's blocks: the warm-up), then captured with `cupy.cuda.Stream.begin_capture()` /
`end_capture()`. Its output buffer is valid until the next replay of any bucket.

CuPy is imported lazily (`xp`, for tests a stand-in with the same few names). Never run on a GPU yet.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 128
# what a padded row holds in each input (see the module's docstring); inputs not listed pad with 0
PAD_VALUES = {"token_ids": 0, "positions": 0, "context_lens": 1, "block_tables": 0, "slot_mapping": -1}


def buckets_up_to(max_batch: int = DEFAULT_MAX_BATCH) -> tuple[int, ...]:
    """Powers of two from 1 up to and including the first >= max_batch."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding n rows, or None where n exceeds them all (run eagerly)."""
    if n < 1:
        raise ValueError(f"a decode batch has at least one row, got {n}")
    return next((b for b in buckets if b >= n), None)


def pad_to(array: np.ndarray, shape: tuple[int, ...], value: int | float = 0) -> np.ndarray:
    """`array` in the corner of an array of `shape` filled with `value` (rows up to a bucket, and a
    block table's columns up to the captured width)."""
    if array.ndim != len(shape) or any(a > s for a, s in zip(array.shape, shape)):
        raise ValueError(f"an array of shape {array.shape} does not fit {shape}")
    if array.shape == tuple(shape):
        return array
    out = np.full(shape, value, dtype=array.dtype)
    out[tuple(slice(0, a) for a in array.shape)] = array
    return out


def pad_rows(array: np.ndarray, bucket: int, value: int | float = 0) -> np.ndarray:
    """`array`'s rows (axis 0) followed by rows of `value` up to `bucket` rows."""
    if array.shape[0] > bucket:
        raise ValueError(f"{array.shape[0]} rows do not fit a bucket of {bucket}")
    return pad_to(array, (bucket, *array.shape[1:]), value)


def pad_batch(inputs: Mapping[str, np.ndarray], bucket: int,
              pad_values: Mapping[str, int | float] = PAD_VALUES) -> dict[str, np.ndarray]:
    """Every input padded to `bucket` rows with its pad value (PAD_VALUES; 0 for others)."""
    return {name: pad_rows(np.asarray(a), bucket, pad_values.get(name, 0)) for name, a in inputs.items()}


@dataclass
class _Captured:
    graph: Any                    # cupy.cuda.graph.Graph
    inputs: dict[str, Any]        # static device buffers, `bucket` rows each
    output: Any                   # static device output, `bucket` rows


class DecodeGraphs:
    """Graphs of `step(inputs) -> output` (device arrays in, a device array out, row i of the output
    row i's), one per bucket, captured on first use or by `warm_up`."""

    def __init__(self, step: Callable[[dict[str, Any]], Any], buckets: tuple[int, ...] | None = None,
                 xp: Any = None, pad_values: Mapping[str, int | float] = PAD_VALUES):
        if xp is None:
            import cupy as xp
        self.xp, self.step, self.pad_values = xp, step, pad_values
        self.buckets = buckets or buckets_up_to()
        self.stream = xp.cuda.Stream(non_blocking=True)
        self.graphs: dict[int, _Captured] = {}
        self.replays = self.eager = 0

    def capture(self, bucket: int, example: Mapping[str, np.ndarray]) -> None:
        """Warm `step` up on the capture stream with `example` padded to `bucket` rows, then capture it.
        The example's other dimensions are the graph's (a block table as wide as the longest context)."""
        xp = self.xp
        inputs = {name: xp.asarray(a) for name, a in pad_batch(example, bucket, self.pad_values).items()}
        with self.stream:
            self.step(inputs)                 # compiles the kernels, fills the memory pool for this stream
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                output = self.step(inputs)
            finally:
                graph = self.stream.end_capture()
        self.graphs[bucket] = _Captured(graph, inputs, output)

    def warm_up(self, example: Mapping[str, np.ndarray]) -> None:
        """Capture every bucket at start (the example's first row stands for any batch; its block table
        as wide as any step's will be)."""
        for bucket in self.buckets:
            if bucket not in self.graphs:
                self.capture(bucket, {k: np.asarray(a)[:1] for k, a in example.items()})
        log.info("captured decode graphs for batches of %s rows", ", ".join(map(str, self.buckets)))

    def run(self, inputs: Mapping[str, np.ndarray]) -> Any:
        """The step's output for these n rows (a device array of n rows): replayed from the bucket's
        graph, or run eagerly above the largest bucket."""
        n = len(next(iter(inputs.values())))
        bucket = bucket_for(n, self.buckets)
        if bucket is None:
            self.eager += 1
            return self.step({k: self.xp.asarray(a) for k, a in inputs.items()})
        if bucket not in self.graphs:
            self.capture(bucket, inputs)
        captured = self.graphs[bucket]
        if any(any(a > b for a, b in zip(np.shape(host)[1:], captured.inputs[name].shape[1:]))
               for name, host in inputs.items()):
            self.eager += 1                     # wider than captured (a longer block table): not this graph
            return self.step({k: self.xp.asarray(a) for k, a in inputs.items()})
        for name, host in inputs.items():       # rows to the bucket, columns to the captured width
            static = captured.inputs[name]
            host = pad_to(np.asarray(host, dtype=static.dtype), static.shape, self.pad_values.get(name, 0))
            static.set(host, stream=self.stream)
        captured.graph.launch(stream=self.stream)
        self.stream.synchronize()
        self.replays += 1
        return captured.output[:n]
