// The one-column kernels for long 16-bit rows (k_mul_mat_rows, k_mul_mat_glu_rows, and the
// copy-engine variant in cuda/matmul_rows_tma.cuh). Part of ops_matmul.cu's translation unit
// (included inside its anonymous namespace): they use that file's Parts, store, halves_unit, load_x
// and norm_prologue.
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
constexpr int kRowWarps = 16;        // the grid of one item a warp
constexpr int kBalWarps = 8;         // the balanced grid
constexpr int kBalBlocksPerSm = 2;
constexpr int kEarlyUnits = 4;

__device__ __forceinline__ uint4 ld_stream(const char* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// A lane's first N units of R rows, into registers.
template <int R, int N>
__device__ __forceinline__ void load_units(const char* const (&wr)[R], int64_t units, int lane, uint4 (&out)[R][N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const int64_t u = lane + 32 * i;
        if (u < units) {
#pragma unroll
            for (int r = 0; r < R; ++r) out[r][i] = ld_stream(wr[r] + u * 16);
        }
    }
}

// The block's activation column in shared memory, normalised (kNorm) or copied; every thread of
// the block (kThreads) calls it.
template <bool kNorm, int kThreads>
__device__ __forceinline__ const float* stage_column(const float* x, int64_t k, const float* nw, float eps) {
    if constexpr (kNorm) {
        const float* xc[1] = {x};
        norm_prologue<1, kThreads>(xc, k, nw, eps);
        return xc[0];
    } else {
        float* hs = reinterpret_cast<float*>(normed_rows);
        for (int64_t i = threadIdx.x; i < k; i += kThreads) hs[i] = x[i];
        __syncthreads();
        return hs;
    }
}

// The items [first, end) of block blockIdx.x: an equal contiguous share of n items over the
// grid (kBalanced), or kW items a block.
template <bool kBalanced, int kW>
__device__ __forceinline__ void block_items(int64_t n, int64_t& first, int64_t& end) {
    const int64_t b = blockIdx.x;
    if constexpr (kBalanced) {
        first = n * b / gridDim.x;
        end = n * (b + 1) / gridDim.x;
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

// How a warp's item (kRows rows) reaches their fmaf chains: a kernel's Feed. Every feed sums a
// lane's units u = lane (mod 32) in increasing u, each unit's fmaf chain as rows_unit_fma has it,
// so the bits are the same in all; what differs is when the bytes are asked for, and how many rows
// an item has. A feed's early() runs before the PDL wait where the weights are constant
// (MatmulPart::constant), for the warp's first item; sum() gives the rows' sums over the staged
// column xs, from what early() asked for when from_early (the first item), else asking for all of
// it itself.

// Units [u, u + 32 N) of R rows from a[r][i], while u < units (u advances by 32 a unit).
template <DType T, int R, int N>
__device__ __forceinline__ void sum_units(const uint4 (&a)[R][N], const float* xs, int64_t units, int64_t& u,
                                          float (&acc)[R]) {
#pragma unroll
    for (int i = 0; i < N; ++i, u += 32) {
        if (u < units) rows_unit_fma<T, R>([&](int r) { return a[r][i]; }, xs + u * 8, acc);
    }
}

// The rest of R rows, from unit u on, streamed in batches of kBatch units (kBatch R loads in
// flight a lane).
template <DType T, int R = 2, int kBatch = 4>
__device__ __forceinline__ void stream_rest(const char* const (&wr)[R], const float* xs, int64_t units, int64_t u,
                                            float (&acc)[R]) {
#pragma unroll kBatch
    for (; u < units; u += 32) {
        uint4 w[R];
#pragma unroll
        for (int r = 0; r < R; ++r) w[r] = ld_stream(wr[r] + u * 16);
        rows_unit_fma<T, R>([&](int r) { return w[r]; }, xs + u * 8, acc);
    }
}

// The first kEarlyUnits units in registers, the rest streamed: StreamedFeed<> is the default (two
// rows an item, 4 units a batch); StreamedRowFeed (PYSPEC_CUDA_ROW_ONE=1, the launches without the
// norm prologue whose rows are too long for WholeRowFeed: Qwen3-4B's down) takes one row an item
// in batches of 8, so each warp keeps as many loads in flight over half the bytes, and down's
// 2,560 rows keep every warp of the balanced grid busy.
template <int R = 2, int kBatch = 4>
struct StreamedFeed {
    static constexpr int kRows = R;
    static constexpr size_t kSmemPerWarp = 0;
    uint4 pre[R][kEarlyUnits];
    __device__ __forceinline__ void early(const char* const (&wr)[R], int64_t units, int lane) {
        load_units(wr, units, lane, pre);
    }
    template <DType T>
    __device__ __forceinline__ void sum(const char* const (&wr)[R], const float* xs, int64_t units, int lane,
                                        bool from_early, float (&acc)[R]) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        int64_t u = lane;
        if (from_early) sum_units<T>(pre, xs, units, u, acc);
        stream_rest<T, R, kBatch>(wr, xs, units, u, acc);
    }
};
using StreamedRowFeed = StreamedFeed<1, 8>;

// Opt-in (PYSPEC_CUDA_ROW_STAGED=1, the norm-prologue launches): as StreamedFeed, and the next
// kStagedUnits units of both rows copied before the wait into shared memory by cp.async, where
// registers have no room. In a launch with the norm prologue the weight stream otherwise stops
// while the block reads x, sums its squares and scales it (two barriers and three rounds to L2).
// Each lane reads back only what it copied. The area follows the staged column:
// [warp][row][kStagedUnits][32 lanes].
constexpr int kStagedUnits = 4;
struct StagedFeed {
    static constexpr int kRows = 2;
    static constexpr size_t kSmemPerWarp = 2 * kStagedUnits * 32 * 16;
    uint4 pre[2][kEarlyUnits];
    uint4* area = nullptr;
    __device__ __forceinline__ void early(const char* const (&wr)[2], int64_t units, int lane) {
        load_units(wr, units, lane, pre);
        area = reinterpret_cast<uint4*>(reinterpret_cast<float*>(normed_rows) + units * 8) +
               static_cast<size_t>(threadIdx.x >> 5) * (2 * kStagedUnits * 32);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
            for (int i = 0; i < kStagedUnits; ++i) {
                const int64_t u = lane + 32 * (kEarlyUnits + i);
                const bool ok = u < units;
                cp_async<16>(area + (r * kStagedUnits + i) * 32 + lane, ok ? wr[r] + u * 16 : wr[r], ok);
            }
        }
        cp_async_commit();
    }
    template <DType T>
    __device__ __forceinline__ void sum(const char* const (&wr)[2], const float* xs, int64_t units, int lane,
                                        bool from_early, float (&acc)[2]) {
        acc[0] = acc[1] = 0.0f;
        int64_t u = lane;
        if (from_early) {
            sum_units<T>(pre, xs, units, u, acc);
            cp_async_wait<0>();
#pragma unroll
            for (int i = 0; i < kStagedUnits; ++i, u += 32) {
                if (u < units) {
                    const uint4 w[2] = {area[i * 32 + lane], area[(kStagedUnits + i) * 32 + lane]};
                    rows_unit_fma<T, 2>([&](int r) { return w[r]; }, xs + u * 8, acc);
                }
            }
        }
        stream_rest<T>(wr, xs, units, u, acc);
    }
};

// Opt-in, every unit of an item's R rows asked for at once, into registers, before the PDL wait
// for the first item, where a lane's share of a row is at most N units:
// - WholeFeed<2, 10> (PYSPEC_CUDA_ROW_WHOLE=1, the norm-prologue launches, K <= 2560: Qwen3-4B's
//   q/k/v, gate/up and head). StreamedFeed has 8 loads in flight a warp, so an item of 2 x 10
//   units takes three rounds to DRAM after the wait (and the norm prologue), and a second item
//   three more: ncu puts q/k/v (1.45 items a warp) 8 us and gate/up 7 us above their bytes at the
//   head's streaming rate. Here the first item needs no round after the wait and every later one
//   a single round.
// - WholeFeed<1, 16> (PYSPEC_CUDA_ROW_ONE=1, the launches without it, K <= 4096: Qwen3-4B's o):
//   one row an item, so o's 2,560 rows spread over the 2,112 warps of the balanced grid (two-row
//   items leave 832 of them idle) and each warp's first row needs no round after the wait.
template <int R, int N>
struct WholeFeed {
    static constexpr int kRows = R;
    static constexpr int64_t kMaxUnits = 32 * N;
    static constexpr size_t kSmemPerWarp = 0;
    uint4 w[R][N];
    __device__ __forceinline__ void early(const char* const (&wr)[R], int64_t units, int lane) {
        load_units(wr, units, lane, w);
    }
    template <DType T>
    __device__ __forceinline__ void sum(const char* const (&wr)[R], const float* xs, int64_t units, int lane,
                                        bool from_early, float (&acc)[R]) {
        if (!from_early) early(wr, units, lane);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] = 0.0f;
        int64_t u = lane;
        sum_units<T>(w, xs, units, u, acc);
    }
};
using WholePairFeed = WholeFeed<2, 10>;  // the norm-prologue launches
using WholeRowFeed = WholeFeed<1, 16>;   // the others

