// Any-host transport over libfabric: one fi_writemsg with FI_REMOTE_CQ_DATA
// carries header + payload into the peer's slot; the receiver's progress()
// turns the 32-bit immediate (ready_off >> 8) into the slot's ready word.
// Compiled only when libfabric is found (VARCOMM_HAVE_RDMA); this header pulls
// in no libfabric headers so the rest of the build needs no extra flags.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "transport.h"

namespace varcomm {

// The transport itself registers as "rdma" (registry.h). Options:
// rdma_provider, a libfabric provider spec ("tcp;ofi_rxm", "verbs;ofi_rxm",
// "efa", "cxi"), "" for the first of rdma_default_providers() present;
// rdma_iface, the libfabric domain name (tcp: a network interface such as
// "eth0"; verbs: "mlx5_0"; efa: "rdmap0s6-rdm"), "" for the first
// non-loopback IPv4 domain.

// The providers tried, in order, when none is named.
std::vector<std::string> rdma_default_providers();

// libfabric version and the RDM providers/domains it offers, one per line,
// and which provider `provider`/`iface` would pick (for `varcomm doctor`).
std::string rdma_info(const std::string& provider, const std::string& iface);

}  // namespace varcomm
