// Fixture of the layering check (never compiled): core includes a layer above it.
#include "hddp/train/trainer.h"