// k_mul_mat's one-column case for long 16-bit rows: item i is the global rows R i .. R i + R - 1
// (R = Feed::kRows, 2 but for the one-row feeds; clamped to the last, as k_mul_mat reads them); warp w
// of a block takes its items first + w, first + w + kW, ... (block_items).
template <DType T, bool kNorm, bool kBalanced, int kW, class Feed = StreamedFeed<>>
__global__ void __launch_bounds__(kW * 32) k_mul_mat_rows(Parts p, int64_t k, const float* x) {
    constexpr int R = Feed::kRows;
    const int lane = threadIdx.x & 31;
    const int64_t n_rows = p.row0[p.n];
    int64_t item, end;
    block_items<kBalanced, kW>((n_rows + R - 1) / R, item, end);
    item += threadIdx.x >> 5;
    const char* wr[R];
    const auto rows_of = [&](int64_t it) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int64_t row = min(R * it + r, n_rows - 1);
            const int j = part_of(p, row);
            wr[r] = p.w[j] + (row - p.row0[j]) * p.rb[j];
        }
    };
    const bool early = p.early && item < end;
    Feed feed;
    if (early) {
        rows_of(item);
        feed.early(wr, k / 8, lane);
    }
    pdl_enter();
    const float* xs = stage_column<kNorm, kW * 32>(x, k, p.norm_w, p.norm_eps);  // before any warp leaves
    for (bool first = true; item < end; item += kW, first = false) {
        if (!(first && early)) rows_of(item);
        float acc[R];
        feed.template sum<T>(wr, xs, k / 8, lane, first && early, acc);
        // Every lane holds every row's sum (warp_sum's xor tree gives each lane the same bits);
        // lane r stores row r, so the two residual reads of o and down (each a round trip to L2
        // on the launch's tail) go out together rather than one after the other.
        if constexpr (R == 2) {
            const float s0 = warp_sum(acc[0]), s1 = warp_sum(acc[1]);
            if (lane < 2 && 2 * item + lane < n_rows) store(p, 2 * item + lane, 0, lane == 0 ? s0 : s1);
        } else {
            static_assert(R == 1, "items of one or two rows");
            const float s0 = warp_sum(acc[0]);
            if (lane == 0) store(p, item, 0, s0);
        }
    }
}

