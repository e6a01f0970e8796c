"""Triton kernels of the TRITON path (triton_attention.py): attention with a position term per key - query
distance read inside the kernel, forward and backward, O(n) memory.

    s_ij = qk_i . k_j + bias[h, r] + qr_i . vectors[h, r],    c = j - i + Tq - 1
    out_i = sum_j dropout(softmax_j(s_ij)) (v_j + values[h, r]),   r = min(max(c - first_column, 0), R - 1)

(qk, qr: the queries, already scaled, plus the encoding's content and shift vectors; the queries are
the last Tq of the Tk keys.) T5/AT5/ALiBi give `bias`, Shaw/LFHC `vectors` (their table rows spread
over the distances), XL/GCDF `vectors` (W_r R per distance); Shaw/LFHC's value term `values`. The tables
hold R rows, the distance columns first_column .. first_column + R - 1: their first row stands for every
column before, their last for every column after (the clipped ends of Shaw's and LFHC's rows;
where each column has its own row, as XL's, R = N = Tq + Tk - 1).

Tiles are square (BLOCK x BLOCK). A tile of queries m0.. and keys n0.. meets the 2 BLOCK - 1 distances
from column band = n0 - m0 + Tq - 1 - (BLOCK - 1) on: its term is computed for that band, (BLOCK, 2 BLOCK)
= qr @ vectors[band]^T + bias[band], and each (i, j) takes column j - i + BLOCK - 1 of its row
(`tl.gather`). The backward reverses it: the tile's dS skewed into the band's columns (a gather again),
dqr += dS_band @ vectors[band], and the band's gradients, dS_band summed over rows (bias) and
dS_band^T @ qr (vectors). The value term the same way with P: out += P_band @ values[band],
dP += (dO @ values[band]^T) gathered, and P_band^T @ dO for the values' gradient.

A tile whose columns all lie at or before first_column, or all at or after the last row's column, reads
one row (an end of the table, `_end_row`): its term is one number per query, qr_i . vectors[end] +
bias[end], and its value term rowsum(P) values[end], so it costs what a tile without terms costs (no
band, no gather). Whether a tile lies at an end depends on n0 - m0 only, so the tiles at the ends are
whole diagonals of tiles; with Shaw's k = 16 and 32 x 32 tiles all but three diagonals are (`CLAMPED`: a
table that has ends at all). Their gradients are sums over rows, taken by the queries' kernel: dS and P
summed per row, then dqr += rowsum(dS) vectors[end], and per block of queries rowsum(dS) . qr,
rowsum(P) . dO and the sum of dS (`EndBias`, `EndVec`, `EndVal`).

Forward: FlashAttention-2's online softmax, one program per (block of queries, batch x head); it keeps
each row's running maximum m and sum l (not their log-sum-exp m + log l: where a row sees no key, m is
the fill value, which in float32 absorbs log l, and the backward would get 1 instead of 1/l).
Backward: P = exp(s - m) / l recomputed, in three kernels, none with atomics:
    per (block of keys, b x h):      dk, dv, looping over the blocks of queries
    per (block of queries, b x h):   dqk, dqr, looping over the blocks of keys; the ends' table gradients
    per (diagonal of tiles, b x h):  the bias, vectors and values gradients of that diagonal's band of
                                     distances, looping over its tiles (the diagonals not at an end);
                                     torch then adds the diagonals' overlapping bands, folds the columns
                                     onto the table's rows and sums over b (and heads where the vectors
                                     are shared): the same result on every run
Float32 (float64 for float64 inputs) throughout.

Masks: key padding, and the causal mask (key j after query i + Tk - Tq). A blocked logit is `fill`
(the finite minimum of the inputs' dtype, as the explicit path fills it); the tiles wholly in the
future, and those of keys before a sentence's first key not padded or after its last, are skipped by
the loops' bounds (`_sentence_keys`: rows that see no key too). Columns past Tk are -inf (they are
not keys).

Attention dropout: Philox draws per (query, key, b x h) from one seed (`_kept`), the same in every
kernel; l sums the probabilities before dropout, out and the gradients use them after it.

Runs compiled on CUDA, and on CPU in Triton's interpreter (TRITON_INTERPRET=1 before this module is
imported) for the exactness tests (tests/kernels/test_triton_attention.py).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _load_rows(base, offs, stride_row, stride_d, offs_d, rows, D):
    return tl.load(base + offs[:, None] * stride_row + offs_d[None, :] * stride_d,
                   mask=(offs[:, None] < rows) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _table_row(column, first_column, rows):
    """The table row of distance column `column`: the first and last rows stand for the columns before
    and after the table's (first_column .. first_column + rows - 1)."""
    return tl.minimum(tl.maximum(column - first_column, 0), rows - 1)


@triton.jit
def _band(qr, first, bias_row, vec_head, svn, svd, offs_d, columns, first_column, rows, D,
          acc_dtype: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VECTORS: tl.constexpr, BLOCK: tl.constexpr,
          PRECISION: tl.constexpr):
    """The term of the band of distances from column `first` on, (BLOCK, 2 BLOCK), and the band's
    vectors (2 BLOCK, BLOCK_D) (zeros without vectors)."""
    column = first + tl.arange(0, 2 * BLOCK)
    inside = (column >= 0) & (column < columns)
    row = _table_row(column, first_column, rows)
    term = tl.zeros([BLOCK, 2 * BLOCK], dtype=acc_dtype)
    vectors = tl.zeros([2 * BLOCK, offs_d.shape[0]], dtype=qr.dtype)
    if HAS_VECTORS:
        vectors = tl.load(vec_head + row[:, None] * svn + offs_d[None, :] * svd,
                          mask=inside[:, None] & (offs_d[None, :] < D), other=0.0).to(qr.dtype)
        term += tl.dot(qr, tl.trans(vectors), input_precision=PRECISION)
    if HAS_BIAS:
        term += tl.load(bias_row + row, mask=inside, other=0.0).to(acc_dtype)[None, :]
    return term, vectors


@triton.jit
def _end_row(bias_row, vec_head, val_head, swn, swd, sun, sud, offs_d, row, D, dtype: tl.constexpr,
             value_dtype: tl.constexpr, acc_dtype: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VECTORS: tl.constexpr,
             HAS_VALUES: tl.constexpr):
    """Row `row` of the tables, an end (0 or rows - 1): the bias (1,) and the value vector (BLOCK_D,)
    in `acc_dtype`, the vector (BLOCK_D,) in `dtype`; the value vector rounded to `value_dtype` first,
    as a band's is (zeros where a table is absent)."""
    bias = tl.zeros([1], dtype=acc_dtype)
    vector = tl.zeros([offs_d.shape[0]], dtype=dtype)
    value = tl.zeros([offs_d.shape[0]], dtype=acc_dtype)
    if HAS_BIAS:
        bias += tl.load(bias_row + row + tl.zeros([1], dtype=tl.int32)).to(acc_dtype)
    if HAS_VECTORS:
        vector = tl.load(vec_head + row * swn + offs_d * swd, mask=offs_d < D, other=0.0).to(dtype)
    if HAS_VALUES:
        value = tl.load(val_head + row * sun + offs_d * sud, mask=offs_d < D, other=0.0).to(value_dtype).to(acc_dtype)
    return bias, vector, value


