#include "cpu/cpu_backend.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "core/immutable_memory.h"
#include "cpu/matmul.h"
#include "cpu/quants.h"

namespace pyspec {
namespace {

constexpr size_t kArenaAlignment = 64;

void* aligned_zeroed(size_t bytes) {
    const size_t rounded = (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
    void* p = std::aligned_alloc(kArenaAlignment, rounded == 0 ? kArenaAlignment : rounded);
    if (!p) throw std::bad_alloc();
    std::memset(p, 0, rounded == 0 ? kArenaAlignment : rounded);
    return p;
}

// PYSPEC_CPU_PACK=0 keeps every weight in its file layout (A/B runs; the same bits either way).
bool packing_enabled() {
    static const bool on = [] {
        const char* v = std::getenv("PYSPEC_CPU_PACK");
        return !(v && std::string(v) == "0");
    }();
    return on;
}

// Bytes of memory Linux says can be had without swapping (MemAvailable), or SIZE_MAX where that
// cannot be read.
size_t memory_available() {
    std::FILE* f = std::fopen("/proc/meminfo", "r");
    if (!f) return std::numeric_limits<size_t>::max();
    char line[256];
    size_t kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f)) found = std::sscanf(line, "MemAvailable: %zu kB", &kib) == 1;
    std::fclose(f);
    return found ? kib * 1024 : std::numeric_limits<size_t>::max();
}

// The packed copy of weights read from a GGUF mapping (cpu/quants.h, pack_weights: one contiguous
// run per 16-row panel block instead of 16 strided reads), made on first use and shared by every
// context over the file (core/immutable_memory.h), or nullptr: weights of other types, other
// builds, or memory that may change (not inside a mapping).
const void* packed_copy(const WeightMatrix& w, PackedLookups& seen, ThreadPool& pool) {
    if (!packing_enabled() || !weights_packable(w.dtype) || w.n_rows < 1) return nullptr;
    const size_t bytes = static_cast<size_t>(w.n_rows) * w.row_bytes;
    const uint64_t kind = static_cast<uint64_t>(w.dtype) << 56 ^ static_cast<uint64_t>(w.n_cols) << 24 ^ w.row_bytes;
    const auto hit = seen.by_data.find(w.data);
    if (hit != seen.by_data.end() && hit->second.kind == kind && hit->second.bytes == bytes) return hit->second.packed;
    const void* packed = immutable_derived_copy(w.data, bytes, kind, [&w, &pool] {
        // The copy is anonymous memory the kernel cannot evict, where the mapping's pages are
        // page cache it can: a copy that would take more than a quarter of what is available is
        // declined, and those weights keep the file layout (the same bits, read more slowly).
        const size_t need = packed_weight_bytes(w.dtype, w.n_rows, w.n_cols);
        if (need > memory_available() / 4) return std::vector<uint8_t>{};
        std::vector<uint8_t> out(need);
        // Each thread packs whole packed panels (the copy of SmolLM2 and its drafter took ~120 ms
        // on one thread, paid by the server's warmup or a first request).
        const int64_t panels = (w.n_rows + kPackedPanelRows - 1) / kPackedPanelRows;
        const size_t panel_bytes = packed_panel_bytes(w.dtype, w.n_cols);
        pool.run([&](int ith, int nth) {
            int64_t p0 = 0, p1 = 0;
            split_range(panels, ith, nth, p0, p1);
            const int64_t r0 = p0 * kPackedPanelRows, r1 = std::min(w.n_rows, p1 * kPackedPanelRows);
            if (r0 >= r1) return;
            pack_weights(w.dtype, static_cast<const uint8_t*>(w.data) + static_cast<size_t>(r0) * w.row_bytes,
                         w.row_bytes, r1 - r0, w.n_cols, out.data() + static_cast<size_t>(p0) * panel_bytes);
        });
        return out;
    });
    seen.by_data[w.data] = PackedLookups::Entry{kind, bytes, packed};
    return packed;
}

MatmulPart matmul_part(const Graph& g, int id, PackedLookups& packed, ThreadPool& pool) {
    const Tensor& dst = g[id];
    const Tensor& w = g[dst.src[0]];
    const Tensor& x = g[dst.src[1]];
    if (w.ne[2] != 1 || w.ne[3] != 1) throw std::logic_error("mul_mat: weights must be 2-D");
    if (x.ne[2] != 1 || x.ne[3] != 1 || x.nb[0] != sizeof(float)) {
        throw std::logic_error("mul_mat: activations must be 2-D F32 rows");
    }
    WeightMatrix wm{w.dtype, w.data, w.ne[1], w.ne[0], w.nb[1]};
    if (w.has(kExternal)) wm.packed = packed_copy(wm, packed, pool);
    return MatmulPart{wm, dst.as<float>(), static_cast<int64_t>(dst.nb[1] / sizeof(float))};
}

bool bytes_overlap(const Tensor& a, const Tensor& b) {
    const char* pa = static_cast<const char*>(a.data);
    const char* pb = static_cast<const char*>(b.data);
    return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// The MUL_MAT at id and those that share its activations (matmuls_sharing_activations: q/k/v,
// gate/up) as one matmul_group (one pass through the pool, activations prepared once). Running
// the later ones early is safe: no node computes in between, and a member whose output overlaps
// the activations or an earlier member's output (never planned so) ends the group. Returns the
// last node run.
int run_mul_mat_group(const Graph& g, int id, ThreadPool& pool, std::vector<uint8_t>& scratch, PackedLookups& packed) {
    const Tensor& x = g[g[id].src[1]];
    int members[kMaxMatmulParts];
    const int n_members = matmuls_sharing_activations(g, id, members, kMaxMatmulParts);
    MatmulPart parts[kMaxMatmulParts];
    int n = 0, last = id;
    for (int m = 0; m < n_members; ++m) {
        const Tensor& t = g[members[m]];
        bool clash = m > 0 && bytes_overlap(t, x);
        for (int i = 0; i < m && !clash; ++i) clash = bytes_overlap(t, g[members[i]]);
        if (clash) break;
        parts[n++] = matmul_part(g, members[m], packed, pool);
        last = members[m];
    }
    matmul_group(parts, n, x.as<float>(), static_cast<int64_t>(x.nb[1] / sizeof(float)), x.ne[1], pool, scratch);
    return last;
}

// Small ops run on the calling thread alone: those of at most this many values, and those whose
// kernel has a single unit (row, token) to share out. Handing an op to the pool and waiting for
// its barrier costs ~1.5-2 us, more than a decode step's norms, adds, RoPEs and K/V writes take
// (~300 of them per step of a 135M-parameter model). Larger batches keep the pool: three rows
// of SWIGLU at 1536 measured 5x slower inline than shared. Every CPU kernel computes each output
// element the same way whatever the thread count, so where an op runs never changes its bits.
constexpr int64_t kInlineValues = 4096;

// The values an op reads or writes, as a measure of its work: the rows it writes for SET_ROWS
// (its destination is the whole cache), the rows it scans for reductions, else its output.
int64_t op_values(const Graph& g, const Tensor& t) {
    switch (t.op) {
        case Op::SET_ROWS: return g[t.src[1]].nelements();
        case Op::ARGMAX:
        case Op::TOP_K:
        case Op::SUM: return g[t.src[0]].nelements();
        default: return t.nelements();
    }
}

// The units an op's kernel (cpu/ops.cpp) splits among threads.
int64_t op_units(const Graph& g, const Tensor& t) {
    switch (t.op) {
        case Op::ROPE: return t.ne[2];  // tokens
        case Op::SET_ROWS: return g[t.src[1]].nrows();
        case Op::ARGMAX:
        case Op::TOP_K: return g[t.src[0]].nrows();
        case Op::SUM: return 1;
        case Op::GUMBEL: return t.nelements();  // a handful of rows of many values
        default: return t.nrows();
    }
}

bool run_inline(const Graph& g, const Tensor& t) {
    return t.op != Op::ATTENTION && (op_values(g, t) <= kInlineValues || op_units(g, t) == 1);
}

}  // namespace

void CpuBackend::FreeDeleter::operator()(void* p) const { std::free(p); }

CpuBackend::CpuBackend(int n_threads)
    : pool_(ThreadPool::shared(n_threads)), scratch_(static_cast<size_t>(pool_->size())) {}

CpuBackend::~CpuBackend() = default;

CpuBackend::Mapping::Mapping(size_t n) : bytes(n == 0 ? 1 : n) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        p = nullptr;
        throw std::bad_alloc();
    }
}

