// The transport registry, NCCL canConnect style: each transport folder
// registers one TransportFactory from a static TransportRegistrar in its .cpp
// (every object is linked into the one extension, so static initialisation
// runs them). The core (routes.cpp) opens, chooses and connects through these
// factories only; it includes no transport header.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "options.h"
#include "protocol.h"
#include "region.h"
#include "transport.h"

namespace varcomm {

// What one rank publishes at set-up: where it runs, how its region is laid
// out, and one opaque descriptor per transport it opened.
struct PeerInfo {
  int rank = -1;
  std::string host;  // host_key(): equal iff two ranks can share memory
  Layout layout;
  std::string transport;  // its Options::transport: routes are chosen alike only when every rank has the same
  std::string a2a_algorithm;  // its Options::a2a_algorithm: an all-to-all pairs up only where every rank has the same
  std::map<std::string, std::string> desc;  // transport name -> Transport::expose() result

  bool has(const std::string& transport) const { return desc.count(transport) != 0; }
  std::string encode() const;
  static PeerInfo decode(const std::string& blob, int rank);
};

// What a factory may use to build this rank's transport.
struct TransportContext {
  int rank;
  int world;
  Region& region;
  const Layout& layout;
  const Options& options;
  bool any_remote;  // some rank runs on another host
  // The host transports opened so far, by name (a device transport that rides
  // on a host one, e.g. rdma-gpu on rdma, shares its endpoint).
  const std::map<std::string, std::shared_ptr<Transport>>* opened = nullptr;
};

struct TransportFactory {
  std::string name;
  bool device = false;          // carries device memory (a second route beside the host one)
  bool same_host_only = false;  // reaches only ranks that share this host's memory
  // Empty when `self` can reach `peer` with this transport, else why not
  // (a sentence that names the peer, e.g. "rank 3 is on another host").
  std::function<std::string(const PeerInfo& self, const PeerInfo& peer, const Options&)> can_connect;
  // Opens this rank's endpoint; throws Error(Invalid) with the reason when it cannot.
  std::function<std::shared_ptr<Transport>(const TransportContext&)> make;
  // Reaches every peer (can_connect is always empty) and is chosen only when no
  // other host transport connects: opened on every rank, ordered last.
  bool last_resort = false;
  // Device transports only: the host route whose pairs it serves ("rdma":
  // GPU tensors to peers reached over rdma); "" for pairs on a same-host route.
  std::string rides_on = "";
};

// Registered factories: host transports first (same-host, then any-host, then
// the last resort), then device ones, each group by name; the order of
// preference for auto routes.
const std::vector<TransportFactory>& transport_factories();
const TransportFactory* find_transport(const std::string& name);

struct TransportRegistrar {
  explicit TransportRegistrar(TransportFactory f);
};

// hostname + "/" + kernel boot id: equal on two ranks iff they can share
// memory (containers on one machine share the boot id but not the hostname).
std::string host_key();

}  // namespace varcomm
