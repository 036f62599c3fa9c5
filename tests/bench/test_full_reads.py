"""benchmarks/full_reads.py: both forms of Full's reads give the same mixtures, and the record has every case."""

import json

import pytest
import torch

from benchmarks import full_reads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_forms_read_the_same_mixtures(dtype):
    fns = full_reads.reads(points=5, tokens=3, dim=16, dtype=dtype)
    listed, banked = fns["list"](), fns["bank"]()
    assert len(listed) == len(banked) == 5
    assert all(torch.equal(a, b) for a, b in zip(listed, banked))


def test_the_record_has_every_case(tmp_path):
    path = tmp_path / "reads.json"
    assert full_reads.main(["--layers", "2", "--dim", "16", "--tokens", "1", "3", "--rounds", "2", "--dtypes", "fp32",
                            "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert [(r["dtype"], r["tokens"]) for r in record["results"]] == [("fp32", 1), ("fp32", 3)]
    assert all(r["ms"]["list"] > 0 and r["ms"]["bank"] > 0 and r["bank_over_list"] > 0 for r in record["results"])


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--tokens", "0"], ["--rounds", "0"]])
def test_bad_sizes_are_refused(argv):
    with pytest.raises(SystemExit):
        full_reads.parse_args(argv)
