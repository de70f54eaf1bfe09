// The one-column kernels for long 16-bit rows (k_mul_mat_rows, k_mul_mat_glu_rows, and the
// copy-engine variant in cuda/matmul_rows_tma.cuh). Part of ops_matmul.cu's translation unit
// (included inside its anonymous namespace): they use that file's Parts, store, halves_unit and
// load_x, and cuda/matmul_column.cuh's copy_column and norm_prologue.
#pragma once

// Long 16-bit float rows at M = 1 (decode of a model like Qwen3-4B F16: rows of 5-19 KiB, the
// step bound by streaming its weights): blocks of kRowWarps warps, each warp two weight rows (two
// consecutive rows, or the gate and up rows of k_mul_mat_glu_rows) in the order of every other
// tile (a lane's units u = lane (mod 32) in increasing u, each unit's fmaf chain, then warp_sum's
// xor tree), so the bits are k_mul_mat's. What differs is how the bytes come:
// - the block stages its activation column in shared memory once (normalised when the norm is
//   the prologue), one copy for 32 rows instead of every warp reading it through L1, whose loads
//   (twice the weights' bytes) were what kept the old kernel from the weights' bandwidth;
// - each lane loads its first kEarlyUnits units of both rows before the PDL wait, so they arrive
//   while the kernel before still runs, where the weights are constant (MatmulPart::constant:
//   no node of the graph writes them);
// - weights are read past L1 (ld.global.nc.L1::no_allocate), which they would only pollute.
// H200, a probe of Qwen3-4B's 144 decode matvecs in one graph (tools/device/probe_gemv_f16.cu):
// 2,723-2,795 -> 2,354-2,382 us a step, against 1,830-1,870 for a plain read of the same bytes.
// In the model the gain is smaller: tg128 300-306 -> 306-316 t/s (alternating runs).
// PYSPEC_CUDA_ROW_STREAM=0 keeps k_mul_mat (A/B); the same bits either way.
//
// The grid is balanced (twenty-seventh session): 2 blocks of 8 warps a SM, block b taking the
// contiguous items [n b / G, n (b + 1) / G) of the launch's n items (an item: a warp's two rows),
// its warps round-robin over them. A grid of one item a warp (16 warps a block) left o's and
// down's 1,280 items on 80 of the 132 SMs and ran gate/up's 9,728 in 1.15 waves, and its kernel
// boundaries cost more (the next kernel's blocks wait for the SMs that hold the longest tail).
// Same probe, both grids, two runs: 2,353-2,356 -> 2,152-2,157 us a step (q/k/v alone 357 -> 400,
// o 261 -> 242, gate/up 1,000 -> 986, down 549 -> 525; the rest is the boundaries).
// PYSPEC_CUDA_ROW_BALANCE=0 keeps the grid of one item a warp (A/B); the same bits either way.
// Other ways to feed the rows (all of an item's units asked for at once, one-row items, the next
// units staged in shared memory before the PDL wait) gave the same bits and lost: docs/cuda-probes.md.
constexpr int kRowWarps = 16;        // the grid of one item a warp
constexpr int kBalWarps = 8;         // the balanced grid
constexpr int kBalBlocksPerSm = 2;
constexpr int kEarlyUnits = 4;
constexpr int kDeepWarps = 10;       // the deep grid (kRowDeep): one block a SM
constexpr int kDeepRound = 4;        // its units a lane in a round (two rounds in flight)
static_assert(kDeepRound == kEarlyUnits, "the early units are a warp's first round");
// How a row kernel's warps get their weights: kFeedPlain, the balanced grid's rounds of 4 units
// asked for, waited for and summed (stream_rows); kFeedDeep, the deep grid's two rounds in flight
// within each warp's one item (stream_rows_deep); kFeedPiped, the balanced grid with two rounds
// in flight across each warp's items (stream_items_piped; kRowPiped).
constexpr int kFeedPlain = 0, kFeedDeep = 1, kFeedPiped = 2;

