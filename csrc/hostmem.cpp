#include "hostmem.h"

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

}  // namespace varcomm
