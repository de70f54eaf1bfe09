// Wall-clock phase timers of a speculative step (SpecEngine::PhaseTimes): internal to
// csrc/spec/spec_engine*.cpp.
#pragma once

#include <chrono>

namespace pyspec {

// Adds the wall time of its scope to a PhaseTimes field.
class PhaseClock {
public:
    explicit PhaseClock(double& into) : into_(into), t0_(std::chrono::steady_clock::now()) {}
    ~PhaseClock() { into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count(); }
    PhaseClock(const PhaseClock&) = delete;
    PhaseClock& operator=(const PhaseClock&) = delete;

private:
    double& into_;
    std::chrono::steady_clock::time_point t0_;
};

// Whatever a step's phases do not claim is "other"; counts the step.
template <typename Times>
struct OtherClock {
    Times& t;
    const Times& before;
    std::chrono::steady_clock::time_point t0;
    ~OtherClock() {
        const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        t.other_s += all - ((t.target_s - before.target_s) + (t.stage_s - before.stage_s) + (t.draft_s - before.draft_s));
        ++t.steps;
    }
};

}  // namespace pyspec