// The L2 policy of a launch's weight loads (Parts::evict_first, kRowEvictFirst): evict_first
// marks the weights' lines as the first to go, so the step's small, re-read data (the KV cache,
// norm weights, the graph's inputs, the activations) is not pushed out of L2 by the ~8 GB of
// weights a Qwen3-4B step streams through it once each; evict_normal is what a plain load does.
__device__ __forceinline__ uint64_t weight_policy(bool evict_first) {
    uint64_t pol;
    if (evict_first) {
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    } else {
        asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;" : "=l"(pol));
    }
    return pol;
}

__device__ __forceinline__ uint4 ld_stream(const char* p, uint64_t pol) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p), "l"(pol));
    return r;
}

// A lane's first kEarlyUnits units of two rows.
__device__ __forceinline__ void load_early(const char* const (&wr)[2], int64_t units, int lane, uint64_t pol,
                                           uint4 (&pre)[2][kEarlyUnits]) {
#pragma unroll
    for (int i = 0; i < kEarlyUnits; ++i) {
        const int64_t u = lane + 32 * i;
        if (u < units) {
            pre[0][i] = ld_stream(wr[0] + u * 16, pol);
            pre[1][i] = ld_stream(wr[1] + u * 16, pol);
        }
    }
}

// The norm's weights copied into shared memory after the column (k floats on), by cp.async before
// the PDL wait, where no node of the graph writes them (kRowNormEarly): the prologue then scales
// with them from there instead of loading them from global memory after its sums, a round trip
// to DRAM (the weights are read once a step) queued behind the launch's own early weight loads.
// The same values, so the same bits. nw and k: 16-byte aligned and a multiple of 4 (the caller
// checks).
template <int kThreads>
__device__ __forceinline__ void stage_norm_weights(const float* nw, int64_t k) {
    float* s_nw = reinterpret_cast<float*>(normed_rows) + k;
    for (int64_t i = 4 * static_cast<int64_t>(threadIdx.x); i < k; i += 4 * kThreads) cp_async<16>(s_nw + i, nw + i, true);
    cp_async_commit();
}

// The block's activation column in shared memory, normalised (kNorm) or copied; every thread of
// the block (kThreads) calls it. nw_staged: the norm's weights were staged (stage_norm_weights).
template <bool kNorm, int kThreads>
__device__ __forceinline__ const float* stage_column(const float* x, int64_t k, const float* nw, float eps,
                                                     bool nw_staged = false) {
    if constexpr (kNorm) {
        const float* xc[1] = {x};
        const float* w = nw_staged ? reinterpret_cast<const float*>(normed_rows) + k : nw;
        norm_prologue<1, kThreads>(xc, k, w, eps, nw_staged);
        return xc[0];
    } else {
        float* hs = reinterpret_cast<float*>(normed_rows);
        copy_column<kThreads>(hs, x, k);  // (all of a thread's loads before its stores)
        __syncthreads();
        return hs;
    }
}

// The items [first, end) of block blockIdx.x: an equal contiguous share of n items over the
// grid (kBalanced), or kW items a block. light (kBalanced, Parts::light): the grid's last `light`
// blocks (at most a third of it) take half a share each, so they leave their SMs halfway through
// the launch, for the next launch's blocks (kRowRoom). With none, block b's share starts at
// n 2b / 2G = n b / G items, as ever.
template <bool kBalanced, int kW>
__device__ __forceinline__ void block_items(int64_t n, int64_t& first, int64_t& end, int light = 0) {
    const int64_t b = blockIdx.x;
    if constexpr (kBalanced) {
        const int64_t grid = gridDim.x, full = grid - min(static_cast<int64_t>(light), grid / 3);
        const auto halves_before = [&](int64_t bb) { return bb <= full ? 2 * bb : full + bb; };
        const int64_t halves = halves_before(grid);
        first = n * halves_before(b) / halves;
        end = n * halves_before(b + 1) / halves;
    } else {
        first = b * kW;
        end = min(first + kW, n);
    }
}

