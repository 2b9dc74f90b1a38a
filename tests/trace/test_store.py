"""Columnar store: merge of rank parts, write/load round trip, and errors that name the file."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_core.trace import STORE_NAME, TraceError, load_trace, merge_parts, write_trace
from prism_core.trace.store import TABLE_ARRAYS
from prism_core.trace.recorder import Recorder
from prism_core.trace.schema import COLUMNS, COMM, SCHEMA_VERSION

from ._build import blocking, merged, reference_job


def _expected_groups(rec: Recorder) -> list[tuple[int, ...] | None]:
    """Per node of a rank: the global ranks of its group (None for compute), from the recorder's own view."""
    by_local = {gid: rec.groups[name] for name, gid in rec._group_ids.items()}
    return [by_local[row[2]] if row[2] >= 0 else None for row in rec.rows]


def _labels(rec: Recorder) -> list[str]:
    names = list(rec.labels)
    return [names[row[10]] for row in rec.rows]


def _dtypes(rec: Recorder) -> list[str]:
    names = list(rec.dtypes)
    return [names[row[5]] for row in rec.rows]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_round_trip_preserves_everything(tmp_path, world_size):
    recs = reference_job(world_size, memory=True)
    trace = merged(tmp_path, recs)          # write_part closes each rank's last compute node
    # ranks registered their groups in different orders (pair first on ranks 2 and 3)
    if world_size == 4:
        assert recs[0].tables()["group_order"] == ["world", "pair0"]
        assert recs[2].tables()["group_order"] == ["pair2", "world"]
    path = write_trace(trace, tmp_path / STORE_NAME)
    assert path == tmp_path / STORE_NAME and not list(tmp_path.glob(".*tmp*"))
    back = load_trace(path)

    assert back.world_size == world_size
    assert np.array_equal(back.offsets, trace.offsets)
    assert set(back.columns) == set(COLUMNS)
    for name, dtype in COLUMNS.items():
        assert back.columns[name].dtype == dtype, name
        assert np.array_equal(back.columns[name], trace.columns[name], equal_nan=True), name
    assert back.groups == trace.groups and all(isinstance(g, tuple) for g in back.groups)
    assert back.group_names == trace.group_names
    assert back.labels == trace.labels and back.dtypes == trace.dtypes
    assert back.step_peaks == [[1000 * (r + 1), 1000 * (r + 1) + 1] for r in range(world_size)]

    # against what each rank recorded: global group ranks, label and dtype text, and every other column
    for rec in recs:
        cols = back.rank(rec.rank)
        n = len(rec.rows)
        assert back.num_nodes(rec.rank) == n
        got_groups = [back.groups[g] if g >= 0 else None for g in cols["group"].tolist()]
        assert got_groups == _expected_groups(rec)
        assert [back.labels[i] for i in cols["label"]] == _labels(rec)
        assert [back.dtypes[i] for i in cols["dtype"]] == _dtypes(rec)
        raw = list(zip(*rec.rows))
        for j, name in enumerate(COLUMNS):
            if name in ("group", "label", "dtype"):
                continue
            assert np.array_equal(cols[name], np.asarray(raw[j], dtype=COLUMNS[name]), equal_nan=True), name
    comm_groups = {back.groups[g] for g in back.columns["group"][back.columns["kind"] == COMM]}
    assert tuple(range(world_size)) in comm_groups and (0, 1) in comm_groups


def test_only_the_columns_asked_for_are_loaded(tmp_path):
    from prism_core.replay.assistant import REPLAY_COLUMNS

    trace = merged(tmp_path, reference_job(3))
    path = write_trace(trace, tmp_path / STORE_NAME)
    part = load_trace(path, REPLAY_COLUMNS)
    assert set(part.columns) == set(REPLAY_COLUMNS) and "t_start" not in part.columns
    for name in REPLAY_COLUMNS:
        assert np.array_equal(part.columns[name], trace.columns[name]), name
    assert np.array_equal(part.offsets, trace.offsets) and part.groups == trace.groups
    with pytest.raises(ValueError, match=r"not columns of the trace schema: \['label_text'\]"):
        load_trace(path, ["kind", "label_text"])
    assert set(load_trace(path, ["op"]).columns) == {"kind", "op"}     # kind always: the node count