// k_mul_mat_glu's one-column case for long 16-bit rows: item i is gate and up row i, storing
// silu(gate) * up; items over blocks and warps as k_mul_mat_rows.
template <DType T, bool kNorm, bool kBalanced, int kW, class Feed = StreamedFeed<>>
__global__ void __launch_bounds__(kW * 32) k_mul_mat_glu_rows(const char* wg, const char* wu, int64_t rb_g, int64_t rb_u,
                                                              int64_t n_rows, int64_t k, const float* x, float* y,
                                                              const float* norm_w, float norm_eps, bool constant) {
    static_assert(Feed::kRows == 2, "an item is a gate row and an up row");
    const int lane = threadIdx.x & 31;
    int64_t row, end;
    block_items<kBalanced, kW>(n_rows, row, end);
    row += threadIdx.x >> 5;
    const bool early = constant && row < end;
    Feed feed;
    if (early) feed.early({wg + row * rb_g, wu + row * rb_u}, k / 8, lane);
    pdl_enter();
    const float* xs = stage_column<kNorm, kW * 32>(x, k, norm_w, norm_eps);  // before any warp leaves
    for (bool first = true; row < end; row += kW, first = false) {
        const char* const wr[2] = {wg + row * rb_g, wu + row * rb_u};
        float acc[2];
        feed.template sum<T>(wr, xs, k / 8, lane, first && early, acc);
        const float g = warp_sum(acc[0]), u = warp_sum(acc[1]);
        if (lane == 0) y[row] = silu_f(g) * u;
    }
}

