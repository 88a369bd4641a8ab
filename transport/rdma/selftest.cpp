// Standalone test of the rdma transport (not part of the package): two forked
// ranks, descriptors exchanged over pipes, the protocol's own region layout.
//
//   g++ -std=c++17 -O2 -I csrc transport/rdma/selftest.cpp csrc/registry.cpp csrc/region.cpp
//       transport/rdma/rdma.cpp transport/rdma/fabric_lib.cpp $(pkg-config --cflags libfabric) -ldl -o /tmp/rdma_selftest
//   /tmp/rdma_selftest [--provider P] [--iface I] [--netns NS0,NS1 [--down "ip -n NS1 link set eth0 down"]]
//   /tmp/rdma_selftest --bench [--size B]... [--iters N]   ping-pong only, JSON lines like bench/varcomm_bench/fi_pingpong
//
// Checks: messages of many sizes land with header and payload intact and the
// ready word set from the completion; credits via write_u64; tickets complete;
// a peer that does not call progress for longer than the liveness timeout is
// not reported dead; then either kill -9 of the peer, or (with --down) a link
// taken down mid-stream, is reported by peer_error() within seconds on the
// survivor(s).
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "protocol.h"
#include "region.h"
#include "registry.h"

using namespace varcomm;
using Clock = std::chrono::steady_clock;

static double secs(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

#define REQUIRE(cond, ...)                                               \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "rank %d FAIL %s:%d: %s: ", g_rank, __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                      \
      fprintf(stderr, "\n");                                             \
      _exit(1);                                                          \
    }                                                                    \
  } while (0)

static int g_rank, g_iters;
static std::vector<size_t> g_sizes;
static int g_in, g_out;  // pipe to the other rank

static void say(const std::string& s) {
  std::string line = s + "\n";
  if (write(g_out, line.data(), line.size()) != ssize_t(line.size())) _exit(3);
}
static std::string hear() {
  std::string s;
  char c;
  while (read(g_in, &c, 1) == 1 && c != '\n') s += c;
  return s;
}

static uint8_t pattern(uint64_t seq, size_t i) { return uint8_t(seq * 131 + i * 7 + (i >> 12)); }

struct Rank {
  int rank, peer;
  Layout L;
  char* base;
  std::unique_ptr<Region> region;
  std::shared_ptr<Transport> t;
  std::vector<uint8_t> src;
  uint64_t next_seq = 1;   // next message we send
  uint64_t next_recv = 1;  // next message we expect

  uint64_t ready(int slot) { return __atomic_load_n((uint64_t*)(base + L.slot_off(peer, slot)), __ATOMIC_ACQUIRE); }
  uint64_t credit(int slot) { return __atomic_load_n((uint64_t*)(base + L.credit_off(peer, slot)), __ATOMIC_ACQUIRE); }

  // Sender: write message `seq` of n bytes into the peer's slot (seq-1) % nslots; waits for that slot's credit.
  uint64_t send(size_t n, Clock::time_point deadline, bool fill = true) {
    uint64_t seq = next_seq++;
    int slot = int((seq - 1) % L.nslots);
    uint64_t need = seq > uint64_t(L.nslots) ? seq - L.nslots : 0;
    while (credit(slot) != need) {
      t->progress();
      REQUIRE(Clock::now() < deadline, "no credit for slot %d (have %lu want %lu): %s", slot,
              (unsigned long)credit(slot), (unsigned long)need, t->peer_error(peer).c_str());
    }
    MsgHeader h{};
    h.seq = seq;
    h.nbytes = n;
    h.tag = int64_t(seq) * 3;
    h.ndim = 1;
    h.shape[0] = int64_t(n);
    if (fill)
      for (size_t i = 0; i < n; i++) src[i] = pattern(seq, i);
    uint64_t ticket;
    while (!(ticket = t->write_message(peer, L.slot_off(rank, slot), &h, sizeof h, src.data(), n, seq))) {
      t->progress();
      REQUIRE(Clock::now() < deadline, "write_message stuck: %s", t->peer_error(peer).c_str());
    }
    // src is reused by the next send: wait for the local completion.
    while (!t->complete(peer, ticket))
      REQUIRE(Clock::now() < deadline, "ticket %lu never completed", (unsigned long)ticket);
    return seq;
  }

