// Long 16-bit float rows at M = 1 through the Tensor Memory Accelerator: the decode matvecs of a
// model like Qwen3-4B F16, whose step is bound by streaming its weights. Part of ops_matmul.cu's
// translation unit (included inside its anonymous namespace): it uses that file's Parts, store,
// halves_unit, load_x and stage_column, and keeps k_mul_mat's order, so its bits.
//
// How the bytes come. A block (one a SM) takes a contiguous share of the launch's row groups (8
// rows, within one part). One thread of the block's first warp streams the share's weights through
// a ring of R::kStages shared-memory stages (RowTmaRing) with the copy engine: a stage is two 2-D
// boxes of 8 rows x 256 columns (4 KiB each, one cp.async.bulk.tensor each) from the row-major
// weights, an mbarrier a stage says when its bytes landed and another when its consumer is done
// with it. The consumer warps take the share's groups R::kConsumers at a time, each warp one
// group, walking its stages in column order. Where the weights are constant (no node of the graph
// writes them, MatmulPart::constant) the first R::kStages stages are asked for before the PDL
// wait, so they stream in while the kernel before still runs.
//
// Why the bits are k_mul_mat's. A plain stage holds 512 columns: units (8 values) 0-31 of the
// group's rows in its first box, 32-63 in its second; lane l takes units l and l + 32 of every
// stage for all 8 rows, reading its 8 activations once for them, and carries each row's sum across
// the stages. So lane l sums the units u = l (mod 32) in increasing u, each unit's 8 products as
// one fmaf chain, and a row ends in warp_sum's xor tree: the order of every other tile. The fused
// gate/up (SWIGLU) stage holds 256 columns of 8 gate rows (first box) and the same 8 up rows
// (second box); lane l takes unit l of both: the same order for every row.
//
// Why, and why it is not the default yet. A probe of Qwen3-4B's 144 decode matvecs alone in one graph
// (tools/device/probe_mega.cu `ltmap`, H200, checked bit for bit against the reference order) put
// this shape at 1,929-1,946 us a step against 2,143-2,147 for the row-streaming kernels
// (k_mul_mat_rows), whose lanes hold a few units each in flight and read the activations once per
// two rows; left without its arithmetic and its PDL wait the same launches stream 4.2 TB/s. In the
// model it loses: tg128 315 t/s against 363 with k_mul_mat_rows (two alternating rounds, engine
// path), though the bits are the same. What the probe lacks is the rest of the step: the decode
// attention (141 KB of shared memory) and the other kernels between the matvecs, beside which the
// row-streaming kernels (10-38 KB) stay resident and load their first weights early, while these
// blocks (~138 KB) can only start once the SM has emptied; the open question is written up in
// docs/cuda-probes.md. Thirty-sixth session: neither ring, neither trigger and no register cap
// fixed it; every kind of MUL_MAT loses alone (PYSPEC_CUDA_ROW_TMA_KINDS), o and down most, whose
// 320 groups leave 2-3 busy consumer warps a SM (ncu, each alone: o 13.3 against 9.5 us). So it is
// opt-in: PYSPEC_CUDA_ROW_TMA=1 (read at every launch).
#pragma once

constexpr int kRowTmaGroup = 8;                                    // rows a consumer warp carries
constexpr int kRowTmaBoxCols = 256;                                // columns of a box (TMA's limit a dimension)
constexpr uint32_t kRowTmaBox = kRowTmaGroup * kRowTmaBoxCols * 2;  // 4 KiB
constexpr uint32_t kRowTmaStage = 2 * kRowTmaBox;

// A ring shape: kStages stages of kRowTmaStage bytes, kConsumers consumer warps besides the
// producer's warp.
template <int kStages_, int kConsumers_>
struct RowTmaRing {
    static constexpr int kStages = kStages_, kConsumers = kConsumers_, kThreads = (kConsumers + 1) * 32;
    static_assert((kStages & (kStages - 1)) == 0, "slots and uses by mask and shift");
    static_assert(kConsumers <= kStages, "a wave's stages of one column box fit the ring");
    static_assert(kThreads % kNormBlockThreads == 0, "every thread of the block takes part in stage_column");
};
// The probe's best (128 KiB of ring: one block a SM) and a ring that leaves room for the decode
// attention's 141 KB beside it (64 KiB; the probe, matvecs alone: 2,065-2,070 us at 4 consumers
// against 1,929-1,931). PYSPEC_CUDA_ROW_TMA_STAGES=8 picks the second (A/B; written after the
// thirty-fifth session's device time ran out: compiled, not yet run on a GPU).
using RowTmaDeep = RowTmaRing<16, 11>;
using RowTmaShallow = RowTmaRing<8, 7>;

