// Same-host transport over host memory: peers map each other's regions and a
// write is a memcpy followed by a release store of the ready word.
#pragma once
#include <memory>

#include "region.h"
#include "transport.h"

namespace varcomm {

std::shared_ptr<Transport> make_shm_transport(Region& local);

}  // namespace varcomm
