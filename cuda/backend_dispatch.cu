// What each node of a graph launches on the CUDA backend (run_node), and the fusions that launch
// several nodes at once: a MUL_MAT group (q/k/v, gate/up) as one launch, with the RMS_NORM before
// it as its prologue and the residual ADD or the SwiGLU after it as its epilogue; pairs of
// row-wise ops (q/k RoPE, K/V SET_ROWS, q/k norms); the RoPE pair with the K/V store; and a
// decode row's RoPE, store and attention as one launch of the attention kernel. Every fusion
// checks, on the device addresses, that nothing it writes overlaps what it reads, so no plan can
// make one unsafe; each gives the bits of the nodes run apart (PYSPEC_CUDA_FUSE=0 runs them so).
// The class and its state: cuda/cuda_backend_class.cuh; the loop that calls these:
// cuda/cuda_backend.cu (run_ops).
#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_backend_class.cuh"
#include "cuda/graph_cache.cuh"
#include "cuda/kernels.h"

namespace pyspec {
namespace cuda_backend {

int CudaBackend::group_parts(const Graph& g, int id, const Span& act, std::vector<cuda::MatmulPart>& parts, int& last) {
    int members[cuda::kMaxMatmulParts];
    const int n_members = matmuls_sharing_activations(g, id, members, cuda::kMaxMatmulParts);
    std::vector<Span> spans{act};
    parts.clear();
    last = id;
    for (int m = 0; m < n_members; ++m) {
        const int j = members[m];
        const cuda::MatmulPart part = matmul_part(g, j);
        const char* b = reinterpret_cast<const char*>(part.y);
        const char* e = b + g[j].nbytes();
        bool hit = false;
        for (const Span& sp : spans) hit = hit || overlaps({b, e}, sp);
        if (hit) break;
        spans.emplace_back(b, e);
        parts.push_back(part);
        last = j;
    }
    return n_members;
}

int CudaBackend::norm_prologue_target(const Graph& g, int id) {
    const Tensor& t = g[id];
    const int mm = next_computed(g, id);
    if (mm >= g.size() || g[mm].op != Op::MUL_MAT || g[mm].src[1] != id || t.src[1] < 0) return -1;
    if (t.has(kOutput) || t.has(kPinned)) return -1;
    const Tensor& x = g[t.src[0]];
    const Tensor& w = g[t.src[1]];
    const Tensor& wm = g[g[mm].src[0]];
    if (x.dtype != DType::F32 || x.nb[0] != sizeof(float) || x.nb[1] % sizeof(float) != 0 || x.ne[2] != 1 ||
        x.ne[3] != 1 || w.dtype != DType::F32 || w.nb[0] != sizeof(float) || w.ne[0] != x.ne[0] ||
        w.nrows() != 1 || t.ne[0] != x.ne[0] || t.ne[1] != x.ne[1] || wm.ne[0] != x.ne[0]) {
        return -1;
    }
    if (!cuda::matmul_norm_prologue(wm.dtype, wm.ne[0], x.ne[1], g[mm].iparams[0], tc_rows(wm))) return -1;
    std::vector<cuda::MatmulPart> parts;
    int last = mm;
    const int n_members = group_parts(g, mm, span(g, t.src[0]), parts, last);
    if (static_cast<int>(parts.size()) != n_members || uses_[static_cast<size_t>(id)] != n_members) return -1;
    return mm;
}

int CudaBackend::attention_room(const Graph& g, int last) {
    for (int j = next_computed(g, last); j < g.size(); j = next_computed(g, j)) {
        const Tensor& t = g[j];
        if (t.op == Op::ATTENTION) {
            const Tensor& q = g[t.src[0]];  // [hd, n_head, rows]
            return q.ne[2] == 1 ? static_cast<int>(q.ne[1]) : 0;
        }
        if (t.op != Op::RMS_NORM && t.op != Op::ROPE && t.op != Op::SET_ROWS) return 0;
    }
    return 0;
}

int CudaBackend::run_mul_mat_group(const Graph& g, int id, int norm) {
    const Tensor& t0 = g[id];
    const Tensor& w0 = g[t0.src[0]];
    const Tensor& x = g[t0.src[1]];
    cuda::MatmulNorm nn;
    const cuda::MatmulNorm* pn = nullptr;
    int act_id = t0.src[1];
    if (norm >= 0) {
        act_id = g[norm].src[0];
        nn.w = reinterpret_cast<const float*>(dptr(g, g[norm].src[1]));
        nn.eps = g[norm].fparams[0];
        nn.constant = constant(g, g[norm].src[1]);
        pn = &nn;
    }
    const Span act = span(g, act_id);
    const float* xp = reinterpret_cast<const float*>(dptr(g, act_id));
    const int64_t xs = static_cast<int64_t>(g[act_id].nb[1] / sizeof(float));
    std::vector<cuda::MatmulPart> parts;
    int last = id;
    group_parts(g, id, act, parts, last);
    if (parts.empty()) {  // the first output overlaps its activations: never planned so
        if (norm >= 0) throw std::logic_error("cuda backend: norm prologue without its matmuls");
        run_node(g, id);
        return id;
    }
    if (norm >= 0) cuda::count_graph_event(cuda::GraphEvent::NormPrologueLaunch);
    if (parts.size() == 1) {
        const int add = residual_add_after(g, id, act, parts[0]);
        if (add >= 0) last = add;
    }
    if (parts.size() == 2) {
        const int glu = swiglu_after(g, id, last, act);
        if (glu >= 0 && cuda::launch_matmul_glu(w0.dtype, parts[0], parts[1], w0.ne[0], xp, xs, x.ne[1],
                                                t0.iparams[0], tc_rows(w0), reinterpret_cast<float*>(dptr(g, glu)),
                                                static_cast<int64_t>(g[glu].nb[1] / sizeof(float)), stream_, pn)) {
            return glu;
        }
    }
    cuda::launch_matmul_group(w0.dtype, parts.data(), static_cast<int>(parts.size()), w0.ne[0], xp, xs, x.ne[1],
                              t0.iparams[0], tc_rows(w0), scratch_, stream_, pn, attention_room(g, last));
    return last;
}

cuda::OpJob CudaBackend::op_job(const Graph& g, int id) {
    const Tensor& t = g[id];
    cuda::OpJob job;
    if (t.op == Op::SET_ROWS) {
        const Tensor& dst = g[t.src[0]];
        require(!dtype_is_integer(dst.dtype), t, "integer destination");
        require(!dtype_is_quantized(dst.dtype) || g[t.src[1]].ne[0] % QK == 0, t,
                "row not a multiple of the block size");
        job.dst = desc(g, t.src[0]);
        job.src = desc(g, t.src[1]);
        return job;
    }
    if (t.op == Op::ROPE) {
        require(t.iparams[0] >= 0 && t.iparams[0] <= g[t.src[0]].ne[0] && t.iparams[0] % 2 == 0, t, "bad n_rot");
        require(g[t.src[0]].ne[3] == 1 && g[t.src[0]].nb[0] == sizeof(float), t, "rows must be [head_dim, n_head, n_rows] F32");
    }
    job.dst = desc(g, id);
    job.src = desc(g, t.src[0]);
    if (t.op == Op::RMS_NORM && t.src[1] >= 0) job.w = reinterpret_cast<const float*>(dptr(g, t.src[1]));
    return job;
}

void CudaBackend::launch_jobs(const Graph& g, int id, const cuda::OpJob* jobs, int n) {
    const Tensor& t = g[id];
    switch (t.op) {
        case Op::RMS_NORM: cuda::launch_rms_norm(jobs, n, t.fparams[0], stream_); return;
        case Op::ROPE: {
            cuda::RopeJob rj[cuda::kMaxOpJobs];
            for (int i = 0; i < n; ++i) {
                rj[i].dst = jobs[i].dst;
                rj[i].src = jobs[i].src;
            }
            launch_rope(g, id, rj, n, nullptr);
            return;
        }
        case Op::SET_ROWS:
            cuda::launch_set_rows(jobs, n, reinterpret_cast<const int32_t*>(dptr(g, t.src[2])), err_, stream_);
            return;
        default: throw std::logic_error("cuda backend: launch_jobs: not a row-wise op");
    }
}

void CudaBackend::launch_rope(const Graph& g, int id, const cuda::RopeJob* jobs, int n, const int32_t* cells) {
    const Tensor& t = g[id];
    const float* ff = t.src[2] >= 0 ? reinterpret_cast<const float*>(dptr(g, t.src[2])) : nullptr;
    cuda::launch_rope(jobs, n, reinterpret_cast<const int32_t*>(dptr(g, t.src[1])), cells, ff, t.iparams[0],
                      t.iparams[1] == 2, t.fparams[0], t.fparams[1], is_leaf(g, t.src[1]) && is_leaf(g, t.src[2]),
                      err_, stream_);
}

int CudaBackend::next_computed(const Graph& g, int i) {
    int j = i + 1;
    while (j < g.size() && (g[j].op == Op::NONE || g[j].op == Op::VIEW)) ++j;
    return j;
}

int CudaBackend::run_rope_and_store(const Graph& g, int a, int b) {
    int c = -1, d = -1;
    if (!rope_store_nodes(g, a, b, c, d)) return -1;
    cuda::RopeJob jobs[3];
    const int ids[2] = {a, b};
    for (int i = 0; i < 2; ++i) {
        const cuda::OpJob j = op_job(g, ids[i]);
        jobs[i].dst = j.dst;
        jobs[i].src = j.src;
    }
    jobs[1].kind = cuda::RopeJob::kRopeStore;
    jobs[1].cache = desc(g, g[c].src[0]);
    jobs[2].kind = cuda::RopeJob::kStore;
    jobs[2].src = desc(g, g[d].src[1]);
    jobs[2].cache = desc(g, g[d].src[0]);
    launch_rope(g, a, jobs, 3, reinterpret_cast<const int32_t*>(dptr(g, g[c].src[2])));
    return d;
}

bool CudaBackend::rope_store_nodes(const Graph& g, int a, int b, int& c, int& d) {
    c = next_computed(g, b);
    d = c < g.size() ? next_computed(g, c) : g.size();
    if (d >= g.size() || g[c].op != Op::SET_ROWS || g[d].op != Op::SET_ROWS || g[c].src[2] != g[d].src[2]) {
        return false;
    }
    const Tensor& rk = g[b];
    const Tensor& kv = g[g[c].src[1]];  // b's rows, [head_dim * n_head, n_rows]
    const Tensor& kc = g[g[c].src[0]];
    const Tensor& vc = g[g[d].src[0]];
    const Tensor& v = g[g[d].src[1]];
    const size_t f = sizeof(float);
    const bool contiguous_b = rk.nb[0] == f && rk.nb[1] == static_cast<size_t>(rk.ne[0]) * f &&
                              rk.nb[2] == static_cast<size_t>(rk.ne[1]) * rk.nb[1] && rk.ne[3] == 1;
    if (!contiguous_b || kv.view_src != b || kv.view_offset != 0 || kv.ne[0] != rk.ne[0] * rk.ne[1] ||
        kv.ne[1] != rk.ne[2] || kv.nb[0] != f || kv.nb[1] != static_cast<size_t>(kv.ne[0]) * f) {
        return false;
    }
    for (const Tensor* cache : {&kc, &vc}) {
        if (cache->dtype != DType::F16 && cache->dtype != DType::F32) return false;
    }
    if (kc.ne[0] != kv.ne[0] || vc.ne[0] != v.ne[0] || v.dtype != DType::F32 || v.nrows() != kv.ne[1]) return false;
    const Span written[] = {span(g, a), span(g, b), span(g, g[c].src[0]), span(g, g[d].src[0])};
    const Span read[] = {span(g, g[a].src[0]), span(g, g[b].src[0]), span(g, g[d].src[1]), span(g, g[a].src[1]),
                         span(g, g[c].src[2])};
    for (size_t i = 0; i < std::size(written); ++i) {
        for (size_t j = i + 1; j < std::size(written); ++j) {
            if (overlaps(written[i], written[j])) return false;
        }
        for (const Span& r : read) {
            if (overlaps(written[i], r)) return false;
        }
    }
    return true;
}

int CudaBackend::run_rope_store_attention(const Graph& g, int a, int b, int nq, int nk) {
    if (!cuda::attention_rope_enabled()) return -1;
    int c = -1, d = -1;
    if (!rope_store_nodes(g, a, b, c, d)) return -1;
    const int e = next_computed(g, d);
    if (e >= g.size()) return -1;
    const Tensor& att = g[e];
    if (att.op != Op::ATTENTION || att.src[0] != a || att.src[1] != c || att.src[2] != d || att.iparams[1] != 0 ||
        g[a].ne[2] != 1 || g[g[c].src[0]].dtype != DType::F16 || g[g[d].src[0]].dtype != DType::F16) {
        return -1;
    }
    const Tensor& ra = g[a];
    if (!is_leaf(g, ra.src[1]) || !is_leaf(g, ra.src[2]) || !is_leaf(g, g[c].src[2])) return -1;
    const bool norms = nq >= 0;
    if (norms) {
        for (int n : {nq, nk}) {
            const Tensor& t = g[n];
            const Tensor& x = g[t.src[0]];
            if (t.op != Op::RMS_NORM || t.src[1] < 0 || t.has(kOutput) || t.has(kPinned) ||
                uses_[static_cast<size_t>(n)] != 1 || g[t.src[1]].dtype != DType::F32 ||
                g[t.src[1]].nelements() != t.ne[0] || x.dtype != DType::F32 || x.ne != t.ne ||
                x.nb[0] != sizeof(float)) {
                return -1;
            }
        }
        if (ra.src[0] != nq || g[b].src[0] != nk || g[nq].fparams[0] != g[nk].fparams[0]) return -1;
    }
    const Span out = span(g, e);
    for (int i : {a, b, g[c].src[0], g[d].src[0], ra.src[0], g[b].src[0], g[d].src[1], ra.src[1], ra.src[2],
                  g[c].src[2], att.src[3], att.src[4], norms ? g[nq].src[0] : -1, norms ? g[nk].src[0] : -1,
                  norms ? g[nq].src[1] : -1, norms ? g[nk].src[1] : -1}) {
        if (i >= 0 && overlaps(out, span(g, i))) return -1;
    }
    for (int i : {att.src[3], att.src[4]}) {  // the mask and the first cells: read, never written here
        for (int w : {a, b, g[c].src[0], g[d].src[0]}) {
            if (overlaps(span(g, i), span(g, w))) return -1;
        }
    }
    cuda::DecodeRope rope;
    rope.q_src = desc(g, norms ? g[nq].src[0] : ra.src[0]);
    rope.k_src = desc(g, norms ? g[nk].src[0] : g[b].src[0]);
    if (norms) {
        rope.q_norm = reinterpret_cast<const float*>(dptr(g, g[nq].src[1]));
        rope.k_norm = reinterpret_cast<const float*>(dptr(g, g[nk].src[1]));
        rope.norm_eps = g[nq].fparams[0];
    }
    rope.v_src = desc(g, g[d].src[1]);
    rope.q_dst = desc(g, a);
    rope.k_dst = desc(g, b);
    rope.pos = reinterpret_cast<const int32_t*>(dptr(g, ra.src[1]));
    rope.cells = reinterpret_cast<const int32_t*>(dptr(g, g[c].src[2]));
    rope.factors = ra.src[2] >= 0 ? reinterpret_cast<const float*>(dptr(g, ra.src[2])) : nullptr;
    rope.early = cuda::env_switch("PYSPEC_CUDA_ATT_EARLY") != 0 && is_leaf(g, att.src[3]) && is_leaf(g, att.src[4]);
    rope.early_copies = rope.early && cuda::env_switch("PYSPEC_CUDA_ATT_EARLY_COPY") != 0 &&
                        written_only_by(g, g[c].src[0], g[d].src[0], c, d);
    rope.let_next_in_first = cuda::env_switch("PYSPEC_CUDA_ATT_LET_IN_FIRST") != 0;
    rope.n_rot = ra.iparams[0];
    rope.neox = ra.iparams[1] == 2 ? 1 : 0;
    rope.base = ra.fparams[0];
    rope.fscale = ra.fparams[1];
    // The step's angles: stored by its first such launch, read by the later ones with the same
    // positions (a graph leaf: the same values all compute) and frequencies.
    StoredAngles these;
    these.valid = true;
    these.pos = rope.pos;
    these.factors = rope.factors;
    these.n_rot = rope.n_rot;
    these.base = rope.base;
    these.fscale = rope.fscale;
    if (cuda::attention_angles_enabled() && rope.n_rot <= kMaxRopeAngles) {
        if (!rope_angles_) check(cudaMalloc(&rope_angles_, kMaxRopeAngles * sizeof(float)), "rope angles: cudaMalloc");
        rope.angles = rope_angles_;
        rope.angles_stored = stored_angles_ == these;
    }
    const bool launched = cuda::launch_attention_rope(
        desc(g, e), desc(g, c), desc(g, d), desc(g, att.src[3]), reinterpret_cast<const int32_t*>(dptr(g, att.src[4])),
        att.iparams[0], att.fparams[0], rope, scratch_, err_, stream_);
    if (launched && rope.angles && !rope.angles_stored) stored_angles_ = these;
    return launched ? e : -1;
}

bool CudaBackend::written_only_by(const Graph& g, int id0, int id1, int w0, int w1) {
    const Span t0 = span(g, id0), t1 = span(g, id1);
    for (int j = 0; j < g.size(); ++j) {
        const Op op = g[j].op;
        if (j == w0 || j == w1 || op == Op::NONE || op == Op::VIEW) continue;
        const Span s = span(g, j);
        if (overlaps(s, t0) || overlaps(s, t1)) return false;
    }
    return true;
}

CudaBackend::Span CudaBackend::span(const Graph& g, int id) {
    const char* b = dptr(g, id);
    return {b, b + g[id].nbytes()};
}

int CudaBackend::run_op_pair(const Graph& g, int id) {
    const int b = next_computed(g, id);
    if (b >= g.size() || !pairable(g, id, b)) {
        run_node(g, id);
        return id;
    }
    if (g[id].op == Op::RMS_NORM) {
        // Qwen3's q/k norms, then the RoPE pair over their outputs: all of it in the decode
        // attention's launch where that applies (run_rope_store_attention).
        const int ra = next_computed(g, b);
        const int rb = ra < g.size() ? next_computed(g, ra) : g.size();
        if (rb < g.size() && g[ra].op == Op::ROPE && g[rb].op == Op::ROPE && g[ra].src[0] == id &&
            g[rb].src[0] == b && pairable(g, ra, rb)) {
            const int last = run_rope_store_attention(g, ra, rb, id, b);
            if (last >= 0) return last;
        }
    }
    if (g[id].op == Op::ROPE) {
        int last = run_rope_store_attention(g, id, b);
        if (last < 0) last = run_rope_and_store(g, id, b);
        if (last >= 0) return last;
    }
    const cuda::OpJob jobs[2] = {op_job(g, id), op_job(g, b)};
    launch_jobs(g, id, jobs, 2);
    return b;
}

bool CudaBackend::pairable(const Graph& g, int ia, int ib) {
    const Tensor& a = g[ia];
    const Tensor& b = g[ib];
    if (b.op != a.op) return false;
    switch (a.op) {
        case Op::ROPE:  // the same positions and frequency factors
            if (b.src[1] != a.src[1] || b.src[2] != a.src[2] || b.iparams[0] != a.iparams[0] || b.iparams[1] != a.iparams[1] || b.fparams[0] != a.fparams[0] ||
                b.fparams[1] != a.fparams[1] || g[b.src[0]].ne[2] != g[a.src[0]].ne[2] ||
                b.iparams[0] > g[b.src[0]].ne[0] || b.iparams[0] % 2 != 0) {
                return false;
            }
            break;
        case Op::RMS_NORM:
            // the same row length: the same kernel, so both jobs fit one launch
            if (b.fparams[0] != a.fparams[0] || g[b.src[0]].ne[0] != g[a.src[0]].ne[0]) return false;
            break;
        case Op::SET_ROWS:  // the same cells
            if (b.src[2] != a.src[2] || dtype_is_quantized(g[a.src[0]].dtype) != dtype_is_quantized(g[b.src[0]].dtype) ||
                dtype_is_integer(g[b.src[0]].dtype) || g[a.src[1]].nrows() != g[b.src[1]].nrows() ||
                (dtype_is_quantized(g[b.src[0]].dtype) && g[b.src[1]].ne[0] % QK != 0)) {
                return false;
            }
            break;
        default: return false;
    }
    const auto written = [&](int i) { return g[i].op == Op::SET_ROWS ? span(g, g[i].src[0]) : span(g, i); };
    const auto wa = written(ia), wb = written(ib);
    if (overlaps(wa, wb)) return false;
    for (int s : b.src) {
        if (s >= 0 && overlaps(span(g, s), wa)) return false;
    }
    for (int s : a.src) {
        if (s >= 0 && overlaps(span(g, s), wb)) return false;
    }
    return true;
}

void CudaBackend::mark_written(const Graph& g) {
    written_.clear();
    for (int j = 0; j < g.size(); ++j) {
        const Op op = g[j].op;
        if (op == Op::NONE || op == Op::VIEW) continue;
        const Span s = span(g, j);
        if (s.first < s.second) written_.push_back(s);
    }
    std::sort(written_.begin(), written_.end());
    size_t n = 0;
    for (const Span& s : written_) {
        if (n > 0 && s.first <= written_[n - 1].second) {
            written_[n - 1].second = std::max(written_[n - 1].second, s.second);
        } else {
            written_[n++] = s;
        }
    }
    written_.resize(n);
}

bool CudaBackend::constant(const Graph& g, int id) {
    if (g[g.root_of(id)].op != Op::NONE) return false;
    const Span w = span(g, id);
    // The first written span that ends after w starts (ends increase with starts: disjoint).
    const auto it = std::upper_bound(written_.begin(), written_.end(), w.first,
                                     [](const char* p, const Span& x) { return p < x.second; });
    return it == written_.end() || !overlaps(w, *it);
}

void CudaBackend::count_uses(const Graph& g) {
    uses_.assign(static_cast<size_t>(g.size()), 0);
    for (int j = 0; j < g.size(); ++j) {
        const Tensor& t = g[j];
        for (int s : t.src) {
            if (s >= 0) ++uses_[static_cast<size_t>(s)];
        }
        if (t.view_src >= 0) ++uses_[static_cast<size_t>(t.view_src)];
    }
}

int CudaBackend::residual_add_after(const Graph& g, int id, const Span& act, cuda::MatmulPart& part) {
    const Tensor& mm = g[id];
    const Tensor& w = g[mm.src[0]];
    if (!cuda::matmul_add_epilogue(w.dtype, w.ne[0], tc_rows(w))) return -1;
    if (mm.has(kOutput) || mm.has(kPinned) || uses_[static_cast<size_t>(id)] != 1) return -1;
    const int a = next_computed(g, id);
    if (a >= g.size() || g[a].op != Op::ADD) return -1;
    const Tensor& add = g[a];
    int other = -1;
    if (add.src[0] == id && add.src[1] != id) other = add.src[1];
    if (add.src[1] == id && add.src[0] != id) other = add.src[0];
    if (other < 0) return -1;
    const Tensor& r = g[other];
    for (int d = 0; d < 4; ++d) {
        if (r.ne[d] != mm.ne[d] || add.ne[d] != mm.ne[d]) return -1;
    }
    if (r.dtype != DType::F32 || add.dtype != DType::F32 || r.nb[0] != sizeof(float) ||
        add.nb[0] != sizeof(float) || r.nb[1] % sizeof(float) != 0 || add.nb[1] % sizeof(float) != 0) {
        return -1;
    }
    const Span out = span(g, a), res = span(g, other);
    if (overlaps(out, act)) return -1;
    const bool same = res.first == out.first && r.nb[1] == add.nb[1];
    if (!same && overlaps(out, res)) return -1;
    const char* rb = res.first;
    part.y = reinterpret_cast<float*>(dptr(g, a));
    part.y_stride = static_cast<int64_t>(add.nb[1] / sizeof(float));
    part.add = reinterpret_cast<const float*>(rb);
    part.add_stride = static_cast<int64_t>(r.nb[1] / sizeof(float));
    return a;
}

int CudaBackend::swiglu_after(const Graph& g, int gate, int up, const Span& act) {
    const int a = next_computed(g, up);
    if (a >= g.size() || g[a].op != Op::SWIGLU || g[a].src[0] != gate || g[a].src[1] != up) return -1;
    const Tensor& glu = g[a];
    for (int id : {gate, up}) {
        const Tensor& mm = g[id];
        if (mm.has(kOutput) || mm.has(kPinned) || uses_[static_cast<size_t>(id)] != 1) return -1;
        for (int d = 0; d < 4; ++d) {
            if (mm.ne[d] != glu.ne[d]) return -1;
        }
    }
    if (glu.dtype != DType::F32 || glu.nb[0] != sizeof(float) || glu.nb[1] % sizeof(float) != 0) return -1;
    if (overlaps(span(g, a), act)) return -1;
    return a;
}

cuda::MatmulPart CudaBackend::matmul_part(const Graph& g, int id) {
    const Tensor& t = g[id];
    const Tensor& w = g[t.src[0]];
    const Tensor& x = g[t.src[1]];
    require(w.ne[2] == 1 && w.ne[3] == 1, t, "weights must be 2-D");
    require(x.ne[2] == 1 && x.ne[3] == 1 && x.nb[0] == sizeof(float) && x.dtype == DType::F32, t,
            "activations must be 2-D F32 rows");
    require(!dtype_is_integer(w.dtype), t, "integer weights");
    require(w.nb[1] >= dtype_row_bytes(w.dtype, w.ne[0]), t, "row stride is smaller than a row");
    require(x.nb[1] % sizeof(float) == 0 && t.nb[1] % sizeof(float) == 0, t, "row strides not in floats");
    cuda::MatmulPart part{dptr(g, t.src[0]), w.ne[1], w.nb[1], reinterpret_cast<float*>(dptr(g, id)),
                          static_cast<int64_t>(t.nb[1] / sizeof(float))};
    part.constant = constant(g, t.src[0]);
    return part;
}

void CudaBackend::require(bool ok, const Tensor& t, const char* why) {
    if (!ok) throw std::logic_error(std::string("cuda backend: ") + op_name(t.op) + " (" + t.name + "): " + why);
}

void CudaBackend::run_node(const Graph& g, int id) {
    const Tensor& t = g[id];
    auto src = [&](int i) { return t.src[static_cast<size_t>(i)]; };
    switch (t.op) {
        case Op::CPY: {
            const Tensor& s = g[src(0)];
            require(s.nelements() == t.nelements() && s.ne[0] == t.ne[0], t, "shapes differ");
            require(!dtype_is_quantized(t.dtype) || s.ne[0] % QK == 0, t, "row not a multiple of the block size");
            require((dtype_is_integer(s.dtype) == dtype_is_integer(t.dtype)) &&
                        (!dtype_is_integer(s.dtype) || (s.dtype == DType::I32 && t.dtype == DType::I32)),
                    t, "unsupported type pair");
            require(s.nrows() == t.nrows(), t, "row counts differ");
            cuda::launch_cpy(desc(g, id), desc(g, src(0)), stream_);
            return;
        }
        case Op::GET_ROWS: {
            const Tensor& tab = g[src(0)];
            require(!dtype_is_integer(tab.dtype), t, "integer table");
            require(t.dtype == DType::F32, t, "dst must be F32");
            cuda::launch_get_rows(desc(g, id), desc(g, src(0)), reinterpret_cast<const int32_t*>(dptr(g, src(1))), err_,
                                  stream_);
            return;
        }
        case Op::MUL_MAT: {
            const Tensor& w = g[src(0)];
            const Tensor& x = g[src(1)];
            const cuda::MatmulPart part = matmul_part(g, id);
            cuda::launch_matmul_group(w.dtype, &part, 1, w.ne[0], reinterpret_cast<const float*>(dptr(g, src(1))),
                                      static_cast<int64_t>(x.nb[1] / sizeof(float)), x.ne[1], t.iparams[0],
                                      tc_rows(w), scratch_, stream_);
            return;
        }
        case Op::RMS_NORM:
        case Op::ROPE:
        case Op::SET_ROWS: {
            const cuda::OpJob job = op_job(g, id);
            launch_jobs(g, id, &job, 1);
            return;
        }
        case Op::ADD:
        case Op::MUL:
        case Op::SWIGLU: {
            const Tensor& a = g[src(0)];
            const Tensor& b = g[src(1)];
            require(b.ne[0] == a.ne[0] && (b.nrows() == 1 || b.nrows() == a.nrows()), t, "shapes do not broadcast");
            const int kind = t.op == Op::ADD ? 0 : t.op == Op::MUL ? 1 : 2;
            cuda::launch_binary(kind, desc(g, id), desc(g, src(0)), desc(g, src(1)), stream_);
            return;
        }
        case Op::SCALE: cuda::launch_unary(0, desc(g, id), desc(g, src(0)), t.fparams[0], stream_); return;
        case Op::SILU: cuda::launch_unary(1, desc(g, id), desc(g, src(0)), 0.0f, stream_); return;
        case Op::SOFTMAX: cuda::launch_softmax(desc(g, id), desc(g, src(0)), t.fparams[0], stream_); return;
        case Op::ATTENTION:
            require(t.iparams[1] >= 0 && t.iparams[1] <= g[src(0)].ne[2], t, "prompt rows outside the rows");
            cuda::launch_attention(desc(g, id), desc(g, src(0)), desc(g, src(1)), desc(g, src(2)), desc(g, src(3)),
                                   reinterpret_cast<const int32_t*>(dptr(g, src(4))), t.iparams[0], t.fparams[0],
                                   t.iparams[1], scratch_, err_, stream_);
            return;
        case Op::ARGMAX: cuda::launch_argmax(desc(g, id), desc(g, src(0)), scratch_, stream_); return;
        case Op::TOP_K: cuda::launch_top_k(desc(g, id), desc(g, src(0)), scratch_, stream_); return;
        case Op::GATHER: cuda::launch_gather(desc(g, id), desc(g, src(0)), desc(g, src(1)), stream_); return;
        case Op::SAMPLE:
            cuda::launch_sample(desc(g, id), desc(g, src(0)), desc(g, src(1)), desc(g, src(2)), desc(g, src(3)),
                                stream_);
            return;
        case Op::SUM: cuda::launch_sum(desc(g, id), desc(g, src(0)), stream_); return;
        case Op::GUMBEL:
            cuda::launch_gumbel(desc(g, id), reinterpret_cast<const int32_t*>(dptr(g, src(0))),
                                reinterpret_cast<const int32_t*>(dptr(g, src(1))),
                                static_cast<uint32_t>(t.iparams[0]), stream_);
            return;
        default: require(false, t, "not implemented on the GPU");
    }
}

}  // namespace cuda_backend
}  // namespace pyspec
