"""benchmarks/full_training.py: the record has every way and dtype, and bad sizes are refused."""

import json

import pytest

from benchmarks import full_training


def test_the_record_has_every_way(tmp_path):
    path = tmp_path / "training.json"
    assert full_training.main(["--layers", "2", "--dim", "16", "--tokens", "3", "--groups", "2", "4", "--rounds", "1",
                               "--dtypes", "fp32", "bf16", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert [r["dtype"] for r in record["results"]] == ["fp32", "bf16"]
    for r in record["results"]:
        assert set(r["ms"]) == {"chain", "group 2", "group 4"} and all(v > 0 for v in r["ms"].values())
        assert r["over_chain"]["chain"] == 1


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--tokens", "0"], ["--rounds", "0"], ["--groups", "1"]])
def test_bad_sizes_are_refused(argv):
    with pytest.raises(SystemExit):
        full_training.parse_args(argv)
