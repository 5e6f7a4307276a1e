"""Which tuned table a device's kernel configs come from (`configs.table_slug`): its own, one of
the same architecture, the one RECFUSE_TUNED_TABLE names, or none (the heuristic). Checked
against the shipped H100 table's entries and the heuristic itself."""
import types

import pytest
import torch

from recfuse.ops import configs

H100 = "h100-80gb-hbm3"


@pytest.fixture
def fresh_configs():
    configs._cached_backward_config.cache_clear()
    configs._cached_forward_config.cache_clear()
    yield
    configs._cached_backward_config.cache_clear()
    configs._cached_forward_config.cache_clear()


def _fake_gpu(monkeypatch, name, major, minor, sms):
    monkeypatch.setattr(configs, "device_slug", lambda device: configs.gpu_slug(name))
    props = types.SimpleNamespace(major=major, minor=minor, multi_processor_count=sms)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)


def _h100_entry(kind, D, H, dtype_name="bfloat16"):
    return configs.load_table(H100)[(kind, D, H, dtype_name, True)]


def test_a_gpu_of_the_same_architecture_takes_the_shipped_table(monkeypatch, fresh_configs):
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    _fake_gpu(monkeypatch, "NVIDIA H200", 9, 0, 132)
    assert configs.table_slug(0) == H100
    cfg = configs.backward_config(64, 16, torch.bfloat16, 0)
    entry = _h100_entry("backward", 64, 16)
    assert (cfg.block_b, cfg.num_warps, cfg.programs_per_sm) == (entry["block_b"], entry["num_warps"],
                                                                 entry["programs_per_sm"])


@pytest.mark.parametrize("arch", [((9, 0), 114), ((8, 0), 132), ((10, 0), 132)], ids=str)
def test_another_architecture_gets_the_heuristic(monkeypatch, fresh_configs, arch):
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    (major, minor), sms = arch
    _fake_gpu(monkeypatch, "NVIDIA Some GPU", major, minor, sms)
    assert configs.table_slug(0) == "none"
    assert configs.backward_config(64, 16, torch.bfloat16, 0) == configs.heuristic_backward(64, 16, torch.bfloat16)
    assert configs.forward_config(64, 16, torch.bfloat16, 0) == configs.heuristic_forward(64, 16, torch.bfloat16)


def test_the_environment_variable_names_the_table_or_none(monkeypatch, fresh_configs):
    _fake_gpu(monkeypatch, "NVIDIA Some GPU", 8, 0, 108)
    monkeypatch.setenv(configs.TABLE_ENV, H100)
    assert configs.table_slug(0) == H100
    entry = _h100_entry("forward", 256, 1, "float32")
    cfg = configs.forward_config(256, 1, torch.float32, 0)
    assert (cfg.block_b, cfg.num_warps) == (entry["block_b"], entry["num_warps"])
    configs._cached_forward_config.cache_clear()
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 9, 0, 132)
    monkeypatch.setenv(configs.TABLE_ENV, "none")
    assert configs.table_slug(0) == "none"
    assert configs.forward_config(256, 1, torch.float32, 0) == configs.heuristic_forward(256, 1, torch.float32)


def test_the_own_table_wins_and_the_interpreter_has_none(monkeypatch):
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 9, 0, 132)
    assert configs.table_slug(0) == H100
    monkeypatch.setenv(configs.TABLE_ENV, H100)
    assert configs.table_slug("cpu") == "none"