// kRows rows' sums of one 16-bit unit: w(r) row r's 16 bytes, xu the unit's 8 activations; each
// row's 8 products go onto its accumulator in order t = 0..7 (the fmaf chain of every tile).
template <DType T, int kRows, class W>
__device__ __forceinline__ void rows_unit_fma(W&& w, const float* xu, float* acc) {
    float xv[8];
    load_x<true>(xu, 0, 4, xv);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
        float v[8];
        halves_unit<T>(w(r), v);
        float a = acc[r];
#pragma unroll
        for (int t = 0; t < 8; ++t) a = fmaf(v[t], xv[t], a);
        acc[r] = a;
    }
}

// Both rows' fmaf chains over the staged column (pre: the first units, when early).
template <DType T>
__device__ __forceinline__ void stream_rows(const char* const (&wr)[2], const float* xs, int64_t k, int lane, bool early,
                                            const uint4 (&pre)[2][kEarlyUnits], uint64_t pol, float (&acc)[2]) {
    acc[0] = acc[1] = 0.0f;
    const int64_t units = k / 8;
    int64_t u = lane;
    const auto unit = [&](const uint4 (&w)[2], int64_t uu) {
        rows_unit_fma<T, 2>([&](int r) { return w[r]; }, xs + uu * 8, acc);
    };
    if (early) {
#pragma unroll
        for (int i = 0; i < kEarlyUnits; ++i, u += 32) {
            if (u < units) unit({pre[0][i], pre[1][i]}, u);
        }
    }
#pragma unroll 4
    for (; u < units; u += 32) unit({ld_stream(wr[0] + u * 16, pol), ld_stream(wr[1] + u * 16, pol)}, u);
}

// stream_rows on the deep grid (kRowDeep): after the early units, rounds of kU units a lane of
// both rows, each round's loads issued before the previous round's sums (two rounds, 2 kU units a
// lane, in flight while a warp sums; ptxas keeps that order, where loads and sums of one deeper
// round came out interleaved, the first sum's wait holding back the loads after it), then each
// unit's fmaf chain in the same order as stream_rows: the same bits. kU = 8 (16 in flight)
// spilled at the deep grid's 168 registers and lost 8% (docs/cuda-probes.md).
template <DType T, int kU>
__device__ __forceinline__ void stream_rows_deep(const char* const (&wr)[2], const float* xs, int64_t k, int lane,
                                                 bool early, const uint4 (&pre)[2][kEarlyUnits], uint64_t pol,
                                                 float (&acc)[2]) {
    acc[0] = acc[1] = 0.0f;
    const int64_t units = k / 8;
    int64_t u = lane;
    const auto unit = [&](const uint4 (&w)[2], int64_t uu) {
        rows_unit_fma<T, 2>([&](int r) { return w[r]; }, xs + uu * 8, acc);
    };
    const auto whole_round = [&](int64_t at) { return at + 32 * (kU - 1) < units; };
    const auto load_round = [&](int64_t at, uint4 (&w)[kU][2]) {
#pragma unroll
        for (int i = 0; i < kU; ++i) {
            w[i][0] = ld_stream(wr[0] + (at + 32 * i) * 16, pol);
            w[i][1] = ld_stream(wr[1] + (at + 32 * i) * 16, pol);
        }
    };
    uint4 cur[kU][2], next[kU][2];
    const int64_t first = early ? u + 32 * kEarlyUnits : u;
    const bool rounds = whole_round(first);
    if (rounds) load_round(first, cur);  // out while the early units are summed
    if (early) {
#pragma unroll
        for (int i = 0; i < kEarlyUnits; ++i, u += 32) {
            if (u < units) unit({pre[0][i], pre[1][i]}, u);
        }
    }
    if (rounds) {
        for (;;) {
            const int64_t at = u + 32 * kU;
            const bool more = whole_round(at);
            if (more) load_round(at, next);
#pragma unroll
            for (int i = 0; i < kU; ++i) unit(cur[i], u + 32 * i);
            u = at;
            if (!more) break;
#pragma unroll
            for (int i = 0; i < kU; ++i) {
                cur[i][0] = next[i][0];
                cur[i][1] = next[i][1];
            }
        }
    }
    for (; u < units; u += 32) unit({ld_stream(wr[0] + u * 16, pol), ld_stream(wr[1] + u * 16, pol)}, u);
}

