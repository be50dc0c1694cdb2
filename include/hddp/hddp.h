// Umbrella header: the whole public API of hddp.
#pragma once

#include "hddp/amp/grad_scaler.h"
#include "hddp/checkpoint/checkpoint.h"
#include "hddp/comm/communicator.h"
#include "hddp/comm/rendezvous.h"
#include "hddp/comm/store.h"
#include "hddp/comm/work.h"
#include "hddp/core/autocast.h"
#include "hddp/core/env.h"
#include "hddp/core/error.h"
#include "hddp/core/logging.h"
#include "hddp/ddp/distributed_data_parallel.h"
#include "hddp/ddp/sync_batch_norm.h"
#include "hddp/version.h"
