"""The zarr-python snippet in docs/FORMAT.md reads a request without r3rdma."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from r3rdma import LocalRoutingStore

DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"


def snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) == 1, "docs/FORMAT.md must hold exactly one python snippet"
    return blocks[0]


def test_snippet_is_short():
    assert len(snippet().strip().splitlines()) <= 10


def test_snippet_reads_request_without_r3rdma(tmp_path, make_record):
    recs = [make_record(f"q{i}", rows=5 + 40 * i) for i in range(4)]
    recs.append(make_record("q1", rows=9, seed=5, start_row=45))  # a second segment
    with LocalRoutingStore(tmp_path, chunk_rows=32) as store:
        store.commit(recs[:2])
        store.commit(recs[2:4])
        store.commit(recs[4:])
    out = tmp_path / "q1.npy"
    program = (
        "import sys\n"
        "sys.modules['r3rdma'] = None  # prove the snippet does not need r3rdma\n"
        + snippet()
        + f"\nnp.save({str(out)!r}, read_request({str(tmp_path)!r}, 'roll-0', 'q1'))\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True)
    np.testing.assert_array_equal(np.load(out), np.concatenate([recs[1].ids_TLK, recs[4].ids_TLK]))