// A warp's items item, item + stride, ... (< end) fed piped (kRowPiped): each item is
// rounds of kDeepRound slots a lane (slot j: unit lane + 32 j of both rows, none past the row's
// end), and the warp's rounds form one stream, each round's loads issued before the previous
// round's sums, an item's last round overlapping the next item's first, so two rounds (8 KB a
// warp) stay in flight from the warp's first item to its last where stream_rows stops at every
// round (and k_mul_mat_rows's warps at every item). rows_of(it, w) gives item it's two row
// pointers; stored(it, acc) takes its two sums. Each row's units are summed in the order
// stream_rows takes them: the same bits. pre: the first item's first round, loaded before the
// PDL wait (when early).
template <DType T, class RowsOf, class Stored>
__device__ __forceinline__ void stream_items_piped(RowsOf&& rows_of, Stored&& stored, int64_t item, int64_t end,
                                                   int stride, const float* xs, int64_t k, int lane, bool early,
                                                   const uint4 (&pre)[2][kEarlyUnits], uint64_t pol) {
    if (item >= end) return;
    const int64_t units = k / 8;
    const int rounds = static_cast<int>((units + 32 * kDeepRound - 1) / (32 * kDeepRound));  // an item's
    const auto load = [&](const char* const (&w)[2], int r, uint4 (&buf)[kDeepRound][2]) {
#pragma unroll
        for (int i = 0; i < kDeepRound; ++i) {
            const int64_t u = lane + 32 * (int64_t{r} * kDeepRound + i);
            if (u < units) {
                buf[i][0] = ld_stream(w[0] + u * 16, pol);
                buf[i][1] = ld_stream(w[1] + u * 16, pol);
            }
        }
    };
    uint4 cur[kDeepRound][2], next[kDeepRound][2];
    const char* wc[2];
    const char* wn[2];
    rows_of(item, wc);
    if (early) {
#pragma unroll
        for (int i = 0; i < kDeepRound; ++i) {
            cur[i][0] = pre[0][i];
            cur[i][1] = pre[1][i];
        }
    } else {
        load(wc, 0, cur);
    }
    float acc[2] = {0.0f, 0.0f};
    int64_t it = item;
    int r = 0;
    for (;;) {
        int64_t it_next = it;
        int r_next = r + 1;
        if (r_next == rounds) {
            it_next = it + stride;
            r_next = 0;
        }
        const bool more = it_next < end;
        if (more) {
            if (r_next == 0) {
                rows_of(it_next, wn);
            } else {
                wn[0] = wc[0];
                wn[1] = wc[1];
            }
            load(wn, r_next, next);
        }
#pragma unroll
        for (int i = 0; i < kDeepRound; ++i) {
            const int64_t u = lane + 32 * (int64_t{r} * kDeepRound + i);
            if (u < units) rows_unit_fma<T, 2>([&](int q) { return cur[i][q]; }, xs + u * 8, acc);
        }
        if (r + 1 == rounds) {
            stored(it, acc);
            acc[0] = acc[1] = 0.0f;
        }
        if (!more) break;
#pragma unroll
        for (int i = 0; i < kDeepRound; ++i) {
            cur[i][0] = next[i][0];
            cur[i][1] = next[i][1];
        }
        it = it_next;
        r = r_next;
        wc[0] = wn[0];
        wc[1] = wn[1];
    }
}

