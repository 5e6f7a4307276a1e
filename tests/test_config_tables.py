"""Which tuned table a device's kernel configs come from (`configs.table_slug`): its own, one of
the same architecture, the one RECFUSE_TUNED_TABLE names, or none (the heuristic). Checked
against the shipped H100 table's entries and the heuristic itself."""
import json
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
    _fake_gpu(monkeypatch, "NVIDIA GH200 480GB", 9, 0, 132)  # no table of its own
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


def test_a_shapes_own_whole_row_winner_stands_where_the_heuristic_chunks(monkeypatch, fresh_configs):
    """fp32 D=160 H=64: the heuristic chunks; a tuned entry of this very shape that names block_k
    (0: the whole-row kernel won against chunked candidates) is used, while a neighbour's
    entry (whole-row or chunked), or an own entry tuned before the chunked kernel existed (no
    block_k), is not. (fp32 D=256 H=16 until session 30, when the heuristic there became the GEMM
    backward's, whose own-entry rule differs: `test_gemm_backward.py`.)"""
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    heuristic = configs.heuristic_backward(160, 64, torch.float32)
    assert heuristic.block_k and not heuristic.gemm
    whole_row = {"block_b": 16, "num_warps": 8, "use_dot": True, "x_evict": "", "programs_per_sm": 4,
                 "num_stages": 1, "block_k": 0}
    table = {("backward", 160, 64, "float32", False): whole_row}  # D=160: masked rows' entries
    _fake_gpu(monkeypatch, "fake-gpu", 1, 0, 1)  # an architecture no shipped table has
    monkeypatch.setattr(configs, "load_table", lambda slug: table)
    cfg = configs.backward_config(160, 64, torch.float32, 0)
    assert (cfg.block_k, cfg.block_b, cfg.num_warps) == (0, 16, 8)
    assert configs.backward_config(192, 64, torch.float32, 0) == configs.heuristic_backward(192, 64, torch.float32)
    # a neighbour's chunked entry is not borrowed either (H=16's 64-column chunks at H=64)
    table[("backward", 192, 16, "float32", False)] = dict(whole_row, block_b=16, block_k=64)
    assert configs.backward_config(192, 64, torch.float32, 0) == configs.heuristic_backward(192, 64, torch.float32)
    assert configs.backward_config(192, 16, torch.float32, 0).block_k == 64
    configs._cached_backward_config.cache_clear()
    table[("backward", 160, 64, "float32", False)] = {k: v for k, v in whole_row.items() if k != "block_k"}
    assert configs.backward_config(160, 64, torch.float32, 0) == heuristic


def test_a_per_column_backward_entry_is_not_borrowed_past_eight_columns():
    """The per-column backward (`unroll_h`) has 8 column slots: a tuned H=8 entry lent to H=12
    (the nearest tuned H by bit length) would launch the [rows, 16, D] broadcast sum instead;
    the heuristic decides there, and H <= 8 keeps the entry."""
    entry = configs.config_to_entry(configs.heuristic_backward(64, 8, torch.float32, use_dot=False, unroll_h=1))
    assert configs.config_from_entry("backward", entry, 64, 12, torch.float32) is None
    cfg = configs.config_from_entry("backward", entry, 64, 6, torch.float32)
    assert cfg is not None and cfg.unroll_h and not cfg.use_dot and cfg.block_h == 8


def test_the_per_column_heuristic_stays_within_the_measured_widths():
    """The heuristic takes the per-column backward where the H100 tuner measured it faster (H = 2-4
    up to 512 columns; fp32 H = 5-8 at 256-512 columns) and keeps the earlier paths past 512
    columns, where 8 row slots of 1024+ elements per column would spill (a D=4096 H=8 fp32 backward
    fell to the composite with it)."""
    for D in (1000, 1024, 2048, 4096):
        for H in (2, 3, 4, 6, 8):
            cfg = configs.heuristic_backward(D, H, torch.float32)
            assert cfg is not None and not cfg.unroll_h, (D, H, cfg)
    assert configs.heuristic_backward(256, 8, torch.float32).unroll_h
    # two power-of-two parts (160 = 128 + 32): the two-part tl.dot rows instead (H200, D=192 H=8
    # 989 -> 538 us; twenty-fourth session)
    assert configs.heuristic_backward(160, 6, torch.float32).row_parts
    assert configs.heuristic_backward(200, 6, torch.float32).unroll_h
    assert configs.heuristic_backward(128, 8, torch.float32).use_dot
    assert configs.heuristic_backward(256, 8, torch.bfloat16).use_dot
    assert configs.heuristic_backward(512, 4, torch.bfloat16).unroll_h


