"""Exact vectors of ARCHITECTURE.md § Engram geometry and the shape of the rank split."""

import json

import numpy as np

from remote_engram.cli import main
from remote_engram.geometry import V41, EngramGeometry, is_prime


def test_v41_rows_and_multipliers():
    assert V41.rows(1) == 384_006_168
    assert V41.rows(14) == 384_016_682
    assert V41.mults[1].tolist() == [76632096046245, 4839876093313, 35959672319349,
                                     73987337458391]
    assert V41.mults[14].tolist() == [67716810739261, 51510806800915, 30921347202721,
                                      82619226485591]
    assert V41.rows(1) * 264 / 2**30 > 94.4


def test_small_test_vector():
    g = EngramGeometry(layers=(1, 3), vocab=32, orders=(2, 3))
    assert g.mults[1].tolist() == [237300864419207287, 14987281307456977, 111353620295905115]
    assert g.mults[3].tolist() == [85240722207167499, 252868047889091175, 33684873675973757]


def test_primes_are_distinct_rising_and_offsets_exclusive():
    all_primes = np.concatenate([V41.primes[1], V41.primes[14]])
    assert len(set(all_primes.tolist())) == 48 and all(is_prime(int(p)) for p in all_primes)
    assert (np.diff(V41.primes[1]) > 0).all() and V41.primes[1][0] > 16_000_000 - 1
    assert V41.primes[14][0] > V41.primes[1][-1]  # layer 14 skips the primes layer 1 took
    assert V41.offsets[1][0] == 0 and V41.offsets[1][1] == V41.primes[1][0]


def test_rank_rows_split_the_table():
    for layer in V41.layers:
        lo0, hi0 = V41.rank_rows(layer, 0, 2)
        lo1, hi1 = V41.rank_rows(layer, 1, 2)
        assert (lo0, hi0, hi1) == (0, lo1, V41.rows(layer))
        assert V41.rank_columns(1, 2) == (12, 24)


def test_geometry_cli_json(capsys):
    assert main(["geometry", "--layers", "1", "14", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layers"]["1"]["rows"] == 384_006_168
    assert out["layers"]["14"]["rows"] == 384_016_682
    assert out["layers"]["14"]["multipliers"][0] == 67716810739261


def test_env_cli_lists_every_variable(capsys):
    from remote_engram import env

    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == [v.name for v in env.ALL]
    assert "ENGRAM_BACKEND (default 'verbs'): ofl backend" in lines[2]


def test_backend_flags_default_to_engram_backend(monkeypatch):
    from remote_engram import cli

    seen = []
    monkeypatch.setenv("ENGRAM_BACKEND", "shm")
    monkeypatch.setattr(cli, "cmd_qualify", lambda args: seen.append(args.backend) or 0)
    assert main(["qualify", "--connect", "h:1", "--shards", "d"]) == 0
    assert seen == ["shm"]
