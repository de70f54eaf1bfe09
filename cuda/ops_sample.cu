// SAMPLE: each row's token as a plain sampled step draws it from the row's candidates
// (csrc/core/graph.h; the host's routine is draw_from_candidates in csrc/spec/verify.cpp, which
// the CPU backend runs as is). One warp a row. Every operation is the host's, in the host's order
// where the order matters: the candidates arrive sorted (TOP_K's order, ties by the smaller id)
// and the row's banned ids are dropped from them first,
// so top-k keeps a prefix; min-p counts the candidates at or above the best + log(min_p); top-p
// sums exp(z - best) in order and keeps the shortest prefix whose cumulative share reaches top_p;
// the kept logits are divided by T and softmaxed in double, each probability rounded to float;
// then the exponential race of verification's bonus draw: w / -log(u) with u the Philox uniform
// of the token's id (slot 0, NoiseStream::Target), the largest winning, ties to the smaller id.
// The exponentials and logs are the GPU's double ones, which may differ from the host's libm in
// the last bit: a row whose draw sits on such a knife edge may come out differently, so the
// engine treats this op's token as a prediction that its own draw confirms.
#include "core/graph.h"
#include "cuda/kernels.h"
#include "cuda/launch.cuh"
#include "runtime/noise_math.h"

namespace pyspec {
namespace cuda {

namespace {

constexpr int kRowsPerBlock = 4;
constexpr int kMaxCandidates = 256;  // more (no engine asks for them) give no prediction (-1)

__device__ __forceinline__ double word_double(const uint32_t* w, int at) {
    return __hiloint2double(static_cast<int>(w[at + 1]), static_cast<int>(w[at]));
}

__global__ void __launch_bounds__(kRowsPerBlock * 32)
    k_sample(TDesc dst, TDesc ids, TDesc logits, TDesc samplers, TDesc bans) {
    __shared__ double s_e[kRowsPerBlock][kMaxCandidates];
    __shared__ int32_t s_id[kRowsPerBlock][kMaxCandidates];
    __shared__ float s_z[kRowsPerBlock][kMaxCandidates];
    pdl_enter();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp;
    if (r >= dst.ne[1]) return;
    const int k = static_cast<int>(ids.ne[0]);
    const int32_t* row_ids = reinterpret_cast<const int32_t*>(ids.row(r));
    const float* row_z = reinterpret_cast<const float*>(logits.row(r));
    const int32_t* ban = reinterpret_cast<const int32_t*>(bans.row(r));
    const uint32_t* w = reinterpret_cast<const uint32_t*>(samplers.row(r));
    int32_t* out = reinterpret_cast<int32_t*>(dst.row(r));
    double* e = s_e[warp];
    int32_t* id = s_id[warp];
    float* z = s_z[warp];
    const double temperature = word_double(w, SamplerWords::kTemperature);
    const double top_p = word_double(w, SamplerWords::kTopP);
    const double min_p = word_double(w, SamplerWords::kMinP);
    const int top_k = static_cast<int>(w[SamplerWords::kTopK]);
    // The candidates, in order, less TOP_K's -1 padding and the row's bans, compacted into
    // shared memory (id[0..m), z[0..m)).
    int m = 0;
    bool nan = false;
    for (int i0 = 0; i0 < k; i0 += 32) {
        const int i = i0 + lane;
        const int32_t t = i < k ? row_ids[i] : -1;
        bool valid = t >= 0;
#pragma unroll
        for (int b = 0; b < kSampleBans; ++b) valid = valid && ban[b] != t;
        const float zi = valid ? row_z[i] : 0.0f;
        const unsigned mask = __ballot_sync(0xffffffffu, valid);
        const int pos = m + __popc(mask & ((1u << lane) - 1u));
        if (valid && pos < kMaxCandidates) {
            id[pos] = t;
            z[pos] = zi;
        }
        m += __popc(mask);
        nan = nan || __any_sync(0xffffffffu, valid && zi != zi);
    }
    __syncwarp();
    const bool params_ok = top_k >= 1 && top_k <= m && top_p >= 0.0 && top_p <= 1.0 && min_p >= 0.0 && min_p <= 1.0;
    if (m == 0 || m > kMaxCandidates || nan || (temperature > 0.0 && !params_ok)) {
        if (lane == 0) out[0] = -1;
        return;
    }
    if (temperature <= 0.0) {
        if (lane == 0) out[0] = id[0];
        return;
    }
    const double zmax = z[0];
    const int n_k = min(top_k, m);
    int limit = n_k;
    if (min_p > 0.0) {
        const double floor = zmax + log(min_p);
        int count = 0;
        for (int i0 = 0; i0 < m; i0 += 32) {
            const int i = i0 + lane;
            count += __popc(__ballot_sync(0xffffffffu, i < m && static_cast<double>(z[i]) >= floor));
        }
        limit = min(limit, max(count, 1));
    }
    int kept = limit;
    if (top_p < 1.0) {
        for (int i = lane; i < n_k; i += 32) e[i] = exp(static_cast<double>(z[i]) - zmax);
        __syncwarp();
        if (lane == 0) {
            double total = 0.0;
            for (int i = 0; i < n_k; ++i) total += e[i];
            double cum = 0.0;
            for (int i = 0; i < limit; ++i) {
                cum += e[i] / total;
                if (cum >= top_p) {
                    kept = i + 1;
                    break;
                }
            }
        }
        kept = __shfl_sync(0xffffffffu, kept, 0);
        __syncwarp();
    }
    // Temperature and the softmax of what is kept: the largest scaled logit is the first's.
    double mx = -INFINITY;
    for (int i = lane; i < kept; i += 32) mx = fmax(mx, static_cast<double>(z[i]) / temperature);
    for (int d = 16; d >= 1; d >>= 1) mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, d));
    for (int i = lane; i < kept; i += 32) e[i] = exp(static_cast<double>(z[i]) / temperature - mx);
    __syncwarp();
    double sum = 0.0;
    if (lane == 0) {
        for (int i = 0; i < kept; ++i) sum += e[i];
    }
    sum = __shfl_sync(0xffffffffu, sum, 0);
    // The race over the kept candidates.
    int32_t best = -1;
    double best_val = 0.0;
    for (int i = lane; i < kept; i += 32) {
        const double wt = static_cast<double>(static_cast<float>(e[i] / sum));
        if (!(wt > 0.0)) continue;
        const uint32_t t = static_cast<uint32_t>(id[i]);
        uint32_t c[4] = {t >> 2, 0u, w[SamplerWords::kOffset], 0u};  // slot 0, NoiseStream::Target
        noise_math::philox4x32(c, w[SamplerWords::kSeedLo], w[SamplerWords::kSeedHi]);
        const double val = wt / -log(static_cast<double>(noise_math::u01_open(c[t & 3u])));
        if (best < 0 || val > best_val || (val == best_val && id[i] < best)) {
            best = id[i];
            best_val = val;
        }
    }
    for (int d = 16; d >= 1; d >>= 1) {
        const int32_t ob = __shfl_xor_sync(0xffffffffu, best, d);
        const double ov = __shfl_xor_sync(0xffffffffu, best_val, d);
        if (ob >= 0 && (best < 0 || ov > best_val || (ov == best_val && ob < best))) {
            best = ob;
            best_val = ov;
        }
    }
    if (lane == 0) out[0] = best;
}

}  // namespace

void launch_sample(const TDesc& dst, const TDesc& ids, const TDesc& logits, const TDesc& samplers, const TDesc& bans,
                   cudaStream_t s) {
    launch(k_sample, grid_for(dst.ne[1], kRowsPerBlock), kRowsPerBlock * 32, 0, s, dst, ids, logits, samplers, bans);
}

}  // namespace cuda
}  // namespace pyspec
