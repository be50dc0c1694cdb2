// A fixture: a tool including an example program's own file.
#include "b_helper.h"
