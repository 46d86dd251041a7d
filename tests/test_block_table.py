"""scheduler/block_table.py: the array a step sends is the table as it is now, whatever changed it
since the last step (appends, a window's released entries, truncation, a freed and regrown table),
and an array already sent does not change with the table."""
from __future__ import annotations

import copy
import pickle

import numpy as np
from hypothesis import given, settings, strategies as st

from scheduler.block_table import BlockTable

ids = st.integers(-1, 5000)
edits = st.lists(st.one_of(
    st.tuples(st.just("append"), ids),
    st.tuples(st.just("extend"), st.lists(ids, max_size=70)),
    st.tuples(st.just("iadd"), st.lists(ids, max_size=5)),
    st.tuples(st.just("set"), st.integers(-200, 200), ids),
    st.tuples(st.just("set_slice"), st.integers(0, 200), st.integers(0, 200), ids),
    st.tuples(st.just("del_tail"), st.integers(0, 200)),
    st.tuples(st.just("del_index"), st.integers(-200, 200)),
    st.tuples(st.just("pop"), st.integers(-200, 200)),
    st.tuples(st.just("insert"), st.integers(-200, 200), ids),
    st.tuples(st.just("clear"),),
    st.tuples(st.just("reverse"),),
    st.tuples(st.just("sort"),),
    st.tuples(st.just("imul"), st.integers(0, 2)),
    st.tuples(st.just("array"),),
), max_size=60)


def apply(table: list, edit: tuple) -> None:
    op, *args = edit
    n = len(table)
    if op == "append":
        table.append(args[0])
    elif op == "extend":
        table.extend(args[0])
    elif op == "iadd":
        table += args[0]
    elif op == "set" and n:
        table[args[0] % n] = args[1]
    elif op == "set_slice":                    # as a window slides: a run of entries released
        lo, hi = sorted((min(args[0], n), min(args[1], n)))
        table[lo:hi] = [args[2]] * (hi - lo)
    elif op == "del_tail":
        del table[min(args[0], n):]
    elif op == "del_index" and n:
        del table[args[0] % n]
    elif op == "pop" and n:
        table.pop(args[0] % n)
    elif op == "insert":
        table.insert(args[0], args[1])
    elif op in ("clear", "reverse", "sort"):
        getattr(table, op)()
    elif op == "imul":
        table *= args[0]


@settings(max_examples=400, deadline=None)
@given(start=st.lists(ids, max_size=100), edits=edits)
def test_the_array_is_always_the_list(start, edits):
    table, plain = BlockTable(start), list(start)
    sent = []
    for edit in edits:
        apply(table, edit)
        apply(plain, edit)
        if edit[0] == "array":
            sent.append((table.array(), list(plain)))
    assert list(table) == plain
    now = table.array()
    assert now.dtype == np.int32 and now.tolist() == plain
    for array, then in sent:                   # what a step was sent is what the table was then
        assert array.tolist() == then


def test_a_copy_or_a_pickled_table_has_its_own_array():
    table = BlockTable(range(10))
    table.array()
    twin, shallow, restored = copy.deepcopy(table), copy.copy(table), pickle.loads(pickle.dumps(table))
    table[3] = 99
    table.append(7)
    for other in (twin, shallow, restored):
        assert type(other) is BlockTable
        other.append(11)
        assert other.array().tolist() == [*range(10), 11]
    assert table.array().tolist() == [0, 1, 2, 99, 4, 5, 6, 7, 8, 9, 7]
    for other in (twin, shallow, restored):    # each copy's array is still its own list
        other.append(12)
        assert other.array().tolist() == [*range(10), 11, 12]
