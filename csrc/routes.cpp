#include "routes.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "auth.h"
#include "errors.h"

namespace varcomm {
namespace {

[[noreturn]] void invalid(const std::string& msg) { throw Error(ErrorKind::Invalid, msg); }

std::string built_names() {
  std::vector<std::string> names;
  for (auto& f : transport_factories()) names.push_back(f.name);
  std::sort(names.begin(), names.end());
  std::string s = "[";
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", '" : "'") + names[i] + "'";
  return s + "]";
}

// Authentication. Every set-up record a rank publishes in the store ends in
// a MAC: HMAC-SHA256 under the job key (Options::job_key) over the record, the
// round, the publishing rank, the world size and (from round 1 on) the job,
// i.e. the hash of every rank's round-0 record, each of which carries a fresh
// random nonce: a record cannot be moved to another rank, round or job. A
// record whose MAC does not verify is refused, so with a key a process outside
// the job cannot plant a descriptor. Without a key the MAC is "none" and the
// job trusts whatever reaches its store, as NCCL and gloo do (README,
// "Semantics and errors"); the checks that need no secret (shm: the peer's
// uid and start time, its region's control block and size) still apply.
//
// Pair tags. Every message header carries auth = the first 8 bytes of
// HMAC(key, "pair" | job | src | dst); the receiver discards an arrival whose
// tag differs (Engine::progress_recvs). With a key, nobody outside the job
// can compute a valid tag, so a forged one-sided write (rdma) is never
// delivered; the tag is fixed per pair and sent in clear, so this does not
// hold against someone who can read the job's traffic and copy it. Without a key the tag is derived from the public nonces: it
// catches stray writes from another job or a stale peer, not an attacker.
const std::string kMacMark = "\nvarcomm-mac ";

std::string context(const char* what, int round, int rank, int world, const std::string& job) {
  std::string c = std::string("varcomm-") + what + "1";
  for (const std::string& part : {std::to_string(round), std::to_string(rank), std::to_string(world), job}) {
    c += '\0';
    c += part;
  }
  return c + '\0';
}

uint64_t pair_tag(const std::string& key, const std::string& job, int src, int dst) {
  std::string mac = hmac_sha256(key, context("pair", 0, src, dst, job));
  uint64_t t = 0;
  std::memcpy(&t, mac.data(), sizeof t);
  return t;
}

// Confidentiality. With a key, the records of rounds 1 and 2 (descriptors:
// rdma endpoints, region addresses and keys; shm pids and fds) are encrypted
// before the MAC is taken (encrypt-then-MAC): the store is readable by anyone
// who reaches it, and an rdma region key read there let an outsider rewrite
// the payload of a genuine message waiting in a slot (its header, and so its
// pair tag, untouched), forge credits, or write into the landing area. The
// keystream is HMAC(key, "pad" | round | rank | world | job | block counter):
// unique per record, since the job holds every rank's fresh nonce.
std::string keystream_xor(const std::string& key, int round, int rank, int world, const std::string& job,
                          const std::string& in) {
  std::string out = in, ctx = context("pad", round, rank, world, job);
  for (size_t at = 0, block = 0; at < in.size(); at += 32, ++block) {
    std::string pad = hmac_sha256(key, ctx + std::to_string(block));
    for (size_t i = 0; i < 32 && at + i < in.size(); ++i) out[at + i] = char(in[at + i] ^ pad[i]);
  }
  return out;
}

const char* const kKeyHint =
    "set the same VARCOMM_JOB_KEY on every rank (varcomm-run does it for you; with torchrun, mpirun or srun "
    "export VARCOMM_JOB_KEY=$(openssl rand -hex 16) before launching: see the README, \"Semantics and errors\")";

}  // namespace

std::string choose_route(const PeerInfo& me, const PeerInfo& peer, const Options& o) {
  const std::string& forced = o.transport;
  if (forced != "auto") {
    const TransportFactory* f = find_transport(forced);
    if (!f || f->device) invalid("transport '" + forced + "' is not built into this varcomm (built: " + built_names() +
                                 "); see `varcomm-doctor`");
    // Self-sends stay in local memory whatever carries the other peers.
    if (peer.rank != me.rank || f->same_host_only) {
      std::string why = f->can_connect(me, peer, o);
      if (!why.empty()) invalid("transport='" + forced + "' but " + why);
      return f->name;
    }
  }
  // The last resort is registered after every other host transport and
  // connects to anyone, so it is chosen exactly when nothing else connects.
  for (auto& f : transport_factories())
    if (!f.device && f.can_connect(me, peer, o).empty()) return f.name;
  invalid("no transport reaches rank " + std::to_string(peer.rank) + " (built: " + built_names() + ")");
}

