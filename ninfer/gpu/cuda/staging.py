"""Host side of a CUDA step: split the batch to fit the buffers, fill the pinned mirrors, copy
them up, and turn the copied-back outputs into `SampledToken`s.

Graph-bucket batches are padded to the bucket with dummy rows (token 0 at position 0 in the
spare page `num_pages`, greedy) whose results are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from ninfer.gpu.cuda.kernels.attn_prefill import plan_tiles
from ninfer.gpu.cuda.buffers import MAX_PENALTY_ENTRIES, StepBuffers
from ninfer.gpu.cuda.kernels.intrinsics import SIMULATOR
from ninfer.gpu.cuda.kernels.sampler import pack_mask, penalty_entries
from ninfer.core.params import MAX_TOP_LOGPROBS
from ninfer.core.runner import SampledToken, StepRow
from ninfer.gpu.sampling import log_softmax, score_logprobs

_MASK64 = (1 << 64) - 1


@attrs.frozen
class Piece:
    """Tokens [offset, offset + count) of row `row`; `sample` on a sampled row's last piece."""

    row: int
    offset: int
    count: int
    sample: bool


@attrs.frozen
class Staged:
    num_tokens: int
    num_rows: int
    num_sampled: int
    num_tiles: int
    head_pieces: tuple[int, ...]  # batch index of each head row's piece (-1: padding / unsampled)


def plan_pieces(rows: Sequence[StepRow], limits, page_size: int) -> list[list[Piece]]:
    """Greedy split into sub-batches of at most max_tokens tokens and max_rows rows."""
    batches: list[list[Piece]] = [[]]
    used = 0
    for r, row in enumerate(rows):
        n = len(row.token_ids)
        off = 0
        while off < n:
            if used == limits.max_tokens or len(batches[-1]) == limits.max_rows:
                batches.append([])
                used = 0
            take = min(n - off, limits.max_tokens - used)
            last = off + take == n
            batches[-1].append(Piece(r, off, take, last and row.sample is not None))
            used += take
            off += take
    return [b for b in batches if b]


def stage_inputs(bufs: StepBuffers, rows, batch: list[Piece], page_size: int, num_pages: int, stream,
                 pad_rows: int | None = None, pad_tokens: int | None = None) -> Staged:  # fmt: skip
    """Fill the host mirrors for one sub-batch and copy up the parts whose size varies from step
    to step (penalty entries, grammar masks); `upload` copies the rest, a fixed size per graph
    bucket, so a captured step can hold those copies itself.

    With `pad_rows` / `pad_tokens` (a graph bucket) the batch is padded to exactly that many
    rows (dummy rows of one token) and tokens (dummy tokens in no row), every row goes
    through the head, and the prefill tiles are padded with empty ones to the bucket's grid.
    """
    num_rows = pad_rows or len(batch)
    decode = all(p.count == 1 for p in batch)
    # Decode padding rows hold one dummy token (the decode attention reads every row); prefill
    # padding rows hold none, so padding never moves a batch across the GEMV / GEMM threshold.
    counts = np.array([p.count for p in batch] + [int(decode)] * (num_rows - len(batch)), np.int64)
    ends = np.cumsum(counts)
    num_real = int(ends[-1])
    num_tokens = max(pad_tokens or 0, num_real)
    tok, rowf, tables = bufs.h_tok, bufs.h_row, bufs.h_tables
    if decode:
        _stage_single_tokens(tok, rowf, tables, rows, batch, page_size)
    else:
        _stage_pieces(tok, rowf, tables, rows, batch, ends, page_size)
    n = len(batch)
    if num_tokens > n or num_rows > n:  # padding: spare page, position 0, greedy
        lo = int(ends[n - 1]) if n else 0
        tok[0, lo:num_tokens], tok[1, lo:num_tokens] = 0, 0
        tok[2, lo:num_tokens], tok[3, lo:num_tokens] = num_pages, 0
        tables[n:num_rows, 0] = num_pages
        pad = np.arange(n, num_rows)
        rowf[0, pad], rowf[2, pad], rowf[3, pad] = 1, ends[pad] - counts[pad], 0
    # head rows: every row of a graph bucket, else the sampled pieces
    if pad_rows:
        head = [i if i < n and batch[i].sample else -1 for i in range(num_rows)]
        rowf[1, :num_rows] = np.maximum(ends - 1, 0)
    else:
        head = [i for i, p in enumerate(batch) if p.sample]
        rowf[1, : len(head)] = ends[head] - 1 if head else 0
    specs = [rows[batch[i].row].sample if i >= 0 else None for i in head]
    pen_total, any_mask = _stage_sampling(bufs, specs)
    num_tiles = 0
    if not decode:
        tr, t0, tn, _, _ = plan_tiles(list(counts), rowf[3, :num_rows].copy())
        num_tiles = tile_grid(num_tokens, num_rows) if pad_rows else tr.size
        h = bufs.h_tiles
        h[:, :num_tiles] = 0  # padding tiles hold no token
        h[0, : tr.size], h[1, : tr.size], h[2, : tr.size] = tr, t0, tn
    extra = []
    if pen_total:
        extra += [(bufs.pen_ids, bufs.h_pen_ids, pen_total), (bufs.pen_counts, bufs.h_pen_counts, pen_total)]
    if any_mask:
        extra.append((bufs.masks, bufs.h_masks, len(head)))
    for dev, host, n in extra:
        _copy_up(dev, host, n, stream)
    return Staged(num_tokens, num_rows, len(head), num_tiles, tuple(head))


