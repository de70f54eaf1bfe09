// The allocation planner. Algorithm, in plain words:
//
// 1. Liveness. Owned tensors (non-view, non-external) get an interval [def, last] of node ids.
//    Inputs and other leaves are written before the graph runs, so their def is -1; a computed
//    tensor's def is its own id. last is the largest id of any consumer of the tensor or of any
//    view of it (views chain to their root; a view's creation counts as a use of its parent,
//    which keeps a SET_ROWS write ordered). Output and pinned tensors, and roots of output or
//    pinned views, live forever. An unconsumed tensor lives only at its def.
// 2. Placement, in execution order, over one arena of unbounded size: leaves first, then at each
//    node id t: place the tensor defined at t, then free every tensor whose last use is t. A
//    node is placed before its dying sources are freed, so it never shares bytes with them (no
//    in-place reuse: kernels may assume restrict pointers).
//    Free space is a list of holes sorted by offset, merged with their neighbours on free, plus
//    the unbounded tail above the highest used byte. A request takes the smallest hole that
//    fits (lowest offset on a tie), else the start of the tail, which grows the arena. This is
//    ggml's dynamic allocator without chunks; we chose it over greedy-by-size placement because
//    it is one linear pass with a short scan per tensor, easy to reason about, and it packs
//    activation chains well (a chain of equal tensors needs two slots).
// 3. Caching. A plan is a pure function of the graph's key (graph_plan_key) and the alignment;
//    the planner keeps the most recently used plans and compares full keys on a hash match.
#include "core/planner.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