  // Receiver: wait for the next message, check it, return its credit.
  void recv(size_t n, Clock::time_point deadline, bool check = true) {
    uint64_t seq = next_recv++;
    int slot = int((seq - 1) % L.nslots);
    while (ready(slot) != seq) {
      t->progress();
      REQUIRE(Clock::now() < deadline, "message %lu never landed (ready=%lu): %s", (unsigned long)seq,
              (unsigned long)ready(slot), t->peer_error(peer).c_str());
    }
    const char* s = base + L.slot_off(peer, slot);
    const auto* h = reinterpret_cast<const MsgHeader*>(s + kHeaderOff);
    REQUIRE(h->seq == seq && h->nbytes == n && h->tag == int64_t(seq) * 3 && h->shape[0] == int64_t(n),
            "bad header for %lu: seq %lu nbytes %lu", (unsigned long)seq, (unsigned long)h->seq,
            (unsigned long)h->nbytes);
    if (check)
      for (size_t i = 0; i < n; i++)
        REQUIRE(uint8_t(s[kPayloadOff + i]) == pattern(seq, i), "payload byte %zu of message %lu (%zu bytes)", i,
                (unsigned long)seq, n);
    t->write_u64(peer, L.credit_off(rank, slot), seq);
  }
};

static void pingpong(Rank& r, size_t n, int iters) {
  auto deadline = Clock::now() + std::chrono::seconds(120);
  int warm = iters / 10 + 2;
  Clock::time_point t0;
  for (int i = 0; i < warm + iters; i++) {
    if (i == warm) t0 = Clock::now();
    if (r.rank == 0) {
      r.send(n, deadline, false);
      r.recv(n, deadline, false);
    } else {
      r.recv(n, deadline, false);
      r.send(n, deadline, false);
    }
  }
  double lat = secs(t0) * 1e6 / iters / 2;
  if (r.rank == 0)
    printf("{\"transport\":\"rdma\",\"size\":%zu,\"iters\":%d,\"lat_us\":%.2f,\"gbps\":%.4f}\n", n, iters, lat,
           n / lat / 1e3);
  fflush(stdout);
}

static void stream_until_error(Rank& r, const std::string& down, double limit_s) {
  // Keep messages flowing (rank 0 -> rank 1) until peer_error() says why they cannot.
  auto t0 = Clock::now(), last_check = t0;
  Clock::time_point down_at{};
  uint64_t ticket = 0, sent = 0, got = 0, size = 65536;
  std::string err;
  while (err.empty()) {
    r.t->progress();
    if (r.rank == 0) {
      if (ticket && r.t->complete(r.peer, ticket)) ticket = 0;
      uint64_t seq = r.next_seq;
      int slot = int((seq - 1) % r.L.nslots);
      uint64_t need = seq > uint64_t(r.L.nslots) ? seq - r.L.nslots : 0;
      if (!ticket && r.credit(slot) == need) {
        MsgHeader h{};
        h.seq = seq;
        h.nbytes = size;
        if ((ticket = r.t->write_message(r.peer, r.L.slot_off(0, slot), &h, sizeof h, r.src.data(), size, seq)))
          sent++, r.next_seq++;
      }
      if (!down.empty() && down_at == Clock::time_point{} && secs(t0) > 1.0) {
        printf("# %lu messages streamed; now: %s\n", (unsigned long)sent, down.c_str());
        fflush(stdout);
        REQUIRE(system(down.c_str()) == 0, "%s failed", down.c_str());
        down_at = Clock::now();
      }
    } else {
      uint64_t seq = r.next_recv;
      int slot = int((seq - 1) % r.L.nslots);
      if (r.ready(slot) == seq) {
        got++, r.next_recv++;
        r.t->write_u64(r.peer, r.L.credit_off(1, slot), seq);
      }
    }
    if (secs(last_check) > 0.1) {
      last_check = Clock::now();
      err = r.t->peer_error(r.peer);
    }
    REQUIRE(secs(t0) < limit_s, "no error after %.1f s (sent %lu got %lu)", secs(t0), (unsigned long)sent,
            (unsigned long)got);
  }
  double since = down_at == Clock::time_point{} ? secs(t0) : secs(down_at);
  printf("PASS rank %d: link down detected after %.1f s (sent %lu, received %lu): %s\n", r.rank, since,
         (unsigned long)sent, (unsigned long)got, err.c_str());
  fflush(stdout);
}

