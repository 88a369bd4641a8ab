// Set-up and route choice: which transport carries each peer, decided once,
// here, from every rank's published PeerInfo. The binding shuttles opaque
// blobs between ranks (one per rank per round, through the store) and feeds
// each round back to step().
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine.h"
#include "registry.h"

namespace varcomm {

// The route for `peer` as seen by `me`: the first registered host transport
// that connects, the last resort ("fallback") when no other does. Self stays
// in local memory whatever is forced for the other peers.
// Throws Error(Invalid) when options.transport forces one that cannot.
std::string choose_route(const PeerInfo& me, const PeerInfo& peer, const Options& o);

class Setup {
 public:
  explicit Setup(Engine& engine);
  // Rounds: 0 host keys; 1 PeerInfo (descriptors, layouts); 2 device
  // acknowledgements, which doubles as the barrier "every rank mapped its
  // peers" before connected() lets the segments go. begin() returns round
  // 0's blob; step(blobs of round k, one per rank) the next round's, or
  // nullopt when set-up is complete.
  std::string begin();
  std::optional<std::string> step(const std::vector<std::string>& blobs);
  bool done() const { return round_ > 2; }

  const std::vector<std::string>& routes() const { return routes_; }
  // Device-memory route per peer, "" when device tensors are staged through host memory.
  const std::vector<std::string>& device_routes() const { return device_routes_; }
  std::string describe(int peer) const;
  // describe() as data: "route", "device_route" ("" when staged), and the
  // route's own transport properties (rdma: provider, fabric, domain).
  std::map<std::string, std::string> route_info(int peer) const;
  // Some pair in the job (not only this rank's) is on the last resort, whose
  // mover (python/varcomm/fallback.py) every rank must then start.
  bool any_fallback() const { return any_fallback_; }
  // A peer reaches our region over the network (rdma): it may still write
  // into it after we are done, so close waits for it (or its death). Not for
  // the last resort: its mover's close ends the writes (see connect_peers).
  bool close_waits_for_peers() const { return close_waits_; }
  // This rank's endpoint of a registered transport, null when it is not open.
  std::shared_ptr<Transport> opened(const std::string& name) const {
    auto it = open_.find(name);
    return it == open_.end() ? nullptr : it->second;
  }
  // The GPU holding our device receive slots, -1 when no device transport is open.
  int device_ordinal() const { return device_ordinal_; }
  // After set-up: the MAC of a store record `name` that rank `rank` of this
  // communicator publishes (barrier arrivals, close's "left"), bound to the
  // job (so to this communicator), the rank and the name; "none" without a
  // job key. The store is open to anyone who reaches its port, so with a key
  // a record whose MAC differs was not written by that rank.
  std::string store_mac(int rank, const std::string& name) const;

 private:
  // Authentication (see routes.cpp): a record as published, with its MAC;
  // and a published record checked and stripped of it, for round `round`.
  std::string seal(const std::string& record, int round) const;
  std::string unseal(int rank, const std::string& sealed, int round) const;
  void derive_job(const std::vector<std::string>& round0);

  void open_transports();
  std::string connect_peers();
  void agree_device(const std::vector<std::string>& acks);

  Engine& e_;
  const Options& o_;
  int round_ = 0;
  std::string mine0_;  // our round-0 record, as begin() made it (step checks the store shows it)
  std::string job_;  // SHA-256 of every rank's round-0 record (which carries a fresh nonce): names this job
  std::vector<std::string> hosts_;
  PeerInfo me_;
  std::vector<PeerInfo> peers_;
  std::map<std::string, std::shared_ptr<Transport>> open_;  // by factory name
  // Device transports opened, by factory name, and why each one that is not
  // open is not (both shown by describe()).
  std::map<std::string, std::shared_ptr<Transport>> devices_;
  std::map<std::string, std::string> device_notes_;
  std::vector<std::pair<int, std::string>> device_ok_;  // peers whose device memory we opened, and with what
  std::vector<std::string> device_why_;                 // per peer without a device route: why not
  std::vector<std::string> routes_, device_routes_;
  std::string why_fallback_;
  bool any_fallback_ = false, close_waits_ = false;
  int device_ordinal_ = -1;
};

}  // namespace varcomm