@triton.jit
def _at_end(row: tl.constexpr, first_row_start, first_row_stop, last_row_start, last_row_stop, bias_row, vec_head,
            val_head, swn, swd, sun, sud, offs_d, rows, D, dtype: tl.constexpr, value_dtype: tl.constexpr,
            acc_dtype: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr):
    """The blocks [start, stop) whose tiles lie at the tables' first row (`row` 0) or last (1), and that
    row (`_end_row`)."""
    start, stop = first_row_start, first_row_stop
    if row == 1:
        start, stop = last_row_start, last_row_stop
    bias, vector, value = _end_row(bias_row, vec_head, val_head, swn, swd, sun, sud, offs_d, row * (rows - 1), D,
                                   dtype, value_dtype, acc_dtype, HAS_BIAS, HAS_VECTORS, HAS_VALUES)
    return start, stop, bias, vector, value


@triton.jit
def _end_term(qr, bias, vector, out_dtype: tl.constexpr, acc_dtype: tl.constexpr):
    """Each query's term (BLOCK,) in a tile at an end of the tables (`_end_row`): qr_i . vector + bias,
    rounded to `out_dtype` as `_logits` rounds a band's term."""
    term = tl.sum(qr.to(acc_dtype) * vector.to(acc_dtype)[None, :], 1) + bias
    return term.to(out_dtype).to(acc_dtype)


@triton.jit
def _near_keys(start, end, m0, first_column, rows, Tq, BLOCK: tl.constexpr):
    """The blocks of keys [near_start, near_end) within [start, end) whose tiles with the block of
    queries from m0 are not wholly at one end of the tables: those before lie at the first row, those
    after at the last. A tile's columns are n0 - m0 + Tq - 1 - (BLOCK - 1) .. n0 - m0 + Tq - 1 + (BLOCK - 1)."""
    low_end = tl.maximum(first_column + m0 - Tq + 2, 0) // BLOCK * BLOCK
    high_start = (tl.maximum(first_column + rows - 1 + m0 - Tq + BLOCK, 0) + BLOCK - 1) // BLOCK * BLOCK
    return _three_ranges(start, end, low_end, high_start)


@triton.jit
def _near_queries(start, end, n0, first_column, rows, Tq, BLOCK: tl.constexpr):
    """`_near_keys` seen from the block of keys from n0: the blocks of queries [near_start, near_end)
    within [start, end); those before lie at the tables' last row, those after at the first."""
    high_end = tl.maximum(n0 - first_column - rows + 1 + Tq, 0) // BLOCK * BLOCK
    low_start = (tl.maximum(n0 - first_column + Tq + BLOCK - 2, 0) + BLOCK - 1) // BLOCK * BLOCK
    return _three_ranges(start, end, high_end, low_start)


@triton.jit
def _three_ranges(start, end, middle_start, middle_end):
    """[start, end) cut at middle_start and middle_end (each clamped into the range, in order)."""
    a = tl.minimum(tl.maximum(middle_start, start), end)
    return a, tl.minimum(tl.maximum(middle_end, a), end)


@triton.jit
def _key_rows(K, V, b, h, n0, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, Tk, D, BLOCK: tl.constexpr):
    """k and v of the block of keys from n0, (BLOCK, BLOCK_D) each (zeros past Tk and D)."""
    offs_n = n0 + tl.arange(0, BLOCK)
    return (_load_rows(K + b * skb + h * skh, offs_n, skn, skd, offs_d, Tk, D),
            _load_rows(V + b * svb + h * svh, offs_n, svn, svd, offs_d, Tk, D))