// k_mul_mat's one-column case for long 16-bit rows: item i is the global rows 2 i and 2 i + 1
// (clamped to the last, as k_mul_mat reads them); warp w of a block takes its items first + w,
// first + w + kW, ... (block_items).
// The diagnostic build's timeline of both kernels (cuda/phase_stamps.cuh, tag ROWS): 0 the block's
// start, 1 its early weight loads issued, 2 the PDL wait over, 3 the column staged (normalised),
// 4 warp 0's first item stored, 5 the block's last warp done.
[[maybe_unused]] constexpr int kRowPhaseSlots = 6;

// kFeed: kFeedPlain; kFeedDeep on the deep grid (balanced, no prologue); kFeedPiped (balanced, two
// blocks of kBalWarps or one of kRowWarps a SM: at 96-114 registers both fit, where the plain
// feed's balanced kernel takes 122-128. A second launch-bounds argument would pin two blocks, but
// ptxas then takes 132 for that plain kernel, where one block a SM would fit: unasked it stays at
// 126). On the deep grid the piped feed (one item a warp) lost to stream_rows_deep: H200
// Qwen3-4B tg128 389.5 -> 380.1-380.5 t/s (docs/cuda-probes.md).
template <DType T, bool kNorm, bool kBalanced, int kW, int kFeed = kFeedPlain>
__global__ void __launch_bounds__(kW * 32) k_mul_mat_rows(Parts p, int64_t k, const float* x) {
    PHASE_STAMP(0, 0);
    const int lane = threadIdx.x & 31;
    const int64_t n_rows = p.row0[p.n];
    int64_t item, end;
    block_items<kBalanced, kW>((n_rows + 1) / 2, item, end, p.light);
    item += threadIdx.x >> 5;
    const char* wr[2];
    const auto rows_of = [&](int64_t it, const char* (&w)[2]) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int64_t row = min(2 * it + r, n_rows - 1);
            const int j = part_of(p, row);
            w[r] = p.w[j] + (row - p.row0[j]) * p.rb[j];
        }
    };
    // Every lane holds both sums (warp_sum's xor tree gives each lane the same bits); lane r
    // stores row r, so the two residual reads of o and down (each a round trip to L2 on the
    // launch's tail) go out together rather than one after the other.
    const auto stored = [&](int64_t it, const float (&acc)[2]) {
        const float s0 = warp_sum(acc[0]), s1 = warp_sum(acc[1]);
        if (lane < 2 && 2 * it + lane < n_rows) store(p, 2 * it + lane, 0, lane == 0 ? s0 : s1);
        return s1;
    };
    const bool early = p.early && item < end;
    const uint64_t pol = weight_policy(p.evict_first);
    if constexpr (kNorm) {
        if (p.norm_early) stage_norm_weights<kW * 32>(p.norm_w, k);  // ahead of the weights' loads
    }
    uint4 pre[2][kEarlyUnits];
    if (early) {
        rows_of(item, wr);
        load_early(wr, k / 8, lane, pol, pre);
    }
    PHASE_STAMP(1, 0);
    pdl_enter();
    PHASE_STAMP(2, 0);
    const float* xs = stage_column<kNorm, kW * 32>(x, k, p.norm_w, p.norm_eps, p.norm_early);  // before any warp leaves
    PHASE_STAMP(3, xs[0]);
    if constexpr (kFeed == kFeedPiped) {
        stream_items_piped<T>(rows_of, stored, item, end, kW, xs, k, lane, early, pre, pol);
        item = end;  // (the loop below is the other feeds')
    }
    for (bool first = true; item < end; item += kW, first = false) {
        if (!(first && early)) rows_of(item, wr);
        float acc[2];
        if constexpr (kFeed == kFeedDeep) {
            stream_rows_deep<T, kDeepRound>(wr, xs, k, lane, first && early, pre, pol, acc);
        } else {
            stream_rows<T>(wr, xs, k, lane, first && early, pre, pol, acc);
        }
        [[maybe_unused]] const float s1 = stored(item, acc);
        if (first) PHASE_STAMP(4, s1);
    }
    PHASE_BLOCK_END(5, 0);
    PHASE_REPORT("rows", kRowPhaseSlots);
}

