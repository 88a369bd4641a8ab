#include "hostmem.h"

#include <sys/mman.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

namespace varcomm {
namespace {

// The state letter, and the start time through *start; empty when gone.
std::string proc_state(int pid, unsigned long long* start) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(f, line)) return "";
  auto close = line.rfind(')');  // the command name may contain spaces and ')'
  if (close == std::string::npos) return "";
  std::istringstream rest(line.substr(close + 2));
  std::string state, tok;
  rest >> state;
  for (int field = 4; field < 22 && rest >> tok; ++field) {
  }
  rest >> *start;
  return state;
}

}  // namespace

void advise_huge_pages(void* p, size_t n) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (n < kHugeAdviseMin) return;
  uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  uintptr_t e = (reinterpret_cast<uintptr_t>(p) + n) & ~(kHuge - 1);
  if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
}

unsigned long long process_start(int pid) {
  unsigned long long start = 0;
  proc_state(pid, &start);
  return start;
}

std::string process_exit_error(int peer, int pid, unsigned long long start) {
  unsigned long long now = 0;
  std::string st = proc_state(pid, &now);
  if (st.empty() || st == "Z" || st == "X" || now != start)
    return "rank " + std::to_string(peer) + " (pid " + std::to_string(pid) + ") has exited";
  return "";
}

std::string process_trust_error(int pid, unsigned long long start) {
  std::string who = "pid " + std::to_string(pid);
  unsigned long long now = 0;
  if (proc_state(pid, &now).empty()) return who + " does not exist";
  if (now != start)
    return who + " started at " + std::to_string(now) + " where the descriptor says " + std::to_string(start) +
           " (a recycled pid, or a descriptor that names another process)";
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(f, line);) {
    if (line.compare(0, 4, "Uid:") != 0) continue;
    std::istringstream in(line.substr(4));
    uid_t me = geteuid();
    long long u;
    for (int i = 0; i < 4 && in >> u; ++i)
      if (uid_t(u) != me)
        return who + " runs as uid " + std::to_string(u) + ", this rank as uid " + std::to_string(me) +
               ": refused (same-host ranks must run as the same user; a process of another user may have written "
               "this descriptor into the store)";
    return "";
  }
  return who + ": cannot read its owner from /proc/" + std::to_string(pid) + "/status";
}

}  // namespace varcomm