// The tensor maps of one launch: part j's rows (plain), or the gate's and the up's rows (SWIGLU).
struct RowTmaMaps {
    CUtensorMap m[kMaxMatmulParts];
};

// Columns a stage covers.
template <bool kGlu>
constexpr int64_t row_tma_stage_cols() {
    return kGlu ? kRowTmaBoxCols : 2 * kRowTmaBoxCols;
}

// The row groups [g0, g1) of block blockIdx.x: an equal contiguous share.
__device__ __forceinline__ void row_tma_groups(int n_groups, int& g0, int& g1) {
    g0 = static_cast<int>(int64_t{n_groups} * blockIdx.x / gridDim.x);
    g1 = static_cast<int>(int64_t{n_groups} * (blockIdx.x + 1) / gridDim.x);
}

// The producer's walk over the block's share [g0, g1) of row groups (nb stages a group): groups go
// R::kConsumers at a time (a wave; only the last is short), a wave's stages in column order
// across its groups, stage i into ring slot i % R::kStages. It advances by additions only: one
// thread issues every stage of the SM, one each ~250 ns at the SM's share of the bandwidth, and
// with 64-bit divisions per stage it was the bottleneck (H200, tg128 of Qwen3-4B 361 -> 225 t/s).
template <class R>
struct RowTmaWalk {
    int w0, wn, gi, bx;  // the wave's first group and size; the stage's group in it and column box
    int slot;            // the ring slot (i % R::kStages)
    uint32_t use;        // the slot's uses before this one (i / R::kStages)
    int nb, g1;

    __device__ __forceinline__ RowTmaWalk(int g0, int g1_, int nb_)
        : w0(g0), wn(min(R::kConsumers, g1_ - g0)), gi(0), bx(0), slot(0), use(0), nb(nb_), g1(g1_) {}
    __device__ __forceinline__ void next() {
        if (++slot == R::kStages) {
            slot = 0;
            ++use;
        }
        if (++gi < wn) return;
        gi = 0;
        if (++bx < nb) return;
        bx = 0;
        w0 += wn;
        wn = min(R::kConsumers, g1 - w0);
    }
};

// The producer (one thread): the walk's next `count` stages into the ring.
template <bool kGlu, class R>
__device__ __forceinline__ void row_tma_produce(const RowTmaMaps& maps, const Parts& p, RowTmaWalk<R>& w, int count,
                                                unsigned char* ring, uint64_t* full, uint64_t* empty) {
    for (int n = 0; n < count; ++n, w.next()) {
        if (w.use > 0) mbar_wait(smem_addr(&empty[w.slot]), (w.use - 1) & 1);
        // The consumer's reads of the slot (generic proxy) before the copy engine's writes.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        const int64_t row = int64_t{w.w0 + w.gi} * kRowTmaGroup;
        const uint32_t bar = smem_addr(&full[w.slot]);
        const uint32_t dst = smem_addr(ring + static_cast<size_t>(w.slot) * kRowTmaStage);
        mbar_expect_tx(bar, kRowTmaStage);
        const int col = w.bx * static_cast<int>(row_tma_stage_cols<kGlu>());
        if constexpr (kGlu) {
            tma_load_2d(dst, &maps.m[0], col, static_cast<int>(row), bar);
            tma_load_2d(dst + kRowTmaBox, &maps.m[1], col, static_cast<int>(row), bar);
        } else {
            const int j = part_of(p, row);
            const int prow = static_cast<int>(row - p.row0[j]);
            tma_load_2d(dst, &maps.m[j], col, prow, bar);
            tma_load_2d(dst + kRowTmaBox, &maps.m[j], col + kRowTmaBoxCols, prow, bar);
        }
    }
}