Setup::Setup(Engine& engine) : e_(engine), o_(engine.options()) {}

std::string Setup::begin() {
  const std::string& t = o_.transport;
  if (t != "auto" && !find_transport(t))
    invalid("transport '" + t + "' is not built into this varcomm (built: " + built_names() + "); see `varcomm-doctor`");
  round_ = 0;
  job_.clear();
  // The nonce makes this job's round-0 records, hence job_, unlike any other's.
  mine0_ = seal(host_key() + "\n" + to_hex(random_bytes(16)), 0);
  return mine0_;
}

std::string Setup::seal(const std::string& plain, int round) const {
  const std::string& key = o_.job_key;
  // Round 0 (host key and nonce) stays readable: the job, hence the pad, is
  // derived from it.
  std::string record =
      key.empty() || round == 0 ? plain : keystream_xor(key, round, e_.rank(), e_.world(), job_, plain);
  std::string mac =
      key.empty() ? "none" : to_hex(hmac_sha256(key, context("setup", round, e_.rank(), e_.world(), job_) + record));
  return record + kMacMark + mac;
}

std::string Setup::unseal(int r, const std::string& sealed, int round) const {
  size_t at = sealed.rfind(kMacMark);
  std::string who = "rank " + std::to_string(r) + "'s set-up record";
  if (at == std::string::npos)
    invalid("bad set-up record from rank " + std::to_string(r) + " (does every rank run the same varcomm version?)");
  std::string record = sealed.substr(0, at), mac = sealed.substr(at + kMacMark.size());
  const std::string& key = o_.job_key;
  if (key.empty()) {
    if (mac != "none")
      invalid("rank " + std::to_string(r) + " was started with a job key (VARCOMM_JOB_KEY) and rank " +
              std::to_string(e_.rank()) + " without one: " + kKeyHint);
    return record;
  }
  if (mac == "none")
    invalid(who + " is not authenticated, but this rank has a job key (VARCOMM_JOB_KEY): rank " + std::to_string(r) +
            " was started without it, or a process outside the job wrote that record into the store; " + kKeyHint);
  if (!same_secret(mac, to_hex(hmac_sha256(key, context("setup", round, r, e_.world(), job_) + record))))
    invalid(who + " fails authentication with this rank's job key: rank " + std::to_string(r) +
            " has another VARCOMM_JOB_KEY, or a process outside the job forged the record in the store; refused; " +
            kKeyHint);
  return round == 0 ? record : keystream_xor(key, round, r, e_.world(), job_, record);
}

std::string Setup::store_mac(int rank, const std::string& name) const {
  const std::string& key = o_.job_key;
  return key.empty() ? "none" : to_hex(hmac_sha256(key, context("store", 0, rank, e_.world(), job_) + name));
}

void Setup::derive_job(const std::vector<std::string>& round0) {
  std::string all;
  for (const std::string& b : round0) all += std::to_string(b.size()) + ":" + b;
  job_ = sha256(all);
  const std::string& key = o_.job_key;
  for (int r = 0; r < e_.world(); ++r)
    e_.set_pair_tags(r, pair_tag(key, job_, e_.rank(), r), pair_tag(key, job_, r, e_.rank()));
}

std::optional<std::string> Setup::step(const std::vector<std::string>& sealed) {
  if (int(sealed.size()) != e_.world())
    invalid("set-up round " + std::to_string(round_) + ": " + std::to_string(sealed.size()) + " records for " +
            std::to_string(e_.world()) + " ranks");
  std::vector<std::string> blobs;
  for (int r = 0; r < e_.world(); ++r) blobs.push_back(unseal(r, sealed[size_t(r)], round_));
  switch (round_++) {
    case 0:
      // Round-0 records carry no job (there is none yet), so an old job's can
      // be put back in the store: a rank that finds any record but its own
      // fresh one there would derive an old job, hence an old keystream (a
      // two-time pad) and old pair tags. With ours in it, the job is new.
      if (sealed[size_t(e_.rank())] != mine0_)
        invalid("rank " + std::to_string(e_.rank()) + "'s own set-up record of round 0 is not what it published: "
                "another process wrote it into the store (two jobs sharing a store and prefix, or a replay); "
                "refused");
      hosts_.clear();
      for (const std::string& b : blobs) hosts_.push_back(b.substr(0, b.rfind('\n')));
      derive_job(sealed);
      open_transports();
      return seal(me_.encode(), 1);
    case 1:
      peers_.clear();
      for (int r = 0; r < e_.world(); ++r) {
        peers_.push_back(PeerInfo::decode(blobs[size_t(r)], r));
        // Each rank chooses its routes alone: only the same rule everywhere
        // gives both ends of a pair the same route (and every rank the same
        // answer to whether the fallback's group is needed).
        const PeerInfo& p = peers_.back();
        if (p.transport != o_.transport)
          invalid("rank " + std::to_string(r) + " was started with transport='" + p.transport + "' but rank " +
                  std::to_string(e_.rank()) + " with transport='" + o_.transport +
                  "': every rank must pass the same transport= (VARCOMM_TRANSPORT)");
        // A one-phase rank takes a two-phase rank's descriptors for chunks
        // (and the reverse): every all-to-all would fail, and leave the two
        // out of step for good.
        auto two_phase = [](const std::string& a) { return a == "two-phase"; };
        if (two_phase(p.a2a_algorithm) != two_phase(o_.a2a_algorithm))
          invalid("rank " + std::to_string(r) + " was started with a2a_algorithm='" + p.a2a_algorithm +
                  "' but rank " + std::to_string(e_.rank()) + " with a2a_algorithm='" + o_.a2a_algorithm +
                  "': every rank must pass the same a2a_algorithm= (VARCOMM_A2A_ALGORITHM)");
      }
      return seal(connect_peers(), 2);
    case 2:
      agree_device(blobs);
      return std::nullopt;
    default:
      invalid("set-up is already complete");
  }
}