def test_the_environment_variable_takes_a_table_files_path(monkeypatch, fresh_configs, tmp_path):
    """A tuner's --save folder is read through RECFUSE_TUNED_TABLE=<path>: the entry it wrote
    is the config used; a name that is no table is refused, not read as "no entries" (which
    would give the heuristic while a table was asked for)."""
    _fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 9, 0, 132)
    written = {"block_b": 4, "num_warps": 2, "use_dot": False, "x_evict": "", "persistent": 0,
               "tile_stages": 1, "block_k": 0, "unroll_h": 0}
    heuristic, shipped = configs.heuristic_forward(256, 1, torch.float32), _h100_entry("forward", 256, 1, "float32")
    assert (4, 2) not in ((heuristic.block_b, heuristic.num_warps), (shipped["block_b"], shipped["num_warps"]))
    path = tmp_path / "h100-80gb-hbm3.json"
    path.write_text(json.dumps({"forward": [{"D": 256, "H": 1, "dtype": "float32", "full_tiles": True,
                                             "config": written}]}))
    monkeypatch.setenv(configs.TABLE_ENV, str(path))
    try:
        assert configs.table_slug(0) == str(path)
        cfg = configs.forward_config(256, 1, torch.float32, 0)
        assert (cfg.block_b, cfg.num_warps, cfg.use_dot) == (4, 2, False)
        for wrong in (str(tmp_path / "h100.json"), "h100-80gb"):
            monkeypatch.setenv(configs.TABLE_ENV, wrong)
            with pytest.raises(ValueError, match=r"RECFUSE_TUNED_TABLE='.*' names no table.*h100-80gb-hbm3"):
                configs.table_slug(0)
    finally:
        configs.load_table.cache_clear()


@pytest.mark.parametrize("kind, D, H, dtype, knobs", [
    # the split backward's weight-gradient kernel: columns a chunk and rows a tile
    ("backward", 96, 16, torch.float32, dict(use_dot=True, block_k=0, block_b=16, split_dw=48, dw_block_b=16)),
    ("backward", 96, 16, torch.float32, dict(use_dot=True, block_k=0, block_b=16, split_dw=32, dw_block_b=24)),
    ("backward", 160, 1, torch.float32, dict(use_dot=False, row_parts=1, block_b=24)),
    ("forward", 160, 1, torch.bfloat16, dict(use_dot=False, block_k=32, block_b=24)),
])
def test_an_entry_whose_tiles_are_not_powers_of_two_does_not_fit(kind, D, H, dtype, knobs):
    # They are tl.arange ranges: such a config fitted and its launch failed to build (the split
    # weight-gradient kernel's split_dw=48 / dw_block_b=24, found by test_kernel_paths_property.py).
    # A table entry of them is ignored; the nearest powers of two fit.
    if kind == "forward":
        cfg = configs.heuristic_forward(D, H, dtype, False, **knobs)
        fits, pow2 = configs.forward_fits, dict(knobs, block_b=16)
        ok = configs.heuristic_forward(D, H, dtype, False, **pow2)
    else:
        cfg = configs.heuristic_backward(D, H, dtype, **knobs)
        fits = configs.backward_fits
        pow2 = {k: (1 << (v.bit_length() - 1) if k in ("block_b", "split_dw", "dw_block_b") else v)
                for k, v in knobs.items()}
        ok = configs.heuristic_backward(D, H, dtype, **pow2)
    assert not fits(cfg, D, H) and fits(ok, D, H)
    assert configs.config_from_entry(kind, configs.config_to_entry(cfg), D, H, dtype, kind == "backward") is None
    assert configs.config_from_entry(kind, configs.config_to_entry(ok), D, H, dtype, kind == "backward") == ok


