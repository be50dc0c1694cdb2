// A fixture: one tool including another tool's own file.
#include "a_own.h"