def tile_grid(num_tokens: int, num_rows: int) -> int:
    """Prefill-attention tiles a bucket launches: enough for any split of its tokens."""
    from ninfer.gpu.cuda.kernels.attn_prefill import TQ

    return num_tokens // TQ + num_rows


def _stage_single_tokens(tok, rowf, tables, rows, batch, page_size):
    """All-decode batch: one token per row, filled with whole-array numpy writes."""
    n = len(batch)
    pos = np.fromiter((rows[p.row].start_pos for p in batch), np.int64, n)
    tok[0, :n] = [int(rows[p.row].token_ids[0]) for p in batch]
    tok[1, :n] = pos
    used = pos // page_size + 1
    for i, p in enumerate(batch):
        table = rows[p.row].page_table
        tok[2, i] = table[pos[i] // page_size]
        tables[i, : used[i]] = table[: used[i]]
    tok[3, :n] = pos % page_size
    rowf[0, :n] = pos + 1
    rowf[2, :n] = np.arange(n)
    rowf[3, :n] = pos


def _stage_pieces(tok, rowf, tables, rows, batch, ends, page_size):
    for i, p in enumerate(batch):
        row = rows[p.row]
        lo = int(ends[i]) - p.count
        start = row.start_pos + p.offset
        pos = np.arange(start, start + p.count)
        table = np.asarray(row.page_table, np.int32)
        tok[0, lo : lo + p.count] = np.asarray(row.token_ids[p.offset : p.offset + p.count], np.int32)
        tok[1, lo : lo + p.count] = pos
        tok[2, lo : lo + p.count] = table[pos // page_size]
        tok[3, lo : lo + p.count] = pos % page_size
        used = -(-(start + p.count) // page_size)
        tables[i, :used] = table[:used]
        rowf[:, i] = (start + p.count, 0, lo, start)


_GREEDY_F = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0], np.float32)


def _stage_sampling(bufs: StepBuffers, specs) -> tuple[int, bool]:
    """Sampling parameters of the head rows; returns (penalty entries, any grammar mask)."""
    fpar, ipar, seeds = bufs.h_fpar, bufs.h_ipar, bufs.h_seeds
    n = len(specs)
    fpar[:n] = _GREEDY_F  # defaults for padding / unsampled rows
    ipar[:n] = 0
    seeds[:n] = 0
    pen = 0
    any_mask = False
    for j, s in enumerate(specs):
        if s is None:
            continue
        p = s.params
        ids, cnt = penalty_entries(s)
        if pen + ids.size > MAX_PENALTY_ENTRIES:
            raise ValueError(f"penalties touch more than {MAX_PENALTY_ENTRIES} distinct tokens in one step")
        bufs.h_pen_ids[pen : pen + ids.size] = ids
        bufs.h_pen_counts[pen : pen + ids.size] = cnt
        has_mask = s.allowed is not None
        if has_mask:
            bufs.h_masks[j] = pack_mask(s.allowed, bufs.h_masks.shape[1])
            any_mask = True
        fpar[j] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, 0, 0)
        ipar[j] = (p.top_k, s.num_top_logprobs, int(has_mask), pen, pen + ids.size, 0, 0, 0)
        seeds[j] = (s.seed & _MASK64, s.token_index & _MASK64)
        pen += ids.size
    return pen, any_mask


def upload(bufs: StepBuffers, staged: Staged, stream) -> None:
    """Copy up the staged inputs of fixed size per graph bucket (tokens, rows, page tables, the
    head rows' sampling parameters, prefill tiles, hybrids' GDN rows). The CUDA runner issues these copies, the
    forward pass and `download` together, so a captured graph replays all three: a decode
    step costs the host one graph launch and one synchronisation."""
    r, h = staged.num_rows, staged.num_sampled
    _copy_up_cols(bufs.tok_in, bufs.h_tok, staged.num_tokens, stream)  # the bucket's tokens, not all alloc_tokens
    pairs = [(bufs.row_in, bufs.h_row, None), (bufs.tables, bufs.h_tables, r)]
    if h:
        pairs += [(bufs.fpar, bufs.h_fpar, h), (bufs.ipar, bufs.h_ipar, h), (bufs.seeds, bufs.h_seeds, h)]
    if bufs.is_hybrid:
        pairs.append((bufs.gdn_rows, bufs.h_gdn_rows, None))
    for dev, host, n in pairs:
        _copy_up(dev, host, n, stream)
    if staged.num_tiles:
        _copy_up_cols(bufs.tiles_in, bufs.h_tiles, staged.num_tiles, stream)


