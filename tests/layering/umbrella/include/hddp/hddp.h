#pragma once
#include "hddp/core/a.h"
