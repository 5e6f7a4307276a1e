"""Candidate launch configs of the `ln_tanh_linear_relu` kernels, for the tuners.

`forward_candidates` / `backward_candidates` list the configs worth timing for one (D, H, dtype),
the heuristic's own first: the CLI tuner (``benchmarks/tune_kernels.py``) times all of them,
tuning on first use (`recfuse.ops.autotune`) a short spread of them (`spread`). This module is
data: it imports `configs` and nothing that launches a kernel.

Example:
    >>> import torch
    >>> cands = backward_candidates(64, 1, torch.float32)
    >>> cands[0] == configs.heuristic_backward(64, 1, torch.float32)
    True
    >>> picked = spread(cands, 4)
    >>> len(picked), picked[0] == cands[0]
    (5, True)
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
import triton

from . import configs

# Row tiles of up to this many elements are tried for narrow rows (more bytes in flight).
NARROW_TILE = 8192


def forward_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.ForwardConfig]:
    full = D == triton.next_power_of_2(D)
    base = configs.heuristic_forward(D, H, dtype, full)
    out = [base]
    block_d = base.block_d
    row_block_h = min(triton.next_power_of_2(H), 4)
    for block_b, warps in itertools.product((4, 8, 16, 32), (1, 2, 4, 8)):
        per_thread = block_b * block_d * row_block_h / (warps * 32)
        if H <= 4 and 4 <= per_thread <= 16 and block_b * block_d * row_block_h <= 2 * configs.TILE_BUDGET:
            out.append(configs.ForwardConfig(block_b, block_d, row_block_h, False, warps))
    if H <= 4:
        # the row path persistent: programs walk row tiles with the next tiles' loads in flight
        # (`tl.range(num_stages=tile_stages)`), as the pipelined backward does; 16-32 programs a SM
        for block_b, warps, persistent, stages in itertools.product((2, 4, 8, 16, 32), (1, 2, 4), (16, 32), (2, 3)):
            per_thread = block_b * block_d * row_block_h / (warps * 32)
            if 8 <= per_thread <= 32 and block_b * block_d * row_block_h <= 2 * configs.TILE_BUDGET:
                out.append(configs.ForwardConfig(block_b, block_d, row_block_h, False, warps, persistent=persistent,
                                                 tile_stages=stages))
    if H <= 4 and D != block_d:
        # the row path in whole chunks of a D that is not a power of two: no padded columns
        # (D=160 pads to 256: 60% more lanes normalised, put through tanh and multiplied)
        for block_k in dict.fromkeys(w for w in (configs.chunk_width(D, 32), configs.chunk_width(D, 64)) if w):
            for block_b, warps, persistent in itertools.product((4, 8, 16, 32), (1, 2, 4), (0, 32)):
                per_thread = block_b * block_k * row_block_h / (warps * 32)
                if 2 <= per_thread <= 16:
                    out.append(configs.ForwardConfig(block_b, block_d, row_block_h, False, warps, persistent=persistent,
                                                     tile_stages=3 if persistent else 1, block_k=block_k))
    if 2 <= H <= 16:
        # one output column at a time (`ForwardConfig.unroll_h`): a row reduction per column
        for block_b, warps in itertools.product((4, 8, 16, 32, 64), (1, 2, 4, 8)):
            per_thread = block_b * block_d / (warps * 32)
            if 4 <= per_thread <= 16:
                out.append(configs.heuristic_forward(D, H, dtype, full, use_dot=False, block_b=block_b,
                                                     num_warps=warps, persistent=0, tile_stages=1, block_k=0,
                                                     unroll_h=1))
    if block_d >= 16 and H >= 2 and 16 * block_d <= configs.TILE_BUDGET:
        block_h = configs.dot_block_h(H)
        if full:
            chunk = min(32 if block_h <= 16 else 64, block_d // 2) if H <= block_h else 0
        else:  # whole chunks of a D that is not a power of two (no padded columns)
            chunk = configs.chunk_width(D, 32 if block_h <= 16 else 64)
        shapes = [(64, 4, 0), (32, 4, 0)] + ([(64, 4, 1), (64, 8, 1)] if H > 4 else [])
        # Narrow rows: longer row tiles keep more bytes of x in flight per program.
        shapes += [(rows, warps, 0) for rows in (128, 256) for warps in (4, 8) if rows * block_d <= NARROW_TILE]
        for (block_b, warps, persistent), block_k in itertools.product(shapes, dict.fromkeys((0, chunk))):
            if block_b * block_d <= 4 * configs.TILE_BUDGET:
                out.append(configs.ForwardConfig(block_b, block_d, block_h, True, warps, persistent=persistent,
                                                 tile_stages=2 if persistent else 1, block_k=block_k))
        # Chunks in a runtime loop (`ForwardConfig.k_loop`): unrolled, a wide row's chunks all held
        # their loads in registers (offline, sm_90: bf16 D=512 H=16 255 registers, 464 B spilled,
        # 192 KB of shared memory; 180 / none / 31 KB as a loop; fp32 D=512 H=16 255 -> 94), so
        # longer row tiles and more warps fit too.
        loop_chunk = configs.chunk_width(D, 32 if block_h <= 16 else 64) if H <= block_h else 0
        shapes = ((32, 4, 0), (64, 4, 0), (64, 8, 0), (128, 4, 0), (128, 8, 0), (64, 4, 1), (64, 8, 1))
        for (block_b, warps, persistent), block_k, k_loop in itertools.product(
                shapes, dict.fromkeys((loop_chunk, 2 * loop_chunk)), (1, 2)):
            if block_k and D % block_k == 0 and D // block_k >= 4:
                out.append(configs.ForwardConfig(block_b, block_d, block_h, True, warps, persistent=persistent,
                                                 tile_stages=2 if persistent else 1, block_k=block_k, k_loop=k_loop))
        out += masked_chunk_candidates(D, H, dtype)
    return list(dict.fromkeys(out))


def masked_chunk_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.ForwardConfig]:
    """tl.dot forwards in chunks of 16-64 columns with the last chunk masked (`MASK_K`), for rows of
    no 16-column chunk (D = 24, 40, 100, 300, 1000): against whole padded rows, a chunk's tile
    multiplies fewer padded columns and stages less shared memory. Chunks unrolled (up to 4) or in
    a runtime loop; 32-128 rows of 4 or 8 warps.

    Example:
        >>> cands = masked_chunk_candidates(40, 8, torch.float32)
        >>> sorted({c.block_k for c in cands}), all(c.use_dot and c.block_k < c.block_d for c in cands)
        ([16, 32], True)
        >>> masked_chunk_candidates(48, 8, torch.float32)  # whole 16-column chunks: no mask
        []
    """
    shape = configs.masked_chunk_shape(D, H)
    if shape is None:
        return []
    block_d, block_h = shape
    out = []
    for block_k in (16, 32, 64):
        if block_k >= block_d or block_k * 32 < D:  # at least 2 chunks, at most 32
            continue
        chunks = triton.cdiv(D, block_k)
        for (rows, warps), k_loop in itertools.product(((32, 4), (64, 4), (64, 8), (128, 4), (128, 8)), (0, 1)):
            if (k_loop == 0 and chunks > 4) or rows * block_k > 8192:
                continue
            cfg = configs.ForwardConfig(rows, block_d, block_h, True, warps, block_k=block_k, k_loop=k_loop)
            if configs.forward_fits(cfg, D, H) and configs.dot_stage_bytes(cfg, dtype) <= configs.DOT_STAGE_BYTES:
                out.append(cfg)
    return out


def backward_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """Compiled variants x programs per SM; the heuristic's own config first."""
    base = configs.heuristic_backward(D, H, dtype)
    if base is None:
        return []
    out = [base]
    paths = [base.use_dot]
    if 2 <= H <= 8:
        paths += [True, False]  # the tensor-core product (H padded to 16) and the per-column sums
    for use_dot in dict.fromkeys(paths):
        rows = (16, 32) if use_dot else (4, 8, 16)
        # Narrow rows: a 16-row tile of 32 bf16 columns is 1 KB in flight per program, far from
        # what an SM needs to cover HBM latency; longer tiles up to NARROW_TILE elements.
        rows += tuple(r for r in (32, 64, 128, 256) if r > rows[-1] and r * base.block_d <= NARROW_TILE)
        # programs per SM: 2 never won a tl.dot shape on the H100 (0 of 49 table entries)
        pps_range = (4, 8, 16) if use_dot else (2, 4, 8, 16)
        # without tl.dot: the [rows, H, D] broadcast sum (H <= 4), then the per-column candidates
        for block_b, warps, stages, pps in itertools.product(rows, (4, 8), (1, 2), pps_range):
            if not use_dot and H > 4:
                break
            cfg = configs.heuristic_backward(D, H, dtype, use_dot=use_dot, block_b=block_b, num_warps=warps,
                                             num_stages=stages, programs_per_sm=pps, block_k=0, unroll_h=0)
            if cfg is not None and configs.backward_fits(cfg, D, H) and cfg.block_b == block_b:
                out.append(cfg)
        if not use_dot:
            # the row loop pipelined (`BackwardConfig.loop_stages`): tiles of x in flight while one
            # is computed, which lets narrow warps (2) and many programs per SM (up to 32) pay
            # 32 programs per SM and up: fewer (16) won at x 256 MB and collapsed at x 1 GB (fp32 D=256
            # H=1 1477-1688 us against 825-843 with 32; results/checks/ab_h1_bwd_sizes_h100.json)
            for block_b, warps, stages, pps in itertools.product((4, 8, 16, 32, 64, 128), (2, 4, 8), (2, 3),
                                                                 (32, 64)):
                per_thread = block_b * base.block_d / (32 * warps)
                if not ((4 if H == 1 else 2) <= per_thread <= 32) or block_b * base.block_d > NARROW_TILE:
                    continue
                # H > 1 with row slots holds one slot tile per output column: half the tile
                for col_sums in ((0, 1) if H == 1 or per_thread <= 16 else (1,)):
                    cfg = configs.heuristic_backward(D, H, dtype, use_dot=False, block_b=block_b, num_warps=warps,
                                                     num_stages=1, programs_per_sm=pps, block_k=0,
                                                     unroll_h=int(H > 1), loop_stages=stages, col_sums=col_sums)
                    if cfg is not None and configs.backward_fits(cfg, D, H) and cfg.block_b == block_b:
                        out.append(cfg)
            if H == 1 and configs.row_parts_of(D):
                # two unmasked power-of-two parts of each row (`BackwardConfig.row_parts`)
                for block_b, warps, stages, pps in itertools.product((2, 4, 8, 16), (1, 2, 4), (2, 3), (32,)):
                    if 4 <= block_b * D / (32 * warps) <= 24:
                        out.append(configs.heuristic_backward(D, H, dtype, use_dot=False, block_b=block_b,
                                                              num_warps=warps, num_stages=1, programs_per_sm=pps,
                                                              block_k=0, unroll_h=0, loop_stages=stages, row_parts=1))
            if 2 <= H <= 8:
                # each output column on its own (`BackwardConfig.unroll_h`): 2D tiles, so longer
                # row tiles than the broadcast sum's 8 fit; 2-16 elements of a tile per thread
                for block_b, warps, pps in itertools.product((4, 8, 16, 32, 64), (2, 4, 8), (2, 4, 8, 16)):
                    cfg = configs.heuristic_backward(D, H, dtype, use_dot=False, block_b=block_b, num_warps=warps,
                                                     num_stages=1, programs_per_sm=pps, block_k=0, unroll_h=1)
                    if cfg is not None and 2 <= cfg.block_b * cfg.block_d / (32 * warps) <= 16:
                        out.append(cfg)
            # the row loop's column sums folded into 2 or 4 row slots (`BackwardConfig.row_slots`)
            # instead of one a tile row: fewer registers, so more programs in flight
            out += [dataclasses.replace(c, row_slots=n) for c in list(out)
                    if not c.use_dot and not c.col_sums and not c.row_parts and (c.block_h == 1 or c.unroll_h)
                    for n in (2, 4) if n < c.block_b]
            continue
        # the next row tile loaded while this one is computed (`BackwardConfig.prefetch`); fp32
        # too since the relu mask (offline sm_90, fp32 D=256 H=16, 16 rows, 8 warps: 228 registers
        # without spills)
        out += [dataclasses.replace(c, prefetch=1 - c.prefetch) for c in out if c.use_dot and not c.block_k]
        # Triton's pipelining of the row loop instead (`BackwardConfig.loop_stages`)
        out += [dataclasses.replace(c, prefetch=0, loop_stages=stages) for c in list(out)
                if c.use_dot and not c.block_k and not c.loop_stages for stages in (2, 3)]
        out += split_weight_candidates(D, H, dtype)
        out += two_pass_candidates(D, H, dtype)
        out += row_parts_dot_candidates(D, H, dtype)
        out += gemm_candidates(D, H, dtype)
        # K-chunked tiles (`kernels.ln_tanh_linear_relu_bwd_chunked`): columns at a time, so
        # longer row tiles fit the registers; 16-column chunks too where 32 would leave a masked
        # last chunk of 1-16 columns (D=40: 16 + 16 + 8 against 32 + 8)
        widths = (32, 64) if D % 32 == 0 else (16, 32, 64)
        for block_k, block_b, warps, pps in itertools.product(widths, (16, 32, 64), (4, 8), (2, 4, 8, 16)):
            cfg = configs.heuristic_backward(D, H, dtype, use_dot=True, block_b=block_b, num_warps=warps,
                                             num_stages=1, programs_per_sm=pps, block_k=block_k)
            if cfg is not None and block_k < cfg.block_d and configs.backward_fits(cfg, D, H):
                out.append(cfg)
    return list(dict.fromkeys(out))



