"""A keyed table follows each sample by identity: a row whose key, content and label are
unchanged carries its values to the new index; new, changed and relabelled rows find none."""
from __future__ import annotations

import numpy as np
import pytest

from sluice.errors import StorageError
from sluice.storage.keyed_table import KeyedTable
from sluice.storage.sample_ids import SampleIds, load_npz


def _ids(keys, content, labels) -> SampleIds:
    return SampleIds(np.array(keys, np.uint64), np.array(content, np.uint32), np.array(labels, np.int64))


OLD = KeyedTable(_ids([1, 2, 3, 4], [10, 20, 30, 40], [0, 1, 2, 3]),
                 {"loss": np.array([0.1, 0.2, 0.3, 0.4], np.float32), "seen": np.array([1, 0, 1, 1], bool)})
# 4 unchanged (moved), 2 new pixels, 3 relabelled, 5 new, 1 unchanged
NEW = _ids([4, 2, 3, 5, 1], [40, 21, 30, 50, 10], [3, 1, 0, 0, 0])


def test_unchanged_rows_carry_their_values_and_the_rest_are_zero():
    cols, found = OLD.carry(NEW)
    assert found.tolist() == [True, False, False, False, True]
    assert cols["loss"].dtype == np.float32 and cols["seen"].dtype == bool
    assert cols["loss"].tolist() == [np.float32(0.4), 0, 0, 0, np.float32(0.1)]
    assert cols["seen"].tolist() == [True, False, False, False, True]


def test_only_the_given_rows_take_a_value():
    cols, found = OLD.carry(NEW, rows=np.array([1, 4]))
    assert found.tolist() == [False, False, False, False, True]
    assert cols["loss"][0] == 0 and cols["loss"][4] == np.float32(0.1)


def test_concat_distinct_and_a_stored_table_loads_back(tmp_path):
    both = OLD.concat(OLD.take([2, 0]))
    assert len(both) == 6 and len(both.distinct()) == 4
    assert both.distinct().columns["loss"].tolist() == OLD.columns["loss"].tolist()
    OLD.save(tmp_path / "t.npz", {"owner": np.array("x")})
    data = load_npz(tmp_path / "t.npz")
    back = KeyedTable.from_arrays(data, {"loss": np.float32, "seen": bool})
    assert str(data["owner"]) == "x" and np.array_equal(back.ids.packed(), OLD.ids.packed())
    assert all(np.array_equal(back.columns[k], OLD.columns[k]) for k in OLD.columns)
    with pytest.raises(StorageError, match="loss"):
        KeyedTable(OLD.ids, {"loss": np.zeros(3, np.float32)})
