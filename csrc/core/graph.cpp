#include "core/graph.h"

#include <stdexcept>

namespace pyspec {

const char* op_name(Op op) {
    switch (op) {
        case Op::NONE: return "NONE";
        case Op::VIEW: return "VIEW";
        case Op::CPY: return "CPY";
        case Op::GET_ROWS: return "GET_ROWS";
        case Op::MUL_MAT: return "MUL_MAT";
        case Op::RMS_NORM: return "RMS_NORM";
        case Op::ADD: return "ADD";
        case Op::MUL: return "MUL";
        case Op::SCALE: return "SCALE";
        case Op::ROPE: return "ROPE";
        case Op::SILU: return "SILU";
        case Op::SWIGLU: return "SWIGLU";
        case Op::SOFTMAX: return "SOFTMAX";
        case Op::ATTENTION: return "ATTENTION";
        case Op::SET_ROWS: return "SET_ROWS";
        case Op::ARGMAX: return "ARGMAX";
        case Op::TOP_K: return "TOP_K";
        case Op::SUM: return "SUM";
        case Op::GUMBEL: return "GUMBEL";
        case Op::GATHER: return "GATHER";
        case Op::SAMPLE: return "SAMPLE";
        default: return "?";
    }
}

std::array<size_t, kMaxDims> contiguous_strides(DType dtype, const Shape& ne) {
    std::array<size_t, kMaxDims> nb{};
    nb[0] = dtype_unit_bytes(dtype);
    nb[1] = dtype_row_bytes(dtype, ne[0]);
    nb[2] = nb[1] * static_cast<size_t>(ne[1]);
    nb[3] = nb[2] * static_cast<size_t>(ne[2]);
    return nb;
}

size_t Tensor::nbytes() const {
    for (int d = 0; d < kMaxDims; ++d) {
        if (ne[d] == 0) return 0;
    }
    size_t bytes = dtype_row_bytes(dtype, ne[0]);
    for (int d = 1; d < kMaxDims; ++d) bytes += static_cast<size_t>(ne[d] - 1) * nb[d];
    return bytes;
}

bool Tensor::is_contiguous() const {
    return nb == contiguous_strides(dtype, ne);
}

int Graph::push(Tensor t) {
    for (int s : t.src) {
        if (s >= size()) throw std::logic_error("graph: source refers to a later tensor");
    }
    tensors_.push_back(std::move(t));
    return size() - 1;
}

static void check_shape(DType dtype, const Shape& ne) {
    for (int64_t n : ne) {
        if (n < 0) throw std::invalid_argument("graph: negative dimension");
    }
    if (ne[0] % dtype_block_size(dtype) != 0) {
        throw std::invalid_argument(std::string("graph: row length not a multiple of the block size of ") +
                                    dtype_name(dtype));
    }
}

int Graph::input(DType dtype, Shape ne, const std::string& name) {
    check_shape(dtype, ne);
    Tensor t;
    t.dtype = dtype;
    t.ne = ne;
    t.nb = contiguous_strides(dtype, ne);
    t.flags = kInput;
    t.name = name;
    return push(std::move(t));
}

int Graph::external(DType dtype, Shape ne, void* data, const std::string& name) {
    check_shape(dtype, ne);
    return external_strided(dtype, ne, contiguous_strides(dtype, ne), data, name);
}

int Graph::external_strided(DType dtype, Shape ne, std::array<size_t, kMaxDims> nb, void* data,
                            const std::string& name) {
    Tensor t;
    t.dtype = dtype;
    t.ne = ne;
    t.nb = nb;
    t.flags = kExternal;
    t.data = data;
    t.name = name;
    return push(std::move(t));
}

int Graph::view(int src, Shape ne, std::array<size_t, kMaxDims> nb, size_t offset) {
    const Tensor& s = (*this)[src];
    Tensor t;
    t.dtype = s.dtype;
    t.op = Op::VIEW;
    t.ne = ne;
    t.nb = nb;
    t.src[0] = src;
    t.view_src = src;
    t.view_offset = offset;
    t.name = s.name + "(view)";
    if (offset + t.nbytes() > s.nbytes()) throw std::logic_error("graph: view exceeds its source");
    return push(std::move(t));
}

int Graph::reshape(int src, Shape ne) {
    const Tensor& s = (*this)[src];
    if (!s.is_contiguous()) throw std::logic_error("graph: reshape of a non-contiguous tensor");
    if (ne[0] * ne[1] * ne[2] * ne[3] != s.nelements()) throw std::logic_error("graph: reshape changes size");
    return view(src, ne, contiguous_strides(s.dtype, ne), 0);
}

int Graph::add_node(Op op, DType dtype, Shape ne, std::initializer_list<int> srcs, const std::string& name) {
    check_shape(dtype, ne);
    Tensor t;
    t.op = op;
    t.dtype = dtype;
    t.ne = ne;
    t.nb = contiguous_strides(dtype, ne);
    int i = 0;
    for (int s : srcs) {
        if (i == kMaxSrc) throw std::logic_error("graph: too many sources");
        t.src[static_cast<size_t>(i++)] = s;
    }
    t.name = name.empty() ? std::string(op_name(op)) : name;
    return push(std::move(t));
}

int Graph::root_of(int id) const {
    while ((*this)[id].view_src >= 0) id = (*this)[id].view_src;
    return id;
}

int Graph::cpy(int src, DType dtype) { return add_node(Op::CPY, dtype, (*this)[src].ne, {src}); }

int Graph::get_rows(int table, int ids) {
    const Tensor& t = (*this)[table];
    const Tensor& i = (*this)[ids];
    if (i.dtype != DType::I32) throw std::logic_error("get_rows: ids must be I32");
    return add_node(Op::GET_ROWS, DType::F32, {t.ne[0], i.ne[0], 1, 1}, {table, ids});
}

int Graph::mul_mat(int weight, int x, int64_t prompt_cols) {
    const Tensor& w = (*this)[weight];
    const Tensor& a = (*this)[x];
    if (w.ne[0] != a.ne[0]) throw std::logic_error("mul_mat: inner dimensions differ");
    if (a.dtype != DType::F32) throw std::logic_error("mul_mat: activations must be F32");
    if (prompt_cols < 0 || prompt_cols > a.ne[1] || (prompt_cols > 0 && (a.ne[2] != 1 || a.ne[3] != 1))) {
        throw std::logic_error("mul_mat: prompt columns outside the activations' columns");
    }
    const int id = add_node(Op::MUL_MAT, DType::F32, {w.ne[1], a.ne[1], a.ne[2], a.ne[3]}, {weight, x});
    (*this)[id].iparams[0] = static_cast<int32_t>(prompt_cols);
    return id;
}

int Graph::rms_norm(int x, int weight, float eps) {
    int id = weight >= 0 ? add_node(Op::RMS_NORM, DType::F32, (*this)[x].ne, {x, weight})
                         : add_node(Op::RMS_NORM, DType::F32, (*this)[x].ne, {x});
    (*this)[id].fparams[0] = eps;
    return id;
}

int Graph::add(int a, int b) { return add_node(Op::ADD, DType::F32, (*this)[a].ne, {a, b}); }
int Graph::mul(int a, int b) { return add_node(Op::MUL, DType::F32, (*this)[a].ne, {a, b}); }

int Graph::scale(int a, float s) {
    int id = add_node(Op::SCALE, DType::F32, (*this)[a].ne, {a});
    (*this)[id].fparams[0] = s;
    return id;
}

int Graph::rope(int x, int positions, int n_rot, int mode, float freq_base, float freq_scale, int freq_factors) {
    int id = freq_factors >= 0 ? add_node(Op::ROPE, DType::F32, (*this)[x].ne, {x, positions, freq_factors})
                               : add_node(Op::ROPE, DType::F32, (*this)[x].ne, {x, positions});
    Tensor& t = (*this)[id];
    t.iparams[0] = n_rot;
    t.iparams[1] = mode;
    t.fparams[0] = freq_base;
    t.fparams[1] = freq_scale;
    return id;
}

int Graph::silu(int a) { return add_node(Op::SILU, DType::F32, (*this)[a].ne, {a}); }
int Graph::swiglu(int gate, int up) { return add_node(Op::SWIGLU, DType::F32, (*this)[gate].ne, {gate, up}); }

int Graph::softmax(int a, float scale) {
    int id = add_node(Op::SOFTMAX, DType::F32, (*this)[a].ne, {a});
    (*this)[id].fparams[0] = scale;
    return id;
}

int Graph::attention(int q, int k_cache, int v_cache, int mask, int kv_base, int n_kv_head, float scale,
                     int64_t prompt_rows) {
    if (prompt_rows < 0 || prompt_rows > (*this)[q].ne[2]) {
        throw std::logic_error("attention: prompt rows outside the query rows");
    }
    int id = add_node(Op::ATTENTION, DType::F32, (*this)[q].ne, {q, k_cache, v_cache, mask, kv_base});
    Tensor& t = (*this)[id];
    t.iparams[0] = n_kv_head;
    t.iparams[1] = static_cast<int32_t>(prompt_rows);
    t.fparams[0] = scale;
    return id;
}

int Graph::set_rows(int dst, int rows, int ids) {
    const Tensor& d = (*this)[dst];
    Tensor t;
    t.op = Op::SET_ROWS;
    t.dtype = d.dtype;
    t.ne = d.ne;
    t.nb = d.nb;
    t.src = {dst, rows, ids, -1, -1};
    t.view_src = dst;
    t.name = d.name + "(set_rows)";
    return push(std::move(t));
}

int Graph::argmax(int a) { return add_node(Op::ARGMAX, DType::I32, {1, (*this)[a].ne[1], 1, 1}, {a}); }

int Graph::top_k(int a, int k) {
    if (k < 1 || k > (*this)[a].ne[0]) {
        throw std::invalid_argument("top_k: k = " + std::to_string(k) + " must be in [1, " +
                                    std::to_string((*this)[a].ne[0]) + "]");
    }
    int id = add_node(Op::TOP_K, DType::I32, {k, (*this)[a].ne[1], 1, 1}, {a});
    (*this)[id].iparams[0] = k;
    return id;
}

int Graph::gather(int a, int ids) {
    const Tensor& x = (*this)[a];
    const Tensor& i = (*this)[ids];
    if (x.dtype != DType::F32 || i.dtype != DType::I32 || i.ne[1] != x.ne[1] || i.ne[2] != 1 || i.ne[3] != 1 ||
        x.ne[2] != 1 || x.ne[3] != 1) {
        throw std::invalid_argument("gather: needs F32 rows [n, rows] and I32 ids [k, rows] of as many rows");
    }
    return add_node(Op::GATHER, DType::F32, {i.ne[0], x.ne[1], 1, 1}, {a, ids});
}

int Graph::sum(int a) { return add_node(Op::SUM, DType::F32, {1, 1, 1, 1}, {a}); }

int Graph::gumbel(int keys, int elements, int stream) {
    const Tensor& k = (*this)[keys];
    const Tensor& e = (*this)[elements];
    if (k.dtype != DType::I32 || k.ne[0] != 5 || !k.is_contiguous()) {
        throw std::invalid_argument("gumbel: keys must be contiguous I32 [5, rows]");
    }
    if (e.dtype != DType::I32 || e.nrows() != 1 || !e.is_contiguous()) {
        throw std::invalid_argument("gumbel: elements must be contiguous I32 [n]");
    }
    if (stream < 0) throw std::invalid_argument("gumbel: negative stream");
    const int id = add_node(Op::GUMBEL, DType::F32, {e.ne[0], k.nrows(), 1, 1}, {keys, elements});
    (*this)[id].iparams[0] = stream;
    return id;
}

int Graph::sample(int ids, int logits, int samplers, int bans) {
    const Tensor& i = (*this)[ids];
    const Tensor& v = (*this)[logits];
    const Tensor& p = (*this)[samplers];
    const Tensor& b = (*this)[bans];
    const auto rows_of = [&i](const Tensor& t, int64_t width) {
        return t.ne[0] == width && t.ne[1] == i.ne[1] && t.ne[2] == 1 && t.ne[3] == 1 && t.is_contiguous();
    };
    if (i.dtype != DType::I32 || v.dtype != DType::F32 || p.dtype != DType::I32 || b.dtype != DType::I32 ||
        !rows_of(i, i.ne[0]) || !rows_of(v, i.ne[0]) || !rows_of(p, kSamplerWords) || !rows_of(b, kSampleBans)) {
        throw std::invalid_argument("sample: needs contiguous I32 ids [k, rows], F32 logits [k, rows], I32 samplers [" +
                                    std::to_string(kSamplerWords) + ", rows] and I32 bans [" +
                                    std::to_string(kSampleBans) + ", rows]");
    }
    return add_node(Op::SAMPLE, DType::I32, {1, i.ne[1], 1, 1}, {ids, logits, samplers, bans});
}

int matmuls_sharing_activations(const Graph& g, int id, int* out, int max_parts) {
    const Tensor& t0 = g[id];
    const Tensor& w0 = g[t0.src[0]];
    int n = 0;
    for (int j = id; j < g.size() && n < max_parts; ++j) {
        const Tensor& t = g[j];
        if (t.op == Op::NONE || t.op == Op::VIEW) continue;
        if (t.op != Op::MUL_MAT || t.src[1] != t0.src[1] || t.iparams[0] != t0.iparams[0]) break;
        const Tensor& w = g[t.src[0]];
        if (w.dtype != w0.dtype || w.ne[0] != w0.ne[0]) break;
        out[n++] = j;
    }
    return n;
}

}  // namespace pyspec
