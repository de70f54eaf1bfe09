// CUDA graph controls for tests and debugging (issue 8 item 2): the switch PYSPEC_CUDA_GRAPHS sets
// at start, and the capture / replay counters. In CPU-only builds they exist and do nothing.
#include <pybind11/pybind11.h>

#include <atomic>

#include "cuda/cuda_graphs.h"

namespace py = pybind11;

namespace pyspec {

#ifndef PYSPEC_WITH_CUDA
// Without the CUDA backend there is nothing to capture: the switch is remembered, the counters
// stay zero.
namespace {
std::atomic<bool> g_cpu_only_switch{true};
}
void set_cuda_graphs(bool on) { g_cpu_only_switch = on; }
bool cuda_graphs_enabled() { return false; }
CudaGraphStats cuda_graph_stats() { return CudaGraphStats{}; }
void reset_cuda_graph_stats() {}
#endif

void bind_cuda(py::module_& m) {
    m.def("set_cuda_graphs", &set_cuda_graphs, py::arg("on"),
          "Turns CUDA graph capture/replay of the CUDA backend on or off for every backend, from their "
          "next compute (overrides PYSPEC_CUDA_GRAPHS).");
    m.def("cuda_graphs_enabled", &cuda_graphs_enabled,
          "Whether the CUDA backend captures and replays graphs (False in CPU-only builds).");
    m.def(
        "cuda_graph_stats",
        []() {
            const CudaGraphStats s = cuda_graph_stats();
            py::dict d;
            d["captures"] = s.captures;
            d["replays"] = s.replays;
            d["eager"] = s.eager;
            d["capture_failures"] = s.capture_failures;
            d["evictions"] = s.evictions;
            d["live"] = s.live;
            d["early_weight_launches"] = s.early_weight_launches;
            d["rope_attention_launches"] = s.rope_attention_launches;
            d["early_copy_attention_launches"] = s.early_copy_attention_launches;
            d["stored_angles_attention_launches"] = s.stored_angles_attention_launches;
            d["row_tma_launches"] = s.row_tma_launches;
            d["norm_prologue_launches"] = s.norm_prologue_launches;
            d["early_norm_launches"] = s.early_norm_launches;
            d["deep_row_launches"] = s.deep_row_launches;
            d["piped_row_launches"] = s.piped_row_launches;
            d["one_block_row_launches"] = s.one_block_row_launches;
            d["room_row_launches"] = s.room_row_launches;
            d["batched_copy_launches"] = s.batched_copy_launches;
            d["timed_replays"] = s.timed_replays;
            d["replay_gpu_ns"] = s.replay_gpu_ns;
            return d;
        },
        "Counters over every CUDA backend of the process: captures, replays, eager computes, "
        "capture_failures, evictions, live (instantiated graphs held now), early_weight_launches "
        "(MUL_MAT launches that load weights before waiting for the kernel before them), "
        "rope_attention_launches (decode attention launches that ran the row's RoPE and K/V store too), "
        "early_copy_attention_launches (those that copied their first cache cells before the PDL wait), "
        "stored_angles_attention_launches (those that read the step's RoPE angles stored by its first one), "
        "row_tma_launches (one-column MUL_MAT launches of row groups fed by the copy engine), "
        "norm_prologue_launches (MUL_MAT group launches that ran the RMS_NORM before them), "
        "early_norm_launches (those that copied the norm's weights before the PDL wait), "
        "deep_row_launches (row-streaming launches on the deep grid, PYSPEC_CUDA_ROW_DEEP), "
        "piped_row_launches (those fed piped, PYSPEC_CUDA_ROW_PIPED), "
        "one_block_row_launches (of those, on one block a SM, PYSPEC_CUDA_ROW_PIPED_ONE_BLOCK), "
        "room_row_launches (row-streaming launches that left SMs free for the decode attention after them, "
        "PYSPEC_CUDA_ROW_ROOM), "
        "batched_copy_launches (small copies run as one launch, PYSPEC_CUDA_BATCH_COPIES), "
        "timed_replays and replay_gpu_ns (replays timed by events, PYSPEC_CUDA_STEP_TIMES=1).");
    m.def("reset_cuda_graph_stats", &reset_cuda_graph_stats, "Zeroes the counters (all but live).");
}

}  // namespace pyspec