// k_mul_mat_glu's one-column case for long 16-bit rows: item i is gate and up row i, storing
// silu(gate) * up; items over blocks and warps as k_mul_mat_rows.
template <DType T, bool kNorm, bool kBalanced, int kW, int kFeed = kFeedPlain>
__global__ void __launch_bounds__(kW * 32) k_mul_mat_glu_rows(const char* wg, const char* wu, int64_t rb_g, int64_t rb_u,
                                                              int64_t n_rows, int64_t k, const float* x, float* y,
                                                              const float* norm_w, float norm_eps, bool constant,
                                                              bool evict_first, bool norm_early) {
    PHASE_STAMP(0, 0);  // the slots of k_mul_mat_rows
    const int lane = threadIdx.x & 31;
    int64_t row, end;
    block_items<kBalanced, kW>(n_rows, row, end);
    row += threadIdx.x >> 5;
    const bool early = constant && row < end;
    const uint64_t pol = weight_policy(evict_first);
    if constexpr (kNorm) {
        if (norm_early) stage_norm_weights<kW * 32>(norm_w, k);  // ahead of the weights' loads
    }
    uint4 pre[2][kEarlyUnits];
    if (early) load_early({wg + row * rb_g, wu + row * rb_u}, k / 8, lane, pol, pre);
    PHASE_STAMP(1, 0);
    pdl_enter();
    PHASE_STAMP(2, 0);
    const float* xs = stage_column<kNorm, kW * 32>(x, k, norm_w, norm_eps, norm_early);  // before any warp leaves
    PHASE_STAMP(3, xs[0]);
    const auto stored = [&](int64_t it, const float (&acc)[2]) {
        const float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
        if (lane == 0) y[it] = silu_f(g) * u;
        return u;
    };
    if constexpr (kFeed == kFeedPiped) {
        const auto rows_of = [&](int64_t it, const char* (&w)[2]) {
            w[0] = wg + it * rb_g;
            w[1] = wu + it * rb_u;
        };
        stream_items_piped<T>(rows_of, stored, row, end, kW, xs, k, lane, early, pre, pol);
        row = end;  // (the loop below is the other feeds')
    }
    for (bool first = true; row < end; row += kW, first = false) {
        const char* const wr[2] = {wg + row * rb_g, wu + row * rb_u};
        float acc[2];
        stream_rows<T>(wr, xs, k, lane, first && early, pre, pol, acc);
        [[maybe_unused]] const float u = stored(row, acc);
        if (first) PHASE_STAMP(4, u);
    }
    PHASE_BLOCK_END(5, 0);
    PHASE_REPORT("glu_rows", kRowPhaseSlots);
}

#include "cuda/matmul_rows_tma.cuh"  // the copy-engine variant (the same translation unit)

// The balanced grid's blocks for n items.
inline int64_t balanced_blocks(int64_t n) {
    return std::max<int64_t>(1, std::min<int64_t>(int64_t{kBalBlocksPerSm} * tc::sm_count(), n));
}

// Whether a k_mul_mat_rows launch over n items (no norm prologue) takes the deep grid: the
// setting asks for it, the balanced grid is on, one block of kDeepWarps a SM gives each warp one
// item at most, and the column fits the 48 KB a launch has without asking.
inline bool takes_deep_grid(int setting, int64_t n, int64_t k) {
    return (setting & kRowDeep) && (setting & kRowBalanced) &&
           n <= int64_t{kDeepWarps} * tc::sm_count() && k * static_cast<int64_t>(sizeof(float)) <= 48 * 1024;
}