static int run(int rank, pid_t child, const Options& opt, bool bench, const std::string& down) {
  g_rank = rank;
  Rank r;
  r.rank = rank;
  r.peer = 1 - rank;
  r.L.world = 2;
  r.L.nslots = 4;
  r.L.bound = 16 << 20;
  size_t total = r.L.total();
  r.region = std::make_unique<Region>(total);
  r.base = r.region->base();
  r.src.resize(r.L.bound);
  const TransportFactory* rdma = find_transport("rdma");
  REQUIRE(rdma, "rdma transport registered");
  r.t = rdma->make(TransportContext{rank, 2, *r.region, r.L, opt, /*any_remote=*/true});
  if (rank == 0) printf("# %s\n", r.t->describe().c_str());
  std::string mine = r.t->expose(r.base, total);
  say(mine);
  r.t->connect(r.peer, hear());
  r.t->connect(rank, mine);  // a rank may write to itself too
  say("connected");
  REQUIRE(hear() == "connected", "handshake");
  r.t->connected();
  REQUIRE(r.t->peer_error(r.peer).empty(), "fresh peer in error: %s", r.t->peer_error(r.peer).c_str());
  auto deadline = Clock::now() + std::chrono::seconds(120);

  if (bench) {  // only the benchmark: half round trips through write_message + progress + credits
    for (size_t n : g_sizes) {
      int iters = g_iters ? g_iters : int(std::max<size_t>(5, std::min<size_t>(2000, (256u << 20) / n)));
      say("go");
      REQUIRE(hear() == "go", "bench sync");
      pingpong(r, n, iters);
    }
    say("done");
    REQUIRE(hear() == "done", "bench end");
    return 0;
  }

  {  // loopback write into our own region
    MsgHeader h{};
    h.seq = 7;
    h.nbytes = 5;
    size_t off = r.L.slot_off(rank, 0);
    uint64_t tk;
    while (!(tk = r.t->write_message(rank, off, &h, sizeof h, "hello", 5, 7))) r.t->progress();
    while (__atomic_load_n((uint64_t*)(r.base + off), __ATOMIC_ACQUIRE) != 7) {
      r.t->progress();
      REQUIRE(Clock::now() < deadline, "self write never landed");
    }
    REQUIRE(memcmp(r.base + off + kPayloadOff, "hello", 5) == 0, "self payload");
    while (!r.t->complete(rank, tk)) {}
  }
  if (rank == 0) printf("PASS self write\n");

  // Every size class: empty, inline (copied with the header), around the staging limit, in place, the bound.
  const size_t sizes[] = {0, 1, 8, 100, 4096, 8000, 8001, 65536, 1 << 20, 3 << 20 | 17, 16 << 20};
  for (int sender = 0; sender < 2; sender++)
    for (int round = 0; round < 2; round++)
      for (size_t n : sizes) {
        if (rank == sender) r.send(n, deadline);
        else r.recv(n, deadline);
      }
  if (rank == 0) printf("PASS %zu messages each way, 0 B .. 16 MiB, payload and header checked, credits returned\n",
                        2 * sizeof sizes / sizeof *sizes);
  fflush(stdout);

  // A peer that is alive but busy (no progress calls) for longer than the liveness timeout is not dead.
  say("quiet");
  REQUIRE(hear() == "quiet", "sync");
  const int quiet_s = 7;
  if (rank == 1) {
    sleep(quiet_s);
  } else {
    auto t0 = Clock::now();
    while (secs(t0) < quiet_s) {
      std::string e = r.t->peer_error(r.peer);
      REQUIRE(e.empty(), "busy peer reported dead after %.1f s: %s", secs(t0), e.c_str());
      usleep(200000);
    }
    printf("PASS peer silent for %d s (no progress calls) is not reported dead\n", quiet_s);
    fflush(stdout);
  }
  say("failure");
  REQUIRE(hear() == "failure", "sync");

  if (!down.empty()) {
    stream_until_error(r, down, 30);
    return 0;
  }
  if (rank == 1) {
    for (;;) pause();  // wait to be killed
  }
  kill(child, SIGKILL);
  auto t0 = Clock::now();
  std::string e;
  while ((e = r.t->peer_error(r.peer)).empty()) {
    r.t->progress();
    REQUIRE(secs(t0) < 10, "kill -9 of the peer not detected within 10 s");
    usleep(100000);
  }
  printf("PASS kill -9 of the peer detected after %.2f s: %s\n", secs(t0), e.c_str());
  // Writes to a dead peer must not hang or crash.
  MsgHeader h{};
  h.seq = 99;
  uint64_t tk = r.t->write_message(r.peer, r.L.slot_off(0, 0), &h, sizeof h, nullptr, 0, 99);
  r.t->write_u64(r.peer, r.L.credit_off(0, 0), 1);
  for (int i = 0; i < 100; i++) r.t->progress();
  printf("PASS writes after the failure return (ticket %lu)\n", (unsigned long)tk);
  int st;
  waitpid(child, &st, 0);
  return 0;
}