def test_some_ranks_are_loaded_with_their_place_in_the_whole_graph(tmp_path):
    trace = merged(tmp_path, reference_job(4))
    path = write_trace(trace, tmp_path / STORE_NAME)
    part = load_trace(path, ranks=[3, 1])
    assert part.world_size == 4 and part.groups == trace.groups
    assert [part.num_nodes(r) for r in range(4)] == [0, trace.num_nodes(1), 0, trace.num_nodes(3)]
    for r in (1, 3):
        rows = part.node_index[part.rank_slice(r)]
        assert np.array_equal(rows, np.arange(trace.offsets[r], trace.offsets[r + 1]))
        for name in COLUMNS:
            assert np.array_equal(part.columns[name][part.rank_slice(r)], trace.columns[name][trace.rank_slice(r)],
                                  equal_nan=name.startswith("t_")), name
    assert load_trace(path).node_index is None
    assert len(load_trace(path, ranks=[]).columns["kind"]) == 0
    with pytest.raises(ValueError, match="not all ranks of a 4-rank trace"):
        load_trace(path, ranks=[4])


def test_some_ranks_step_peaks_are_read_and_the_others_hold_none(tmp_path):
    trace = merged(tmp_path, reference_job(4, memory=True))
    trace.step_peaks[2] = [5, None, 7]
    path = write_trace(trace, tmp_path / STORE_NAME)
    assert load_trace(path).step_peaks == trace.step_peaks
    part = load_trace(path, ["op"], ranks=[2, 0])
    assert part.step_peaks == [trace.step_peaks[0], [], [5, None, 7], []]
    trace.step_peaks = []           # none noted at all reads back as none
    assert load_trace(write_trace(trace, tmp_path / "none.zarr"), ranks=[1]).step_peaks == []


def test_the_group_and_peak_tables_are_arrays_not_attributes(tmp_path):
    """A replay reading a few ranks of a large job holds no table of every rank: the group members
    and step peaks are arrays, read in part, and zarr.json holds only the small name tables."""
    trace = merged(tmp_path, reference_job(3, memory=True))
    path = write_trace(trace, tmp_path / STORE_NAME)
    attrs = json.loads((path / "zarr.json").read_text())["attributes"]
    assert "groups" not in attrs and "step_peaks" not in attrs and attrs["group_names"] == trace.group_names
    for name in TABLE_ARRAYS:
        assert (path / name / "zarr.json").is_file(), name


def test_a_store_of_schema_3_is_still_read(tmp_path):
    import shutil

    trace = merged(tmp_path, reference_job(3, memory=True))
    path = write_trace(trace, tmp_path / STORE_NAME)
    meta = json.loads((path / "zarr.json").read_text())
    attrs = meta["attributes"]
    attrs.update(schema_version=3, step_peaks=trace.step_peaks,
                 groups=[{"name": n, "ranks": list(g)} for n, g in zip(attrs.pop("group_names"), trace.groups)])
    (path / "zarr.json").write_text(json.dumps(meta))
    for name in TABLE_ARRAYS:
        shutil.rmtree(path / name)
    back = load_trace(path)
    assert back.groups == trace.groups and back.group_names == trace.group_names
    assert back.step_peaks == trace.step_peaks
    assert load_trace(path, ranks=[1]).step_peaks == [[], trace.step_peaks[1], []]


@pytest.mark.parametrize("name", ["group_offsets", "peak_offsets"])
@pytest.mark.parametrize("at", [0, 1, -1])
def test_offsets_that_do_not_cut_their_table_name_the_file(tmp_path, name, at):
    import zarr

    path = write_trace(merged(tmp_path, reference_job(3, memory=True)), tmp_path / STORE_NAME)
    cuts = zarr.open_array(str(path / name), mode="r+")
    values = cuts[:]
    values[at] += 1 if at != 1 else -values[1] - 1         # off the start, going backwards, past the end
    cuts[:] = values
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(path / name) in str(err.value)


def test_step_peaks_none_without_memory(tmp_path):
    trace = merged(tmp_path, reference_job(2))
    back = load_trace(write_trace(trace, tmp_path / STORE_NAME))
    assert back.step_peaks == [[None, None], [None, None]]


def test_rank_that_recorded_nothing(tmp_path):
    recs = [Recorder(0), Recorder(1), Recorder(2)]
    blocking(recs[0], "allreduce", "g01", (0, 1), 64)
    blocking(recs[1], "allreduce", "g01", (0, 1), 64)
    trace = merged(tmp_path, recs)
    assert trace.num_nodes(2) == 1      # only the compute node closed at the end
    assert trace.step_peaks[2] == []
    back = load_trace(write_trace(trace, tmp_path / STORE_NAME))
    assert back.num_nodes(2) == 1 and back.rank(2)["group"].tolist() == [-1]
    assert back.groups == [(0, 1)]


