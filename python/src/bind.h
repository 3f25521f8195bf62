// The parts of kiln._kiln, one function each, called from module.cpp.
#pragma once
#include <nanobind/nanobind.h>

namespace kiln::py {

namespace nb = nanobind;

void bind_errors(nb::module_& m);  // kiln.Error and its subclasses, and the translator
void bind_models(nb::module_& m);  // Layer, BluePrint, the DSL, the zoo
void bind_engine(nb::module_& m);  // Engine, StepStats
void bind_train(nb::module_& m);   // the trainer with the CLI's flags

}  // namespace kiln::py
