"""Triton helpers the backends' kernels share: launch arithmetic, interpreter facts, bit-exact
conversions, float32 order keys, and the stateless hash that makes `sample` agree across backends.

Backend-neutral by construction: it imports only `triton`, `triton.language` and `torch`, and uses
only the part of the Triton language that community Triton and triton-ascend (which installs the
module `triton` too) both compile: no libdevice, no `triton.language.extra.cann`, no launch options.
What one backend alone needs stays in that backend's `kernels/common.py`. The core never imports
this module (it needs triton): only kernel modules do, once their backend was selected.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# launch arithmetic (host side)


def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def fp8_views(cache):
    """An FP8 KV cache (deepinfer.ops.kv_cache_format: rows of W e4m3 values + a float32 scale) as
    the two views its kernels take: its bytes (uint8, same shape) and the same memory as float32
    (a row at byte offset o has its scale at float32 index (o + W) / 4). Every row width and stride
    of such a cache is a multiple of 4 bytes; anything else is refused."""
    if cache.stride(-1) != 1 or cache.shape[-1] % 4 or any(st % 4 for st in cache.stride()[:-1]) or cache.storage_offset() % 4:
        raise ValueError(f"an FP8 KV cache needs contiguous rows and strides in multiples of 4 bytes (its float32 scales), got {tuple(cache.shape)}")
    return cache.view(torch.uint8), cache.view(torch.float32)  # both alias the cache


def float32_dots(q, caches) -> bool:
    """Whether an attention kernel's dots must take float32 operands: q and the caches it reads, as
    (tensor, is_fp8) pairs, do not share one 16-bit dtype. An FP8 cache counts as q's dtype (its e4m3
    values convert to it exactly). Pass only the caches the call reads: a placeholder standing in for
    a list the call does not have would wrongly count."""
    dtypes = {q.dtype, *(cache.dtype for cache, fp8 in caches if not fp8)}
    return torch.float32 in dtypes or len(dtypes) > 1


def last_dim_contiguous(*tensors):
    """Each tensor with a unit last stride (copied only when it has not): what the kernels' row loads assume."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def pick_splits(base: int, slots: int, limit: int) -> int:
    """The split count whose base * splits programs fill `slots` concurrent programs best (fewest
    splits on near-ties), at most `limit`.

    A wave that is only partly full wastes the rest of it, so efficiency = programs / (waves *
    slots). Splits cost partial writes and a merge, so once one wave is full only a clearly better
    fill (+5%) adds splits, and never beyond twice the count that fills one wave. Used by the
    split-KV attention kernels (slots: resident CTAs on a GPU, AI cores on an NPU).
    """
    best, best_eff = 1, 0.0
    for splits in range(1, max(1, min(limit, 2 * cdiv(slots, base))) + 1):
        programs = base * splits
        eff = programs / (cdiv(programs, slots) * slots)
        if eff > best_eff * 1.05:
            best, best_eff = splits, eff
    return best


# ---------------------------------------------------------------------------------------------
# interpreter facts


def interpreting() -> bool:
    """True when kernels run under TRITON_INTERPRET=1 (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cheaper_interpreter_calls() -> None:
    """The interpreter re-patches triton.language before every kernel launch and every call of a
    @triton.jit helper inside a kernel, each time listing the language modules' members with
    inspect.getmembers (about 3 ms a call: a quarter of a CPU test run through the kernels went
    there, measured with cProfile on 2026-12-02). The builtins a module holds never change, so their
    names are listed once per module, a helper's call inside a launch (everything patched already)
    returns at once, and what gets patched, and how, is unchanged. The dtype map the interpreter
    consults for every operation (7% of that run) is memoised. Left as it is where this Triton's
    interpreter is shaped differently."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    if original is None or getattr(original, "lists_names_once", False) or not hasattr(interpreter, "_patch_attr"):
        return
    names: dict[int, list[str]] = {}

    def _patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None:
            listed = names[id(pkg)] = [name for name in dir(pkg) if tl.core.is_builtin(getattr(pkg, name, None))]
        if listed and not tl.core.is_builtin(getattr(pkg, listed[0], None)):
            return  # patched already by the launch this call is part of (a launch patches every builtin)
        for name in listed:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    _patch_builtin.lists_names_once = True
    interpreter._patch_builtin = _patch_builtin
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if np_dtype is not None and not getattr(np_dtype, "memoised", False):  # a pure map from a Triton dtype to numpy's
        known: dict = {}

        def _get_np_dtype(tt_dtype):
            try:
                return known[tt_dtype]
            except KeyError:
                known[tt_dtype] = found = np_dtype(tt_dtype)
                return found
            except TypeError:  # not hashable
                return np_dtype(tt_dtype)

        _get_np_dtype.memoised = True
        interpreter._get_np_dtype = _get_np_dtype