def row_slots_neighbours(cfg, D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """A no-tl.dot backward config that keeps row slots, with its column sums folded into 2 or 4
    row slots (`BackwardConfig.row_slots`) on its own row tile and on tiles 2 and 4 times as long,
    at its programs per SM and twice as many: what the registers the fold frees can buy. The
    tuner's ``--only row_slots`` times these against the config a GPU runs now (the full candidate
    list has every row_slots variant, too many for a short run). A whole-row tl.dot config gets
    its LayerNorm-affine sums' slots instead (`_dot_row_slots_neighbours`).

    Example:
        >>> base = configs.heuristic_backward(256, 1, torch.float32, use_dot=False, block_b=8, num_warps=2,
        ...                                    programs_per_sm=32, block_k=0, loop_stages=3)
        >>> sorted({(c.row_slots, c.block_b) for c in row_slots_neighbours(base, 256, 1, torch.float32)})
        [(2, 8), (2, 16), (2, 32), (4, 8), (4, 16), (4, 32)]
    """
    if cfg is not None and cfg.use_dot:
        return _dot_row_slots_neighbours(cfg, D, H, dtype)
    if (cfg is None or cfg.col_sums or cfg.row_parts or cfg.block_k
            or not (cfg.block_h == 1 or cfg.unroll_h)):
        return []
    knobs = configs.config_to_entry(cfg)
    out = []
    for slots, longer, more in itertools.product((2, 4), (1, 2, 4), (1, 2)):
        knobs.update(row_slots=slots, block_b=cfg.block_b * longer, programs_per_sm=cfg.programs_per_sm * more)
        c = configs.heuristic_backward(D, H, dtype, **knobs)
        if (c is not None and c.block_b == knobs["block_b"] and slots < c.block_b
                and c.block_b * c.block_d <= max(NARROW_TILE, cfg.block_b * cfg.block_d)
                and configs.backward_fits(c, D, H)):
            out.append(c)
    return list(dict.fromkeys(out))


def _dot_row_slots_neighbours(cfg, D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """A whole-row tl.dot backward config with its LayerNorm-affine column sums in as many row slots
    as its layout tile spans, and twice that (`configs.layout_row_span`), instead of one cross-warp
    sum a tile: what fixed the GEMM backward's bf16 row kernel (session 31).

    Example:
        >>> base = configs.heuristic_backward(256, 16, torch.bfloat16, use_dot=True, gemm=0, block_b=16,
        ...                                    num_warps=4, block_k=0, two_pass=0, row_parts=0, split_dw=0)
        >>> [c.row_slots for c in row_slots_neighbours(base, 256, 16, torch.bfloat16)]
        [4, 8]
    """
    if cfg.gemm or cfg.block_k or cfg.two_pass or cfg.row_parts or cfg.split_ln or cfg.row_slots:
        return []
    span = configs.layout_row_span(cfg.block_b, cfg.block_d, cfg.num_warps, dtype.itemsize)
    out = []
    for slots in (span, 2 * span):
        c = dataclasses.replace(cfg, row_slots=slots)
        if slots > 1 and configs.backward_fits(c, D, H):
            out.append(c)
    return list(dict.fromkeys(out))


def split_weight_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """Whole-row tl.dot backwards whose weight gradient is a kernel of its own
    (`BackwardConfig.split_dw`): without the [H, D] accumulator and its dot the fused kernel's
    row tiles can be shorter and its warps more, and the weight-gradient kernel's tile is a
    [BLOCK_H, 64-128] accumulator whatever D. H >= 8 (below, the fused kernel's accumulator is
    small); weights of at most 4096 fp32 elements (the fp32 weight is held as three bf16 parts)
    or 16384 bf16 ones.

    Example:
        >>> cands = split_weight_candidates(256, 16, torch.bfloat16)
        >>> {c.split_dw for c in cands}, all(c.use_dot and not c.block_k for c in cands)
        ({64, 128}, True)
        >>> split_weight_candidates(256, 4, torch.bfloat16)
        []
    """
    block_d, block_h = triton.next_power_of_2(D), configs.dot_block_h(H)
    limit = 16384 if dtype == torch.bfloat16 else 4096
    if H < 8 or block_d < 16 or block_h * block_d > limit:
        return []
    out = []
    fused_tiles = ((16, 4, 16), (16, 8, 8), (32, 4, 8), (32, 8, 8), (64, 4, 16))
    weight_tiles = ((64, 64, 4), (128, 64, 8), (64, 32, 4))
    for (block_b, warps, pps), (dw_k, dw_b, dw_w) in itertools.product(fused_tiles, weight_tiles):
        if block_b * block_d > 8192:
            continue
        for split_ln in (0, 1):
            cfg = configs.heuristic_backward(D, H, dtype, use_dot=True, block_b=block_b, num_warps=warps,
                                             num_stages=1, programs_per_sm=pps, block_k=0, prefetch=0, loop_stages=0,
                                             split_dw=min(dw_k, block_d), dw_block_b=dw_b, dw_num_warps=dw_w,
                                             split_ln=split_ln)
            if cfg is not None and configs.backward_fits(cfg, D, H):
                out.append(cfg)
    return list(dict.fromkeys(out))


def two_pass_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """Two-pass backwards (`BackwardConfig.two_pass`): chunks of 32 or 64 columns (128 too for rows
    of 512+); the row-sums kernel's tile (rows, warps) and the dx-and-partials kernel's chosen apart,
    since the second holds the [H, chunk] weight-gradient accumulator besides its tile (H200, bf16
    D=512 H=64, both on 32 rows and 4 warps: 255 registers and spills in the second, 212 in the
    first); 16 programs per SM, or 8 with both on one tile. The second kernel's loads pipelined 3
    deep. Then a few with the weight gradient in the first pass (`BackwardConfig.dw_first`). H >= 8,
    the tl.dot path's shapes: below, the whole-row kernels' weight and accumulator are small.

    Example:
        >>> cands = two_pass_candidates(512, 64, torch.bfloat16)
        >>> sorted({c.two_pass for c in cands}), all(c.use_dot and not c.block_k for c in cands)
        ([32, 64, 128], True)
        >>> two_pass_candidates(256, 4, torch.float32)
        []
    """
    block_d = triton.next_power_of_2(D)
    if H < 8 or block_d < 32:
        return []
    out = []
    chunks = [k for k in (32, 64, 128) if k <= block_d and (k < 128 or block_d >= 512)]
    tiles = ((32, 4), (64, 4), (64, 8))
    second_tiles = ((32, 4), (32, 8), (64, 8))
    for chunk, (rows, warps), (dw_rows, dw_warps), pps in itertools.product(chunks, tiles, second_tiles, (8, 16)):
        if pps == 8 and (rows, warps) != (dw_rows, dw_warps):
            continue
        cfg = configs.heuristic_backward(D, H, dtype, use_dot=True, block_b=rows, num_warps=warps, num_stages=1,
                                         programs_per_sm=pps, block_k=0, prefetch=0, loop_stages=0, split_dw=0,
                                         two_pass=chunk, dw_block_b=dw_rows, dw_num_warps=dw_warps, dw_num_stages=3)
        if cfg is not None and configs.backward_fits(cfg, D, H):
            out.append(cfg)
    # The weight gradient in the first pass (`BackwardConfig.dw_first`): the first pass then holds
    # the accumulator, so 8 warps there; offline (sm_90, bf16 D=512 H=64) neither pass spills.
    for chunk, (rows, warps), (dw_rows, dw_warps) in itertools.product(chunks, ((64, 8), (32, 8)),
                                                                       ((32, 4), (64, 8))):
        cfg = configs.heuristic_backward(D, H, dtype, use_dot=True, block_b=rows, num_warps=warps, num_stages=1,
                                         programs_per_sm=16, block_k=0, prefetch=0, loop_stages=0, split_dw=0,
                                         two_pass=chunk, dw_block_b=dw_rows, dw_num_warps=dw_warps, dw_num_stages=3,
                                         dw_first=1)
        if cfg is not None and configs.backward_fits(cfg, D, H):
            out.append(cfg)
    return list(dict.fromkeys(out))


def row_parts_dot_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """The tl.dot backward over two unmasked power-of-two parts of each row
    (`BackwardConfig.row_parts` with `use_dot`, `kernels.ln_tanh_linear_relu_bwd_rows2_dot`) where
    D is such a sum with a second part of at least `configs.ROW_PARTS_DOT_MIN` columns: tiles of
    4-24 elements a thread, 8 or 16 programs per SM, a plain or a 2-deep pipelined row loop.

    Example:
        >>> cands = row_parts_dot_candidates(160, 16, torch.float32)
        >>> len(cands) > 0 and all(c.use_dot and c.row_parts and not c.block_k for c in cands)
        True
        >>> row_parts_dot_candidates(256, 16, torch.float32), row_parts_dot_candidates(48, 16, torch.float32)
        ([], [])
    """
    if not configs.row_parts_dot_fits(D) or H < 2:
        return []
    out = []
    for block_b, warps, pps, stages in itertools.product((16, 32, 64, 128), (4, 8), (8, 16), (0, 2)):
        if not 4 <= block_b * D / (32 * warps) <= 24:
            continue
        cfg = configs.heuristic_backward(D, H, dtype, use_dot=True, block_b=block_b, num_warps=warps, num_stages=1,
                                         programs_per_sm=pps, block_k=0, prefetch=0, loop_stages=stages,
                                         split_dw=0, two_pass=0, row_parts=1)
        if cfg is not None and configs.backward_fits(cfg, D, H):
            out.append(cfg)
    return out


def gemm_candidates(D: int, H: int, dtype: torch.dtype) -> list[configs.BackwardConfig]:
    """The GEMM backward (`BackwardConfig.gemm`, fp32 and bf16, H >= 16, rows of 64+ columns): its row
    kernel's tiles of 2048-8192 elements, 4 or 8 warps, 2-16 programs an SM a launch, the row loop 3 or
    4 deep (bf16 also 1 or 2; its GEMMs keep `configs.gemm_backward_config`'s tiles). H200, fp32
    (results/checks/ab_gemm_bwd_tiles_h200.txt, before the per-launch program count was fixed):
    4096 elements, 4 warps, 8 programs and 3 stages were best at D = 256/512, H = 32/64, 2 stages
    1.03-1.04x slower than 3. Session 31's tuner, after the fix and the row slots, chose 2048
    elements, 4 warps, 4 programs and 3 stages at fp32 D=512 H=64 and bf16 D = 256/512 H=64
    (`configs.gemm_backward_config`).

    Example:
        >>> cands = gemm_candidates(512, 64, torch.float32)
        >>> len(cands), all(c.gemm and configs.backward_fits(c, 512, 64) for c in cands)
        (48, True)
        >>> gemm_candidates(512, 64, torch.float16), gemm_candidates(512, 8, torch.float32)
        ([], [])
    """
    block_d = triton.next_power_of_2(D)
    # fp16: its forward saves no relu mask (`configs.relu_mask_min_d`), which the GEMM backward needs
    if dtype not in (torch.float32, torch.bfloat16) or not 16 <= H <= 64 or block_d < 64:
        return []
    out = []
    # bf16's row kernel stalled on shared memory with its loop pipelined (ncu, session 31): 1-2 stages too
    stage_counts = (3, 4) if dtype == torch.float32 else (1, 2, 3, 4)
    for elements, warps, pps, stages in itertools.product((2048, 4096, 8192), (4, 8), (2, 4, 8, 16), stage_counts):
        cfg = configs.gemm_backward_config(D, H, dtype, block_b=max(1, elements // block_d), num_warps=warps,
                                           programs_per_sm=pps, loop_stages=stages)
        if configs.backward_fits(cfg, D, H):
            out.append(cfg)
    return list(dict.fromkeys(out))


def rank_us(row: dict) -> float:
    """What a timed candidate is ranked by: its "us", plus for a forward its "train_us", the same
    config timed as a training step's forward launches it (saving the row stats and, where the
    backward reads it, the relu mask). One forward config serves both calls: ranked by the
    inference call alone, the chunk loop won forwards whose training step it slowed (H100 fp32
    D=256 H=16: grid step 642 -> 763 us; H200 bf16 D=256 H=64: forward 203 -> 177 us, step +2%).

    Example:
        >>> rank_us({"us": 10.0, "train_us": 12.0}), rank_us({"us": 10.0})
        (22.0, 10.0)
    """
    return row["us"] + row.get("train_us", 0.0)


def confirm_at_scale(timed: list, time_at_scale, finalists: int) -> list:
    """``timed`` (rows, dicts with "us", sorted by `rank_us` at the tuned size) re-ordered by how
    its ``finalists`` fastest do at a larger size too: by each finalist's worse ratio to the fastest
    finalist at either size (``time_at_scale(row)`` gives its time there, ranked as `rank_us` ranks,
    kept as "confirm_us"; inf for a config that fails there); the other rows follow as they were.
    The CLI tuner and tuning on first use both rank this way.

    A winner at one size need not be one at another: on the H100 the pipelined H = 1 backward with
    16 programs per SM won at x 256 MB (222 us against 241 with 32) and collapsed at 1 GB (1477-1688
    us against 825-843; benchmarks/results/checks/ab_h1_bwd_sizes_h100.json).

    Example:
        >>> rows = [{"config": "a", "us": 1.0}, {"config": "b", "us": 1.1}, {"config": "c", "us": 3.0}]
        >>> at_4x = {"a": 9.0, "b": 4.0}
        >>> [r["config"] for r in confirm_at_scale(rows, lambda row: at_4x[row["config"]], finalists=2)]
        ['b', 'a', 'c']
    """
    head, tail = timed[:finalists], timed[finalists:]
    if len(head) < 2:
        return timed
    for row in head:
        row["confirm_us"] = time_at_scale(row)
    fastest = min(rank_us(r) for r in head)
    fastest_confirm = min(r["confirm_us"] for r in head)
    if not fastest_confirm < float("inf"):
        return timed  # no finalist ran at the larger size: the tuned size alone decides
    head.sort(key=lambda r: max(rank_us(r) / fastest, r["confirm_us"] / fastest_confirm))
    return head + tail


def maxnreg_neighbours(cfg, D: int, H: int, dtype: torch.dtype) -> list:
    """A config with its (first) kernel's registers capped (`TileConfig.maxnreg`) so that more of
    its programs fit an SM's register file: the tuner's ``--only maxnreg`` times these against the
    config a GPU runs now. Backward: caps (112-232, multiples of 8) that fit one, two or three more
    programs than 255 registers a thread do, at the config's programs per SM and, where that is
    fewer, at the programs the cap lets in; its row loop waits on memory with 216-255 registers
    (benchmarks/NOTES.md, nineteenth session). Forward (96-168 registers, offline sm_90): the caps
    168, 128, 96, 80 and 64, which at 4 warps fit 3, 4, 5, 6 and 8 programs.

    Example:
        >>> base = configs.heuristic_backward(256, 16, torch.float32, num_warps=4, programs_per_sm=16)
        >>> sorted(c.maxnreg for c in maxnreg_neighbours(base, 256, 16, torch.float32))
        [128, 168]
        >>> fwd = configs.heuristic_forward(256, 16, torch.float32)
        >>> sorted(c.maxnreg for c in maxnreg_neighbours(fwd, 256, 16, torch.float32))
        [64, 80, 96, 128, 168]
    """
    if cfg is None or cfg.maxnreg:
        return []
    if isinstance(cfg, configs.ForwardConfig):
        out = [dataclasses.replace(cfg, maxnreg=cap) for cap in FORWARD_MAXNREG_CAPS]
        return [c for c in out if configs.forward_fits(c, D, H)]
    threads = 32 * cfg.num_warps
    uncapped = configs.REGISTERS_PER_SM // (256 * threads)  # programs an SM holds at 255 registers
    out = []
    for programs in range(uncapped + 1, uncapped + 4):
        cap = configs.REGISTERS_PER_SM // (programs * threads) // 8 * 8
        if not 112 <= cap <= 232:
            continue
        for pps in dict.fromkeys((cfg.programs_per_sm, max(cfg.programs_per_sm, programs))):
            c = dataclasses.replace(cfg, maxnreg=cap, programs_per_sm=pps)
            if configs.backward_fits(c, D, H):
                out.append(c)
    return list(dict.fromkeys(out))


# The forward's register caps `maxnreg_neighbours` tries.
FORWARD_MAXNREG_CAPS = (168, 128, 96, 80, 64)


def kernel_path(cfg) -> tuple:
    """The code path a config compiles to, as `spread` groups candidates: the product (tl.dot or
    not), K-chunked or whole rows, and the path knobs (persistent forward, per-column products,
    pipelined row loop, column sums, prefetch).

    Example:
        >>> kernel_path(configs.heuristic_forward(256, 1, torch.float32))
        ('forward', False, False, False, False, False, False)
    """
    if isinstance(cfg, configs.ForwardConfig):
        return ("forward", cfg.use_dot, bool(cfg.block_k), bool(cfg.persistent), bool(cfg.unroll_h), bool(cfg.k_loop),
                bool(cfg.maxnreg))
    return ("backward", cfg.use_dot, bool(cfg.block_k), bool(cfg.unroll_h), bool(cfg.loop_stages),
            bool(cfg.col_sums), bool(cfg.prefetch), bool(cfg.split_ln), bool(cfg.split_dw), bool(cfg.row_parts),
            bool(cfg.two_pass), bool(cfg.dw_first), bool(cfg.row_slots), bool(cfg.maxnreg), bool(cfg.gemm))


# The knob each flag of a `kernel_path` stands for, after its kind.
PATH_FLAGS = {"forward": ("dot", "chunked", "persistent", "unroll_h", "k_loop", "maxnreg"),
              "backward": ("dot", "chunked", "unroll_h", "loop_stages", "col_sums", "prefetch", "split_ln",
                           "split_dw", "row_parts", "two_pass", "dw_first", "row_slots", "maxnreg", "gemm")}


def path_label(path: tuple) -> str:
    """A kernel path as the knobs it sets, e.g. "dot+chunked+k_loop" ("plain": none).

    Example:
        >>> path_label(kernel_path(configs.heuristic_forward(512, 16, torch.bfloat16)))
        'dot+chunked+k_loop'
    """
    return "+".join(name for name, on in zip(PATH_FLAGS[path[0]], path[1:]) if on) or "plain"


def spread(cands: list, limit: int = 12) -> list:
    """A short list of ``cands``: its first (the heuristic's config) and at most ``limit`` others,
    spread over the kernel paths and, within a path, over its knobs.

    How: the others are grouped by `kernel_path` (in order of first appearance); the groups take
    one slot each in turn until ``limit`` slots are taken or every group is exhausted, so every
    path is tried before any path gets a second candidate; a group with k slots takes the members
    at the centres of k equal segments of its list. The generators list a path's candidates in
    nested loops (rows, warps, stages, programs per SM), so evenly spaced picks vary all of them
    rather than the innermost knob alone. Deterministic: the same list in every process.

    Example:
        >>> cands = list(range(10))  # any items: ints have no kernel path, so here one group
        >>> spread(cands, 3)
        [0, 2, 5, 8]
    """
    if not cands:
        return []
    head = cands[0]
    groups: dict = {}
    for c in cands[1:]:
        if c != head:
            groups.setdefault(kernel_path(c) if isinstance(c, configs.TileConfig) else None, []).append(c)
    members = list(groups.values())
    slots = [0] * len(members)
    taken = 0
    while taken < limit and any(n < len(g) for n, g in zip(slots, members)):
        for i, g in enumerate(members):
            if taken < limit and slots[i] < len(g):
                slots[i] += 1
                taken += 1
    out = [head]
    for g, k in zip(members, slots):
        out += [g[int((j + 0.5) * len(g) / k)] for j in range(k)]
    return out