def download(bufs: StepBuffers, staged: Staged, stream) -> None:
    """Copy back the head rows' tokens and logprobs (the top-logprob lists, when asked for,
    come back in queue_extras)."""
    if staged.num_sampled:
        _copy_down(bufs.h_out, bufs.out, bufs.limits.max_rows + staged.num_sampled, stream)


def _copy_up(dev, host, n, stream):
    """Copy the first n rows (all when None) of a host mirror to its device array."""
    if SIMULATOR:
        dev.copy_to_device(host)
        return
    from ninfer.gpu.cuda.graphs import memcpy_htod

    rows = host.shape[0] if n is None else n
    memcpy_htod(dev, host, rows * (host.nbytes // host.shape[0]), stream)


def _copy_up_cols(dev, host, cols: int, stream):
    """Copy the first `cols` columns of a 2-D host mirror to its device array."""
    if SIMULATOR:
        dev.copy_to_device(host)
        return
    from ninfer.gpu.cuda.graphs import memcpy2d_htod

    memcpy2d_htod(dev, host, cols * host.itemsize, stream)


def _head_specs(rows, batch: list[Piece], staged: Staged) -> list:
    return [rows[batch[i].row].sample if i >= 0 else None for i in staged.head_pieces]


@attrs.frozen
class Extras:
    """Rows copied back for the head rows that ask, by head index (complete once the step is)."""

    logits: dict[int, np.ndarray] = attrs.field(factory=dict)  # float32 [vocab]
    residual: dict[int, np.ndarray] = attrs.field(factory=dict)  # float32 [d_model]: the last token's x


def queue_extras(bufs: StepBuffers, rows, batch: list[Piece], staged: Staged, stream) -> Extras:
    """Queue, right behind the step (before any later step can overwrite the device outputs),
    the copies back only some steps need: the top-logprob lists into the selected host mirror;
    logits rows (rows that want them, and scoring rows: their `score_ids` are read out on the
    host); the residual row of the last token of rows that want their hidden row (the final
    norm is applied on the host). Call it right after the step is queued, while the staged
    host mirror is still this step's."""
    specs = _head_specs(rows, batch, staged)
    if any(sp is not None and sp.num_top_logprobs for sp in specs):
        r, k = bufs.limits.max_rows, MAX_TOP_LOGPROBS
        _copy_down(bufs.h_out, bufs.out, (2 + 2 * k) * r, stream)
    logits = {j: bufs.logits[j].copy_to_host(stream=stream) for j, sp in enumerate(specs) if _needs_logits(sp)}
    residual = {j: bufs.x[int(bufs.h_row[1, j])].copy_to_host(stream=stream)
                for j, sp in enumerate(specs) if sp is not None and sp.want_hidden}  # fmt: skip
    return Extras(logits, residual)


def _needs_logits(sp) -> bool:
    return sp is not None and (sp.want_logits or sp.score_ids is not None)


def final_hidden(x: np.ndarray, final_norm: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(x) * final_norm of one residual row, as the reference computes it (float32)."""
    x = np.asarray(x, np.float32)
    scale = (1.0 / np.sqrt(np.mean(np.square(x)) + np.float32(eps))).astype(np.float32)
    return (x * scale * final_norm).astype(np.float32)


def fetch_outputs(bufs: StepBuffers, mirror, rows, batch: list[Piece], staged: Staged, extras: Extras,
                  final_norm: np.ndarray | None = None, eps: float = 0.0) -> list[SampledToken | None]:  # fmt: skip
    """Wrap the head rows' results in `mirror` (the step must be complete), one entry per
    piece of the batch; `extras` from queue_extras; `final_norm` (host float32) and `eps` for
    rows that want their hidden row."""
    results: list[SampledToken | None] = [None] * len(batch)
    if staged.num_sampled == 0:
        return results
    toks, lps, top_ids, top_lps = bufs.host_outputs(mirror)
    for j, (i, sp) in enumerate(zip(staged.head_pieces, _head_specs(rows, batch, staged), strict=True)):
        if sp is None:
            continue
        n_top = sp.num_top_logprobs
        results[i] = SampledToken(
            token_id=int(toks[j]),
            logprob=float(lps[j]),
            top_ids=top_ids[j, :n_top].astype(np.int32) if n_top else None,
            top_logprobs=top_lps[j, :n_top].astype(np.float32) if n_top else None,
            logits=extras.logits.get(j) if sp.want_logits else None,
            # scoring reads the raw row on the host, with the reference's own log_softmax
            score_logprobs=None if sp.score_ids is None else score_logprobs(log_softmax(extras.logits[j]), sp.score_ids),
            hidden=final_hidden(extras.residual[j], final_norm, eps) if sp.want_hidden else None,
        )
    return results


def _copy_down(host, dev, n, stream):
    if SIMULATOR:
        host[:n] = dev.copy_to_host()[:n]
        return
    from ninfer.gpu.cuda.graphs import memcpy_dtoh

    memcpy_dtoh(host, dev, n * host.itemsize, stream)
