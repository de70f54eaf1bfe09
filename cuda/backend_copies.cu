// CudaBackend's small copies, queued and run as one launch (cuda/cuda_backend_class.cuh says why;
// the kernel is cuda/copy_pieces.cu).
#include "cuda/cuda_backend_class.cuh"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda_backend {
namespace {

bool overlap(const char* a, size_t na, const char* b, size_t nb) { return a < b + nb && b < a + na; }

}  // namespace

char* CudaBackend::mapped(void* host) {
    void* d = nullptr;
    check(cudaHostGetDevicePointer(&d, host, 0), "mapping pinned host memory");
    return static_cast<char*>(d);
}

void CudaBackend::queue_piece(const char* src, char* dst, size_t bytes) {
    if (bytes == 0) return;
    bool clash = pending_.n == cuda::kMaxCopyPieces;
    for (int i = 0; i < pending_.n && !clash; ++i) {
        // A piece that writes what another reads or writes must come after it: the launch's
        // blocks run in no set order.
        const char* s = pending_.src[i];
        const char* d = pending_.dst[i];
        const size_t n = pending_.bytes[i];
        clash = overlap(dst, bytes, d, n) || overlap(dst, bytes, s, n) || overlap(src, bytes, d, n);
    }
    if (clash) flush_pieces();
    const int i = pending_.n++;
    pending_.src[i] = src;
    pending_.dst[i] = dst;
    pending_.bytes[i] = static_cast<uint32_t>(bytes);
}

void CudaBackend::flush_pieces() {
    if (pending_.n > 0) {
        cuda::CopyPieces p = pending_;
        pending_.n = 0;  // (whatever happens below, the queue is spent)
        if (p.n == 1) {
            check(cudaMemcpyAsync(p.dst[0], p.src[0], p.bytes[0], cudaMemcpyDefault, stream_), "copy: cudaMemcpyAsync");
        } else {
            cuda::launch_copy_pieces(p, stream_);
            cuda::count_graph_event(cuda::GraphEvent::BatchedCopyLaunch);
        }
    }
    for (AsyncRead& a : in_flight_reads_) {  // (a read's pieces are all queued before it is listed)
        if (a.recorded) continue;
        check(cudaEventRecord(a.done, stream_), "read: cudaEventRecord");
        a.recorded = true;
    }
}

void CudaBackend::queue_error_word_read(unsigned* dst) {
    queue_piece(reinterpret_cast<const char*>(err_), reinterpret_cast<char*>(dst), sizeof(unsigned));
}

}  // namespace cuda_backend
}  // namespace pyspec
