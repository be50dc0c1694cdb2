// A fixture: a tool reaching into an example by a relative path.
#include "../../examples/b/b_helper.h"
