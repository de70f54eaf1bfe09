// pyspec._core.DraftStateRegistry: request id -> drafter slot (csrc/spec/draft_state_registry.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "spec/draft_state_registry.h"

namespace py = pybind11;

namespace pyspec {

void bind_registry(py::module_& m) {
    py::class_<SlotGrant>(m, "SlotGrant", "What acquire/schedule did for one request.")
        .def_readonly("request_id", &SlotGrant::request_id)
        .def_readonly("slot", &SlotGrant::slot)
        .def_readonly("fresh", &SlotGrant::fresh, "newly assigned: clear the drafter sequence before staging")
        .def_readonly("restage", &SlotGrant::restage, "returning after an eviction: restage its committed context")
        .def_readonly("evicted", &SlotGrant::evicted, "the request this slot was reclaimed from, or None")
        .def("__repr__", [](const SlotGrant& g) {
            return "SlotGrant(request_id=" + std::to_string(g.request_id) + ", slot=" + std::to_string(g.slot) +
                   ", fresh=" + (g.fresh ? "True" : "False") + ", restage=" + (g.restage ? "True" : "False") +
                   ", evicted=" + (g.evicted ? std::to_string(*g.evicted) : std::string("None")) + ")";
        });

    py::class_<DraftStateRegistry>(m, "DraftStateRegistry",
                                   "Request id -> drafter slot for the request's lifetime; when no slot is free the "
                                   "least recently scheduled holder (ties: smallest id) is reclaimed and parked.")
        .def(py::init<int32_t>(), py::arg("n_slots"))
        .def("acquire", &DraftStateRegistry::acquire, py::arg("request_id"), py::arg("step"))
        .def("schedule", &DraftStateRegistry::schedule, py::arg("step"), py::arg("request_ids"),
             "One step's drafting requests in any order; grants in the same order.")
        .def("touch", &DraftStateRegistry::touch, py::arg("request_id"), py::arg("step"))
        .def("release", &DraftStateRegistry::release, py::arg("request_id"),
             "Drops the request; returns the slot it freed, -1 if none (unknown ids included).")
        .def("slot_of", &DraftStateRegistry::slot_of, py::arg("request_id"))
        .def("holder_of", &DraftStateRegistry::holder_of, py::arg("slot"))
        .def("last_step", &DraftStateRegistry::last_step, py::arg("request_id"))
        .def("parked", &DraftStateRegistry::parked)
        .def("size", &DraftStateRegistry::size)
        .def("__len__", &DraftStateRegistry::size)
        .def_property_readonly("n_held", &DraftStateRegistry::n_held)
        .def_property_readonly("n_slots", &DraftStateRegistry::n_slots);
}

}  // namespace pyspec