void Setup::open_transports() {
  const int rank = e_.rank();
  me_.rank = rank;
  me_.host = hosts_[size_t(rank)];
  me_.layout = e_.layout();
  me_.transport = o_.transport;
  me_.a2a_algorithm = o_.a2a_algorithm;
  bool any_remote = std::any_of(hosts_.begin(), hosts_.end(), [&](const std::string& h) { return h != me_.host; });
  const std::string& forced = o_.transport;
  const TransportFactory* forced_f = find_transport(forced);
  why_fallback_ = forced_f && forced_f->last_resort ? "VARCOMM_TRANSPORT=" + forced
                                                    : "no varcomm transport reaches this peer";
  TransportContext ctx{rank, e_.world(), e_.region(), e_.layout(), o_, any_remote};
  auto open = [&](const TransportFactory& f) {
    auto t = f.make(ctx);
    me_.desc[f.name] = t->expose(e_.region().base(), e_.region().size());
    return t;
  };
  // Network endpoints are opened only when some peer needs one (or forced);
  // same-host ones always (the route to self), the last resort always (it
  // holds nothing until a route uses it, and any pair may need it).
  for (auto& f : transport_factories()) {
    if (f.device || !(f.same_host_only || f.last_resort || f.name == forced || (forced == "auto" && any_remote)))
      continue;
    try {
      open_[f.name] = open(f);
    } catch (const Error& err) {
      if (f.same_host_only || f.last_resort || f.name == forced) throw;
      why_fallback_ = f.name + " unavailable: " + err.what();
    }
  }
  ctx.opened = &open_;
  // Every device transport (nvlink for same-host pairs, rdma-gpu for pairs on
  // rdma) opens when this process uses CUDA; each pair then takes the one that
  // serves its host route.
  bool any_dev = false;
  for (auto& f : transport_factories()) {
    if (!f.device) continue;
    any_dev = true;
    if (o_.nvlink == "off") {
      device_notes_[f.name] = "off (VARCOMM_NVLINK=0)";
    } else if (o_.cuda_device < 0) {
      device_notes_[f.name] = "this process had not used CUDA at varcomm.init (call torch.cuda.set_device first, or "
                              "set VARCOMM_NVLINK=1)";
    } else if (!f.rides_on.empty() && !open_.count(f.rides_on)) {
      device_notes_[f.name] = "no " + f.rides_on + " endpoint on this rank";
    } else {
      try {
        devices_[f.name] = open(f);
        device_ordinal_ = o_.cuda_device;
      } catch (const Error& err) {
        if (o_.nvlink != "auto" || err.forced) throw;
        device_notes_[f.name] = err.what();
      }
    }
  }
  if (!any_dev) device_notes_[""] = "built without CUDA support";
}

