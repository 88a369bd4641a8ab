#include "registry.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "errors.h"

namespace varcomm {
namespace {

std::vector<TransportFactory>& registry() {
  static std::vector<TransportFactory> r;  // constructed on first registration, whatever the link order
  return r;
}

int rank_of(const TransportFactory& f) { return f.device ? 3 : f.same_host_only ? 0 : f.last_resort ? 2 : 1; }

// Length-prefixed fields: descriptors are opaque bytes.
void put(std::string& out, const std::string& v) {
  out += std::to_string(v.size());
  out += ':';
  out += v;
}

std::string take(const std::string& in, size_t& at, int rank) {
  size_t colon = in.find(':', at);
  if (colon == std::string::npos)
    throw Error(ErrorKind::Invalid, "bad set-up record from rank " + std::to_string(rank) +
                                        " (does every rank run the same varcomm version?)");
  size_t n = std::stoull(in.substr(at, colon - at));
  if (colon + 1 + n > in.size()) throw Error(ErrorKind::Invalid, "truncated set-up record from rank " + std::to_string(rank));
  at = colon + 1 + n;
  return in.substr(colon + 1, n);
}

}  // namespace

TransportRegistrar::TransportRegistrar(TransportFactory f) {
  auto& r = registry();
  r.push_back(std::move(f));
  std::stable_sort(r.begin(), r.end(), [](const TransportFactory& a, const TransportFactory& b) {
    return rank_of(a) != rank_of(b) ? rank_of(a) < rank_of(b) : a.name < b.name;
  });
}

const std::vector<TransportFactory>& transport_factories() { return registry(); }

const TransportFactory* find_transport(const std::string& name) {
  for (auto& f : registry())
    if (f.name == name) return &f;
  return nullptr;
}

std::string PeerInfo::encode() const {
  std::string out = "varcomm-peer3 ";
  put(out, host);
  put(out, std::to_string(layout.world));
  put(out, std::to_string(layout.nslots));
  put(out, std::to_string(layout.bound));
  put(out, std::to_string(layout.landing));
  put(out, transport);
  put(out, a2a_algorithm);
  put(out, std::to_string(desc.size()));
  for (auto& kv : desc) {
    put(out, kv.first);
    put(out, kv.second);
  }
  return out;
}

PeerInfo PeerInfo::decode(const std::string& blob, int rank) {
  static const std::string magic = "varcomm-peer3 ";
  if (blob.compare(0, magic.size(), magic) != 0)
    throw Error(ErrorKind::Invalid, "rank " + std::to_string(rank) + " runs another varcomm version (set-up record)");
  PeerInfo p;
  p.rank = rank;
  size_t at = magic.size();
  try {
    p.host = take(blob, at, rank);
    p.layout.world = std::stoi(take(blob, at, rank));
    p.layout.nslots = std::stoi(take(blob, at, rank));
    p.layout.bound = std::stoull(take(blob, at, rank));
    p.layout.landing = std::stoull(take(blob, at, rank));
    p.transport = take(blob, at, rank);
    p.a2a_algorithm = take(blob, at, rank);
    size_t n = std::stoull(take(blob, at, rank));
    for (size_t i = 0; i < n; ++i) {
      std::string k = take(blob, at, rank);
      p.desc[k] = take(blob, at, rank);
    }
  } catch (const std::logic_error&) {  // stoi/stoull on a field that is no number
    throw Error(ErrorKind::Invalid, "bad set-up record from rank " + std::to_string(rank) +
                                        " (does every rank run the same varcomm version?)");
  }
  return p;
}

std::string host_key() {
  char name[256] = {0};
  gethostname(name, sizeof name - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  while (!boot.empty() && (boot.back() == '\n' || boot.back() == ' ')) boot.pop_back();
  return std::string(name) + "/" + boot;
}

}  // namespace varcomm