def test_empty_part_and_empty_trace(tmp_path):
    """A part with no rows at all (and a store with zero nodes) still merges, writes and loads."""
    parts = tmp_path / "parts"
    Recorder(0).write_part(parts)
    empty = {name: np.empty(0, dtype) for name, dtype in COLUMNS.items()}
    tables = Recorder(1).tables()
    np.savez(parts / "1.npz", tables=np.frombuffer(json.dumps(tables).encode(), dtype=np.uint8), **empty)
    trace = merge_parts(parts, 2)
    assert trace.num_nodes(1) == 0
    back = load_trace(write_trace(trace, tmp_path / STORE_NAME))
    assert back.num_nodes(0) == 1 and back.num_nodes(1) == 0
    trace.columns = {name: col[:0] for name, col in trace.columns.items()}
    trace.offsets = np.zeros(3, dtype=np.int64)
    back = load_trace(write_trace(trace, tmp_path / "empty.zarr"))
    assert all(len(c) == 0 for c in back.columns.values())


def test_write_replaces_an_existing_store(tmp_path):
    path = tmp_path / STORE_NAME
    write_trace(merged(tmp_path, reference_job(2), "a"), path)
    small = merged(tmp_path, [Recorder(0), Recorder(1)], "b")
    write_trace(small, path)
    assert load_trace(path).num_nodes(0) == 1


@pytest.mark.parametrize("column", ["bytes", "kind", "t_end"])
def test_corrupt_chunk_names_the_column(tmp_path, column):
    path = write_trace(merged(tmp_path, reference_job(3)), tmp_path / STORE_NAME)
    chunk = path / column / "c" / "0"
    data = bytearray(chunk.read_bytes())
    for i in range(len(data) // 2, min(len(data) // 2 + 4, len(data))):
        data[i] ^= 0x5A
    chunk.write_bytes(bytes(data))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(path / column) in str(err.value)


@pytest.mark.parametrize("column", ["kind", "rank_offsets"])
def test_missing_column_names_it(tmp_path, column):
    import shutil

    path = write_trace(merged(tmp_path, reference_job(2)), tmp_path / STORE_NAME)
    shutil.rmtree(path / column)
    with pytest.raises(TraceError, match="is missing or corrupt") as err:
        load_trace(path, ranks=[0])
    assert str(path / column) in str(err.value)


def test_missing_store_names_the_file(tmp_path):
    with pytest.raises(TraceError) as err:
        load_trace(tmp_path / "nowhere.zarr")
    assert str(tmp_path / "nowhere.zarr") in str(err.value)


def test_wrong_schema_version_names_the_file(tmp_path):
    path = write_trace(merged(tmp_path, reference_job(2)), tmp_path / STORE_NAME)
    meta_path = path / "zarr.json"
    meta = json.loads(meta_path.read_text())
    assert meta["attributes"]["schema_version"] == SCHEMA_VERSION
    meta["attributes"]["schema_version"] = SCHEMA_VERSION + 1
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(meta_path) in str(err.value) and str(SCHEMA_VERSION + 1) in str(err.value)


def test_unreadable_metadata_names_the_file(tmp_path):
    path = write_trace(merged(tmp_path, reference_job(2)), tmp_path / STORE_NAME)
    (path / "zarr.json").write_text("{not json")
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(path / "zarr.json") in str(err.value)


def test_merge_with_a_missing_rank_names_it(tmp_path):
    parts = tmp_path / "parts"
    for rec in reference_job(3):
        rec.write_part(parts)
    (parts / "1.npz").unlink()
    with pytest.raises(TraceError, match=r"rank 1 left no trace") as err:
        merge_parts(parts, 3)
    assert str(parts / "1.npz") in str(err.value)


def test_merge_with_an_unreadable_part_names_the_file(tmp_path):
    parts = tmp_path / "parts"
    for rec in reference_job(2):
        rec.write_part(parts)
    (parts / "0.npz").write_bytes(b"garbage")
    with pytest.raises(TraceError) as err:
        merge_parts(parts, 2)
    assert str(parts / "0.npz") in str(err.value)