if interpreting():
    _cheaper_interpreter_calls()


def upcast_dot() -> bool:
    """Whether kernels convert their tl.dot operands to float32 (their DOT_F32 constexpr).

    Deviation (interpreter only): community Triton's interpreter returns garbage for tl.dot on bf16
    operands (relative error ~1e10, seen with Triton 3.8/3.9 on 2026-11-30), while bf16 converted to
    float32 before the dot is exact. On a device it is False and the matrix units see bf16.
    """
    return interpreting()


# ---------------------------------------------------------------------------------------------
# in kernels: var-len grids, float helpers


@triton.jit
def find_request(cu_q_ptr, slot, num_requests, search_steps, BLOCK_M: tl.constexpr):
    """The request b whose slots [cu_q[b] // BLOCK_M + b, cu_q[b+1] // BLOCK_M + b + 1) hold `slot`.

    The prefill kernels' grid from shapes only: Tq // BLOCK_M + B slots cover every request's query
    blocks, so no host reads cu_seqlens_q; a binary search over cu_q (search_steps = bit length of
    num_requests - 1) finds a slot's request.
    """
    lo = slot * 0
    hi = lo + num_requests
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        first_slot = tl.load(cu_q_ptr + mid) // BLOCK_M + mid
        right = first_slot <= slot
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def log1p_from_log(x):
    """Kahan's log1p from log: accurate to a few ulp, also where 1 + x rounds to 1."""
    u = 1.0 + x
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    return tl.where(u == 1.0, x, tl.log(u) * (x / d))




