// kiln._kiln: the compiled half of the kiln package; python/kiln/__init__.py is the other.
#include "bind.h"

NB_MODULE(_kiln, m) {
  m.doc() = "kiln's C++ core: models, the compiled training step, the trainer";
  kiln::py::bind_errors(m);
  kiln::py::bind_models(m);
  kiln::py::bind_engine(m);
  kiln::py::bind_train(m);
}