namespace pyspec {
namespace {

constexpr int64_t kForever = std::numeric_limits<int64_t>::max();
constexpr uint8_t kPlanFlags = kInput | kOutput | kPinned | kExternal;

bool is_owned(const Tensor& t) { return !t.is_view() && !t.has(kExternal); }

struct Liveness {
    std::vector<int> root;         // per tensor: the tensor whose memory it lives in
    std::vector<int64_t> def;      // per owned tensor: -1 for leaves, else its id
    std::vector<int64_t> last;     // per owned tensor: last use, kForever for outputs/pinned
};

Liveness analyse(const Graph& g) {
    const int n = g.size();
    Liveness lv;
    lv.root.resize(static_cast<size_t>(n));
    lv.def.resize(static_cast<size_t>(n));
    lv.last.resize(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) {
        const Tensor& t = g[i];
        for (int s : t.src) {
            if (s >= i) throw std::logic_error("planner: tensor " + std::to_string(i) + " '" + t.name +
                                               "' has a source that is not an earlier tensor");
        }
        if (t.is_view() && t.view_src >= i) {
            throw std::logic_error("planner: view " + std::to_string(i) + " '" + t.name +
                                   "' views a tensor that is not an earlier tensor");
        }
        lv.root[i] = t.is_view() ? lv.root[t.view_src] : i;
        const bool leaf = t.op == Op::NONE || t.has(kInput);
        lv.def[i] = leaf ? -1 : i;
        lv.last[i] = lv.def[i];
    }
    // Sources come before their consumers, so a root never consumes itself through a view;
    // the check below still drops a self-edge should a builder ever produce one.
    auto use = [&lv](int src, int at) {
        const int r = lv.root[static_cast<size_t>(src)];
        if (r != at) lv.last[r] = std::max<int64_t>(lv.last[r], at);
    };
    for (int i = 0; i < n; ++i) {
        const Tensor& t = g[i];
        for (int s : t.src) {
            if (s >= 0) use(s, i);
        }
        if (t.is_view()) use(t.view_src, i);
    }
    // A node's sources stay live through the next computed node when a backend may run the two
    // as one launch: a MUL_MAT and the node consuming its product (the residual ADD after
    // wo/ffn_down, the SWIGLU after ffn_up: CUDA's epilogues store the consumer's output while
    // the matmul still reads its activations), and two nodes of the same row-wise op (q/k ROPE,
    // K/V SET_ROWS, q/k RMS_NORM: one launch runs both jobs). The second node's output must not
    // share bytes with what the first still reads; without this rule it often took the slot the
    // first node's dying sources had just freed, and the fusion had to be skipped.
    const auto next_computed = [&g, n](int i) {
        int j = i + 1;
        while (j < n && (g[j].op == Op::NONE || g[j].is_view())) ++j;
        return j;
    };
    for (int i = 0; i < n; ++i) {
        if (g[i].op == Op::NONE || g[i].is_view()) continue;
        const int j = next_computed(i);
        if (j >= n) continue;
        bool fusable = false;
        if (g[i].op == Op::MUL_MAT) {
            for (int s : g[j].src) fusable = fusable || (s >= 0 && lv.root[static_cast<size_t>(s)] == i);
        } else if (g[i].op == g[j].op) {
            fusable = g[i].op == Op::ROPE || g[i].op == Op::SET_ROWS || g[i].op == Op::RMS_NORM;
        }
        if (!fusable) continue;
        for (int s : g[i].src) {
            if (s >= 0) use(s, j);
        }
    }
    // A single-row ATTENTION over a ROPE's q and the K/V SET_ROWS before it: the CUDA backend runs
    // the q/k ROPEs (and q/k norms), the SET_ROWS and the ATTENTION as one launch of its decode attention
    // (cuda::DecodeRope), whose blocks still read the ROPEs' and SET_ROWS' sources and write the k
    // ROPE's output while others store the attention's output. So those sources and that output
    // stay live through the ATTENTION. Without this rule the attention's output took the bytes of
    // the k ROPE's output and of V (freed at the SET_ROWS; Qwen3's layers), and the launch had to be
    // skipped. Only single rows (a decode step), so batches keep their tighter arenas.
    const auto use_sources = [&](int node, int at) {
        for (int s : g[node].src) {
            if (s >= 0) use(s, at);
        }
    };
    for (int e = 0; e < n; ++e) {
        const Tensor& att = g[e];
        if (att.op != Op::ATTENTION || att.src[0] < 0 || g[att.src[0]].op != Op::ROPE || g[att.src[0]].ne[2] != 1) {
            continue;
        }
        // A ROPE's sources, and those of the per-head RMS_NORM before it (Qwen3's q/k norms, which
        // that launch runs too).
        const auto keep_rope = [&](int rope) {
            use_sources(rope, e);
            const int x = lv.root[static_cast<size_t>(g[rope].src[0])];
            if (g[x].op == Op::RMS_NORM) use_sources(x, e);
        };
        keep_rope(att.src[0]);
        for (int kv : {att.src[1], att.src[2]}) {
            if (kv < 0 || g[kv].op != Op::SET_ROWS) continue;
            use_sources(kv, e);
            const int rows = lv.root[static_cast<size_t>(g[kv].src[1])];  // the k ROPE, through its reshape
            if (g[rows].op == Op::ROPE) keep_rope(rows);
        }
    }
    // An RMS_NORM read by the MUL_MATs right after it (they share its output as activations: q/k/v,
    // gate/up, or one): the CUDA backend runs the norm as their launch's prologue at decode widths,
    // reading the norm's input while it stores the products, and the node consuming the products
    // (the residual ADD, the SWIGLU) as its epilogue. So the norm's sources stay live through the
    // last MUL_MAT and that node. Without the rule a norm input that died at the norm (the final
    // norm before the output head; a test graph's input) lent its bytes to the products, and the
    // prologue had to be skipped.
    for (int i = 0; i < n; ++i) {
        if (g[i].op != Op::RMS_NORM) continue;
        const int first = next_computed(i);
        if (first >= n || g[first].op != Op::MUL_MAT || g[first].src[1] != i) continue;
        int members[8];  // more than any backend groups
        const int n_members = matmuls_sharing_activations(g, first, members, 8);
        int through = members[n_members - 1];
        const int after = next_computed(through);
        if (after < n) {
            for (int s : g[after].src) {
                const int r = s >= 0 ? lv.root[static_cast<size_t>(s)] : -1;
                if (std::find(members, members + n_members, r) != members + n_members) through = after;
            }
        }
        use_sources(i, through);
    }
    for (int i = 0; i < n; ++i) {
        if (g[i].has(kOutput | kPinned)) lv.last[lv.root[i]] = kForever;
    }
    return lv;
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Free space of one arena: holes sorted by offset, none touching the tail, and the tail
// [top_, infinity). The arena's size is the highest top_ ever reached.
class FreeSpace {
public:
    size_t alloc(size_t size) {
        size_t best = holes_.size();
        for (size_t i = 0; i < holes_.size(); ++i) {
            if (holes_[i].size >= size && (best == holes_.size() || holes_[i].size < holes_[best].size)) best = i;
        }
        if (best < holes_.size()) {
            Hole& h = holes_[best];
            const size_t off = h.offset;
            h.offset += size;
            h.size -= size;
            if (h.size == 0) holes_.erase(holes_.begin() + static_cast<std::ptrdiff_t>(best));
            return off;
        }
        const size_t off = top_;
        top_ += size;
        high_ = std::max(high_, top_);
        return off;
    }

    void free(size_t offset, size_t size) {
        if (offset + size == top_) {
            top_ = offset;
            if (!holes_.empty() && holes_.back().offset + holes_.back().size == top_) {
                top_ = holes_.back().offset;
                holes_.pop_back();
            }
            return;
        }
        auto next = std::lower_bound(holes_.begin(), holes_.end(), offset,
                                     [](const Hole& h, size_t off) { return h.offset < off; });
        const bool joins_prev = next != holes_.begin() && std::prev(next)->offset + std::prev(next)->size == offset;
        const bool joins_next = next != holes_.end() && offset + size == next->offset;
        if (joins_prev && joins_next) {
            std::prev(next)->size += size + next->size;
            holes_.erase(next);
        } else if (joins_prev) {
            std::prev(next)->size += size;
        } else if (joins_next) {
            next->offset = offset;
            next->size += size;
        } else {
            holes_.insert(next, Hole{offset, size});
        }
    }

    size_t high_water() const { return high_; }

private:
    struct Hole {
        size_t offset;
        size_t size;
    };
    std::vector<Hole> holes_;
    size_t top_ = 0;
    size_t high_ = 0;
};

AllocationPlan plan_graph(const Graph& g, size_t alignment, uint64_t key_hash) {
    if (alignment == 0) throw std::invalid_argument("planner: alignment must be positive");
    const int n = g.size();
    const Liveness lv = analyse(g);
    AllocationPlan plan;
    plan.offset.assign(static_cast<size_t>(n), -1);
    plan.alignment = alignment;
    plan.key_hash = key_hash;

    std::vector<size_t> bytes(static_cast<size_t>(n), 0);
    // dying[t + 1]: owned tensors whose last use is t (t = -1 for unconsumed leaves).
    std::vector<std::vector<int>> dying(static_cast<size_t>(n) + 1);
    for (int i = 0; i < n; ++i) {
        if (!is_owned(g[i])) continue;
        bytes[i] = round_up(g[i].nbytes(), alignment);
        if (bytes[i] == 0) {
            plan.offset[i] = 0;  // needs no memory; any aligned offset is valid
            continue;
        }
        if (lv.last[i] != kForever) dying[static_cast<size_t>(lv.last[i] + 1)].push_back(i);
    }

    FreeSpace space;
    auto place = [&](int i) { plan.offset[i] = static_cast<int64_t>(space.alloc(bytes[i])); };
    auto release = [&](int64_t t) {
        for (int i : dying[static_cast<size_t>(t + 1)]) space.free(static_cast<size_t>(plan.offset[i]), bytes[i]);
    };
    for (int i = 0; i < n; ++i) {
        if (bytes[i] > 0 && lv.def[i] == -1) place(i);
    }
    release(-1);
    for (int t = 0; t < n; ++t) {
        if (bytes[t] > 0 && lv.def[t] == t) place(t);
        release(t);
    }
    plan.arena_bytes = space.high_water();
    return plan;
}

std::string describe(const Graph& g, int id) {
    return "tensor " + std::to_string(id) + " '" + g[id].name + "'";
}

std::string interval(int64_t def, int64_t last) {
    return "[" + std::to_string(def) + ", " + (last == kForever ? std::string("forever") : std::to_string(last)) + "]";
}

}  // namespace

std::vector<int64_t> graph_plan_key(const Graph& graph) {
    const auto& ts = graph.tensors();
    std::vector<int64_t> key;
    key.reserve(1 + ts.size() * 18);
    key.push_back(static_cast<int64_t>(ts.size()));
    for (const Tensor& t : ts) {
        key.push_back(static_cast<int64_t>(t.op));
        key.push_back(static_cast<int64_t>(t.dtype));
        for (int64_t n : t.ne) key.push_back(n);
        for (size_t b : t.nb) key.push_back(static_cast<int64_t>(b));
        for (int s : t.src) key.push_back(s);
        key.push_back(t.view_src);
        key.push_back(static_cast<int64_t>(t.view_offset));
        key.push_back(t.flags & kPlanFlags);
    }
    return key;
}

uint64_t hash_plan_key(const std::vector<int64_t>& key) {
    // splitmix64's finaliser over a running state: cheap, and every bit of every word matters.
    uint64_t h = 0x243f6a8885a308d3ull;
    for (int64_t v : key) {
        h ^= static_cast<uint64_t>(v) + 0x9e3779b97f4a7c15ull;
        h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
        h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
        h ^= h >> 31;
    }
    return h;
}

AllocationPlan make_plan(const Graph& graph, size_t alignment) {
    return plan_graph(graph, alignment, hash_plan_key(graph_plan_key(graph)));
}

void check_plan(const Graph& g, const AllocationPlan& plan) {
    const int n = g.size();
    if (plan.offset.size() != static_cast<size_t>(n)) {
        throw std::logic_error("check_plan: plan has " + std::to_string(plan.offset.size()) +
                               " offsets for a graph of " + std::to_string(n) + " tensors");
    }
    if (plan.alignment == 0) throw std::logic_error("check_plan: plan alignment is 0");
    const Liveness lv = analyse(g);

    struct Placed {
        int id;
        size_t begin, end;
    };
    std::vector<Placed> placed;
    std::vector<size_t> in_root(static_cast<size_t>(n), 0);  // a view's byte offset inside its root
    for (int i = 0; i < n; ++i) {
        const Tensor& t = g[i];
        const int64_t off = plan.offset[i];
        if (!is_owned(t)) {
            if (off != -1) {
                throw std::logic_error("check_plan: " + describe(g, i) +
                                       " is a view or external but the plan gives it offset " + std::to_string(off));
            }
            if (t.is_view()) {
                in_root[i] = in_root[t.view_src] + t.view_offset;
                const int r = lv.root[i];
                if (in_root[i] + t.nbytes() > g[r].nbytes()) {
                    throw std::logic_error("check_plan: view " + describe(g, i) + " spans bytes [" +
                                           std::to_string(in_root[i]) + ", " + std::to_string(in_root[i] + t.nbytes()) +
                                           ") outside its root " + describe(g, r) + " of " +
                                           std::to_string(g[r].nbytes()) + " bytes");
                }
            }
            continue;
        }
        if (off < 0) throw std::logic_error("check_plan: owned " + describe(g, i) + " has no offset");
        const size_t begin = static_cast<size_t>(off);
        const size_t end = begin + t.nbytes();
        if (begin % plan.alignment != 0) {
            throw std::logic_error("check_plan: " + describe(g, i) + " offset " + std::to_string(begin) +
                                   " is not a multiple of " + std::to_string(plan.alignment));
        }
        if (end > plan.arena_bytes) {
            throw std::logic_error("check_plan: " + describe(g, i) + " bytes [" + std::to_string(begin) + ", " +
                                   std::to_string(end) + ") exceed the arena of " + std::to_string(plan.arena_bytes));
        }
        if (end > begin) placed.push_back({i, begin, end});
    }

    // Sweep over time: tensors enter in def order and leave once their last use is behind.
    // Live byte ranges are pairwise disjoint until the first violation, so a newcomer only
    // needs comparing with its neighbours by offset.
    std::stable_sort(placed.begin(), placed.end(),
                     [&lv](const Placed& a, const Placed& b) { return lv.def[a.id] < lv.def[b.id]; });
    std::map<size_t, size_t> live;  // begin -> index in placed
    using Leaving = std::pair<int64_t, size_t>;  // (last, index in placed)
    std::priority_queue<Leaving, std::vector<Leaving>, std::greater<Leaving>> leaving;
    auto fail = [&](const Placed& a, const Placed& b) {
        throw std::logic_error("check_plan: " + describe(g, a.id) + " (bytes [" + std::to_string(a.begin) + ", " +
                               std::to_string(a.end) + "), live " + interval(lv.def[a.id], lv.last[a.id]) +
                               ") overlaps " + describe(g, b.id) + " (bytes [" + std::to_string(b.begin) + ", " +
                               std::to_string(b.end) + "), live " + interval(lv.def[b.id], lv.last[b.id]) +
                               ") while both are live");
    };
    for (size_t k = 0; k < placed.size(); ++k) {
        const Placed& p = placed[k];
        const int64_t def = lv.def[p.id];
        while (!leaving.empty() && leaving.top().first < def) {
            live.erase(placed[leaving.top().second].begin);
            leaving.pop();
        }
        auto next = live.lower_bound(p.begin);
        if (next != live.end() && next->first < p.end) fail(placed[next->second], p);
        if (next != live.begin() && placed[std::prev(next)->second].end > p.begin) fail(placed[std::prev(next)->second], p);
        live.emplace(p.begin, k);
        leaving.emplace(lv.last[p.id], k);
    }
}

AllocationPlanner::AllocationPlanner(size_t cache_capacity, size_t alignment)
    : capacity_(cache_capacity), alignment_(alignment) {
    if (alignment == 0) throw std::invalid_argument("AllocationPlanner: alignment must be positive");
}

std::shared_ptr<const AllocationPlan> AllocationPlanner::plan(const Graph& graph) {
    std::vector<int64_t> key = graph_plan_key(graph);
    const uint64_t hash = hash_plan_key(key);
    std::shared_ptr<const AllocationPlan> result;
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
        if (it->plan->key_hash == hash && it->key == key) {
            cache_.splice(cache_.begin(), cache_, it);
            ++cache_hits_;
            result = cache_.front().plan;
            break;
        }
    }
    if (!result) {
        result = std::make_shared<const AllocationPlan>(plan_graph(graph, alignment_, hash));
        ++plans_built_;
        if (capacity_ > 0) {
            cache_.push_front(Entry{std::move(key), result});
            if (cache_.size() > capacity_) cache_.pop_back();
        }
    }
    if (checking_) check_plan(graph, *result);
    return result;
}

void assign_addresses(Graph& graph, const AllocationPlan& plan, char* arena) {
    for (int i = 0; i < graph.size(); ++i) {
        Tensor& t = graph[i];
        if (t.has(kExternal)) continue;
        if (t.is_view()) {
            t.data = static_cast<char*>(graph[t.view_src].data) + t.view_offset;
        } else {
            if (plan.offset[static_cast<size_t>(i)] < 0) throw std::logic_error("apply_plan: tensor without memory: " + t.name);
            t.data = arena + plan.offset[static_cast<size_t>(i)];
        }
    }
}

}  // namespace pyspec