CpuBackend::Mapping::~Mapping() {
    if (p) munmap(p, bytes);
}

void* CpuBackend::alloc_persistent(size_t bytes) {
    persistent_.push_back(std::make_unique<Mapping>(bytes));  // page-aligned and zeroed
    return persistent_.back()->p;
}

void CpuBackend::apply_plan(Graph& graph, const AllocationPlan& plan) {
    if (plan.offset.size() != static_cast<size_t>(graph.size())) {
        throw std::logic_error("apply_plan: the plan was made for a different graph");
    }
    if (plan.arena_bytes > arena_size_) {  // grow-only
        arena_.reset(static_cast<uint8_t*>(aligned_zeroed(plan.arena_bytes)));
        arena_size_ = plan.arena_bytes;
    }
    if (poison_ && arena_) {
        float* f = reinterpret_cast<float*>(arena_.get());
        const size_t n = arena_size_ / sizeof(float);
        for (size_t i = 0; i < n; ++i) f[i] = std::numeric_limits<float>::quiet_NaN();
    }
    assign_addresses(graph, plan, reinterpret_cast<char*>(arena_.get()));
}

void CpuBackend::compute(Graph& graph) {
    using clock = std::chrono::steady_clock;
    if (const uint64_t gen = immutable_generation(); gen != packed_.generation) {  // a mapping went
        packed_.by_data.clear();
        packed_.generation = gen;
    }
    for (int id = 0; id < graph.size(); ++id) {
        const Op op = graph[id].op;
        if (op == Op::NONE || op == Op::VIEW) continue;
        const clock::time_point t0 = profiling_ ? clock::now() : clock::time_point();
        int last = id;
        if (op == Op::MUL_MAT) {
            last = run_mul_mat_group(graph, id, *pool_, matmul_scratch_, packed_);
        } else if (op == Op::ATTENTION && attention_phased_applies(graph, id, pool_->size())) {
            attention_phased(graph, id, *pool_, attention_scratch_);
        } else if (run_inline(graph, graph[id])) {
            run_cpu_op(graph, id, 0, 1, scratch_[0]);
        } else {
            const Graph& g = graph;
            pool_->run([&](int ith, int nth) { run_cpu_op(g, id, ith, nth, scratch_[static_cast<size_t>(ith)]); });
        }
        if (profiling_) {
            op_seconds_[static_cast<size_t>(op)] += std::chrono::duration<double>(clock::now() - t0).count();
            for (int j = id; j <= last; ++j) op_calls_[static_cast<size_t>(op)] += graph[j].op == op;  // a group's members
        }
        id = last;
    }
}

Backend::OpProfile CpuBackend::op_profile() const {
    OpProfile rows;
    for (size_t i = 0; i < op_seconds_.size(); ++i) {
        if (op_calls_[i] != 0) rows.emplace_back(op_name(static_cast<Op>(i)), op_seconds_[i], op_calls_[i]);
    }
    return rows;
}

void CpuBackend::write(const Tensor& t, const void* src, size_t bytes, size_t offset) {
    if (offset + bytes > t.nbytes()) throw std::logic_error("write past the end of tensor " + t.name);
    std::memcpy(static_cast<char*>(t.data) + offset, src, bytes);
}

void CpuBackend::read(const Tensor& t, void* dst, size_t bytes, size_t offset) {
    if (offset + bytes > t.nbytes()) throw std::logic_error("read past the end of tensor " + t.name);
    std::memcpy(dst, static_cast<const char*>(t.data) + offset, bytes);
}

}  // namespace pyspec
