"""The Triton source of `verl_dppo.math.kernels`' four kernels; that module's doc says what each computes, and its
wrappers launch them. Triton is imported inside `build_kernels` only: the package imports without it.

Pure Triton (no verl import); each kernel reads one row of logits per program, BLOCK columns per step.
"""

from __future__ import annotations

import functools

__all__ = ["build_kernels"]


@functools.lru_cache(maxsize=None)
def build_kernels():
    """The jitted kernels (max_and_sum_outside, scaled_exp, lane_threshold, below_threshold), built on first use
    (importing Triton takes a noticeable time; the torch path never pays it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _program_row(rows_ptr, HAS_ROWS: tl.constexpr):
        """(this program's index, the logits row it reads: rows[index] when given)."""
        pid = tl.program_id(0).to(tl.int64)
        row = pid
        if HAS_ROWS:
            row = tl.load(rows_ptr + pid).to(tl.int64)
        return pid, row

    @triton.jit
    def _excluded_walk(excluded_ptr, pid, n_excluded):
        """The walk over this program's excluded ids (sorted, n_excluded a row): (their start, the first of them)."""
        own = excluded_ptr + pid * n_excluded
        return own, tl.load(own, mask=n_excluded > 0, other=2**62)

    @triton.jit
    def _skip_excluded(skip, cols, block_end, own, ptr, upcoming, n_excluded):
        """Marks in `skip` the row's excluded ids (sorted, at own[ptr:]) below block_end; returns the walk's state."""
        while upcoming < block_end:
            skip = skip | (cols == upcoming)
            ptr += 1
            upcoming = tl.load(own + ptr, mask=ptr < n_excluded, other=2**62)
        return skip, ptr, upcoming

    # The kernels call these by their global names (Triton's interpreter resolves calls in the module's globals):
    # module-level functions, defined here because Triton is imported only when a kernel is first used.
    globals().update(_program_row=_program_row, _excluded_walk=_excluded_walk, _skip_excluded=_skip_excluded)

    @triton.jit
    def scaled_exp_kernel(
        logits_ptr,
        stride_row,
        out_ptr,
        stride_out,
        rows_ptr,
        base_ptr,
        coef_ptr,
        vocab,
        log_z_ptr,
        entropy_ptr,
        entropy_coef_ptr,
        HAS_ROWS: tl.constexpr,
        ENTROPY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid, row = _program_row(rows_ptr, HAS_ROWS)
        src = logits_ptr + row * stride_row
        dst = out_ptr + row * stride_out
        shift = tl.load(base_ptr + pid).to(tl.float32)
        coef = tl.load(coef_ptr + pid).to(tl.float32)
        if ENTROPY:  # + the entropy's term, -g_H pi (log pi + H), with log pi = logit - log Z
            log_z = tl.load(log_z_ptr + pid).to(tl.float32)
            entropy = tl.load(entropy_ptr + pid).to(tl.float32)
            entropy_coef = tl.load(entropy_coef_ptr + pid).to(tl.float32)
        lanes = tl.arange(0, BLOCK)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            x = tl.load(src + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            value = tl.exp(x - shift) * coef
            if ENTROPY:
                log_p = x - log_z
                value += tl.where(x == float("-inf"), 0.0, tl.exp(log_p) * (log_p + entropy) * entropy_coef)
            tl.store(dst + cols, value.to(dst.dtype.element_ty), mask=cols < vocab)

    @triton.jit
    def max_and_sum_outside_kernel(
        logits_ptr,
        stride_row,
        rows_ptr,
        excluded_ptr,
        n_excluded,
        vocab,
        max_ptr,
        sum_ptr,
        entropy_ptr,
        HAS_ROWS: tl.constexpr,
        HAS_MAX: tl.constexpr,
        ENTROPY: tl.constexpr,
        SUMS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # No reduction inside the loop: each lane keeps its own running max and its sum relative to it, and the
        # excluded ids are walked with a scalar pointer; lanes are combined once, at the end.
        pid, row = _program_row(rows_ptr, HAS_ROWS)
        base = logits_ptr + row * stride_row
        lanes = tl.arange(0, BLOCK)
        own, upcoming = _excluded_walk(excluded_ptr, pid, n_excluded)
        ptr = 0
        if HAS_MAX:
            given = tl.load(max_ptr + pid).to(tl.float32)
            shift = tl.where(given == float("-inf"), 0.0, given)
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK], tl.float32)
        # ENTROPY: over every column, sum exp(s) but the one term of the lane's max (1), and sum exp(s) s, with
        # s = x - the lane's max <= 0: kept apart from the 1, Z - 1 keeps its relative accuracy on peaked rows
        lane_rest = tl.zeros([BLOCK], tl.float32)
        lane_weighted = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            skip = cols >= vocab
            skip, ptr, upcoming = _skip_excluded(skip, cols, start + BLOCK, own, ptr, upcoming, n_excluded)
            keep = tl.where(skip, 0.0, 1.0)
            if HAS_MAX:
                lane_sum += keep * tl.exp(x - shift)
            else:
                # One exp per element: exp(-|x - max|) rescales the sum when x is the new max, else weighs x.
                e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - lane_max)))
                rises = x > lane_max
                lane_sum = tl.where(rises, lane_sum * e + keep, lane_sum + keep * e)
                if ENTROPY:
                    # new max: the old terms' s drop by (old max - x), a finite amount once a lane has a term; the
                    # old terms, its max's 1 included, become the rest (e = 0 while the lane had none)
                    drop = tl.where(lane_max > float("-inf"), lane_max - x, 0.0)
                    moved = e * (lane_weighted + drop * (lane_rest + 1.0))
                    own_term = tl.where(x == float("-inf"), 0.0, e * (x - lane_max))
                    lane_weighted = tl.where(rises, moved, lane_weighted + own_term)
                    lane_rest = tl.where(rises, (lane_rest + 1.0) * e, lane_rest + e)
                lane_max = tl.maximum(lane_max, x)
        if HAS_MAX:
            tl.store(sum_ptr + pid, tl.sum(lane_sum, axis=0))
        else:
            row_max = tl.max(lane_max, axis=0)
            top = tl.where(row_max == float("-inf"), 0.0, row_max)
            weights = tl.where(lane_max == float("-inf"), 0.0, tl.exp(lane_max - top))
            tl.store(sum_ptr + pid, tl.sum(lane_sum * weights, axis=0))
            tl.store(max_ptr + pid, row_max)
            if ENTROPY:  # H = log Z - sum exp(s) s / Z, s = x - the row max; both terms >= 0
                lane_drop = tl.where(lane_max == float("-inf"), 0.0, lane_max - top)
                # Z - 1 with no 1 + tiny rounded: the lanes' rests, the lanes below the top, the top's ties but one
                # (an all -inf row: -1, H NaN)
                ties = tl.sum(tl.where((lane_max == top) & (lane_max > float("-inf")), 1.0, 0.0), axis=0)
                rest = tl.sum(lane_rest * weights + tl.where(lane_max < top, weights, 0.0), axis=0) + (ties - 1.0)
                weighted = tl.sum((lane_weighted + lane_drop * (lane_rest + 1.0)) * weights, axis=0)
                if SUMS:  # the two sums as they are: a vocabulary shard's, combined across the shards by the caller
                    tl.store(entropy_ptr + 2 * pid, rest)
                    tl.store(entropy_ptr + 2 * pid + 1, weighted)
                else:
                    total = 1.0 + rest
                    log_z = tl.where(total == 1.0, rest, tl.log(total) * (rest / (total - 1.0)))  # log1p(rest)
                    tl.store(entropy_ptr + pid, log_z - weighted / total)

    @triton.jit
    def lane_threshold_kernel(
        logits_ptr,
        stride_row,
        rows_ptr,
        vocab,
        kth,
        max_ptr,
        threshold_ptr,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Each lane keeps the max of its columns (no reduction inside the loop); the lanes' maxima are distinct
        # columns, so their (kth + 1)-th largest is a lower bound of the row's own (kth + 1)-th largest logit.
        pid, row = _program_row(rows_ptr, HAS_ROWS)
        base = logits_ptr + row * stride_row
        lanes = tl.arange(0, BLOCK)
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            lane_max = tl.maximum(lane_max, x)
        # The (kth + 1)-th largest lane max by bisection on the float's bits (an int32 key in float order): 32 counts
        # of the lanes, no sort (tl.sort of 1,024 lanes takes ~1 s a row under the interpreter).
        bits = lane_max.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        low = tl.full([], -(2**31), tl.int64)  # every lane's key is >= low: a valid answer
        high = tl.full([], 2**31, tl.int64)  # no key reaches high
        for _ in range(32):
            middle = low + (high - low) // 2  # high - low > 0: no rounding toward zero below 0
            enough = tl.sum((key >= middle).to(tl.int32), axis=0) > kth
            low = tl.where(enough, middle, low)
            high = tl.where(enough, high, middle)
        found = tl.where(low < 0, low ^ 0x7FFFFFFF, low).to(tl.int32)
        tl.store(max_ptr + pid, tl.max(lane_max, axis=0))
        tl.store(threshold_ptr + pid, found.to(tl.float32, bitcast=True))

    @triton.jit
    def below_threshold_kernel(
        logits_ptr,
        stride_row,
        rows_ptr,
        excluded_ptr,
        n_excluded,
        vocab,
        max_ptr,
        threshold_ptr,
        sum_ptr,
        count_ptr,
        candidates_ptr,
        capacity,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Columns at or above the row's threshold are written out as candidates (their slot from an atomic counter:
        # a handful per row, so no scan of the block); the rest, less the excluded ids, is summed as exp(x - max).
        pid, row = _program_row(rows_ptr, HAS_ROWS)
        base = logits_ptr + row * stride_row
        lanes = tl.arange(0, BLOCK)
        own, upcoming = _excluded_walk(excluded_ptr, pid, n_excluded)
        ptr = 0
        given = tl.load(max_ptr + pid).to(tl.float32)
        shift = tl.where(given == float("-inf"), 0.0, given)
        threshold = tl.load(threshold_ptr + pid).to(tl.float32)
        counter = count_ptr + pid + tl.zeros([BLOCK], tl.int32)
        slots = candidates_ptr + pid * capacity
        lane_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + lanes
            inside = cols < vocab
            x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
            skip = cols >= vocab
            skip, ptr, upcoming = _skip_excluded(skip, cols, start + BLOCK, own, ptr, upcoming, n_excluded)
            hit = inside & (x >= threshold)
            # relaxed, CTA scope: only this program counts its row, and torch reads the count after the kernel
            slot = tl.atomic_add(counter, 1, mask=hit, sem="relaxed", scope="cta")
            tl.store(slots + slot, cols.to(tl.int32), mask=hit & (slot < capacity))
            lane_sum += tl.where(skip | hit, 0.0, tl.exp(x - shift))
        tl.store(sum_ptr + pid, tl.sum(lane_sum, axis=0))

    return max_and_sum_outside_kernel, scaled_exp_kernel, lane_threshold_kernel, below_threshold_kernel
