"""pipeline.open_store on a store judged by another analysis (an older tensor-trace, or rules
changed since): judged again where the rank files are there to merge, read as it is where they
are not (a store kept or shipped without its rank files read before the analysis version was
kept in the store, and must still)."""

import os

from tensor_trace.exporters import analysis
from tensor_trace.exporters.pipeline import open_store
from tensor_trace.exporters.store.tables import STORE_NAME, STORE_VERSION, open_new_store


def _store(folder, meta):
    con = open_new_store(os.path.join(folder, STORE_NAME))
    con.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
    con.commit()
    con.close()


def test_a_store_without_its_rank_files_judged_by_another_analysis_still_opens(tmp_path):
    _store(str(tmp_path), {"store_version": str(STORE_VERSION)})  # before analysis_version was kept
    warnings = []
    con = open_store(str(tmp_path), warn=warnings.append)
    assert con.execute("SELECT value FROM meta WHERE key='store_version'").fetchone() == (str(STORE_VERSION),)
    assert warnings and "analysis" in warnings[0]


def test_a_store_of_this_analysis_without_rank_files_opens_quietly(tmp_path):
    _store(str(tmp_path), {"store_version": str(STORE_VERSION), "analysis_version": analysis.version()})
    warnings = []
    open_store(str(tmp_path), warn=warnings.append)
    assert warnings == []