template <DType T, bool kNorm, bool kGlu, class R>
__global__ void __launch_bounds__(R::kThreads, 1)
    k_mul_mat_rows_tma(const __grid_constant__ RowTmaMaps maps, Parts p, int64_t k, const float* x, bool trigger_first) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    __shared__ __align__(8) uint64_t full[R::kStages], empty[R::kStages];
    // Dynamic shared memory: the activation column (stage_column's k floats), then the ring.
    unsigned char* ring = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(normed_rows) + k * sizeof(float) + 127) & ~uintptr_t{127});
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nb = static_cast<int>(k / row_tma_stage_cols<kGlu>());
    int g0, g1;
    row_tma_groups(static_cast<int>(p.row0[p.n] / kRowTmaGroup), g0, g1);
    const int n_stages = (g1 - g0) * nb;
    if (threadIdx.x == 0) {
        for (int s = 0; s < R::kStages; ++s) {
            mbar_init(smem_addr(&full[s]), 1);   // the producer's expect_tx, then the copies' bytes
            mbar_init(smem_addr(&empty[s]), 1);  // the stage's consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (trigger_first) pdl_let_next_in();
    // Constant weights: the ring's first fill goes out before the wait (no slot to free yet).
    RowTmaWalk<R> walk(g0, g1, nb);
    const int ahead = p.early ? min(n_stages, R::kStages) : 0;
    if (threadIdx.x == 0) row_tma_produce<kGlu, R>(maps, p, walk, ahead, ring, full, empty);
    if (trigger_first) {
        pdl_wait();
    } else {
        pdl_enter();
    }
    const float* xs = stage_column<kNorm, R::kThreads>(x, k, p.norm_w, p.norm_eps);  // every thread, once
    if (warp == 0) {
        if (lane == 0) row_tma_produce<kGlu, R>(maps, p, walk, n_stages - ahead, ring, full, empty);
        return;
    }
    const int cw = warp - 1;
    constexpr int kRows = kGlu ? 2 * kRowTmaGroup : kRowTmaGroup;
    unsigned it = 0;  // the block's stages before this wave
    for (int w0 = g0; w0 < g1; w0 += R::kConsumers) {
        const int wn = min(R::kConsumers, g1 - w0);
        if (cw < wn) {
            float acc[kRows];
#pragma unroll
            for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
            unsigned mine = it + cw;  // the stage's index (its slot and use: a mask and a shift)
            for (int bx = 0; bx < nb; ++bx, mine += wn) {
                const int st = static_cast<int>(mine % R::kStages);
                const uint32_t use = mine / R::kStages;
                // The stage's previous use released first, so the full barrier's parity is this use's.
                if (use > 0) mbar_wait(smem_addr(&empty[st]), (use - 1) & 1);
                mbar_wait(smem_addr(&full[st]), use & 1);
                const unsigned char* stage = ring + static_cast<size_t>(st) * kRowTmaStage;
                const auto unit_of = [&](int box, int r) {
                    return reinterpret_cast<const uint4*>(stage + box * kRowTmaBox + r * kRowTmaBoxCols * 2)[lane];
                };
                if constexpr (kGlu) {
                    const float* xu = xs + (bx * (kRowTmaBoxCols / 8) + lane) * 8;
                    rows_unit_fma<T, kRows>([&](int r) { return unit_of(r / kRowTmaGroup, r % kRowTmaGroup); }, xu, acc);
                } else {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const float* xu = xs + (bx * (2 * kRowTmaBoxCols / 8) + h * 32 + lane) * 8;
                        rows_unit_fma<T, kRows>([&](int r) { return unit_of(h, r); }, xu, acc);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(smem_addr(&empty[st]));
            }
            const int64_t row0 = int64_t{w0 + cw} * kRowTmaGroup;
            // Every lane holds every row's sum (warp_sum's xor tree gives each lane the same
            // bits); lane r stores row r, so a group's 8 residual reads (o, down) go out together
            // rather than as 8 round trips to L2 in a row on the launch's tail.
            float out = 0.0f;
#pragma unroll
            for (int r = 0; r < kRowTmaGroup; ++r) {
                if constexpr (kGlu) {
                    const float g = warp_sum(acc[r]), u = warp_sum(acc[kRowTmaGroup + r]);
                    if (lane == r) out = silu_f(g) * u;
                } else {
                    const float sum = warp_sum(acc[r]);
                    if (lane == r) out = sum;
                }
            }
            if (lane < kRowTmaGroup) {
                if constexpr (kGlu) {
                    p.y[0][row0 + lane] = out;
                } else {
                    store(p, row0 + lane, 0, out);
                }
            }
        }
        it += static_cast<unsigned>(nb * wn);
    }
#endif
}

// Writes 1 where this build has the kernel's sm_90 code for the running GPU.
__global__ void k_rows_tma_built(int* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    *out = 1;
#else
    *out = 0;
#endif
}

// Whether launches may take k_mul_mat_rows_tma: matmul_row_tma_setting() on (off by default, see
// above), the kernel built for this GPU, and a driver with tensor maps.
bool rows_tma_ready() {
    if (!(matmul_row_tma_setting() & kRowTmaOn)) return false;
    static const bool ready = tensor_maps_available() && flag_kernel_writes_one(k_rows_tma_built);
    return ready;
}

// Whether every part fits the row groups and the maps: whole groups, whole stages of K, and the
// 16-byte alignment a tensor map asks of the base and the row pitch.
template <bool kGlu>
bool rows_tma_fits(const Parts& p, int64_t k) {
    if (k % row_tma_stage_cols<kGlu>() != 0) return false;
    const int kind = kGlu ? kRowTmaSkipGlu : p.norm_w ? kRowTmaSkipNorm : kRowTmaSkipPlain;
    if (matmul_row_tma_setting() & kind) return false;
    for (int j = 0; j < p.n; ++j) {
        const int64_t rows = p.row0[j + 1] - p.row0[j];
        if (rows % kRowTmaGroup != 0 || reinterpret_cast<uintptr_t>(p.w[j]) % 16 != 0 || p.rb[j] % 16 != 0) return false;
    }
    return rows_tma_ready();
}

// The launch with ring R: one block a SM (fewer for fewer groups); maps[j] over p.w[j]'s rows (kGlu:
// p.w[0] the gate's, p.w[1] the up's, each p.row0[1] rows).
template <DType T, bool kGlu, class R>
void launch_rows_tma_ring(const Parts& p, int64_t k, const float* x, cudaStream_t s) {
    static_assert(T == DType::F16 || T == DType::BF16, "tensor maps of 16-bit floats");
    RowTmaMaps maps{};
    const int n_maps = kGlu ? 2 : p.n;
    for (int j = 0; j < n_maps; ++j) {
        const int64_t rows = kGlu ? p.row0[1] : p.row0[j + 1] - p.row0[j];
        make_map_2d(&maps.m[j], T == DType::BF16, p.w[j], k, rows, p.rb[j], kRowTmaBoxCols, kRowTmaGroup, false);
    }
    const size_t ring = size_t{R::kStages} * kRowTmaStage;
    const size_t smem = static_cast<size_t>(k) * sizeof(float) + 128 + ring;
    const auto kernel = p.norm_w ? k_mul_mat_rows_tma<T, true, kGlu, R> : k_mul_mat_rows_tma<T, false, kGlu, R>;
    static const bool sized = [&] {  // every instantiation asks for the widest K's room once
        const int most = static_cast<int>(kMatmulNormMaxValues * sizeof(float) + 128 + ring);
        for (auto kr : {k_mul_mat_rows_tma<T, true, kGlu, R>, k_mul_mat_rows_tma<T, false, kGlu, R>}) {
            check(cudaFuncSetAttribute(kr, cudaFuncAttributeMaxDynamicSharedMemorySize, most),
                  "mul_mat (row groups, TMA): cudaFuncSetAttribute");
        }
        return true;
    }();
    (void)sized;
    const int64_t groups = p.row0[p.n] / kRowTmaGroup;
    count_graph_event(GraphEvent::RowTmaLaunch);
    // kRowTmaTriggerFirst lets the next kernel be launched as soon as every block has started, as
    // the probe did (A/B; written after the thirty-fifth session's device time ran out).
    const bool trigger_first = (matmul_row_tma_setting() & kRowTmaTriggerFirst) != 0;
    launch(kernel, static_cast<unsigned>(std::min<int64_t>(tc::sm_count(), groups)), R::kThreads, smem, s, maps, p, k, x,
           trigger_first);
}

template <DType T, bool kGlu>
void launch_rows_tma(const Parts& p, int64_t k, const float* x, cudaStream_t s) {
    if (matmul_row_tma_setting() & kRowTmaShallow) return launch_rows_tma_ring<T, kGlu, RowTmaShallow>(p, k, x, s);
    launch_rows_tma_ring<T, kGlu, RowTmaDeep>(p, k, x, s);
}