@triton.jit
def to_bf16_rne(x):
    """float32 -> bfloat16 rounded to nearest even by bit arithmetic (NaN stays NaN).

    The interpreter truncates float32 -> bfloat16 casts; devices and torch round to nearest even.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def e4m3_rne_bits(v):
    """The e4m3fn byte (as int32, 0..255) nearest to float32 v (|v| < 464), ties to even.

    Integer arithmetic only: the interpreter's float8 cast is wrong (it truncates), and Ascend A2/A3
    have no float8 type; on NVIDIA devices `v.to(tl.float8e4nv)` (cvt.rn) gives the same byte."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    # Normal range (|v| >= 2^-6): drop 20 of float32's 23 mantissa bits, round half to even; a
    # carry moves into the exponent by itself. Then rebias the exponent from 127 to 7.
    rounded = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20
    normal = rounded - ((127 - 7) << 3)
    # Subnormal range: code = round_half_even(|v| * 2^9); adding 2^23 rounds to an integer (RNE),
    # whose value sits in the low mantissa bits. A result of 8 is the smallest normal, 2^-6.
    sub = (mag * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    code = tl.where(mag >= 0.015625, normal, sub)
    return code | sign


@triton.jit
def e4m3_bits_to_f32(code):
    """The float32 value of e4m3fn bytes (int32 0..255; the NaN codes are never written), by integer
    arithmetic: for hardware without a float8 type (Ascend A2/A3)."""
    exponent = (code >> 3) & 15
    mantissa = code & 7
    normal = ((exponent + (127 - 7)) << 23) | (mantissa << 20)
    magnitude = tl.where(exponent > 0, normal.to(tl.float32, bitcast=True), mantissa.to(tl.float32) * 0.001953125)  # subnormal: m * 2^-9
    return tl.where((code & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def softmax_block(scores, m_i, l_i, BASE2: tl.constexpr):
    """One key block of an online softmax over rows of `scores` [M, N] (flash attention's update):
    returns the block's unnormalised weights p, the factor alpha that rescales what was accumulated
    before it, and the new running max and sum. Scores are in the log2 domain with BASE2, natural
    otherwise; a row that has seen only -inf keeps m = -inf and weights 0 (no NaN)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if BASE2:
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
    else:
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def normalise_with_sink(acc, m_i, l_i, sink, BASE2: tl.constexpr):
    """The output of an online softmax whose normaliser also counts a per-row sink logit (no value):
    acc * 2^(m - M) / (l * 2^(m - M) + 2^(sink - M)) with M = max(m, sink) (e^ without BASE2); zero
    for a row that saw no key, never a division by zero."""
    top = tl.maximum(m_i, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    if BASE2:
        w = tl.exp2(m_i - top)
        denom = l_i * w + tl.exp2(sink - top)
    else:
        w = tl.exp(m_i - top)
        denom = l_i * w + tl.exp(sink - top)
    return acc * (w / tl.where(denom > 0.0, denom, 1.0))[:, None]


@triton.jit
def split_partial(acc, m_i, l_i, BASE2: tl.constexpr):
    """A split's normalised partial output and its log-sum-exp (-inf for a row that saw no key), for
    a combine that merges the splits in a fixed order."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if BASE2:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    else:
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def merge_split_columns(
    lse_row, po_row, stride_pl_split, stride_po_split, num_splits, offs_c, c_ok, CHUNK: tl.constexpr, BASE2: tl.constexpr, sink=0.0,
    HAS_SINK: tl.constexpr = False,
):
    """One query row's output at columns offs_c from every split's normalised partial (po_row +
    k * stride_po_split) and log-sum-exp (lse_row + k * stride_pl_split): CHUNK splits a load (one
    [CHUNK, columns] tile, the loads in flight together), summed as a tree within each chunk and chunk
    after chunk, so the bits depend on the split count. A split that saw no key has lse -inf: weight 0.
    HAS_SINK: `sink` (a logit in the lse's domain) joins the normaliser without a value (attention
    sinks). The wide combines of the split-KV attention kernels."""
    offs_k = tl.arange(0, CHUNK)
    top = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    for k0 in range(0, num_splits, CHUNK):  # the largest lse first: no weight overflows, none is rescaled
        top = tl.maximum(top, tl.load(lse_row + (k0 + offs_k) * stride_pl_split, mask=k0 + offs_k < num_splits, other=float("-inf")))
    top_all = tl.max(top, axis=0)
    if HAS_SINK:
        top_all = tl.maximum(top_all, sink)
    top_all = tl.where(top_all == float("-inf"), 0.0, top_all)
    denom = tl.zeros([CHUNK], dtype=tl.float32)
    acc = tl.zeros(offs_c.shape, dtype=tl.float32)
    for k0 in range(0, num_splits, CHUNK):
        k_ok = k0 + offs_k < num_splits
        lse = tl.load(lse_row + (k0 + offs_k) * stride_pl_split, mask=k_ok, other=float("-inf"))
        if BASE2:
            w = tl.exp2(lse - top_all)
        else:
            w = tl.exp(lse - top_all)
        part = tl.load(po_row + (k0 + offs_k)[:, None] * stride_po_split + offs_c[None, :], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
        denom += w
        acc += tl.sum(w[:, None] * part, axis=0)
    total = tl.sum(denom, axis=0)
    if HAS_SINK:
        if BASE2:
            total += tl.exp2(sink - top_all)
        else:
            total += tl.exp(sink - top_all)
    return acc / tl.where(total > 0.0, total, 1.0)


@triton.jit
def fp8_kv_row(latent, rope, MANUAL_CVT: tl.constexpr):
    """One token's row in the FP8 KV format (deepinfer.ops.kv_cache_format), bit-exact with its
    reference: scale = max(amax, 1e-4) / 448 and the values divided by it (IEEE divisions), rounded
    to e4m3 (nearest even). Returns the two parts' e4m3 bytes (uint8) and the float32 scale.
    MANUAL_CVT: integer rounding (the interpreter; hardware without a float8 type: the float8 branch
    is a constexpr branch that such a caller never compiles)."""
    amax = tl.maximum(tl.max(tl.abs(latent), axis=0), tl.max(tl.abs(rope), axis=0))
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    ql = tl.math.div_rn(latent, scale)
    qr = tl.math.div_rn(rope, scale)
    if MANUAL_CVT:
        bl = e4m3_rne_bits(ql).to(tl.uint8)
        br = e4m3_rne_bits(qr).to(tl.uint8)
    else:
        bl = ql.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        br = qr.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    return bl, br, scale


@triton.jit
def norm_rope_row(nope, tail, partner, w_nope, w_tail, w_partner, cos, sin, odd, D, eps):
    """One row of norm_rope_kv_write (deepinfer.ops.compressor): the row is its first channels `nope` and its
    rope channels `tail` (masked lanes 0), `partner` holds each tail lane's pair partner (channel c ^ 1) and
    `odd` marks the second lane of each pair, so the rotation needs no shuffle across lanes. Returns the
    RMS-normed nope channels and the normed, rotated tail, in the inputs' precision, in the reference's order:
    (x * inv) * w, then a cos -/+ b sin."""
    inv = 1.0 / tl.sqrt((tl.sum(nope * nope, axis=0) + tl.sum(tail * tail, axis=0)) / D + eps)
    normed = nope * inv * w_nope
    rotated = tail * inv * w_tail * cos + tl.where(odd, 1.0, -1.0) * (partner * inv * w_partner) * sin
    return normed, rotated


@triton.jit
def rotate_tail_pairs(x, col0, pos, cs_ptr, stride_cs, D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr):
    """x [ROWS, WIDTH] (float32: columns col0 .. col0 + WIDTH - 1 of rows D wide, col0 even) with its channels
    c >= D - R rotated in DeepSeek's interleaved pairs by the table row at `pos` (`rope`, interleaved=True:
    (a, b) -> (a cos - b sin, b cos + a sin)); the other channels are returned as they are. The pairs are taken
    apart by masked sums over a [ROWS, WIDTH / 2, 2] view (exact; no tl.split, which triton-ascend may not
    lower) and joined back with tl.join."""
    pairs = tl.reshape(x, (ROWS, WIDTH // 2, 2))
    lane = tl.arange(0, 2)[None, None, :]
    a = tl.sum(tl.where(lane == 0, pairs, 0.0), axis=2)
    b = tl.sum(tl.where(lane == 1, pairs, 0.0), axis=2)
    first = col0 + 2 * tl.arange(0, WIDTH // 2)  # each pair's even channel
    tail = (first >= D - R) & (first < D)
    j = tl.where(tail, (first - (D - R)) // 2, 0)
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=tail, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + R // 2 + j, mask=tail, other=0.0).to(tl.float32)[None, :]
    ra = tl.where(tail[None, :], a * cos - b * sin, a)
    rb = tl.where(tail[None, :], b * cos + a * sin, b)
    return tl.reshape(tl.join(ra, rb), (ROWS, WIDTH))


@triton.jit
def sinkhorn_mix(z, n_ok, hc_eps, sinkhorn_iters):
    """DeepSeek-V4's hyper-connection mixing matrix from its logits z [T, N_PAD, N_PAD] (rows and
    columns past N masked by n_ok): a row softmax plus hc_eps, then alternating column and row
    normalisations (Sinkhorn), `sinkhorn_iters` column passes in all, as the reference does."""
    valid = (n_ok[:, None] & n_ok[None, :])[None, :, :]
    z = tl.where(valid, z, -1.0e30)
    ez = tl.where(valid, tl.exp(z - tl.max(z, axis=2)[:, :, None]), 0.0)
    row_sum = tl.where(n_ok[None, :], tl.sum(ez, axis=2), 1.0)
    c = tl.where(valid, ez / row_sum[:, :, None] + hc_eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    for _ in range(1, sinkhorn_iters):
        c = c / (tl.sum(c, axis=2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + hc_eps)
    return c


@triton.jit
def order_key(x):
    """float32 -> int32 whose order is the floats' order (-0.0 maps to +0.0's key): thresholds
    searched over keys are always an element's value, so ties behave as the reference's `>=`."""
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return tl.where(x == 0.0, 0, k)


@triton.jit
def from_order_key(k):
    """The float32 whose `order_key` is k."""
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)


ORDER_KEY_NONE = tl.constexpr(-(2**31))  # below every float's key (it is a NaN's bit pattern): no element
ORDER_KEY_NEG_INF = tl.constexpr(-2139095041)  # order_key(-inf)
ORDER_KEY_POS_INF = tl.constexpr(2139095040)  # order_key(+inf)


@triton.jit
def kth_largest_key(keys, k):
    """The k-th largest of the int32 `keys` (an element's exact key), or ORDER_KEY_NONE when fewer
    than k keys are above ORDER_KEY_NONE: the largest x with #(keys >= x) >= k, found bit by bit from
    the top (32 counts of the tile)."""
    x = tl.full([], -(2**31), tl.int64)
    for b in tl.static_range(31, -1, -1):
        cand = x + (1 << b)
        count = tl.sum((keys >= cand.to(tl.int32)).to(tl.int32), axis=0)
        x = tl.where(count >= k, cand, x)
    return x.to(tl.int32)


@triton.jit
def top_k_lowest_first(keys, k):
    """The top k of a tile of order keys (ORDER_KEY_NONE: no element; fewer than 2^16 of them) by
    key, equal keys lowest position first, as deepinfer.ops.indexer._top_ids_lowest_first takes them:
    every key above the k-th largest (-inf's key when fewer than k elements), then the first
    room = k - #(above) keys equal to a finite k-th. Returns (take mask, each taken element's rank
    among the taken in position order, the count taken)."""
    kth = tl.maximum(kth_largest_key(keys, k), ORDER_KEY_NEG_INF)
    above = keys > kth
    tie_key = tl.where((kth == ORDER_KEY_NEG_INF) | (kth == ORDER_KEY_POS_INF), ORDER_KEY_NONE, kth)  # ties count at a finite kth only
    tied = (keys == tie_key) & (keys != ORDER_KEY_NONE)
    # One scan counts both: the aboves in the low 16 bits, the ties in the high ones.
    counts = tl.cumsum(above.to(tl.int32) + (tied.to(tl.int32) << 16), axis=0)
    room = k - (tl.max(counts, axis=0) & 0xFFFF)
    ties_so_far = counts >> 16
    take = above | (tied & (ties_so_far <= room))
    rank = (counts & 0xFFFF) + tl.minimum(ties_so_far, room) - 1  # the aboves and the taken ties up to here
    return take, rank, k - room + tl.minimum(tl.max(ties_so_far, axis=0), room)


@triton.jit
def split_row_blocks(K, K2, xlen_ptr, t, split, num_splits, BLOCK_N: tl.constexpr, HAS_LENGTHS: tl.constexpr):
    """sparse_attention's blocks for query t and one split: (nb1, width2, nb2, lo, hi). The window list has
    nb1 = cdiv(K, BLOCK_N) row blocks, the second (compressed entries') list nb2 over the width2 ids it reads (its
    first xlen[t] with HAS_LENGTHS, else all K2); the split takes the blocks lo .. hi - 1 of the two in sequence (runs of
    cdiv(nb1 + nb2, num_splits)). The cuda and ascend kernels share it."""
    nb1 = tl.cdiv(K, BLOCK_N)
    width2 = K2
    if HAS_LENGTHS:
        width2 = tl.minimum(tl.maximum(tl.load(xlen_ptr + t).to(tl.int32), 0), K2)
    nb2 = tl.cdiv(width2, BLOCK_N)
    per_split = tl.cdiv(nb1 + nb2, num_splits)
    lo = split * per_split
    return nb1, width2, nb2, lo, lo + per_split


@triton.jit
def selection_chunk(src_ptr, src_ids_ptr, nv_ptr, t, offs, width, stride_src, FIRST: tl.constexpr):
    """(order keys, ids) of one chunk of a top-k selection row t at columns `offs`: FIRST, the row's float32
    scores (ids: their columns, valid below num_visible[t] and width); else an earlier pass's candidates
    (keys and ids, -1: none). indexer_topk's selection kernels (cuda, ascend) share it."""
    if FIRST:
        nv = tl.minimum(tl.maximum(tl.load(nv_ptr + t).to(tl.int32), 0), width)
        ok = offs < nv
        keys = tl.where(ok, order_key(tl.load(src_ptr + t * stride_src + offs, mask=ok, other=0.0)), ORDER_KEY_NONE)
        ids = offs
    else:
        ids = tl.load(src_ids_ptr + t * stride_src + offs, mask=offs < width, other=-1)
        keys = tl.where(ids >= 0, tl.load(src_ptr + t * stride_src + offs, mask=offs < width, other=ORDER_KEY_NONE), ORDER_KEY_NONE)
    return keys, ids


@triton.jit
def store_candidates(key_row, id_row, keys, ids, take, pos):
    """A chunk's taken keys and ids at their ranks `pos` of key_row / id_row (the next pass's candidates)."""
    tl.store(id_row + pos, ids, mask=take)
    tl.store(key_row + pos, keys, mask=take)


@triton.jit
def pad_selection(key_row, id_row, taken, TOP_K, BLOCK_K: tl.constexpr, KEYS: tl.constexpr):
    """-1 in id_row (and, KEYS, ORDER_KEY_NONE in key_row) at ranks taken .. TOP_K - 1: after the last taken."""
    for p0 in range(0, TOP_K, BLOCK_K):
        p = p0 + tl.arange(0, BLOCK_K)
        pad = (p >= taken) & (p < TOP_K)
        tl.store(id_row + p, tl.full([BLOCK_K], -1, tl.int32), mask=pad)
        if KEYS:
            tl.store(key_row + p, tl.full([BLOCK_K], ORDER_KEY_NONE, tl.int32), mask=pad)


# ---------------------------------------------------------------------------------------------
# the sampling hash: deepinfer.ops.sampling.sampling_uniform, in uint32


@triton.jit
def mix32(x):
    """The 32-bit finaliser of `sampling_uniform` (uint32 in, uint32 out, wrap-around multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0xD35A2D97
    return x ^ (x >> 15)


@triton.jit
def row_hash(seed, pos):
    """A row's hash from its int64 seed and position: mix(mix(mix(seed_lo + 0x9E3779B9) ^ seed_hi) ^ pos_lo)."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    pl = (pos & 0xFFFFFFFF).to(tl.uint32)
    h = mix32(lo + 0x9E3779B9)
    h = mix32(h ^ hi)
    return mix32(h ^ pl)


@triton.jit
def hash_uniform(rowhash, idx):
    """u in (0, 1) for vocabulary index idx of a row: ((mix(rowhash ^ idx) >> 9) + 0.5) * 2^-23 (exact)."""
    h = mix32(rowhash ^ idx.to(tl.uint32))
    return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
