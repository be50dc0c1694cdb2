// Fixture of the layering check (never compiled): ddp reaches into comm's private header.
#include "comm/work_impl.h"
