// Any-host transport over libfabric: one fi_writemsg with FI_REMOTE_CQ_DATA
// carries header + payload into the peer's slot; the receiver's progress()
// turns the 32-bit immediate (ready_off >> 8) into the slot's ready word.
// Compiled only when libfabric is found (VARCOMM_HAVE_RDMA); this header pulls
// in no libfabric headers so the rest of the build needs no extra flags.
#pragma once
#include <memory>
#include <string>

#include "transport.h"

namespace varcomm {

// provider: a libfabric provider spec ("tcp;ofi_rxm", "verbs;ofi_rxm", "efa",
// "cxi"); "" means $VARCOMM_FI_PROVIDER, else verbs/efa/cxi when present, else
// tcp;ofi_rxm. iface: the libfabric domain name (tcp: a network interface such
// as "eth0"; verbs: "mlx5_0"; efa: "rdmap0s6-rdm"); "" means $VARCOMM_FI_IFACE,
// else the first non-loopback IPv4 domain. Throws varcomm::Error (Invalid) when no
// provider fits.
std::unique_ptr<Transport> make_rdma_transport(int rank, int world, const std::string& provider,
                                               const std::string& iface);

// libfabric version and the RDM providers/domains it offers, one per line
// (for `varcomm doctor` and bug reports).
std::string rdma_info();

}  // namespace varcomm