std::string Setup::connect_peers() {
  const int world = e_.world();
  routes_.assign(size_t(world), "");
  device_routes_.assign(size_t(world), "");
  for (int r = 0; r < world; ++r) {
    const PeerInfo& p = peers_[size_t(r)];
    std::string route = choose_route(me_, p, o_);
    routes_[size_t(r)] = route;
    auto& t = open_.at(route);
    if (!p.has(route))
      invalid("rank " + std::to_string(r) + " published no " + route + " endpoint, which this rank chose to reach it; "
              "it may have failed to open one (see its varcomm-doctor)");
    t->connect(r, p.desc.at(route));
    e_.set_transport(r, t, p.layout);
    // A network peer may still write into our registered region after we are
    // done. The last resort's writes into our region are made by our own mover
    // threads, which its close() ends (a goodbye each peer answers) and which
    // keep the region alive while they run: nothing to wait for here.
    const TransportFactory* f = find_transport(route);
    if (!f->same_host_only && !f->last_resort) close_waits_ = true;
  }
  // The mover's gloo group is built by every rank (a collective), so it exists
  // as soon as any pair in the job uses the last resort.
  for (int i = 0; i < world && !any_fallback_; ++i)
    for (int j = i + 1; j < world && !any_fallback_; ++j)
      any_fallback_ = find_transport(choose_route(peers_[size_t(i)], peers_[size_t(j)], o_))->last_resort;
  std::string acks;
  device_why_.assign(size_t(world), "");
  for (int r = 0; r < world; ++r) {
    const std::string& host_route = routes_[size_t(r)];
    const bool same_host = find_transport(host_route)->same_host_only;
    const TransportFactory* f = nullptr;
    for (auto& g : transport_factories())
      if (g.device && (g.rides_on.empty() ? same_host : g.rides_on == host_route)) f = f ? f : &g;
    if (!f) {
      device_why_[size_t(r)] = device_notes_.count("") ? device_notes_[""] : "no GPU transport serves " + host_route;
      continue;
    }
    auto d = devices_.find(f->name);
    if (d == devices_.end()) {
      device_why_[size_t(r)] = "no " + f->name + " (" + device_notes_[f->name] + ")";
      continue;
    }
    std::string why = f->can_connect(me_, peers_[size_t(r)], o_);
    if (!why.empty()) {
      device_why_[size_t(r)] = "no " + f->name + " (" + why + ")";
      continue;
    }
    try {
      d->second->connect(r, peers_[size_t(r)].desc.at(f->name));
      device_ok_.push_back({r, f->name});
      acks += std::to_string(r) + ",";
    } catch (const Error& err) {
      device_why_[size_t(r)] = "no " + f->name + " (rank " + std::to_string(r) + ": " + err.what() + ")";
    }
  }
  return "acks:" + acks;
}

void Setup::agree_device(const std::vector<std::string>& acks) {
  // Every rank has mapped its peers' regions (it sent this round's record
  // after connecting): the segments can be let go.
  e_.connected();
  const std::string me = std::to_string(e_.rank());
  for (auto& [r, name] : device_ok_) {
    std::istringstream in(acks[size_t(r)].substr(acks[size_t(r)].find(':') + 1));
    bool both = false;
    for (std::string x; std::getline(in, x, ',');) both |= x == me;
    if (!both) {  // a pair uses device memory only if both sides could open the other's
      device_why_[size_t(r)] = "no " + name + " (rank " + std::to_string(r) + " could not open this rank's)";
      continue;
    }
    e_.set_device_transport(r, devices_.at(name));
    device_routes_[size_t(r)] = name;
    // The peer's copies write our GPU slots through its mapping of them: freed
    // under a copy still queued on its stream, a GPU faults or lands the data
    // in another allocation. close() waits for it to close (or die) first.
    if (r != e_.rank()) close_waits_ = true;
  }
  // Local copies (an all-to-all's chunk to itself, a staged message into
  // device memory) need a GPU transport of this rank, not a route: the one to
  // ourselves where there is one, else any that opened (say rdma-gpu on a rank
  // whose nvlink could not open). device_ordinal() >= 0 exactly when one is set.
  std::shared_ptr<Transport> local;
  const std::string& self = device_routes_[size_t(e_.rank())];
  if (!self.empty()) local = devices_.at(self);
  else if (!devices_.empty()) local = devices_.begin()->second;
  std::string why;
  for (auto& [name, note] : device_notes_) why += (why.empty() ? "" : "; ") + (name.empty() ? "" : name + ": ") + note;
  e_.set_local_device(local, why.empty() ? "no GPU transport opened" : why);
}

std::string Setup::describe(int peer) const {
  std::string d = e_.transport_describe(peer);
  if (find_transport(routes_.at(size_t(peer)))->last_resort) d += "; " + why_fallback_;
  const std::string& dev = device_routes_.at(size_t(peer));
  if (!dev.empty()) return d + "; GPU tensors: " + devices_.at(dev)->describe();
  const std::string& why = device_why_.at(size_t(peer));
  return why.empty() ? d : d + "; GPU tensors: staged through host memory: " + why;
}

std::map<std::string, std::string> Setup::route_info(int peer) const {
  auto info = e_.transport_properties(peer);
  info["route"] = routes_.at(size_t(peer));
  info["device_route"] = device_routes_.at(size_t(peer));
  return info;
}

}  // namespace varcomm
