"""The cost model reproduces the figures of docs/design.md section 9 (Kimi K3 bank size, paper Table 1 traffic)."""

import pytest

from attnres.analysis.cost import residual_cost
from attnres.cli import main


def test_kimi_k3_bank_and_paper_table_1():
    # K3: T=8192, N=8, d=7168, bf16 -> ~896 MiB; Table 1: L=128 sublayers, N=8, S=16 -> 5.5d and 24d
    cost = residual_cost(tokens=8192, num_layers=64, block_size=8, hidden_size=7168, dtype="bf16")
    assert cost.bank_bytes == 8192 * 8 * 7168 * 2 == 896 * 2**20
    assert cost.traffic_standard == 3.0
    assert cost.traffic_block_two_phase == 5.5
    assert cost.traffic_full_two_phase == 24.0


def test_sharding_and_chunking_divide_the_bank():
    cost = residual_cost(tokens=1000, num_layers=10, block_size=3, hidden_size=16, dtype="fp32", ranks=3, chunk=100)
    row = 16 * 4
    assert cost.bank_bytes == 1000 * 4 * row  # ceil(10 / 3) = 4 rows
    assert cost.bank_bytes_per_rank == 334 * 4 * row
    assert cost.bank_bytes_per_chunk == 100 * 4 * row


@pytest.mark.parametrize("kwargs,name", [({"block_size": 0}, "block_size"), ({"dtype": "int8"}, "dtype"),
                                         ({"ranks": 0}, "ranks"), ({"chunk": 0}, "chunk")])
def test_bad_settings_are_named(kwargs, name):
    args = {"tokens": 10, "num_layers": 4, "block_size": 2, "hidden_size": 8, **kwargs}
    with pytest.raises(ValueError, match=name):
        residual_cost(**args)


def test_estimate_command_prints_the_bank(capsys):
    assert main(["estimate", "--tokens", "8192", "--layers", "64", "--block-size", "8", "--hidden", "7168"]) == 0
    assert "896.0 MiB" in capsys.readouterr().out


def test_estimate_predicts_tensor_parallel_and_pipeline_traffic(capsys):
    """What benchmarks/mesh_memory.py measures against (docs/mesh_memory.json: measured / predicted = 1.000):
    4 * rows * T * d * e * (1 + 1/P) a decoder layer under TP; the state after a stage, per pipeline hop."""
    assert main(["estimate", "--tokens", "1024", "--layers", "8", "--block-size", "2", "--hidden", "512",
                 "--dtype", "fp32", "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"per rank: {4 * 1024 * 512 * 4 * 1.5 / 2**20:.1f} MiB" in out  # 12.0 MiB
    # after 4 of 8 layers with block size 2: 2 bank rows and the prefix, 1024 tokens of 512 fp32 each
    assert f"per microbatch: {3 * 1024 * 512 * 4 / 2**20:.1f} MiB" in out  # 6.0 MiB
    assert main(["estimate", "--layers", "6", "--pp", "4"]) == 2  # the CLI's one-line error
    assert "pp: 4 stages must divide layers=6" in capsys.readouterr().err
