"""How merge_workers.plan splits rank files between the merging process and its workers."""

import os

import pytest

from tensor_trace.exporters.store import merge_workers


def files_of(tmp_path, sizes):
    paths = []
    for k, n in enumerate(sizes):
        p = tmp_path / f"r{k:02d}.ttr"
        p.write_bytes(bytes(n))
        paths.append(str(p))
    return paths


def check_partition(groups, files):
    """Contiguous, in file order, every file once with its own process id, no empty group."""
    assert all(groups)
    flat = [pp for g in groups for pp in g]
    assert flat == list(enumerate(files))


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_groups_are_contiguous_and_balanced(tmp_path, workers):
    files = files_of(tmp_path, [1000] * 8)
    groups = merge_workers.plan(files, workers)
    check_partition(groups, files)
    assert len(groups) == min(workers + 1, 8)
    if workers == 1:
        # Equal files: the merging process copies the worker's parts while the worker loads its
        # next files, so both load half; the copying ends with the worker's last file.
        assert [len(g) for g in groups] == [4, 4]


def sparse_files_of(tmp_path, sizes):
    """Rank files of these sizes that take no disk (plan reads only their sizes)."""
    paths = []
    for k, n in enumerate(sizes):
        p = tmp_path / f"r{k:02d}.ttr"
        with open(p, "wb") as f:
            f.truncate(n)
        paths.append(str(p))
    return paths


@pytest.mark.parametrize("size_mb, n_files, share", [(14, 8, 4), (140, 8, 4), (140, 24, 11)])
def test_the_merging_process_finishes_with_its_worker(tmp_path, size_mb, n_files, share):
    """Rank files of a 2M-record trace (14 MB each) and of a 20M-record one (140 MB): the merging
    process loads its files, then copies each of the worker's parts as it completes (COPY_RATIO
    of loading it), so it takes as many files as leave it done copying when the worker is done
    loading: half of 8, and fewer than half of 24 (copying 13 parts weighs more than a file).
    What follows the loading is the same for every cut: the size of the trace does not matter."""
    files = sparse_files_of(tmp_path, [size_mb << 20] * n_files)
    groups = merge_workers.plan(files, 1)
    check_partition(groups, files)
    assert [len(g) for g in groups] == [share, n_files - share]


def test_uneven_files_split_by_bytes(tmp_path):
    files = files_of(tmp_path, [8000, 100, 100, 100, 100, 100, 100, 7000])
    groups = merge_workers.plan(files, 1)
    check_partition(groups, files)
    assert [p for p, _ in groups[0]] == [0]  # the first file alone is about half the bytes


def test_no_workers_for_one_file_zero_workers_or_a_small_trace(tmp_path, monkeypatch):
    monkeypatch.delenv(merge_workers.ENV_WORKERS, raising=False)
    one = files_of(tmp_path, [merge_workers.PARALLEL_MIN_BYTES * 2])
    assert merge_workers.plan(one, 3) == [[(0, one[0])]]
    files = files_of(tmp_path, [1000] * 4)
    assert len(merge_workers.plan(files, 0)) == 1
    assert len(merge_workers.plan(files, None)) == 1  # far below PARALLEL_MIN_BYTES
    assert len(merge_workers.plan(files, 2)) == 3  # asked for: used whatever the size


def test_environment_sets_the_workers(tmp_path, monkeypatch):
    files = files_of(tmp_path, [1000] * 4)
    monkeypatch.setenv(merge_workers.ENV_WORKERS, "2")
    assert len(merge_workers.plan(files, None)) == 3
    monkeypatch.setenv(merge_workers.ENV_WORKERS, "0")
    assert len(merge_workers.plan(files, None)) == 1
    assert len(merge_workers.plan(files, 1)) == 2  # an explicit argument wins


def test_auto_uses_the_cores(tmp_path, monkeypatch):
    monkeypatch.delenv(merge_workers.ENV_WORKERS, raising=False)
    monkeypatch.setattr(merge_workers, "PARALLEL_MIN_BYTES", 0)
    files = files_of(tmp_path, [1000] * 8)
    monkeypatch.setattr(merge_workers, "_usable_cpus", lambda: 1)
    assert len(merge_workers.plan(files, None)) == 1
    monkeypatch.setattr(merge_workers, "_usable_cpus", lambda: 2)
    assert len(merge_workers.plan(files, None)) == 2
    monkeypatch.setattr(merge_workers, "_usable_cpus", lambda: 64)
    assert len(merge_workers.plan(files, None)) == merge_workers.MAX_WORKERS + 1


def test_part_paths_finds_only_this_stores_parts(tmp_path):
    tmp = str(tmp_path / "merged.sqlite.tmp")
    for name in ("merged.sqlite.tmp.part1", "merged.sqlite.tmp.part1.log", "merged.sqlite.tmp.part2",
                 "merged.sqlite", "other.part1"):
        (tmp_path / name).write_bytes(b"")
    assert sorted(os.path.basename(p) for p in merge_workers.part_paths(tmp)) == [
        "merged.sqlite.tmp.part1", "merged.sqlite.tmp.part1.log", "merged.sqlite.tmp.part2"]


def test_split_cuts_inside_a_file_where_both_finish_together(tmp_path):
    """8 equal files: the merging process loads x files and copies the other 8 - x (COPY_RATIO
    each), the worker loads 8 - x and then its last file's part is copied: x = 3.79. The first
    worker's first part is the head of file 3, the merging process loads its rest."""
    files = sparse_files_of(tmp_path, [14 << 20] * 8)
    groups = merge_workers.plan(files, 1, split=True)
    assert groups[0] == list(enumerate(files[:3]))
    proc, path, stop = groups[1][0]
    assert (proc, path) == (3, files[3]) and 0.15 < stop / (14 << 20) < 0.3
    assert groups[1][1:] == list(enumerate(files))[4:]
    assert merge_workers.plan(files, 1) == [list(enumerate(files[:4])), list(enumerate(files))[4:]]


def test_no_split_of_the_first_file_or_for_a_sliver(tmp_path):
    files = files_of(tmp_path, [8000, 100, 100, 100, 100, 100, 100, 7000])
    assert merge_workers.plan(files, 1, split=True) == merge_workers.plan(files, 1)  # x inside file 0
    files = sparse_files_of(tmp_path, [1000] * 2)  # x = 1.0: the cut falls between the files
    assert merge_workers.plan(files, 1, split=True) == [[(0, files[0])], [(1, files[1])]]
