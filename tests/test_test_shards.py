"""The test shards `make test` splits the interpreter suite into (RECFUSE_TEST_SHARD, tests/conftest.py):
every selected test in exactly one shard, the shards' sizes within one of each other, and a bad
spec refused with its value in the message."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TARGET = "tests/test_config_tables.py"
PICK = "takes_the_shipped or names_the_table or whole_row_winner"


def _collected(shard=None, *extra):
    env = dict(os.environ)
    env.pop("RECFUSE_TEST_SHARD", None)
    if shard is not None:
        env["RECFUSE_TEST_SHARD"] = shard
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          TARGET, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out.returncode, [line for line in out.stdout.splitlines() if "::" in line], out.stdout + out.stderr


@pytest.mark.slow
def test_shards_partition_what_k_selected():
    # The shard plugin runs after `-k` / `-m` have deselected (trylast): two shards of what `-k`
    # picks are those tests, each once, in halves within one of each other. PICK names three tests
    # at even places of the file: shards taken before `-k` would put all three in one.
    rc, picked, text = _collected(None, "-k", PICK)
    assert rc == 0 and len(picked) == 3, text
    rc, all_tests, _ = _collected()
    assert len(all_tests) > len(picked)
    halves = [_collected(f"{i}/2", "-k", PICK)[1] for i in range(2)]
    assert sorted(sum(halves, [])) == sorted(picked)
    assert abs(len(halves[0]) - len(halves[1])) <= 1


@pytest.mark.parametrize("spec", ["2/2", "x/2", "1", "-1/2"])
def test_bad_shard_spec_is_refused(spec):
    from conftest import _Shard

    with pytest.raises(pytest.UsageError, match="RECFUSE_TEST_SHARD") as err:
        _Shard(spec)
    assert repr(spec) in str(err.value)
