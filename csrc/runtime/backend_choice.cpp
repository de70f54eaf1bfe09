#include "runtime/backend_choice.h"

#include <cctype>
#include <stdexcept>

#include "cpu/cpu_backend.h"
#include "cuda/cuda_backend.h"

namespace pyspec {

BackendChoice parse_backend(const std::string& name) {
    BackendChoice c;
    if (name == "cpu") return c;
    if (name == "cuda" || name == "gpu") {
        c.kind = BackendKind::Cuda;
        return c;
    }
    const std::string prefix = "cuda:";
    if (name.size() > prefix.size() && name.compare(0, prefix.size(), prefix) == 0) {
        const std::string num = name.substr(prefix.size());
        bool digits = num.size() <= 6;
        for (char ch : num) digits = digits && std::isdigit(static_cast<unsigned char>(ch));
        if (digits) {
            c.kind = BackendKind::Cuda;
            c.device = std::stoi(num);
            return c;
        }
    }
    throw std::invalid_argument("unknown backend '" + name + "' (expected \"cpu\", \"cuda\" or \"cuda:N\")");
}

std::string backend_string(const BackendChoice& c) {
    return c.kind == BackendKind::Cpu ? std::string("cpu") : "cuda:" + std::to_string(c.device);
}

std::unique_ptr<Backend> make_backend(const BackendChoice& c, int n_threads, bool poison, int n_seq_max) {
    if (c.kind == BackendKind::Cuda) {
        std::string why;
        if (!cuda_available(&why)) throw std::runtime_error("the CUDA backend cannot be used: " + why);
        return make_cuda_backend(c.device, n_seq_max);
    }
    auto cpu = std::make_unique<CpuBackend>(n_threads);
    cpu->set_poison(poison);
    return cpu;
}

}  // namespace pyspec