// Launches k_mul_mat_rows's deep-grid kernel over n items (takes_deep_grid): one block of
// kDeepWarps a SM, the column its shared memory.
template <class Kernel>
void launch_deep_rows(Kernel kernel, int64_t n, int64_t k, cudaStream_t s, const Parts& p, const float* x) {
    PHASE_CONFIGURE("ROWS");
    count_graph_event(GraphEvent::DeepRowLaunch);
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(tc::sm_count(), n));
    launch(kernel, static_cast<unsigned>(blocks), kDeepWarps * 32, k * sizeof(float), s, p, k, x);
}

// Launches a row-streaming kernel (k_mul_mat_rows, k_mul_mat_glu_rows) over n items: the balanced
// grid where setting (matmul_row_stream_setting(), read once a launch by the launch site) has
// kRowBalanced, its warps fed piped where it also has kRowPiped (and then on one block of
// kRowWarps a SM where it has kRowPipedOneBlock: the same number of warps as two blocks of
// kBalWarps, the column staged once a SM), else (PYSPEC_CUDA_ROW_BALANCE=0, for A/B) the grid of
// one item a warp. pick(grid tag) gives the kernel instantiation (the tags
// below); smem its shared memory (the column, and the norm's weights where those are staged).
struct PipedFeed {};
struct PipedOneBlockFeed {};
// A pick's grid tag (std::true_type: balanced, std::false_type: one item a warp, PipedFeed: the
// balanced grid fed piped, PipedOneBlockFeed: the same on one block of kRowWarps a SM) as the
// kernels' template arguments.
template <class G>
constexpr bool kGridBalanced = !std::is_same_v<G, std::false_type>;
template <class G>
constexpr int kGridWarps = std::is_same_v<G, std::false_type>    ? kRowWarps
                           : std::is_same_v<G, PipedOneBlockFeed> ? kRowWarps
                                                                  : kBalWarps;
template <class G>
constexpr int kGridFeed = std::is_same_v<G, PipedFeed> || std::is_same_v<G, PipedOneBlockFeed> ? kFeedPiped : kFeedPlain;

template <class Pick, class... Args>
void launch_row_stream(Pick&& pick, int64_t n, int setting, size_t smem, cudaStream_t s, Args... args) {
    PHASE_CONFIGURE("ROWS");
    if ((setting & kRowBalanced) && (setting & kRowPiped)) {
        count_graph_event(GraphEvent::PipedRowLaunch);
        if (setting & kRowPipedOneBlock) {
            count_graph_event(GraphEvent::OneBlockRowLaunch);
            const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(tc::sm_count(), n));
            return launch(pick(PipedOneBlockFeed{}), static_cast<unsigned>(blocks), kRowWarps * 32, smem, s, args...);
        }
        return launch(pick(PipedFeed{}), static_cast<unsigned>(balanced_blocks(n)), kBalWarps * 32, smem, s, args...);
    }
    if (setting & kRowBalanced) {
        return launch(pick(std::true_type{}), static_cast<unsigned>(balanced_blocks(n)), kBalWarps * 32, smem, s,
                      args...);
    }
    launch(pick(std::false_type{}), grid_for(n, kRowWarps), kRowWarps * 32, smem, s, args...);
}

// The weight types the row-streaming kernels are built for (16-bit floats, 16-byte loads): only
// those launches instantiate them.
template <DType T, bool kVec>
constexpr bool kRowStreamType = (T == DType::F16 || T == DType::BF16) && kVec;

// Whether a launch of weight type T (kVec: 16-byte loads) takes the row-streaming kernels.
template <DType T, bool kVec>
bool streams_rows(int64_t k, int64_t m) {
    static const bool enabled = env_switch("PYSPEC_CUDA_ROW_STREAM") != 0;
    if constexpr (kRowStreamType<T, kVec>) {
        return enabled && m == 1 && static_cast<int64_t>(dtype_row_bytes(T, k)) > 1024 && k <= kMatmulNormMaxValues;
    } else {
        return false;
    }
}
