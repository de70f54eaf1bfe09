// What the two attention kernels (ops_attention.cu: one (head, row) per block; ops_attention_tiled.cu:
// a kv head's query heads over a tile of rows per block) share: the cell chunking that fixes every
// row's order of operations, so both give a row the same bits.
#pragma once

#include "cuda/common.cuh"

namespace pyspec {
namespace cuda {

constexpr int kWarps = 8;    // warps per block; chunk c belongs to warp c mod kWarps
constexpr int kChunk = 32;   // cells per chunk (absolute cells 32c .. 32c + 31): one per lane

// The row-tiled kernel serves batches (rows > 1, F16 cache, head_dim <= 128, 16-byte rows);
// PYSPEC_CUDA_ATT_TILED=0 turns it off. Checked on the H200: the per-row kernel's bits for every
// row, and every CUDA op and model test passes with it.
bool attention_tiled_enabled();
bool attention_tiled_supports(const TDesc& q, const TDesc& k, const TDesc& v, int n_kv_head);
void launch_attention_tiled(const TDesc& dst, const TDesc& q, const TDesc& k, const TDesc& v, const TDesc& mask,
                            const int32_t* base, int n_kv_head, float scale, unsigned* err, cudaStream_t s);

}  // namespace cuda
}  // namespace pyspec