def test_an_own_table_lies_over_the_same_architecture_table(monkeypatch, fresh_configs, tmp_path):
    """A GPU whose own table holds a few shapes (an H200 tuned where it differs) takes those
    entries, and the same-architecture table's (the H100's) for every shape its own lacks: exact
    entries and nearest ones alike, never the heuristic where the H100 table has an entry."""
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    _fake_gpu(monkeypatch, "NVIDIA H200", 9, 0, 132)
    own_slug = configs.gpu_slug("NVIDIA H200")
    h100 = configs.load_table(H100)
    mine = {"block_b": 4, "num_warps": 2, "use_dot": False, "x_evict": "", "persistent": 0,
            "tile_stages": 1, "block_k": 0, "unroll_h": 0}
    shipped = _h100_entry("forward", 256, 1, "float32")
    assert (shipped["block_b"], shipped["num_warps"]) != (4, 2)
    tables = {own_slug: {("forward", 256, 1, "float32", True): mine}, H100: h100}
    monkeypatch.setattr(configs, "load_table", lambda slug: tables.get(slug, {}))
    assert configs.table_slug(0) == own_slug
    cfg = configs.forward_config(256, 1, torch.float32, 0)
    assert (cfg.block_b, cfg.num_warps, cfg.use_dot) == (4, 2, False)  # the own entry
    for kind, D, H, dtype in [("forward", 512, 1, torch.float32), ("backward", 64, 16, torch.bfloat16),
                              ("backward", 512, 4, torch.float32)]:
        name = configs._DTYPE_NAMES[dtype]
        entry = h100[(kind, D, H, name, True)]
        cfg = (configs.forward_config(D, H, dtype, 0) if kind == "forward" else configs.backward_config(D, H, dtype, 0))
        assert (cfg.block_b, cfg.num_warps) == (entry["block_b"], entry["num_warps"]), (kind, D, H, dtype)
    # a shape neither table has exactly: the nearest entry over both (the H100's D=256 H=16 for
    # H=32; at D=512 the heuristic takes the GEMM backward, which borrows no neighbour's entry)
    near = h100[("backward", 256, 16, "bfloat16", True)]
    cfg = configs.backward_config(256, 32, torch.bfloat16, 0)
    assert (cfg.block_b, cfg.num_warps) == (near["block_b"], near["num_warps"])
    # the environment variable still names one table alone
    monkeypatch.setenv(configs.TABLE_ENV, H100)
    assert configs.device_entries(0) == h100


def test_a_neighbours_chunk_width_that_does_not_divide_D_is_not_borrowed(tmp_path):
    """D=48's masked entry (16-column chunks) is D=48's own config and the nearest of D = 40 and 56,
    which 16 does not divide: its tiles, tuned for chunks, would run whole masked rows there, so
    those take the heuristic. At D=48 H=32 (another H, the same D) the entry is still borrowed."""
    entry = {"block_b": 32, "num_warps": 8, "use_dot": True, "x_evict": "", "persistent": 0, "tile_stages": 1,
             "block_k": 16, "unroll_h": 0, "k_loop": 0}
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"forward": [{"D": 48, "H": 16, "dtype": "bfloat16", "full_tiles": False,
                                             "config": entry}]}))
    try:
        own = configs.table_forward_config(48, 16, torch.bfloat16, "cpu", False, table=str(path))
        assert (own.block_b, own.num_warps, own.block_k) == (32, 8, 16)
        for D in (40, 56):  # nearest entry D=48 (same BLOCK_D), its 16 columns do not divide D
            cfg = configs.table_forward_config(D, 16, torch.bfloat16, "cpu", False, table=str(path))
            assert cfg == configs.heuristic_forward(D, 16, torch.bfloat16, False)
        cfg = configs.table_forward_config(48, 32, torch.bfloat16, "cpu", False, table=str(path))
        assert (cfg.block_b, cfg.num_warps, cfg.block_k) == (32, 8, 16)
    finally:
        configs.load_table.cache_clear()
