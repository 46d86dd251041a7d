"""scheduler/block_format.py: one KV block as one self-checking value. A value round-trips bit for
bit; anything that does not check out (another model, codec, block size, geometry or format
version, truncation, any flipped byte, token ids that do not hash to the block's hash) is
rejected with a reason, never decoded into wrong K/V."""
from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.block_format import MAGIC, VERSION, BlockRejected, Geometry, KVBlock, decode, encode
from scheduler.block_manager import BlockManager, block_hash

GEOMETRY = Geometry(fingerprint="7ca25d631175b423cbef161bd44ac293", codec="f32", block_size=16, n_layers=3,
                    kv_heads=2, head_dim=8)


def make_block(seed: int = 0, parent: bytes | None = None, geometry: Geometry = GEOMETRY) -> KVBlock:
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 50000, geometry.block_size))
    layers = tuple(rng.standard_normal(geometry.layer_shape).astype(geometry.dtype) for _ in range(geometry.n_layers))
    return KVBlock.from_layers(geometry, block_hash(geometry.fingerprint.encode(), parent, tokens), parent, tokens, layers)


def test_round_trip_bit_for_bit_and_the_hash_is_the_schedulers():
    first = make_block(1)
    second = make_block(2, parent=first.block_hash)
    for block in (first, second):
        got = decode(encode(block), GEOMETRY)
        assert got.block_hash == block.block_hash and got.parent_hash == block.parent_hash
        assert got.token_ids == block.token_ids
        assert all(np.array_equal(a, b) for a, b in zip(got.layers, block.layers))
    manager = BlockManager(4, GEOMETRY.block_size, fingerprint=GEOMETRY.fingerprint)
    assert manager.block_hash(None, first.token_ids) == first.block_hash       # what the prefix cache keys


@pytest.mark.parametrize("field, value", [("fingerprint", "another-model"), ("codec", "f16"), ("block_size", 32),
                                          ("n_layers", 4), ("kv_heads", 1), ("head_dim", 16)])
def test_another_model_codec_or_geometry_is_rejected(field, value):
    stored = encode(make_block(3))
    with pytest.raises(BlockRejected, match=field.replace("_", " ")):
        decode(stored, dataclasses.replace(GEOMETRY, **{field: value}))


def test_another_format_version_or_no_block_at_all_is_rejected():
    stored = bytearray(encode(make_block(4)))
    struct.pack_into("<H", stored, len(MAGIC), VERSION + 1)
    with pytest.raises(BlockRejected, match=f"format version {VERSION + 1}"):
        decode(bytes(stored), GEOMETRY)
    with pytest.raises(BlockRejected, match="not a TensorServe KV block"):
        decode(b"GIF89a" + bytes(100), GEOMETRY)


def test_token_ids_that_do_not_match_the_hash_are_rejected():
    block = make_block(5)
    forged = dataclasses.replace(block, token_ids=(1,) + block.token_ids[1:])      # a valid checksum over a lie
    with pytest.raises(BlockRejected, match="do not hash"):
        decode(encode(forged), GEOMETRY)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_flipped_byte_or_truncation_is_rejected(data):
    stored = encode(make_block(6))
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(stored) - 1))
        bit = data.draw(st.integers(0, 7))
        altered = bytearray(stored)
        altered[i] ^= 1 << bit
        value = bytes(altered)
    else:
        value = stored[:data.draw(st.integers(0, len(stored) - 1))]
    with pytest.raises(BlockRejected):
        decode(value, GEOMETRY)


def test_f16_blocks_are_half_the_payload():
    half = dataclasses.replace(GEOMETRY, codec="f16")
    block = make_block(7, geometry=half)
    assert len(encode(block)) < len(encode(make_block(7))) and decode(encode(block), half).layers[0].dtype == np.float16
