"""The headline plot's series: one point per (row, S) of the random workload, one device."""
import pytest

from bench.plot_headline import headline


def _line(row, S, fwd, workload=None, device="GPU A"):
    line = {"row": row, "S": str(S), "fwd_ms": str(fwd), "fwd_bwd_ms": str(3 * fwd),
            "device": device, "status": ""}
    if workload is not None:
        line["workload"] = workload
    return line


def test_series_keep_the_random_workload_only():
    rows = [_line("nsa_jax_pallas", 8192, 3.0, "random"),
            _line("nsa_jax_pallas", 8192, 2.5, "coherent"),
            _line("nsa_jax_pallas", 65536, 38.0),          # written before the column existed
            _line("fa3_full", 8192, 1.8, "coherent"),
            _line("fa3_full", 8192, 1.9, "random")]
    series, device = headline(rows)
    assert device == "GPU A"
    assert series["fwd_ms"]["NSA core (Pallas)"] == [(8192, 3.0), (65536, 38.0)]
    assert series["fwd_bwd_ms"]["FlashAttention-3 (full)"] == [(8192, pytest.approx(5.7))]


def test_rows_of_two_devices_raise():
    with pytest.raises(ValueError, match="devices"):
        headline([_line("nsa_jax_pallas", 8192, 3.0), _line("fa3_full", 8192, 1.9,
                                                              device="GPU B")])