#include "cuda/matmul_rows_tma.cuh"  // the copy-engine variant (the same translation unit)

// The launch sites read matmul_row_stream_setting() once a launch and hand it to what follows:
// kRowBalanced picks the balanced grid (PYSPEC_CUDA_ROW_BALANCE=0: one item a warp, for A/B).

// The feed of a norm-prologue launch over K = k under setting: WholePairFeed where
// a lane holds the rows' units, StagedFeed where the column and the area fit the
// 48 KiB a kernel gets unasked; both opt-in, the balanced grid only, the same bits as the default.
enum class RowFeed { Streamed, Staged, WholePair, WholeRow, StreamedRow };
inline RowFeed row_feed(int64_t k, int setting) {
    if (!(setting & kRowBalanced)) return RowFeed::Streamed;
    if ((setting & kRowWhole) && k / 8 <= WholePairFeed::kMaxUnits) return RowFeed::WholePair;
    if ((setting & kRowStaged) && k * sizeof(float) + kBalWarps * StagedFeed::kSmemPerWarp <= 48 * 1024) {
        return RowFeed::Staged;
    }
    return RowFeed::Streamed;
}

// The feed of a launch without the norm prologue: with PYSPEC_CUDA_ROW_ONE=1 (opt-in) on the
// balanced grid one row an item, WholeRowFeed where a lane's share of a row fits it, else
// StreamedRowFeed.
inline RowFeed row_feed_plain(int64_t k, int setting) {
    if (!(setting & kRowBalanced) || !(setting & kRowOne)) return RowFeed::Streamed;
    return k / 8 <= WholeRowFeed::kMaxUnits ? RowFeed::WholeRow : RowFeed::StreamedRow;
}

// Counts the opt-in feeds' launches (cuda_graph_stats), so tests know the feed they compare ran.
inline void count_row_feed(RowFeed feed) {
    if (feed == RowFeed::Staged) count_graph_event(GraphEvent::StagedFeedLaunch);
    if (feed == RowFeed::WholePair) count_graph_event(GraphEvent::WholeFeedLaunch);
    if (feed == RowFeed::WholeRow || feed == RowFeed::StreamedRow) count_graph_event(GraphEvent::OneRowFeedLaunch);
}

// The shared memory a balanced block of that feed asks for after its column.
inline size_t row_feed_smem(RowFeed feed) { return feed == RowFeed::Staged ? kBalWarps * StagedFeed::kSmemPerWarp : 0; }

// Launches a row-streaming kernel (k_mul_mat_rows, k_mul_mat_glu_rows) over n items: the balanced
// grid (setting & kRowBalanced), or the grid of one item a warp. pick(balanced) gives the kernel
// instantiation; extra_smem is the bytes after the column (the staged units' area).
template <class Pick, class... Args>
void launch_row_stream(Pick&& pick, int64_t n, int64_t k, size_t extra_smem, int setting, cudaStream_t s,
                       Args... args) {
    const size_t smem = k * sizeof(float) + extra_smem;
    if (setting & kRowBalanced) {
        const int64_t blocks = std::min<int64_t>(int64_t{kBalBlocksPerSm} * tc::sm_count(), n);
        return launch(pick(std::true_type{}), static_cast<unsigned>(std::max<int64_t>(1, blocks)), kBalWarps * 32, smem,
                      s, args...);
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