static void enter_netns(const std::string& ns) {
  if (ns.empty()) return;
  int fd = open(("/var/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) {
    perror(("setns " + ns).c_str());
    _exit(2);
  }
  close(fd);
}

int main(int argc, char** argv) {
  std::string down, ns[2];
  Options opt;
  bool bench = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--provider") opt.rdma_provider = next();
    else if (a == "--iface") opt.rdma_iface = next();
    else if (a == "--strict") opt.rdma_strict = true;
    else if (a == "--bench") bench = true;
    else if (a == "--iters") g_iters = atoi(next().c_str());
    else if (a == "--size") g_sizes.push_back(strtoull(next().c_str(), nullptr, 0));
    else if (a == "--down") down = next();
    else if (a == "--netns") {
      std::string v = next();
      size_t c = v.find(',');
      ns[0] = v.substr(0, c);
      ns[1] = c == std::string::npos ? "" : v.substr(c + 1);
    } else {
      fprintf(stderr, "usage: %s [--provider P] [--iface I] [--strict] [--bench [--size B]... [--iters N]] [--netns A,B] "
                      "[--down CMD]\n", argv[0]);
      return 2;
    }
  }
  if (g_sizes.empty()) g_sizes = {8, 65536, 1 << 20, 16 << 20};
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int a[2], b[2];
  if (pipe(a) || pipe(b)) return 1;
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive rank 0
    enter_netns(ns[1]);
    g_in = a[0], g_out = b[1];
    try {
      _exit(run(1, 0, opt, bench, down));
    } catch (const std::exception& e) {
      fprintf(stderr, "rank 1: %s\n", e.what());
      _exit(1);
    }
  }
  enter_netns(ns[0]);
  g_in = b[0], g_out = a[1];
  int rc;
  try {
    rc = run(0, pid, opt, bench, down);
  } catch (const std::exception& e) {
    fprintf(stderr, "rank 0: %s\n", e.what());
    kill(pid, SIGKILL);
    return 1;
  }
  int st = 0;
  if (!down.empty() || bench) {
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  printf(rc ? "FAILED\n" : "ALL PASSED\n");
  return rc;
}