@triton.jit
def _keys_end(m0, Tq, Tk, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """The end of the keys that the block of queries from m0 sees: under the causal mask, up to its
    last query's key (later tiles are wholly in the future, skipped)."""
    end = Tk
    if CAUSAL:
        end = tl.minimum(Tk, m0 + BLOCK + Tk - Tq)
    return end


@triton.jit
def _sentence_keys(Keys, b, Tk, HAS_PADDING: tl.constexpr):
    """What padding leaves of sentence b's keys (`sentence_keys`): how many of its first queries see no
    key, and its keys from the first to the last that is not padding, [first, stop) ((0, 0, Tk)
    without padding). The tiles of keys outside that range are skipped by the loops' bounds (no branch
    in a loop: Triton pipelines the loads of a loop without one). A block of queries that holds a row
    seeing no key skips no tile: that row's logits are all the fill value, so it gets uniform weights
    over all Tk keys, as the explicit path gives it; a row that sees a key gains exactly nothing from a
    tile whose logits are all blocked (exp(fill - m) = 0), so extra tiles are harmless."""
    unseen = b * 0
    first = b * 0
    stop = b * 0 + Tk
    if HAS_PADDING:
        unseen = tl.load(Keys + 3 * b)
        first = tl.load(Keys + 3 * b + 1)
        stop = tl.load(Keys + 3 * b + 2)
    return unseen, first, stop


@triton.jit
def _key_tiles(Keys, b, m0, Tq, Tk, HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr):
    """The keys [start, end) whose tiles the block of queries from m0 visits (`_sentence_keys`)."""
    unseen, first, stop = _sentence_keys(Keys, b, Tk, HAS_PADDING)
    every = m0 < unseen
    return (tl.where(every, 0, first // BLOCK * BLOCK),
            tl.where(every, Tk, tl.minimum(_keys_end(m0, Tq, Tk, CAUSAL, BLOCK), stop)))


@triton.jit
def _kept(Seed, bh, offs_m, offs_n, Tk, dropout_p, HAS_DROPOUT: tl.constexpr):
    """Where attention dropout keeps the probability of query i and key j, (BLOCK, BLOCK): Philox of the
    pass's seed at counters (i Tk + j, b x h) as a uniform number in [0, 1), kept where >= dropout_p.
    Every kernel draws the same for the same (i, j) (all True without dropout)."""
    keep = (offs_m[:, None] >= 0) & (offs_n[None, :] >= 0)
    if HAS_DROPOUT:
        counter = offs_m[:, None] * Tk + offs_n[None, :]
        zero = counter * 0
        bits, _, _, _ = tl.philox(tl.load(Seed), counter, zero + bh, zero, zero)
        keep = tl.uint_to_uniform_float(bits) >= dropout_p
    return keep


@triton.jit
def _logits(qk, k_t, qr, m0, n0, bias_row, vec_head, svn, svd, offs_d, pad_row, fill, end_term, Tq, Tk, D,
            first_column, rows, HAS_BIAS: tl.constexpr, HAS_VECTORS: tl.constexpr, HAS_PADDING: tl.constexpr,
            CAUSAL: tl.constexpr, AT_END: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """A tile's logits (BLOCK, BLOCK) with the term and the masks, where they are blocked, and the
    band's vectors (zeros at an end of the tables, `AT_END`, whose term is `end_term` per query)."""
    rows_in_tile = tl.arange(0, BLOCK)
    offs_m, offs_n = m0 + rows_in_tile, n0 + rows_in_tile
    s = tl.dot(qk, k_t, input_precision=PRECISION)
    vectors = tl.zeros([2 * BLOCK, offs_d.shape[0]], dtype=qr.dtype)
    if AT_END:
        s += end_term[:, None]
    else:
        term, vectors = _band(qr, n0 - m0 + (Tq - 1) - (BLOCK - 1), bias_row, vec_head, svn, svd, offs_d,
                              Tq + Tk - 1, first_column, rows, D, s.dtype, HAS_BIAS, HAS_VECTORS, BLOCK, PRECISION)
        # column j - i + BLOCK - 1 of row i; the term rounded to the inputs' dtype, as the explicit path adds it
        s += tl.gather(term, rows_in_tile[None, :] - rows_in_tile[:, None] + (BLOCK - 1), axis=1).to(qk.dtype).to(s.dtype)
    blocked = (offs_m[:, None] < 0) & (offs_n[None, :] < 0)
    if CAUSAL:
        blocked = blocked | (offs_n[None, :] > offs_m[:, None] + (Tk - Tq))
    if HAS_PADDING:
        padded = tl.load(pad_row + offs_n, mask=offs_n < Tk, other=0) != 0
        blocked = blocked | padded[None, :]
    s = tl.where(blocked, fill, s)
    s = tl.where(offs_n[None, :] < Tk, s, float("-inf"))
    return s, blocked, vectors


@triton.jit
def _key_tile(qk, qr, K, V, b, h, m0, n0, bias_row, vec_head, pad_row, fill, end_term, offs_d, skb, skh, skn, skd,
              svb, svh, svn, svd, swn, swd, Tq, Tk, D, first_column, rows, HAS_BIAS: tl.constexpr,
              HAS_VECTORS: tl.constexpr, HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr, AT_END: tl.constexpr,
              BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """k, v of the block of keys from n0 and the tile's logits, where they are blocked and the band's
    vectors (`_logits`)."""
    k, v = _key_rows(K, V, b, h, n0, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, Tk, D, BLOCK)
    s, blocked, vectors = _logits(qk, tl.trans(k), qr, m0, n0, bias_row, vec_head, swn, swd, offs_d, pad_row, fill,
                                  end_term, Tq, Tk, D, first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_PADDING, CAUSAL,
                                  AT_END, BLOCK, PRECISION)
    return k, v, s, blocked, vectors


@triton.jit
def _products(do, v, val_head, sun, sud, offs_d, m0, n0, Tq, Tk, D, first_column, rows, end_value,
              HAS_VALUES: tl.constexpr, AT_END: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """dP of a tile: dO_i . (v_j + values[h, r]), the value vectors of the band gathered as the term
    (at an end of the tables, dO_i . end_value for every key)."""
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if HAS_VALUES:
        if AT_END:
            dp += tl.sum(do.to(end_value.dtype) * end_value[None, :], 1)[:, None]
        else:
            tile_rows = tl.arange(0, BLOCK)
            values = _values_band(val_head, sun, sud, offs_d, m0, n0, Tq, Tk, D, first_column, rows, v.dtype, BLOCK)
            per_column = tl.dot(do, tl.trans(values), input_precision=PRECISION)
            dp += tl.gather(per_column, tile_rows[None, :] - tile_rows[:, None] + (BLOCK - 1), axis=1)
    return dp


@triton.jit
def _values_band(val_head, sun, sud, offs_d, m0, n0, Tq, Tk, D, first_column, rows, dtype: tl.constexpr,
                 BLOCK: tl.constexpr):
    """The value vectors of a tile's band of distances, (2 BLOCK, BLOCK_D)."""
    column = n0 - m0 + (Tq - 1) - (BLOCK - 1) + tl.arange(0, 2 * BLOCK)
    inside = (column >= 0) & (column < Tq + Tk - 1)
    row = _table_row(column, first_column, rows)
    return tl.load(val_head + row[:, None] * sun + offs_d[None, :] * sud,
                   mask=inside[:, None] & (offs_d[None, :] < D), other=0.0).to(dtype)


@triton.jit
def _skewed(ds, BLOCK: tl.constexpr):
    """(BLOCK, 2 BLOCK): row i of `ds` shifted right by BLOCK - 1 - i, so that column w holds the
    distance column band + w (zeros elsewhere): the adjoint of `_logits`' gather."""
    rows = tl.arange(0, BLOCK)
    source = tl.arange(0, 2 * BLOCK)[None, :] + rows[:, None] - (BLOCK - 1)
    inside = (source >= 0) & (source < BLOCK)
    return tl.where(inside, tl.gather(ds, tl.minimum(tl.maximum(source, 0), BLOCK - 1), axis=1), 0.0)


@triton.jit
def _probabilities(s, blocked, m_i, l_i, dp, delta, offs_m, Tq, keep, dropout_p, HAS_DROPOUT: tl.constexpr):
    """The probabilities after dropout and dS of a tile (rows past Tq: zeros); dS is zero where the logit
    is blocked (a constant). `dp`: dO . (v + values), the gradient of the dropped probabilities, so
    dropout's mask and scale apply to it too (delta = rowsum(dO * out) is sum_j P_ij dP_ij either way)."""
    p = tl.exp(s - m_i[:, None]) / l_i[:, None]
    p = tl.where(offs_m[:, None] < Tq, p, 0.0)
    dropped = p
    if HAS_DROPOUT:
        dropped = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        dp = tl.where(keep, dp / (1.0 - dropout_p), 0.0)
    ds = tl.where(blocked, 0.0, p * (dp - delta[:, None]))
    return dropped, ds


@triton.jit
def _tile_gradients(s, blocked, do, v, m_i, l_i, delta, Seed, bh, val_head, sun, sud, offs_d, offs_m, m0, n0, Tq, Tk,
                    D, first_column, rows, end_value, dropout_p, HAS_VALUES: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    AT_END: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """The backward of a tile: its probabilities after dropout and dS (`_products`, `_probabilities`)."""
    dp = _products(do, v, val_head, sun, sud, offs_d, m0, n0, Tq, Tk, D, first_column, rows, end_value, HAS_VALUES,
                   AT_END, BLOCK, PRECISION)
    keep = _kept(Seed, bh, offs_m, n0 + tl.arange(0, BLOCK), Tk, dropout_p, HAS_DROPOUT)
    return _probabilities(s, blocked, m_i, l_i, dp, delta, offs_m, Tq, keep, dropout_p, HAS_DROPOUT)


@triton.jit
def _query_rows(Q, QR, dO, M, L, Delta, b, h, bh, offs_m, offs_d, sqb, sqh, sqm, sqd, sob, soh, som, sod, Tq, D):
    """What the backward reads of a block of queries: qk, qr, dO, and each row's m, l and
    rowsum(dO * out) (rows past Tq: m 0, l 1)."""
    qk = _load_rows(Q + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
    qr = _load_rows(QR + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
    do = _load_rows(dO + b * sob + h * soh, offs_m, som, sod, offs_d, Tq, D)
    row = bh * Tq + offs_m
    m_i = tl.load(M + row, mask=offs_m < Tq, other=0.0)
    l_i = tl.load(L + row, mask=offs_m < Tq, other=1.0)
    delta = tl.load(Delta + row, mask=offs_m < Tq, other=0.0)
    return qk, qr, do, m_i, l_i, delta


@triton.jit
def _forward_tiles(acc, m_i, l_i, start, end, qk, qr, K, V, Seed, b, h, bh, m0, offs_m, offs_d, bias_row, vec_head,
                   val_head, pad_row, fill, end_term, end_value, skb, skh, skn, skd, svb, svh, svn, svd, swn, swd,
                   sun, sud, Tq, Tk, D, dropout_p, first_column, rows, HAS_BIAS: tl.constexpr,
                   HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr, HAS_PADDING: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, AT_END: tl.constexpr, BLOCK: tl.constexpr,
                   PRECISION: tl.constexpr):
    """The online softmax over the blocks of keys start, start + BLOCK, .. < end (all at one end of the
    tables where AT_END): the running acc, m and l."""
    for n0 in range(start, end, BLOCK):
        k, v, s, blocked, vectors = _key_tile(qk, qr, K, V, b, h, m0, n0, bias_row, vec_head, pad_row, fill, end_term,
                                              offs_d, skb, skh, skn, skd, svb, svh, svn, svd, swn, swd, Tq, Tk, D,
                                              first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_PADDING, CAUSAL, AT_END,
                                              BLOCK, PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if HAS_DROPOUT:  # (the sum l is of the probabilities before dropout)
            keep = _kept(Seed, bh, offs_m, n0 + tl.arange(0, BLOCK), Tk, dropout_p, HAS_DROPOUT)
            p = tl.where(keep, p / (1.0 - dropout_p), 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        if HAS_VALUES:  # sum_j p_ij values[h, r]
            if AT_END:
                acc += tl.sum(p, 1)[:, None] * end_value[None, :]
            else:  # the probabilities skewed into the band's columns
                values = _values_band(val_head, sun, sud, offs_d, m0, n0, Tq, Tk, D, first_column, rows, v.dtype,
                                      BLOCK)
                acc += tl.dot(_skewed(p, BLOCK).to(v.dtype), values, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attention_forward(Q, QR, K, V, Bias, Vec, Val, Pad, Keys, Seed, Fill, Out, M, L,
                       sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                       sbh, swh, swn, swd, suh, sun, sud, spb,
                       H, Tq, Tk, D, dropout_p, first_column, rows,
                       BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_VECTORS: tl.constexpr,
                       HAS_VALUES: tl.constexpr, HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr,
                       HAS_DROPOUT: tl.constexpr, CLAMPED: tl.constexpr, PRECISION: tl.constexpr):
    """(Q and QR share strides, as dO and Out do.)"""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    m0 = block * BLOCK
    offs_m = m0 + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    qk = _load_rows(Q + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
    qr = _load_rows(QR + b * sqb + h * sqh, offs_m, sqm, sqd, offs_d, Tq, D)
    fill = tl.load(Fill)
    bias_row, vec_head, val_head, pad_row = Bias + h * sbh, Vec + h * swh, Val + h * suh, Pad + b * spb
    m_i = tl.zeros([BLOCK], dtype=fill.dtype) + float("-inf")
    l_i = tl.zeros([BLOCK], dtype=fill.dtype)
    acc = tl.zeros([BLOCK, BLOCK_D], dtype=fill.dtype)
    start, end = _key_tiles(Keys, b, m0, Tq, Tk, HAS_PADDING, CAUSAL, BLOCK)
    near_start, near_end = start, end
    if CLAMPED:  # the blocks of keys at the tables' first row, then those at their last
        near_start, near_end = _near_keys(start, end, m0, first_column, rows, Tq, BLOCK)
        for row in tl.static_range(2):
            first_tile, stop, bias, vector, value = _at_end(row, start, near_start, near_end, end, bias_row, vec_head,
                                                            val_head, swn, swd, sun, sud, offs_d, rows, D, qr.dtype,
                                                            V.dtype.element_ty, fill.dtype, HAS_BIAS, HAS_VECTORS,
                                                            HAS_VALUES)
            end_term = _end_term(qr, bias, vector, qk.dtype, fill.dtype)
            acc, m_i, l_i = _forward_tiles(acc, m_i, l_i, first_tile, stop, qk, qr, K, V, Seed, b, h, bh, m0,
                                           offs_m, offs_d, bias_row, vec_head, val_head, pad_row, fill, end_term,
                                           value, skb, skh, skn, skd, svb, svh, svn, svd, swn, swd, sun, sud, Tq, Tk,
                                           D, dropout_p, first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_VALUES,
                                           HAS_PADDING, CAUSAL, HAS_DROPOUT, True, BLOCK, PRECISION)
    acc, m_i, l_i = _forward_tiles(acc, m_i, l_i, near_start, near_end, qk, qr, K, V, Seed, b, h, bh, m0, offs_m,
                                   offs_d, bias_row, vec_head, val_head, pad_row, fill, l_i, l_i, skb, skh, skn, skd,
                                   svb, svh, svn, svd, swn, swd, sun, sud, Tq, Tk, D, dropout_p, first_column, rows,
                                   HAS_BIAS, HAS_VECTORS, HAS_VALUES, HAS_PADDING, CAUSAL, HAS_DROPOUT, False, BLOCK,
                                   PRECISION)
    out = acc / l_i[:, None]
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, out.to(Out.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D))
    row = bh * Tq + offs_m
    tl.store(M + row, m_i, mask=offs_m < Tq)
    tl.store(L + row, l_i, mask=offs_m < Tq)


@triton.jit
def _key_block_tiles(dk, dv, start, end, k, v, Q, QR, dO, M, L, Delta, Seed, b, h, bh, n0, offs_d, bias_row, vec_head,
                     val_head, pad_row, fill, end_bias, end_vector, end_value, sqb, sqh, sqm, sqd, sob, soh, som, sod,
                     swn, swd, sun, sud, Tq, Tk, D, dropout_p, first_column, rows, HAS_BIAS: tl.constexpr,
                     HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr, HAS_PADDING: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, AT_END: tl.constexpr, BLOCK: tl.constexpr,
                     PRECISION: tl.constexpr):
    """dk, dv summed over the blocks of queries start, start + BLOCK, .. < end (all at one end of the
    tables where AT_END: `_end_row`'s bias, vector and value)."""
    for m0 in range(start, end, BLOCK):
        offs_m = m0 + tl.arange(0, BLOCK)
        qk, qr, do, m_i, l_i, delta = _query_rows(Q, QR, dO, M, L, Delta, b, h, bh, offs_m, offs_d, sqb, sqh, sqm,
                                                  sqd, sob, soh, som, sod, Tq, D)
        end_term = m_i
        if AT_END:
            end_term = _end_term(qr, end_bias, end_vector, qk.dtype, fill.dtype)
        s, blocked, _ = _logits(qk, tl.trans(k), qr, m0, n0, bias_row, vec_head, swn, swd, offs_d, pad_row, fill,
                                end_term, Tq, Tk, D, first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_PADDING, CAUSAL,
                                AT_END, BLOCK, PRECISION)
        p, ds = _tile_gradients(s, blocked, do, v, m_i, l_i, delta, Seed, bh, val_head, sun, sud, offs_d, offs_m,
                                m0, n0, Tq, Tk, D, first_column, rows, end_value, dropout_p, HAS_VALUES, HAS_DROPOUT,
                                AT_END, BLOCK, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(qk.dtype)), qk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _attention_backward_keys(Q, QR, K, V, Bias, Vec, Val, Pad, Keys, Seed, Fill, dO, M, L, Delta, dK, dV,
                             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                             sbh, swh, swn, swd, suh, sun, sud, spb,
                             H, Tq, Tk, D, dropout_p, first_column, rows,
                             BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr, HAS_PADDING: tl.constexpr,
                             CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, CLAMPED: tl.constexpr,
                             PRECISION: tl.constexpr):
    """dk, dv of a block of keys (dK, dV share the strides of K, V)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    n0 = block * BLOCK
    offs_n = n0 + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    k, v = _key_rows(K, V, b, h, n0, offs_d, skb, skh, skn, skd, svb, svh, svn, svd, Tk, D, BLOCK)
    fill = tl.load(Fill)
    bias_row, vec_head, val_head, pad_row = Bias + h * sbh, Vec + h * swh, Val + h * suh, Pad + b * spb
    dk = tl.zeros([BLOCK, BLOCK_D], dtype=fill.dtype)
    dv = tl.zeros([BLOCK, BLOCK_D], dtype=fill.dtype)
    start = 0
    if CAUSAL:  # the first query that sees this block's first key
        start = tl.maximum(0, n0 - (Tk - Tq)) // BLOCK * BLOCK
    unseen, first_key, stop_key = _sentence_keys(Keys, b, Tk, HAS_PADDING)
    live = (n0 + BLOCK > first_key) & (n0 < stop_key)
    # (rows that see no key: every block of queries from 0, the extra tiles harmless)
    start = tl.where(unseen > 0, 0, tl.where(live, start, Tq))
    near_start, near_end = start, Tq
    if CLAMPED:  # the blocks of queries at the tables' last row, then those at their first
        near_start, near_end = _near_queries(start, Tq, n0, first_column, rows, Tq, BLOCK)
        for row in tl.static_range(2):
            first_tile, stop, bias, vector, value = _at_end(row, near_end, Tq, start, near_start, bias_row, vec_head,
                                                            val_head, swn, swd, sun, sud, offs_d, rows, D,
                                                            QR.dtype.element_ty, V.dtype.element_ty, fill.dtype,
                                                            HAS_BIAS, HAS_VECTORS, HAS_VALUES)
            dk, dv = _key_block_tiles(dk, dv, first_tile, stop, k, v, Q, QR, dO, M, L, Delta, Seed, b, h, bh, n0,
                                      offs_d, bias_row, vec_head, val_head, pad_row, fill, bias, vector, value, sqb,
                                      sqh, sqm, sqd, sob, soh, som, sod, swn, swd, sun, sud, Tq, Tk, D, dropout_p,
                                      first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_VALUES, HAS_PADDING, CAUSAL,
                                      HAS_DROPOUT, True, BLOCK, PRECISION)
    dk, dv = _key_block_tiles(dk, dv, near_start, near_end, k, v, Q, QR, dO, M, L, Delta, Seed, b, h, bh, n0, offs_d,
                              bias_row, vec_head, val_head, pad_row, fill, dk, dk, dk, sqb, sqh, sqm, sqd, sob, soh,
                              som, sod, swn, swd, sun, sud, Tq, Tk, D, dropout_p, first_column, rows, HAS_BIAS,
                              HAS_VECTORS, HAS_VALUES, HAS_PADDING, CAUSAL, HAS_DROPOUT, False, BLOCK, PRECISION)
    tl.store(dK + b * skb + h * skh + offs_n[:, None] * skn + offs_d[None, :] * skd, dk.to(dK.dtype.element_ty),
             mask=(offs_n[:, None] < Tk) & (offs_d[None, :] < D))
    tl.store(dV + b * svb + h * svh + offs_n[:, None] * svn + offs_d[None, :] * svd, dv.to(dV.dtype.element_ty),
             mask=(offs_n[:, None] < Tk) & (offs_d[None, :] < D))


@triton.jit
def _query_block_tiles(dqk, dqr, ds_sum, p_sum, start, end, qk, qr, do, m_i, l_i, delta, K, V, Seed, b, h, bh, m0,
                       offs_m, offs_d, bias_row, vec_head, val_head, pad_row, fill, end_term, end_value, skb, skh, skn,
                       skd, svb, svh, svn, svd, swn, swd, sun, sud, Tq, Tk, D, dropout_p, first_column, rows,
                       HAS_BIAS: tl.constexpr, HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr,
                       HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                       AT_END: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """dqk, dqr summed over the blocks of keys start, start + BLOCK, .. < end; at an end of the tables
    (AT_END) dS and P summed per row instead of dqr."""
    for n0 in range(start, end, BLOCK):
        k, v, s, blocked, vectors = _key_tile(qk, qr, K, V, b, h, m0, n0, bias_row, vec_head, pad_row, fill, end_term,
                                              offs_d, skb, skh, skn, skd, svb, svh, svn, svd, swn, swd, Tq, Tk, D,
                                              first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_PADDING, CAUSAL, AT_END,
                                              BLOCK, PRECISION)
        p, ds = _tile_gradients(s, blocked, do, v, m_i, l_i, delta, Seed, bh, val_head, sun, sud, offs_d, offs_m,
                                m0, n0, Tq, Tk, D, first_column, rows, end_value, dropout_p, HAS_VALUES, HAS_DROPOUT,
                                AT_END, BLOCK, PRECISION)
        dqk += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if AT_END:
            ds_sum += tl.sum(ds, 1)
            p_sum += tl.sum(p, 1)
        else:
            if HAS_VECTORS:
                dqr += tl.dot(_skewed(ds, BLOCK).to(vectors.dtype), vectors, input_precision=PRECISION)
    return dqk, dqr, ds_sum, p_sum


@triton.jit
def _attention_backward_queries(Q, QR, K, V, Bias, Vec, Val, Pad, Keys, Seed, Fill, dO, M, L, Delta, dQ, dQR,
                                EndBias, EndVec, EndVal,
                                sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                                sbh, swh, swn, swd, suh, sun, sud, spb,
                                H, Tq, Tk, D, dropout_p, first_column, rows,
                                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                                HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr, HAS_PADDING: tl.constexpr,
                                CAUSAL: tl.constexpr, HAS_DROPOUT: tl.constexpr, CLAMPED: tl.constexpr,
                                BIAS_GRAD: tl.constexpr, VECTORS_GRAD: tl.constexpr, VALUES_GRAD: tl.constexpr,
                                PRECISION: tl.constexpr):
    """dqk (and dqr with vectors) of a block of queries (dQ, dQR share the strides of Q); with CLAMPED,
    the tables' gradients from its tiles at their ends, [bh, block, end] (end 0: the first row, 1: the
    last): EndBias the sum of dS, EndVec rowsum(dS) . qr, EndVal rowsum(P) . dO (BLOCK_D each)."""
    block, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    m0 = block * BLOCK
    offs_m = m0 + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    qk, qr, do, m_i, l_i, delta = _query_rows(Q, QR, dO, M, L, Delta, b, h, bh, offs_m, offs_d, sqb, sqh, sqm, sqd,
                                              sob, soh, som, sod, Tq, D)
    fill = tl.load(Fill)
    bias_row, vec_head, val_head, pad_row = Bias + h * sbh, Vec + h * swh, Val + h * suh, Pad + b * spb
    dqk = tl.zeros([BLOCK, BLOCK_D], dtype=fill.dtype)
    dqr = tl.zeros([BLOCK, BLOCK_D], dtype=fill.dtype)
    start, end = _key_tiles(Keys, b, m0, Tq, Tk, HAS_PADDING, CAUSAL, BLOCK)
    near_start, near_end = start, end
    if CLAMPED:  # the blocks of keys at the tables' first row, then those at their last
        near_start, near_end = _near_keys(start, end, m0, first_column, rows, Tq, BLOCK)
        part = (bh * tl.num_programs(0) + block) * 2
        for row in tl.static_range(2):
            first_tile, stop, bias, vector, value = _at_end(row, start, near_start, near_end, end, bias_row, vec_head,
                                                            val_head, swn, swd, sun, sud, offs_d, rows, D, qr.dtype,
                                                            V.dtype.element_ty, fill.dtype, HAS_BIAS, HAS_VECTORS,
                                                            HAS_VALUES)
            ds_sum = tl.zeros([BLOCK], dtype=fill.dtype)
            p_sum = tl.zeros([BLOCK], dtype=fill.dtype)
            dqk, dqr, ds_sum, p_sum = _query_block_tiles(
                dqk, dqr, ds_sum, p_sum, first_tile, stop, qk, qr, do, m_i, l_i, delta, K, V, Seed, b, h, bh, m0,
                offs_m, offs_d, bias_row, vec_head, val_head, pad_row, fill, _end_term(qr, bias, vector, qk.dtype,
                                                                                       fill.dtype),
                value, skb, skh, skn, skd, svb, svh, svn, svd, swn, swd, sun, sud, Tq, Tk, D, dropout_p, first_column,
                rows, HAS_BIAS, HAS_VECTORS, HAS_VALUES, HAS_PADDING, CAUSAL, HAS_DROPOUT, True, BLOCK, PRECISION)
            if HAS_VECTORS:
                dqr += ds_sum[:, None] * vector.to(fill.dtype)[None, :]
            if BIAS_GRAD:
                tl.store(EndBias + part + row + tl.zeros([1], dtype=tl.int32), tl.sum(ds_sum, 0) + tl.zeros([1], dtype=fill.dtype))
            if VECTORS_GRAD:
                tl.store(EndVec + (part + row) * BLOCK_D + offs_d, tl.sum(ds_sum[:, None] * qr.to(fill.dtype), 0))
            if VALUES_GRAD:
                tl.store(EndVal + (part + row) * BLOCK_D + offs_d, tl.sum(p_sum[:, None] * do.to(fill.dtype), 0))
    dqk, dqr, _, _ = _query_block_tiles(
        dqk, dqr, l_i, l_i, near_start, near_end, qk, qr, do, m_i, l_i, delta, K, V, Seed, b, h, bh, m0, offs_m,
        offs_d, bias_row, vec_head, val_head, pad_row, fill, l_i, l_i, skb, skh, skn, skd, svb, svh, svn, svd, swn,
        swd, sun, sud, Tq, Tk, D, dropout_p, first_column, rows, HAS_BIAS, HAS_VECTORS, HAS_VALUES, HAS_PADDING,
        CAUSAL, HAS_DROPOUT, False, BLOCK, PRECISION)
    tl.store(dQ + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, dqk.to(dQ.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D))
    if HAS_VECTORS:
        tl.store(dQR + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd,
                 dqr.to(dQR.dtype.element_ty), mask=(offs_m[:, None] < Tq) & (offs_d[None, :] < D))


@triton.jit
def _attention_backward_distances(Q, QR, K, V, Bias, Vec, Val, Pad, Keys, Seed, Fill, dO, M, L, Delta, BiasPart, VecPart, ValPart,
                                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
                                  sbh, swh, swn, swd, suh, sun, sud, spb,
                                  H, Tq, Tk, D, dropout_p, first_column, rows, query_blocks, key_blocks, first_diagonal,
                                  BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, HAS_BIAS: tl.constexpr,
                                  HAS_VECTORS: tl.constexpr, HAS_VALUES: tl.constexpr, HAS_PADDING: tl.constexpr, CAUSAL: tl.constexpr,
                                  HAS_DROPOUT: tl.constexpr, BIAS_GRAD: tl.constexpr, VECTORS_GRAD: tl.constexpr, VALUES_GRAD: tl.constexpr,
                                  PRECISION: tl.constexpr):
    """The band gradients of diagonal `t` = first_diagonal + the program's of tiles (key block - query
    block = t - (query_blocks - 1)), one not at an end of the tables (`backward`): BiasPart[bh, program]
    (2 BLOCK,), VecPart and ValPart[bh, program] (2 BLOCK, BLOCK_D), summed over its tiles."""
    t, bh = first_diagonal + tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_d = tl.arange(0, BLOCK_D)
    fill = tl.load(Fill)
    bias_row, vec_head, val_head, pad_row = Bias + h * sbh, Vec + h * swh, Val + h * suh, Pad + b * spb
    bias_grad = tl.zeros([2 * BLOCK], dtype=fill.dtype)
    vec_grad = tl.zeros([2 * BLOCK, BLOCK_D], dtype=fill.dtype)
    val_grad = tl.zeros([2 * BLOCK, BLOCK_D], dtype=fill.dtype)
    shift = t - (query_blocks - 1)  # key block - query block
    first = tl.maximum(0, -shift)
    last = tl.minimum(query_blocks, key_blocks - shift)
    unseen, first_key, stop_key = _sentence_keys(Keys, b, Tk, HAS_PADDING)
    live_first = tl.maximum(first, first_key // BLOCK - shift)  # (the tiles of keys not all padding)
    live_last = tl.minimum(last, (stop_key + BLOCK - 1) // BLOCK - shift)
    if CAUSAL:  # the diagonal's tiles are all wholly in the future, or none is
        future = shift * BLOCK > BLOCK - 1 + Tk - Tq
        live_last = tl.where(future, live_first, live_last)
        last = tl.where(future, tl.minimum(last, (unseen + BLOCK - 1) // BLOCK), last)
    # (rows that see no key: every tile of their blocks, the extra tiles of the others harmless)
    first, last = tl.where(unseen > 0, first, live_first), tl.where(unseen > 0, last, live_last)
    unused = tl.zeros([BLOCK], dtype=fill.dtype)
    for query_block in range(first, last):
        m0 = query_block * BLOCK
        n0 = (query_block + shift) * BLOCK
        offs_m = m0 + tl.arange(0, BLOCK)
        qk, qr, do, m_i, l_i, delta = _query_rows(Q, QR, dO, M, L, Delta, b, h, bh, offs_m, offs_d, sqb, sqh, sqm,
                                                  sqd, sob, soh, som, sod, Tq, D)
        k, v, s, blocked, _ = _key_tile(qk, qr, K, V, b, h, m0, n0, bias_row, vec_head, pad_row, fill, unused, offs_d,
                                        skb, skh, skn, skd, svb, svh, svn, svd, swn, swd, Tq, Tk, D, first_column,
                                        rows, HAS_BIAS, HAS_VECTORS, HAS_PADDING, CAUSAL, False, BLOCK, PRECISION)
        p, ds = _tile_gradients(s, blocked, do, v, m_i, l_i, delta, Seed, bh, val_head, sun, sud, offs_d, offs_m,
                                m0, n0, Tq, Tk, D, first_column, rows, unused, dropout_p, HAS_VALUES, HAS_DROPOUT,
                                False, BLOCK, PRECISION)
        band = _skewed(ds, BLOCK)
        if VALUES_GRAD:
            val_grad += tl.dot(tl.trans(_skewed(p, BLOCK).to(do.dtype)), do, input_precision=PRECISION)
        if BIAS_GRAD:
            bias_grad += tl.sum(band, 0)
        if VECTORS_GRAD:
            vec_grad += tl.dot(tl.trans(band.to(qr.dtype)), qr, input_precision=PRECISION)
    part = bh * tl.num_programs(0) + tl.program_id(0)
    width = tl.arange(0, 2 * BLOCK)
    if BIAS_GRAD:
        tl.store(BiasPart + part * (2 * BLOCK) + width, bias_grad)
    if VECTORS_GRAD:
        tl.store(VecPart + (part * (2 * BLOCK) + width[:, None]) * BLOCK_D + offs_d[None, :], vec_grad)
    if VALUES_GRAD:
        tl.store(ValPart + (part * (2 * BLOCK) + width[:, None]) * BLOCK_D + offs_d[None, :], val_grad)


def _strides(*tensors):
    return [stride for x in tensors for stride in x.stride()]


def settings(dtype: torch.dtype, head_dims: int, on_cuda: bool, vectors: bool) -> dict:
    """The kernels' compile-time settings for inputs of `dtype` with `head_dims` per head, with or
    without `vectors`. Tiles: 16 in the interpreter (the smallest tl.dot); on CUDA 64 for a bias
    alone in fp16/bf16 with heads of at most 64 dims, else 32: with vectors, float32 or wider heads,
    64 x 64 tiles need more shared memory than an A100 or H100 gives one block
    (tests/kernels/compile_triton.py; docs/triton_attention.md). Float32 products in IEEE arithmetic, as torch's default matmul
    (no TF32; the choice applies to float32 operands only)."""
    head_block = max(16, triton.next_power_of_2(head_dims))
    small = vectors or head_block > 64 or dtype not in (torch.float16, torch.bfloat16)
    block = (32 if small else 64) if on_cuda else 16
    return dict(BLOCK=block, BLOCK_D=head_block,
                PRECISION="ieee" if dtype in (torch.float32, torch.float64) else "tf32")


class Inputs:
    """What every kernel reads: q (for the keys) and qr (for the vectors; q itself where no vectors),
    k, v (B, H, T, D); the tables, R rows for the distance columns first_column .. first_column + R - 1
    (of N = Tq + Tk - 1), or None: bias (H, R), vectors and the value term's vectors `values` (H or 1,
    R, D); padding (B, Tk) int8 or None, and with it `keys` (B, 3) int32, what the padding leaves of
    each sentence's keys (`sentence_keys`); `fill` a one-element tensor of the accumulation dtype;
    attention dropout's probability `dropout_p` and, where it is > 0, `seed` a one-element int64 tensor
    (`_kept`)."""

    def __init__(self, q, qr, k, v, bias, vectors, values, padding, keys, causal, fill, dropout_p, seed,
                 first_column=0):
        self.q, self.k, self.v, self.padding, self.keys = q, k, v, padding, keys
        self.bias, self.vectors, self.values = bias, vectors, values
        self.qr = qr if qr is not None else q
        self.causal, self.fill, self.dropout_p, self.seed = causal, fill, dropout_p, seed
        self.config = settings(q.dtype, q.size(-1), q.is_cuda, vectors is not None or values is not None)
        self.first_column, self.rows = first_column, table_rows(q.size(2), k.size(2), bias, vectors, values,
                                                                first_column)
        self.clamped = (first_column, self.rows) != (0, q.size(2) + k.size(2) - 1)

    def pointers(self):
        tensors = (self.bias, self.vectors, self.values, self.padding, self.keys, self.seed)
        return [self.q, self.qr, self.k, self.v, *(x if x is not None else self.fill for x in tensors), self.fill]

    def sizes(self):
        """H, Tq, Tk, D, the dropout probability and the tables' first column and rows."""
        heads, queries, dims = self.q.size(1), self.q.size(2), self.q.size(3)
        return [heads, queries, self.k.size(2), dims, float(self.dropout_p), self.first_column, self.rows]

    def strides(self, out):
        def per_head(table):  # (a table shared by the heads: head stride 0)
            if table is None:
                return [0, 0, 0]
            return [table.stride(0) if table.size(0) > 1 else 0, table.stride(1), table.stride(2)]
        return [*_strides(self.q, self.k, self.v, out), self.bias.stride(0) if self.bias is not None else 0,
                *per_head(self.vectors), *per_head(self.values),
                self.padding.stride(0) if self.padding is not None else 0]

    def flags(self):
        return dict(HAS_BIAS=self.bias is not None, HAS_VECTORS=self.vectors is not None,
                    HAS_VALUES=self.values is not None, HAS_PADDING=self.padding is not None, CAUSAL=self.causal,
                    HAS_DROPOUT=self.dropout_p > 0, **self.config)


def table_rows(queries: int, keys: int, bias, vectors, values, first_column: int) -> int:
    """The tables' rows R (all tables have the same; N = Tq + Tk - 1 without tables), checked to lie
    within the N distance columns from `first_column` on."""
    columns = queries + keys - 1
    sizes = {table.size(-1 if index == 0 else -2) for index, table in enumerate((bias, vectors, values))
             if table is not None}
    if len(sizes) > 1:
        raise ValueError(f"the tables have different numbers of rows: {sorted(sizes)}")
    rows = sizes.pop() if sizes else columns
    if not (0 <= first_column and rows >= 1 and first_column + rows <= columns):
        raise ValueError(f"tables of {rows} rows from distance column {first_column}: outside the {columns} "
                         f"columns of {queries} queries and {keys} keys")
    return rows


def forward(inputs: Inputs):
    """(out, m, l): the output (B, H, Tq, D) in q's dtype (contiguous), each row's maximum and sum
    (B, H, Tq) in the accumulation dtype."""
    q = inputs.q
    batch, heads, queries, dims = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    m = torch.empty(batch, heads, queries, dtype=inputs.fill.dtype, device=q.device)
    l = torch.empty_like(m)  # noqa: E741
    grid = (triton.cdiv(queries, inputs.config["BLOCK"]), batch * heads)
    _attention_forward[grid](*inputs.pointers(), out, m, l, *inputs.strides(out), *inputs.sizes(),
                             CLAMPED=inputs.clamped, **inputs.flags())
    return out, m, l


def near_diagonals(query_blocks: int, key_blocks: int, block: int, queries: int, first_column: int,
                   rows: int) -> range:
    """The diagonals of tiles t (shift = key block - query block = t - (query_blocks - 1)) whose tiles
    are not wholly at one end of the tables, as the kernels tell them (`_near_keys`): the tiles of a
    shift meet the columns shift BLOCK + Tq - BLOCK .. shift BLOCK + Tq + BLOCK - 2."""
    def at_an_end(t):
        shift = t - (query_blocks - 1)
        return (shift * block + block + queries - 2 <= first_column
                or shift * block - block + queries >= first_column + rows - 1)
    near = [t for t in range(query_blocks + key_blocks - 1) if not at_an_end(t)]
    return range(near[0], near[-1] + 1) if near else range(0)


def backward(inputs: Inputs, out, m, l, grad_out, tables_grad):  # noqa: E741
    """(dq, dqr, dk, dv, dbias, dvectors, dvalues): dqr None without vectors; each table's gradient
    ((H, R); (H or 1, R, D)) in the accumulation dtype where `tables_grad` (three booleans: bias,
    vectors, values) asks for it and the table is given, else None. `grad_out` shares `out`'s strides."""
    q, k = inputs.q, inputs.k
    batch, heads, queries, dims = q.shape
    keys = k.size(2)
    block, block_d = inputs.config["BLOCK"], inputs.config["BLOCK_D"]
    accumulate = inputs.fill.dtype
    delta = (grad_out.to(accumulate) * out.to(accumulate)).sum(-1).contiguous()
    # the gradients are written with the strides of what they are the gradients of (non-overlapping)
    dq, dk, dv = (torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device) for x in (q, k, inputs.v))
    has_vectors = inputs.vectors is not None
    dqr = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device) if has_vectors else None
    common = [*inputs.pointers(), grad_out, m, l, delta]
    strides = inputs.strides(grad_out)
    query_blocks, key_blocks = triton.cdiv(queries, block), triton.cdiv(keys, block)
    tables = (inputs.bias, inputs.vectors, inputs.values)
    wanted = [asked and table is not None for asked, table in zip(tables_grad, tables)]
    widths = (1, block_d, block_d)
    gradient_flags = dict(BIAS_GRAD=wanted[0], VECTORS_GRAD=wanted[1], VALUES_GRAD=wanted[2])
    # the tables' gradients from the tiles at their ends, per (b x h, block of queries, end)
    ends = [torch.zeros(batch * heads * query_blocks * 2 * width if want and inputs.clamped else 1,
                        dtype=accumulate, device=q.device) for want, width in zip(wanted, widths)]
    _attention_backward_keys[(key_blocks, batch * heads)](*common, dk, dv, *strides, *inputs.sizes(),
                                                          CLAMPED=inputs.clamped, **inputs.flags())
    _attention_backward_queries[(query_blocks, batch * heads)](
        *common, dq, dqr if has_vectors else dq, *ends, *strides, *inputs.sizes(), CLAMPED=inputs.clamped,
        **gradient_flags, **inputs.flags())
    grads = [None, None, None]
    if not any(wanted):
        return (dq, dqr, dk, dv, *grads)
    diagonals = near_diagonals(query_blocks, key_blocks, block, queries, inputs.first_column, inputs.rows)
    parts = [torch.zeros(batch * heads * len(diagonals) * 2 * block * width if want else 1, dtype=accumulate,
                         device=q.device) for want, width in zip(wanted, widths)]
    if len(diagonals):
        _attention_backward_distances[(len(diagonals), batch * heads)](
            *common, *parts, *strides, *inputs.sizes(), query_blocks, key_blocks, diagonals.start,
            **gradient_flags, **inputs.flags())
    # the first column of diagonal t's band
    first = (diagonals.start + 1 - query_blocks) * block + queries - block
    for index, (want, part, end, width, table) in enumerate(zip(wanted, parts, ends, widths, tables)):
        if not want:
            continue
        rows = _bands_to_rows(part.view(batch, heads, len(diagonals), 2 * block, width), first, inputs.first_column,
                              inputs.rows).sum(0)  # (H, R, width)
        if inputs.clamped:
            at_ends = end.view(batch, heads, query_blocks, 2, width).sum((0, 2))
            rows[:, 0] += at_ends[:, 0]
            rows[:, -1] += at_ends[:, 1]
        if index == 0:
            grads[0] = rows[..., 0]
        else:
            grads[index] = rows[..., :dims].sum(0, keepdim=True) if table.size(0) == 1 else rows[..., :dims]
    return (dq, dqr, dk, dv, *grads)


def sentence_keys(padding: torch.Tensor, queries: int, causal: bool) -> torch.Tensor:
    """(B, 3) int32, per sentence: how many of its first queries see no key, its first key that is not
    padding and one past its last (`_sentence_keys`); `padding` (B, Tk) nonzero at padded keys. The
    queries are the last `queries` keys, under the causal mask query i sees the keys up to
    i + Tk - Tq, so the rows that see no key are a prefix: those before the first key not padded."""
    real = (padding == 0).to(torch.int32)
    keys = padding.size(1)
    any_real = real.amax(-1) > 0
    first = torch.where(any_real, real.argmax(-1), keys)  # (argmax: the first maximum)
    stop = torch.where(any_real, keys - real.flip(-1).argmax(-1), keys)
    if causal:
        unseen = (first - (keys - queries)).clamp(0, queries)
    else:
        unseen = torch.where(any_real, 0, queries)
    return torch.stack([unseen, torch.where(any_real, first, 0), stop], -1).to(torch.int32).contiguous()


def dropout_keep(seed: torch.Tensor, batch: int, heads: int, queries: int, keys: int, dropout_p: float) -> torch.Tensor:
    """(B, H, Tq, Tk) bool: where the kernels' attention dropout keeps a probability for `seed` (the
    draws of `_kept`, written out: for tests and inspection)."""
    keep = torch.empty(batch * heads, queries, keys, dtype=torch.int8, device=seed.device)
    _dropout_keep[(triton.cdiv(queries, 16), batch * heads)](seed, keep, queries, keys, float(dropout_p),
                                                             BLOCK=16, KEY_BLOCK=triton.next_power_of_2(keys))
    return keep.view(batch, heads, queries, keys) != 0


@triton.jit
def _dropout_keep(Seed, Keep, Tq, Tk, dropout_p, BLOCK: tl.constexpr, KEY_BLOCK: tl.constexpr):
    block, bh = tl.program_id(0), tl.program_id(1)
    offs_m = block * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, KEY_BLOCK)
    keep = _kept(Seed, bh, offs_m, offs_n, Tk, dropout_p, True)
    tl.store(Keep + (bh * Tq + offs_m[:, None]) * Tk + offs_n[None, :], keep.to(tl.int8),
             mask=(offs_m[:, None] < Tq) & (offs_n[None, :] < Tk))


def _bands_to_rows(bands, first, first_column, rows):
    """(..., diagonals, 2 BLOCK, X) bands, diagonal t's starting at column first + t BLOCK, added into
    the tables' rows (..., rows, X): each band's halves, the second half of t on the first half of t + 1,
    then column c onto row min(max(c - first_column, 0), rows - 1) (the columns outside 0..N-1 hold
    zeros)."""
    *lead, diagonals, width, extra = bands.shape
    block = width // 2
    spread = torch.zeros(*lead, (diagonals + 1) * block, extra, dtype=bands.dtype, device=bands.device)
    spread[..., : diagonals * block, :] += bands[..., :block, :].reshape(*lead, diagonals * block, extra)
    spread[..., block:, :] += bands[..., block:, :].reshape(*lead, diagonals * block, extra)
    out = torch.zeros(*lead, rows, extra, dtype=bands.dtype, device=bands.device)
    zero = first_column - first  # spread's index of row 0's column
    low, high = max(zero, 0), min(zero + rows, spread.size(-2))
    if high > low:
        out[..., low - zero: high - zero, :] += spread[..., low:high, :]
    if zero > 0:  # the columns before the table's: its first row
        out[..., 0, :] += spread[..., :zero, :].sum(-2)
    if zero + rows < spread.size(-2):  # the columns after: its last
        out[..., rows - 1, :] += spread[..., max(zero + rows, 0):, :].sum(-2)
    return out
