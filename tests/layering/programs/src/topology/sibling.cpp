// A fixture: topology may use core only, not its sibling checkpoint.
#include "hddp/checkpoint/checkpoint.h"
